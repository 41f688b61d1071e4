"""Early warning: the scale falling far below its running maximum, or skips piling up.

A run whose scale collapses (pytorch#70346, DeepSpeed#931, the BigScience 104B chronicles)
first skips more and more steps while the scale falls towards 1 and below; by the time
``PersistentOverflowError`` or a NaN loss stops it, the cause is long gone from the logs.
:class:`CollapseWatch` looks every ``window`` iterations at two numbers:

* the scale against the largest scale seen at the end of earlier windows: below
  ``scale_drop`` times that maximum is a collapse (the descent from ``init_scale`` in the first
  window does not count: the maximum starts at the first window's end);
* the fraction of the window's iterations that were skipped for inf/NaN: at or above
  ``skip_rate`` is a collapse.

On entering a collapse it calls the scaler's ``"collapse"`` callbacks with a
:class:`CollapseAlert` and, the first time, logs one warning on the ``ampscaler`` logger that
names the causes counted so far (``loss`` or ``gradients``, see
:attr:`OverflowReport.cause <ampscaler.OverflowReport.cause>`) and the parameters seen most
often in overflow reports. It fires again only after the run has recovered at a later check.

The end of a collapse is the scale's floor, :data:`~ampscaler.policy.LOWEST_SCALE` (``2**-126``):
the scaler never goes below it (below it unscaling writes inf/NaN into finite gradients), so
from there on backing off cannot help, and a finite step at that scale loses nearly every
float16 gradient to underflow. Reaching it the first time warns at once with a
:class:`~ampscaler.ScaleFloorWarning` (and each time calls the ``"collapse"`` callbacks with
the reason ``"floor"``), saying how many steps in a row were skipped and in how many of them
the loss itself was already inf/NaN, whatever ``log`` says. Non-fused optimizers hear it at the
latest in the ``step()`` that skips at the floor, which has read its verdict and the scale
anyway.
During a collapse whose scale has fallen below ``2**-64`` the watch looks after every update,
so every optimizer hears it after the update that reached the floor, before a step runs there
(on CUDA, once that update's non-blocking copy has landed); otherwise fused optimizers, which
never wait for their verdict, hear it at the next window's end.

Cost: every ``window`` updates the counters and the scale are copied to the host without
waiting (on CUDA a non-blocking copy into pinned memory, read once it has landed; on the CPU a
read of host memory). Nothing is read on the other updates, and nothing under
``torch.compile``. During a collapse below ``2**-64`` the copy is taken after every update,
until the floor is seen. A non-fused step skipped at the floor reads one counter more, with the
reads that skipped step makes anyway.

Example:
    >>> watch = CollapseWatch(scale_drop=2.0**-8, skip_rate=0.5, window=50)
    >>> watch
    CollapseWatch(scale_drop=0.00390625, skip_rate=0.5, window=50, log=True)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..arguments import check_switch
from ..errors import InvalidConfigError, ScaleFloorWarning, warn_at_caller
from ..hostcopy import HostCopy
from ..policy.base import LOWEST_SCALE, require_int, require_number
from .localize import OverflowReport

if TYPE_CHECKING:
    from ..iteration import Iteration
    from ..state import LiveState

__all__ = ["CollapseAlert", "CollapseWatch", "OverflowTally"]

logger = logging.getLogger("ampscaler")

#: Below this scale a collapsing run is looked at after every update, so that reaching the
#: floor (``2**-126``) is seen at once (a non-blocking copy per update, during a collapse only).
NEAR_FLOOR = 2.0**-64


class OverflowTally:
    """What the overflow reports of a run said so far: causes and parameters, counted, and the
    latest run of skipped steps whose loss was already inf/NaN."""

    def __init__(self) -> None:
        self.causes: Counter[str] = Counter()
        self.parameters: Counter[str] = Counter()
        #: Reported steps in a row whose loss was inf/NaN, up to the latest report.
        self.loss_run = 0
        self._last_step: int | None = None

    def add(self, report: OverflowReport) -> None:
        """Count one iteration's report."""
        self.causes[report.cause or "unknown"] += 1
        self.parameters.update(report.names)
        if report.step != self._last_step:  # several optimizers report the same step
            consecutive = self._last_step is not None and report.step == self._last_step + 1
            nonfinite_loss = report.cause == "loss"
            self.loss_run = (self.loss_run if consecutive else 0) + 1 if nonfinite_loss else 0
            self._last_step = report.step


