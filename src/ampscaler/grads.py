"""Collecting an optimizer's gradients, checking them for inf/NaN and unscaling them.

Gradients are grouped by device and dtype so that each group is handled by one fused kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``), the same kernel torch's scaler uses, so
the unscaled values are bit-for-bit the same. Sparse gradients are checked through their values
(fp16 ones are coalesced first, so duplicate indices cannot overflow when summed later).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = [
    "FP16_GRADS_MESSAGE",
    "GradGroups",
    "check_and_unscale_",
    "group_grad_list",
    "group_grads",
    "iter_params",
]

FP16_GRADS_MESSAGE = (
    "Attempting to unscale FP16 gradients. GradScaler unscales gradients in float32: keep the "
    "model's parameters in float32 and run the forward pass under torch.autocast, or wrap the "
    "optimizer in ampscaler.MasterWeightOptimizer to train float16 weights with float32 masters."
)

GradGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(group_index, param_index, param)`` for every parameter of ``optimizer``."""
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise TypeError(
                    f"optimizer.param_groups[{group_index}]['params'][{param_index}] is a "
                    f"{type(param).__name__}, not a torch.Tensor; GradScaler can only check "
                    "tensor parameters."
                )
            yield group_index, param_index, param


def group_grads(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> GradGroups:
    """The tensors to check for ``optimizer``, grouped by device and dtype.

    Parameters without a gradient are left out. For a sparse gradient its values are checked;
    an fp16 sparse gradient is coalesced first (replacing ``param.grad``).

    Raises:
        ValueError: an fp16 gradient when ``allow_fp16`` is false (torch's message, extended).
    """
    grads: list[torch.Tensor | None] = []
    with torch.no_grad():
        for _, _, param in iter_params(optimizer):
            grad = param.grad
            if grad is not None and grad.is_sparse:
                if grad.dtype is torch.float16:
                    if not allow_fp16:
                        raise ValueError(FP16_GRADS_MESSAGE)
                    grad = param.grad = grad.coalesce()
                grad = grad._values()
            grads.append(grad)
    groups = group_grad_list(grads, allow_fp16)
    assert groups is not None  # sparse gradients were replaced by their values above
    return groups


def group_grad_list(
    grads: list[torch.Tensor | None], allow_fp16: bool
) -> GradGroups | None:
    """Group already collected dense gradients by device and dtype (``None`` entries skipped).

    The fast way for the common case: one dict lookup per gradient. Returns ``None`` when a
    gradient is sparse; :func:`group_grads` handles those.

    Raises:
        ValueError: a float16 gradient when ``allow_fp16`` is false.
    """
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        if grad is None:
            continue
        if grad.is_sparse:
            return None
        key = (grad.device, grad.dtype)
        bucket = by_key.get(key)
        if bucket is None:
            bucket = by_key[key] = []
        bucket.append(grad)
    groups: GradGroups = {}
    for (device, dtype), bucket in by_key.items():
        if dtype == torch.float16 and not allow_fp16:
            raise ValueError(FP16_GRADS_MESSAGE)
        groups.setdefault(device, {})[dtype] = bucket
    return groups


def check_and_unscale_(
    groups: GradGroups, inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient in ``groups`` by ``inv_scale`` in place and flag inf/NaN.

    Returns one float32 0-dim flag per device that held gradients: ``1.0`` where a non-finite
    value was seen, else ``0.0``. ``found_inf`` (all zeros) and ``inv_scale`` live on the
    scale's device and are copied to other devices once each. No host sync.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    inv_scales: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in groups.items():
            if device == found_inf.device:
                flag, inv = found_inf, inv_scale
            else:
                flag = found_inf.to(device=device, non_blocking=True, copy=True)
                inv = inv_scales.setdefault(
                    device, inv_scale.to(device=device, non_blocking=True, copy=True)
                )
            flags[device] = flag
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
    return flags

