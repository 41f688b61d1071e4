"""Knowing on the host, without waiting for the device, that the scale is a power of two.

For a power of two ``S = 2**e`` with ``-126 <= e <= 127``, ``1/S`` is exact in float32, so
``grad * (1/S)`` and ``grad / S`` round to the same float32 (or float64) value for every
``grad``, inf and NaN included. That lets the fused-optimizer path unscale gradients in the
pass that checks them (which writes every gradient anyway) and hand the optimizer no
``grad_scale``, so its kernel does not divide and write every gradient a second time, while the
parameters come out bit for bit as with torch's scaler (see :meth:`GradScaler.step`).

:class:`Pow2Watch` knows this without reading the scale. A scale that starts as a power of two
stays one under a policy whose factors and bounds are powers of two (``update()`` only
multiplies by the factors and clamps to the bounds), and every update leaves it at or above
``2**-126`` (the scaler's floor) and below float32's infinity: after an update, a power of two
is always one with an exact reciprocal. So the watch only follows whether the scale is a power
of two: from the values the host reads or sets anyway (``get_scale()``, ``state_dict()``,
``update(new_scale)``, loading a state dict) and the policy's promise to keep one. No update
ever reads the device for it.

The watch follows the scale through the scaler's methods. A write from outside them (torch's
private ``scaler._scale.fill_(...)``, a captured graph's) is seen on the host without reading
the device: every in-place write bumps the tensor's version counter, so a version the watch did
not see is a write it did not follow, and nothing is known again until a copy of the scale
(taken then, without waiting: on CUDA into pinned memory, with an event it polls; on the CPU at
once) has landed. Anything it cannot vouch for (a policy that may leave the powers of two, see
:attr:`Policy.power_of_two <ampscaler.Policy.power_of_two>`; a scale set to a value that is not
a power of two; a device other than the CPU or CUDA) makes it answer ``False``, and the fused
path then checks and unscales exactly as torch does.

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


class Pow2Watch:
    """Whether the scale is known to be a power of two with an exact float32 reciprocal.

    Args:
        rule: how the policy in force keeps powers of two (its ``power_of_two``, ``None``: it
            may leave them; see :meth:`set_policy` for changes). Nothing is known until
            :meth:`use_device`.
    """

    def __init__(self, rule: PowerOfTwo | None) -> None:
        self._device_ok = False
        # Whether the scale is known to be a power of two (of any exponent), and known to be
        # one with an exact reciprocal (at least 2**-126: so after any update that may lower
        # it, which holds it at the floor).
        self._pow2 = self._exact = False
        self._keeps = self._lowers = False
        self.set_policy(rule)
        self._updates = 0
        self._pending: HostCopy | None = None
        self._forgotten: torch.Tensor | None = None  # the scale, to copy once it is read again
        # The scale tensor followed (see follow()) and its version as of the last write or read
        # the watch knows of; the version a pending copy was taken at.
        self._scale: torch.Tensor | None = None
        self._version = 0
        self._pending_version = 0

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
        """An ``update()`` is about to move the scale (or :attr:`exact` is asked): if something
        wrote the scale since the watch last knew it, that write is not followed (forget what
        is known)."""
        scale = self._scale
        # Traced code does not read version counters: there, assume a write (never wrong).
        if scale is not None and (torch.compiler.is_compiling() or scale._version != self._version):
            self.forget(scale)

    def _seen_now(self) -> None:
        if self._scale is not None and not torch.compiler.is_compiling():
            self._version = self._scale._version

    def set_policy(self, rule: PowerOfTwo | None) -> None:
        """Use the policy whose ``power_of_two`` is ``rule`` for the updates from now on."""
        self._keeps = rule is not None
        self._lowers = rule is not None and rule.drop > 0
        self._pow2 = self._pow2 and self._keeps
        self._exact = self._exact and self._keeps

    def saw(self, value: float) -> None:
        """The host read (or set) the scale's current value: ``value``."""
        self._learn(value, updated=False)
        self._pending = None
        self._forgotten = None
        self._seen_now()

    def forget(self, scale: torch.Tensor) -> None:
        """The scale (the tensor ``scale``) moved in a way the watch did not follow (an update
        under ``torch.compile``, where counting would be guarded on): nothing is known until
        the next :meth:`saw`, or until a copy of ``scale`` taken at the next :attr:`exact`
        has landed (at once on the CPU)."""
        self._pow2 = self._exact = False
        self._pending = None
        self._forgotten = scale

    def updated(self, scale: torch.Tensor) -> None:
        """One ``update()`` ran; ``scale`` is the new scale tensor. A power of two stays one
        (the policy keeps them); one that a policy may lower is held at or above the floor
        by the update, so it now has an exact reciprocal (a scale a policy never lowers keeps
        what it had)."""
        self._updates += 1
        self._exact = self._pow2 and (self._exact or self._lowers)
        if self._forgotten is None:  # a write from outside before it: followed by nothing
            self._seen_now()

    @property
    def exact(self) -> bool:
        """Whether the scale is certainly ``2**e`` with ``e >= -126`` right now. After a move
        the watch did not follow, the first ask starts copying the scale to the host without
        waiting; what the copy holds is known once it has landed (no host sync)."""
        if not self._device_ok:
            return False
        self.before_update()
        forgotten = self._forgotten
        if forgotten is not None:  # copy it to the host without waiting (adopted once landed)
            self._pending = HostCopy(forgotten, self._updates)
            self._pending_version = forgotten._version
            self._forgotten = None
        pending = self._pending
        if pending is not None and pending.landed():
            self._pending = None
            since = self._lowers and self._updates > pending.at  # held at the floor since
            self._learn(float(pending.tolist()), updated=since)
            if self._scale is not None:  # writes after the copy are still unseen
                self._version = self._pending_version
        return self._exact

    def _learn(self, value: float, updated: bool) -> None:
        """The scale was ``value`` (``updated``: and an update has run since)."""
        exponent = pow2_exponent(value)
        self._pow2 = self._keeps and exponent is not None
        normal = exponent is not None and exponent >= LOWEST_EXACT
        self._exact = self._pow2 and (updated or normal)
