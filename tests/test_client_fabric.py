"""Lightning Fabric with a custom scaler: torch's and ampscaler's give the same training.

Fabric takes a scaler through ``MixedPrecision("16-mixed", "cpu", scaler=...)`` and uses it in
``fabric.backward`` (scale), ``fabric.clip_gradients`` (unscale_) and the wrapped optimizer's
``step`` (step and update). The initial scale overflows at first, so steps are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision

import ampscaler


def train(factory: Any) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    scaler = factory("cpu", init_scale=2.0**20, growth_interval=2)
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    scales = []
    for _ in range(10):
        inputs, targets = torch.randn(4, 8, generator=data), torch.randn(4, 1, generator=data)
        fabric.backward(torch.nn.functional.mse_loss(model(inputs).float(), targets))
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


def test_fabric_trains_the_same_with_either_scaler() -> None:
    their_scales, theirs = train(torch.amp.GradScaler)
    our_scales, ours = train(ampscaler.GradScaler)
    assert our_scales == their_scales
    assert min(their_scales) < 2.0**20 and max(their_scales) > min(their_scales)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
