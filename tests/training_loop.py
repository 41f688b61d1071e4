"""A tiny fp16-autocast training loop shared by the diagnostics tests.

``run_loop`` trains ``Net`` with a scaler for a few iterations; ``poison`` maps iteration ->
``{parameter name: value}`` written into one element of that parameter's gradient after
backward, which is how the tests make chosen parameters overflow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Net(torch.nn.Module):
    """Two dense layers and a head; parameter names: body.0.*, body.2.*, head.*."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def run_loop(
    scaler: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    poison: dict[int, dict[str, float]] | None = None,
    after_update: Callable[[int], None] | None = None,
    seed: int = 0,
) -> None:
    """Train ``steps`` iterations; ``after_update(i)`` runs after update(), before zero_grad()."""
    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for i in range(steps):
        x = torch.randn(16, 8, generator=generator)
        y = torch.randn(16, 1, generator=generator)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ((model(x).float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        for name, value in (poison or {}).get(i, {}).items():
            grad = params[name].grad
            assert grad is not None
            grad.view(-1)[0] = value
        scaler.step(optimizer)
        scaler.update()
        if after_update is not None:
            after_update(i)
        optimizer.zero_grad()
