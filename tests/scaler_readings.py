"""What the names issue 36 deprecated gave the tests, read through the names that replace them.

- :func:`counts`: the running counts as one :class:`~ampscaler.ScalerStats` (``scaler.stats``),
  from ``metrics()``, whose ``skips`` is the ``skipped`` counter. For tests that compare every
  counter at once (with a reference model, across ranks, before and after a copy). One host
  sync, as ``metrics()``.
- :func:`skip_reason`: ``"nonfinite"``, ``"spike"`` or ``None`` (``scaler.last_skip_reason``),
  from ``last_step_skipped`` and ``last_overflow``.

Example:
    >>> import ampscaler
    >>> counts(ampscaler.GradScaler("cpu")).as_dict() == ampscaler.ScalerStats().as_dict()
    True
"""

from __future__ import annotations

from typing import Literal

from ampscaler import GradScaler, ScalerStats


def counts(scaler: GradScaler) -> ScalerStats:
    """``scaler``'s counters, as ``scaler.metrics("")`` reads them."""
    read = scaler.metrics("")
    return ScalerStats(
        steps=int(read["steps"]),
        skipped=int(read["skips"]),
        growths=int(read["growths"]),
        backoffs=int(read["backoffs"]),
        consecutive_skips=int(read["consecutive_skips"]),
        spike_skips=int(read["spike_skips"]),
        replays=int(read["replays"]),
        flush_skips=int(read["flush_skips"]),
    )


def skip_reason(scaler: GradScaler) -> Literal["nonfinite", "spike"] | None:
    """Why the last iteration skipped its step: ``"nonfinite"`` (inf/NaN, with its
    ``last_overflow`` report), ``"spike"`` (a guard vetoed finite gradients: no report), or
    ``None`` (it stepped)."""
    if not scaler.last_step_skipped:
        return None
    return "spike" if scaler.last_overflow is None else "nonfinite"