@dataclass(frozen=True)
class CollapseAlert:
    """What :class:`CollapseWatch` saw when it decided the run is collapsing.

    Attributes:
        first_step: the first step of the window checked.
        last_step: its last step.
        scale: the scale at the end of the window.
        max_scale: the largest scale seen at the end of an earlier window.
        skip_rate: the fraction of the window's iterations skipped for inf/NaN.
        reasons: ``"scale"`` (far below its maximum) and/or ``"skip_rate"``; or ``"floor"``
            alone: the scale reached ``2**-126``, where it cannot back off further (then
            ``first_step`` to ``last_step`` are the steps skipped in a row up to it).
        causes: overflow reports so far by cause (``"loss"``, ``"gradients"``, ``"unknown"``).
        parameters: the parameters seen most often in overflow reports, with their counts.
        in_a_row: with ``"floor"``: the steps skipped in a row up to ``last_step``.
        loss_in_a_row: with ``"floor"``: of those, the latest ones whose loss was already
            inf/NaN before scaling (as far as reports say: non-fused optimizers report every
            skip; fused ones only when asked).
    """

    first_step: int
    last_step: int
    scale: float
    max_scale: float
    skip_rate: float
    reasons: tuple[str, ...]
    causes: dict[str, int] = field(default_factory=dict)
    parameters: list[tuple[str, int]] = field(default_factory=list)
    in_a_row: int = 0
    loss_in_a_row: int = 0

    def __str__(self) -> str:
        if self.reasons == ("floor",):
            return self._floor_text()
        found = []
        if "scale" in self.reasons:
            found.append(
                f"the scale fell to {self.scale:g}, 2^{math.log2(self.max_scale / self.scale):.0f}"
                f" below its running maximum {self.max_scale:g}"
            )
        if "skip_rate" in self.reasons:
            found.append(f"{self.skip_rate:.0%} of the steps were skipped")
        causes = ", ".join(f"{n} {c}" for c, n in sorted(self.causes.items())) or "none localized"
        named = ", ".join(f"{name} ({n})" for name, n in self.parameters) or "none named"
        hint = (
            " Most overflows came with a non-finite loss: lowering the scale cannot help; check "
            "the inputs and activations that exceed float16's 65504, or lower the learning rate."
            if self.causes.get("loss", 0) > self.causes.get("gradients", 0)
            else " Lower the learning rate or clip gradients; if the scale keeps falling, train "
            "in bfloat16, or raise min_scale to stop the descent."
        )
        return (
            f"ampscaler: the loss scale is collapsing at steps {self.first_step}-"
            f"{self.last_step}: {' and '.join(found)}. Overflow causes so far: {causes}; "
            f"parameters seen most often: {named}.{hint}"
        )

    def _floor_text(self) -> str:
        if self.in_a_row:
            skipped = (
                f"; the last {self.in_a_row} step(s) in a row (steps {self.first_step}-"
                f"{self.last_step}) were skipped for inf/NaN"
            )
        else:
            skipped = "; the latest step was not skipped"
        losses = self.loss_in_a_row
        if losses:
            which = "the latest" if losses == 1 else f"the last {losses}"
            loss = (
                f" In {'all' if losses >= self.in_a_row else which} of them the loss itself was "
                "already inf/NaN before it was scaled: lowering the scale cannot help."
            )
        else:
            causes = ", ".join(f"{n} {c}" for c, n in sorted(self.causes.items()))
            loss = f" Overflow causes so far: {causes}." if causes else ""
        return (
            f"ampscaler: at step {self.last_step} the scale is 2**-126, the lowest the scaler "
            "keeps (float32's smallest normal number: below it unscaling would write inf/NaN "
            f"into finite gradients){skipped}.{loss} No step was taken with inf/NaN gradients, "
            "and such steps are still skipped, but a finite step at this scale loses nearly "
            "every float16 gradient to underflow. Fix the cause (inputs or labels with inf/NaN, "
            "activations beyond float16's 65504, a learning rate that diverged) and resume from "
            "a checkpoint taken before the skips began; to stop here, set "
            "max_consecutive_skips=N (PersistentOverflowError) or turn this warning into an "
            "error: warnings.simplefilter('error', ampscaler.ScaleFloorWarning)."
        )


