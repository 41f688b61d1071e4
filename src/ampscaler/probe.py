"""The underflow and headroom probe: how much of the gradient fp16 loses, and how close to overflow.

Opt-in with ``GradScaler(probe_every=N)``; on a probed iteration it measures

* **underflow** (a): of the non-zero gradient elements at the current scale (as the optimizer's
  gradients hold them before unscaling), the fraction that would flush to zero if stored in fp16
  (``|g| <= 2**-25``), and the same fraction for the gradients divided by the scale, i.e. what
  training without loss scaling would lose;
* **headroom** (b): ``log2(65504 / max|g|)`` for the scaled gradients ``g``, the number of times
  the scale could double before the largest gradient overflows fp16 (negative: it already
  overflowed; ``inf``: every gradient is zero);
* **per-module underflow** (c): through hooks on the leaf modules of the watched models, the
  fraction of the fp16 gradient elements arriving at each module's outputs that are zero or
  subnormal (``|g| < 2**-14``), the worst modules listed first.

Everything is computed on the device and read back with the step record's one host sync. The
module hooks exist only during probed iterations; with the probe off nothing is registered.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .diagnostics import iter_grad_values
from .taps import GradTaps

__all__ = ["FP16_MAX", "GradientProbe", "PendingProbe", "ProbeResult"]

FP16_MAX = 65504.0
FLUSH_TO_ZERO = 2.0**-25  # fp16 rounds |x| <= 2**-25 to zero (half the smallest subnormal)
SMALLEST_NORMAL = 2.0**-14
WORST_MODULES = 10


def _number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured (the ``probe`` field of a step record).

    Attributes:
        scale: the loss scale of the probed gradients.
        elements: gradient elements examined (sparse gradients: their stored values).
        nonzero: of those, the non-zero ones.
        underflow_at_scale: fraction of the non-zero elements that would flush to zero in fp16
            at ``scale``.
        underflow_at_one: the same fraction for the gradients divided by ``scale``.
        headroom_log2: ``log2(65504 / max|scaled gradient|)``.
        modules: the worst (up to ten) watched leaf modules -> fraction of the fp16 gradient
            elements arriving at their outputs that were zero or subnormal; worst first.
    """

    scale: float
    elements: int
    nonzero: int
    underflow_at_scale: float
    underflow_at_one: float
    headroom_log2: float
    modules: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; non-finite floats are written as strings (``"inf"``)."""
        return {
            "scale": self.scale,
            "elements": self.elements,
            "nonzero": self.nonzero,
            "underflow_at_scale": self.underflow_at_scale,
            "underflow_at_one": self.underflow_at_one,
            "headroom_log2": _number(self.headroom_log2),
            "modules": dict(self.modules),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        """The inverse of :meth:`as_dict`."""
        return cls(
            scale=float(data["scale"]),
            elements=int(data["elements"]),
            nonzero=int(data["nonzero"]),
            underflow_at_scale=float(data["underflow_at_scale"]),
            underflow_at_one=float(data["underflow_at_one"]),
            headroom_log2=float(data["headroom_log2"]),  # float() also reads "inf", "nan"
            modules={str(k): float(v) for k, v in data["modules"].items()},
        )


def _headroom(largest: float) -> float:
    if math.isnan(largest):
        return math.nan
    if largest == 0.0:
        return math.inf
    return math.log2(FP16_MAX / largest) if math.isfinite(largest) else -math.inf


@dataclass
class PendingProbe:
    """A probe's device-side results, waiting for the step record's host sync.

    ``tensors`` are 0-dim; :meth:`finish` turns their values (in the same order) into a
    :class:`ProbeResult`.
    """

    scale: torch.Tensor
    elements: int
    tensors: list[torch.Tensor]
    module_elements: dict[str, int]

    def finish(self, values: Sequence[float]) -> ProbeResult:
        """Build the result from the values of :attr:`tensors` read back from the device."""
        scale, zeros, flush_at_scale, flush_at_one, largest, *per_module = values
        nonzero = self.elements - int(zeros)
        fractions = {
            name: small / self.module_elements[name]
            for name, small in zip(self.module_elements, per_module, strict=True)
        }
        worst = sorted(fractions.items(), key=lambda item: item[1], reverse=True)[:WORST_MODULES]
        return ProbeResult(
            scale=scale,
            elements=self.elements,
            nonzero=nonzero,
            underflow_at_scale=(flush_at_scale - zeros) / nonzero if nonzero else 0.0,
            underflow_at_one=(flush_at_one - zeros) / nonzero if nonzero else 0.0,
            headroom_log2=_headroom(largest),
            modules=dict(worst),
        )


class GradientProbe:
    """Measures one iteration's gradients on the device; see the module docstring."""

    def __init__(self) -> None:
        self._taps = GradTaps(self._tap)
        self._counts: list[torch.Tensor] = []  # [zeros, <= flush at scale, <= flush at 1]
        self._maxima: list[torch.Tensor] = []
        self._elements = 0
        self._scale: torch.Tensor | None = None
        self._small: dict[str, torch.Tensor] = {}
        self._module_elements: dict[str, int] = defaultdict(int)

    @property
    def armed(self) -> bool:
        """Whether the module hooks are registered (during probed iterations)."""
        return self._taps.attached

    def arm(self, models: Iterable[tuple[torch.nn.Module, str]]) -> None:
        """Register the module hooks on ``(model, prefix)`` pairs."""
        for model, prefix in models:
            self._taps.attach(model, prefix)

    def disarm(self) -> None:
        """Remove the module hooks."""
        self._taps.detach()

    def _tap(self, name: str, where: str, grad: torch.Tensor) -> None:
        values = grad._values() if grad.is_sparse else grad
        if values.dtype is not torch.float16 or values.numel() == 0:
            return
        with torch.no_grad():
            small = torch.count_nonzero(values.abs() < SMALLEST_NORMAL)
            previous = self._small.get(name)
            self._small[name] = small if previous is None else previous + small
            self._module_elements[name] += values.numel()

    def measure(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
        """Count ``optimizer``'s gradients at ``scale`` (before unscaling). No host sync."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for _, _, _, values in iter_grad_values([optimizer]):
            if values.numel():
                groups[(values.device, values.dtype)].append(values.reshape(-1))
        if not groups:
            return
        self._scale = scale
        with torch.no_grad():
            for (device, _), grads in groups.items():
                flat = torch.cat(grads).abs_() if len(grads) > 1 else grads[0].abs()
                at_one = scale.to(device, non_blocking=True) * FLUSH_TO_ZERO
                self._counts.append(
                    torch.stack(
                        [
                            torch.count_nonzero(flat == 0),
                            torch.count_nonzero(flat <= FLUSH_TO_ZERO),
                            torch.count_nonzero(flat <= at_one),
                        ]
                    )
                )
                self._maxima.append(flat.max().float())
                self._elements += flat.numel()

    def take(self) -> PendingProbe | None:
        """The pending results of this iteration (``None`` if nothing was measured); resets."""
        if self._scale is None:
            self._small, self._module_elements = {}, defaultdict(int)
            return None
        device = self._scale.device
        counts = torch.stack([c.to(device) for c in self._counts]).sum(dim=0)
        largest = torch.stack([m.to(device) for m in self._maxima]).max()
        tensors = [self._scale, *counts.unbind(), largest]
        tensors += [self._small[name].to(device) for name in self._module_elements]
        pending = PendingProbe(self._scale, self._elements, tensors, dict(self._module_elements))
        self._counts, self._maxima, self._elements, self._scale = [], [], 0, None
        self._small, self._module_elements = {}, defaultdict(int)
        return pending
