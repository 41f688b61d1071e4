"""The scaler's observer: overflow bookkeeping per iteration, and records for whoever listens.

:class:`Monitor` is what :class:`~ampscaler.GradScaler` tells about each step and update. It

* keeps, per iteration, the overflow reports of optimizers that skipped (localized at once on
  the plain path, where ``step()`` already read the inf flag) and the inf flags of fused
  optimizers (localized only when somebody asks, since reading them is a host sync);
* runs the opt-in underflow probe and non-finite tracer;
* at ``update()``, when anything consumes records (history, a sink, an event callback), reads
  the iteration's outcome from the device in one host sync and hands a
  :class:`~ampscaler.StepRecord` to the history, the sinks and the callbacks, in that order.

With nothing attached and the probe and tracer off, ``update()`` costs a few attribute checks
here and never waits for the device.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from . import diagnostics
from .counters import StepCounters
from .diagnostics import OverflowReport, ParamNames, merge_reports
from .errors import InvalidConfigError
from .probe import GradientProbe, PendingProbe
from .records import StepRecord
from .tracer import NonFiniteTracer, TraceEvent

__all__ = ["EVENTS", "Monitor", "Sink"]

EVENTS = ("step", "overflow", "backoff", "growth")

Callback = Callable[[StepRecord], Any]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(record)``; see :mod:`ampscaler.sinks` for the ready-made ones."""

    def write(self, record: StepRecord) -> None:
        """Take one step record (called at the end of ``update()``)."""


