"""Knowing on the host, without waiting for the device, that the scale is a power of two.

For a power of two ``S = 2**e`` with ``-126 <= e <= 127``, ``1/S`` is exact in float32, so
``grad * (1/S)`` and ``grad / S`` round to the same float32 (or float64) value for every
``grad``, inf and NaN included. That lets the fused-optimizer path unscale gradients in the
pass that checks them (which writes every gradient anyway) and hand the optimizer no
``grad_scale``, so its kernel does not divide and write every gradient a second time, while the
parameters come out bit for bit as with torch's scaler (see :meth:`GradScaler.step`).

:class:`Pow2Watch` knows this without reading the scale. A scale that starts as a power of two
stays one under a policy whose factors and bounds are powers of two (``update()`` only
multiplies by the factors and clamps to the bounds). Its exponent can fall by at most
``log2(1/backoff_factor)`` per ``update()``, so the watch keeps a lower bound on it from the
last value it saw. Each time the host reads or sets the scale anyway (``get_scale()``,
``state_dict()``, ``update(new_scale)``, loading a state dict) the bound is renewed for free.
Left alone, the bound would fall below ``2**-126`` after some 140 updates at torch's defaults;
before it does (below ``2**-64``), the watch copies the scale to the host without waiting for
it (on CUDA: into pinned memory, with an event it polls; on the CPU the value is at hand) and
renews the bound from that copy once it has landed. So no update ever waits for the device.

The watch assumes the scale changes only through the scaler's methods. Anything it cannot vouch
for (a policy that may leave the powers of two, see :attr:`Policy.power_of_two
<ampscaler.Policy.power_of_two>`; a scale set to a value that is not a power of two; a device
other than the CPU or CUDA) makes it answer ``False``, and the fused path then checks and
unscales exactly as torch does.

Example:
    >>> import torch
    >>> from ampscaler.policy import ScalePolicy
    >>> from ampscaler.grads.pow2 import Pow2Watch
    >>> watch = Pow2Watch(ScalePolicy().power_of_two)
    >>> watch.use_device(torch.device("cpu"))
    >>> watch.saw(65536.0)
    >>> watch.exact
    True
    >>> watch.saw(3.0e4)   # a scale set by hand to a value that is not a power of two
    >>> watch.exact
    False
"""

from __future__ import annotations

import torch

from ..hostcopy import HostCopy
from ..policy.base import PowerOfTwo, pow2_exponent

__all__ = ["Pow2Watch", "pow2_exponent"]

#: The smallest exponent whose reciprocal float32 holds as a normal number.
LOWEST_EXACT = -126
#: Below this bound the watch starts copying the scale to the host to renew the bound.
RENEW_BELOW = -64


class Pow2Watch:
    """Whether the scale is known to be a power of two with an exact float32 reciprocal.

    Args:
        rule: how the policy in force keeps powers of two (its ``power_of_two``; see
            :meth:`set_policy` for changes). Nothing is known until :meth:`use_device`.
    """

    def __init__(self, rule: PowerOfTwo | None) -> None:
        self._device_ok = False
        self._updates = 0
        # A lower bound on the scale's exponent as of update number _known_at (None: the
        # scale is not known to be a power of two).
        self._known: int | None = None
        self._known_at = 0
        self._pending: HostCopy | None = None
        self._forgotten: torch.Tensor | None = None  # the scale, to copy once it is read again
        self._drop: int | None = None
        self._floor: int | None = None
        self.set_policy(rule)

    def use_device(self, device: torch.device) -> None:
        """The scale lives on ``device`` (the watch vouches for the CPU and CUDA only)."""
        self._device_ok = device.type in ("cpu", "cuda")

    def set_policy(self, rule: PowerOfTwo | None) -> None:
        """Use the policy whose ``power_of_two`` is ``rule`` for the updates from now on."""
        self._renew_from_bound()
        self._drop = None if rule is None else rule.drop
        self._floor = None if rule is None else rule.floor
        if self._drop is None:
            self._known = None

    def saw(self, value: float) -> None:
        """The host read (or set) the scale's current value: ``value``."""
        self._known = pow2_exponent(value) if self._drop is not None else None
        self._known_at = self._updates
        self._pending = None
        self._forgotten = None

    def forget(self, scale: torch.Tensor) -> None:
        """The scale (the tensor ``scale``) moved in a way the watch did not follow (an update
        under ``torch.compile``, where counting would be guarded on): nothing is known until
        the next :meth:`saw`, or until a copy of ``scale`` taken at the next :attr:`exact`
        has landed (at once on the CPU)."""
        self._known = None
        self._pending = None
        self._forgotten = scale

    def updated(self, scale: torch.Tensor) -> None:
        """One ``update()`` ran; ``scale`` is the new scale tensor (on the device)."""
        self._updates += 1
        bound = self._bound()
        if bound is not None and bound < RENEW_BELOW and self._pending is None:
            self._pending = HostCopy(scale, self._updates)  # adopted by `exact` once landed

    @property
    def exact(self) -> bool:
        """Whether the scale is certainly ``2**e`` with ``e >= -126`` right now."""
        if not self._device_ok:
            return False
        if self._forgotten is not None:
            self._pending = HostCopy(self._forgotten, self._updates)
            self._forgotten = None
        self._adopt_landed()
        bound = self._bound()
        return bound is not None and bound >= LOWEST_EXACT

    def _bound(self) -> int | None:
        """A lower bound on the scale's exponent now (``None``: not known to be a power of 2)."""
        if self._known is None or self._drop is None:
            return None
        bound = self._known - self._drop * (self._updates - self._known_at)
        return bound if self._floor is None else max(bound, self._floor)

    def _adopt_landed(self) -> None:
        pending = self._pending
        if pending is not None and pending.landed():
            self._pending = None
            if self._drop is not None:
                self._known = pow2_exponent(float(pending.tolist()))
                self._known_at = pending.at

    def _renew_from_bound(self) -> None:
        # Before the factors change, fold the updates so far into the bound: the new backoff
        # factor only applies to the updates that come after.
        self._known = self._bound()
        self._known_at = self._updates
        self._pending = None
