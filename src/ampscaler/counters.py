"""Counting step outcomes on the device, and reading them back as Python numbers.

Each ``update()`` costs one small device op: :meth:`StepCounters.record` stacks the step's
inf flag and its old and new scale into a row of a short history on the device. The history
is folded into five ``int64`` counters, with a dozen vectorized ops, when it is full and
whenever the counters are read. Nothing waits for the device until somebody reads
:class:`ScalerStats`.

Example:
    >>> import torch
    >>> from ampscaler.counters import StepCounters
    >>> counters = StepCounters(torch.device("cpu"))
    >>> counters.record(torch.tensor(1.0), torch.tensor(8.0), torch.tensor(4.0))
    >>> counters.record(torch.tensor(0.0), torch.tensor(4.0), torch.tensor(4.0))
    >>> counters.read()
    ScalerStats(steps=2, skipped=1, growths=0, backoffs=1, consecutive_skips=0)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["FIELDS", "ScalerStats", "StepCounters"]

FIELDS = ("steps", "skipped", "growths", "backoffs", "consecutive_skips")
_STEPS, _SKIPPED, _GROWTHS, _BACKOFFS, _CONSECUTIVE = range(len(FIELDS))


@dataclass(frozen=True)
class ScalerStats:
    """What happened so far, as Python ints.

    Attributes:
        steps: iterations that reached ``update()`` after at least one ``step()``.
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

    Args:
        device: where the counters and the history live (the scale's device).
        stats: the starting values (zeros by default), e.g. from a checkpoint.
        history: how many updates are recorded before they are folded into the counters.
    """

    def __init__(
        self, device: torch.device, stats: ScalerStats | None = None, history: int = 64
    ) -> None:
        start = ScalerStats() if stats is None else stats
        self._totals = torch.tensor(
            [getattr(start, name) for name in FIELDS], dtype=torch.int64, device=device
        )
        # One row per recorded update: found_inf, old scale, new scale.
        self._history = torch.zeros((history, 3), dtype=torch.float32, device=device)
        self._rows = self._history.unbind(0)
        self._filled = 0

    def record(
        self, found_inf: torch.Tensor, old_scale: torch.Tensor, new_scale: torch.Tensor
    ) -> None:
        """Count one iteration: it overflowed iff ``found_inf > 0``; the scale moved as given.

        One device op (a fold every ``history`` calls), no host sync.
        """
        torch.stack((found_inf, old_scale, new_scale), out=self._rows[self._filled])
        self._filled += 1
        if self._filled == len(self._rows):
            self._fold()

    def _fold(self) -> None:
        filled = self._filled
        if filled == 0:
            return
        rows = self._history[:filled]
        overflow = rows[:, 0] > 0
        increments = torch.stack(
            (overflow.sum(), (rows[:, 2] > rows[:, 1]).sum(), (rows[:, 2] < rows[:, 1]).sum())
        )
        trailing = overflow.flip(0).cumprod(0).sum()  # overflows in a row at the end
        totals = self._totals
        totals[_STEPS] += filled
        totals[_SKIPPED:_CONSECUTIVE] += increments
        totals[_CONSECUTIVE] = trailing + totals[_CONSECUTIVE] * (trailing == filled)
        self._filled = 0

    def read(self) -> ScalerStats:
        """The counters so far, as Python ints (a host sync)."""
        self._fold()
        return ScalerStats.from_tensor(self._totals)
