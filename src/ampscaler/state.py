"""The scaler's state: the policy's tensors and the step counters, created lazily, updated in
place, and settled on every read.

:class:`ScalerState` is the one object a :class:`~ampscaler.GradScaler` keeps its moving values
in, for its whole life. Before the first ``scale()`` the device is not known and it holds Python
numbers (a :class:`HostState`, which is also what checkpoints and pickles carry); from then on
the tensors of a :class:`LiveState` on the device: the policy's state (scale, growth tracker and
whatever the policy adds) and the :class:`StepCounters`. Which of the two it holds is its own
business: every read goes through it.

The tensor objects never change once made: ``update()``, ``update(new_scale)``, loading a
checkpoint and the setters write into them (``copy_``, ``fill_``), so a compiled graph or a CUDA
graph that captured ``scaler.scale(loss)`` or a fused step reads the live value.

Under ``torch.compile`` an ``update()`` with nothing to read on the host hands its flags over
(:meth:`ScalerState.defer`) and the next read applies them, branch-free (so the compiled graph
holds no Python decision that changes from step to step). Every read settles first; nothing
outside this module needs to know.

Example:
    >>> import torch
    >>> from ampscaler.policy import ScalePolicy
    >>> state = ScalerState(ScalePolicy(growth_interval=1), 8.0)
    >>> live = state.use(torch.device("cpu"))      # what scale() does
    >>> scale = live.scale
    >>> iteration = Iteration()
    >>> iteration.found_inf = torch.tensor(0.0)        # a clean iteration
    >>> _ = state.advance(iteration)                   # the scale grows
    >>> state.live.scale is scale, state.scale_value(), state.stats().growths
    (True, 16.0, 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from .errors import ScalerUsageError
from .grads.pow2 import Pow2Watch
from .hooks import Veto, VetoCause
from .hostcopy import read_values
from .iteration import NO_VETOES, Iteration, StepOutcome
from .policy import LOWEST_SCALE, Policy, PolicyState, adjusted, float32_value
from .policy.derived import comparable, power_of_two, with_rule

__all__ = [
    "FOLD_EVERY",
    "HostState",
    "LiveState",
    "ScalerState",
    "ScalerStats",
    "StepCounters",
    "StepOutcomes",
]

#: Iterations kept before they are folded into the counters, at the latest.
FOLD_EVERY = 256

#: The largest value an int64 counter holds.
INT64_MAX = 2**63 - 1

#: Where :class:`StepCounters` counts replays, and each cause of a veto (:class:`ScalerStats`'
#: order: ``spike_skips``, ``flush_skips``).
_REPLAYS = 6
_VETO_COUNTERS = {VetoCause.GUARD: 5, VetoCause.FLUSHED: 7}


@dataclass(frozen=True)
class ScalerStats:
    """What happened so far, as Python ints.

    Attributes:
        steps: iterations that reached ``update()`` after at least one ``step()`` or ``unscale_()``.
        skipped: of those, iterations whose gradients held inf or NaN (the optimizer skipped).
        growths: updates that raised the scale.
        backoffs: updates that lowered the scale.
        consecutive_skips: skipped iterations in a row, up to the latest one (0 after a clean one).
        spike_skips: iterations whose gradients were finite but that a guard skipped (a
            :class:`~ampscaler.SpikeGuard`, or a hook's veto of cause
            :attr:`~ampscaler.hooks.VetoCause.GUARD`); not in ``skipped``, since the scale was
            not the problem and did not back off.
        replays: skipped iterations whose batch :meth:`GradScaler.attempts
            <ampscaler.GradScaler.attempts>` ran again (each is also in ``steps`` and
            ``skipped``: the batch was lost only when it was skipped and not replayed).
        flush_skips: iterations whose gradients were finite but that a measuring policy's
            meter skipped because every gradient it measured flushed to zero (a veto of cause
            :attr:`~ampscaler.hooks.VetoCause.FLUSHED`); not in ``skipped`` nor in
            ``spike_skips``. New in this release: a checkpoint of an older one starts it at 0.
    """

    steps: int = 0
    skipped: int = 0
    growths: int = 0
    backoffs: int = 0
    consecutive_skips: int = 0
    spike_skips: int = 0
    replays: int = 0
    flush_skips: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict, as stored in ``state_dict()["stats"]``."""
        return asdict(self)


