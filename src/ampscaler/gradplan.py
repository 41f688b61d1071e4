"""Remembering an optimizer's gradient grouping while its gradient tensors stay the same.

Grouping gradients by device and dtype is a Python loop over every parameter, and the check
kernel has a fixed cost per tensor; with thousands of small tensors both outweigh the
arithmetic. Many training loops keep the same gradient tensors from step to step
(``zero_grad(set_to_none=False)``, accumulation in place). For those a :class:`GradPlan` is
built once the same gradient tensors have been seen on consecutive steps:

- the gradients of each device and dtype are moved into one flat buffer and every
  ``param.grad`` becomes a view of it (same values, shape and dtype), so the check and the
  unscale run once per buffer instead of once per tensor;
- gradients that cannot be moved (views of other tensors, non-contiguous, requiring grad, a
  dtype or shape other than their parameter's) stay separate tensors.

Every step the plan is validated against the optimizer in one pass: the same number of
parameters, each ``.grad`` the very tensor object the plan holds, at the same data pointer.
Anything else (a new parameter group, a gradient set to ``None`` or replaced, ``.data``
reassigned) drops the plan and the gradients are grouped afresh; a plan is never used stale.
Optimizers with sparse gradients or with tensor-subclass gradients (``DTensor``) get no plan.

Loops that replace their gradients every step (``zero_grad()``'s default
``set_to_none=True``) are recognized by the gradients' ids and get no plan; when the ids of
freed gradients happen to be reused, a plan may be built and is dropped on the next step.
Each dropped plan doubles the number of unchanged steps needed before the next one, so such
loops pay for a logarithmic number of copies, and a dropped plan's buffer is freed with it.
While a plan is kept across ``zero_grad(set_to_none=True)``, until the next check, its buffer
holds gradient memory the loop would otherwise have released.

Example:
    >>> import torch
    >>> from ampscaler.gradplan import GradPlanner
    >>> params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)]
    >>> for p in params:
    ...     p.grad = torch.ones(3)
    >>> opt = torch.optim.SGD(params, lr=0.1)
    >>> planner = GradPlanner()
    >>> _ = planner.groups(opt, allow_fp16=False)   # first sighting: grouped afresh
    >>> groups = planner.groups(opt, allow_fp16=False)   # same tensors again: planned
    >>> [t.shape for t in groups[torch.device("cpu")][torch.float32]]
    [torch.Size([12])]
    >>> params[0].grad._base is groups[torch.device("cpu")][torch.float32][0]
    True
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field

import torch

from .grads import FP16_GRADS_MESSAGE, GradGroups, group_grad_list, group_grads, iter_params

__all__ = ["GradPlan", "GradPlanner"]

_DATA_PTR = torch.Tensor.data_ptr


@dataclass
class GradPlan:
    """The gradient tensors of one optimizer, grouped, and what to check them against.

    Attributes:
        grads: ``param.grad`` expected for every parameter, in ``param_groups`` order.
        members: the non-``None`` entries of ``grads``.
        pointers: ``data_ptr()`` of each member when the plan was built.
        groups: what the check kernel receives: per device and dtype, the flat buffer (when
            gradients were moved into one) followed by the gradients kept as they are.
        has_fp16: whether any group holds float16 gradients.
    """

    grads: list[torch.Tensor | None]
    members: list[torch.Tensor]
    pointers: list[int]
    groups: GradGroups
    has_fp16: bool

    def matches(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``grads`` (the optimizer's current ``.grad`` per parameter) are the plan's."""
        return (
            len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and list(map(_DATA_PTR, self.members)) == self.pointers
        )


@dataclass
class _Entry:
    plan: GradPlan | None = None
    last_ids: list[int] = field(default_factory=list)
    streak: int = 0
    patience: int = 1

    def drop(self) -> None:
        self.plan = None
        self.streak = 0
        self.patience *= 2


