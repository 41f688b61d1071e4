"""Counting step outcomes on the device, and reading them back as Python numbers.

Counting costs ``update()`` no device work: :meth:`StepCounters.record` only keeps the
iteration's inf flag and its old and new scale (0-dim tensors the scaler never modifies). The
kept iterations are folded into one ``int64`` tensor of five counters with a dozen vectorized
ops when somebody reads the counters, or every :data:`FOLD_EVERY` iterations; nothing waits
for the device until somebody reads :class:`ScalerStats`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["FIELDS", "FOLD_EVERY", "ScalerStats", "StepCounters"]

FIELDS = ("steps", "skipped", "growths", "backoffs", "consecutive_skips")
#: Iterations kept before they are folded into the counters, at the latest.
FOLD_EVERY = 64


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


class StepCounters:
    """The five counters of :class:`ScalerStats` on ``device``, starting from ``stats``.

    Example:
        >>> counters = StepCounters(torch.device("cpu"))
        >>> one = torch.tensor(1.0)
        >>> counters.record(torch.tensor(0.0), one, one * 2)   # clean, the scale grew
        >>> counters.record(torch.tensor(1.0), one * 2, one)   # overflow, it backed off
        >>> counters.stats()
        ScalerStats(steps=2, skipped=1, growths=1, backoffs=1, consecutive_skips=1)
    """

    def __init__(self, device: torch.device, stats: ScalerStats | None = None) -> None:
        values = [0] * len(FIELDS) if stats is None else [getattr(stats, f) for f in FIELDS]
        self._folded = torch.tensor(values, dtype=torch.int64, device=device)
        self._found: list[torch.Tensor] = []
        self._old: list[torch.Tensor] = []
        self._new: list[torch.Tensor] = []

    def record(
        self, found_inf: torch.Tensor, old_scale: torch.Tensor, new_scale: torch.Tensor
    ) -> None:
        """Count one iteration: it overflowed iff ``found_inf > 0``; the scale moved from
        ``old_scale`` to ``new_scale``. The tensors must not be modified afterwards."""
        self._found.append(found_inf)
        self._old.append(old_scale)
        self._new.append(new_scale)
        if len(self._found) >= FOLD_EVERY:
            self._fold()

    def tensor(self) -> torch.Tensor:
        """The counters as one ``int64`` tensor of shape ``[5]``, in :data:`FIELDS` order."""
        if self._found:
            self._fold()
        return self._folded

    def stats(self) -> ScalerStats:
        """The counters as Python ints (a host sync)."""
        return ScalerStats.from_tensor(self.tensor())

    def _fold(self) -> None:
        count = len(self._found)
        device = self._folded.device
        overflow = torch.stack([flag.to(device, torch.float32) for flag in self._found]) > 0
        old = torch.stack(self._old)
        new = torch.stack(self._new)
        # The overflows at the end, in a row: 1s of the reversed flags up to their first 0.
        trailing = overflow.flip(0).to(torch.int64).cumprod(0).sum()
        steps, skipped, growths, backoffs, in_a_row = self._folded.unbind()
        self._folded = torch.stack(
            (
                steps + count,
                skipped + overflow.sum(),
                growths + (new > old).sum(),
                backoffs + (new < old).sum(),
                trailing + in_a_row * (trailing == count),
            )
        )
        self._found, self._old, self._new = [], [], []