class StepCounters:
    """The counters of :class:`ScalerStats` on the device, starting from ``stats``.

    Counting costs ``update()`` almost no device work: :meth:`record` keeps the iteration's
    inf flag and a copy of the scale it started from. The kept iterations are folded into the
    counters with a dozen vectorized ops when somebody reads them, or every :data:`FOLD_EVERY`
    iterations; nothing waits for the device until somebody reads :meth:`stats`.

    Args:
        scale: the live scale tensor (read when kept iterations are folded).
        stats: where the counts start.

    Example:
        >>> scale = torch.tensor(2.0)
        >>> counters = StepCounters(scale)
        >>> counters.record(torch.tensor(0.0), torch.tensor(1.0))   # clean, grew from 1 to 2
        >>> counters.record(torch.tensor(1.0), scale.clone()); _ = scale.fill_(1.0)  # backed off
        >>> counters.stats()  # doctest: +NORMALIZE_WHITESPACE
        ScalerStats(steps=2, skipped=1, growths=1, backoffs=1, consecutive_skips=1,
                    spike_skips=0, replays=0, flush_skips=0)
    """

    def __init__(self, scale: torch.Tensor, stats: ScalerStats | None = None) -> None:
        self._scale = scale
        self._values = torch.zeros(len(fields(ScalerStats)), dtype=torch.int64, device=scale.device)
        self._found: list[torch.Tensor] = []
        # Veto flags by cause, kept from the first one on (then in step with _found).
        self._vetoed: dict[VetoCause, list[torch.Tensor]] = {}
        self._old: list[torch.Tensor] = []
        self.reset(stats or ScalerStats())

    def reset(self, stats: ScalerStats) -> None:
        """Start again from ``stats`` (in place; forgets iterations not yet folded)."""
        self._found, self._vetoed, self._old = [], {}, []
        values = list(asdict(stats).values())
        self._values.copy_(torch.tensor(values, dtype=torch.int64))

    def record(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        vetoes: Mapping[VetoCause, Veto] = NO_VETOES,
        compiling: bool | None = None,
    ) -> None:
        """Count one iteration: it overflowed iff ``found_inf > 0``; a hook vetoed it iff a
        veto's flag is ``> 0`` (counted under its cause where it did not overflow); it started
        at ``old_scale`` (a copy nobody modifies) and ended at the live scale's value now. A
        NaN ``found_inf`` stands for no iteration and is not counted.

        Eagerly the iteration is kept for a later fold; under ``torch.compile`` (``compiling``,
        where the caller knows it; asked otherwise) it is counted at once, in place, so the
        compiled graph holds no growing list (and its guards never change with the step
        number).
        """
        if compiling or (compiling is None and torch.compiler.is_compiling()):
            self.count_now(found_inf, old_scale, vetoes)
            return
        self._found.append(found_inf)
        if vetoes or self._vetoed:
            kept = self._vetoed
            for cause in vetoes:
                if cause not in kept:
                    kept[cause] = [torch.zeros_like(flag) for flag in self._found[:-1]]
            for cause, flags in kept.items():
                veto = vetoes.get(cause)
                flags.append(torch.zeros_like(found_inf) if veto is None else veto.flag)
        self._old.append(old_scale)
        if len(self._found) >= FOLD_EVERY:
            self.fold()

    def count_now(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        vetoes: Mapping[VetoCause, Veto] = NO_VETOES,
    ) -> None:
        """:meth:`record`, counted at once in place: nothing is kept for later."""
        self.fold()
        flags = {cause: veto.flag.reshape(1) for cause, veto in vetoes.items()}
        self._count(found_inf.reshape(1), flags, old_scale.reshape(1))

    @property
    def values(self) -> torch.Tensor:
        """The counters in :class:`ScalerStats`' order, an int64 tensor on the device (no
        sync; the same tensor, updated in place)."""
        self.fold()
        return self._values

    @property
    def steps(self) -> torch.Tensor:
        """Iterations counted so far, a 0-dim int64 tensor on the device (no sync)."""
        return self.values[0]

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """Skipped iterations in a row up to the latest, a 0-dim int64 tensor (no sync)."""
        return self.values[4]

    def stats(self) -> ScalerStats:
        """The counters as Python ints (a host sync)."""
        return ScalerStats(*(int(v) for v in self.values.tolist()))

    def count_replay(self) -> None:
        """One more replayed batch (in place; no sync)."""
        self._values[_REPLAYS].add_(1)

    def fold(self) -> None:
        """Count the kept iterations now, in place (no sync): each ended where the next one
        started, the last one at the live scale, so fold before the scale is written from
        outside an iteration."""
        if self._found:
            device = self._values.device
            found = _stacked(self._found, device)
            vetoed = {cause: _stacked(flags, device) for cause, flags in self._vetoed.items()}
            self._count(found, vetoed, torch.stack(self._old))
            self._found, self._vetoed, self._old = [], {}, []

    def _count(
        self, found: torch.Tensor, vetoed: Mapping[VetoCause, torch.Tensor], old: torch.Tensor
    ) -> None:
        """Add iterations with inf flags ``found`` and veto flags ``vetoed`` by cause (a cause
        left out vetoed none) that started at scales ``old`` (1-dim, in order; the last one
        ended at the live scale), in place. NaN flags are not counted."""
        counted = ~torch.isnan(found)
        count = counted.sum()
        overflow = found > 0
        # Each iteration ended where the next one started; the last one ends at the live scale.
        new = torch.cat((old[1:], self._scale.reshape(1)))
        # The overflows at the end, in a row: 1s of the reversed flags up to their first 0.
        trailing = overflow.flip(0).to(torch.int64).cumprod(0).sum()
        values = list(self._values.unbind())
        steps, skipped, growths, backoffs, in_a_row = values[:5]
        values[:5] = (
            steps + count,
            skipped + overflow.sum(),
            growths + ((new > old) & counted).sum(),
            backoffs + ((new < old) & counted).sum(),
            trailing + in_a_row * (trailing == count),
        )
        for cause, flags in vetoed.items():
            index = _VETO_COUNTERS[cause]
            values[index] = values[index] + ((flags > 0) & ~overflow & counted).sum()
        self._values.copy_(torch.stack(values))


