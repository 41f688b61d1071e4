"""Counting step outcomes on the device, and reading them back as Python numbers.

One ``int64`` tensor of five counters is updated with a handful of tensor ops per
``update()``; nothing waits for the device until somebody reads :class:`ScalerStats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["FIELDS", "ScalerStats", "new_counters", "record"]

FIELDS = ("steps", "skipped", "growths", "backoffs", "consecutive_skips")
_STEPS, _SKIPPED, _GROWTHS, _BACKOFFS, _CONSECUTIVE = range(len(FIELDS))


@dataclass(frozen=True)
class ScalerStats:
    """What happened so far, as Python ints.

    Attributes:
        steps: iterations that reached ``update()`` after at least one ``step()`` or ``unscale_()``.
        skipped: of those, iterations whose gradients held inf or NaN (the optimizer skipped).
        growths: updates that raised the scale.
        backoffs: updates that lowered the scale.
        consecutive_skips: skipped iterations in a row, up to the latest one (0 after a clean one).
    """

    steps: int = 0
    skipped: int = 0
    growths: int = 0
    backoffs: int = 0
    consecutive_skips: int = 0

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict, as stored in ``state_dict()["stats"]``."""
        return asdict(self)

    @classmethod
    def from_tensor(cls, counters: torch.Tensor) -> ScalerStats:
        """Read a counters tensor back (a host sync)."""
        return cls(*(int(v) for v in counters.tolist()))


def new_counters(device: torch.device, stats: ScalerStats | None = None) -> torch.Tensor:
    """A counters tensor on ``device``, starting from ``stats`` (zeros by default)."""
    values = [0] * len(FIELDS) if stats is None else [getattr(stats, f) for f in FIELDS]
    return torch.tensor(values, dtype=torch.int64, device=device)


def record(
    counters: torch.Tensor,
    found_inf: torch.Tensor,
    old_scale: torch.Tensor,
    new_scale: torch.Tensor,
) -> None:
    """Count one iteration in place: whether it overflowed and how the scale moved.

    Eight small device ops, no host sync: ``counters = counters * keep + add`` with
    ``keep = [1, 1, 1, 1, overflow]`` and ``add = [1, overflow, grew, shrank, overflow]``,
    so ``consecutive_skips`` becomes ``(consecutive_skips + 1) * overflow``.
    """
    overflow = found_inf > 0
    one = torch.ones_like(overflow)
    keep = torch.stack((one, one, one, one, overflow))
    add = torch.stack((one, overflow, new_scale > old_scale, new_scale < old_scale, overflow))
    counters.mul_(keep).add_(add)
