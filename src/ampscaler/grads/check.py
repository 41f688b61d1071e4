"""Checking gradients for inf/NaN and unscaling them.

:func:`check_and_unscale_` runs torch's own kernel
(``torch._amp_foreach_non_finite_check_and_unscale_``) once per device and dtype group, so the
unscaled values are bit for bit torch's. How fused optimizers are checked and handed the flag
is :mod:`ampscaler.grads.fused`'s.

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

from .collect import GradGroups

__all__ = ["check_and_unscale_", "combined_flag", "unscale_per_device_"]


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
            inv = inv_scale
            if inv.device != device:
                inv = inv.to(device, non_blocking=True)
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
