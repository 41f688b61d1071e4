"""A scale set from measured gradient magnitudes: :class:`HeadroomPolicy`.

Reactive policies (torch's, :class:`~ampscaler.ScalePolicy`) find the scale's ceiling by
overflowing; this one measures how far the largest scaled gradients are from float16's largest
value and sets the scale below it (:mod:`ampscaler.policy.meter` measures). The scale stays a
power of two, so unscaling is exact.

Example:
    >>> import torch
    >>> policy = HeadroomPolicy(margin=2.0)
    >>> state = policy.initial_state(1.0, torch.device("cpu"))
    >>> state = policy.adjust(state, torch.tensor(0.0), torch.tensor(1e-3))
    >>> state.scale.item() == 2.0**24
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from ..errors import InvalidConfigError
from .base import (
    FP16_MAX,
    Meter,
    Policy,
    PolicyState,
    PowerOfTwo,
    adjusted,
    check_bounds,
    check_number,
    check_scale,
    pow2_exponent,
    require_int,
    require_number,
    require_state,
)

__all__ = ["FLUSH_JUMP", "HEADROOM_EXPONENTS", "HeadroomPolicy", "HeadroomState"]

_INFINITY = torch.tensor(math.inf, dtype=torch.float64)

#: The exponents ``e`` of the scales ``2**e`` a HeadroomPolicy may hold: float32's normal
#: range, where ``1/scale`` is exact.
HEADROOM_EXPONENTS = (-126, 127)

#: How far the target jumps on an iteration whose every measured gradient flushed to zero
#: before anything was measured. Float16 rounds a value to zero only below ``2**-24``, so at
#: ``2**16`` times the scale every value it flushed stays below ``2**-8``, 24 binades under
#: 65504: room for what the measurement cannot see. From the default ``first_scale`` of 1 it
#: lands where torch's scaler starts. (Doubling, as a reactive rule grows, took four tries on
#: ``benchmarks/scaling.py``'s ``tiny-loss``, loss times ``2**-24``, and its first step, at 8,
#: still flushed 99.8% of the gradients.)
FLUSH_JUMP = 2.0**16


class HeadroomState(NamedTuple):
    """A :class:`HeadroomPolicy`'s moving parts, as tensors on the scale's device.

    The first three are :class:`ScaleState`'s.

    Attributes:
        scale: float32, the current loss scale (always a power of two, at most ``target``).
        growth_tracker: int32, clean steps in a row since the last overflow or the last
            doubling after one (torch's growth tracker).
        target: float32, the scale the measurements allow (``first_scale`` until the first).
        history: float64 ``[history_length]``, the largest gradient of each measured iteration
            divided by the scale it was measured at (a ring; 0 marks an empty slot).
        measured: int64, measurements stored so far (the next goes to slot
            ``measured % history_length``).
        iteration: int64, updates so far (what the measuring schedule counts).
        overflowed_at: float32, the scale of the last overflow (0: none yet).
        flushed: int64, measured iterations whose every measured gradient was zero at their
            scale (flushed to zero in float16: the scale does not help them).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    target: torch.Tensor
    history: torch.Tensor
    measured: torch.Tensor
    iteration: torch.Tensor
    overflowed_at: torch.Tensor
    flushed: torch.Tensor


#: The largest count a HeadroomPolicy setting takes (its counters are int64 tensors).
_COUNT_MAX = 2**62


#: What each margin is, for the message that refuses one.
_MARGINS = {
    "margin": "the factor kept between the largest scaled gradient and 65504; 1 keeps none",
    "first_margin": "the margin while the history is young, its first history_length iterations",
}

#: The dtype of each field of a :class:`HeadroomState`, in order (scale, growth_tracker, target,
#: history; measured, iteration, overflowed_at, flushed).
_DTYPES = (
    *(torch.float32, torch.int32, torch.float32, torch.float64),
    *(torch.int64, torch.int64, torch.float32, torch.int64),
)


def _pow2(name: str, value: object, none: str = "") -> int:
    """``e`` if ``value`` is ``2**e`` with ``e`` in float32's normal range (``none``: what the
    message adds for a setting that may also be ``None``)."""
    number = require_number(name, value)
    exponent = pow2_exponent(number)
    low, high = HEADROOM_EXPONENTS
    if exponent is None or not low <= exponent <= high:
        near = round(math.log2(number)) if number > 0 and math.isfinite(number) else 16
        raise InvalidConfigError(
            f"HeadroomPolicy keeps the scale a power of two (so unscaling is exact): {name} must "
            f"be 2**e with {low} <= e <= {high}{none}, got {value!r}; for example 2.0**{near}."
        )
    return exponent


@dataclass(frozen=True)
class HeadroomPolicy(Policy):
    """A scale set from measured gradients' magnitudes instead of found by overflowing.

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
    could overflow. While the history is young (its first ``history_length`` iterations) the
    margin is ``first_margin``, and only its last :attr:`young_window` measurements count: the
    first optimizer steps move the gradients most, and once they settle what they measured no
    longer holds.

    Three more things are measurements. An iteration whose every measured gradient was zero
    (flushed in float16) before anything else was measured says the scale is too low to see
    anything: the target jumps by :data:`FLUSH_JUMP` (``2**16``: every flushed value was below
    ``2**-24``, so it stays below ``2**-8``), once per such iteration (and the iteration is
    counted in ``flushed``). The scaler's meter vetoes such an iteration's step (it would
    apply zero gradients), and :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>`
    runs the batch again at the new scale. An overflow at scale ``S`` says the largest gradient
    exceeded ``65504 / S``; a single one may be a one-off (the scale recovers to the target,
    as before), but an overflow at or above the scale of the last one enters the history as
    that bound, so the target stays below ``S`` for as long as a measurement would hold it: heavy
    tails stop pulling the scale back into them after every recovery. (The scaler hands an
    iteration that may have overflowed to the policy with ``measured < 0``, "nothing seen",
    when it was not measured, so that the bound is taken.)

    One call of :meth:`adjust`, with ``overflow = found_inf > 0`` and ``measured`` the largest
    gradient magnitude of the iteration at its scale (``None``: not measured; ``< 0``: nothing
    seen)::

        trouble = overflow or (measured is inf, NaN or > 65504)
        if measured is not None:
            usable = measured > 0 and not trouble
            again = trouble and 0 < overflowed_at <= scale   # it overflowed here before
            if usable or again:
                history[stored % history_length] = (measured / scale if usable
                                                    else next_up(65504 / scale))
                if iteration < history_length and stored >= young_window:
                    history[(stored - young_window) % history_length] = 0  # young: forget
                stored += 1
            if trouble:  overflowed_at = scale
            flushed = measured == 0 and not trouble;  flushes += flushed
            m = first_margin if iteration < history_length else margin
            if max(history) > 0:
                new = the largest 2**e <= 65504 / (max(history) * m),
                      within [min_scale, max_scale]
            elif flushed:  new = min(2**16 * target, max_scale)   # nothing seen yet: jump
            else:          new = target
            if not trouble:  scale = scale * new / target       # keep the distance below it
            target = new
        if trouble:  scale *= backoff_factor;  tracker = 0    # torch's rule ...
        else:        tracker += 1
                     if tracker == recovery_interval:  tracker = 0;  scale *= 2
        scale = min(max(scale, min_scale), target)           # ... capped at the target
        iteration += 1

    Products of powers of two are exact, so the scale stays a power of two: unscaling is exact
    and fused optimizers keep ampscaler's one-pass route. Written with ``torch.where`` and
    torch's fused update kernel, it runs on the device and never waits for it; an iteration
    that was not measured costs five small device ops; a measured one (or one that may have
    overflowed) about sixty.

    Args:
        margin: the largest scaled gradient is kept at least this factor below 65504; >= 1.
            The default, ``2**0.5``, leaves half a binade (and the rounding down to a power of
            two another half on average) for gradients to grow between measurements and for
            values the measurement does not see (inside fused attention, say); ``2.0`` or more
            for gradients that jump more (docs/headroom.md has measurements).
        first_margin: the margin while the history is young (its first ``history_length``
            iterations, every one measured); >= 1. The default, 2, covers how much the largest
            gradient grew from one iteration to the next in the first 40 optimizer steps of
            the workloads of ``benchmarks/scaling.py``: up to 1.99x (Student-t advantages),
            1.52x (a text LM), 1.39x (an MLP), 1.18x (GPT-2).
        history_length: measurements kept; the largest sets the scale; >= 1.
        sample_every: after the first ``history_length`` iterations, measure every this many;
            >= 1 (``1``: every iteration).
        backoff_factor: multiplies the scale on an overflow; a power of two in (0, 1).
        recovery_interval: clean steps in a row after which a scale an overflow backed off
            doubles (up to the target); >= 1 (torch's ``growth_interval``, saved under that
            name). The default, 16, brings the scale back within a factor 2 of its target in
            48 clean steps after up to four isolated outlier batches; an overflow the
            measurement cannot see (raise ``margin`` for those) costs one skipped step per
            ``recovery_interval`` (one replay with :meth:`GradScaler.attempts
            <ampscaler.GradScaler.attempts>`).
        first_scale: the scale of the iterations before the first measurement (a power of
            two); the scaler's ``init_scale`` does not apply.
        min_scale: the scale never goes below this (a power of two); ``None``: ``2**-126``.
        max_scale: the scale never goes above this (a power of two); ``None``: ``2**127``.

    Raises:
        InvalidConfigError: (a ``ValueError``) naming the argument and its allowed values.

    Example:
        >>> import torch
        >>> policy = HeadroomPolicy(margin=2.0)
        >>> state = policy.initial_state(1.0, torch.device("cpu"))
        >>> largest = torch.tensor(1e-3)      # the largest gradient at scale 1
        >>> state = policy.adjust(state, torch.tensor(0.0), largest)
        >>> state.scale.item() == 2.0**24     # 2**24 * 1e-3 * 2 <= 65504 < 2**25 * 1e-3 * 2
        True
        >>> state = policy.adjust(state, torch.tensor(1.0))   # an overflow anyway: back off
        >>> state.scale.item() == 2.0**23, state.target.item() == 2.0**24
        (True, True)
    """

    margin: float = 2.0**0.5
    first_margin: float = 2.0
    history_length: int = 64
    sample_every: int = 32
    backoff_factor: float = 0.5
    recovery_interval: int = 16
    first_scale: float = 1.0
    min_scale: float | None = None
    max_scale: float | None = None

    #: The lowest and highest exponent ``e`` of the scales ``2**e`` this policy sets (set per
    #: instance by ``__post_init__`` and read on every update).
    exponents: ClassVar[tuple[int, int]]

    def __post_init__(self) -> None:
        for name, meaning in _MARGINS.items():
            must = f"a finite number >= 1 ({meaning})"
            check_number(name, getattr(self, name), lambda m: 1 <= m < math.inf, must)
        for name in ("history_length", "sample_every", "recovery_interval"):
            require_int(name, getattr(self, name), 1, _COUNT_MAX)
        if _pow2("backoff_factor", self.backoff_factor) >= 0:
            raise InvalidConfigError(
                f"backoff_factor must be a power of two below 1 (0.5, 0.25, ...), got "
                f"{self.backoff_factor!r}."
            )
        low, high = HEADROOM_EXPONENTS
        if self.min_scale is not None:
            low = _pow2("min_scale", self.min_scale, " or None")
        if self.max_scale is not None:
            high = _pow2("max_scale", self.max_scale, " or None")
        check_bounds(self, low, high)
        object.__setattr__(self, "exponents", (low, high))
        self.check_scale("first_scale", self.first_scale)

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value (``first_scale``, ``new_scale``, a loaded one): a power of
        two within the bounds. Returns it as a float, or raises :class:`InvalidConfigError`."""
        exponent = _pow2(name, scale)
        low, high = self.exponents
        if not low <= exponent <= high:
            raise InvalidConfigError(
                f"{name} must be within [min_scale, max_scale] = [2**{low}, 2**{high}], got "
                f"{scale!r}."
            )
        return 2.0**exponent

    @property
    def young_window(self) -> int:
        """How many measurements the young history keeps: ``max(1, history_length // 2)``.

        While the history is young (its first ``history_length`` iterations, every one
        measured) a measurement leaves it once ``young_window`` more have been stored, so the
        history that sampling takes over holds the last half of the young iterations, not the
        first optimizer steps' larger gradients, which would otherwise hold the scale down
        until sampling replaced them, about ``history_length * sample_every / 2`` iterations
        later. (Sampling fills the empty slots first, then replaces the young measurements,
        oldest first; a young ring of ``young_window`` slots, which sampling overwrote first,
        cost the text LM a skipped step where this costs none.)
        Measured every iteration on ``benchmarks/scaling.py``'s text LM, the largest gradient
        of the first 8 iterations was 2.5x the largest of iterations 32 to 63 and 1.5x the
        largest of the 236 after them: kept, it held the token-summed loss's scale a binade
        below torch's for all 300 batches (mean log2 scale 7.68 against 9.10; 8.73 with the
        window, and no more skipped steps on any of the six workloads).

        Example:
            >>> HeadroomPolicy().young_window, HeadroomPolicy(history_length=1).young_window
            (32, 1)
        """
        return max(1, self.history_length // 2)

    def measures(self, iteration: int) -> bool:
        """Whether iteration number ``iteration`` (counting from 0) is measured.

        Example:
            >>> policy = HeadroomPolicy(history_length=3, sample_every=4)
            >>> [i for i in range(16) if policy.measures(i)]
            [0, 1, 2, 6, 10, 14]
        """
        young = iteration < self.history_length
        return young or (iteration - self.history_length + 1) % self.sample_every == 0

    # ------------------------------------------------------------------ the protocol

    def initial_state(
        self, scale: float, device: torch.device, values: Mapping[str, Any] | None = None
    ) -> HeadroomState:
        """Fresh state on ``device`` (nothing measured yet; the target is ``scale``), or the
        saved ``values`` (:meth:`own_values`)."""
        fresh = {"target": scale, "history": [0.0] * self.history_length, "overflowed_at": 0.0}
        given = {**fresh, **(values or {}), "scale": scale}
        return HeadroomState(
            *(  # a number is filled in on the device: no copy from the host, which would wait
                torch.full((), given.get(name, 0), dtype=dtype, device=device)
                if name != "history"
                else torch.tensor(given[name], dtype=dtype, device=device)
                for name, dtype in zip(HeadroomState._fields, _DTYPES, strict=True)
            )
        )

    def own_values(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """``target``, ``history``, ``measured`` and ``iteration`` from a checkpoint, validated.

        Raises:
            InvalidConfigError: a value is missing, of another length, or out of range.
        """
        history = saved.get("history")
        if not (
            isinstance(history, (list, tuple))
            and len(history) == self.history_length
            and all(_finite_at_least_zero(value) for value in history)
        ):
            raise InvalidConfigError(
                f"headroom['history'] must be a list of {self.history_length} finite numbers "
                f">= 0 (history_length), got {history!r}."
            )
        values: dict[str, Any] = {"history": [float(value) for value in history]}
        values["target"] = self.check_scale("headroom['target']", saved.get("target"))
        # Checkpoints before 0.2 hold neither flushed nor overflowed_at: none flushed, no overflow.
        for name, missing in (("measured", None), ("iteration", None), ("flushed", 0)):
            values[name] = require_int(
                f"headroom[{name!r}]", saved.get(name, missing), 0, _COUNT_MAX, integral_floats=True
            )
        at = saved.get("overflowed_at", 0.0)
        overflowed = 0.0 if at == 0 else self.check_scale("headroom['overflowed_at']", at)
        values["overflowed_at"] = overflowed
        return values

    @property
    def holds_on_nonfinite_loss(self) -> bool:
        """``True``: an iteration whose loss was already inf/NaN before scaling (bad data, a
        forward overflow), and whose step was skipped, leaves the scale, the target and the
        measurements as they were; a lower scale cannot help such a step."""
        return True

    def set_scale_(self, state: PolicyState, value: float) -> None:
        """``update(new_scale)``: the scale, and what the measurements allow, until the next
        measurement or overflow."""
        live = require_state(HeadroomState, state, "HeadroomPolicy.set_scale_()")
        live.scale.fill_(value)
        live.target.fill_(value)

    def starting_scale(self, init_scale: object) -> float:
        """``first_scale``: the first iteration runs there, and its measurement sets the scale
        (``init_scale`` is validated, but not used)."""
        check_scale("init_scale", init_scale)
        return float(self.first_scale)

    @property
    def power_of_two(self) -> PowerOfTwo:
        """Every scale it sets is ``2**e`` within its bounds, which float32's normal range holds
        (checked on construction): exact after any number of updates."""
        return PowerOfTwo(drop=0, floor=None)

    def new_meter(self, iteration: int, agreed: bool) -> Meter:
        """A :class:`~ampscaler.policy.meter.HeadroomMeter` following this policy's schedule."""
        from .meter import HeadroomMeter  # the meter needs the taps, which need torch.nn

        return HeadroomMeter(self, iteration, agreed=agreed)

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
        own = require_state(HeadroomState, state, "HeadroomPolicy.adjust()")
        return adjusted(self, own, found_inf, measured)

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Apply the rule to ``state`` in place: its tensors keep their identity.

        An iteration that was not measured runs five device ops (torch's fused update kernel
        among them); a measured one about sixty (the young window's eight among them). No host
        sync.

        Raises:
            TypeError: ``state`` is not a :class:`HeadroomState`.
        """
        live = require_state(HeadroomState, state, "HeadroomPolicy.update_()")
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
        """Take ``measured`` (and an overflow's bound) into the history, the target and the
        scale, in place; returns the flag torch's rule moves the scale by (the overflow flag,
        raised for a measurement beyond float16)."""
        hot = ~(measured <= FP16_MAX)  # inf, NaN, or beyond float16
        flag = flag + hot
        over = flag > 0
        clean = ~over
        usable = (measured > 0.0) & clean
        scale = live.scale.double()
        # An overflow at a scale at or above the last one's: the largest gradient exceeded
        # 65504 / scale (the next float64 up: the target must stay below this scale).
        again = over & (live.overflowed_at > 0.0) & (live.scale >= live.overflowed_at)
        bound = torch.nextafter(torch.full_like(scale, FP16_MAX) / scale, _INFINITY)
        entry = torch.where(usable, measured.double() / scale, bound)
        write = usable | again
        slot = torch.remainder(live.measured, self.history_length).reshape(1)
        live.history.index_put_((slot,), torch.where(write, entry, live.history[slot]))
        young = live.iteration < self.history_length
        window = self.young_window
        if window < self.history_length:
            # While young, a measurement leaves once `window` more are stored: the first
            # optimizer steps move the gradients, and what they measured no longer holds once
            # they settle. (Before `window` are stored that slot has never been written.)
            stale = torch.remainder(live.measured - window, self.history_length).reshape(1)
            gone = write & young
            live.history.index_put_((stale,), torch.where(gone, 0.0, live.history[stale]))
        live.measured.add_(write)
        live.overflowed_at.copy_(torch.where(over, live.scale, live.overflowed_at))
        flushed = (measured == 0.0) & clean  # measured, and every gradient was zero
        live.flushed.add_(flushed)
        peak = live.history.max()
        kept = torch.where(young, peak * self.first_margin, peak * self.margin)
        # One correctly rounded division (a Python number over a tensor would round twice).
        room = torch.full_like(peak, FP16_MAX) / kept
        mantissa, _ = torch.frexp(room)  # room = m * 2**e with 0.5 <= m < 1 (exact)
        low, high = self.exponents
        # 2**(e - 1) = room / (2 m) exactly: the quotient is representable, so division is exact.
        allowed = (room / (mantissa * 2.0)).clamp(2.0**low, 2.0**high).float()
        # Nothing measured before, and every gradient zero now: the scale is too low to see
        # anything; it jumps by FLUSH_JUMP (once per measured iteration).
        jumped = torch.clamp(live.target * FLUSH_JUMP, max=2.0**high)
        grown = torch.where(flushed, jumped, live.target)
        target = torch.where(peak > 0.0, allowed, grown)
        # A ratio of powers of two: exact (1 on an overflow, which backs off below).
        ratio = torch.where(over, live.target, target) / live.target
        live.scale.mul_(ratio)  # keep the distance below the target (an overflow backs off)
        live.target.copy_(target)
        return flag


def _finite_at_least_zero(value: object) -> bool:
    """Whether ``value`` is a real number, finite and >= 0."""
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < math.inf
    )
