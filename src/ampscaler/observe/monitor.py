"""The scaler's observers: overflow reports, and records for whoever listens.

:class:`Monitor` is what :class:`~ampscaler.GradScaler` tells about each step and update. It
reads the scaler's :class:`~ampscaler.iteration.Iteration` (the per-optimizer records, the
losses, the outcome) and never changes the step. It

* keeps, per iteration, the overflow reports of optimizers that skipped (localized at once on
  the plain path, where ``step()`` already read the inf flag) and the inf flags of fused
  optimizers (localized only when somebody asks, since reading them is a host sync);
* drives what is attached to it: a :class:`~ampscaler.GradientProbe` measures on its
  iterations, a :class:`~ampscaler.NonFiniteTracer` names the module an overflow came from,
  the :class:`~ampscaler.CollapseWatch` looks at the counters every so many updates;
* at ``update()``, when anything consumes records (a sink, :class:`~ampscaler.StepHistory`
  included, or an event callback), reads the iteration's outcome from the device in one host
  sync and hands a :class:`~ampscaler.StepRecord` to the sinks, in the order they were added,
  then to the callbacks; one that raises is reported once and starves none of the others
  (:mod:`~ampscaler.observe.delivery`).

With no sink, no callback and no probe or tracer, ``update()`` costs a few attribute checks here
and never waits for the device.

The scaler's calls, in the order of one iteration: :meth:`~Monitor.before_check` and
:meth:`~Monitor.note_step` per optimizer, then :meth:`~Monitor.after_update`, once the counters
have counted the iteration.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import InvalidConfigError
from ..hooks import Hook
from ..hostcopy import read_values
from ..taps import WatchedModels
from . import localize
from .collapse import CollapseAlert, CollapseWatch, snapshot_of
from .delivery import Delivery
from .localize import NonFiniteTracer, OverflowReport, ParamNames, TraceEvent, merge_reports
from .probe import GradientProbe, PendingProbe
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


#: Where the monitor keeps what it derived from an iteration, in ``Iteration.notes``.
_NOTE = "monitor"


@dataclass
class _Observed:
    """What the observers derived from one iteration (kept in the iteration's notes)."""

    reports: list[OverflowReport] = field(default_factory=list)
    localized: set[int] = field(default_factory=set)  # ids of the optimizers in reports
    trace: list[TraceEvent] | None = None
    resolved: bool = False
    report: OverflowReport | None = None


def _observed(iteration: Iteration) -> _Observed:
    found: _Observed | None = iteration.notes.get(_NOTE)
    if found is None:
        found = iteration.notes[_NOTE] = _Observed()
    return found


class Monitor(Hook):
    """Overflow reports; the probe, tracer, sinks, callbacks and collapse watch attached.

    A hook (:mod:`ampscaler.hooks`) whose moments follow what is attached: by default only a
    skip known on the host (``on_skip``: localize it) and the collapse watch's checks
    (``periodic``); ``after_update`` once anything consumes records or a probe or tracer is
    attached; ``before_check`` with a probe. A clean default iteration runs none of it.

    Args:
        enabled: whether the scaler is enabled; a disabled one takes attachments but registers
            no hooks.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.names = ParamNames()
        self._enabled = enabled
        self._sinks: list[Sink] = []
        self._callbacks: dict[str, list[Callable[[Any], Any]]] = {event: [] for event in EVENTS}
        self._delivery = Delivery()  # a failing sink or callback starves no other
        self._probe: GradientProbe | None = None
        self._tracer: NonFiniteTracer | None = None
        self.collapse = CollapseWatch()
        self.collapse.callbacks = self._callbacks["collapse"]
        self._models = WatchedModels()

    # ------------------------------------------------------------------ configuration

    @property
    def consuming(self) -> bool:
        """Whether anything takes step records (so ``update()`` must read the outcome)."""
        return bool(self._sinks) or any(self._callbacks[event] for event in RECORD_EVENTS)

    def moments(self) -> set[str]:
        """The moments it is due at, given what is attached."""
        due = {"on_skip", "periodic"}
        if self.consuming or self._probe is not None or self._tracer is not None:
            due.add("after_update")
        if self._probe is not None:
            due.add("before_check")
        return due

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn ``model``'s parameter names; the probe and tracer tap its modules."""
        self.names.watch(model, prefix)
        if not self._enabled:
            return
        self._models.add(model, prefix)
        for observer in (self._probe, self._tracer):
            if observer is not None:
                observer.watch(model, prefix)

    def adopt(self, plugin: object) -> bool:
        """Attach ``plugin`` if it is a probe or a tracer (one of each), which taps the models
        watched so far and from now on, a collapse watch, which replaces the one in place, or a
        sink, which gets every step record.

        Raises:
            InvalidConfigError: (a ``ValueError``) a probe or tracer is attached already.
        """
        if isinstance(plugin, CollapseWatch):
            plugin.tally, plugin.callbacks = self.collapse.tally, self.collapse.callbacks
            self.collapse = plugin
            return True
        if isinstance(plugin, GradientProbe):
            if self._probe is not None:
                raise InvalidConfigError(
                    f"This scaler already has {self._probe!r} attached; it takes one probe. "
                    "Attach a single GradientProbe with the period you want."
                )
            self._probe = plugin
        elif isinstance(plugin, NonFiniteTracer):
            if self._tracer is not None:
                raise InvalidConfigError(
                    "This scaler already has a NonFiniteTracer attached; one tracer covers "
                    "every watched model."
                )
            self._tracer = plugin
        elif isinstance(plugin, Sink):
            self.add_sink(plugin)
            return True
        else:
            return False
        self.changed()
        if self._enabled:
            for model, prefix in self._models:
                plugin.watch(model, prefix)
        return True

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

    def before_check(self, record: OptimizerRecord, scale: torch.Tensor) -> None:
        """The probe measures the scaled gradients when due."""
        if self._probe is not None:
            self._probe.measure(record.optimizer, scale)

    def on_skip(self, iteration: Iteration, record: OptimizerRecord, live: LiveState) -> None:
        """A skip known on the host: localize it now, while the gradients are as the check saw
        them (host syncs, on skipped steps only); at the scale's floor, warn now."""
        counters = live.counters
        step = int(counters.steps.item())
        events = None if self._tracer is None else self._tracer.events
        scale = 1.0 if iteration.scale is None else float(iteration.scale.item())
        origin = iteration.loss_origin() if record.origin is None else record.origin
        report = self._localize([record.optimizer], step, scale, events, origin)
        observed = _observed(iteration)
        observed.reports.append(report)
        observed.localized.add(id(record.optimizer))
        self.collapse.tally.add(report)
        self.collapse.note_skip(report, lambda: int(counters.consecutive_skips.item()))

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """Emit the iteration's record if anything consumes records; move the probe on; keep
        the tracer's events with the iteration."""
        pending = None if self._probe is None else self._probe.end_iteration()
        if self._tracer is not None:
            _observed(iteration).trace = self._tracer.take()
        if self.consuming:
            self._emit(iteration, live.counters, pending)

    def periodic(self, iteration: Iteration, live: LiveState, updates: int) -> int:
        """The collapse watch looks at the counters when it has work."""
        collapse = self.collapse
        if collapse.due(updates):
            new_scale = live.scale
            counters = live.counters
            collapse.look(
                lambda: snapshot_of(counters, new_scale), lambda: iteration.loss_origin().cause
            )
        return collapse.next_due()

    def _emit(
        self, iteration: Iteration, counters: StepCounters, pending: PendingProbe | None
    ) -> None:
        found_inf, old_scale, new_scale = iteration.found_inf, iteration.scale, iteration.new_scale
        assert found_inf is not None and old_scale is not None and new_scale is not None
        spike = torch.zeros_like(found_inf) if iteration.spiked is None else iteration.spiked
        outcome = [found_inf, spike.to(found_inf.dtype), old_scale, new_scale]
        tensors = [torch.stack([t.to(old_scale.device) for t in outcome]), counters.steps]
        if pending is not None:
            tensors.append(pending.values.to(old_scale.device))
        read = read_values(tensors)  # the one host sync
        found, spike_flag, old, new = read[0]
        step = int(read[1]) - 1
        skipped = found > 0
        record = StepRecord(
            step=step,
            scale=old,
            new_scale=new,
            skipped=skipped,
            time=time.time(),
            overflow=self._resolve(iteration, step) if skipped else None,
            probe=None if pending is None else pending.finish(read[2], old),
            spike=not skipped and spike_flag > 0,
            attempt=iteration.attempt,
        )
        delivery = self._delivery
        for sink in self._sinks:
            delivery.hand(sink.write, record, sink)
        fired = [
            ("step", True),
            ("overflow", record.skipped),
            ("backoff", record.backed_off),
            ("growth", record.grew),
        ]
        for event, happened in fired:
            if happened:
                for fn in list(self._callbacks[event]):
                    delivery.hand(fn, record)

    # ------------------------------------------------------------------ overflow reports

    def _localize(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        step: int,
        scale: float,
        events: list[TraceEvent] | None,
        origin: SkipOrigin,
    ) -> OverflowReport:
        report = localize.locate_overflow(
            optimizers,
            self.names,
            step=step,
            scale=scale,
            origin=None if events is None else NonFiniteTracer.origin(events),
            cause=origin.cause,
        )
        return dataclasses.replace(report, ranks=origin.ranks, micro_batch=origin.micro_batch)

    def _resolve(self, iteration: Iteration, step: int) -> OverflowReport | None:
        """The iteration's overflow report: the skips localized at the step, and the fused
        optimizers' flags read and localized now (once)."""
        observed = _observed(iteration)
        if observed.resolved:
            return observed.report
        reports = list(observed.reports)
        overflowed = [  # the fused optimizers' (their flags stayed on the device)
            record.optimizer
            for key, record in iteration.records.items()
            if key not in observed.localized
            and record.outcome is not None
            and record.outcome.reason == "nonfinite"
        ]
        if overflowed and iteration.scale is not None:
            events = observed.trace
            if events is None and self._tracer is not None:
                events = self._tracer.events
            scale = float(iteration.scale.item())
            report = self._localize(overflowed, step, scale, events, iteration.loss_origin())
            reports.append(report)
            self.collapse.tally.add(report)
        observed.report = merge_reports(reports) if reports else None
        observed.resolved = True
        return observed.report

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
        # Sinks, callbacks, hooks and watched models belong to this process and this object;
        # a copy keeps what configures it (the probe's and tracer's settings) and the history,
        # and is watched and given sinks anew.
        return {
            "enabled": self._enabled,
            "histories": [sink for sink in self._sinks if isinstance(sink, StepHistory)],
            "observers": [o for o in (self._probe, self._tracer) if o is not None]
            + [self.collapse.fresh()],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["enabled"])  # type: ignore[misc]
        for history in state["histories"]:
            self.add_sink(history)
        for observer in state["observers"]:
            self.adopt(observer)
