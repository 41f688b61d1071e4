"""Opt-in flat gradient buffers (``GradScaler(..., flat_grads=True)``), in front of the collection.

Off by default, because it moves the user's gradient memory: a drop-in must not relocate memory
that other code (a CUDA graph captured over the backward, a compiled step guarded on gradient
identity, a hook holding a pointer) may rely on. Turn it on when the loop keeps the same gradient
tensors from step to step (``zero_grad(set_to_none=False)``, accumulation in place) over many
small tensors; see docs/benchmarks.md for what it saves.

Grouping gradients by device and dtype is a Python loop over every parameter, and the check
kernel has a fixed cost per tensor; with thousands of small tensors both outweigh the
arithmetic. Many training loops keep the same gradient tensors from step to step
(``zero_grad(set_to_none=False)``, accumulation in place). For those a :class:`GradPlan` is
built once the same gradient tensors have been seen on consecutive steps:

- the gradients of each device and dtype are moved into one flat buffer, in place: each
  gradient stays the same tensor object with the same values, shape and strides, only its
  memory is now a slice of the buffer (``Tensor.set_``). References held elsewhere stay valid,
  and the check and the unscale run once per buffer instead of once per tensor;
- gradients whose memory others share (views of them, or they a view of something else),
  non-contiguous ones, and ones requiring grad stay where they are, checked one by one. So
  do all gradients where torch does not expose storage use counts
  (``torch._C._storage_Use_Count``), since sharing cannot be ruled out there.

Every step the plan is validated against the optimizer in one pass: the same number of
parameters, each ``.grad`` the very tensor object the plan holds; gradients kept where they were
at the same data pointer; and each flat buffer's storage used by as many tensors as on the first
check after the plan was built (when every moved gradient's data pointer is checked too): a
moved gradient whose memory is rebound (``.data`` reassigned, ``set_``) releases the buffer and
lowers that count. Anything else (a new parameter group, a gradient set to ``None`` or replaced)
drops the plan and the gradients are grouped afresh; a plan is never used stale. A count that
rises (a new view of a gradient kept somewhere) also drops it, costing only speed.
Optimizers with sparse gradients or with tensor-subclass gradients (``DTensor``) get no plan.
Nor do optimizers whose parameters could not pay even were every gradient movable (a few
large tensors per device and dtype: :data:`MIN_FLATTENED`, :data:`MAX_MEAN_NUMEL`): their
gradients are not followed from step to step at all, and are grouped as without the option,
until the number of parameters in a group changes.

Loops that replace their gradients every step (``zero_grad()``'s default
``set_to_none=True``) are recognized by the gradients' ids and get no plan; when the ids of
freed gradients happen to be reused, a plan may be built and is dropped on the next step.
Each dropped plan doubles the number of unchanged steps needed before the next one, so such
loops pay for a logarithmic number of copies, and a dropped plan's buffer is freed with it.
While a plan is kept across ``zero_grad(set_to_none=True)``, until the next check, its buffer
holds gradient memory the loop would otherwise have released.

Example:
    >>> import torch
    >>> from ampscaler.grads.flat import GradPlanner
    >>> params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(16)]
    >>> for p in params:
    ...     p.grad = torch.ones(3)
    >>> opt = torch.optim.SGD(params, lr=0.1)
    >>> planner = GradPlanner()
    >>> _ = planner.groups(opt, allow_fp16=False)   # first sighting: grouped afresh
    >>> groups = planner.groups(opt, allow_fp16=False)   # same tensors again: planned
    >>> (flat,) = groups[torch.device("cpu")][torch.float32]
    >>> flat.shape, params[1].grad.data_ptr() - flat.data_ptr()   # the 2nd gradient's slice
    (torch.Size([48]), 12)
"""

from __future__ import annotations

import operator
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch

from .collect import FP16_GRADS_MESSAGE, GradGroups, collect, iter_params

__all__ = ["GradPlan", "GradPlanner"]

_DATA_PTR = torch.Tensor.data_ptr