def _movable(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` can become a view of a flat buffer without anyone noticing but ``is``."""
    return (
        grad._base is None
        and not grad.requires_grad
        and grad.is_contiguous()
        and grad.numel() > 0
        and param.is_leaf
        and grad.dtype == param.dtype
        and grad.shape == param.shape
        and grad.device == param.device
    )


@torch.no_grad()
def _flatten_(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Copy the gradients of ``pairs`` into one new buffer and point each ``.grad`` into it."""
    grads = [grad for _, grad in pairs]
    flat = torch.empty(
        sum(grad.numel() for grad in grads), dtype=grads[0].dtype, device=grads[0].device
    )
    views = [
        piece.view(grad.shape)
        for piece, grad in zip(flat.split([g.numel() for g in grads]), grads, strict=True)
    ]
    torch._foreach_copy_(views, grads)
    for (param, _), view in zip(pairs, views, strict=True):
        param.grad = view
    return flat


def build_plan(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> GradPlan | None:
    """Group ``optimizer``'s gradients once, moving the movable ones into flat buffers.

    Returns ``None`` (touching nothing) when a gradient is sparse, a tensor subclass (such as a
    ``DTensor``), or has no data pointer to validate the plan by.

    Raises:
        TypeError: a parameter that is not a tensor.
        ValueError: a float16 gradient when ``allow_fp16`` is false (nothing is moved).
    """
    params = [param for _, _, param in iter_params(optimizer)]
    present = [(param, param.grad) for param in params if param.grad is not None]
    if any(type(grad) is not torch.Tensor or grad.is_sparse for _, grad in present):
        return None
    try:
        for _, grad in present:
            grad.data_ptr()
    except RuntimeError:  # no storage (e.g. a lazy or XLA tensor)
        return None
    if not allow_fp16 and any(grad.dtype == torch.float16 for _, grad in present):
        raise ValueError(FP16_GRADS_MESSAGE)
    distinct = len({id(grad) for _, grad in present}) == len(present)
    movable: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    kept: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for param, grad in present:
        key = (grad.device, grad.dtype)
        if distinct and _movable(param, grad):
            movable.setdefault(key, []).append((param, grad))
        else:
            kept.setdefault(key, []).append(grad)
    groups: GradGroups = {}
    for key in [*movable, *(k for k in kept if k not in movable)]:
        pairs = movable.get(key, [])
        rest = kept.get(key, [])
        if len(pairs) == 1:
            rest = [pairs[0][1], *rest]
        elif pairs:
            rest = [_flatten_(pairs), *rest]
        device, dtype = key
        groups.setdefault(device, {})[dtype] = rest
    grads = [param.grad for param in params]
    members = [grad for grad in grads if grad is not None]
    return GradPlan(
        grads=grads,
        members=members,
        pointers=list(map(_DATA_PTR, members)),
        groups=groups,
        has_fp16=any(torch.float16 in per_dtype for per_dtype in groups.values()),
    )


class GradPlanner:
    """Per-optimizer :class:`GradPlan` s, built and validated as described in this module.

    Optimizers are held weakly; a planner is not copied or pickled with its scaler.
    """

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Entry] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, object]:
        return {}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]

    def groups(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> GradGroups:
        """``optimizer``'s gradients grouped by device and dtype, as :func:`group_grads` does.

        Raises:
            TypeError: a parameter that is not a tensor.
            ValueError: a float16 gradient when ``allow_fp16`` is false.
        """
        try:
            entry = self._entries.get(optimizer)
            if entry is None:
                entry = self._entries[optimizer] = _Entry()
        except TypeError:  # not hashable or not weakly referenceable: nothing to remember by
            return group_grads(optimizer, allow_fp16)
        try:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        except AttributeError:  # a parameter that is not a tensor: group_grads says so
            return group_grads(optimizer, allow_fp16)
        plan = entry.plan
        if plan is not None:
            if plan.matches(grads):
                if plan.has_fp16 and not allow_fp16:
                    raise ValueError(FP16_GRADS_MESSAGE)
                return plan.groups
            entry.drop()
        ids = list(map(id, grads))
        entry.streak = entry.streak + 1 if ids == entry.last_ids else 0
        entry.last_ids = ids
        if entry.streak >= entry.patience:
            entry.plan = build_plan(optimizer, allow_fp16)
            if entry.plan is not None:
                entry.last_ids = []
                return entry.plan.groups
            entry.drop()
        groups = group_grad_list(grads, allow_fp16)
        return groups if groups is not None else group_grads(optimizer, allow_fp16)
