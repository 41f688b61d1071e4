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

The collectives, in the order every rank issues them:

* at the first step, and at the first step after ``load_state_dict``: one gather of the
  scaler's settings and state per group, so that ranks configured or restored differently
  stop with an error naming the ranks and the differences instead of diverging;
* per optimizer per iteration: one ``all_reduce(MAX)`` per group (the last one asynchronous) of
  two flags, whether the gradients held inf/NaN and whether a loss was already inf/NaN before
  scaling, started as soon as the gradients are checked and waited on only where the step
  decision needs it; so every rank knows the skip's cause (``loss`` if a loss was non-finite on
  any rank, else ``gradients``) and decides alike on it;
* per skipped optimizer step only (plain optimizers): one gather of the local flags per group,
  to name the ranks the overflow came from (and the micro-batch of a non-finite loss).

Every rank must therefore call the scaler's methods in the same order, as training loops do.

Example (one process; real runs use ``torchrun`` and ``init_process_group``)::

    >>> import torch, torch.distributed as dist
    >>> from ampscaler.distributed import RankAgreement
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> agreement = RankAgreement(dist.group.WORLD)
    >>> agreed = agreement.launch(torch.tensor(1.0))   # starts the all_reduce
    >>> agreement.settle()                             # waits for it
    >>> agreed.item(), agreement.origins(torch.tensor([1.0, 0.0])).gradient_ranks
    (1.0, (0,))
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .errors import InvalidConfigError
from .hostcopy import read_values

__all__ = ["GroupSpec", "Origins", "RankAgreement", "SettingValue", "refuse_alone"]

GroupSpec = dist.ProcessGroup | Sequence[dist.ProcessGroup]
"""What ``process_group=`` takes: one group, or several whose union must agree."""

SettingValue = float | int | bool | str | None | torch.Tensor
"""A setting compared across ranks: a Python number or string, ``None``, or a 0-dim tensor."""


class Origins(NamedTuple):
    """Where a skipped step's trouble came from, the same on every rank.

    Attributes:
        gradient_ranks: the global ranks whose own gradients held inf/NaN.
        loss_ranks: the global ranks whose loss was already inf/NaN before scaling.
        micro_batch: on the first of ``loss_ranks``, which ``scale()`` call of the iteration
            had that loss (``None``: unknown, or no loss rank).
    """

    gradient_ranks: tuple[int, ...] = ()
    loss_ranks: tuple[int, ...] = ()
    micro_batch: int | None = None


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
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise InvalidConfigError(
                "process_group is an empty list; pass the groups whose ranks must agree, or "
                "None for none."
            )
        groups = [_require_group(group) for group in spec]
    else:
        groups = [_require_group(spec)]
    members = [frozenset(dist.get_process_group_ranks(group)) for group in groups]
    kept = []
    for index, ranks in enumerate(members):
        covered = any(
            (ranks < other) or (ranks == other and other_index < index)
            for other_index, other in enumerate(members)
            if other_index != index
        )
        if not covered:
            kept.append(groups[index])
    return tuple(kept)


