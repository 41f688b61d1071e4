"""torch's dynamic rule with hysteresis and bounds (:class:`ScalePolicy`), and a fixed scale
(:class:`StaticPolicy`).

The whole dynamic algorithm, for one call of :meth:`ScalePolicy.adjust` with
``overflow = found_inf > 0``::

    if overflow:
        growth_tracker = 0
        hysteresis_left = max(hysteresis_left - 1, 0)
        if hysteresis_left == 0:
            scale = max(scale * backoff_factor, min_scale, 2**-126)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_left = hysteresis
            grown = min(scale * growth_factor, max_scale)
            if isfinite(grown):
                scale = grown

With ``hysteresis=1`` and no bounds this is exactly ``torch._amp_update_scale_``, including its
rounding: products are rounded once to the float32 scale, as torch's kernel does. One difference
is on purpose: the scale never backs off below ``2**-126``, float32's smallest normal number,
where torch's goes on into values whose reciprocal is inexact or infinite (and then unscales
finite gradients into inf/NaN without a skip; docs/migration.md). The transition is written
with ``torch.where`` so it runs on the device and never waits for it.

Example:
    >>> import torch
    >>> policy = ScalePolicy(growth_interval=2, hysteresis=2)
    >>> state = policy.initial_state(1024.0, torch.device("cpu"))
    >>> state = policy.adjust(state, torch.tensor(1.0))   # first overflow: budget absorbs it
    >>> state.scale.item()
    1024.0
    >>> state = policy.adjust(state, torch.tensor(1.0))   # second overflow: back off
    >>> state.scale.item()
    512.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .base import (
    LOWEST_SCALE,
    Policy,
    PolicyState,
    PowerOfTwo,
    adjusted,
    check_bounds,
    check_number,
    check_scale,
    check_switch,
    float32_value,
    pow2_exponent,
    require_int,
    require_state,
)

__all__ = ["INT32_MAX", "ScalePolicy", "ScaleState", "StaticPolicy"]

INT32_MAX = 2**31 - 1
"""The largest growth interval or hysteresis: their counters are int32 tensors, as torch's
growth tracker is."""


class ScaleState(NamedTuple):
    """:class:`ScalePolicy`'s moving parts, as 0-dim tensors on the scale's device.

    Attributes:
        scale: float32, the current loss scale.
        growth_tracker: int32, clean steps in a row since the last growth or overflow.
        hysteresis_left: int32, overflows still absorbed before the next backoff.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor


def _times(scale: torch.Tensor, factor: float) -> torch.Tensor:
    """``scale * factor`` rounded once to float32, as torch's kernel forms it: a power-of-two
    factor multiplies exactly in float32 (no float64 needed: devices without it work); any
    other is multiplied in float64 first."""
    if pow2_exponent(factor) is not None:
        return scale * factor
    return (scale.double() * factor).float()


