"""A pure-Python model of HeadroomPolicy's transition, for property tests.

Written from the rule in the issue and the class docstring, not from ``ampscaler.policy``:
plain ``if`` statements on Python numbers, no tensors. Float32 values (the scale and the
target) are held in Python floats after rounding them to float32; the history is float64, as
Python's floats are::

    measured < 0 is no measurement
    trouble = overflow or measured is inf, NaN or > 65504
    if measured and not trouble and measured > 0:
        history[stored % length] = measured / scale; stored += 1
    if measured and max(history) > 0:
        new = 2**clamp(exponent of the largest power of two <= 65504 / (peak * margin))
        scale = f32(scale * f32(new / target)); target = new
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
        """One update after an iteration that overflowed or not, and measured or not."""
        if measured is not None and measured < 0.0:
            measured = None  # a measurement of nothing
        hot = measured is not None and not measured <= FP16_MAX  # NaN is not <= either
        trouble = overflow or hot
        if measured is not None:
            if not trouble and measured > 0.0:
                self.history[self.stored % self.history_length] = measured / self.scale
                self.stored += 1
            peak = max(self.history)
            if peak > 0.0:
                room = FP16_MAX / (peak * self.margin)
                exponent = math.frexp(room)[1] - 1  # the largest 2**e <= room
                new = min(max(2.0**exponent, self.lowest), self.highest)
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