@dataclass(eq=False)
class CollapseWatch:
    """Decides, every ``window`` iterations, whether the scale is collapsing (module docstring).

    Every scaler has one with the defaults; ``scaler.attach(CollapseWatch(...))`` replaces it.

    Args:
        scale_drop: a scale below ``scale_drop`` times its running maximum is a collapse
            (in (0, 1); ``None``: do not watch the scale). The default, ``2**-10``, is ten
            backoffs at torch's factor with no growth in between.
        skip_rate: a window with at least this fraction of skipped iterations is a collapse
            (in (0, 1]; ``None``: do not watch skips). Healthy runs skip one step in
            thousands.
        window: iterations between checks (>= 10).
        log: log one warning on the ``ampscaler`` logger at the first collapse.

    Raises:
        InvalidConfigError: (a ``ValueError``) an argument out of range, naming it.
    """

    scale_drop: float | None = 2.0**-10
    skip_rate: float | None = 0.25
    window: int = 100
    log: bool = True

    def __post_init__(self) -> None:
        scale_drop, skip_rate = self.scale_drop, self.skip_rate
        if scale_drop is not None and not 0 < require_number("scale_drop", scale_drop) < 1:
            raise InvalidConfigError(
                f"scale_drop must be a number in (0, 1) or None, got {scale_drop!r}."
            )
        if skip_rate is not None and not 0 < require_number("skip_rate", skip_rate) <= 1:
            raise InvalidConfigError(
                f"skip_rate must be a number in (0, 1] or None, got {skip_rate!r}."
            )
        self.window = require_int("window", self.window, 10)
        check_switch("log", self.log)
        self._updates = 0
        self._pending: HostCopy | None = None
        self._last = (0.0, 0.0)  # (steps, skipped) at the last check
        self._max_scale: float | None = None
        self._collapsing = False
        self._logged = False
        self._at_floor = False  # told of the scale's current stay at the floor
        self._warned = False  # a ScaleFloorWarning was issued (once per scaler)
        self._window_ended: int | None = None  # the update that ended a window not yet judged
        self._last_scale = math.inf  # the scale in the latest copy
        #: What the overflow reports said so far (the scaler's monitor counts them here).
        self.tally = OverflowTally()
        #: The scaler's ``"collapse"`` callbacks, called with each alert.
        self.callbacks: list[Callable[[CollapseAlert], Any]] = []

    @property
    def active(self) -> bool:
        """Whether it watches anything."""
        return self.scale_drop is not None or self.skip_rate is not None

    def periodic(self, iteration: Iteration, live: LiveState, updates: int) -> int:
        """Count ``updates`` more updates and look when there is work: a window ended; during a
        collapse, every update until the scale is at its floor; or a copy is on its way.

        Looking starts copying the counters and the scale to the host; once a copy has landed
        (never waits), it judges the window that ended before it and checks the floor (asking
        ``iteration`` its cause only on reaching it: that may read the device). Returns how
        many updates from now it is due next: one while a copy is on its way or a collapse is
        on, else the rest of the window (the monitor's :meth:`~ampscaler.hooks.Hook.periodic`).
        """
        before = self._updates
        updates = self._updates = before + updates
        if updates // self.window > before // self.window:
            self._window_ended = updates - updates % self.window
        # During a collapse whose scale was last seen below 2**-64, look after every update
        # until the floor is seen.
        nearing_floor = self._collapsing and not self._at_floor and self._last_scale < NEAR_FLOOR
        if self._pending is not None or (
            self.active and (self._window_ended is not None or nearing_floor)
        ):
            self._look(live, lambda: iteration.loss_origin().cause)
        if self._pending is not None or self._collapsing:
            return 1
        return self.window - updates % self.window

    def _look(self, live: LiveState, latest_cause: Callable[[], str | None]) -> None:
        if self._pending is None:
            # The steps, skipped and consecutive_skips counters and the float32 scale's bits,
            # as one int64 tensor (exact, and no float64 on the device).
            values = live.counters.values
            bits = live.scale.reshape(1).view(torch.int32).to(torch.int64)
            snapshot = torch.cat([values[:2], values[4:5], bits])
            self._pending = HostCopy(snapshot, self._updates)
        pending = self._pending
        if pending.landed():
            self._pending = None
            steps, skipped, in_a_row, bits = pending.tolist()
            scale = self._last_scale = struct.unpack("<f", struct.pack("<i", bits))[0]
            if self._window_ended is not None and pending.at >= self._window_ended:
                self._window_ended = None
                self._judge(steps, skipped, scale)
            self._check_floor(int(steps) - 1, int(in_a_row), scale, latest_cause)

    def note_skip(self, report: OverflowReport, in_a_row: Callable[[], int]) -> None:
        """A step was skipped, known on the host (the non-fused path, whose ``step()`` read its
        verdict): if it ran at the floor, warn now, before any step runs there.
        ``in_a_row()`` gives the skipped steps in a row before this one (read only then: a
        host sync on a skipped step, which syncs anyway); :attr:`tally` has counted ``report``."""
        if report.scale > LOWEST_SCALE:
            self._at_floor = False
        elif not self._at_floor:
            cause = report.cause
            self._check_floor(report.step, in_a_row() + 1, report.scale, lambda: cause)

    def _check_floor(
        self, step: int, in_a_row: int, scale: float, latest_cause: Callable[[], str | None]
    ) -> None:
        """Call :attr:`callbacks` with the alert once per stay at the floor, and warn
        (:class:`~ampscaler.ScaleFloorWarning`) at the first. How many of the ``in_a_row``
        skips came with a non-finite loss: as the reports say, or at least the latest by
        ``latest_cause()``."""
        if scale > LOWEST_SCALE:
            self._at_floor = False
            return
        if self._at_floor:
            return
        self._at_floor = True
        loss_in_a_row = min(self.tally.loss_run, in_a_row)
        if in_a_row and not loss_in_a_row and latest_cause() == "loss":
            loss_in_a_row = 1
        alert = CollapseAlert(
            first_step=step - in_a_row + 1 if in_a_row else step,
            last_step=step,
            scale=scale,
            max_scale=self._max_scale or scale,
            skip_rate=1.0 if in_a_row else 0.0,
            reasons=("floor",),
            causes=dict(self.tally.causes),
            parameters=self.tally.parameters.most_common(5),
            in_a_row=in_a_row,
            loss_in_a_row=loss_in_a_row,
        )
        if not self._warned:  # a scale that leaves the floor and returns warns no more
            self._warned = True
            warn_at_caller(str(alert), ScaleFloorWarning)
        for fn in list(self.callbacks):
            fn(alert)

    def _judge(self, steps: float, skipped: float, scale: float) -> None:
        last_steps, last_skipped = self._last
        self._last = (steps, skipped)
        done = steps - last_steps
        rate = (skipped - last_skipped) / done if done > 0 else 0.0
        reference = self._max_scale
        self._max_scale = scale if reference is None else max(reference, scale)
        scale_drop, skip_rate = self.scale_drop, self.skip_rate
        reasons = []
        if scale_drop is not None and reference is not None and scale < reference * scale_drop:
            reasons.append("scale")
        if skip_rate is not None and done > 0 and rate >= skip_rate:
            reasons.append("skip_rate")
        was_collapsing, self._collapsing = self._collapsing, bool(reasons)
        if not reasons or was_collapsing:
            return
        alert = CollapseAlert(
            first_step=int(last_steps),
            last_step=int(steps) - 1,
            scale=scale,
            max_scale=self._max_scale,
            skip_rate=rate,
            reasons=tuple(reasons),
            causes=dict(self.tally.causes),
            parameters=self.tally.parameters.most_common(5),
        )
        if self.log and not self._logged:
            self._logged = True
            logger.warning("%s", alert)
        for fn in list(self.callbacks):
            fn(alert)

    def fresh(self) -> CollapseWatch:
        """A watch with the same settings that has seen nothing (for a copied scaler)."""
        return dataclasses.replace(self)
