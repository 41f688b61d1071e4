"""A scaler's running counts as one :class:`~ampscaler.ScalerStats`, read through ``metrics()``.

Tests that compare every counter at once (with a reference model, across ranks, before and
after a copy) read them here; ``GradScaler.stats``, which gave this object, is deprecated for
``metrics()``, whose ``skips`` is the ``skipped`` counter. One host sync, as ``metrics()``.

Example:
    >>> import ampscaler
    >>> counts(ampscaler.GradScaler("cpu")).as_dict() == ampscaler.ScalerStats().as_dict()
    True
"""

from __future__ import annotations

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
    )
