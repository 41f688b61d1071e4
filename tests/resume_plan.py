"""One training run, replayable from any iteration: the plan behind the resume tests.

Every case trains the same small model, whose output is cast to float16, for ``STEPS``
iterations with overflows of every kind injected before and after the checkpoints: inf, -inf
and NaN written into gradients, and a loss so large that the float16 backward overflows. (No
autocast: float16 matrix products on a busy CPU cost milliseconds each; the cast is enough.)
Data depend only on the iteration number, so a run restored from a checkpoint at iteration
``k`` sees what the uninterrupted run saw.

``Record`` is what one iteration leaves behind, as plain values (parameters as raw bytes), so
two runs agree bit for bit exactly when their records are equal.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

import ampscaler

STEPS = 12
CHECKPOINTS = (2, 6, 9)
INF = float("inf")

# iteration -> ("grad", parameter name, value) or ("loss", factor, None). Each checkpoint falls
# between two overflows in a row, so hysteresis budgets and skip counts cross it.
FAULTS: dict[int, tuple[str, Any, float | None]] = {
    1: ("grad", "0.weight", INF),
    2: ("loss", 1e6, None),
    5: ("grad", "2.bias", float("nan")),
    6: ("grad", "2.weight", -INF),
    8: ("loss", 1e6, None),
    9: ("grad", "0.bias", float("nan")),
}

_BASE = {"init_scale": 2.0**11, "growth_interval": 2}
_ALL = {"hysteresis": 2, "min_scale": 2.0**9, "max_scale": 2.0**12, "max_consecutive_skips": 2}


@dataclass(frozen=True)
class Case:
    """A scaler configuration and optimizer to run the plan with."""

    name: str
    scaler_kwargs: dict[str, Any]
    fused: bool = False


CASES = (
    Case("torch-options", {"growth_factor": 3.0, "backoff_factor": 0.25}),
    Case("hysteresis", {"hysteresis": 3}),
    Case("min-scale", {"min_scale": 2.0**10}),
    Case("max-scale", {"max_scale": 2.0**11, "backoff_factor": 0.9}),
    Case("static", {"policy": ampscaler.StaticPolicy()}),
    Case("max-consecutive-skips", {"max_consecutive_skips": 2}),
    Case("every-option", _ALL),
    Case("fused-adam", {}, fused=True),
    Case("fused-adam-every-option", _ALL, fused=True),
)


@dataclass(frozen=True)
class Record:
    """What one iteration left behind."""

    scale: float
    state: tuple[tuple[str, Any], ...]
    skipped: bool
    raised: bool
    params: tuple[bytes, ...]


@dataclass
class Run:
    """A model, its optimizer and its scaler, at some iteration of the plan."""

    case: Case
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: ampscaler.GradScaler


def build(case: Case, scaler_kwargs: dict[str, Any] | None = None) -> Run:
    """A fresh run at iteration 0 (the scaler built from ``scaler_kwargs`` when given)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=case.fused)
    # A policy object takes no rule arguments beside it: only the base's scale then.
    base = {"init_scale": _BASE["init_scale"]} if "policy" in case.scaler_kwargs else _BASE
    kwargs = {**base, **case.scaler_kwargs} if scaler_kwargs is None else scaler_kwargs
    return Run(case, model, optimizer, ampscaler.GradScaler("cpu", **kwargs))


def play(run: Run, iterations: range) -> list[Record]:
    """Train ``run`` through ``iterations``; one record per iteration.

    Works with ``torch.amp.GradScaler`` too (its records say ``skipped=False``).
    """
    records = []
    params = dict(run.model.named_parameters())
    for iteration in iterations:
        data = torch.Generator().manual_seed(iteration)
        inputs, target = torch.randn(8, 6, generator=data), torch.randn(8, 1, generator=data)
        kind, what, value = FAULTS.get(iteration, ("none", None, None))
        out = run.model(inputs).half()  # its gradient passes through float16
        loss = (out.float() - target).pow(2).mean() * (what if kind == "loss" else 1.0)
        run.scaler.scale(loss).backward()
        if kind == "grad":
            params[what].grad.view(-1)[iteration % params[what].numel()] = value
        run.scaler.step(run.optimizer)
        raised = False
        try:
            run.scaler.update()
        except ampscaler.PersistentOverflowError:
            raised = True
        run.optimizer.zero_grad()
        state = run.scaler.state_dict()
        records.append(
            Record(
                scale=state.pop("scale"),
                state=tuple(sorted((k, repr(v)) for k, v in state.items())),
                skipped=getattr(run.scaler, "last_step_skipped", False),
                raised=raised,
                params=tuple(p.detach().numpy().tobytes() for p in run.model.parameters()),
            )
        )
    return records


def checkpoint(run: Run) -> dict[str, Any]:
    """The state a training script saves: model, optimizer and scaler."""
    return {
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scaler": run.scaler.state_dict(),
    }


def restore(case: Case, saved: dict[str, Any], scaler_kwargs: dict[str, Any] | None = None) -> Run:
    """A fresh run loaded from ``saved`` (a checkpoint as returned by ``torch.load``)."""
    run = build(case, scaler_kwargs)
    run.model.load_state_dict(saved["model"])
    run.optimizer.load_state_dict(saved["optimizer"])
    run.scaler.load_state_dict(saved["scaler"])
    return run


def through_bytes(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` after ``torch.save`` and ``torch.load`` (with torch's default, weights only)."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return torch.load(buffer)
