"""The scaler's live state on the device: created once, updated in place.

:class:`LiveState` holds every tensor that changes from step to step: the scale, the growth
tracker and the hysteresis budget (a :class:`~ampscaler.policy.ScaleState` of 0-dim tensors)
and the step counters. The tensor objects never change: ``update()``, ``update(new_scale)``,
loading a checkpoint and the setters all write into them (``copy_``, ``fill_``), so a compiled
graph or a CUDA graph that captured ``scaler.scale(loss)`` or a fused step reads the live value.

Counting costs ``update()`` almost no device work: :meth:`StepCounters.record` keeps the
iteration's inf flag and a copy of the scale it started from. The kept iterations are folded
into five ``int64`` counters with a dozen vectorized ops when somebody reads the counters, or
every :data:`FOLD_EVERY` iterations; nothing waits for the device until somebody reads
:class:`ScalerStats`.

Example:
    >>> import torch
    >>> from ampscaler.policy import ScalePolicy
    >>> state = LiveState(ScalePolicy(growth_interval=1), torch.device("cpu"), scale=8.0)
    >>> scale = state.scale
    >>> _ = state.advance(ScalePolicy(growth_interval=1), torch.tensor(0.0))   # clean: grows
    >>> state.scale is scale, state.scale.item(), state.counters.stats().growths
    (True, 16.0, 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from .policy import HeadroomPolicy, HeadroomState, Policy, PolicyState, ScaleState, initial_state

__all__ = ["FOLD_EVERY", "HostState", "LiveState", "ScalerStats", "StepCounters"]

#: Iterations kept before they are folded into the counters, at the latest.
FOLD_EVERY = 64


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
            :class:`~ampscaler.SpikeGuard`); not in ``skipped``, since the scale was not the
            problem and did not back off.
    """

    steps: int = 0
    skipped: int = 0
    growths: int = 0
    backoffs: int = 0
    consecutive_skips: int = 0
    spike_skips: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict, as stored in ``state_dict()["stats"]``."""
        return asdict(self)


class StepCounters:
    """The counters of :class:`ScalerStats` on the device, starting from ``stats``.

    The counters are read by name: :attr:`steps` and :attr:`consecutive_skips` as 0-dim
    tensors (no sync), :meth:`stats` as Python ints (a host sync).

    Args:
        scale: the live scale tensor (read when kept iterations are folded).
        stats: where the counts start.

    Example:
        >>> scale = torch.tensor(2.0)
        >>> counters = StepCounters(scale)
        >>> counters.record(torch.tensor(0.0), torch.tensor(1.0))   # clean, grew from 1 to 2
        >>> counters.record(torch.tensor(1.0), scale.clone()); _ = scale.fill_(1.0)  # backed off
        >>> counters.stats()
        ScalerStats(steps=2, skipped=1, growths=1, backoffs=1, consecutive_skips=1, spike_skips=0)
    """

    def __init__(self, scale: torch.Tensor, stats: ScalerStats | None = None) -> None:
        self._scale = scale
        self._values = torch.zeros(len(fields(ScalerStats)), dtype=torch.int64, device=scale.device)
        self._found: list[torch.Tensor] = []
        self._spiked: list[torch.Tensor] = []
        self._old: list[torch.Tensor] = []
        self.reset(stats or ScalerStats())

    def reset(self, stats: ScalerStats) -> None:
        """Start again from ``stats`` (in place; forgets iterations not yet folded)."""
        self._found, self._spiked, self._old = [], [], []
        values = list(asdict(stats).values())
        self._values.copy_(torch.tensor(values, dtype=torch.int64))

    def record(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        spiked: torch.Tensor | None = None,
    ) -> None:
        """Count one iteration: it overflowed iff ``found_inf > 0``; a guard skipped it iff
        ``spiked > 0`` (``None``: no guard); it started at ``old_scale`` (a copy nobody
        modifies) and ended at the live scale's value now. A NaN ``found_inf`` stands for no
        iteration and is not counted.

        Eagerly the iteration is kept for a later fold; under ``torch.compile`` it is counted
        at once, in place, so the compiled graph holds no growing list (and its guards never
        change with the step number).
        """
        if torch.compiler.is_compiling():
            self.count_now(found_inf, old_scale, spiked)
            return
        self._found.append(found_inf)
        # Guard flags are kept only from the first one on (then in step with _found).
        if spiked is not None and not self._spiked:
            self._spiked = [torch.zeros_like(flag) for flag in self._found[:-1]]
        if self._spiked or spiked is not None:
            self._spiked.append(torch.zeros_like(found_inf) if spiked is None else spiked)
        self._old.append(old_scale)
        if len(self._found) >= FOLD_EVERY:
            self._fold()

    def count_now(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        spiked: torch.Tensor | None = None,
    ) -> None:
        """:meth:`record`, counted at once in place: nothing is kept for later."""
        self._fold()
        flags = None if spiked is None else spiked.reshape(1)
        self._count(found_inf.reshape(1), flags, old_scale.reshape(1))

    @property
    def steps(self) -> torch.Tensor:
        """Iterations counted so far, a 0-dim int64 tensor on the device (no sync)."""
        self._fold()
        return self._values[0]

    @property
    def skipped(self) -> torch.Tensor:
        """Iterations skipped for inf/NaN so far, a 0-dim int64 tensor (no sync)."""
        self._fold()
        return self._values[1]

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """Skipped iterations in a row up to the latest, a 0-dim int64 tensor (no sync)."""
        self._fold()
        return self._values[4]

    def stats(self) -> ScalerStats:
        """The counters as Python ints (a host sync)."""
        self._fold()
        return ScalerStats(*(int(v) for v in self._values.tolist()))

    def _fold(self) -> None:
        if self._found:
            device = self._values.device
            found = torch.stack([flag.to(device) for flag in self._found])
            spiked = (
                torch.stack([flag.to(device) for flag in self._spiked]) if self._spiked else None
            )
            self._count(found, spiked, torch.stack(self._old))
            self._found, self._spiked, self._old = [], [], []

    def _count(
        self, found: torch.Tensor, spiked: torch.Tensor | None, old: torch.Tensor
    ) -> None:
        """Add iterations with inf flags ``found`` and guard flags ``spiked`` (``None``: no
        guard flagged any) that started at scales ``old`` (1-dim, in order; the last one ended
        at the live scale), in place. NaN flags are not counted."""
        counted = ~torch.isnan(found)
        count = counted.sum()
        overflow = found > 0
        # Each iteration ended where the next one started; the last one ends at the live scale.
        new = torch.cat((old[1:], self._scale.reshape(1)))
        # The overflows at the end, in a row: 1s of the reversed flags up to their first 0.
        trailing = overflow.flip(0).to(torch.int64).cumprod(0).sum()
        steps, skipped, growths, backoffs, in_a_row, spikes = self._values.unbind()
        self._values.copy_(
            torch.stack(
                (
                    steps + count,
                    skipped + overflow.sum(),
                    growths + ((new > old) & counted).sum(),
                    backoffs + ((new < old) & counted).sum(),
                    trailing + in_a_row * (trailing == count),
                    spikes
                    if spiked is None
                    else spikes + ((spiked > 0) & ~overflow & counted).sum(),
                )
            )
        )


@dataclass(frozen=True)
class HostState:
    """The same values as :class:`LiveState`, as Python numbers: what a scaler holds before
    its first ``scale()`` (when the device is not known yet), and what checkpoints and pickles
    carry. ``extra``: a :class:`~ampscaler.HeadroomPolicy`'s own fields (history, counts) by
    name; empty for the other policies."""

    scale: float
    growth_tracker: int
    hysteresis_left: int
    stats: ScalerStats = ScalerStats()
    extra: Mapping[str, Any] = field(default_factory=dict)


class LiveState:
    """Scale, growth tracker, hysteresis budget and counters on ``device``, updated in place.

    Attributes:
        scale: the loss scale, a 0-dim float32 tensor.
        growth_tracker: clean steps in a row, a 0-dim int32 tensor.
        hysteresis_left: overflows still absorbed before the next backoff, 0-dim int32.
        tensors: the three as a :class:`~ampscaler.policy.ScaleState` (a
            :class:`~ampscaler.policy.HeadroomState`, which adds its own, for a
            :class:`~ampscaler.HeadroomPolicy`).
        counters: the step counters.
        device: where the state lives.
        unused_scale: the scale as given (not rounded to float32) until the first ``scale()``
            uses the state: what torch's ``get_scale()`` and ``state_dict()`` report until then.

    Args:
        policy: the policy whose initial budget fills ``hysteresis_left`` by default.
        device: where the state lives (the device of the first scaled tensor).
        scale: the starting scale.
        growth_tracker: the starting growth tracker.
        hysteresis_left: the starting hysteresis budget (``None``: the policy's full budget).
        stats: the starting counters (``None``: all zero).
        extra: a :class:`~ampscaler.HeadroomPolicy`'s own starting values (``None``: fresh).
    """

    def __init__(
        self,
        policy: Policy,
        device: torch.device,
        *,
        scale: float,
        growth_tracker: int = 0,
        hysteresis_left: int | None = None,
        stats: ScalerStats | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: PolicyState = initial_state(
            policy, scale, device, growth_tracker, hysteresis_left, extra
        )
        # The same tensor objects for the state's lifetime, by name.
        self.scale, self.growth_tracker, self.hysteresis_left = self.tensors[:3]
        self.device = self.scale.device
        self.counters = StepCounters(self.scale, stats)
        self.unused_scale: float | None = scale
        # An update handed over under torch.compile (see defer()); NaN: nothing pending.
        self._pending: tuple[torch.Tensor, ...] = (self._nothing(),)
        self._pending_policy = policy
        self.deferred = False

    @classmethod
    def from_host(cls, policy: Policy, device: torch.device, host: HostState) -> LiveState:
        """The live state on ``device`` holding ``host``'s values."""
        return cls(
            policy,
            device,
            scale=host.scale,
            growth_tracker=host.growth_tracker,
            hysteresis_left=host.hysteresis_left,
            stats=host.stats,
            extra=host.extra,
        )

    def to_host(self) -> HostState:
        """The values as Python numbers (a host sync)."""
        values = torch.cat([t.reshape(-1).to(torch.float64) for t in self.tensors]).tolist()
        scale, tracker, budget = values[:3]
        if self.unused_scale is not None:
            scale = self.unused_scale
        extra: dict[str, Any] = {}
        at = 3
        for name, tensor in list(self.tensors._asdict().items())[3:]:
            taken = values[at : at + tensor.numel()]
            at += tensor.numel()
            if tensor.dim():
                extra[name] = taken
            else:
                extra[name] = taken[0] if tensor.is_floating_point() else int(taken[0])
        return HostState(scale, int(tracker), int(budget), self.counters.stats(), extra)

    def advance(
        self,
        policy: Policy,
        found_inf: torch.Tensor,
        spiked: torch.Tensor | None = None,
        measured: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One iteration ended with ``found_inf`` (and a guard's ``spiked``, which the policy
        does not see; and what a :class:`~ampscaler.HeadroomPolicy` ``measured``): move the
        state by ``policy``, count it.

        Returns a copy of the scale the iteration started from. No host sync.
        """
        old = self.scale.clone()
        if isinstance(policy, HeadroomPolicy):
            policy.update_(self.tensors, found_inf, measured)
        else:
            assert isinstance(self.tensors, ScaleState)  # made for the policy in force
            policy.update_(self.tensors, found_inf)
        self.counters.record(found_inf, old, spiked)
        return old

    def _nothing(self) -> torch.Tensor:
        # A new tensor each time: one kept and reused would alias the pending flag on the
        # first compiled call, and torch.compile guards on aliasing (a recompile later).
        return torch.full((), math.nan, dtype=torch.float32, device=self.device)

    def defer(self, policy: Policy, flags: Sequence[torch.Tensor]) -> None:
        """``update()`` under ``torch.compile``: keep the iteration's inf flags and apply the
        policy at the next :meth:`settle`. No device work here: between the optimizer's graph
        break and ``zero_grad()``'s, any would be a compiled graph of its own (torch's scaler
        runs its update eagerly there, with none)."""
        self._pending = tuple(flags)
        self._pending_policy = policy
        self.deferred = True

    def settle(self) -> None:
        """Apply an update handed over by :meth:`defer`, in place (every reader calls this).

        Eagerly only when one is pending. Under ``torch.compile`` always, branch-free: the
        transition is masked by whether the kept flag is NaN (nothing pending), so the graph
        holds no Python decision that could change from step to step. No host sync.
        """
        if not (torch.compiler.is_compiling() or self.deferred):
            return
        if isinstance(self._pending_policy, HeadroomPolicy) and not self.deferred:
            return  # its updates never wait for a read (nothing to mask under torch.compile)
        found = self._pending[0]
        for flag in self._pending[1:]:
            found = found + flag
        pending = ~torch.isnan(found)
        old = self.scale.clone()
        policy = self._pending_policy
        found_or_zero = torch.where(pending, found, 0.0)
        if isinstance(policy, HeadroomPolicy):
            moved: PolicyState = policy.adjust(self.tensors, found_or_zero)
        else:
            assert isinstance(self.tensors, ScaleState)  # made for the policy in force
            moved = policy.adjust(self.tensors, found_or_zero)
        for live, value in zip(self.tensors, moved, strict=True):
            if value is not live:
                live.copy_(torch.where(pending, value, live))
        self.counters.count_now(found, old)  # kept iterations would change a compiled guard
        self._pending = (self._nothing(),)
        self.deferred = False

    def set_scale(
        self,
        value: float,
        found_inf: torch.Tensor | None,
        spiked: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``update(new_scale)``: write ``value`` into the scale (for a
        :class:`~ampscaler.HeadroomPolicy` also into what its measurements and overflows allow,
        until the next measurement or overflow); count the iteration when ``found_inf`` is
        given. Returns a copy of the old scale."""
        old = self.scale.clone()
        self.scale.fill_(value)
        if isinstance(self.tensors, HeadroomState):  # held until the next measurement
            self.tensors.target.fill_(value)
        if found_inf is not None:
            self.counters.record(found_inf, old, spiked)
        return old

    def load(self, host: HostState, policy: Policy) -> None:
        """Overwrite every value with ``host``'s (a loaded checkpoint for ``policy``), keeping
        the tensors: the scale, tracker and budget always, a
        :class:`~ampscaler.HeadroomPolicy`'s own unless their shapes change."""
        if self.unused_scale is not None:
            self.unused_scale = host.scale
        self.scale.fill_(host.scale)
        self.growth_tracker.fill_(host.growth_tracker)
        self.hysteresis_left.fill_(host.hysteresis_left)
        self.counters.reset(host.stats)
        loaded = initial_state(policy, host.scale, self.device, extra=host.extra)
        if type(loaded) is type(self.tensors) and all(
            old.shape == new.shape for old, new in zip(self.tensors, loaded, strict=True)
        ):
            for old, new in zip(self.tensors[3:], loaded[3:], strict=True):
                old.copy_(new)
        else:
            self.tensors = type(loaded)(self.scale, self.growth_tracker, self.hysteresis_left,
                                        *loaded[3:])
        self._pending_policy = policy
