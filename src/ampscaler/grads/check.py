"""Checking gradients for inf/NaN and unscaling them, and the fused optimizers' route.

:func:`check_and_unscale_` runs torch's own kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``) once per device and dtype group, so the
unscaled values are bit for bit torch's.

:class:`FusedRoute` decides how a fused optimizer (``Adam(fused=True)``, which skips inside its
kernel when handed ``found_inf``) is checked. torch's route checks the gradients by multiplying
them by 1 and hands the kernel ``grad_scale``, which divides and writes every gradient a second
time. When the scale is a power of two ``2**e`` with ``-126 <= e <= 127``, ``1/S`` is exact in
float32, so ``grad * (1/S)`` rounds exactly as the kernel's ``grad / S`` would: the check pass
(which writes every gradient anyway) unscales, and the kernel gets no ``grad_scale`` and reads
the gradients without writing them back. That holds for torch's own fused Adam, AdamW, SGD and
Adagrad (which divide by ``grad_scale`` and use it nowhere else) with float32/float64 gradients.
Whether the scale is such a power of two is known on the host without reading it
(:class:`~ampscaler.grads.pow2.Pow2Watch`).

Example:
    >>> import torch
    >>> cpu = torch.device("cpu")
    >>> grads = {cpu: {torch.float32: [torch.tensor([2.0, float("inf")])]}}
    >>> found_inf = check_and_unscale_(grads, torch.tensor(0.5), cpu)
    >>> grads[cpu][torch.float32][0], found_inf
    (tensor([1., inf]), tensor(1.))
"""

from __future__ import annotations

import torch

from ..master import MasterWeightOptimizer
from ..policy import Policy
from .collect import GradGroups
from .pow2 import Pow2Watch

__all__ = ["FusedRoute", "check_and_unscale_", "combined_flag", "unscale_per_device_"]

# torch's fused optimizers, whose kernels divide each gradient by ``grad_scale`` (when given)
# in float32/float64 arithmetic before using it, and touch ``grad_scale`` nowhere else.
_DIVIDING_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

# Gradient dtypes the fused kernels compute in as they are: unscaling one in the check pass
# rounds exactly as the kernel's division would. (float16/bfloat16 would round to their
# own precision in the check, where the kernel divides in float32.)
_WIDE_FLOATS = frozenset((torch.float32, torch.float64))


def unscale_per_device_(
    groups: GradGroups, inv_scale: torch.Tensor, found_inf: torch.Tensor
) -> dict[torch.device, torch.Tensor]:
    """Multiply every gradient in ``groups`` by ``inv_scale`` in place and flag inf/NaN into
    ``found_inf`` (on its device; a copy of it on each other device). Returns the flag of each
    device that held gradients, as torch's ``GradScaler._unscale_grads_`` does. No host sync.
    """
    flags: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for device, per_dtype in groups.items():
            flag = found_inf if device == found_inf.device else found_inf.to(device, copy=True)
            inv = inv_scale.to(device, non_blocking=True)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
            flags[device] = flag
    return flags


def check_and_unscale_(
    groups: GradGroups, inv_scale: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """Multiply every gradient in ``groups`` by ``inv_scale`` in place and flag inf/NaN.

    Returns a float32 0-dim flag on ``device`` (the scale's), ``> 0`` iff a non-finite value
    was seen, or ``None`` when ``groups`` holds no gradient. Gradients on other devices are
    checked there and their flags summed on ``device``. No host sync.
    """
    found_inf = torch.zeros((), dtype=torch.float32, device=device)
    return combined_flag(unscale_per_device_(groups, inv_scale, found_inf), device)


def combined_flag(
    flags: dict[torch.device, torch.Tensor], device: torch.device
) -> torch.Tensor | None:
    """The per-device flags summed on ``device`` (``> 0`` iff any was set); ``None`` for none."""
    combined: torch.Tensor | None = flags.get(device)
    for flag_device, flag in flags.items():
        if flag_device != device:
            flag = flag.to(device, non_blocking=True)
            combined = flag if combined is None else combined + flag
    return combined


class FusedRoute:
    """How to check a fused optimizer's gradients, and what its kernel is handed.

    Told about every host read or write of the scale (:meth:`saw`), every ``update()``
    (:meth:`updated`) and policy change (:meth:`set_policy`), it answers :meth:`plan`.

    Args:
        policy: the policy in force.
        scale: the live scale tensor.
        value: its current value, as the host knows it.
    """

    def __init__(self, policy: Policy, scale: torch.Tensor, value: float) -> None:
        self._scale = scale
        self._watch = Pow2Watch(policy, scale.device)
        self._watch.saw(value)

    def set_policy(self, policy: Policy) -> None:
        """The policy changed (a setter, a loaded checkpoint)."""
        self._watch.set_policy(policy)

    def saw(self, value: float) -> None:
        """The host read or set the scale: it is ``value`` now."""
        self._watch.saw(value)

    def updated(self) -> None:
        """One ``update()`` moved the scale by the policy.

        Under ``torch.compile`` the watch forgets what it knew instead of counting updates
        (a Python count in a compiled graph would be guarded on, recompiling every step); the
        next eager :meth:`plan` renews it from a copy of the scale (on the CPU at once; on
        CUDA once a non-blocking copy has landed, torch's route until then).
        """
        if torch.compiler.is_compiling():
            self._watch.forget(self._scale)
        else:
            self._watch.updated(self._scale)

    def plan(
        self, optimizer: torch.optim.Optimizer, groups: GradGroups
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(multiplier, grad_scale)``: what the check multiplies ``optimizer``'s gradients
        by, and the ``grad_scale`` its kernel gets (``None``: the check unscaled them)."""
        if (
            not hasattr(optimizer, "grad_scale")
            and self._watch.exact
            and _kernel_divides(optimizer)
            and all(dtype in _WIDE_FLOATS for per_dtype in groups.values() for dtype in per_dtype)
        ):
            # 1/scale is exact in float32 here: no need to form it in float64 first.
            return self._scale.reciprocal(), None
        ones = torch.ones((), dtype=torch.float32, device=self._scale.device)
        return ones, self._scale * getattr(optimizer, "grad_scale", 1)


def _kernel_divides(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's fused optimizers (possibly wrapped by
    :class:`~ampscaler.MasterWeightOptimizer`)."""
    stepping = optimizer.inner if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    return type(stepping) in _DIVIDING_FUSED