def _stacked(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim ``flags`` as one 1-dim tensor on ``device`` (each moved there only when they are
    not on one device already: asking each flag its device cost as much as the stack, some
    0.2 us a flag on one CPU thread)."""
    try:
        stacked = torch.stack(flags)
    except RuntimeError:  # on several devices
        stacked = torch.stack([flag.to(device) for flag in flags])
    return stacked.to(device)


class StepOutcomes(dict[int, StepOutcome]):
    """The outcome of the latest ``step()`` (:attr:`last`), and of each optimizer's latest, by
    the optimizer's ``id``: what ``last_step_skipped`` and ``step_skipped(optimizer)`` answer,
    valid across ``update()`` until the next step; what persists of the steps beside the
    counters. The scaler's ``step()`` writes it (a dict: no call into this module per step),
    and drops an optimizer's entry with the optimizer (not kept alive, and gone before its
    ``id`` can be reused: a weak-keyed dict would make a weak reference at every step). A copy
    (pickle, ``copy.deepcopy``) keeps the latest outcome only, as Python values.

    Example:
        >>> outcomes = StepOutcomes()
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> outcomes[id(opt)] = outcomes.last = StepOutcome(False)
        >>> outcomes.of(opt).skipped, outcomes.last.skipped, len(outcomes)
        (False, False, 1)
    """

    last: StepOutcome | None = None

    def of(self, optimizer: torch.optim.Optimizer) -> StepOutcome | None:
        """``optimizer``'s latest outcome (``None``: it has not stepped)."""
        return self.get(id(optimizer))

    def __reduce__(self) -> tuple[Any, ...]:
        # Which optimizers skipped belongs to this object (their ids mean nothing in a copy).
        last = self.last
        return (_outcomes_from, (None if last is None else last.settled(),))


