"""Agreeing on overflow across ranks: one inf/NaN verdict for every rank of a process group.

With sharded gradients (FSDP, ZeRO, tensor or pipeline parallelism) each rank checks only its
own shard. A rank that finds inf/NaN skips its step and backs off its scale while the others
step and keep theirs, and the replicas silently diverge. :class:`RankAgreement` max-reduces
each optimizer's inf flag over a process group, so every rank of the group steps or skips
together and moves its scale identically.

The collectives, in the order every rank issues them:

* at the first step only: one all_gather of the scaler's settings and state, so that ranks
  configured differently stop with an error naming the differences instead of diverging;
* per optimizer per iteration: one asynchronous ``all_reduce(MAX)`` of a 0-dim float flag,
  started as soon as the gradients are checked and waited on only where the step decision
  needs it;
* per skipped optimizer step only: one all_gather of the local flags, to name the ranks whose
  gradients overflowed.

Every rank must therefore call the scaler's methods in the same order, as training loops do.

Example (one process; real runs use ``torchrun`` and ``init_process_group``)::

    >>> import torch, torch.distributed as dist
    >>> from ampscaler.distributed import RankAgreement
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> agreement = RankAgreement(dist.group.WORLD)
    >>> agreed = agreement.launch(torch.tensor(1.0))   # starts the all_reduce
    >>> agreement.settle()                             # waits for it
    >>> agreed.item(), agreement.ranks_with_overflow(torch.tensor(1.0))
    (1.0, (0,))
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidConfigError

__all__ = ["RankAgreement", "SettingValue"]

SettingValue = float | int | bool | None | torch.Tensor
"""A setting compared across ranks: a Python number, ``None``, or a 0-dim tensor."""

_NONE = -1.0  # every setting is >= 0, so -1 encodes None unambiguously


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
        isinstance(group, dist.ProcessGroup) and dist.get_rank(group) < 0
    ):
        raise InvalidConfigError(
            f"This process (rank {dist.get_rank()}) is not a member of process_group (new_group() "
            "returns a placeholder on ranks outside the group); pass the group this rank "
            "belongs to."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise InvalidConfigError(
            "process_group must be a torch.distributed.ProcessGroup (for example "
            f"torch.distributed.group.WORLD or one from new_group()), got {group!r}."
        )
    return group


class RankAgreement:
    """Makes the ranks of ``group`` agree on each step's inf/NaN verdict.

    ``launch`` starts a max-reduction of a rank's local flag and returns the tensor that will
    hold the agreed flag; ``settle`` waits for every reduction launched so far (with NCCL the
    wait is a stream dependency, not a host sync). ``check_settings`` (once, at the first step)
    and ``ranks_with_overflow`` (on skipped steps) read from the device: host syncs.

    Raises:
        InvalidConfigError: (a ``ValueError``, as torch raises for an uninitialized default
            group) torch.distributed not initialized, ``group`` not a process group, or this
            rank not a member of it.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = _require_group(group)
        self._global_ranks = tuple(dist.get_process_group_ranks(group))
        self._pending: list[dist.Work] = []
        self.checked = False

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group the flags are reduced over."""
        return self._group

    def check_settings(self, settings: Mapping[str, SettingValue]) -> None:
        """Stop every rank, naming the differences, if the ranks' ``settings`` differ.

        Every rank of the group must call this at the same point (the scaler does it at the
        first step). Tensor values are gathered from their device; one host sync.

        Raises:
            InvalidConfigError: naming each differing setting and its value on every rank.
        """
        names = list(settings)
        values = [settings[name] for name in names]
        device = next(
            (v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu")
        )
        row = torch.stack(
            [
                v.detach().to(device=device, dtype=torch.float64).reshape(())
                if isinstance(v, torch.Tensor)
                else torch.tensor(_NONE if v is None else float(v), dtype=torch.float64,
                                  device=device)
                for v in values
            ]
        )
        rows = [torch.empty_like(row) for _ in self._global_ranks]
        dist.all_gather(rows, row, group=self._group)
        table = torch.stack(rows).cpu().tolist()
        differing = [
            self._describe(name, values[column], [r[column] for r in table])
            for column, name in enumerate(names)
            if any(r[column] != table[0][column] for r in table)
        ]
        if differing:
            raise InvalidConfigError(
                "GradScaler settings differ across the ranks of process_group, so their scales "
                f"would diverge: {'; '.join(differing)}. Construct the scaler with the same "
                "arguments on every rank, and load the same state_dict on every rank or on none."
            )
        self.checked = True

    def _describe(self, name: str, local: SettingValue, column: list[float]) -> str:
        integral = isinstance(local, (bool, int)) or (
            isinstance(local, torch.Tensor) and not local.is_floating_point()
        )
        by_value: dict[float, list[int]] = {}
        for group_rank, value in enumerate(column):
            by_value.setdefault(value, []).append(self._global_ranks[group_rank])
        parts = []
        for value, ranks in by_value.items():
            if value == _NONE:
                shown = "None"
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
        device: torch.device,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start agreeing on one optimizer's inf flag from the check (``None``: this rank
        held no gradients, and takes part with a zero flag).

        Returns ``(local, agreed)``: this rank's flag on ``device``, and the tensor that holds
        the group's verdict once :meth:`settle` has returned. The first call compares the
        ranks' ``settings()`` (a host sync, once).
        """
        if not self.checked:
            self.check_settings(settings())
        local = found_inf
        if local is None:
            local = torch.zeros((), dtype=torch.float32, device=device)
        return local, self.launch(local)

    def launch(self, local_flag: torch.Tensor) -> torch.Tensor:
        """Start max-reducing ``local_flag`` (0-dim float) over the group; return the result tensor.

        ``local_flag`` itself is left unchanged. The returned tensor holds the agreed flag once
        :meth:`settle` has returned. No host sync.
        """
        agreed = local_flag.clone()
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        assert work is not None
        self._pending.append(work)
        return agreed

    def settle(self) -> None:
        """Wait for every reduction launched so far.

        With gloo (CPU) this blocks the host until the reductions are done; with NCCL it only
        makes the current stream wait for them.
        """
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def decide(
        self, local_flag: torch.Tensor | None, agreed: torch.Tensor
    ) -> tuple[bool, tuple[int, ...]]:
        """Wait for the group's verdict and read it (a host sync): whether every rank skips,
        and then the ranks whose own ``local_flag`` was set (:meth:`ranks_with_overflow`, a
        collective every rank of the group makes, as all of them skip together)."""
        self.settle()
        if not bool(agreed.item()):
            return False, ()
        assert local_flag is not None  # set with the agreed flag
        return True, self.ranks_with_overflow(local_flag)

    def ranks_with_overflow(self, local_flag: torch.Tensor) -> tuple[int, ...]:
        """The global ranks whose ``local_flag`` was set (an all_gather and a host sync).

        Every rank of the group must call this at the same point: the scaler does it on
        skipped steps only, which all ranks skip together.
        """
        flag = local_flag.detach().reshape(1).float()
        flags = [torch.empty_like(flag) for _ in self._global_ranks]
        dist.all_gather(flags, flag, group=self._group)
        gathered = torch.cat(flags).cpu().tolist()
        return tuple(
            rank for rank, value in zip(self._global_ranks, gathered, strict=True) if value > 0
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> RankAgreement:
        # Process groups cannot be copied: a copied scaler agrees over the same group.
        twin = RankAgreement.__new__(RankAgreement)
        twin.__dict__.update(self.__dict__, _pending=[])
        return twin

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "A GradScaler with a process_group cannot be pickled, because process groups "
            "cannot; save scaler.state_dict() instead and load it into a scaler constructed "
            "with the group."
        )
