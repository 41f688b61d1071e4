"""Where an overflow happened: naming the parameters whose gradients held inf or NaN.

Localization runs only on steps already known to be skipped, so clean steps pay nothing.

Example:
    >>> import torch
    >>> from ampscaler.diagnostics import ParamNames, locate_overflow
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> names = ParamNames()
    >>> names.watch(model)
    >>> model.weight.grad = torch.tensor([[float("inf"), 0.0]])
    >>> report = locate_overflow([opt], names, step=7)
    >>> report.names, report.kinds
    (['weight'], {'weight': 'inf'})
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .grads import iter_params, nonfinite_kind

__all__ = ["OverflowReport", "ParamNames", "locate_overflow"]


class ParamNames:
    """Names for parameters, learned from ``model.named_parameters()``.

    Parameters are remembered by identity through weak references, so watching a model keeps
    nothing alive. Unwatched parameters are named by optimizer position, ``group0.param3``.
    """

    def __init__(self) -> None:
        # id(param) -> (weak reference, name); the reference guards against a reused id.
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn the names of ``model``'s parameters (prefixed with ``prefix`` + ``.``)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"watch() expects a torch.nn.Module, got {type(model).__name__}; pass the model "
                "whose parameters the optimizer updates."
            )
        lead = f"{prefix}." if prefix else ""
        for name, param in model.named_parameters():
            if self._lookup(param) is None:
                self._names[id(param)] = (weakref.ref(param), lead + name)

    def _lookup(self, param: torch.Tensor) -> str | None:
        entry = self._names.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def name(self, param: torch.Tensor, group_index: int, param_index: int) -> str:
        """The watched name of ``param``, or its position in the optimizer."""
        found = self._lookup(param)
        return found if found is not None else f"group{group_index}.param{param_index}"

    def __len__(self) -> int:
        return len(self._names)

    def __getstate__(self) -> dict[str, object]:
        # Weak references cannot be pickled, and a copy's parameters are new tensors anyway:
        # a copied scaler learns names again through watch().
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._names = {}


@dataclass(frozen=True)
class OverflowReport:
    """The parameters whose gradients were non-finite on one skipped step.

    Attributes:
        step: the step number (``stats.steps`` before the step was counted, from 0).
        names: the offending parameters, in optimizer parameter order.
        kinds: name -> ``"inf"``, ``"nan"`` or ``"inf+nan"``.
        scale: the loss scale the gradients were computed with.
        rank: the process's rank in the default process group, or ``None`` when not distributed.
        ranks: with a scaler ``process_group``, the global ranks whose gradients overflowed (the
            whole group skipped the step with them); empty otherwise.
    """

    step: int
    names: list[str]
    kinds: dict[str, str]
    scale: float
    rank: int | None = None
    ranks: Sequence[int] = field(default_factory=tuple)

    def __str__(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        label = "rank" if len(self.ranks) == 1 else "ranks"
        culprits = f"{label} {', '.join(map(str, self.ranks))}"
        if self.ranks and self.rank not in self.ranks:
            return (
                f"step {self.step}{where}: skipped with the whole process group because of an "
                f"overflow on {culprits} at scale {self.scale:g}; this rank's gradients were finite"
            )
        if not self.names:
            return (
                f"step {self.step}{where}: overflow at scale {self.scale:g}, but no gradient "
                "held inf/NaN any more when it was examined"
            )
        shown = ", ".join(f"{n} ({self.kinds[n]})" for n in self.names[:10])
        more = f" and {len(self.names) - 10} more" if len(self.names) > 10 else ""
        also = f" (overflow on {culprits})" if self.ranks else ""
        return (
            f"step {self.step}{where}: non-finite gradients at scale {self.scale:g} in "
            f"{len(self.names)} parameter(s): {shown}{more}{also}"
        )


def _rank() -> int | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def locate_overflow(
    optimizers: Iterable[torch.optim.Optimizer], names: ParamNames, step: int, scale: float = 1.0
) -> OverflowReport:
    """Examine every gradient of ``optimizers`` and report the non-finite ones (host syncs)."""
    found: list[str] = []
    kinds: dict[str, str] = {}
    for optimizer in optimizers:
        for group_index, param_index, param in iter_params(optimizer):
            if param.grad is None:
                continue
            kind = nonfinite_kind(param.grad)
            if kind is not None:
                name = names.name(param, group_index, param_index)
                found.append(name)
                kinds[name] = kind
    return OverflowReport(step=step, names=found, kinds=kinds, scale=scale, rank=_rank())
