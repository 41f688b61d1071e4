"""A pure-Python model of ampscaler's scaling policy and counters, for property tests.

Written from issue 3's statement of the semantics, not from ``ampscaler.policy``: plain ``if``
statements on Python numbers, no tensors. The scale is a float32 value held in a Python float;
products are formed in float64 and rounded once to float32, as torch's ``_amp_update_scale_``
kernel does, and the bounds are compared after rounding them to float32 like the scale::

    if not dynamic: nothing moves
    overflow:  tracker = 0; budget = max(budget - 1, 0)
               if budget == 0: scale = max(f32(scale * backoff), f32(min_scale), 2**-126)
    clean:     tracker += 1
               if tracker == interval:
                   tracker = 0; budget = hysteresis
                   grown = min(f32(scale * growth), f32(max_scale))
                   if grown is finite: scale = grown

Every ``update()`` that follows at least one ``step()``/``unscale_()`` is counted: ``steps``,
``skipped`` (the iteration held inf/NaN), ``growths``/``backoffs`` (the scale went up/down,
``update(new_scale)`` included) and ``consecutive_skips``.

Example:
    >>> ref = Reference(RefConfig(growth_interval=2, hysteresis=2), init_scale=8.0)
    >>> ref.update(overflow=True).scale, ref.update(overflow=True).scale
    (8.0, 4.0)
    >>> ref.update(overflow=False).scale, ref.update(overflow=False).scale
    (4.0, 8.0)
    >>> ref.stats["steps"], ref.stats["skipped"], ref.stats["growths"], ref.stats["backoffs"]
    (4, 2, 1, 1)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

#: The scale never backs off below float32's smallest normal number, where ``1/scale`` stops
#: being exact (issue 27: torch's would, and then unscaled finite gradients into inf/NaN).
LOWEST_SCALE = 2.0**-126


def f32(value: float) -> float:
    """``value`` rounded to the nearest float32 (overflowing to a signed infinity)."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True)
class RefConfig:
    """The policy's configuration, with ampscaler's keyword names and defaults."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float | None = None
    max_scale: float | None = None
    dynamic: bool = True

    def scaler_kwargs(self) -> dict[str, object]:
        """Keyword arguments that build an ``ampscaler.GradScaler`` with this policy."""
        if not self.dynamic:
            from ampscaler import StaticPolicy

            return {"policy": StaticPolicy()}
        return {
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }


@dataclass
class Reference:
    """The scale, growth tracker, hysteresis budget and counters of one scaler."""

    config: RefConfig
    init_scale: float = 2.0**16
    scale: float = field(init=False)
    tracker: int = 0
    budget: int = field(init=False)
    stats: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.scale = f32(self.init_scale)
        self.budget = self.config.hysteresis
        names = ("steps", "skipped", "growths", "backoffs", "consecutive_skips", "spike_skips")
        self.stats = dict.fromkeys((*names, "replays", "flush_skips"), 0)

    def adjust(self, overflow: bool) -> None:
        """Move the policy state only (no counters): one call of ``policy.adjust``."""
        cfg = self.config
        if not cfg.dynamic:
            return
        if overflow:
            self.tracker = 0
            self.budget = max(self.budget - 1, 0)
            if self.budget == 0:
                shrunk = f32(self.scale * cfg.backoff_factor)
                low = LOWEST_SCALE if cfg.min_scale is None else f32(cfg.min_scale)
                self.scale = max(shrunk, low, LOWEST_SCALE)
            return
        self.tracker += 1
        if self.tracker == cfg.growth_interval:
            self.tracker = 0
            self.budget = cfg.hysteresis
            grown = f32(self.scale * cfg.growth_factor)
            if cfg.max_scale is not None:
                grown = min(grown, f32(cfg.max_scale))
            if math.isfinite(grown):
                self.scale = grown

    def update(self, overflow: bool, new_scale: float | None = None) -> Reference:
        """One ``scaler.update(new_scale)`` after an iteration that overflowed or not."""
        old = self.scale
        if new_scale is None:
            self.adjust(overflow)
        else:
            self.scale = f32(new_scale)
        counts = self.stats
        counts["steps"] += 1
        counts["skipped"] += overflow
        counts["growths"] += self.scale > old
        counts["backoffs"] += self.scale < old
        counts["consecutive_skips"] = counts["consecutive_skips"] + 1 if overflow else 0
        return self

    def bounds(self) -> tuple[float, float]:
        """The range the scale must stay in: the bounds rounded to float32."""
        cfg = self.config
        low = LOWEST_SCALE if cfg.min_scale is None else max(f32(cfg.min_scale), LOWEST_SCALE)
        high = math.inf if cfg.max_scale is None else f32(cfg.max_scale)
        return low, high
