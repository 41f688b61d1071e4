"""How the loss scale moves: a configuration and a pure, branch-free state transition.

A policy is a small immutable value: :class:`ScalePolicy` (the dynamic rule),
:class:`StaticPolicy` (the scale never moves), or :class:`HeadroomPolicy` (the scale set from
measured gradient magnitudes, with the dynamic rule as its safety net), by type rather than by
flag. The whole dynamic algorithm, for one call of :meth:`ScalePolicy.adjust` with
``overflow = found_inf > 0``::

    if overflow:
        growth_tracker = 0
        hysteresis_left = max(hysteresis_left - 1, 0)
        if hysteresis_left == 0:
            scale = max(scale * backoff_factor, min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_left = hysteresis
            grown = min(scale * growth_factor, max_scale)
            if isfinite(grown):
                scale = grown

With ``hysteresis=1`` and no bounds this is exactly ``torch._amp_update_scale_``, including its
rounding: products are formed in float64 and rounded once to the float32 scale, as torch's kernel
does. The transition is written with ``torch.where`` so it runs on the device and never waits for
it. Nothing here knows about optimizers or gradients, so the policy is testable on its own.

:meth:`~ScalePolicy.adjust` is pure (it returns a new state); :meth:`~ScalePolicy.update_` applies
the same transition to a live state in place (``copy_``), so a compiled graph or a CUDA graph that
captured the scale tensor reads the new value.

Example:
    >>> import torch
    >>> from ampscaler.policy import ScalePolicy, initial_state
    >>> policy = ScalePolicy(growth_interval=2, hysteresis=2)
    >>> state = initial_state(policy, 1024.0, torch.device("cpu"))
    >>> state = policy.adjust(state, torch.tensor(1.0))   # first overflow: budget absorbs it
    >>> state.scale.item()
    1024.0
    >>> state = policy.adjust(state, torch.tensor(1.0))   # second overflow: back off
    >>> state.scale.item()
    512.0
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from .errors import InvalidConfigError

__all__ = [
    "FP16_MAX",
    "HeadroomPolicy",
    "HeadroomState",
    "Policy",
    "PolicyState",
    "ScalePolicy",
    "ScaleState",
    "StaticPolicy",
    "float32_value",
    "initial_state",
    "policy_from_arguments",
    "pow2_exponent",
    "starting_scale",
    "torch_rule",
]

FP16_MAX = 65504.0
"""The largest finite float16 value: a gradient beyond it overflows to inf."""


def _require_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfigError(f"{name} must be a real number, got {value!r}.")
    return float(value)


def float32_value(value: float) -> float:
    """``value`` as the float32 the scale tensor holds (``inf`` beyond float32's range)."""
    return float(torch.tensor(value, dtype=torch.float64).float())


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{name} must be an int >= {minimum}, got {value!r}.")
    if value < minimum:
        raise InvalidConfigError(f"{name} must be >= {minimum}, got {value}.")
    return value


def _check_scale(
    name: str, scale: object, min_scale: float | None = None, max_scale: float | None = None
) -> float:
    """``scale`` as a float if float32 holds it finite, > 0 and within the bounds."""
    value = _require_number(name, scale)
    stored = float32_value(value)
    low = 0.0 if min_scale is None else float32_value(min_scale)
    high = math.inf if max_scale is None else float32_value(max_scale)
    if not (math.isfinite(stored) and stored > 0.0 and low <= stored <= high):
        within = (
            ""
            if min_scale is None and max_scale is None
            else f" and within [min_scale, max_scale] = [{min_scale or 0}, "
            f"{max_scale or math.inf}]"
        )
        raise InvalidConfigError(
            f"{name} must be a number > 0 that is finite as a float32{within}, got {scale!r}."
        )
    return value


class ScaleState(NamedTuple):
    """The policy's moving parts, as 0-dim tensors on the scale's device.

    Attributes:
        scale: float32, the current loss scale.
        growth_tracker: int32, clean steps in a row since the last growth or overflow.
        hysteresis_left: int32, overflows still absorbed before the next backoff.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor


def _copy_into_(live: PolicyState, new: PolicyState) -> None:
    for target, value in zip(live, new, strict=True):
        if value is not target:
            target.copy_(value)


@dataclass(frozen=True)
class ScalePolicy:
    """The dynamic rule: back off after overflows, grow after a run of clean steps.

    Python numbers only; validated on construction.

    Args:
        growth_factor: multiplies the scale after ``growth_interval`` clean steps; > 1.
        backoff_factor: multiplies the scale after an overflow that exhausts the hysteresis
            budget; in (0, 1).
        growth_interval: clean steps in a row needed to grow the scale; >= 1.
        hysteresis: overflows absorbed before the scale backs off (``1`` backs off at every
            overflow, as torch does); refilled whenever the scale grows; >= 1.
        min_scale: the scale never backs off below this; ``None`` for no bound.
        max_scale: the scale never grows above this; ``None`` for no bound (growth still stops
            short of float32 infinity). Both bounds apply as float32, the scale's type: a bound
            that float32 cannot hold exactly is rounded to the nearest float32 first.

    Raises:
        InvalidConfigError: (a ``ValueError``) naming the argument and its allowed range.

    Example:
        >>> ScalePolicy(hysteresis=2, min_scale=1.0)
        ScalePolicy(growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, hysteresis=2, min_scale=1.0, max_scale=None)
    """  # noqa: E501

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        growth = _require_number("growth_factor", self.growth_factor)
        if not (growth > 1.0 and math.isfinite(growth)):
            raise InvalidConfigError(
                f"growth_factor must be a finite number > 1.0, got {self.growth_factor!r}."
            )
        backoff = _require_number("backoff_factor", self.backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise InvalidConfigError(
                f"backoff_factor must be in the open interval (0, 1), got {self.backoff_factor!r}."
            )
        _require_int("growth_interval", self.growth_interval, 1)
        _require_int("hysteresis", self.hysteresis, 1)
        for name in ("min_scale", "max_scale"):
            bound = getattr(self, name)
            if bound is not None:
                value = float32_value(_require_number(name, bound))
                if not (value > 0.0 and math.isfinite(value)):
                    raise InvalidConfigError(
                        f"{name} must be a number > 0 that is finite as a float32, or None, "
                        f"got {bound!r}."
                    )
        if (
            self.min_scale is not None
            and self.max_scale is not None
            and self.min_scale > self.max_scale
        ):
            raise InvalidConfigError(
                f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})."
            )

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value (``init_scale``, ``new_scale``, a loaded one) for this policy.

        The scale is a float32, so the value and the bounds are compared as float32: every
        value this policy produces passes. Returns the value as a float, or raises
        :class:`InvalidConfigError` naming ``name`` and the allowed range.
        """
        return _check_scale(name, scale, self.min_scale, self.max_scale)

    @property
    def _is_torch_rule(self) -> bool:
        return self.hysteresis == 1 and self.min_scale is None and self.max_scale is None

    def adjust(
        self, state: ScaleState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> ScaleState:
        """The state after one step whose gradients were non-finite iff ``found_inf > 0``.

        Pure (the input state is not modified) and free of host syncs. ``found_inf`` is a 0-dim
        float tensor on the state's device holding a count of non-finite checks (``>= 0``), as
        the gradient check produces it. ``measured`` (what :class:`HeadroomPolicy` reads) is
        not used.

        With torch's rule (``hysteresis=1``, no bounds) and a float32 ``found_inf``, the
        transition is torch's own fused kernel ``torch._amp_update_scale_`` run on copies of the
        state: three small device ops instead of about fifteen, with identical results.
        """
        if self._is_torch_rule and found_inf.dtype == torch.float32:
            scale = state.scale.clone()
            growth_tracker = state.growth_tracker.clone()
            torch._amp_update_scale_(
                scale,
                growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
            return ScaleState(scale, growth_tracker, state.hysteresis_left)
        overflow = found_inf > 0
        zero = torch.zeros((), dtype=torch.int32, device=state.scale.device)

        counted = torch.where(overflow, zero, state.growth_tracker + 1)
        grow = counted == self.growth_interval
        growth_tracker = torch.where(grow, zero, counted)

        if self.hysteresis == 1:
            # Every overflow backs off and the budget is always full: skip its bookkeeping.
            hysteresis_left = state.hysteresis_left
            backoff = overflow
        else:
            spent = torch.clamp_min(state.hysteresis_left - 1, 0)
            refilled = torch.full_like(state.hysteresis_left, self.hysteresis)
            hysteresis_left = torch.where(
                overflow, spent, torch.where(grow, refilled, state.hysteresis_left)
            )
            backoff = overflow & (hysteresis_left == 0)

        wide = state.scale.double()
        grown = (wide * self.growth_factor).float()
        if self.max_scale is not None:
            grown = torch.clamp_max(grown, self.max_scale)
        shrunk = (wide * self.backoff_factor).float()
        if self.min_scale is not None:
            shrunk = torch.clamp_min(shrunk, self.min_scale)

        scale = torch.where(grow & torch.isfinite(grown), grown, state.scale)
        scale = torch.where(backoff, shrunk, scale)
        return ScaleState(scale, growth_tracker, hysteresis_left)

    def update_(
        self, state: ScaleState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Apply :meth:`adjust` to ``state`` in place: its tensors keep their identity.

        With torch's rule this is one call of torch's fused kernel on the live tensors.
        No host sync.
        """
        if self._is_torch_rule and found_inf.dtype == torch.float32:
            torch._amp_update_scale_(
                state.scale,
                state.growth_tracker,
                found_inf,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )
        else:
            _copy_into_(state, self.adjust(state, found_inf))


@dataclass(frozen=True)
class StaticPolicy:
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

    @property
    def hysteresis(self) -> int:
        """``1``: a static scale never backs off, so there is no budget to spend."""
        return 1

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value: finite and > 0 as a float32 (see ScalePolicy's)."""
        return _check_scale(name, scale)

    def adjust(
        self, state: ScaleState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> ScaleState:
        """``state`` unchanged, whatever ``found_inf`` says."""
        return state

    def update_(
        self, state: ScaleState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Nothing moves."""


def pow2_exponent(value: float | None) -> int | None:
    """``e`` when ``value`` is exactly ``2**e`` (a positive finite power of two), else ``None``.

    Example:
        >>> pow2_exponent(65536.0), pow2_exponent(0.25), pow2_exponent(3.0), pow2_exponent(None)
        (16, -2, None, None)
    """
    if value is None or not (value > 0.0 and math.isfinite(value)):
        return None
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else None


#: The exponents of the scales a :class:`HeadroomPolicy` may set without bounds: float32's normal
#: range, where ``1/scale`` is exact.
HEADROOM_EXPONENTS = (-126, 127)


class HeadroomState(NamedTuple):
    """A :class:`HeadroomPolicy`'s moving parts, as tensors on the scale's device.

    The first three are :class:`ScaleState`'s.

    Attributes:
        scale: float32, the current loss scale (always a power of two, at most ``target``).
        growth_tracker: int32, clean steps in a row since the last overflow or the last
            doubling after one (torch's growth tracker).
        hysteresis_left: int32, always 1 (every overflow backs off).
        target: float32, the scale the measurements allow (``first_scale`` until the first).
        history: float64 ``[history_length]``, the largest gradient of each measured iteration
            divided by the scale it was measured at (a ring; 0 marks an empty slot).
        measured: int64, measurements stored so far (the next goes to slot
            ``measured % history_length``).
        iteration: int64, updates so far (what the measuring schedule counts).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    target: torch.Tensor
    history: torch.Tensor
    measured: torch.Tensor
    iteration: torch.Tensor


def _require_pow2(name: str, value: object, *, optional: bool = False) -> float | None:
    """``value`` as a float if it is ``2**e`` with ``e`` in float32's normal range."""
    if optional and value is None:
        return None
    number = _require_number(name, value)
    exponent = pow2_exponent(number)
    low, high = HEADROOM_EXPONENTS
    if exponent is None or not low <= exponent <= high:
        none = " or None" if optional else ""
        near = round(math.log2(number)) if number > 0 and math.isfinite(number) else 16
        raise InvalidConfigError(
            f"HeadroomPolicy keeps the scale a power of two (so unscaling is exact): {name} must "
            f"be 2**e with {low} <= e <= {high}{none}, got {value!r}; for example 2.0**{near}."
        )
    return number


@dataclass(frozen=True)
class HeadroomPolicy:
    """A scale set from measured gradient magnitudes instead of found by overflowing.

    Reactive policies (torch's, :class:`ScalePolicy`) grow the scale every ``growth_interval``
    clean steps until a step overflows, skip that step and back off, over and over. This
    policy measures how far the largest scaled gradients are from float16's largest value
    (65504) and sets the scale to the largest power of two that keeps ``margin`` between them,
    so it grows without overflowing. A real overflow still backs off at once: the scale moves by
    torch's rule (backed off at each overflow, doubled after each ``recovery_interval`` clean
    steps) but never above that target, and a measurement that moves the target moves the
    scale with it. Until something overflows the scale is the target; after an overflow it
    goes on following the measurements, a binade below them until it has recovered.

    What is measured (by the scaler, see :mod:`ampscaler.headroom`): the largest magnitude of
    the gradients arriving at the outputs of the leaf modules of the models given to
    :meth:`GradScaler.watch <ampscaler.GradScaler.watch>` (the activation gradients, where
    float16 overflows during the backward), and of the parameter gradients float16 computed.
    Every iteration while fewer than ``history_length`` iterations have run, then every
    ``sample_every``-th; the last ``history_length`` measurements are kept, and the largest
    of them sets the scale. The first iteration runs at ``first_scale`` (1 by default, where
    float16 training without scaling runs), so its measurement sets the scale before any step
    could overflow: no run skips warm-up steps, whatever the scale would have started at.

    One call of :meth:`adjust`, with ``overflow = found_inf > 0`` and ``measured`` the largest
    gradient magnitude of the iteration at its scale (``None``: not measured)::

        trouble = overflow or (measured is inf, NaN or > 65504)
        if measured and not trouble and measured > 0:
            history[stored % history_length] = measured / scale;  stored += 1
        if measured and max(history) > 0:
            new = the largest 2**e <= 65504 / (max(history) * margin),
                  within [min_scale, max_scale]
            scale = scale * new / target;  target = new      # keep the distance below it
        if trouble:  scale *= backoff_factor;  tracker = 0    # torch's rule ...
        else:        tracker += 1
                     if tracker == recovery_interval:  tracker = 0;  scale *= 2
        scale = min(max(scale, min_scale), target)           # ... capped at the target
        iteration += 1

    Products of powers of two are exact, so the scale stays a power of two: unscaling is exact
    and fused optimizers keep ampscaler's one-pass route. Written with ``torch.where`` and
    torch's fused update kernel, it runs on the device and never waits for it; an iteration
    that was not measured costs four small device ops, a measured one about thirty.

    Args:
        margin: the largest scaled gradient is kept at least this factor below 65504; >= 1.
            The default, ``2**0.5``, leaves half a binade (and the rounding down to a power of
            two another half on average) for gradients to grow between measurements and for
            values the measurement does not see (inside fused attention, say); ``2.0`` or more
            for gradients that jump more (docs/headroom.md has measurements).
        history_length: measurements kept; the largest sets the scale; >= 1.
        sample_every: after the first ``history_length`` iterations, measure every this many;
            >= 1 (``1``: every iteration).
        backoff_factor: multiplies the scale on an overflow; a power of two in (0, 1).
        recovery_interval: clean steps in a row after which a scale an overflow backed off
            doubles (up to the target); >= 1 (torch's ``growth_interval``, saved under that
            name).
        first_scale: the scale of the iterations before the first measurement (a power of
            two); the scaler's ``init_scale`` does not apply.
        min_scale: the scale never goes below this (a power of two); ``None``: ``2**-126``.
        max_scale: the scale never goes above this (a power of two); ``None``: ``2**127``.

    Raises:
        InvalidConfigError: (a ``ValueError``) naming the argument and its allowed values.

    Example:
        >>> import torch
        >>> policy = HeadroomPolicy(margin=2.0)
        >>> state = initial_state(policy, 1.0, torch.device("cpu"))
        >>> largest = torch.tensor(1e-3)      # the largest gradient at scale 1
        >>> state = policy.adjust(state, torch.tensor(0.0), largest)
        >>> state.scale.item() == 2.0**24     # 2**24 * 1e-3 * 2 <= 65504 < 2**25 * 1e-3 * 2
        True
        >>> state = policy.adjust(state, torch.tensor(1.0))   # an overflow anyway: back off
        >>> state.scale.item() == 2.0**23, state.target.item() == 2.0**24
        (True, True)
    """

    margin: float = 2.0**0.5
    history_length: int = 64
    sample_every: int = 32
    backoff_factor: float = 0.5
    recovery_interval: int = 2000
    first_scale: float = 1.0
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        margin = _require_number("margin", self.margin)
        if not (margin >= 1.0 and math.isfinite(margin)):
            raise InvalidConfigError(
                f"margin must be a finite number >= 1 (the factor kept between the largest "
                f"scaled gradient and 65504; 1 keeps none), got {self.margin!r}."
            )
        _require_int("history_length", self.history_length, 1)
        _require_int("sample_every", self.sample_every, 1)
        _require_int("recovery_interval", self.recovery_interval, 1)
        backoff = _require_pow2("backoff_factor", self.backoff_factor)
        if backoff is None or not backoff < 1.0:
            raise InvalidConfigError(
                f"backoff_factor must be a power of two below 1 (0.5, 0.25, ...), got "
                f"{self.backoff_factor!r}."
            )
        low = _require_pow2("min_scale", self.min_scale, optional=True)
        high = _require_pow2("max_scale", self.max_scale, optional=True)
        if low is not None and high is not None and low > high:
            raise InvalidConfigError(
                f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})."
            )
        low_bound, high_bound = HEADROOM_EXPONENTS
        exponents = (
            low_bound if low is None else pow2_exponent(low) or 0,
            high_bound if high is None else pow2_exponent(high) or 0,
        )
        object.__setattr__(self, "_exponents", exponents)  # read on every update
        self.check_scale("first_scale", self.first_scale)

    @property
    def hysteresis(self) -> int:
        """``1``: every overflow backs off."""
        return 1

    @property
    def exponents(self) -> tuple[int, int]:
        """The lowest and highest exponent ``e`` of the scales ``2**e`` this policy sets."""
        exponents: tuple[int, int] = self.__dict__["_exponents"]
        return exponents

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value (``first_scale``, ``new_scale``, a loaded one): a power of
        two within the bounds. Returns it as a float, or raises :class:`InvalidConfigError`."""
        value = _require_pow2(name, scale)
        assert value is not None
        low, high = self.exponents
        if not 2.0**low <= value <= 2.0**high:
            raise InvalidConfigError(
                f"{name} must be within [min_scale, max_scale] = [2**{low}, 2**{high}], got "
                f"{scale!r}."
            )
        return value

    def measures(self, iteration: int) -> bool:
        """Whether iteration number ``iteration`` (counting from 0) is measured.

        Example:
            >>> policy = HeadroomPolicy(history_length=3, sample_every=4)
            >>> [i for i in range(16) if policy.measures(i)]
            [0, 1, 2, 6, 10, 14]
        """
        young = iteration < self.history_length
        return young or (iteration - self.history_length + 1) % self.sample_every == 0

    def adjust(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> HeadroomState:
        """The state after one iteration (see the class docstring for the rule).

        Pure (the input state is not modified: :meth:`update_` runs on copies of its tensors)
        and free of host syncs. ``found_inf`` is a 0-dim float tensor, ``> 0`` iff the
        gradients held inf/NaN; ``measured`` a 0-dim float tensor: the largest gradient
        magnitude the iteration's backward held at its scale (``< 0`` counts as nothing
        measured, as ``None`` does).

        Raises:
            TypeError: ``state`` is not a :class:`HeadroomState`.
        """
        moved = HeadroomState(*(tensor.clone() for tensor in _headroom_state(state, "adjust")))
        self.update_(moved, found_inf, measured)
        return moved

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Apply the rule to ``state`` in place: its tensors keep their identity.

        An iteration that was not measured runs four device ops (torch's fused update kernel
        among them); a measured one about thirty. No host sync.

        Raises:
            TypeError: ``state`` is not a :class:`HeadroomState`.
        """
        live = _headroom_state(state, "update_")
        flag = found_inf.to(device=live.scale.device, dtype=torch.float32)
        if measured is not None:
            flag = self._measure_(live, flag, measured.to(live.scale.device))
        torch._amp_update_scale_(
            live.scale,
            live.growth_tracker,
            flag,
            2.0,
            self.backoff_factor,
            self.recovery_interval,
        )
        live.scale.clamp_(min=2.0 ** self.exponents[0])
        torch.minimum(live.scale, live.target, out=live.scale)
        live.iteration.add_(1)

    def _measure_(
        self, live: HeadroomState, flag: torch.Tensor, measured: torch.Tensor
    ) -> torch.Tensor:
        """Take ``measured`` into the history, the target and the scale, in place; returns the
        flag torch's rule moves the scale by (the overflow flag, raised for a measurement
        beyond float16)."""
        hot = ~(measured <= FP16_MAX)  # inf, NaN, or beyond float16
        flag = flag + hot
        usable = (measured > 0.0) & (flag == 0)
        slot = torch.remainder(live.measured, self.history_length).reshape(1)
        relative = measured.double() / live.scale.double()
        live.history.index_put_((slot,), torch.where(usable, relative, live.history[slot]))
        live.measured.add_(usable)
        peak = live.history.max()
        # One correctly rounded division (a Python number over a tensor would round twice).
        room = torch.full_like(peak, FP16_MAX) / (peak * self.margin)
        _, exponent = torch.frexp(room)  # room = m * 2**exponent with 0.5 <= m < 1
        low, high = self.exponents
        allowed = torch.exp2((exponent - 1).clamp(low, high).double()).float()
        target = torch.where(peak > 0.0, allowed, live.target)
        live.scale.mul_(target / live.target)  # a ratio of powers of two: exact
        live.target.copy_(target)
        return flag


def _headroom_state(state: PolicyState, method: str) -> HeadroomState:
    if not isinstance(state, HeadroomState):
        raise TypeError(
            f"HeadroomPolicy.{method}() needs a HeadroomState (initial_state(policy, ...) makes "
            f"one), got {type(state).__name__}."
        )
    return state


Policy = ScalePolicy | StaticPolicy | HeadroomPolicy
"""The policies a :class:`~ampscaler.GradScaler` takes as ``policy=``."""

PolicyState = ScaleState | HeadroomState
"""A policy's moving parts: :class:`HeadroomState` for :class:`HeadroomPolicy`, else
:class:`ScaleState`."""

#: The extra fields of a :class:`HeadroomState`, beyond the three of :class:`ScaleState`.
HEADROOM_FIELDS = HeadroomState._fields[len(ScaleState._fields) :]


def initial_state(
    policy: Policy,
    scale: float,
    device: torch.device,
    growth_tracker: int = 0,
    hysteresis_left: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> PolicyState:
    """Fresh state on ``device``; ``hysteresis_left`` defaults to a full budget.

    For a :class:`HeadroomPolicy`, ``extra`` holds the values of its own fields
    (:data:`HEADROOM_FIELDS`, as ``state_dict()`` saves them; ``None``: nothing measured yet).
    """
    budget = policy.hysteresis if hysteresis_left is None else hysteresis_left
    common = ScaleState(
        scale=torch.full((), scale, dtype=torch.float32, device=device),
        growth_tracker=torch.full((), growth_tracker, dtype=torch.int32, device=device),
        hysteresis_left=torch.full((), budget, dtype=torch.int32, device=device),
    )
    if not isinstance(policy, HeadroomPolicy):
        return common
    values = dict(extra or {})
    history = values.get("history", [0.0] * policy.history_length)
    return HeadroomState(
        *common,
        target=torch.full((), values.get("target", scale), dtype=torch.float32, device=device),
        history=torch.tensor(history, dtype=torch.float64, device=device),
        measured=torch.full((), values.get("measured", 0), dtype=torch.int64, device=device),
        iteration=torch.full((), values.get("iteration", 0), dtype=torch.int64, device=device),
    )


def torch_rule(policy: Policy) -> ScalePolicy:
    """The dynamic rule ``policy`` is saved and reported as under torch's names
    (``growth_factor``, ``backoff_factor``, ``growth_interval``, ``get_growth_interval()``):
    a ScalePolicy itself; torch's defaults for a StaticPolicy; for a HeadroomPolicy, its
    backoff factor and bounds, and its ``recovery_interval`` as the growth interval."""
    if isinstance(policy, HeadroomPolicy):
        return ScalePolicy(
            backoff_factor=policy.backoff_factor,
            growth_interval=policy.recovery_interval,
            min_scale=policy.min_scale,
            max_scale=policy.max_scale,
        )
    return policy if isinstance(policy, ScalePolicy) else ScalePolicy()


def starting_scale(policy: Policy, init_scale: object) -> float:
    """The scale a scaler with ``policy`` starts from, given its ``init_scale`` (validated).

    ``init_scale`` itself, except for a :class:`HeadroomPolicy`, whose first iteration runs at
    its ``first_scale`` (its first measurement then sets the scale).

    Raises:
        InvalidConfigError: ``init_scale`` is not a valid scale for ``policy``.
    """
    if isinstance(policy, HeadroomPolicy):
        _check_scale("init_scale", init_scale)
        return float(policy.first_scale)
    return policy.check_scale("init_scale", init_scale)


_RULE_DEFAULTS = {rule.name: rule.default for rule in fields(ScalePolicy)}


def policy_from_arguments(policy: object, dynamic: object, rule: dict[str, Any]) -> Policy:
    """The policy a :class:`~ampscaler.GradScaler` call asks for: ``policy=``, or the keyword
    shorthands (``dynamic`` and ``rule``: :class:`ScalePolicy`'s fields as given)."""
    changed = [name for name, value in rule.items() if value != _RULE_DEFAULTS[name]]
    if policy is not None:
        if not isinstance(policy, (ScalePolicy, StaticPolicy, HeadroomPolicy)):
            raise InvalidConfigError(
                "policy must be an ampscaler.ScalePolicy or ampscaler.StaticPolicy (or an "
                f"ampscaler.HeadroomPolicy), got {type(policy).__name__}."
            )
        if changed or dynamic is not True:
            raise InvalidConfigError(
                f"Pass either policy= or the policy's keyword arguments, not both: got "
                f"policy={policy} and {', '.join(changed) or 'dynamic'}. Put them into the policy."
            )
        return policy
    if not isinstance(dynamic, bool):
        raise InvalidConfigError(f"dynamic must be True or False, got {dynamic!r}.")
    dynamic_rule = ScalePolicy(**rule)  # validates the arguments either way
    if dynamic:
        return dynamic_rule
    if changed:
        warnings.warn(
            f"dynamic=False keeps the scale fixed, so {', '.join(changed)} will not be used "
            "(they are kept out of the checkpoint too); drop them, or pass policy=StaticPolicy().",
            stacklevel=3,
        )
    return StaticPolicy()