def _outcomes_from(last: StepOutcome | None) -> StepOutcomes:
    """A copy's :class:`StepOutcomes`: the latest outcome only."""
    outcomes = StepOutcomes()
    outcomes.last = last
    return outcomes


@dataclass(frozen=True)
class HostState:
    """The state as Python values: what a scaler holds before its first ``scale()``, and what
    checkpoints and pickles carry.

    Attributes:
        scale: the loss scale.
        growth_tracker: clean steps in a row (torch's growth tracker).
        own: the policy's own state values by name (``hysteresis_left`` for a
            :class:`~ampscaler.ScalePolicy`; empty: fresh).
        stats: the counters.
    """

    scale: float
    growth_tracker: int = 0
    own: Mapping[str, Any] = field(default_factory=dict)
    stats: ScalerStats = ScalerStats()

    def values(self) -> dict[str, Any]:
        """What :meth:`Policy.initial_state <ampscaler.Policy.initial_state>` takes."""
        return {"growth_tracker": self.growth_tracker, **self.own}


def _host_state(
    scale: float, tensors: PolicyState, read: list[Any], stats: ScalerStats
) -> HostState:
    """``tensors`` (a policy's state) as Python values, from their values ``read``."""
    values: dict[str, Any] = dict(zip(tensors._asdict(), read, strict=True))
    del values["scale"]
    tracker = values.pop("growth_tracker")
    return HostState(scale, tracker, values, stats)


def _supports_float64(device: torch.device) -> bool:
    """Whether ``device`` computes in float64 (MPS and Intel Arc do not: torch raises)."""
    try:
        torch.zeros((), dtype=torch.float64, device=device)
    except (TypeError, RuntimeError):
        return False
    return True


class LiveState:
    """The state's tensors on one device, for the length of one call of the scaler.

    Attributes:
        tensors: the policy's state (:class:`~ampscaler.policy.PolicyState`).
        scale: the loss scale, a 0-dim float32 tensor (``tensors.scale``).
        growth_tracker: torch's growth tracker, a 0-dim int32 tensor.
        counters: the step counters.
        floor: :data:`~ampscaler.policy.LOWEST_SCALE` as a 0-dim float32 tensor on the device
            (a clamp to a tensor dispatches faster than one to a Python number).
        device: where the state lives.
        float64: whether the device computes in float64 (MPS and Intel Arc do not).
    """

    def __init__(self, tensors: PolicyState, stats: ScalerStats) -> None:
        self.tensors = tensors
        self.scale = tensors.scale
        self.growth_tracker = tensors.growth_tracker
        self.device = self.scale.device
        self.counters = StepCounters(self.scale, stats)
        self.floor = torch.full((), LOWEST_SCALE, dtype=torch.float32, device=self.device)
        self.float64 = _supports_float64(self.device)

    def replace_tensors(self, tensors: PolicyState) -> None:
        """Take a loaded policy's state: values are copied into the tensors that exist (scale
        and growth tracker always, the policy's own where their layout is the same), so that
        captured graphs keep reading them; tensors of another layout are replaced."""
        same = type(tensors) is type(self.tensors) and all(
            old.shape == new.shape and old.dtype == new.dtype
            for old, new in zip(self.tensors, tensors, strict=True)
        )
        if same:
            for old, new in zip(self.tensors, tensors, strict=True):
                old.copy_(new)
            return
        self.scale.copy_(tensors.scale)
        self.growth_tracker.copy_(tensors.growth_tracker)
        kind: Any = type(tensors)  # the policy's NamedTuple
        own = list(tensors)[2:]
        self.tensors = kind(self.scale, self.growth_tracker, *own)


