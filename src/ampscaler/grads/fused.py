"""The fused optimizers' handover: how their gradients are checked, and what their kernel gets.

An optimizer whose ``_step_supports_amp_scaling`` is true (``Adam(fused=True)`` and torch's
other fused optimizers) unscales and skips inside its own kernel: it reads
``optimizer.grad_scale`` (divide every gradient by it) and ``optimizer.found_inf`` (skip the
step when it is > 0), which the scaler sets for the length of the step (:func:`step_fused`).

:class:`FusedRoute` decides how the gradients are checked before that. torch's route, the
default: the check multiplies them by 1 (finding inf/NaN, changing nothing) and the kernel gets
``grad_scale``, so after a skipped step the gradients are still scaled, as with torch's scaler.

The one-pass route (``GradScaler(one_pass_fused=True)``): when the scale is a power of two
``2**e`` with ``-126 <= e <= 127``, ``1/S`` is exact in float32, so ``grad * (1/S)`` rounds
exactly as the kernel's ``grad / S`` would. The check pass (which writes every gradient anyway)
then unscales, and the kernel gets no ``grad_scale`` and reads the gradients without writing them
back: one pass fewer over the gradients, with parameters bit for bit torch's. That holds for
torch's own fused Adam, AdamW, SGD and Adagrad (which divide by ``grad_scale`` and use it nowhere
else) with float32/float64 gradients. What differs from torch: after a *skipped* step the
gradients are left unscaled. Whether the scale is such a power of two is known on the host
without reading it (:class:`~ampscaler.grads.pow2.Pow2Watch`, kept by the scaler's state).

Example:
    >>> import torch
    >>> route = FusedRoute(one_pass=False)
    >>> opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(1))], fused=True)
    >>> multiplier, grad_scale = route.plan(opt, {}, torch.tensor(8.0), exact=True)
    >>> multiplier.item(), grad_scale.item()
    (1.0, 8.0)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from .collect import GradGroups

__all__ = ["FusedRoute", "step_fused"]

# torch's fused optimizers, whose kernels divide each gradient by ``grad_scale`` (when given)
# in float32/float64 arithmetic before using it, and touch ``grad_scale`` nowhere else.
_DIVIDING_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

# Gradient dtypes the fused kernels compute in as they are: unscaling one in the check pass
# rounds exactly as the kernel's division would. (float16/bfloat16 would round to their
# own precision in the check, where the kernel divides in float32.)
_WIDE_FLOATS = frozenset((torch.float32, torch.float64))


class FusedRoute:
    """How to check a fused optimizer's gradients, and what its kernel is handed.

    Args:
        one_pass: take the one-pass route where it is exact (module docstring); ``False``:
            torch's route always.
    """

    def __init__(self, one_pass: bool) -> None:
        self.one_pass = one_pass

    def plan(
        self,
        optimizer: torch.optim.Optimizer,
        groups: GradGroups,
        scale: torch.Tensor,
        exact: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(multiplier, grad_scale)``: what the check multiplies ``optimizer``'s gradients
        by, and the ``grad_scale`` its kernel gets (``None``: the check unscaled them).
        ``exact``: whether ``1/scale`` is known to be exact in float32 right now."""
        if (
            self.one_pass
            and exact
            and not hasattr(optimizer, "grad_scale")
            # torch's own fused kernel steps: the optimizer's, or the inner one of a wrapper
            # that steps one (such as ampscaler.MasterWeightOptimizer).
            and type(getattr(optimizer, "inner", optimizer)) in _DIVIDING_FUSED
            and all(dtype in _WIDE_FLOATS for per_dtype in groups.values() for dtype in per_dtype)
        ):
            # 1/scale is exact in float32 here: no need to form it in float64 first.
            return scale.reciprocal(), None
        ones = torch.ones((), dtype=torch.float32, device=scale.device)
        return ones, scale * getattr(optimizer, "grad_scale", 1)


def step_fused(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step an optimizer that unscales by ``optimizer.grad_scale`` and skips on
    ``optimizer.found_inf`` inside its kernel; the attributes exist only during the step.
    Optimizers with torch's deprecated ``grad_scaler=`` protocol are refused.

    Raises:
        TypeError: ``optimizer.step`` takes a ``grad_scaler`` argument; the message names the
            optimizer and what to do.
    """
    if _takes_grad_scaler(type(optimizer).step):
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes a grad_scaler argument: the legacy "
            "protocol, deprecated by torch since 2.0, in which the optimizer drives the "
            "scaler. ampscaler hands optimizers optimizer.grad_scale and optimizer.found_inf "
            "instead; update the optimizer to read those, or use torch.amp.GradScaler for it."
        )
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether an optimizer class's ``step`` has torch's legacy ``grad_scaler`` parameter."""
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False
