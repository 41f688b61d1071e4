"""What one iteration gathers: per-optimizer records, the losses, and the outcome.

An iteration runs from the first ``scale()`` (or ``step()``) after an ``update()`` to the next
``update()``. The scaler keeps one :class:`Iteration` in progress and the last finished one;
everything that reports on steps (the overflow report, step records, skip awareness, guards)
reads them, and nothing else keeps per-iteration state of its own about the step.

Each optimizer moves through three stages within an iteration::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()------------------------------^   (step() unscales itself when needed)

Example:
    >>> import torch
    >>> iteration = Iteration()
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> record = iteration.record(opt, "step")
    >>> record.stage, iteration.stepped
    (<OptState.READY: 0>, False)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, NamedTuple, NoReturn

import torch

from .errors import ScalerUsageError
from .hooks import Veto, VetoCause
from .hostcopy import read_values

__all__ = [
    "NO_VETOES",
    "Attempt",
    "Iteration",
    "OptState",
    "OptimizerRecord",
    "SkipOrigin",
    "SkipReason",
    "StepOutcome",
]

SkipReason = Literal["nonfinite", "spike"]

#: An iteration's vetoes before any hook vetoed (read-only: :meth:`Iteration.veto` makes a new
#: mapping).
NO_VETOES: Mapping[VetoCause, Veto] = MappingProxyType({})

#: Losses kept per iteration before they are summed into one (a long accumulation).
_KEEP_LOSSES = 16


class Attempt(NamedTuple):
    """One try at a batch, as :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>` yields
    it.

    Attributes:
        number: which try (0: the first).
        limit: how many tries the batch gets at most.

    Example:
        >>> Attempt(1, 3).replay
        True
    """

    number: int
    limit: int

    @property
    def replay(self) -> bool:
        """Whether this try runs a batch again (its first try overflowed)."""
        return self.number > 0


class SkipOrigin(NamedTuple):
    """Where a skipped step's trouble came from, as the scaler tells its observers.

    Attributes:
        cause: ``"loss"`` (a loss was inf/NaN before scaling), ``"gradients"``, or ``None``
            (unknown: no loss was kept).
        ranks: with a process group, the ranks it came from (empty otherwise).
        micro_batch: for cause ``"loss"``, which ``scale()`` call had the first inf/NaN loss.
    """

    cause: str | None
    ranks: tuple[int, ...] = ()
    micro_batch: int | None = None


class OptState(enum.Enum):
    """Where an optimizer is within the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class StepOutcome:
    """One ``step()``'s verdict: the inf/NaN flag and a guard's flag, as device tensors (the
    fused path) or as known values; a tensor is read the first time it is asked about.

    Example:
        >>> outcome = StepOutcome(torch.tensor(0.0), torch.tensor(1.0))
        >>> outcome.skipped, outcome.reason
        (True, 'spike')
    """

    _found_inf: torch.Tensor | bool
    _spike: torch.Tensor | bool | None = None

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

    def keep_own_flag(self, shared: torch.Tensor | None) -> None:
        """Hold a copy of the inf/NaN flag where it is still the device tensor ``shared`` (one
        small device op), so that a later write into ``shared`` leaves the verdict as the step
        saw it."""
        if self._found_inf is shared and shared is not None:
            self._found_inf = shared.clone()


@dataclass
class OptimizerRecord:
    """What one optimizer did in the iteration."""

    # Held so that the id() the record is keyed by cannot be reused within the iteration.
    optimizer: torch.optim.Optimizer
    stage: OptState = OptState.READY
    # The checked flag on the scale's device (agreed across ranks with a process group);
    # None before the check, or when the optimizer held no gradient.
    found_inf: torch.Tensor | None = None
    # This rank's own flag, before agreement (None: this rank held none of the gradients).
    local_found_inf: torch.Tensor | None = None
    # The guards' verdict (0-dim float, > 0: skip although finite); None without guards.
    spike: torch.Tensor | None = None
    # found_inf > 0, when unscale_() already read it (None: not read yet).
    known_overflow: bool | None = None
    outcome: StepOutcome | None = None  # set by step()
    # Where a skip known on the host came from (set before the hooks hear of it).
    origin: SkipOrigin | None = None
    # Whether the hooks heard of this optimizer's overflow already (at unscale_()).
    reported: bool = False

    def ready_again(self) -> None:
        """Back to READY before ``step()``, so that ``unscale_()`` may check new gradients
        (torch's ``_per_optimizer_states[id(optimizer)]["stage"] = OptState.READY``, which
        Composer's closure scaler writes before each SAM closure). The flag stays until that
        check replaces it, as torch's ``found_inf_per_device`` does; what was read of it goes.

        Raises:
            ScalerUsageError: the optimizer was stepped in this iteration.
        """
        if self.stage is OptState.STEPPED:
            raise ScalerUsageError(
                "_per_optimizer_states[id(optimizer)]['stage'] was set to READY after "
                "scaler.step(optimizer): an optimizer steps once per iteration. Set it before "
                "step() (to unscale new gradients again), or call scaler.update() first."
            )
        self.stage = OptState.READY
        self.known_overflow, self.origin, self.reported = None, None, False


class Iteration:
    """One iteration's records, losses and outcome (module docstring). A plain class: the
    values an iteration may never set are class attributes, so that the new iteration every
    ``update()`` starts makes its four containers and nothing else.

    Attributes:
        records: per optimizer (by ``id``), in the order they were first seen.
        losses: the losses given to ``scale()``, detached: the iteration holds no autograd
            graph, so a backward that fails (out of memory) leaves nothing of it alive (read
            only on skipped steps and by guards).
        graph_scaled: whether a loss given to ``scale()`` had an autograd graph (its backward
            may have put gradients at this iteration's scale).
        scale: the live scale while the iteration runs; after ``update()`` a copy of the scale
            it ran at.
        start_scale: a copy of the scale the iteration runs at, when one was made (the first
            unscale makes one in float64, as torch forms the reciprocal from it).
        loss_nonfinite: the flag (> 0) that a loss was already inf/NaN before scaling, agreed
            across the ranks of a ``process_group`` at the check (``None``: not agreed; then
            :meth:`loss_flag` gives this rank's).
        local_loss_flag: this rank's loss flag kept as the losses come, when it is to be agreed
            (``keep_loss(..., flag=True)``; ``None`` otherwise).
        found_inf: after ``update()``: the iteration's flag (> 0: some optimizer overflowed;
            ``None``: no optimizer was checked).
        spiked: after ``update()``: the guards' flag (``None``: no guard).
        new_scale: after ``update()``: the live scale (read only by consumers of records).
        attempt: which attempt at its batch this iteration is (0: the first; see
            :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>`).
        measured: what a measuring policy's meter measured for the update (``None``: not
            measured).
        by_policy: whether ``update()`` moves the scale by the policy (``False`` for
            ``update(new_scale)``).
        vetoes: the hooks' vetoes of its steps (:class:`~ampscaler.hooks.Veto`), one by cause,
            each flag the largest of that cause's over the optimizers (empty: no hook said
            anything).
        notes: what hooks derived from the iteration, by hook (an overflow report, a trace):
            kept with it, dropped with it.
        launched: the rank agreement's reductions of this iteration not yet waited for, as
            ``(work, verdict, agreed flag)`` (:class:`~ampscaler.distributed.RankAgreement`).
    """

    records: dict[int, OptimizerRecord]
    losses: list[torch.Tensor]
    scale: torch.Tensor | None = None
    start_scale: torch.Tensor | None = None
    loss_nonfinite: torch.Tensor | None = None
    local_loss_flag: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    spiked: torch.Tensor | None = None
    new_scale: torch.Tensor | None = None
    attempt: int = 0
    losses_summed: bool = False  # a long accumulation's losses were summed into one
    graph_scaled: bool = False
    measured: torch.Tensor | None = None
    by_policy: bool = True
    vetoes: Mapping[VetoCause, Veto] = NO_VETOES
    notes: dict[str, Any]
    launched: list[Any]

    def __init__(self) -> None:
        self.records = {}
        self.losses = []
        self.notes = {}
        self.launched = []

    def record(self, optimizer: torch.optim.Optimizer, funcname: str) -> OptimizerRecord:
        """``optimizer``'s record, made at its first call.

        Raises:
            TypeError: ``optimizer`` is not an optimizer (no ``param_groups`` and ``step``).
        """
        found = self.records.get(id(optimizer))
        if found is not None:
            return found
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"scaler.{funcname}() expects a torch.optim.Optimizer (an object with "
                f"param_groups and step()), got {type(optimizer).__name__}."
            )
        made = self.records[id(optimizer)] = OptimizerRecord(optimizer)
        return made

    def veto(self, record: OptimizerRecord, said: Veto | torch.Tensor) -> None:
        """A hook vetoed ``record``'s step (``said``; a bare flag is a guard's veto): join its
        flag into the record's (what the step decides on) and into the iteration's veto of its
        cause (what is counted, reported, and replayed on where every veto that fired says
        ``replay``). A device op where a flag is joined to another; no host sync."""
        veto = said if isinstance(said, Veto) else Veto(said)
        flag = veto.flag
        record.spike = flag if record.spike is None else torch.maximum(record.spike, flag)
        earlier = self.vetoes.get(veto.cause)
        if earlier is not None:
            joined = torch.maximum(earlier.flag, flag)
            veto = Veto(joined, veto.cause, earlier.replay and veto.replay)
        self.vetoes = {**self.vetoes, veto.cause: veto}

    def vetoed_for_replay(self) -> bool:
        """Whether a veto skipped a step of this iteration and every veto that fired says
        ``replay`` (:meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>` runs the batch
        again). Reads the flags (one host copy) only where a step was skipped."""
        vetoes = list(self.vetoes.values())
        records = self.records.values()
        if not vetoes or not any(r.outcome is not None and r.outcome.skipped for r in records):
            return False
        values = read_values([veto.flag for veto in vetoes])
        fired = [veto for veto, value in zip(vetoes, values, strict=True) if value > 0]
        return bool(fired) and all(veto.replay for veto in fired)

    def require_unstarted(self, funcname: str) -> None:
        """Raise if the iteration has begun: a loss that can carry gradients was scaled (one
        with an autograd graph), or an optimizer unscaled or stepped (stricter than torch, see
        docs/migration.md). A scaled tensor without a graph leaves no gradient at the old scale
        (torch's own tests scale one to make the scale tensor before loading).

        Raises:
            ScalerUsageError: ``scale()`` of such a loss, ``unscale_()`` or ``step()`` came
                since the last ``update()``.
        """
        if self.records or self.graph_scaled:
            raise ScalerUsageError(
                f"scaler.{funcname}() was called in the middle of an iteration (after "
                "scale(), unscale_() or step(), before update()): the gradients already hold "
                "the old scale, and step() would unscale them by the new one. Call it before "
                "scale() or after scaler.update(); the scaler is unchanged."
            )

    def require_none_unscaled(self) -> None:
        """Raise if an optimizer was unscaled and not stepped: a loss scaled now would add
        scaled gradients to unscaled ones, and ``step()`` would take the sum as unscaled
        (stricter than torch, see docs/migration.md). An optimizer whose ``unscale_()`` found
        no gradient unscaled nothing: its ``step()`` refuses as torch's does ("No inf checks
        were recorded for this optimizer"), so a loop that caught ``update()``'s error for it
        goes on as over torch's scaler.

        Raises:
            ScalerUsageError: ``unscale_()`` of gradients came since the last ``update()`` and
                ``step()`` did not.
        """
        if any(
            record.stage is OptState.UNSCALED and record.found_inf is not None
            for record in self.records.values()
        ):
            raise ScalerUsageError(
                "scaler.scale() was called after scaler.unscale_(optimizer) and before its "
                "step() and update(): the new scaled gradients would be added to unscaled "
                "ones and step() would apply the sum unscaled. Call unscale_() after the last "
                "backward() of the iteration. If an iteration was interrupted after "
                "unscale_(), zero the gradients and call scaler.update() to end it."
            )

    @property
    def stepped(self) -> bool:
        """Whether any optimizer has been stepped in this iteration."""
        return any(record.stage is OptState.STEPPED for record in self.records.values())

    def keep_loss(self, loss: torch.Tensor, flag: bool = False) -> None:
        """Keep a loss given to ``scale()``, detached (a view: no device work unless many are
        kept, when they are summed into one); with ``flag``, also fold whether it is inf/NaN
        into :attr:`local_loss_flag` (two small device ops, a third for a loss of several
        elements and from the second loss on; no host sync)."""
        self.graph_scaled = self.graph_scaled or loss.requires_grad
        loss = loss.detach()
        losses = self.losses
        losses.append(loss)
        if flag:
            bad = nonfinite_flag(loss)
            previous = self.local_loss_flag
            self.local_loss_flag = bad if previous is None else torch.maximum(previous, bad)
        if len(losses) > _KEEP_LOSSES:
            losses[:] = [_loss_sum(losses)]
            self.losses_summed = True

    def __getstate__(self) -> dict[str, object]:
        # Reductions in flight belong to this object (a copy agrees anew).
        state = self.__dict__.copy()
        state["launched"] = []
        return state

    def loss(self) -> torch.Tensor | None:
        """The sum of the iteration's losses so far, unscaled (on the device; ``None`` when
        ``scale()`` kept none)."""
        return _loss_sum(self.losses) if self.losses else None

    def loss_flag(self) -> torch.Tensor | None:
        """This rank's flag, a 0-dim float32 tensor > 0 iff a kept loss is inf/NaN (``None``:
        none kept). A few device ops; no host sync."""
        loss = self.loss()
        return None if loss is None else nonfinite_flag(loss)

    def cause_flag(self) -> torch.Tensor | None:
        """The loss flag the iteration's cause is told by: the agreed one with a
        ``process_group``, else this rank's. No host sync."""
        return self.loss_nonfinite if self.loss_nonfinite is not None else self.loss_flag()

    def loss_origin(self) -> SkipOrigin:
        """The cause of a skip (agreed with a process group: :meth:`cause_flag`) and this
        rank's micro-batch of a non-finite loss (a host sync; for skipped steps)."""
        flag = self.cause_flag()
        if flag is None:
            return SkipOrigin(None)
        if not bool(flag > 0):
            return SkipOrigin("gradients")
        return SkipOrigin("loss", micro_batch=self.first_nonfinite_loss())

    def first_nonfinite_loss(self) -> int | None:
        """Which ``scale()`` call of the iteration (counting from 0) had the first inf/NaN
        loss, when the losses are still kept one by one (``None``: none, or they were summed
        after a long accumulation). A host sync; for skipped steps."""
        if not self.losses or self.losses_summed:
            return None
        device = self.losses[0].device
        finite = torch.stack([torch.isfinite(loss).all().to(device) for loss in self.losses])
        bad = (~finite).nonzero()
        return int(bad[0, 0]) if bad.numel() else None

    def outcome_flags(self) -> torch.Tensor:
        """After ``update()``: ``[found_inf, spiked, loss flag]`` as one float32 tensor on the
        scale's device (0 where there is none). A few device ops; no host sync."""
        found = self.found_inf
        assert found is not None, "the iteration ended with update()"
        flags = [found, self.spiked, self.cause_flag()]
        return torch.stack([torch.zeros_like(found) if f is None else f.to(found) for f in flags])

    def checked_flags(
        self,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None, bool | None, torch.Tensor | None]:
        """The inf flags of the optimizers that were checked, their sum (> 0 iff any
        overflowed; ``None`` for none), whether any overflowed where the host knows it
        (:meth:`overflow_known`), and the guards' flags summed (``None``: no guard said
        anything), in one pass over the records. No host sync."""
        flags: list[torch.Tensor] = []
        total = spiked = None
        known: bool | None = False
        for record in self.records.values():
            spike = record.spike
            if spike is not None:
                spiked = spike if spiked is None else spiked + spike
            flag = record.found_inf
            if flag is None:
                continue  # not checked: not in the iteration's flag
            flags.append(flag)
            total = flag if total is None else total + flag
            if known is not None:  # known on the host: read by a plain step or unscale_()
                outcome = record.outcome
                nonfinite = record.known_overflow if outcome is None else outcome._found_inf
                if nonfinite is None or isinstance(nonfinite, torch.Tensor):
                    known = None  # a flag still on the device
                else:
                    known = known or nonfinite
        return flags, total, known, spiked

    def overflow_known(self) -> bool | None:
        """Whether a checked optimizer's gradients held inf/NaN, when every check's outcome is
        known on the host (a plain optimizer's step, or ``unscale_()``, read it); ``None`` when
        one is a flag still on the device (fused optimizers, one unscaled and not stepped
        under a ``process_group``). No host sync."""
        return self.checked_flags()[2]

    def refuse_unchecked(self) -> NoReturn:
        """Raise: ``update()`` needs a flag, and no optimizer was checked.

        Raises:
            ScalerUsageError: always (no ``step()`` or ``unscale_()`` in the iteration).
        """
        raise ScalerUsageError(
            "No inf checks were recorded prior to update(). Call scaler.step(optimizer) "
            "for every optimizer of the iteration before scaler.update()."
        )


def nonfinite_flag(values: torch.Tensor) -> torch.Tensor:
    """``1.0`` if any of ``values`` is inf or NaN, else ``0.0``: a 0-dim float32 tensor, outside
    any autograd graph (two small device ops for a 0-dim tensor, three otherwise; no host
    sync).

    Example:
        >>> nonfinite_flag(torch.tensor([1.0, float("inf")])), nonfinite_flag(torch.tensor(2.0))
        (tensor(1.), tensor(0.))
    """
    with torch.no_grad():  # values - values: 0 where finite, NaN where inf or NaN
        zeroed = values.sub(values) if values.dim() == 0 else values.sub(values).sum()
        return zeroed.nan_to_num_(nan=1.0).float()


def _loss_sum(losses: list[torch.Tensor]) -> torch.Tensor:
    """The (detached) losses summed into one float32 value, on the first one's device."""
    device = losses[0].device
    if len(losses) == 1:
        return losses[0].to(torch.float32).sum()
    return torch.stack([loss.to(device, torch.float32).sum() for loss in losses]).sum()