@dataclass
class _Iteration:
    """What one iteration noted about overflow."""

    started: bool = False
    reports: list[OverflowReport] = field(default_factory=list)
    # Fused optimizers: (optimizer, its inf flag on the device, the scale), read only on demand.
    fused: list[tuple[torch.optim.Optimizer, torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    trace: list[TraceEvent] | None = None
    resolved: bool = False
    report: OverflowReport | None = None


def _check_options(history_size: object, probe_every: object, trace_nonfinite: object) -> None:
    if isinstance(history_size, bool) or not isinstance(history_size, int) or history_size < 0:
        raise InvalidConfigError(
            f"history_size must be an int >= 0 (0 keeps no history), got {history_size!r}."
        )
    if probe_every is not None and (
        isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1
    ):
        raise InvalidConfigError(
            f"probe_every must be an int >= 1 or None (no probe), got {probe_every!r}."
        )
    if not isinstance(trace_nonfinite, bool):
        raise InvalidConfigError(f"trace_nonfinite must be True or False, got {trace_nonfinite!r}.")


class Monitor:
    """Per-iteration overflow bookkeeping, probe, tracer, history, sinks and event callbacks.

    Args:
        enabled: whether the scaler is enabled (a disabled one registers no hooks).
        history_size: how many step records to keep in memory (0: none).
        probe_every: probe the gradients on every ``probe_every``-th iteration, counting from
            the first one after construction; ``None`` never.
        trace_nonfinite: tap every watched leaf module to find where non-finite gradients
            first appear in backward.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        history_size: int = 0,
        probe_every: int | None = None,
        trace_nonfinite: bool = False,
    ) -> None:
        _check_options(history_size, probe_every, trace_nonfinite)
        self.names = ParamNames()
        self._enabled = enabled
        self._history_size = history_size
        self._history: deque[StepRecord] | None = (
            deque(maxlen=history_size) if history_size else None
        )
        self._sinks: list[Sink] = []
        self._callbacks: dict[str, list[Callback]] = {event: [] for event in EVENTS}
        self._probe_every = probe_every
        self._trace_nonfinite = trace_nonfinite
        self._probe = GradientProbe() if probe_every is not None and enabled else None
        self._tracer = NonFiniteTracer() if trace_nonfinite and enabled else None
        self._models: list[tuple[weakref.ref[torch.nn.Module], str]] = []
        self._iterations = 0
        self._current = _Iteration()
        self._finished = _Iteration()

    # ------------------------------------------------------------------ configuration

    @property
    def consuming(self) -> bool:
        """Whether anything takes step records (so ``update()`` must read the outcome)."""
        return (
            self._history is not None
            or bool(self._sinks)
            or any(self._callbacks.values())
        )

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn ``model``'s parameter names; tap its modules if the probe or tracer is on."""
        self.names.watch(model, prefix)
        if not self._enabled:
            return
        self._models.append((weakref.ref(model), prefix))
        if self._tracer is not None:
            self._tracer.attach(model, prefix)
        if self._probe is not None and self._probing():
            self._probe.arm([(model, prefix)])

    def _live_models(self) -> list[tuple[torch.nn.Module, str]]:
        alive = [(ref(), prefix) for ref, prefix in self._models]
        self._models = [(weakref.ref(m), p) for m, p in alive if m is not None]
        return [(m, p) for m, p in alive if m is not None]

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

        def remove() -> None:
            if fn in callbacks:
                callbacks.remove(fn)

        return remove

    def add_sink(self, sink: Sink) -> None:
        """Send every step record to ``sink.write``."""
        if not isinstance(sink, Sink):
            raise TypeError(
                f"add_sink() expects an object with a write(record) method (JsonlSink, "
                f"TensorBoardSink, LoggingSink, ...), got {type(sink).__name__}."
            )
        self._sinks.append(sink)

    def remove_sink(self, sink: Sink) -> None:
        """Stop sending records to ``sink`` (it is not closed)."""
        if sink not in self._sinks:
            raise ValueError(f"{sink!r} is not attached to this scaler; see scaler.add_sink().")
        self._sinks.remove(sink)

    @property
    def history(self) -> list[StepRecord]:
        """The kept step records, oldest first (empty when ``history_size`` is 0)."""
        return [] if self._history is None else list(self._history)

    # ------------------------------------------------------------------ the scaler's calls

    def _probing(self) -> bool:
        return self._probe_every is not None and self._iterations % self._probe_every == 0

    def before_check(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
        """Called with the scaled gradients, before they are checked; probes when due."""
        if self._probe is not None and self._probing():
            self._probe.measure(optimizer, scale)

    def note_step(
        self,
        optimizer: torch.optim.Optimizer,
        found_inf: bool | torch.Tensor,
        scale: torch.Tensor,
        counters: StepCounters | None,
    ) -> None:
        """Record one ``step()``: a known outcome (plain path) or a device flag (fused path).

        A known skip is localized now, while the gradients are certainly there (host syncs,
        on skipped steps only).
        """
        current = self._current
        current.started = True
        if isinstance(found_inf, torch.Tensor):
            current.fused.append((optimizer, found_inf, scale))
        elif found_inf:
            step = 0 if counters is None else int(counters.tensor()[0].item())
            events = None if self._tracer is None else self._tracer.events
            current.reports.append(self._localize([optimizer], step, float(scale.item()), events))

    def note_ranks(self, ranks: tuple[int, ...]) -> None:
        """Add the ranks that overflowed to the report of the step just skipped."""
        reports = self._current.reports
        if reports:
            reports[-1] = dataclasses.replace(reports[-1], ranks=ranks)

    def after_update(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        new_scale: torch.Tensor,
        counters: StepCounters,
    ) -> None:
        """End the iteration: emit its record if anything consumes records; re-arm the probe."""
        pending = self._probe.take() if self._probe is not None else None
        if self._tracer is not None:
            self._current.trace = self._tracer.take()
        if self.consuming:
            self._emit(found_inf, old_scale, new_scale, counters, pending)
        self._finished, self._current = self._current, _Iteration()
        self._iterations += 1
        if self._probe is not None:
            due = self._probing()
            if due and not self._probe.armed:
                self._probe.arm(self._live_models())
            elif not due and self._probe.armed:
                self._probe.disarm()

    def _emit(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        new_scale: torch.Tensor,
        counters: StepCounters,
        pending: PendingProbe | None,
    ) -> None:
        device = old_scale.device
        tensors = [found_inf, old_scale, new_scale, counters.tensor()[0]]
        if pending is not None:
            tensors += pending.tensors
        values = torch.stack([t.to(device, torch.float64) for t in tensors]).tolist()  # sync
        found, old, new, steps = values[:4]
        step = int(steps) - 1
        skipped = found > 0
        record = StepRecord(
            step=step,
            scale=old,
            new_scale=new,
            skipped=skipped,
            time=time.time(),
            overflow=self._resolve(self._current, lambda: step) if skipped else None,
            probe=None if pending is None else pending.finish(values[4:]),
        )
        self._dispatch(record)

    def _dispatch(self, record: StepRecord) -> None:
        if self._history is not None:
            self._history.append(record)
        for sink in self._sinks:
            sink.write(record)
        fired = [
            ("step", True),
            ("overflow", record.skipped),
            ("backoff", record.backed_off),
            ("growth", record.grew),
        ]
        for event, happened in fired:
            if happened:
                for fn in list(self._callbacks[event]):
                    fn(record)

    # ------------------------------------------------------------------ overflow reports

    def _localize(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        step: int,
        scale: float,
        events: list[TraceEvent] | None,
    ) -> OverflowReport:
        origin = None if events is None else NonFiniteTracer.origin(events)
        return diagnostics.locate_overflow(
            optimizers, self.names, step=step, scale=scale, origin=origin
        )

    def _resolve(self, iteration: _Iteration, step: Callable[[], int]) -> OverflowReport | None:
        if iteration.resolved:
            return iteration.report
        reports = list(iteration.reports)
        overflowed = [(opt, scale) for opt, flag, scale in iteration.fused if bool(flag.item())]
        if overflowed:
            events = iteration.trace
            if events is None and self._tracer is not None:
                events = self._tracer.events
            reports.append(
                self._localize(
                    [opt for opt, _ in overflowed], step(), float(overflowed[0][1].item()), events
                )
            )
        iteration.report = merge_reports(reports) if reports else None
        iteration.resolved = True
        return iteration.report

    def last_overflow(self, counters: StepCounters | None) -> OverflowReport | None:
        """The overflow of the iteration in progress if it stepped, else of the last one.

        On the fused path the first read is a host sync (it reads the inf flags) and localizes
        then: read it before ``optimizer.zero_grad()``.
        """
        current = self._current.started
        iteration = self._current if current else self._finished

        def step() -> int:
            done = 0 if counters is None else int(counters.tensor()[0].item())
            return done if current else done - 1

        return self._resolve(iteration, step)

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        # Sinks, callbacks, hooks and watched models belong to this process and this object;
        # a copy keeps the configuration and the history, and is watched and attached anew.
        return {
            "enabled": self._enabled,
            "history_size": self._history_size,
            "probe_every": self._probe_every,
            "trace_nonfinite": self._trace_nonfinite,
            "history": self.history,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            enabled=state["enabled"],
            history_size=state["history_size"],
            probe_every=state["probe_every"],
            trace_nonfinite=state["trace_nonfinite"],
        )
        if self._history is not None:
            self._history.extend(state["history"])
