"""The scaler's observation methods: skip awareness, overflow reports, records, sinks, watching.

A mixin of :class:`~ampscaler.GradScaler` that delegates to its :class:`~.monitor.Monitor` and
reads its live state; nothing here takes part in a training step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ..errors import InvalidConfigError
from ..state import HostState, LiveState, ScalerStats
from .localize import NonFiniteTracer, OverflowReport
from .monitor import Attachable, Callback, Monitor
from .probe import GradientProbe
from .records import StepRecord
from .sinks import Sink, StepHistory

__all__ = ["ObserverMethods"]

SinkT = TypeVar("SinkT", bound=Sink)
AttachableT = TypeVar("AttachableT", bound=Attachable)


class ObserverMethods:
    """Mixin: what a training loop asks the scaler about its steps (see the module docstring)."""

    _monitor: Monitor
    _state: LiveState | HostState
    _last_found_inf: torch.Tensor | bool | None

    def _attach_shorthands(
        self, history_size: object, probe_every: object, trace_nonfinite: object
    ) -> None:
        """The constructor's ``history_size``, ``probe_every`` and ``trace_nonfinite``."""
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
            raise InvalidConfigError(
                f"trace_nonfinite must be True or False, got {trace_nonfinite!r}."
            )
        if history_size:
            self._monitor.add_sink(StepHistory(history_size))
        if probe_every is not None:
            self._monitor.attach(GradientProbe(every=probe_every))
        if trace_nonfinite:
            self._monitor.attach(NonFiniteTracer())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent :meth:`step` skipped ``optimizer.step()`` (False before any).

        Use it to keep LR schedulers and weight averages in step with the parameters::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped:
                scheduler.step()
                ema.update_parameters(model)

        A host sync on the fused-optimizer path (it reads the inf flag handed to the kernel);
        free otherwise, since the decision already read it.
        """
        found = self._last_found_inf
        if isinstance(found, torch.Tensor):
            found = self._last_found_inf = bool(found.item())
        return bool(found)

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Which parameters held inf/NaN in the latest iteration, or ``None`` if it was clean.

        The iteration is the one in progress once it has called :meth:`step`, otherwise the
        last one that reached :meth:`update`; the report covers all of its optimizers.
        Parameters are named as :meth:`watch` learned them.

        Plain optimizers are localized inside :meth:`step` when it skips (it already knows).
        Fused optimizers (``Adam(fused=True)``) decide inside their kernel, so nothing is
        known without a host sync: their overflow is localized when this property is first
        read (or at :meth:`update` when step records are consumed). Read it before
        ``optimizer.zero_grad()``; afterwards the gradients are gone and the report can only
        say that the step overflowed. Clean iterations never run a localization pass.

        Example:
            >>> import ampscaler, torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.watch(model)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> model.bias.grad.fill_(float("nan"))
            tensor([nan])
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> print(scaler.last_overflow)
            step 0: non-finite gradients at scale 65536 in 1 parameter(s): bias (nan)
        """
        state = self._state
        if not isinstance(state, LiveState):
            return self._monitor.last_overflow(None)
        state.settle()  # counts an update handed over under torch.compile
        return self._monitor.last_overflow(state.counters)

    @property
    def history(self) -> list[StepRecord]:
        """The records kept by the first attached :class:`~ampscaler.StepHistory`, oldest first
        (empty without one; ``history_size=N`` attaches one).

        Example:
            >>> import ampscaler, torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu", init_scale=256.0, history_size=100)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> record = scaler.history[-1]
            >>> record.step, record.scale, record.skipped
            (0, 256.0, False)
        """
        return self._monitor.history

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` at the end of :meth:`update` when ``event`` happened.

        Events: ``"step"`` (every iteration), ``"overflow"`` (skipped), ``"backoff"`` (the
        scale went down), ``"growth"`` (it went up). ``fn`` gets the
        :class:`~ampscaler.StepRecord`. Registering a callback makes :meth:`update` sync once
        per iteration. Returns a function that unregisters ``fn``.

        Example:
            >>> import ampscaler, torch
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> stop = scaler.on("overflow", lambda record: print(record.overflow))
            >>> stop()

        Raises:
            ValueError: an unknown event (:class:`~ampscaler.InvalidConfigError`).
            TypeError: ``fn`` is not callable.
        """
        return self._monitor.on(event, fn)

    def add_sink(self, sink: SinkT) -> SinkT:
        """Send every step record to ``sink`` (an object with ``write(record)``); returns it.

        Attaching a sink makes :meth:`update` sync once per iteration. See
        :mod:`ampscaler.observe.sinks`.

        Example:
            >>> import ampscaler, torch
            >>> from ampscaler import LoggingSink
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> sink = scaler.add_sink(LoggingSink("train"))
            >>> scaler.remove_sink(sink)

        Raises:
            TypeError: ``sink`` has no ``write`` method.
        """
        self._monitor.add_sink(sink)
        return sink

    def remove_sink(self, sink: Sink) -> None:
        """Stop sending records to ``sink`` (without closing it).

        Raises:
            ValueError: ``sink`` is not attached.
        """
        self._monitor.remove_sink(sink)

    def attach(self, observer: AttachableT) -> AttachableT:
        """Attach a :class:`~ampscaler.GradientProbe` or a :class:`~ampscaler.NonFiniteTracer`
        to the models given to :meth:`watch`; returns it.

        Example:
            >>> import ampscaler, torch
            >>> from ampscaler import GradientProbe
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> probe = scaler.attach(GradientProbe(every=100))

        Raises:
            TypeError: not a probe or tracer. ValueError: one of its kind is attached already.
        """
        self._monitor.attach(observer)
        return observer

    @property
    def stats(self) -> ScalerStats:
        """Counters so far: steps, skipped, growths, backoffs, consecutive_skips. A host sync.

        Example:
            >>> import ampscaler, torch
            >>> ampscaler.GradScaler("cpu").stats
            ScalerStats(steps=0, skipped=0, growths=0, backoffs=0, consecutive_skips=0)
        """
        state = self._state
        if not isinstance(state, LiveState):
            return state.stats
        state.settle()
        return state.counters.stats()

    def watch(self, *models: torch.nn.Module, **named_models: torch.nn.Module) -> None:
        """Learn parameter names from ``models`` so overflow reports can name them.

        Keyword arguments prefix the names, which keeps several models apart
        (``watch(encoder=enc, decoder=dec)`` names ``decoder.fc.weight``). An attached probe
        or tracer also hooks the models' leaf modules. Without ``watch()``, reports name
        parameters by position (``group0.param3``).

        Example:
            >>> import ampscaler, torch
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.watch(torch.nn.Linear(2, 2))
            >>> scaler.watch(head=torch.nn.Linear(2, 1))
        """
        for model in models:
            self._monitor.watch(model)
        for prefix, model in named_models.items():
            self._monitor.watch(model, prefix)