@dataclass
class GradPlan:
    """The gradient tensors of one optimizer, grouped, and what to check them against.

    Attributes:
        grads: ``param.grad`` expected for every parameter, in ``param_groups`` order.
        moved: the gradients moved into flat buffers, and ``moved_pointers`` their
            ``data_ptr()`` right after the move.
        kept: the other non-``None`` gradients, and ``kept_pointers`` their ``data_ptr()``.
        buffers: the storages of the flat buffers (``_cdata`` handles, alive with ``groups``).
        buffer_counts: the buffers' storage use counts, taken on the first check that passed.
        groups: what the check kernel receives: per device and dtype, the flat buffer (when
            gradients were moved into one) followed by the gradients kept as they are.
        has_fp16: whether any group holds float16 gradients.
    """

    grads: list[torch.Tensor | None]
    moved: list[torch.Tensor]
    moved_pointers: list[int]
    kept: list[torch.Tensor]
    kept_pointers: list[int]
    buffers: list[int]
    groups: GradGroups
    has_fp16: bool
    buffer_counts: list[int] | None = None

    def matches(self, grads: list[torch.Tensor | None]) -> bool:
        """Whether ``grads`` (the optimizer's current ``.grad`` per parameter) are the plan's."""
        if not (
            len(grads) == len(self.grads)
            and all(map(operator.is_, grads, self.grads))
            and list(map(_DATA_PTR, self.kept)) == self.kept_pointers
        ):
            return False
        counts = [int(_USE_COUNT(cdata)) for cdata in self.buffers] if _USE_COUNT else []
        if self.buffer_counts is None:
            if list(map(_DATA_PTR, self.moved)) != self.moved_pointers:
                return False
            self.buffer_counts = counts
            return True
        return counts == self.buffer_counts


@dataclass
class _Entry:
    plan: GradPlan | None = None
    last_ids: list[int] = field(default_factory=list)
    streak: int = 0
    patience: int = 1
    # The parameter count of each group when it was last judged whether flattening could pay
    # for these parameters at all (``could_pay``); judged again when the counts change.
    judged: list[int] | None = None
    could_pay: bool = True

    def drop(self) -> None:
        self.plan = None
        self.streak = 0
        self.patience *= 2


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _unshared(grads: list[torch.Tensor]) -> list[bool]:
    """For each gradient: whether only gradients in ``grads`` use its storage (no views of it
    elsewhere, no aliases), e.g. it owns its memory, or it lies in an earlier plan's buffer
    together with others of ``grads`` and nothing else.

    Counted against a fresh tensor on the same device, since the count a storage shows
    includes references of torch's own. All ``False`` where torch does not expose storage
    use counts.
    """
    if _USE_COUNT is None or not grads:
        return [False] * len(grads)
    use_count = _USE_COUNT
    storages = [grad.untyped_storage()._cdata for grad in grads]
    probe = torch.empty(1, device=grads[0].device)  # alive while counted
    baseline = int(use_count(probe.untyped_storage()._cdata))
    sharers = Counter(storages)
    return [int(use_count(cdata)) == baseline + sharers[cdata] - 1 for cdata in storages]


def _movable(grad: torch.Tensor) -> bool:
    """Whether ``grad`` can move into a flat buffer, keeping its identity, shape and strides."""
    return (
        grad._base is None and not grad.requires_grad and grad.is_contiguous() and grad.numel() > 0
    )


@torch.no_grad()
def _flatten_(grads: list[torch.Tensor]) -> torch.Tensor:
    """Move ``grads`` into one new buffer, in place: each tensor object keeps its values,
    shape, strides and identity (``set_``), so references held elsewhere stay valid."""
    sizes = [grad.numel() for grad in grads]
    flat = torch.empty(sum(sizes), dtype=grads[0].dtype, device=grads[0].device)
    pieces = [p.view(g.shape) for p, g in zip(torch.split(flat, sizes), grads, strict=True)]
    torch._foreach_copy_(pieces, grads)
    storage = flat.untyped_storage()
    offset = 0
    for grad, size in zip(grads, sizes, strict=True):
        grad.set_(storage, offset, grad.size(), grad.stride())
        offset += size
    return flat


#: A device and dtype's gradients move into a flat buffer only when there are at least this
#: many ...
MIN_FLATTENED = 16
#: ... and they hold at most this many elements on average: checking them one by one costs a
#: fixed overhead per tensor that flattening saves; for few large tensors it is noise, and a
#: plan would only add its validation.
MAX_MEAN_NUMEL = 2**16


def _pays(numels: list[int]) -> bool:
    """Whether moving tensors of ``numels`` elements into one buffer saves time (see
    :data:`MIN_FLATTENED`)."""
    count = len(numels)
    return count >= MIN_FLATTENED and sum(numels) <= MAX_MEAN_NUMEL * count