class RankAgreement:
    """Makes the ranks of ``groups`` agree on each step's inf/NaN verdict.

    ``launch`` starts a max-reduction of a rank's local flag and returns the tensor that will
    hold the agreed flag; ``settle`` waits for every reduction launched so far (with NCCL the
    wait is a stream dependency, not a host sync). ``check_settings`` (at the first step) and
    ``origins`` (on skipped steps) read from the device: host syncs.

    Args:
        groups: one process group, or several (see the module docstring).

    Raises:
        InvalidConfigError: (a ``ValueError``, as torch raises for an uninitialized default
            group) torch.distributed not initialized, an empty list, something that is not a
            process group, a destroyed group, or a group this rank is not a member of.
    """

    def __init__(self, groups: GroupSpec) -> None:
        self._groups = _distinct_groups(groups)
        self._pending: list[dist.Work] = []
        self.checked = False

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The groups the flags are reduced over, in order (repeats and contained ones left
        out)."""
        return self._groups

    def _gather(self, value: Any) -> dict[int, Any]:
        """Every rank's ``value`` that the groups reach, by global rank: gathered over one
        group after the other, each time with everything known so far, so that for groups
        forming a grid every rank ends up knowing every rank of the grid."""
        known = {dist.get_rank(): value}
        for group in self._groups:
            parts: list[dict[int, Any] | None] = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, known, group=group)
            for part in parts:
                if part is not None:
                    known.update(part)
        return known

    def check_settings(self, settings: Mapping[str, SettingValue]) -> None:
        """Stop every rank, naming the differences and the ranks, if the ranks' ``settings``
        differ.

        Every rank of the groups must call this at the same point (the scaler does it at the
        first step, and again at the first step after a checkpoint is loaded). Tensor values
        are read from their device; one host sync, and one gather per group.

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
        self.checked = True

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

    def agree(
        self,
        found_inf: torch.Tensor | None,
        loss_nonfinite: torch.Tensor | None,
        device: torch.device,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start agreeing on one optimizer's inf flag from the check and on the iteration's
        loss flag (``None``: this rank held no gradients, or kept no loss, and takes part
        with a zero flag).

        Returns ``(local, agreed)``: this rank's two flags on ``device`` (a 1-dim float32
        tensor: ``[found_inf, loss_nonfinite]``), and the tensor that holds the groups' two
        verdicts once :meth:`settle` has returned. The first call (and the first after
        :meth:`recheck`) compares the ranks' ``settings()`` (a host sync).
        """
        if not self.checked:
            self.check_settings(settings())
        zero = torch.zeros((), dtype=torch.float32, device=device)
        flags = [
            zero if flag is None else flag.to(device, torch.float32).reshape(())
            for flag in (found_inf, loss_nonfinite)
        ]
        local = torch.stack(flags)
        return local, self.launch(local)

    def recheck(self) -> None:
        """Compare the settings and state again at the next step (after a checkpoint load)."""
        self.checked = False

    def launch(self, local_flag: torch.Tensor) -> torch.Tensor:
        """Start max-reducing ``local_flag`` (float, any shape) over the groups; return the
        result tensor.

        ``local_flag`` itself is left unchanged. The returned tensor holds the agreed flag once
        :meth:`settle` has returned. With several groups, the reductions before the last are
        waited for in order (with NCCL a stream dependency). No host sync with NCCL.
        """
        agreed = local_flag.clone()
        *first, last = self._groups
        for group in first:
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=last, async_op=True)
        assert work is not None
        self._pending.append(work)
        return agreed

    def sum_(self, values: torch.Tensor) -> int:
        """Sum ``values`` in place over the groups, one after the other (for groups forming a
        grid: over the whole grid); returns how many ranks were summed, for averages."""
        ranks = 1
        for group in self._groups:
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
            ranks *= dist.get_world_size(group)
        return ranks

    def settle(self) -> None:
        """Wait for every reduction launched so far.

        With gloo (CPU) this blocks the host until the reductions are done; with NCCL it only
        makes the current stream wait for them.
        """
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def decide(
        self,
        local_flags: torch.Tensor | None,
        agreed: torch.Tensor,
        micro_batch: Callable[[], int | None],
    ) -> tuple[bool, Origins]:
        """Wait for the groups' verdict and read it (a host sync): whether every rank skips,
        and then where the trouble came from (:meth:`origins`, a collective every rank makes,
        as all of them skip together)."""
        self.settle()
        if not bool(agreed.item()):
            return False, Origins()
        assert local_flags is not None  # set with the agreed flag
        return True, self.origins(local_flags, micro_batch())

    def origins(self, local_flags: torch.Tensor, micro_batch: int | None = None) -> Origins:
        """The ranks whose own flags (``[found_inf, loss_nonfinite]``, as :meth:`agree` made
        them) were set, and the micro-batch of the first non-finite loss: gathered from every
        rank (a host sync, and one gather per group).

        Every rank of the groups must call this at the same point: the scaler does it on
        skipped steps only, which all ranks skip together.

        Example:
            >>> import torch, torch.distributed as dist
            >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            >>> RankAgreement(dist.group.WORLD).origins(torch.tensor([0.0, 1.0]), 2)
            Origins(gradient_ranks=(), loss_ranks=(0,), micro_batch=2)
            >>> dist.destroy_process_group()
        """
        found, loss = read_values([local_flags.detach().float()])[0]
        table = self._gather((found, loss, micro_batch))
        ranks = sorted(table)
        loss_ranks = tuple(rank for rank in ranks if table[rank][1] > 0)
        return Origins(
            gradient_ranks=tuple(rank for rank in ranks if table[rank][0] > 0),
            loss_ranks=loss_ranks,
            micro_batch=table[loss_ranks[0]][2] if loss_ranks else None,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> RankAgreement:
        # Process groups cannot be copied: a copied scaler agrees over the same groups.
        twin = RankAgreement.__new__(RankAgreement)
        twin.__dict__.update(self.__dict__, _pending=[])
        return twin

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "A GradScaler with a process_group cannot be pickled, because process groups "
            "cannot; save scaler.state_dict() instead and load it into a scaler constructed "
            "with the group."
        )


def _plain_row(settings: Mapping[str, SettingValue]) -> dict[str, float | str | None]:
    """The settings as Python numbers (``None`` and strings stay as they are); the tensors
    among them are read in one host sync."""
    tensors = {name: v for name, v in settings.items() if isinstance(v, torch.Tensor)}
    read = dict(zip(tensors, read_values(list(tensors.values())), strict=True))
    row: dict[str, float | str | None] = {}
    for name, value in settings.items():
        if name in read:
            row[name] = float(read[name])
        elif value is None or isinstance(value, str):
            row[name] = value
        else:
            row[name] = float(value)
    return row
