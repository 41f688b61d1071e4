"""Patch settings that observe every scaler an engine builds, for the engine tests: a user's
policy, step records kept in memory, a collapse watch with a short window, and its alerts."""

from __future__ import annotations

from typing import Any

import ampscaler
from ampscaler import CollapseAlert, CollapseWatch, GradScaler, StepHistory

#: The collapse alerts of the scalers configured by :func:`observed`, in this process.
ALERTS: list[CollapseAlert] = []
#: The step histories given to them, the latest last.
HISTORIES: list[StepHistory] = []


def _observe(scaler: GradScaler) -> None:
    HISTORIES.append(scaler.add_sink(StepHistory(100)))
    scaler.attach(CollapseWatch(skip_rate=0.5, window=10))
    scaler.on("collapse", ALERTS.append)


def observed(policy: ampscaler.Policy) -> dict[str, Any]:
    """``patch_megatron``/``patch_deepspeed`` settings: ``policy``, and the observers above."""
    return {"policy": policy, "configure": _observe}


def seen(scaler: GradScaler) -> dict[str, Any]:
    """What a test asserts on of ``scaler``, the latest one configured, at the end of a run
    (picklable)."""
    return {
        "metrics": scaler.metrics(),
        "history": [(record.skipped, record.new_scale) for record in HISTORIES[-1].records],
        "alerts": [alert.reasons for alert in ALERTS],
    }


def user_policy_scales(skipped: list[bool], init: float, interval: int) -> list[float]:
    """tests/user_policy.py's HalveOrDouble, in plain Python: the scale after each step."""
    scale, clean, scales = init, 0, []
    for skip in skipped:
        clean = 0 if skip else clean + 1
        if skip:
            scale /= 2
        elif clean >= interval:
            scale, clean = scale * 2, 0
        scales.append(scale)
    return scales
