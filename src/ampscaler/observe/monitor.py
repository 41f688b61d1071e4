"""The scaler's observers: overflow reports, and records for whoever listens.

:class:`Monitor` is what :class:`~ampscaler.GradScaler` tells about each step and update. It
reads the scaler's :class:`~ampscaler.iteration.Iteration` (the per-optimizer records, the
losses, the outcome) and never changes the step. It

* keeps, per iteration, the overflow reports of optimizers that skipped (localized at once on
  the plain path, where ``step()`` already read the inf flag) and the inf flags of fused
  optimizers (localized only when somebody asks, since reading them is a host sync); the
  module an overflow came from is judged from the events an attached
  :class:`~ampscaler.NonFiniteTracer` left in the iteration's notes;
* lets the :class:`~ampscaler.CollapseWatch` look at the counters every so many updates;
* at ``update()``, when anything consumes records (a sink, :class:`~ampscaler.StepHistory`
  included, or an event callback), reads the iteration's outcome from the device in one host
  sync, with the results an attached :class:`~ampscaler.GradientProbe` left in the notes, and
  hands a :class:`~ampscaler.StepRecord` to the sinks, in the order they were added, then to
  the callbacks.

A sink whose disk is full, or a callback with a bug, raises from inside ``update()``. Were the
error to propagate, every sink and callback after it would get nothing, and training would stop
for the sake of its telemetry: so each consumer is called in turn, and when one raises, the
monitor warns once for that consumer (a :class:`~ampscaler.SinkWarning` that names it and the
error), serves the rest, and keeps calling it at the next steps (a disk that frees up resumes
the log). ``KeyboardInterrupt`` and other non-``Exception`` errors propagate.

The probe and the tracer are hooks of their own (:mod:`ampscaler.hooks`); they meet the monitor
only in the iteration's notes. With no sink and no callback, ``update()`` runs nothing here.

The scaler's calls, in the order of one iteration: :meth:`~Monitor.on_skip` per optimizer
that skipped (known on the host), then :meth:`~Monitor.after_update`, once the counters have
counted the iteration, and :meth:`~Monitor.periodic` when the collapse watch is due.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidConfigError, SinkWarning, warn_at_caller
from ..hooks import Hook, VetoCause
from ..hostcopy import read_values
from . import localize
from .collapse import CollapseAlert, CollapseWatch
from .localize import TRACE_NOTE, NonFiniteTracer, OverflowReport, ParamNames, merge_reports
from .probe import PROBE_NOTE, PendingProbe
from .records import StepRecord
from .sinks import Sink, StepHistory

if TYPE_CHECKING:
    from ..iteration import Iteration, OptimizerRecord, SkipOrigin
    from ..state import LiveState, StepCounters

__all__ = ["EVENTS", "Callback", "CollapseCallback", "Monitor", "RecordCallback"]

EVENTS = ("step", "overflow", "backoff", "growth", "collapse")
#: Events whose callbacks take a StepRecord (the others: "collapse", a CollapseAlert).
RECORD_EVENTS = EVENTS[:4]

RecordCallback = Callable[[StepRecord], Any]
"""What :meth:`Monitor.on` calls with each matching record."""

CollapseCallback = Callable[[CollapseAlert], Any]
"""What :meth:`Monitor.on` calls with a collapse alert (event ``"collapse"``)."""

Callback = RecordCallback | CollapseCallback
"""What :meth:`Monitor.on` calls: with each matching record, or with a collapse alert."""


#: Where the monitor keeps, in ``Iteration.notes``, the reports of the skips localized at the
#: step (by the optimizer's id, in stepping order) and, once resolved, the iteration's report.
_SKIPS, _REPORT = "monitor.skips", "monitor.report"


class Monitor(Hook):
    """Overflow reports, step records for the sinks and callbacks, and the collapse watch.

    A hook (:mod:`ampscaler.hooks`) whose moments follow what is attached: by default only a
    skip known on the host (``on_skip``: localize it) and the collapse watch's checks
    (``periodic``); ``after_update`` once anything consumes records. A clean default iteration
    runs none of it.
    """

    def __init__(self) -> None:
        self.names = ParamNames()
        self._sinks: list[Sink] = []
        self._callbacks: dict[str, list[Callable[[Any], Any]]] = {event: [] for event in EVENTS}
        # The consumers whose failure was reported (held, so that an id is never reused).
        self._failed: list[object] = []
        self.collapse = CollapseWatch()
        self.collapse.callbacks = self._callbacks["collapse"]

    # ------------------------------------------------------------------ configuration

    @property
    def consuming(self) -> bool:
        """Whether anything takes step records (so ``update()`` must read the outcome)."""
        return bool(self._sinks) or any(self._callbacks[event] for event in RECORD_EVENTS)

    def moments(self) -> set[str]:
        """The moments it is due at, given what is attached."""
        due = {"on_skip", "periodic"}
        return due | {"after_update"} if self.consuming else due

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn ``model``'s parameter names."""
        self.names.watch(model, prefix)

    def adopt(self, plugin: object) -> bool:
        """Attach ``plugin`` if it is a collapse watch, which replaces the one in place, or a
        sink, which gets every step record."""
        if isinstance(plugin, CollapseWatch):
            plugin.tally, plugin.callbacks = self.collapse.tally, self.collapse.callbacks
            self.collapse = plugin
            return True
        if isinstance(plugin, Sink):
            self.add_sink(plugin)
            return True
        return False

    def release(self, plugin: object) -> bool:
        """Stop sending records to ``plugin`` if it is one of the sinks (it is not closed)."""
        if not any(sink is plugin for sink in self._sinks):
            return False
        self.remove_sink(plugin)  # type: ignore[arg-type]
        return True

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` on ``event``; returns a function that unregisters it."""
        if event not in EVENTS:
            raise InvalidConfigError(
                f"Unknown event {event!r}; the events are {', '.join(map(repr, EVENTS))}."
            )
        if not callable(fn):
            raise TypeError(f"on() expects a callable taking a StepRecord, got {fn!r}.")
        callbacks = self._callbacks[event]
        callbacks.append(fn)
        self.changed()

        def remove() -> None:
            if fn in callbacks:
                callbacks.remove(fn)
                self.changed()

        return remove

    def add_sink(self, sink: Sink) -> None:
        """Send every step record to ``sink.write``."""
        if not isinstance(sink, Sink):
            raise TypeError(
                f"add_sink() expects an object with a write(record) method (StepHistory, "
                f"JsonlSink, TensorBoardSink, LoggingSink, ...), got {type(sink).__name__}."
            )
        self._sinks.append(sink)
        self.changed()

    def remove_sink(self, sink: Sink) -> None:
        """Stop sending records to ``sink`` (it is not closed)."""
        if sink not in self._sinks:
            raise ValueError(f"{sink!r} is not attached to this scaler; see scaler.attach().")
        self._sinks.remove(sink)
        self.changed()

    @property
    def history(self) -> list[StepRecord]:
        """The records of the first :class:`~ampscaler.StepHistory` added, oldest first (empty
        without one)."""
        return next((s.records for s in self._sinks if isinstance(s, StepHistory)), [])

    # ------------------------------------------------------------------ the moments

    def on_skip(self, iteration: Iteration, record: OptimizerRecord, live: LiveState) -> None:
        """A skip known on the host: localize it now, while the gradients are as the check saw
        them (host syncs, on skipped steps only); at the scale's floor, warn now."""
        counters = live.counters
        step = int(counters.steps.item())
        origin = iteration.loss_origin() if record.origin is None else record.origin
        report = self._localize([record.optimizer], step, iteration, origin)
        iteration.notes.setdefault(_SKIPS, {})[id(record.optimizer)] = report
        self.collapse.note_skip(report, lambda: int(counters.consecutive_skips.item()))

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """Emit the iteration's record, with the results a probe left in its notes (due only
        while anything consumes records)."""
        pending: PendingProbe | None = iteration.notes.get(PROBE_NOTE)
        found_inf, old_scale, new_scale = iteration.found_inf, iteration.scale, iteration.new_scale
        assert found_inf is not None and old_scale is not None and new_scale is not None
        # The record's spike and flushed: the flags of the guards' and the meter's vetoes.
        vetoes = [iteration.vetoes.get(cause) for cause in (VetoCause.GUARD, VetoCause.FLUSHED)]
        flags = [torch.zeros_like(found_inf) if veto is None else veto.flag for veto in vetoes]
        outcome = [t.to(old_scale.device, found_inf.dtype) for t in (found_inf, *flags)]
        tensors = [torch.stack([*outcome, old_scale, new_scale]), live.counters.steps]
        if pending is not None:
            tensors += [t.to(old_scale.device) for t in pending.values]
        read = read_values(tensors)  # the one host sync
        found, spike_flag, flush_flag, old, new = read[0]
        step = int(read[1]) - 1
        skipped = found > 0
        record = StepRecord(
            step=step,
            scale=old,
            new_scale=new,
            skipped=skipped,
            time=time.time(),
            overflow=self._resolve(iteration, step) if skipped else None,
            probe=None if pending is None else pending.finish(read[2:], old),
            spike=not skipped and spike_flag > 0,
            flushed=not skipped and flush_flag > 0,
            attempt=iteration.attempt,
        )
        for sink in self._sinks:
            self._hand(sink.write, record, sink)
        happened = (True, record.skipped, record.backed_off, record.grew)  # RECORD_EVENTS'
        for event, due in zip(RECORD_EVENTS, happened, strict=True):
            for fn in list(self._callbacks[event]) if due else ():
                self._hand(fn, record, fn)

    def periodic(self, iteration: Iteration, live: LiveState, updates: int) -> int:
        """The collapse watch looks at the counters when it has work."""
        return self.collapse.periodic(iteration, live, updates)

    def _hand(
        self, consumer: Callable[[StepRecord], object], record: StepRecord, owner: object
    ) -> None:
        """Call ``consumer(record)``; if it raises, warn once for ``owner`` (the sink whose
        method ``consumer`` is, or the callback) and return (module docstring)."""
        try:
            consumer(record)
        except Exception as error:
            if any(seen is owner for seen in self._failed):
                return
            self._failed.append(owner)
            warn_at_caller(
                f"{owner!r} raised {type(error).__name__}: {error} at step {record.step}. The "
                "other sinks and callbacks were served, and it will still be called at the next "
                "steps; this is reported once. Fix it, or detach it (scaler.detach(sink), or the "
                "function scaler.on() returned).",
                SinkWarning,
            )

    # ------------------------------------------------------------------ overflow reports

    def _localize(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        step: int,
        iteration: Iteration,
        origin: SkipOrigin,
    ) -> OverflowReport:
        """Localize an overflow of ``optimizers`` at ``iteration``'s scale (host syncs) and
        count the report in the collapse watch's tally."""
        scale = 1.0 if iteration.scale is None else float(iteration.scale.item())
        report = localize.locate_overflow(
            optimizers, self.names, step=step, scale=scale, cause=origin.cause
        )
        report = dataclasses.replace(report, ranks=origin.ranks, micro_batch=origin.micro_batch)
        self.collapse.tally.add(report)
        return report

    def _resolve(self, iteration: Iteration, step: int) -> OverflowReport | None:
        """The iteration's overflow report: the skips localized at the step, and the fused
        optimizers' flags read and localized now (once); its origin judged from the tracer's
        events, if one left them."""
        notes = iteration.notes
        if _REPORT in notes:
            return notes[_REPORT]  # type: ignore[no-any-return]
        localized = notes.get(_SKIPS, {})
        reports = list(localized.values())
        overflowed = [  # the fused optimizers' (their flags stayed on the device)
            record.optimizer
            for key, record in iteration.records.items()
            if key not in localized
            and record.outcome is not None
            and record.outcome.reason == "nonfinite"
        ]
        if overflowed and iteration.scale is not None:
            reports.append(self._localize(overflowed, step, iteration, iteration.loss_origin()))
        events = notes.get(TRACE_NOTE)
        if reports and events is not None:
            origin = NonFiniteTracer.origin(events)
            reports[0] = dataclasses.replace(reports[0], origin=origin)
        merged = notes[_REPORT] = merge_reports(reports) if reports else None
        return merged

    def last_overflow(
        self, iteration: Iteration | None, in_progress: bool, counters: StepCounters | None
    ) -> OverflowReport | None:
        """The overflow of ``iteration`` (the one in progress, or the last one that ended;
        ``None``: none yet).

        On the fused path the first read is a host sync (it reads the inf flags) and localizes
        then: read it before ``optimizer.zero_grad()``.
        """
        if iteration is None:
            return None
        done = 0 if counters is None else int(counters.steps.item())
        return self._resolve(iteration, done if in_progress else done - 1)

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        # Sinks, callbacks and watched names belong to this process and this object; a copy
        # keeps the history and the collapse watch's settings, and is watched and given sinks
        # anew.
        return {
            "histories": [sink for sink in self._sinks if isinstance(sink, StepHistory)],
            "collapse": self.collapse.fresh(),
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        for history in state["histories"]:
            self.add_sink(history)
        self.adopt(state["collapse"])
