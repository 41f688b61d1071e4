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
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from ..errors import InvalidConfigError
from ..hostcopy import read_values
from ..taps import WatchedModels
from . import localize
from .collapse import CollapseAlert, CollapseWatch, OverflowTally, snapshot_of
from .delivery import Delivery
from .localize import NonFiniteTracer, OverflowReport, ParamNames, TraceEvent, merge_reports
from .probe import GradientProbe, PendingProbe
from .records import StepRecord
from .sinks import Sink, StepHistory

if TYPE_CHECKING:
    from ..iteration import Iteration, SkipOrigin
    from ..state import StepCounters

__all__ = ["EVENTS", "Attachable", "Callback", "CollapseCallback", "Monitor", "RecordCallback"]

EVENTS = ("step", "overflow", "backoff", "growth", "collapse")
#: Events whose callbacks take a StepRecord (the others: "collapse", a CollapseAlert).
RECORD_EVENTS = EVENTS[:4]

RecordCallback = Callable[[StepRecord], Any]
"""What :meth:`Monitor.on` calls with each matching record."""

CollapseCallback = Callable[[CollapseAlert], Any]
"""What :meth:`Monitor.on` calls with a collapse alert (event ``"collapse"``)."""

Callback = RecordCallback | CollapseCallback
"""What :meth:`Monitor.on` calls: with each matching record, or with a collapse alert."""

Attachable: TypeAlias = GradientProbe | NonFiniteTracer | CollapseWatch
"""What :meth:`Monitor.attach` takes: one probe and one tracer at most; a collapse watch
replaces the one in place."""


@dataclass
class _Observed:
    """What the observers derived from one iteration of the scaler."""

    iteration: Iteration | None = None
    reports: list[OverflowReport] = field(default_factory=list)
    # Fused optimizers and their inf flags on the device, read only on demand.
    fused: list[tuple[torch.optim.Optimizer, torch.Tensor]] = field(default_factory=list)
    trace: list[TraceEvent] | None = None
    resolved: bool = False
    report: OverflowReport | None = None
    # Optimizers whose overflow was localized at unscale_(), before anything changed their
    # gradients (clipping turns inf into NaN).
    checked: set[int] = field(default_factory=set)


#: What :meth:`Monitor.after_update` keeps for an iteration in which nothing was noted (no
#: skip, nothing traced): resolved, with no report.
_NOTHING_OBSERVED = _Observed(resolved=True)


