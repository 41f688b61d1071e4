"""The scaler's observation methods: skip awareness, overflow reports, records, sinks, watching.

A mixin of :class:`~ampscaler.GradScaler` that delegates to its :class:`~.monitor.Monitor` and
reads its live state; nothing here takes part in a training step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Literal, TypeVar, overload

import torch

from ..errors import InvalidConfigError, ScalerUsageError
from ..state import HostState, LiveState, ScalerStats
from .collapse import CollapseAlert
from .localize import NonFiniteTracer, OverflowReport
from .monitor import Attachable, Callback, Monitor
from .probe import GradientProbe
from .records import StepRecord
from .sinks import Sink, StepHistory

__all__ = ["ObserverMethods", "SkipReason", "StepOutcome"]

SkipReason = Literal["nonfinite", "spike"]

SinkT = TypeVar("SinkT", bound=Sink)
AttachableT = TypeVar("AttachableT", bound=Attachable)


class StepOutcome:
    """One ``step()``'s verdict: the inf/NaN flag and a guard's flag, as device tensors (the
    fused path) or as known values; a tensor is read the first time it is asked about.

    Example:
        >>> outcome = StepOutcome(torch.tensor(0.0), torch.tensor(1.0))
        >>> outcome.skipped, outcome.reason
        (True, 'spike')
    """

    def __init__(
        self, found_inf: torch.Tensor | bool, spike: torch.Tensor | bool | None = None
    ) -> None:
        self._found_inf = found_inf
        self._spike = spike

    @property
    def reason(self) -> SkipReason | None:
        """``"nonfinite"``, ``"spike"``, or ``None`` when the step was taken (reads the flags
        still on the device: a host sync)."""
        if isinstance(self._found_inf, torch.Tensor):
            self._found_inf = bool(self._found_inf.item())
        if self._found_inf:
            return "nonfinite"
        if isinstance(self._spike, torch.Tensor):
            self._spike = bool(self._spike.item())
        return "spike" if self._spike else None

    @property
    def skipped(self) -> bool:
        """Whether ``optimizer.step()`` was skipped (may read the device, see :attr:`reason`)."""
        return self.reason is not None

    def settled(self) -> StepOutcome:
        """The same verdict as Python values (for a copied scaler)."""
        reason = self.reason
        return StepOutcome(reason == "nonfinite", reason == "spike")


class ObserverMethods:
    """Mixin: what a training loop asks the scaler about its steps (see the module docstring)."""

    _monitor: Monitor
    _state: LiveState | HostState
    _last_outcome: StepOutcome | None
    _outcomes: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepOutcome]

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

        A step a guard skipped (:class:`~ampscaler.SpikeGuard`) counts as skipped;
        :attr:`last_skip_reason` tells the two apart, :meth:`step_skipped` follows each
        optimizer of a loop with several.

        A host sync on the fused-optimizer path (it reads the inf flag handed to the kernel);
        free otherwise, since the decision already read it.
        """
        outcome = self._last_outcome
        return outcome is not None and outcome.skipped

    @property
    def last_skip_reason(self) -> SkipReason | None:
        """Why the most recent :meth:`step` skipped: ``"nonfinite"`` (inf/NaN gradients: the
        scale backs off), ``"spike"`` (a guard vetoed finite gradients: the scale stays), or
        ``None`` (it stepped, or no step yet). Same syncs as :attr:`last_step_skipped`.

        Example:
            >>> import ampscaler, torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> scaler.last_skip_reason, scaler.last_overflow.cause
            ('nonfinite', 'loss')
        """
        outcome = self._last_outcome
        return None if outcome is None else outcome.reason

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the latest :meth:`step` of ``optimizer`` was skipped (for any reason).

        For loops with several optimizers, where :attr:`last_step_skipped` follows only the
        last ``step()``: keep each optimizer's scheduler in step with its parameters. Valid
        until that optimizer's next ``step()``, across ``update()``. A host sync on the fused
        path, as :attr:`last_step_skipped`.

        Example:
            >>> import ampscaler, torch
            >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
            >>> opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
            >>> opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> x = torch.ones(1, 2)
            >>> scaler.scale(a(x).sum() + b(x).sum()).backward()
            >>> b.bias.grad.fill_(float("inf"))
            tensor([inf])
            >>> scaler.step(opt_a), scaler.step(opt_b)
            (None, None)
            >>> scaler.update()
            >>> scaler.step_skipped(opt_a), scaler.step_skipped(opt_b)
            (False, True)

        Raises:
            ScalerUsageError: (a ``RuntimeError``) ``optimizer`` has not been stepped through
                this scaler.
        """
        outcome = self._outcomes.get(optimizer)
        if outcome is None:
            raise ScalerUsageError(
                f"step_skipped() was asked about an optimizer ({type(optimizer).__name__}) "
                "that this scaler has not stepped: call it after scaler.step(optimizer)."
            )
        return outcome.skipped

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
            >>> report = scaler.last_overflow
            >>> report.names, report.kinds, report.cause
            (['bias'], {'bias': 'nan'}, 'gradients')
            >>> print(report)  # doctest: +ELLIPSIS
            step 0: non-finite gradients at scale 65536 in 1 parameter(s): bias (nan); cause: ...
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

    @overload
    def on(
        self, event: Literal["collapse"], fn: Callable[[CollapseAlert], object]
    ) -> Callable[[], None]: ...

    @overload
    def on(self, event: str, fn: Callable[[StepRecord], object]) -> Callable[[], None]: ...

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` at the end of :meth:`update` when ``event`` happened.

        Events: ``"step"`` (every iteration), ``"overflow"`` (skipped), ``"backoff"`` (the
        scale went down), ``"growth"`` (it went up); ``fn`` gets the
        :class:`~ampscaler.StepRecord`, and registering it makes :meth:`update` sync once per
        iteration. ``"collapse"``: the scale fell far below its running maximum or skips piled
        up (see :class:`~ampscaler.CollapseWatch`); ``fn`` gets a
        :class:`~ampscaler.CollapseAlert`, and registering it costs nothing per iteration.
        Returns a function that unregisters ``fn``.

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
        to the models given to :meth:`watch`, or a :class:`~ampscaler.CollapseWatch` in place of
        the default one; returns it.

        Example:
            >>> import ampscaler, torch
            >>> from ampscaler import GradientProbe
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> probe = scaler.attach(GradientProbe(every=100))

        Raises:
            TypeError: not a probe, tracer or collapse watch. ValueError: a probe or tracer
                is attached already.
        """
        self._monitor.attach(observer)
        return observer

    @property
    def stats(self) -> ScalerStats:
        """Counters so far: steps, skipped, growths, backoffs, consecutive_skips, spike_skips
        (see :class:`~ampscaler.ScalerStats`). A host sync.

        Example:
            >>> import ampscaler, torch
            >>> stats = ampscaler.GradScaler("cpu").stats
            >>> stats.steps, stats.skipped, stats.spike_skips
            (0, 0, 0)
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