def _could_pay(optimizer: torch.optim.Optimizer) -> bool:
    """Whether flattening could pay for some device and dtype of ``optimizer``'s parameters,
    were every gradient movable (a dense gradient has its parameter's shape, device and dtype).
    Where it could not, as for a few large tensors, the planner does not follow the gradients
    at all: the defaults' grouping, at the defaults' cost.

    Raises:
        TypeError: a parameter that is not a tensor.
    """
    numels: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for _, _, param in iter_params(optimizer):
        numels.setdefault((param.device, param.dtype), []).append(param.numel())
    return any(map(_pays, numels.values()))


def build_plan(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> GradPlan | None:
    """Group ``optimizer``'s gradients once, moving the movable ones into flat buffers where
    that pays (many small gradients of one device and dtype: :data:`MIN_FLATTENED`,
    :data:`MAX_MEAN_NUMEL`).

    Returns ``None`` (touching nothing) when a gradient is sparse, a tensor subclass (such as a
    ``DTensor``), or has no data pointer to validate the plan by, and when flattening pays for
    no group (then the gradients are grouped as without the option).

    Raises:
        TypeError: a parameter that is not a tensor.
        ValueError: a float16 gradient when ``allow_fp16`` is false (nothing is moved).
    """
    params = [param for _, _, param in iter_params(optimizer)]
    present = [param.grad for param in params if param.grad is not None]
    if any(type(grad) is not torch.Tensor or grad.is_sparse for grad in present):
        return None
    try:
        for grad in present:
            grad.data_ptr()
    except RuntimeError:  # no storage (e.g. a lazy or XLA tensor)
        return None
    groups = collect(optimizer, allow_fp16=allow_fp16)  # raises on fp16 before moving
    distinct = len({id(grad) for grad in present}) == len(present)
    moved_ids: set[int] = set()
    buffers: list[int] = []
    for per_dtype in groups.values():
        for dtype, bucket in per_dtype.items():
            alone = _unshared(bucket) if distinct else [False] * len(bucket)
            movable = [g for g, sole in zip(bucket, alone, strict=True) if sole and _movable(g)]
            if _pays([grad.numel() for grad in movable]):
                moved_ids.update(id(grad) for grad in movable)
                kept = [grad for grad in bucket if id(grad) not in moved_ids]
                flat = _flatten_(movable)
                buffers.append(flat.untyped_storage()._cdata)
                per_dtype[dtype] = [flat, *kept]
    if not buffers:
        return None
    moved = [grad for grad in present if id(grad) in moved_ids]
    kept = [grad for grad in present if id(grad) not in moved_ids]
    return GradPlan(
        grads=[param.grad for param in params],
        moved=moved,
        moved_pointers=list(map(_DATA_PTR, moved)),
        kept=kept,
        kept_pointers=list(map(_DATA_PTR, kept)),
        buffers=buffers,
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

    def __reduce__(self) -> tuple[type[GradPlanner], tuple[()]]:
        return GradPlanner, ()  # a copy plans afresh

    def groups(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, local: bool = False
    ) -> GradGroups:
        """``optimizer``'s gradients grouped by device and dtype, as
        :func:`~ampscaler.grads.collect.collect` groups them (``local`` goes to it).

        Raises:
            TypeError: a parameter that is not a tensor.
            ValueError: a float16 gradient when ``allow_fp16`` is false.
        """
        try:
            entry = self._entries.get(optimizer)
            if entry is None:  # setdefault would make an entry and a weak reference every step
                entry = self._entries[optimizer] = _Entry()
        except TypeError:  # not hashable or not weakly referenceable: nothing to remember by
            return collect(optimizer, allow_fp16=allow_fp16, local=local)
        counts = [len(group["params"]) for group in optimizer.param_groups]
        if counts != entry.judged:
            entry.could_pay = _could_pay(optimizer)  # a parameter not a tensor raises here
            entry.judged = counts
        if not entry.could_pay:
            entry.plan = None  # made for other parameters: its buffer goes
            return collect(optimizer, allow_fp16=allow_fp16, local=local)
        try:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        except AttributeError:  # a parameter that is not a tensor: collect() says so
            return collect(optimizer, allow_fp16=allow_fp16, local=local)
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
        return collect(optimizer, allow_fp16=allow_fp16, local=local)