class Monitor:
    """Per-iteration overflow bookkeeping; the probe, tracer, sinks and callbacks attached.

    Args:
        enabled: whether the scaler is enabled; a disabled one takes attachments but registers
            no hooks.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.names = ParamNames()
        self._enabled = enabled
        self._sinks: list[Sink] = []
        self._callbacks: dict[str, list[Callback]] = {event: [] for event in RECORD_EVENTS}
        self._collapse_callbacks: list[Callable[[CollapseAlert], Any]] = []
        self._record_callbacks = 0  # how many are registered in _callbacks
        self._delivery = Delivery()  # a failing sink or callback starves no other
        self._probe: GradientProbe | None = None
        self._tracer: NonFiniteTracer | None = None
        self.collapse = CollapseWatch()
        self.tally = OverflowTally()
        self._models = WatchedModels()
        self._current = _Observed()
        self._finished = _Observed()

    # ------------------------------------------------------------------ configuration

    @property
    def consuming(self) -> bool:
        """Whether anything takes step records (so ``update()`` must read the outcome)."""
        return bool(self._sinks) or self._record_callbacks > 0

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn ``model``'s parameter names; the probe and tracer tap its modules."""
        self.names.watch(model, prefix)
        if not self._enabled:
            return
        self._models.add(model, prefix)
        for observer in (self._probe, self._tracer):
            if observer is not None:
                observer.watch(model, prefix)

    def attach(self, observer: Attachable) -> None:
        """Attach a probe or a tracer (one of each), which taps the models watched so far and
        from now on; or a collapse watch, which replaces the one in place.

        Raises:
            InvalidConfigError: (a ``ValueError``) one of its kind is attached already.
            TypeError: ``observer`` is neither.
        """
        if isinstance(observer, CollapseWatch):
            self.collapse = observer
            return
        if isinstance(observer, GradientProbe):
            if self._probe is not None:
                raise InvalidConfigError(
                    f"This scaler already has {self._probe!r} attached; it takes one probe. "
                    "Attach a single GradientProbe with the period you want."
                )
            self._probe = observer
        elif isinstance(observer, NonFiniteTracer):
            if self._tracer is not None:
                raise InvalidConfigError(
                    "This scaler already has a NonFiniteTracer attached; one tracer covers "
                    "every watched model."
                )
            self._tracer = observer
        else:
            raise TypeError(
                f"attach() takes a GradientProbe, a NonFiniteTracer or a CollapseWatch, got "
                f"{type(observer).__name__}; objects that take step records go to add_sink()."
            )
        if self._enabled:
            for model, prefix in self._models:
                observer.watch(model, prefix)

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` on ``event``; returns a function that unregisters it."""
        if event not in EVENTS:
            raise InvalidConfigError(
                f"Unknown event {event!r}; the events are {', '.join(map(repr, EVENTS))}."
            )
        if not callable(fn):
            raise TypeError(f"on() expects a callable taking a StepRecord, got {fn!r}.")
        if event == "collapse":
            collapse = self._collapse_callbacks
            collapse.append(fn)  # type: ignore[arg-type]  # "collapse" takes alerts

            def stop_collapse() -> None:
                if fn in collapse:
                    collapse.remove(fn)

            return stop_collapse
        callbacks = self._callbacks[event]
        callbacks.append(fn)
        self._record_callbacks += 1

        def remove() -> None:
            if fn in callbacks:
                callbacks.remove(fn)
                self._record_callbacks -= 1

        return remove

    def add_sink(self, sink: Sink) -> None:
        """Send every step record to ``sink.write``."""
        if not isinstance(sink, Sink):
            raise TypeError(
                f"add_sink() expects an object with a write(record) method (StepHistory, "
                f"JsonlSink, TensorBoardSink, LoggingSink, ...), got {type(sink).__name__}."
            )
        self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        """Stop sending records to ``sink`` (it is not closed)."""
        if sink not in self._sinks:
            raise ValueError(f"{sink!r} is not attached to this scaler; see scaler.add_sink().")
        self._sinks.remove(sink)

    @property
    def history(self) -> list[StepRecord]:
        """The records of the first :class:`~ampscaler.StepHistory` added, oldest first (empty
        without one)."""
        for sink in self._sinks:
            if isinstance(sink, StepHistory):
                return sink.records
        return []

    # ------------------------------------------------------------------ the scaler's calls

    def before_check(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
        """Called with the scaled gradients, before they are checked; the probe measures when
        due."""
        if self._probe is not None:
            self._probe.measure(optimizer, scale)

    def note_check(
        self,
        iteration: Iteration,
        optimizer: torch.optim.Optimizer,
        counters: StepCounters | None,
    ) -> None:
        """``unscale_()`` found inf/NaN in ``optimizer``'s gradients: localize now, while they
        are as the check saw them (host syncs, on overflowing checks only); the step that
        follows reports it."""
        observed = self._observe(iteration)
        self.note_step(iteration, optimizer, True, counters)
        observed.checked.add(id(optimizer))

    def note_step(
        self,
        iteration: Iteration,
        optimizer: torch.optim.Optimizer,
        found_inf: bool | torch.Tensor,
        counters: StepCounters | None,
        origin: SkipOrigin | None = None,
    ) -> None:
        """Record one ``step()``: a known outcome (plain path) or a device flag (fused path).

        A known skip is localized now, while the gradients are certainly there (host syncs,
        on skipped steps only); ``origin`` says where it came from (its cause, and with a
        process group the ranks, the same on every rank). A flag is read when the overflow
        is asked for, up to the end of the next iteration: it must not change before then.
        """
        if isinstance(found_inf, torch.Tensor):
            self._observe(iteration).fused.append((optimizer, found_inf))
            return
        if not found_inf:
            return  # a clean plain step: nothing to note
        observed = self._observe(iteration)
        if id(optimizer) not in observed.checked:
            step = 0 if counters is None else int(counters.steps.item())
            events = None if self._tracer is None else self._tracer.events
            scale = 1.0 if iteration.scale is None else float(iteration.scale.item())
            report = self._localize([optimizer], step, scale, events, iteration, origin)
            observed.reports.append(report)
            self.tally.add(report)
            if counters is not None:  # at the scale's floor: warn now, before a step runs there
                seen = counters
                self.collapse.note_skip(
                    report,
                    lambda: int(seen.consecutive_skips.item()),
                    self.tally,
                    self._collapse_callbacks,
                )

    def after_update(self, iteration: Iteration, counters: StepCounters, compiling: bool) -> None:
        """End the iteration: emit its record if anything consumes records; move the probe
        and the collapse watch on (not under ``torch.compile``: ``compiling``, as the caller
        knows it).

        ``iteration`` holds its outcome (``found_inf``, ``spiked``, the scale it ran at as a
        copy, and the live ``new_scale``, read only here); ``counters`` have counted it.
        """
        pending = None if self._probe is None else self._probe.end_iteration()
        if self._tracer is not None:
            self._observe(iteration).trace = self._tracer.take()
        if self._sinks or self._record_callbacks:
            self._emit(iteration, counters, pending)
        # Nothing noted in the iteration: nothing to report. Nothing of it is held once the
        # next one ends (its optimizers, its losses).
        current = self._current
        if current.iteration is iteration:
            self._finished, self._current = current, _NOTHING_OBSERVED
        else:
            self._finished = _NOTHING_OBSERVED
        if not compiling and self.collapse.due():
            new_scale = iteration.new_scale
            assert new_scale is not None  # set by update()
            self.collapse.look(
                lambda: snapshot_of(counters, new_scale),
                self.tally,
                self._collapse_callbacks,
                lambda: iteration.loss_origin().cause,
            )

    def _observe(self, iteration: Iteration) -> _Observed:
        current = self._current
        if current.iteration is not iteration:
            current = self._current = _Observed(iteration)
        return current

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
            overflow=self._resolve(self._current, lambda: step) if skipped else None,
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
        iteration: Iteration | None,
        origin: SkipOrigin | None = None,
    ) -> OverflowReport:
        if origin is None and iteration is not None:
            origin = iteration.loss_origin()
        report = localize.locate_overflow(
            optimizers,
            self.names,
            step=step,
            scale=scale,
            origin=None if events is None else NonFiniteTracer.origin(events),
            cause=None if origin is None else origin.cause,
        )
        if origin is None:
            return report
        return dataclasses.replace(report, ranks=origin.ranks, micro_batch=origin.micro_batch)

    def _resolve(self, observed: _Observed, step: Callable[[], int]) -> OverflowReport | None:
        if observed.resolved:
            return observed.report
        reports = list(observed.reports)
        overflowed = [opt for opt, flag in observed.fused if bool(flag.item())]
        iteration = observed.iteration
        if overflowed and iteration is not None and iteration.scale is not None:
            events = observed.trace
            if events is None and self._tracer is not None:
                events = self._tracer.events
            scale = float(iteration.scale.item())
            report = self._localize(overflowed, step(), scale, events, iteration)
            reports.append(report)
            self.tally.add(report)
        observed.report = merge_reports(reports) if reports else None
        observed.resolved = True
        return observed.report

    def last_overflow(
        self, current: Iteration, counters: StepCounters | None
    ) -> OverflowReport | None:
        """The overflow of the iteration in progress (``current``) if it stepped, else of the
        last one.

        On the fused path the first read is a host sync (it reads the inf flags) and localizes
        then: read it before ``optimizer.zero_grad()``.
        """
        in_progress = current.stepped
        observed = self._observe(current) if in_progress else self._finished

        def step() -> int:
            done = 0 if counters is None else int(counters.steps.item())
            return done if in_progress else done - 1

        return self._resolve(observed, step)

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
            self.attach(observer)
