"""A policy written outside the package, as a user would write one (tests/test_user_policy.py).

It halves the scale on an overflow, doubles it after ``interval`` clean steps (never above
``ceiling``), and counts the overflows in a state tensor of its own, which checkpoints must carry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch

import ampscaler
from ampscaler.policy import PolicyState


class CountingState(NamedTuple):
    scale: torch.Tensor
    growth_tracker: torch.Tensor
    overflows: torch.Tensor  # int64: overflows so far


@dataclass(frozen=True)
class HalveOrDouble(ampscaler.Policy):
    """Halve on an overflow; double after ``interval`` clean steps, up to ``ceiling``."""

    interval: int = 3
    ceiling: float = 2.0**20

    def initial_state(
        self, scale: float, device: torch.device, values: Mapping[str, Any] | None = None
    ) -> CountingState:
        values = values or {}
        return CountingState(
            torch.full((), scale, dtype=torch.float32, device=device),
            torch.full((), values.get("growth_tracker", 0), dtype=torch.int32, device=device),
            torch.full((), values.get("overflows", 0), dtype=torch.int64, device=device),
        )

    def own_values(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        overflows = saved.get("overflows")
        if isinstance(overflows, bool) or not isinstance(overflows, int) or overflows < 0:
            raise ampscaler.InvalidConfigError(f"overflows must be an int >= 0, got {overflows!r}.")
        return {"overflows": overflows}

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        live = cast(CountingState, state)
        overflow = found_inf > 0
        clean = torch.where(overflow, 0, live.growth_tracker + 1)
        grow = clean >= self.interval
        factor = torch.where(overflow, 0.5, torch.where(grow, 2.0, 1.0))
        live.scale.copy_(torch.clamp(live.scale * factor, max=self.ceiling))
        live.growth_tracker.copy_(torch.where(grow, 0, clean))
        live.overflows.add_(overflow.to(torch.int64))


def reference_scales(
    init: float, overflows: list[bool], interval: int, ceiling: float
) -> list[float]:
    """The scale after each update, by the rule in plain Python."""
    scale, clean, scales = init, 0, []
    for overflow in overflows:
        if overflow:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean >= interval:
                scale, clean = min(scale * 2, ceiling), 0
        scales.append(scale)
    return scales
