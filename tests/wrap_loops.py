"""The fp32-style loops ``scaler.wrap()`` is compared in, each also written with a scaler's
calls in, as torch's documentation writes them.

``train(...)`` runs one loop either way: ``wrapped=True`` is the loop as written for fp32
(``loss.backward()``, clipping, ``optimizer.step()``) under ``ampscaler.GradScaler.wrap``;
``wrapped=False`` is the same loop with ``scale()``/``unscale_()``/``step()``/``update()`` of
the given torch scaler written in. ``engine=True`` is the shape of verl's FSDP engine: it
skips ``optimizer.step()`` itself when the clipped norm is not finite, and steps an LR
scheduler every iteration. The scale is read after each iteration's ``zero_grad()`` (where a
loop that skipped its step has counted the skip) and once more at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import ampscaler

SCALER_KWARGS: dict[str, Any] = {"init_scale": 2.0**16, "growth_interval": 3}
#: step -> what goes wrong in its last micro-batch: an inf or a NaN in the input, or an input
#: target far enough off that the *scaled* gradients overflow in fp16 while the loss stays finite.
FAULTS = {2: "inf", 5: "huge", 6: "huge", 9: "nan", 13: "huge"}


class Mlp(torch.nn.Sequential):
    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


class TinyTransformer(torch.nn.Module):
    """One encoder layer and a head: attention, layer norms, GELU, 14 parameter tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layer = torch.nn.TransformerEncoderLayer(
            16, 2, dim_feedforward=32, dropout=0.0, batch_first=True, activation="gelu"
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x.view(x.shape[0], 1, 8)))).squeeze(1)


def batch(step: int, micro: int, rank: int, fault: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    if fault == "inf":
        x[0, 0] = float("inf")
    elif fault == "nan":
        x[0, 0] = float("nan")
    elif fault == "huge":
        y = y * 1e4
    return x, y


@dataclass
class Run:
    """What a loop saw: per iteration the scale (after its zero_grad) and the clipped norm;
    the parameters at the end (full tensors)."""

    scales: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    metrics: dict[str, float | int] = field(default_factory=dict)

    def same_as(self, other: Run) -> bool:
        """Bit for bit: scales, norms (NaN as NaN), learning rates and parameters."""
        norms = [str(a) == str(b) for a, b in zip(self.norms, other.norms, strict=True)]
        return (
            self.scales == other.scales
            and all(norms)
            and self.lrs == other.lrs
            and all(torch.equal(a, b) for a, b in zip(self.params, other.params, strict=True))
        )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _norm(value: torch.Tensor) -> float:
    return float(_full(value))


def train(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    scaler: Any,
    *,
    wrapped: bool,
    steps: int = 16,
    start: int = 0,
    accumulation: int = 1,
    faults: Mapping[int, str] = FAULTS,
    fault_ranks: tuple[int, ...] = (0,),
    rank: int = 0,
    engine: bool = False,
    sync: Callable[[bool], contextlib.AbstractContextManager[Any]] | None = None,
) -> Run:
    """One of the loops (module docstring), from step ``start`` (a resumed run) to ``steps``.
    ``sync(last_micro_batch)``: a context for each micro-batch's backward (DDP's ``no_sync``,
    FSDP2's gradient sync switch)."""
    if wrapped:
        scaler.wrap(model, *optimizers)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5) for opt in optimizers]
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    run = Run()
    for step in range(start, steps):
        for opt in optimizers:
            opt.zero_grad()
        run.scales.append(scaler.get_scale())
        for micro in range(accumulation):
            last = micro == accumulation - 1
            fault = faults.get(step) if last and rank in fault_ranks else None
            x, y = batch(step, micro, rank, fault)
            with sync(last) if sync is not None else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = ((out.float() - y) ** 2).mean() / accumulation
                (loss if wrapped else scaler.scale(loss)).backward()
        if not wrapped:
            for opt in optimizers:
                scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        run.norms.append(_norm(norm))
        if not (engine and not torch.isfinite(_full(norm))):
            for opt in optimizers:
                opt.step() if wrapped else scaler.step(opt)
        if not wrapped:
            scaler.update()
        if engine:
            for scheduler in schedulers:
                scheduler.step()
        run.lrs.append(optimizers[0].param_groups[0]["lr"])
    for opt in optimizers:
        opt.zero_grad()
    run.scales.append(scaler.get_scale())
    run.params = [_full(p) for p in model.parameters()]
    run.metrics = scaler.metrics() if hasattr(scaler, "metrics") else {}
    return run


def adamw(model: torch.nn.Module, **kwargs: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)]


def side_by_side(
    make_model: Callable[[], torch.nn.Module],
    make_optimizers: Callable[[torch.nn.Module], list[torch.optim.Optimizer]] = adamw,
    make_torch_scaler: Callable[[], Any] = lambda: torch.amp.GradScaler("cpu", **SCALER_KWARGS),
    make_scaler: Callable[[], ampscaler.GradScaler] = lambda: ampscaler.GradScaler(
        "cpu", **SCALER_KWARGS
    ),
    **loop: Any,
) -> tuple[Run, Run]:
    """The loop with torch's scaler written in, then wrapped with ampscaler's: (torch, wrap)."""
    runs = []
    for wrapped in (False, True):
        torch.manual_seed(0)
        model = make_model()
        scaler = make_scaler() if wrapped else make_torch_scaler()
        runs.append(train(model, make_optimizers(model), scaler, wrapped=wrapped, **loop))
    return runs[0], runs[1]
