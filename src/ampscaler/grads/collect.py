"""Collecting an optimizer's gradients: one walk, grouped by device and dtype.

Every part of ampscaler that reads gradients (the check and unscale, localization of an
overflow, the underflow probe, agreement across ranks) takes them from here, so the rules are
decided once:

- a parameter without a gradient is left out; a parameter that is not a tensor is an error;
- a sparse gradient is read through its values; a float16 sparse gradient is coalesced first
  (replacing ``param.grad``), so duplicate indices cannot overflow when they are summed later;
- a ``DTensor`` gradient (FSDP2, tensor parallel) is read through its local shard when the
  caller asks for ``local`` views (the scaler does when it agrees across ranks itself; otherwise
  DTensor's own handling of the check kernel reduces the flag over its mesh);
- a float16 gradient is refused unless ``allow_fp16`` (torch's rule: unscaling float16
  gradients in float16 loses them; see :class:`~ampscaler.MasterWeightOptimizer`).

Views share memory with the gradients, so unscaling them in place unscales the gradients.

Example:
    >>> import torch
    >>> params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    >>> params[0].grad = torch.ones(2)
    >>> opt = torch.optim.SGD(params, lr=0.1)
    >>> collect(opt, allow_fp16=False)
    {device(type='cpu'): {torch.float32: [tensor([1., 1.])]}}
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "FP16_GRADS_MESSAGE",
    "GradGroups",
    "collect",
    "grad_views",
    "iter_params",
]

FP16_GRADS_MESSAGE = (
    "Attempting to unscale FP16 gradients. GradScaler unscales gradients in float32: keep the "
    "model's parameters in float32 and run the forward pass under torch.autocast, or wrap the "
    "optimizer in ampscaler.MasterWeightOptimizer to train float16 weights with float32 masters."
)

GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]
"""Gradient views per device, then per dtype: what one check kernel call takes."""


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(group_index, param_index, param)`` for every parameter of ``optimizer``.

    Raises:
        TypeError: a parameter that is not a tensor.
    """
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"optimizer.param_groups[{group_index}]['params'][{param_index}] is a "
                    f"{type(param).__name__}, not a torch.Tensor; GradScaler can only check "
                    "tensor parameters."
                )
            yield group_index, param_index, param


def _dtensor_type() -> type[Any] | None:
    """DTensor's class once torch has imported it; before that no gradient can be one."""
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):  # torch >= 2.5, 2.4
        found = getattr(sys.modules.get(module), "DTensor", None)
        if isinstance(found, type):
            return found
    return None


def _sparse_values(param: torch.Tensor, grad: torch.Tensor, allow_fp16: bool) -> torch.Tensor:
    if grad.dtype is torch.float16:
        if not allow_fp16:
            raise ValueError(FP16_GRADS_MESSAGE)
        with torch.no_grad():
            grad = param.grad = grad.coalesce()
    return grad._values()


def collect(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool, local: bool = False
) -> GradGroups:
    """``optimizer``'s gradient views, grouped by device and dtype (see the module docstring).

    ``local``: read ``DTensor`` gradients through their local shards. No host sync.

    Raises:
        TypeError: a parameter that is not a tensor.
        ValueError: a float16 gradient when ``allow_fp16`` is false (nothing is modified).
    """
    by_key: defaultdict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    dtensor = _dtensor_type() if local else None
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if dtensor is not None and isinstance(grad, dtensor):
                    grad = grad.to_local()
                if grad.is_sparse:
                    grad = _sparse_values(param, grad, allow_fp16)
                by_key[grad.device, grad.dtype].append(grad)
    except AttributeError:  # a parameter that is not a tensor: say which one
        for _ in iter_params(optimizer):
            pass
        raise
    groups: GradGroups = {}
    for (device, dtype), bucket in by_key.items():
        if dtype is torch.float16 and not allow_fp16:
            raise ValueError(FP16_GRADS_MESSAGE)
        groups.setdefault(device, {})[dtype] = bucket
    return groups


def grad_views(
    optimizers: Iterable[torch.optim.Optimizer],
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(group_index, param_index, param, view)`` for every parameter with a gradient.

    ``view`` is the gradient itself, its local shard for a DTensor, or the stored values of a
    sparse gradient: what localization and the probe examine, parameter by parameter.

    Raises:
        TypeError: a parameter that is not a tensor.
    """
    dtensor = _dtensor_type()
    for optimizer in optimizers:
        for group_index, param_index, param in iter_params(optimizer):
            grad = param.grad
            if grad is not None:
                if dtensor is not None and isinstance(grad, dtensor):
                    grad = grad.to_local()
                yield group_index, param_index, param, grad._values() if grad.is_sparse else grad
