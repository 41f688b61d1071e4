"""The one hook protocol: how optional features plug into an iteration of the scaler.

A :class:`Hook` is told about a few named moments of one iteration. Every moment is a no-op
on the base class; a hook overrides the ones it needs, and the scaler calls a hook only at the
moments it overrides (:class:`HookList` keeps one tuple per moment), so a hook that is not due
costs nothing::

    scale(loss)  ──▶ at_scale        every scale() call (eagerly)
    unscale_/step──▶ before_check    the optimizer's scaled gradients, before the check
                 ──▶ after_check     the checked gradients; a veto (flag > 0) skips the step
                 ──▶ after_step      the step's outcome (plain: known; fused: a device flag)
                 ──▶ on_skip         a step known on the host to have skipped for inf/NaN
    update()     ──▶ before_update   before the policy moves (a measurement goes in here)
                 ──▶ after_update    the iteration has ended and been counted
                 ──▶ periodic        every so many updates (eagerly), as the hook asks

What a hook receives is the scaler's own record of the iteration
(:class:`~ampscaler.iteration.Iteration`, :class:`~ampscaler.iteration.OptimizerRecord`) and
its live state (:class:`~ampscaler.state.LiveState`); a hook that only observes reads them
and changes nothing. Guards (:mod:`ampscaler.guards`), the observers (:mod:`ampscaler.observe`)
and a measuring policy's meter (:class:`MeterHook`) plug in this way; so does a hook of your
own, with :meth:`GradScaler.attach <ampscaler.GradScaler.attach>`.

Example:
    >>> import torch, ampscaler
    >>> class CountSkips(ampscaler.Hook):
    ...     def __init__(self):
    ...         self.skips = 0
    ...     def on_skip(self, iteration, record, live):
    ...         self.skips += 1
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = ampscaler.GradScaler("cpu")
    >>> counter = scaler.attach(CountSkips())
    >>> scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> counter.skips
    1
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from .errors import InvalidConfigError

if TYPE_CHECKING:
    from .distributed import Agreement, RankAgreement
    from .grads.collect import GradGroups
    from .iteration import Iteration, OptimizerRecord
    from .policy.base import Meter
    from .state import LiveState

__all__ = ["MOMENTS", "Check", "Hook", "HookList", "MeterHook", "Veto", "VetoCause"]

#: The moments of an iteration, in the order they come.
MOMENTS = (
    "at_scale",
    "before_check",
    "after_check",
    "after_step",
    "on_skip",
    "before_update",
    "after_update",
    "periodic",
)


class VetoCause(enum.IntEnum):
    """Why a hook vetoed a step whose gradients were finite; the value is the number
    :meth:`GradScaler.metrics <ampscaler.GradScaler.metrics>` reports as ``skip_cause``, and
    each cause has its own counter there."""

    #: A guard's skip rule (:class:`~ampscaler.SpikeGuard`, or a hook's own): counted in
    #: ``spike_skips``.
    GUARD = 3
    #: Every gradient a measuring policy's meter measured flushed to zero before it measured
    #: anything (the step would apply zeros): counted in ``flush_skips``.
    FLUSHED = 4


class Veto(NamedTuple):
    """A hook's veto of one optimizer's step at :meth:`Hook.after_check`: the step is skipped
    where ``flag > 0``, although its gradients are finite.

    The core handles every veto alike: the step is skipped (a fused kernel is handed the flag),
    the policy does not back off for it, it is counted under its ``cause``, and
    :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>` runs the batch again only where
    every veto that fired says ``replay`` (the flag is read there, one host copy with the
    rest). With a ``process_group`` the flag must be the same on every rank: a hook agrees
    what it decides from over :attr:`Check.agreement` (a guard sums its statistics, a meter
    max-reduces its measurement), so every rank skips, counts and replays alike.

    Attributes:
        flag: a 0-dim float32 tensor on the scale's device (``> 0``: skip).
        cause: why (:class:`VetoCause`).
        replay: whether running the batch again at the scale the update leaves can help (a
            meter's flush veto: the policy grows; not a guard's: the batch itself is suspect).

    Example:
        >>> veto = Veto(torch.tensor(1.0), VetoCause.FLUSHED, replay=True)
        >>> int(veto.cause), Veto(torch.tensor(0.0)).cause.name
        (4, 'GUARD')
    """

    flag: torch.Tensor
    cause: VetoCause = VetoCause.GUARD
    replay: bool = False


class Check(NamedTuple):
    """What :meth:`Hook.after_check` is given about one optimizer's check.

    Attributes:
        iteration: the iteration in progress (its losses: :meth:`~ampscaler.iteration.
            Iteration.loss`).
        record: the optimizer's record (``record.optimizer``; ``record.found_inf`` is not set
            yet).
        groups: the gradients as checked, by device and dtype.
        unscaled_by: dividing the checked gradients by this gives the true ones (0-dim, on the
            scale's device).
        live: the scaler's live state.
        agreement: the scaler's rank agreement (``None``: no ``process_group``), for a hook
            whose verdict must be the same on every rank.
    """

    iteration: Iteration
    record: OptimizerRecord
    groups: GradGroups
    unscaled_by: torch.Tensor
    live: LiveState
    agreement: RankAgreement | None


class Hook:
    """One plug-in of a :class:`~ampscaler.GradScaler`: override the moments you need (module
    docstring); the scaler never calls the others. Eager moments run outside
    ``torch.compile`` only (``at_scale``, ``on_skip``, ``periodic``); the others also run in
    a compiled ``unscale_``/``update()``, where they must not read values on the host."""

    #: Whether a scaler takes at most one hook of this class (the probe, the tracer).
    unique = False

    def at_scale(self, iteration: Iteration) -> None:
        """``scale()`` was called in ``iteration`` (every call)."""

    def before_check(self, record: OptimizerRecord, scale: torch.Tensor) -> None:
        """``record.optimizer``'s gradients are about to be checked; they are still scaled by
        ``scale`` (the live scale tensor)."""

    def after_check(self, check: Check) -> Veto | torch.Tensor | None:
        """An optimizer's gradients were checked (and unscaled). Return a :class:`Veto` (its
        flag > 0: skip this step although the gradients are finite; the scale does not back
        off), a bare flag for a guard's veto (``Veto(flag)``), or ``None`` for no say. Must not
        read the device."""
        return None

    def after_step(self, iteration: Iteration, record: OptimizerRecord, live: LiveState) -> None:
        """``step()`` decided for ``record.optimizer``: ``record.outcome`` says whether it
        stepped (a flag still on the device for a fused optimizer)."""

    def on_skip(self, iteration: Iteration, record: OptimizerRecord, live: LiveState) -> None:
        """``record.optimizer``'s gradients held inf/NaN, known on the host (a plain step that
        skipped, or ``unscale_()`` that read its flag): the gradients are as the check saw
        them. ``record.origin`` says where it came from."""

    def before_update(self, iteration: Iteration, live: LiveState) -> None:
        """``update()`` is about to move the state (by the policy, or to ``new_scale``:
        ``iteration.by_policy`` says which); a hook that measures for the policy sets
        ``iteration.measured`` here. A hook at this moment makes ``update()`` run eagerly under
        ``torch.compile``."""

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """``iteration`` ended: its outcome is set (``found_inf``, ``spiked``, ``scale``,
        ``new_scale``) and the counters have counted it (``compiling``: under
        ``torch.compile``)."""

    def periodic(self, iteration: Iteration, live: LiveState, updates: int) -> int:
        """Called after an eager ``update()`` when due, ``updates`` updates after it was last
        called; returns how many updates from now it is due next (``>= 1``). First due after
        one update."""
        return NEVER

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """``scaler.watch()`` was given ``model`` (names prefixed by ``prefix``)."""

    def adopt(self, plugin: object) -> bool:
        """Take ``plugin`` (given to :meth:`GradScaler.attach <ampscaler.GradScaler.attach>`)
        under this hook's care if it is of the kind the hook holds (guards, probes...);
        whether it did."""
        return False

    def release(self, plugin: object) -> bool:
        """Let go of ``plugin`` if this hook holds it (:meth:`GradScaler.detach
        <ampscaler.GradScaler.detach>`); whether it did."""
        return False

    def save(self) -> dict[str, Any]:
        """What ``state_dict()`` holds for this hook (keys beside the scaler's own)."""
        return {}

    def readings(self, live: LiveState) -> Mapping[str, torch.Tensor]:
        """Values this hook adds to :meth:`GradScaler.metrics <ampscaler.GradScaler.metrics>`,
        by name: 0-dim tensors on the state's device, read in the one host copy ``metrics()``
        makes (an integer dtype reads as an ``int``)."""
        return {}

    def heard(self, values: Mapping[str, float], scale: float) -> None:
        """``metrics()`` read ``values`` (every hook's :meth:`readings`, by name) at the scale
        ``scale``: a hook that warns on what it reads does it here."""

    def prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None] | None:
        """Validate this hook's part of ``state_dict``; returns what restores it (nothing
        changes before that is called), or ``None`` for nothing to restore.

        Raises:
            InvalidStateDictError: its part does not fit the hook.
        """
        return None

    def moments(self) -> Collection[str]:
        """The moments this hook is due at: by default those its class overrides. A hook whose
        needs change with what it holds overrides this and calls :meth:`changed` after a
        change."""
        return [m for m in MOMENTS if getattr(type(self), m) is not getattr(Hook, m)]

    def changed(self) -> None:
        """Tell the scaler that :meth:`moments` changed (the hook list replaces this method
        with one that sorts the hook again)."""


#: ``periodic``'s answer for "not again".
NEVER = 1 << 30


@dataclass
class _Periodic:
    """A periodic hook, the updates until it is due, and since it was last called."""

    hook: Hook
    left: int = 1
    since: int = 0


_H = TypeVar("_H", bound=Hook)


class HookList:
    """A scaler's hooks in the order they were added, and for each moment those that override
    it (plain tuples: the scaler loops over them; an empty one costs a loop over nothing).

    Example:
        >>> class OnSkip(Hook):
        ...     def on_skip(self, iteration, record, live): ...
        >>> hooks = HookList()
        >>> hook = hooks.add(OnSkip())
        >>> hooks.on_skip == (hook,), hooks.after_update
        (True, ())
    """

    at_scale: tuple[Hook, ...] = ()
    before_check: tuple[Hook, ...] = ()
    after_check: tuple[Hook, ...] = ()
    after_step: tuple[Hook, ...] = ()
    on_skip: tuple[Hook, ...] = ()
    before_update: tuple[Hook, ...] = ()
    after_update: tuple[Hook, ...] = ()

    def __init__(self) -> None:
        self._hooks: list[Hook] = []
        self._periodic: list[_Periodic] = []
        #: Eager updates until a periodic hook is due (counted down by the scaler).
        self.due_in = NEVER
        self._elapsed = NEVER  # due_in as last set

    def __iter__(self) -> Iterator[Hook]:
        return iter(list(self._hooks))

    def add(self, hook: _H) -> _H:
        """Add ``hook`` after the others.

        Raises:
            TypeError: not a :class:`Hook`. InvalidConfigError: added already (or one of its
                class, for a :attr:`~Hook.unique` one).
        """
        if not isinstance(hook, Hook):
            raise TypeError(f"a hook must subclass ampscaler.Hook, got {type(hook).__name__}.")
        if any(existing is hook for existing in self._hooks):
            raise InvalidConfigError(f"{hook!r} is attached to this scaler already.")
        if hook.unique and self.find(type(hook)) is not None:
            raise InvalidConfigError(
                f"This scaler already has a {type(hook).__name__} attached; it takes one."
            )
        self._hooks.append(hook)
        hook.changed = self._sort  # type: ignore[method-assign]
        self._sort()
        return hook

    def remove(self, hook: Hook) -> None:
        """Remove ``hook``.

        Raises:
            ValueError: it is not in the list.
        """
        if not any(existing is hook for existing in self._hooks):
            raise ValueError(f"{hook!r} is not attached to this scaler; see scaler.attach().")
        self._hooks = [existing for existing in self._hooks if existing is not hook]
        del hook.changed
        self._sort()

    def find(self, kind: type[Any]) -> Any:
        """The first hook that is a ``kind``, or ``None``."""
        return next((hook for hook in self._hooks if isinstance(hook, kind)), None)

    def run_periodic(self, iteration: Iteration, live: LiveState) -> None:
        """Call the periodic hooks that are due (:attr:`due_in` has counted down to 0), and
        set :attr:`due_in` to the next one."""
        self._count_elapsed()
        for entry in self._periodic:
            if entry.left <= 0:
                entry.left = max(1, entry.hook.periodic(iteration, live, entry.since))
                entry.since = 0
        self._set_due_in()

    def _count_elapsed(self) -> None:
        elapsed = self._elapsed - self.due_in
        for entry in self._periodic:
            entry.left -= elapsed
            entry.since += elapsed
        self._elapsed = self.due_in

    def _set_due_in(self) -> None:
        self.due_in = self._elapsed = min((e.left for e in self._periodic), default=NEVER)

    def _sort(self) -> None:
        self._count_elapsed()
        due = {id(hook): set(hook.moments()) for hook in self._hooks}
        for moment in MOMENTS[:-1]:
            setattr(self, moment, tuple(h for h in self._hooks if moment in due[id(h)]))
        kept = {id(entry.hook): entry for entry in self._periodic}
        self._periodic = [
            kept.get(id(hook)) or _Periodic(hook)
            for hook in self._hooks
            if "periodic" in due[id(hook)]
        ]
        self._set_due_in()

    def __getstate__(self) -> dict[str, Any]:
        return {"hooks": self._hooks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        for hook in state["hooks"]:
            self.add(hook)


class MeterHook(Hook):
    """A measuring policy's meter (:class:`~ampscaler.policy.Meter`) as a hook: it starts at
    ``scale()``, measures before each check, hands the measurement to the policy before the
    update (agreed across ranks by ``agree``, when given) and moves on after it.

    A meter that has a ``veto(state, agreement)`` method (:class:`~ampscaler.policy.meter.
    HeadroomMeter`) is also asked after each check whether to skip the step although its
    gradients are finite: a step whose every measured gradient flushed to zero, taken before
    the policy measured anything, would apply zero gradients. Its :class:`Veto` (cause
    :attr:`VetoCause.FLUSHED`, the flag agreed across the ranks by the meter) skips the step
    without backing the scale off, as every veto does, and the policy grows on the
    measurement; the veto says ``replay``, so :meth:`GradScaler.attempts
    <ampscaler.GradScaler.attempts>` runs the batch again at the grown scale.

    Args:
        meter: the policy's meter.
        agreement: the scaler's agreement, which max-reduces a measurement over its process
            groups, if any (one all_reduce of one value, on measured iterations only: every
            rank follows the same schedule).
    """

    def __init__(self, meter: Meter, agreement: Agreement) -> None:
        self.meter = meter
        self._agreement = agreement
        self._veto: Callable[..., torch.Tensor | None] | None = getattr(meter, "veto", None)
        self._vetoing = self._may_veto()
        #: Whether the meter warned on what ``metrics()`` read (once per scaler: a meter that
        #: replaces this one, after a load or a replay's rewind, is handed it).
        self.warned = False

    def _may_veto(self) -> bool:
        """Whether the meter may veto the iteration in progress (once it may not, it never
        may again: its ``may_veto`` holds for the first iterations only)."""
        return self._veto is not None and bool(getattr(self.meter, "may_veto", False))

    def moments(self) -> Collection[str]:
        """Its moments; ``after_check`` only while the meter may veto, so that the iterations
        after cost nothing there."""
        due = super().moments()
        return due if self._vetoing else [m for m in due if m != "after_check"]

    def after_check(self, check: Check) -> Veto | None:
        """The meter's veto of this step (class docstring); no host sync."""
        assert self._veto is not None, "due only with a meter that vetoes"
        flag = self._veto(check.live.tensors, check.agreement)
        return None if flag is None else Veto(flag, VetoCause.FLUSHED, replay=True)

    def at_scale(self, iteration: Iteration) -> None:
        self.meter.start()

    def before_check(self, record: OptimizerRecord, scale: torch.Tensor) -> None:
        self.meter.measure(record.optimizer)

    def before_update(self, iteration: Iteration, live: LiveState) -> None:
        if not iteration.by_policy:  # update(new_scale): the policy is not consulted
            self.meter.skip()
            return
        measured = self.meter.take(live.device)
        if measured is not None:
            measured = self._agreement.max_over_ranks(measured)
        if measured is None and iteration.overflow_known() is not False:
            # An iteration that may have overflowed reaches the policy with "nothing measured"
            # (< 0): the overflow itself is a measurement (HeadroomPolicy's bound). The flag is
            # agreed across ranks already, so every rank passes the same.
            measured = torch.full((), -1.0, dtype=torch.float32, device=live.device)
        iteration.measured = measured

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        if iteration.by_policy:
            self.meter.advance()
            if self._vetoing and not self._may_veto():
                self._vetoing = False
                self.changed()  # after_check is no longer due

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        self.meter.watch(model, prefix)

    def readings(self, live: LiveState) -> Mapping[str, torch.Tensor]:
        """The meter's values for ``metrics()`` (its ``readings(state)``, where it has one)."""
        readings = getattr(self.meter, "readings", None)
        return {} if readings is None else readings(live.tensors)

    def heard(self, values: Mapping[str, float], scale: float) -> None:
        """Let the meter warn on what ``metrics()`` read (its ``heard(values, scale)``, which
        says whether it warned), once."""
        heard = getattr(self.meter, "heard", None)
        if heard is not None and not self.warned:
            self.warned = bool(heard(values, scale))

    def __repr__(self) -> str:
        return f"MeterHook({self.meter!r})"