class ScalerState:
    """The scaler's moving values for its whole life: on the host until the first device is
    known, then on it (module docstring).

    Args:
        policy: the policy whose state it holds.
        scale: the starting scale (validated by the caller).

    Attributes:
        outcomes: the latest step outcomes (:class:`StepOutcomes`).
    """

    def __init__(self, policy: Policy, scale: float) -> None:
        self._policy = policy
        self._holds = policy.holds_on_nonfinite_loss  # asked once per policy, not per update
        self._host: HostState = HostState(scale)
        self._live: LiveState | None = None
        self.outcomes = StepOutcomes()
        # Until scale() uses it, the scale is reported as given (not rounded to float32), as
        # torch's get_scale() and state_dict() do before the first scale().
        self._used = False
        # An update handed over under torch.compile (see defer()); a NaN flag: nothing pending
        # (made with the live state: always one flag or more, so a compiled read of it is
        # guarded on the same length every step).
        self._pending: tuple[torch.Tensor, ...] = ()
        self._pending_policy = policy
        self._deferred = False
        self._watch: Pow2Watch | None = None  # made by watch_powers_of_two()
        # The last value of the scale the host read or set, and the version counter the scale
        # was at then (a later write bumps it: the value is then no longer known).
        self._seen = (float32_value(scale), 0)

    # ------------------------------------------------------------------ the policy

    @property
    def policy(self) -> Policy:
        """The policy whose state this is."""
        return self._policy

    def change_rule(self, funcname: str, **changes: Any) -> None:
        """Change torch's rule numbers (``set_growth_factor()`` and friends), validated by the
        policy; an update still pending applies under the old numbers.

        Raises:
            ScalerUsageError: the policy has no such rule.
            InvalidConfigError: a value out of range.
        """
        policy = with_rule(self._policy, funcname, **changes)
        self._apply_pending()
        self._policy = self._pending_policy = policy
        self._holds = policy.holds_on_nonfinite_loss
        if self._watch is not None:
            self._watch.set_policy(power_of_two(policy))

    # ------------------------------------------------------------------ reads (settled)

    @property
    def used(self) -> bool:
        """Whether ``scale()`` has put the scale to use (since construction or unpickling)."""
        return self._used

    @property
    def live(self) -> LiveState | None:
        """The tensors (settled), or ``None`` before the first device is known."""
        if self._deferred:
            self._settle_masked()
        return self._live

    def on(self, device: torch.device) -> LiveState:
        """The tensors (settled), put on ``device`` by the first call. Under
        ``torch.compile`` a pending update is applied masked, whether there is one or not."""
        if self._live is None:
            self._make_live(device)
        if torch.compiler.is_compiling() or self._deferred:
            self._settle_masked()
        assert self._live is not None
        return self._live

    def use(self, device: torch.device) -> LiveState:
        """The tensors (settled), put on ``device`` by the first call, for ``scale()``: from
        now on the scale is the float32 tensor's value."""
        live = self.on(device)
        self._used = True
        return live

    def require(self, funcname: str) -> LiveState:
        """The tensors (settled), for a step of the iteration ``scale()`` started.

        Raises:
            ScalerUsageError: ``scale()`` has not been used yet.
        """
        if self._deferred:
            self._settle_masked()
        live = self._live
        if live is None or not self._used:
            raise ScalerUsageError(
                f"Attempted {funcname}() but the scale was never used: call "
                "scaler.scale(loss).backward() earlier in the iteration, before "
                f"scaler.{funcname}()."
            )
        return live

    def scale_value(self) -> float:
        """The scale as a Python float (a host sync once it lives on a device)."""
        live = self.live
        if live is None or not self._used:
            return self._host.scale
        value = float(live.scale.item())
        self._saw(value)
        return value

    def kept(self, scale: torch.Tensor | None) -> torch.Tensor | None:
        """``scale``, an iteration's scale after ``update()``, where it is a value later updates
        leave alone (the copy the update made); ``None`` where it is still the live scale (a
        deferred compiled update on a device without float64, which the next read of the state
        may already have applied): then the scale it ran at is not known. No device work."""
        live = self._live
        return None if live is not None and scale is live.scale else scale

    def growth_tracker_value(self) -> int:
        """torch's growth tracker as an int (a host sync once it lives on a device)."""
        live = self.live
        return self._host.growth_tracker if live is None else int(live.growth_tracker.item())

    def stats(self) -> ScalerStats:
        """The counters as Python ints (a host sync once they live on a device)."""
        live = self.live
        return self._host.stats if live is None else live.counters.stats()

    def snapshot(self) -> HostState:
        """Every value as Python numbers, the policy's own state complete (one host sync once
        they live on a device)."""
        live = self.live
        if live is None:
            host = self._host
            fresh = self._policy.initial_state(host.scale, torch.device("cpu"), host.values())
            return _host_state(host.scale, fresh, read_values(list(fresh)), host.stats)
        read = read_values([*live.tensors, live.counters.values])
        stats = ScalerStats(*read[-1])
        scale = float(read[0]) if self._used else self._host.scale
        self._saw(float32_value(scale))
        return _host_state(scale, live.tensors, read[:-1], stats)

    def comparable(self) -> dict[str, Any]:
        """What ranks compare: the policy's settings, and every state tensor (the live objects,
        which later updates change in place)."""
        policy = self._policy
        settings: dict[str, Any] = comparable(policy)
        live = self.live
        if live is not None:
            settings.update(live.tensors._asdict())
        return settings

    # ------------------------------------------------------------------ writes

    def advance(
        self, iteration: Iteration, overflowed: bool | None = None, compiling: bool = False
    ) -> LiveState:
        """``iteration`` ended with ``iteration.found_inf`` (and its ``vetoes``, which the
        policy does not see; and what a measuring policy ``measured``): move the state by the
        policy, hold the scale at the floor, count the iteration (its vetoes by cause). Sets
        ``iteration.scale`` to a copy of the scale it started from (``iteration.start_scale``,
        the copy its unscale made, or a new one) and returns the live state.

        A policy that holds on a non-finite loss
        (:attr:`Policy.holds_on_nonfinite_loss <ampscaler.Policy.holds_on_nonfinite_loss>`)
        does not move where the iteration's loss flag is > 0 and the step was skipped (made
        only where the host does not know that it stepped: ``overflowed`` is whether
        ``found_inf > 0``, where the host knows it). Whatever the policy, the scale never ends
        below :data:`~ampscaler.policy.LOWEST_SCALE` (``2**-126``): one small device op, the
        same for every update, that the host needs to know nothing for. ``compiling``: whether
        under ``torch.compile``. No host sync."""
        if self._deferred:
            self._settle_masked()
        live = self._live
        assert live is not None, "the state lives on a device once scale() has run"
        found_inf = iteration.found_inf
        assert found_inf is not None, "update() refuses an iteration without a check"
        watch = self._watch
        if watch is not None:
            watch.before_update()
        old = iteration.start_scale
        if old is None:
            old = live.scale.clone()
        iteration.scale = old
        # A policy holds where a non-finite loss skipped the step; a step the host knows went
        # through (no overflow) has nothing to hold, and the loss flag is not made.
        hold = iteration.cause_flag() if self._holds and overflowed is not False else None
        if hold is None:
            self._policy.update_(live.tensors, found_inf, iteration.measured)
        else:
            self._update_unless(hold, live, found_inf, iteration.measured)
        torch.clamp_min_(live.scale, live.floor)  # the floor (the function: a little faster)
        live.counters.record(found_inf, old, iteration.vetoes, compiling)
        if watch is not None:
            watch.updated(live.scale)
        return live

    def moved_outside(self, iteration: Iteration) -> None:
        """``iteration`` ended with ``iteration.found_inf``, the state moved by code outside the
        policy (a subclass's own ``update()``): hold the scale at the floor and count the
        iteration from the scale it ran at (``iteration.start_scale``: the copy its unscale,
        or the subclass's call of ``_check_scale_growth_tracker``, made; where none was made,
        from the scale now, so that its move is counted with the iteration before it). The
        power-of-two watch learns the scale anew. No host sync."""
        live = self._settled_live()
        found_inf = iteration.found_inf
        assert found_inf is not None, "an iteration without a check is dropped, not counted"
        old = iteration.start_scale
        if old is None:
            old = live.scale.clone()
        iteration.scale = old
        torch.clamp_min_(live.scale, live.floor)
        live.counters.record(found_inf, old, iteration.vetoes)
        if self._watch is not None:
            self._watch.forget(live.scale)

    def _update_unless(
        self,
        hold: torch.Tensor,
        live: LiveState,
        found_inf: torch.Tensor,
        measured: torch.Tensor | None,
    ) -> None:
        """The policy's update, except where the flag ``hold`` is > 0 and the step was skipped
        (branch-free)."""
        moved = adjusted(self._policy, live.tensors, found_inf, measured)
        keep = (hold.to(live.device) > 0) & (found_inf.to(live.device) > 0)
        for tensor, value in zip(live.tensors, moved, strict=True):
            if value is not tensor:
                tensor.copy_(torch.where(keep, tensor, value))

    def set_scale(
        self,
        value: float,
        found_inf: torch.Tensor | None,
        vetoes: Mapping[VetoCause, Veto] = NO_VETOES,
    ) -> torch.Tensor:
        """``update(new_scale)``: write ``value`` into the state by the policy; count the
        iteration (and its ``vetoes``) when ``found_inf`` is given. Returns a copy of the old
        scale."""
        live = self._settled_live()
        old = live.scale.clone()
        self._policy.set_scale_(live.tensors, value)
        if found_inf is not None:
            live.counters.record(found_inf, old, vetoes)
        self._saw(value)
        return old

    def put(self, scale: float | None = None, growth_tracker: int | None = None) -> None:
        """Set the scale or the growth tracker outside an iteration, as code written for
        torch's scaler does by assigning ``scaler._scale`` or ``scaler._growth_tracker``;
        everything else stays. Validated by the caller. No host sync."""
        live = self.live
        if scale is not None:
            self._host = replace(self._host, scale=scale)
            if live is not None:
                live.counters.fold()  # the iterations so far ended at the scale before
                self._policy.set_scale_(live.tensors, scale)
            self._saw(scale)
        if growth_tracker is not None:
            self._host = replace(self._host, growth_tracker=growth_tracker)
            if live is not None:
                live.growth_tracker.fill_(growth_tracker)

    def count_replay(self) -> None:
        """One more batch replayed (``stats.replays``). No host sync."""
        self._settled_live().counters.count_replay()

    def defer(self, flags: Sequence[torch.Tensor]) -> None:
        """``update()`` under ``torch.compile``: keep the iteration's inf flags and apply the
        policy at the next read. No device work here: between the optimizer's graph break and
        ``zero_grad()``'s, any would be a compiled graph of its own (torch's scaler runs its
        update eagerly there, with none)."""
        self._pending = tuple(flags)
        self._pending_policy = self._policy
        self._deferred = True
        if self._watch is not None:
            self._watch.forget(self._settled_live().scale)

    def load(self, host: HostState, policy: Policy) -> None:
        """Overwrite every value with ``host``'s (a loaded checkpoint for ``policy``), keeping
        the tensors (see :meth:`LiveState.replace_tensors`)."""
        self._apply_pending()
        tensors = None
        if self._live is not None:  # made first: if the policy refuses the values, nothing changed
            tensors = policy.initial_state(host.scale, self._live.device, host.values())
        self._policy = self._pending_policy = policy
        self._holds = policy.holds_on_nonfinite_loss
        if self._live is None or tensors is None:
            self._host = host
            return
        if not self._used:
            self._host = HostState(host.scale)
        self._live.replace_tensors(tensors)
        self._live.counters.reset(host.stats)
        if self._watch is not None:
            self._watch.set_policy(power_of_two(policy))
        self._saw(float32_value(host.scale))

    # ------------------------------------------------------------------ powers of two

    def watch_powers_of_two(self) -> None:
        """From now on, know on the host whether the scale is a power of two (see
        :attr:`exact_reciprocal`); a few Python operations per update. No host sync: where
        the host does not know the scale's value now, a copy of it starts on its way without
        waiting, and the watch knows once it has landed (at once on the CPU)."""
        if self._watch is not None:
            return
        self._apply_pending()
        watch = self._watch = Pow2Watch(power_of_two(self._policy))
        live = self._live
        if live is None:
            watch.saw(self._host.scale)
            return
        watch.follow(live.scale)
        value, version = self._seen
        if live.scale._version == version:  # nothing wrote it since it was known
            watch.saw(value)
        else:
            watch.forget(live.scale)

    @property
    def exact_reciprocal(self) -> bool:
        """Whether ``1/scale`` is certainly exact in float32 now (a power of two within
        float32's normal range), known without reading the device. ``False`` unless
        :meth:`watch_powers_of_two` was called."""
        self._apply_pending()
        return self._watch is not None and self._watch.exact

    # ------------------------------------------------------------------ internals

    def _make_live(self, device: torch.device) -> None:
        host = self._host
        tensors = self._policy.initial_state(host.scale, device, host.values())
        self._live = LiveState(tensors, host.stats)
        self._seen = (float32_value(host.scale), self._live.scale._version)
        self._pending = (self._nothing(device),)
        if self._watch is not None:
            self._watch.follow(self._live.scale)
            # As held on the host: a power of two here is one in float32 too; a value that only
            # rounds to one counts as unknown, which is safe (torch's route until the next read).
            self._watch.saw(host.scale)

    def _settled_live(self) -> LiveState:
        live = self.live
        assert live is not None, "the state lives on a device once scale() has run"
        return live

    def _saw(self, value: float) -> None:
        """The host learned the scale's value."""
        live = self._live
        self._seen = (value, 0 if live is None else live.scale._version)
        if self._watch is not None:
            self._watch.saw(value)

    def _nothing(self, device: torch.device) -> torch.Tensor:
        # A new tensor each time: one kept and reused would alias the pending flag on the
        # first compiled call, and torch.compile guards on aliasing (a recompile later).
        return torch.full((), math.nan, dtype=torch.float32, device=device)

    def _apply_pending(self) -> None:
        """Apply an update handed over by :meth:`defer`, if there is one (eagerly, and in a
        compiled read after ``scale()``, where nothing is pending: the guard on
        ``_deferred`` then holds every step)."""
        if self._deferred:
            self._settle_masked()

    def _settle_masked(self) -> None:
        """Apply the update handed over by :meth:`defer` in place, branch-free: the transition
        is masked by whether the kept flag is NaN (nothing pending), so a compiled ``scale()``
        that runs it every step holds no Python decision that could change from step to step.
        No host sync. A measuring policy's updates never wait for a read (its ``update()``
        runs eagerly under ``torch.compile``): nothing to apply."""
        live = self._live
        policy = self._pending_policy
        measures = type(policy).new_meter is not Policy.new_meter
        if live is None or (measures and not self._deferred):
            return
        found = self._pending[0]
        for flag in self._pending[1:]:
            found = found + flag
        pending = ~torch.isnan(found)
        old = live.scale.clone()
        moved = adjusted(policy, live.tensors, torch.where(pending, found, 0.0))
        for tensor, value in zip(live.tensors, moved, strict=True):
            if value is not tensor:
                tensor.copy_(torch.where(pending, value, tensor))
        live.scale.clamp_(min=LOWEST_SCALE)  # the floor, as in advance()
        live.counters.count_now(found, old)  # kept iterations would change a compiled guard
        self._pending = (self._nothing(live.device),)
        self._deferred = False

    # ------------------------------------------------------------------ copies

    def __getstate__(self) -> dict[str, Any]:
        # Copies hold the values on the host; the device state is made again at the next
        # scale(). A pending update is applied first (snapshot() settles).
        return {
            "policy": self._policy,
            "host": self.snapshot(),
            "watch": self._watch is not None,
            "outcomes": self.outcomes,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["policy"], state["host"].scale)  # type: ignore[misc]
        self._host = state["host"]
        self.outcomes = state["outcomes"]
        if state["watch"]:
            self.watch_powers_of_two()