@dataclass(frozen=True)
class ScalePolicy(Policy):
    """The dynamic rule: back off after overflows, grow after a run of clean steps.

    Python numbers only (numpy scalars and one-element tensors are taken as their values);
    validated on construction.

    Args:
        growth_factor: multiplies the scale after ``growth_interval`` clean steps; > 1.
        backoff_factor: multiplies the scale after an overflow that exhausts the hysteresis
            budget; in (0, 1).
        growth_interval: clean steps in a row needed to grow the scale; in [1, 2**31 - 1]
            (the growth tracker is an int32, as torch's is).
        hysteresis: overflows absorbed before the scale backs off (``1`` backs off at every
            overflow, as torch does); refilled whenever the scale grows; in [1, 2**31 - 1].
        min_scale: the scale never backs off below this; ``None`` for no bound (the scale still
            stops at ``2**-126``, where unscaling stops being exact).
        max_scale: the scale never grows above this; ``None`` for no bound (growth still stops
            short of float32 infinity). Both bounds apply as float32, the scale's type: a bound
            that float32 cannot hold exactly is rounded to the nearest float32 first.
        backoff_on_nonfinite_loss: ``True`` (torch's rule): an iteration whose loss was already
            inf/NaN before scaling backs the scale off like any overflow. ``False``: it leaves
            the scale, the growth tracker and the hysteresis budget as they were (a lower scale
            cannot help such a step; the step is still skipped and counted).

    Raises:
        InvalidConfigError: (a ``ValueError``) naming the argument and its allowed range.

    Example:
        >>> ScalePolicy(hysteresis=2, min_scale=1.0)  # doctest: +NORMALIZE_WHITESPACE
        ScalePolicy(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=2,
                    min_scale=1.0, max_scale=None, backoff_on_nonfinite_loss=True)
    """

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    backoff_on_nonfinite_loss: bool = True

    _torch_kernel: ClassVar[bool]  # set per instance by __post_init__

    def __post_init__(self) -> None:
        growth = check_number(
            "growth_factor", self.growth_factor, lambda g: 1 < g < math.inf, "a finite number > 1.0"
        )
        within = "in the open interval (0, 1)"
        backoff = check_number("backoff_factor", self.backoff_factor, lambda b: 0 < b < 1, within)
        interval = require_int("growth_interval", self.growth_interval, 1, INT32_MAX)
        hysteresis = require_int("hysteresis", self.hysteresis, 1, INT32_MAX)
        bounds = [self._bound(name) for name in ("min_scale", "max_scale")]
        check_bounds(self, *bounds)
        backoff_on_loss = check_switch("backoff_on_nonfinite_loss", self.backoff_on_nonfinite_loss)
        values = (growth, backoff, interval, hysteresis, *bounds, backoff_on_loss)
        for field, value in zip(dataclasses.fields(self), values, strict=True):
            object.__setattr__(self, field.name, value)  # plain Python numbers from here on
        # Whether this is torch's own rule, which torch's fused kernel applies (asked at every
        # update: kept, not computed).
        object.__setattr__(self, "_torch_kernel", hysteresis == 1 and bounds == [None, None])

    @property
    def holds_on_nonfinite_loss(self) -> bool:
        """``not backoff_on_nonfinite_loss``."""
        return not self.backoff_on_nonfinite_loss

    def _bound(self, name: str) -> float | None:
        bound = getattr(self, name)
        if bound is None:
            return None
        must = "a number > 0 that is finite as a float32, or None"
        return check_number(name, bound, lambda value: 0.0 < float32_value(value) < math.inf, must)

    # ------------------------------------------------------------------ state and transition

    def initial_state(
        self, scale: float, device: torch.device, values: Mapping[str, Any] | None = None
    ) -> ScaleState:
        """Fresh state on ``device`` (a full hysteresis budget), or the saved ``values``."""
        basic = super().initial_state(scale, device, values)
        budget = int((values or {}).get("hysteresis_left", self.hysteresis))
        budget_tensor = torch.full((), budget, dtype=torch.int32, device=device)
        return ScaleState(basic.scale, basic.growth_tracker, budget_tensor)

    def adjust(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> ScaleState:
        """The state after one step whose gradients were non-finite iff ``found_inf > 0``.

        Pure (the input state is not modified) and free of host syncs. ``found_inf`` is a 0-dim
        float tensor on the state's device holding a count of non-finite checks (``>= 0``), as
        the gradient check produces it. ``measured`` is not used. The scale it returns is at
        least ``2**-126``, as the pseudo-code says (:meth:`update_` leaves that clamp to the
        scaler, which holds every policy's scale there).

        This is :meth:`update_` run on copies of the state (:func:`~ampscaler.policy.adjusted`),
        then the floor: with torch's rule (``hysteresis=1``, no bounds) and a float32
        ``found_inf``, torch's own fused kernel ``torch._amp_update_scale_``, with the same
        results as the branch-free rule.
        """
        moved = adjusted(self, require_state(ScaleState, state, "ScalePolicy"), found_inf)
        moved.scale.clamp_(min=LOWEST_SCALE)
        return moved

    def _moved(self, live: ScaleState, found_inf: torch.Tensor) -> ScaleState:
        """The rule written with ``torch.where``, without the floor at ``2**-126`` (which
        :meth:`adjust` adds and :meth:`update_` leaves to the scaler)."""
        overflow = found_inf > 0
        zero = torch.zeros((), dtype=torch.int32, device=live.scale.device)

        counted = torch.where(overflow, zero, live.growth_tracker + 1)
        grow = counted == self.growth_interval
        growth_tracker = torch.where(grow, zero, counted)

        if self.hysteresis == 1:
            # Every overflow backs off and the budget is always full: skip its bookkeeping.
            hysteresis_left = live.hysteresis_left
            backoff = overflow
        else:
            spent = torch.clamp_min(live.hysteresis_left - 1, 0)
            refilled = torch.full_like(live.hysteresis_left, self.hysteresis)
            hysteresis_left = torch.where(
                overflow, spent, torch.where(grow, refilled, live.hysteresis_left)
            )
            backoff = overflow & (hysteresis_left == 0)

        grown = _times(live.scale, self.growth_factor)
        if self.max_scale is not None:
            grown = torch.clamp_max(grown, self.max_scale)
        shrunk = _times(live.scale, self.backoff_factor)
        if self.min_scale is not None:
            shrunk = torch.clamp_min(shrunk, self.min_scale)

        scale = torch.where(grow & torch.isfinite(grown), grown, live.scale)
        scale = torch.where(backoff, shrunk, scale)
        return ScaleState(scale, growth_tracker, hysteresis_left)

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Apply the rule to ``state`` in place: its tensors keep their identity.

        With torch's rule this is one call of torch's fused kernel on the live tensors. Either
        way the scaler then holds the scale at or above ``2**-126`` (one clamp, whatever the
        policy). No host sync.
        """
        if self._torch_kernel and found_inf.dtype == torch.float32:
            torch._amp_update_scale_(
                state.scale,
                state.growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
            return
        live = require_state(ScaleState, state, "ScalePolicy")
        for tensor, value in zip(live, self._moved(live, found_inf), strict=True):
            if value is not tensor:
                tensor.copy_(value)

    # ------------------------------------------------------------------ values

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value (``init_scale``, ``new_scale``, a loaded one) for this policy.

        The scale is a float32, so the value and the bounds are compared as float32: every
        value this policy produces passes. Returns the value as a float, or raises
        :class:`InvalidConfigError` naming ``name`` and the allowed range.
        """
        return check_scale(name, scale, self.min_scale, self.max_scale)

    @property
    def power_of_two(self) -> PowerOfTwo | None:
        """Powers of two stay powers of two when both factors and both bounds are ones."""
        bounds = (self.min_scale, self.max_scale)
        exponents = [pow2_exponent(float32_value(b)) for b in bounds if b is not None]
        backoff = pow2_exponent(self.backoff_factor)
        if backoff is None or pow2_exponent(self.growth_factor) is None or None in exponents:
            return None
        floor = None if self.min_scale is None else exponents[0]  # min_scale's comes first
        return PowerOfTwo(drop=-backoff, floor=floor)


@dataclass(frozen=True)
class StaticPolicy(Policy):
    """A scale that never moves: steps with inf/NaN gradients are still skipped.

    The scale is the scaler's ``init_scale`` (or one set with ``update(new_scale)`` or loaded
    from a checkpoint). Useful when a good scale is known, or to rule the scaler out while
    debugging a run.

    Example:
        >>> import torch
        >>> from ampscaler import GradScaler
        >>> scaler = GradScaler("cpu", init_scale=128.0, policy=StaticPolicy())
        >>> scaler.policy
        StaticPolicy()
    """

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Nothing moves."""

    def adjust(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> PolicyState:
        """``state`` unchanged, whatever ``found_inf`` says."""
        return state

    @property
    def power_of_two(self) -> PowerOfTwo:
        """The scale never moves: whatever it is, it stays."""
        return PowerOfTwo(drop=0, floor=None)
