"""Agreeing on overflow across ranks: one inf/NaN verdict for every rank of one or more
process groups.

With sharded gradients (FSDP, ZeRO, tensor or pipeline parallelism) each rank checks only its
own shard. A rank that finds inf/NaN skips its step and backs off its scale while the others
step and keep theirs, and the replicas silently diverge. :class:`RankAgreement` max-reduces
each optimizer's inf flag over a process group, so every rank of the group steps or skips
together and moves its scale identically.

Several groups (Megatron's layout: a tensor-parallel group and a data-parallel group that
together span a grid of ranks) are reduced one after the other: after the max over this rank's
tensor-parallel group and then over its data-parallel group, every rank of the grid holds the
max over the whole grid, with one collective per group and no group that spans the union.
Groups contained in another given group add nothing and are dropped, as are repeats.

The collectives, in the order every rank issues them. Which ones a rank makes never depends on
its own state, only on what every rank reads from the same reduction, so a fault on one rank
becomes the same error on every rank instead of a hang until the group's timeout:

* per optimizer per iteration: one ``all_reduce(MAX)`` per group (the last one asynchronous)
  of a small float tensor, the *verdict*: the optimizer's inf flag, whether a loss of the
  iteration was already inf/NaN before scaling (so every rank knows the skip's cause, ``loss``
  if a loss was non-finite on any rank, else ``gradients``, and decides alike on it), whether
  this rank held any of its gradients, and a fingerprint ``f`` as ``(f, -f)``, so that the
  maximum shows whether every rank had the same. The fingerprint hashes the scaler's settings
  (as of the first step and of each load), its live state tensors (scale, growth tracker and
  the policy's own) and how often ``load_state_dict()`` was called. The state is hashed at the
  first step, after a load, and whenever something other than the scaler's own policy
  transition wrote it since (``update(new_scale)``, a setter, a write to the tensor: their
  version counters say so); in between, the last hash is sent again (ranks that held the same
  state and moved it by the same agreed transition still hold the same state), so a steady
  step adds no device work for it. A write on one rank only is therefore found even where it
  wrote what the others hold, as a load on one rank only is. Started as soon as the gradients
  are checked, waited on only where the step decision needs it;
* when the fingerprints differed (a rank loaded another checkpoint, or loaded when the others
  did not, or was configured or moved differently): one gather of the settings per group, to
  name the differences in the :class:`~ampscaler.InvalidConfigError` every rank then raises.
  The step is skipped on every rank: non-fused optimizers raise in that ``step()`` (which reads
  its verdict anyway); fused ones, whose kernel gets the verdict without a read, raise at the
  next check of an optimizer (waiting for a copy of the verdict that has long landed);
* per skipped optimizer step only (plain optimizers): one gather of the local flags per group,
  to name the ranks the overflow came from (and the micro-batch of a non-finite loss).

An optimizer that holds gradients on no rank of the groups is refused as torch's
``GradScaler`` refuses it, on every rank: a non-fused one in ``step()``, a fused one in
``update()``; with ``refuse_unchecked=False`` (torch's ``ShardedGradScaler``, which gives such
an optimizer a clean flag) it is stepped as a clean one.

Every rank must therefore call the scaler's methods in the same order, as training loops do.

Example (one process; real runs use ``torchrun`` and ``init_process_group``)::

    >>> import torch, torch.distributed as dist
    >>> from ampscaler.distributed import RankAgreement
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> agreement = RankAgreement(dist.group.WORLD)
    >>> agreement.max_over_ranks(torch.tensor(1.0))   # one all_reduce, waited for
    tensor(1.)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from .errors import InvalidConfigError, ScalerUsageError, warn_at_caller
from .hostcopy import HostCopy, read_values
from .iteration import Iteration, OptimizerRecord, SkipOrigin

if TYPE_CHECKING:
    from .scaler import OneRank

__all__ = [
    "NO_GROUP",
    "Agreement",
    "GroupSpec",
    "RankAgreement",
    "SettingValue",
    "agreement_for",
    "refuse_alone",
]

GroupSpec = dist.ProcessGroup | Sequence[dist.ProcessGroup]
"""What ``process_group=`` takes: one group, or several whose union must agree."""

SettingValue = float | int | bool | str | None | torch.Tensor
"""A setting compared across ranks: a Python number or string, ``None``, or a tensor of the
live state (compared value by value; named in messages by its sum when it has several)."""

#: The name under which ranks compare how often they loaded a checkpoint.
LOADS = "load_state_dict() calls"

#: Fingerprints are taken modulo this prime (the largest below 2**24): float32 holds them exactly.
_PRIME = 16777213

#: The slots of a verdict: the loss flag, whether the rank held gradients, the inf flag, the
#: fingerprint and its negation (the max of the negation is minus the smallest fingerprint).
#: The last three are adjacent: after the max, their sum is the inf flag plus how far the
#: largest fingerprint is above the smallest (one sum folds a mismatch into the flag).
_LOSS, _HELD, _FLAG, _PRINT, _NEG_PRINT = range(5)


Agreement: TypeAlias = "OneRank | RankAgreement"
"""How a scaler reaches each optimizer's verdict: the one component it calls at the same points
of every iteration, whether the rank is alone (the scaler's own ``OneRank``, in ``scaler.py``)
or one of the ranks of process groups (:class:`RankAgreement`). The scaler never asks which it
holds. Both have, in the order an iteration calls them:

- ``ranks``: the agreement over process groups (``None``: this rank alone), for a hook whose
  own verdict must be the same on every rank (a guard's reduction); ``local_shards``: whether
  gradients are checked through this rank's local shards (``DTensor``), the agreement making
  the verdict whole; ``flags_losses``: whether ``scale()`` keeps each loss's inf/NaN flag as the
  losses come (two or three small device ops), for the agreement to agree on at the check;
- ``agree(record, found_inf, iteration, device, settings)``: ``record.optimizer``'s gradients
  were checked (``found_inf``; ``None``: none on this rank): set ``record.found_inf`` to the
  verdict (on the device, no host sync);
- ``read_early(record)``: at ``unscale_()`` of a plain optimizer, whether it overflowed, where
  reading it now is the one host sync its step needs anyway (``None``: not read now);
- ``decide(record, iteration, settings)``: a plain optimizer's step, whether it is skipped
  (inf/NaN or a guard's veto; a host sync), setting ``record.origin`` where it learned where a
  skip's trouble came from; ``before_kernel(record, iteration)``: a fused optimizer's kernel is
  about to take ``record.found_inf``, made final here;
- ``flags(iteration)``: at ``update()``, :meth:`Iteration.checked_flags
  <ampscaler.iteration.Iteration.checked_flags>`, as agreed; ``moved()``: the policy has just
  moved the state, eagerly, by the agreed flags; ``loaded()``: a checkpoint was loaded;
- ``refuse_alone(reason)``: raise :class:`~ampscaler.InvalidConfigError` if this rank decides
  alone among several (:func:`refuse_alone`); ``max_over_ranks(value)``: ``value``, max-reduced
  over the ranks (a measurement every rank must act on).
"""


def refuse_alone(reason: str) -> None:
    """Refuse to go on when torch.distributed runs more than one rank and the scaler has no
    ``process_group`` to agree over: ``reason`` says what would diverge.

    Raises:
        InvalidConfigError: torch.distributed is initialized with more than one rank.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise InvalidConfigError(
            f"{reason} Pass process_group= (torch.distributed.group.WORLD with DDP) so that the "
            "ranks agree, as they agree on overflow."
        )


class _NoGroup:
    """The default of ``process_group=``: no agreement. Told apart from an explicit ``None``,
    which is also what ``torch.distributed.group.WORLD`` is before ``init_process_group()``."""

    def __repr__(self) -> str:
        return "None"


#: ``process_group``'s default (shown as ``None``): the ranks do not agree.
NO_GROUP: Any = _NoGroup()


def agreement_for(
    process_group: GroupSpec | None,
    refuse_unchecked: bool,
    alone: Callable[[bool], Agreement],
) -> Agreement:
    """The agreement ``process_group=`` asks for (``refuse_unchecked``: see
    :class:`RankAgreement`); without a group, ``alone(look)``, where ``look`` says whether to
    look at the first step for the likely mistake of an explicit ``None`` given before
    torch.distributed was initialized (see :func:`warn_if_world_came_later`).

    Raises:
        InvalidConfigError: see :class:`RankAgreement`.
    """
    if process_group is NO_GROUP:
        return alone(False)
    if process_group is None:
        return alone(dist.is_available() and not dist.is_initialized())
    return RankAgreement(process_group, refuse_unchecked)


def warn_if_world_came_later() -> None:
    """At the first step of a scaler given ``process_group=None`` before torch.distributed was
    initialized: if it is initialized now with several ranks, the ``None`` was most likely
    ``torch.distributed.group.WORLD`` read too early, and the ranks do not agree; say so (a
    :class:`UserWarning`). Nothing when this process is alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    warn_at_caller(
        f"This GradScaler was given process_group=None before torch.distributed was "
        f"initialized, and this process is now rank {dist.get_rank()} of "
        f"{dist.get_world_size()}: the ranks do not agree on overflow (with sharded gradients "
        "-- FSDP, ZeRO, tensor or pipeline parallelism -- their scales and parameters drift "
        "apart). If the None was torch.distributed.group.WORLD, which is None until "
        "init_process_group(), construct the scaler after init_process_group(), or use "
        "ampscaler.ShardedGradScaler, which looks the default group up at its first scale(). "
        "With DDP no agreement is needed: leave process_group out.",
        UserWarning,
    )


def _require_group(group: object) -> dist.ProcessGroup:
    if not dist.is_available():
        raise InvalidConfigError(
            "process_group was given, but this build of torch has no torch.distributed; use a "
            "build with distributed support, or leave process_group=None."
        )
    if not dist.is_initialized():
        raise InvalidConfigError(
            "process_group was given, but torch.distributed is not initialized, so the ranks "
            "cannot agree on overflow. Call torch.distributed.init_process_group() before "
            "constructing the GradScaler (note that torch.distributed.group.WORLD is None "
            "until then)."
        )
    outside = dist.GroupMember.NON_GROUP_MEMBER
    if (isinstance(group, int) and group == outside) or (
        isinstance(group, dist.ProcessGroup) and _rank_in(group) < 0
    ):
        raise InvalidConfigError(
            f"This process (rank {dist.get_rank()}) is not a member of process_group (new_group() "
            "returns a placeholder on ranks outside the group); pass the group this rank "
            "belongs to."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise InvalidConfigError(
            "process_group must be a torch.distributed.ProcessGroup or a list of them (for "
            f"example torch.distributed.group.WORLD, or groups from new_group()), got {group!r}."
        )
    return group


def _rank_in(group: dist.ProcessGroup) -> int:
    """This process's rank in ``group`` (< 0: not a member).

    Raises:
        InvalidConfigError: the group was destroyed.
    """
    try:
        return int(dist.get_rank(group))
    except (ValueError, RuntimeError) as error:
        raise InvalidConfigError(
            f"process_group {group!r} cannot be used ({error}); it was probably destroyed "
            "(destroy_process_group). Pass a live group, and destroy it only after training."
        ) from error


def _distinct_groups(spec: object) -> tuple[dist.ProcessGroup, ...]:
    """The groups of ``spec`` that add something: repeats and groups whose ranks lie within
    another given group are dropped (reducing over the larger one covers them)."""
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not specs:
        raise InvalidConfigError(
            "process_group is an empty list; pass the groups whose ranks must agree, or "
            "None for none."
        )
    groups = [_require_group(group) for group in specs]
    members = [frozenset(dist.get_process_group_ranks(group)) for group in groups]
    return tuple(
        group
        for index, (group, ranks) in enumerate(zip(groups, members, strict=True))
        if not any(
            ranks < other or (ranks == other and earlier < index)
            for earlier, other in enumerate(members)
        )
    )


class RankAgreement:
    """Makes the ranks of ``groups`` agree on each step's inf/NaN verdict.

    ``agree`` starts the max-reduction of one optimizer's verdict (module docstring), kept in
    the iteration (``Iteration.launched``: per-step state lives there) until the first read of
    a verdict waits for every reduction of the iteration (with NCCL the wait is a stream
    dependency, not a host sync) and skips, on the device, every step whose fingerprints
    differed. ``decide`` (non-fused steps), ``check_settings`` (after differing fingerprints)
    and ``origins`` (on skipped steps) read from the device: host syncs.

    Args:
        groups: one process group, or several (see the module docstring).
        refuse_unchecked: refuse an optimizer none of whose gradients any rank held, as
            torch's ``GradScaler`` refuses it (``False``: step it as clean, as torch's
            ``ShardedGradScaler`` does).

    Raises:
        InvalidConfigError: (a ``ValueError``, as torch raises for an uninitialized default
            group) torch.distributed not initialized, an empty list, something that is not a
            process group, a destroyed group, or a group this rank is not a member of.
    """

    def __init__(self, groups: GroupSpec, refuse_unchecked: bool = True) -> None:
        #: The groups the flags are reduced over, in order (repeats and contained ones left out).
        self.groups = _distinct_groups(groups)
        self._refuse_unchecked = refuse_unchecked
        self._loads = 0  # load_state_dict() calls on this rank (part of the fingerprint)
        # Copies, on their way to the host, of verdicts settled since the last check that no
        # decide() read (fused steps): their fingerprints are compared at the next agree().
        self._landing: list[HostCopy] = []
        # The settings and state tensors the verdicts fingerprint: taken at the first verdict
        # and after each load (the tensors are the live ones, read at every verdict).
        self._compared: _Compared | None = None

    def _gather(self, value: Any) -> dict[int, Any]:
        """Every rank's ``value`` that the groups reach, by global rank: gathered over one
        group after the other, each time with everything known so far, so that for groups
        forming a grid every rank ends up knowing every rank of the grid."""
        known = {dist.get_rank(): value}
        for group in self.groups:
            parts: list[dict[int, Any] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, known, group=group)
            for part in parts:
                if part is not None:
                    known.update(part)
        return known

    def check_settings(self, settings: Mapping[str, SettingValue]) -> None:
        """Stop every rank, naming the differences and the ranks, if the ranks' ``settings``
        differ.

        Every rank of the groups must call this at the same point (the scaler does it on every
        rank when the fingerprints in a verdict differed). Tensor values are read from their
        device; one host sync, and one gather per group.

        Raises:
            InvalidConfigError: naming each differing setting and its value on every rank.
        """
        row = _plain_row(settings)
        table = self._gather(row)
        names = dict.fromkeys(name for rank in sorted(table) for name in table[rank])
        differing = [
            self._describe(name, settings.get(name), {r: table[r].get(name) for r in table})
            for name in names
            if any(table[rank].get(name) != row.get(name) for rank in table)
        ]
        if differing:
            raise InvalidConfigError(
                "GradScaler settings or state differ across the ranks of process_group, so "
                f"their scales would diverge: {'; '.join(differing)}. Construct the scaler with "
                "the same arguments on every rank, and load the same state_dict on every rank "
                "or on none."
            )

    @staticmethod
    def _describe(name: str, local: SettingValue, column: dict[int, float | str | None]) -> str:
        integral = isinstance(local, (bool, int)) or (
            isinstance(local, torch.Tensor) and not local.is_floating_point()
        )
        by_value: dict[float | str | None, list[int]] = {}
        for rank in sorted(column):
            by_value.setdefault(column[rank], []).append(rank)
        parts = []
        for value, ranks in by_value.items():
            if value is None or isinstance(value, str):
                shown = str(value)
            elif isinstance(local, bool):
                shown = str(bool(value))
            else:
                shown = str(int(value)) if integral else f"{value:g}"
            label = "rank" if len(ranks) == 1 else "ranks"
            parts.append(f"{shown} on {label} {', '.join(map(str, ranks))}")
        return f"{name} is {', '.join(parts)}"

    # ------------------------------------------------------------------ the Agreement protocol

    #: Gradients are checked through this rank's local shards; the verdict makes them whole.
    local_shards = True
    #: The losses' inf/NaN flag is agreed at the check (the skip's cause, alike on every rank).
    flags_losses = True

    @property
    def ranks(self) -> RankAgreement:
        """This agreement (:data:`Agreement`)."""
        return self

    def agree(
        self,
        record: OptimizerRecord,
        found_inf: torch.Tensor | None,
        iteration: Iteration,
        device: torch.device,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> None:
        """Start agreeing on one optimizer's inf flag from the check (``None``: this rank held
        none of its gradients, and takes part with a clean flag) and on the iteration's loss
        flag (``None``: no loss kept; a clean flag).

        Sets ``record.local_found_inf`` (``found_inf`` as given), ``record.found_inf`` and
        ``iteration.loss_nonfinite`` (0-dim views of one verdict), which hold the agreed values
        once the reductions are waited for (by :meth:`decide`, :meth:`before_kernel` or
        :meth:`flags`, whichever reads them first); the reduction is kept in
        ``iteration.launched`` until then. The verdict carries a fingerprint of
        ``settings()`` (the configuration and the live state) and of the checkpoint loads, so
        that ranks that differ are found in this reduction (module docstring). First, if an
        earlier verdict found differing fingerprints that no ``decide()`` has read yet, waits
        for its copy (long landed, normally) and raises on every rank.

        Raises:
            InvalidConfigError: an earlier verdict's fingerprints differed (every rank raises).
        """
        if self._landed_differ():
            self._stop(settings)
        if self._compared is None:  # the first time, and after a load
            self._compared = _Compared(settings(), self._loads)
        no, yes, _, _ = self._compared.made(device)
        flag, held = (no, no) if found_inf is None else (found_inf.to(torch.float32), yes)
        local_loss = iteration.local_loss_flag
        loss = no if local_loss is None else local_loss.to(device, torch.float32)
        fingerprint, negated = self._compared.fingerprint(device)
        if loss.dim():
            loss = loss.reshape(())
        verdict = torch.stack([loss, held, flag, fingerprint, negated])
        slots = verdict.unbind()  # the views, in one op
        agreed = slots[_FLAG]
        iteration.launched.append((self._reduce(verdict, dist.ReduceOp.MAX), verdict, agreed))
        record.local_found_inf, record.found_inf = found_inf, agreed
        iteration.loss_nonfinite = slots[_LOSS]

    def read_early(self, record: OptimizerRecord) -> None:
        """Nothing is read at ``unscale_()``: the flag is agreed, and read, in ``step()``."""

    def decide(
        self,
        record: OptimizerRecord,
        iteration: Iteration,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> bool:
        """Wait for the groups' verdict on a non-fused optimizer and read it (one host sync):
        whether every rank skips (for the agreed inf/NaN flag, or a guard's ``record.spike``),
        and then where the trouble came from (``record.origin``, from :meth:`_origin`, a
        collective every rank makes, as all of them skip together).
        ``settings()`` is what the ranks compare where the fingerprints differed (as for
        :meth:`agree`).

        Raises:
            InvalidConfigError: the ranks' fingerprints differed (every rank raises, after one
                gather naming the differences).
            ScalerUsageError: no rank held any of the optimizer's gradients (torch's error
                without a group; every rank raises), unless ``refuse_unchecked`` is ``False``.
        """
        agreed = record.found_inf
        assert agreed is not None, "agree() set the verdict"
        mine = _verdict_of(agreed)
        self._settle(iteration, read=mine)  # read here; others' kernels take theirs
        verdict: list[float]
        if record.spike is None:  # the verdict says it all: one read
            verdict = mine.tolist()
            skipped = verdict[_FLAG]
        else:
            verdict, skipped = read_values([mine, torch.maximum(agreed, record.spike)])
        earlier = self._landed_differ()  # fused verdicts settled since the last check
        if _differ(verdict) or earlier:
            self._stop(settings)
        if self._refuse_unchecked and verdict[_HELD] <= 0:
            raise ScalerUsageError(NO_GRADIENTS)
        if not skipped:
            return False
        record.origin = self._origin(record, iteration, loss=verdict[_LOSS] > 0)
        return True

    def before_kernel(self, record: OptimizerRecord, iteration: Iteration) -> None:
        """Wait for the iteration's verdicts (the kernel must see the agreed flag); an
        optimizer none of whose gradients any rank held gets no flag (refused at ``update()``,
        as in torch), unless ``refuse_unchecked`` is ``False``. A host sync only on a rank that
        held none of its gradients itself."""
        self._settle(iteration)
        agreed = record.found_inf
        if (
            record.local_found_inf is None  # the host sync below only where no gradient was
            and agreed is not None
            and self._refuse_unchecked
            and float(_verdict_of(agreed)[_HELD].item()) <= 0
        ):
            record.found_inf = None

    def flags(
        self, iteration: Iteration
    ) -> tuple[list[torch.Tensor], torch.Tensor | None, bool | None, torch.Tensor | None]:
        """The iteration's agreed flags, once every reduction has been waited for."""
        self._settle(iteration)
        return iteration.checked_flags()

    def refuse_alone(self, reason: str) -> None:
        """The ranks decide together: nothing to refuse."""

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` max-reduced over the groups (one all_reduce per group, waited for: with
        NCCL a stream dependency, with gloo the host waits); ``value`` itself is left
        unchanged."""
        agreed = value.clone()
        self._reduce(agreed, dist.ReduceOp.MAX).wait()
        return agreed

    def moved(self) -> None:
        """The scaler's policy has just moved the state, eagerly, by the transition every rank
        applies to the same state with the same agreed flags: the ranks that held the same
        state still do, so the next verdict sends the last fingerprint again instead of hashing
        the state anew (module docstring). Not for ``update(new_scale)``, a setter or a load.
        No device work."""
        if self._compared is not None:
            self._compared.note_transition()

    def loaded(self) -> None:
        """A checkpoint was loaded on this rank: the ranks compare what they hold at the next
        verdict (the count is part of the fingerprint, so a rank that loaded while the others
        did not is found even when it loaded what they hold)."""
        self._loads += 1
        self._compared = None  # the settings, and maybe the state tensors, are new

    def _reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> dist.Work:
        """Start reducing ``tensor`` in place by ``op`` over the groups, one after the other
        (for groups forming a grid: over the whole grid); the last reduction's work, to wait
        for (the reductions before the last are waited for in order: with NCCL a stream
        dependency). No host sync with NCCL."""
        *first, last = self.groups
        for group in first:
            dist.all_reduce(tensor, op=op, group=group)
        work: dist.Work | None = dist.all_reduce(tensor, op=op, group=last, async_op=True)
        assert work is not None
        return work

    def sum_(self, values: torch.Tensor) -> int:
        """Sum ``values`` in place over the groups (:meth:`_reduce`, waited for); returns how
        many ranks were summed, for averages."""
        self._reduce(values, dist.ReduceOp.SUM).wait()
        return math.prod(dist.get_world_size(group) for group in self.groups)

    def _settle(self, iteration: Iteration, read: torch.Tensor | None = None) -> None:
        """Wait for every reduction launched in ``iteration``. Each verdict but ``read`` (which
        its caller reads now) is one nobody reads (its kernel takes its agreed flag): if its
        fingerprints differ, its flag is set on the device (the step is skipped), and it is
        started on its way to the next check (three small device ops and a copy).

        With gloo (CPU) this blocks the host until the reductions are done; with NCCL it only
        makes the current stream wait for them. No host sync.
        """
        launched, iteration.launched = iteration.launched, []
        for work, verdict, agreed in launched:
            work.wait()
            if verdict is not read:
                # flag + (max - min) of the fingerprints: exact integers in float32; > 0 is a
                # skip, and the kernels take exactly 1.0 for one.
                torch.clamp(verdict[_FLAG:].sum(), max=1.0, out=agreed)
                self._landing.append(HostCopy(verdict, 0))

    def _origin(self, record: OptimizerRecord, iteration: Iteration, loss: bool) -> SkipOrigin:
        """Where a skipped step's trouble came from, the same on every rank: gathered from
        every rank's own flags (a host sync, and one gather per group). Where the agreed loss
        flag is set (``loss``), the ranks whose loss was already inf/NaN before scaling and, on
        the first of them, which ``scale()`` call had that loss; else the ranks whose own
        gradients held inf/NaN (cause ``gradients``, or ``None`` where no loss was kept).

        Every rank of the groups must call this at the same point: the scaler does it on
        skipped steps only, which all ranks skip together.
        """
        micro_batch = iteration.first_nonfinite_loss()
        local_flags = (record.local_found_inf, iteration.local_loss_flag)
        present = [flag.detach().float().reshape(()) for flag in local_flags if flag is not None]
        values = iter(read_values(present))
        found, lost = (0.0 if flag is None else next(values) for flag in local_flags)
        table = self._gather((found, lost, micro_batch))
        ranks = tuple(rank for rank in sorted(table) if table[rank][1 if loss else 0] > 0)
        if loss:
            return SkipOrigin("loss", ranks, table[ranks[0]][2] if ranks else None)
        return SkipOrigin("gradients" if iteration.losses else None, ranks)

    def _landed_differ(self) -> bool:
        """Whether a verdict on its way since the last check had differing fingerprints
        (waiting for the copies, normally landed long ago); forgets them."""
        if not self._landing:
            return False
        landing, self._landing = self._landing, []
        return any(_differ(copy.wait()) for copy in landing)

    def _stop(self, settings: Callable[[], Mapping[str, SettingValue]]) -> None:
        """Every rank found differing fingerprints in the same verdict: compare the
        ``settings()`` (one gather per group) and raise, naming the differences. The callable
        is not kept: it is the scaler's, and a reference to it here would make a cycle that
        keeps the scaler, and its process groups, alive until the garbage collector runs.

        Raises:
            InvalidConfigError: always.
        """
        self.check_settings({**settings(), LOADS: self._loads})
        raise InvalidConfigError(
            "GradScaler settings or state differed across the ranks of process_group at the "
            "last step (a rank loaded a state_dict, called update(new_scale) or a setter, or "
            "wrote the scale, where the others did not), though they agree again now; every "
            "rank skipped that step. Load the same state_dict on every rank or on none, and "
            "make the same calls on every rank."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> RankAgreement:
        # Process groups cannot be copied: a copied scaler agrees over the same groups.
        twin = RankAgreement.__new__(RankAgreement)
        twin.__dict__.update(self.__dict__, _landing=[], _compared=None)
        return twin

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "A GradScaler with a process_group cannot be pickled, because process groups "
            "cannot; save scaler.state_dict() instead and load it into a scaler constructed "
            "with the group."
        )


NO_GRADIENTS = (
    "No inf checks were recorded for this optimizer: none of its parameters has a gradient on "
    "any rank of process_group. Call scaler.scale(loss).backward() on a loss that depends on "
    "the optimizer's parameters before scaler.step(optimizer)."
)


def _differ(verdict: list[float]) -> bool:
    """Whether an agreed verdict, read on the host, shows differing fingerprints."""
    return verdict[_PRINT] != -verdict[_NEG_PRINT]


def _verdict_of(agreed: torch.Tensor) -> torch.Tensor:
    """The verdict agreed flags from :meth:`RankAgreement.agree` are slots of (the flags are
    views of it)."""
    verdict = agreed._base
    assert verdict is not None and verdict.shape == (5,), "not a flag from agree()"
    return verdict


class _Compared:
    """What the verdicts fingerprint: the settings (hashed once, with the count of loads) and
    the live state tensors among them (hashed on their device when something other than the
    scaler's own transition has written them since the last hash)."""

    def __init__(self, settings: Mapping[str, SettingValue], loads: int) -> None:
        numbers = _plain_row({k: v for k, v in settings.items() if not isinstance(v, torch.Tensor)})
        self._code = zlib.crc32(repr((sorted(numbers.items()), loads)).encode()) % _PRIME
        # Integer views of the live state tensors: the same memory and the same version
        # counters, so they see every update, and say when something wrote it.
        self._words = [_bits(v) for _, v in sorted(settings.items()) if isinstance(v, torch.Tensor)]
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        # The state tensors' version counters for which the last fingerprint (and its
        # negation) stands: as hashed, or as the scaler's own transition left them since.
        self._last: tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] | None = None

    def made(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``0.0``, ``1.0``, the hash's weights and the settings' code on ``device`` (made once:
        no copy to the device per verdict)."""
        made = self._on.get(device)
        if made is None:
            words = sum(view.numel() for view in self._words) + 1
            weights = [pow(1_000_003, i, _PRIME) for i in range(words)]
            made = self._on[device] = (
                torch.zeros((), device=device),
                torch.ones((), device=device),
                torch.tensor(weights, device=device),
                torch.tensor([self._code], dtype=torch.int32, device=device),
            )
        return made

    def _versions(self) -> tuple[int, ...]:
        return tuple(view._version for view in self._words)

    def note_transition(self) -> None:
        """The scaler's own transition has just written the state: the last fingerprint stands
        for the state as it is now (module docstring)."""
        if self._last is not None:
            self._last = (self._versions(), self._last[1])

    def fingerprint(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f, -f)``, 0-dim float32 with ``f`` in ``[0, 2**24)`` on ``device`` (exact in
        float32, so a max and a min compare it): six small device operations when a state
        tensor was written since the last one other than by the scaler's own transition
        (their version counters, read on the host, say so), none otherwise."""
        versions = None
        if not torch.compiler.is_compiling():  # traced code does not read version counters
            versions = self._versions()
            if self._last is not None and self._last[0] == versions:
                return self._last[1]
        _, _, weights, code = self.made(device)
        words = torch.cat([*self._words, code])  # the state tensors live on ``device``
        fingerprint = (words * weights).sum().remainder(_PRIME).to(torch.float32)
        pair = (fingerprint, -fingerprint)
        self._last = None if versions is None else (versions, pair)
        return pair


def _bits(value: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as 32-bit (or narrower) integers, flattened, without a copy: floats'
    bits reinterpreted, not converted (``-0.0`` and ``0.0`` differ, NaN equals itself)."""
    flat = value.detach().reshape(-1)
    return flat.view(_WORDS[flat.element_size()])


#: The integer type a tensor's bytes are read as, by element size (8 bytes: two int32 words).
_WORDS = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _plain_row(settings: Mapping[str, SettingValue]) -> dict[str, float | str | None]:
    """The settings as Python numbers (``None`` and strings stay as they are); the tensors
    among them are read in one host sync."""
    tensors = {name: v for name, v in settings.items() if isinstance(v, torch.Tensor)}
    flat = [tensor.reshape(-1) if tensor.dim() > 1 else tensor for tensor in tensors.values()]
    read = dict(zip(tensors, read_values(flat), strict=True))
    row: dict[str, float | str | None] = {}
    for name, setting in settings.items():
        value = read.get(name, setting)  # a tensor's values: a number, or a list of them
        if value is None or isinstance(value, str):
            row[name] = value
        else:
            row[name] = float(sum(value) if isinstance(value, list) else value)
    return row
