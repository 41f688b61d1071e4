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

The watch follows the scale through the scaler's methods. A write from outside them (torch's
private ``scaler._scale.fill_(...)``, a captured graph's) is seen on the host without reading
the device: every in-place write bumps the tensor's version counter, so a version the watch did
not see is a write it did not follow, and nothing is known again until a copy of the scale
(taken then, without waiting) has landed. Anything it cannot vouch for (a policy that may leave
the powers of two, see :attr:`Policy.power_of_two <ampscaler.Policy.power_of_two>`; a scale
set to a value that is not a power of two; a device other than the CPU or CUDA) makes it
answer ``False``, and the fused path then checks and unscales exactly as torch does.

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
        # The scale tensor followed (see follow()) and its version as of the last write or read
        # the watch knows of; the version a pending copy was taken at.
        self._scale: torch.Tensor | None = None
        self._version = 0
        self._pending_version = 0
        self._drop: int | None = None
        self._floor: int | None = None
        self.set_policy(rule)

    def use_device(self, device: torch.device) -> None:
        """The scale lives on ``device`` (the watch vouches for the CPU and CUDA only)."""
        self._device_ok = device.type in ("cpu", "cuda")

    def follow(self, scale: torch.Tensor) -> None:
        """Watch ``scale`` (the live tensor, on its device) for writes from outside the scaler:
        a version of it the watch did not see makes :attr:`exact` ``False`` until a copy of the
        scale has landed."""
        self.use_device(scale.device)
        self._scale = scale
        self._version = scale._version

    def before_update(self) -> None:
        """An ``update()`` is about to move the scale: if something wrote the scale since the
        watch last knew it, that write is not followed (forget what is known)."""
        if self._written_outside():
            assert self._scale is not None
            self.forget(self._scale)

    def _written_outside(self) -> bool:
        if self._scale is None:
            return False
        # Traced code does not read version counters: there, assume a write (never wrong).
        return torch.compiler.is_compiling() or self._scale._version != self._version

    def _seen_now(self) -> None:
        if self._scale is not None and not torch.compiler.is_compiling():
            self._version = self._scale._version

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
        self._seen_now()

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
        if self._forgotten is None:  # a write from outside before it: followed by nothing
            self._seen_now()
        bound = self._bound()
        if bound is not None and bound < RENEW_BELOW and self._pending is None:
            self._copy(scale)  # adopted by `exact` once landed

    @property
    def exact(self) -> bool:
        """Whether the scale is certainly ``2**e`` with ``e >= -126`` right now."""
        if not self._device_ok:
            return False
        if self._written_outside():
            assert self._scale is not None
            self.forget(self._scale)
        if self._forgotten is not None:
            self._copy(self._forgotten)
            self._forgotten = None
        self._adopt_landed()
        bound = self._bound()
        return bound is not None and bound >= LOWEST_EXACT

    def lowest(self) -> float:
        """A lower bound on the scale now, as this watch knows it (``0.0``: none)."""
        bound = self._bound()
        return 0.0 if bound is None else 2.0**bound

    def _bound(self) -> int | None:
        """A lower bound on the scale's exponent now (``None``: not known to be a power of 2)."""
        if self._known is None or self._drop is None:
            return None
        bound = self._known - self._drop * (self._updates - self._known_at)
        return bound if self._floor is None else max(bound, self._floor)

    def _copy(self, scale: torch.Tensor) -> None:
        """Start copying ``scale`` to the host without waiting (adopted once landed)."""
        self._pending = HostCopy(scale, self._updates)
        self._pending_version = scale._version

    def _adopt_landed(self) -> None:
        pending = self._pending
        if pending is not None and pending.landed():
            self._pending = None
            if self._drop is not None:
                self._known = pow2_exponent(float(pending.tolist()))
                self._known_at = pending.at
            if self._scale is not None:  # writes after the copy are still unseen
                self._version = self._pending_version

    def _renew_from_bound(self) -> None:
        # Before the factors change, fold the updates so far into the bound: the new backoff
        # factor only applies to the updates that come after.
        self._known = self._bound()
        self._known_at = self._updates
        self._pending = None
