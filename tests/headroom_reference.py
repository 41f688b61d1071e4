"""A pure-Python model of HeadroomPolicy's transition, for property tests.

Written from the rule in the issue and the class docstring, not from ``ampscaler.policy``:
plain ``if`` statements on Python numbers, no tensors. Float32 values (the scale and the
target) are held in Python floats after rounding them to float32; the history is float64, as
Python's floats are::

    (a measurement < 0 saw nothing, but still takes an overflow's bound; None: not measured)
    trouble = overflow or measured is inf, NaN or > 65504
    if measured is not None:
        usable = measured > 0 and not trouble
        again = trouble and 0 < overflowed_at <= scale      # overflowed here or lower before
        if usable or again:
            history[stored % length] = measured / scale if usable else next_up(65504 / scale)
            if iteration < length and stored >= window:   # young: keep the last window
                history[(stored - window) % length] = 0     # (window = max(1, length // 2))
            stored += 1
        if trouble: overflowed_at = scale
        flushed = measured == 0 and not trouble;  flushes += flushed
        m = first_margin while iteration < length, else margin
        if max(history) > 0:  new = 2**clamp(exponent of the largest power of two
                                              <= 65504 / (max(history) * m))
        elif flushed:         new = min(2**16 * target, highest)  # nothing seen yet: jump
        else:                 new = target
        if not trouble: scale = f32(scale * f32(new / target))
        target = new
    torch's rule on the scale (backoff on trouble; growth 2 every recovery_interval clean
          steps), then scale = min(max(scale, lowest), target); iteration += 1

Example:
    >>> ref = HeadroomRef(margin=2.0, history_length=2)
    >>> ref.adjust(False, 1e-3).scale == 2.0**24, ref.adjust(True, None).scale == 2.0**23
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reference import f32

FP16_MAX = 65504.0


@dataclass
class HeadroomRef:
    """HeadroomPolicy's configuration and moving parts."""

    margin: float = 2.0
    first_margin: float = 2.0
    history_length: int = 16
    backoff_factor: float = 0.5
    recovery_interval: int = 16
    first_scale: float = 1.0
    min_scale: float | None = None
    max_scale: float | None = None
    scale: float = field(init=False)
    tracker: int = 0
    target: float = field(init=False)
    history: list[float] = field(init=False)
    stored: int = 0
    iteration: int = 0
    overflowed_at: float = 0.0
    flushed: int = 0

    def __post_init__(self) -> None:
        self.scale = self.target = self.first_scale
        self.history = [0.0] * self.history_length

    @property
    def lowest(self) -> float:
        return 2.0**-126 if self.min_scale is None else self.min_scale

    @property
    def highest(self) -> float:
        return 2.0**127 if self.max_scale is None else self.max_scale

    def adjust(self, overflow: bool, measured: float | None) -> HeadroomRef:
        """One update after an iteration that overflowed or not, and measured or not (a
        measurement < 0: nothing seen, but the overflow's bound is taken)."""
        hot = measured is not None and not measured <= FP16_MAX  # NaN is not <= either
        trouble = overflow or hot
        if measured is not None:
            usable = measured > 0.0 and not trouble
            again = trouble and 0.0 < self.overflowed_at <= self.scale
            if usable or again:
                entry = (
                    measured / self.scale
                    if usable
                    else math.nextafter(FP16_MAX / self.scale, math.inf)
                )
                self.history[self.stored % self.history_length] = entry
                window = max(1, self.history_length // 2)
                young = self.iteration < self.history_length
                if young and window < self.history_length and self.stored >= window:
                    self.history[(self.stored - window) % self.history_length] = 0.0
                self.stored += 1
            if trouble:
                self.overflowed_at = self.scale
            flushed = measured == 0.0 and not trouble
            self.flushed += flushed
            peak = max(self.history)
            margin = self.first_margin if self.iteration < self.history_length else self.margin
            new = self.target
            if peak > 0.0:
                room = FP16_MAX / (peak * margin)
                exponent = math.frexp(room)[1] - 1  # the largest 2**e <= room
                new = min(max(2.0**exponent, self.lowest), self.highest)
            elif flushed:
                new = min(self.target * 2.0**16, self.highest)
            if not trouble:
                self.scale = f32(self.scale * f32(new / self.target))
            self.target = new
        scale = self.scale
        if trouble:
            scale = f32(scale * self.backoff_factor)
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.recovery_interval:
                self.tracker = 0
                grown = f32(scale * 2.0)
                if math.isfinite(grown):
                    scale = grown
        self.scale = min(max(scale, self.lowest), self.target)
        self.iteration += 1
        return self
