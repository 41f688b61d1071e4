"""Handing a step record to each of its consumers, so that one failing consumer never starves
the others.

A sink whose disk is full, or a callback with a bug, raises from inside ``update()``. Were the
error to propagate, every sink and callback after it would get nothing, and training would
stop for the sake of its telemetry. :class:`Delivery` calls each consumer in turn, and when one
raises, it warns once for that consumer (a :class:`~ampscaler.SinkWarning` that names it and
the error), serves the rest, and keeps calling it at the next steps (a disk that frees up
resumes the log). ``KeyboardInterrupt`` and other non-``Exception`` errors propagate.

Example:
    >>> import warnings
    >>> delivery = Delivery()
    >>> got = []
    >>> def broken(record):
    ...     raise OSError(28, "No space left on device")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for step in range(3):
    ...         delivery.hand(broken, step)
    ...         delivery.hand(got.append, step)
    >>> got, len(caught)
    ([0, 1, 2], 1)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import SinkWarning, warn_at_caller

__all__ = ["Delivery"]


class Delivery:
    """Calls consumers, each failure its own: reported once per consumer, never raised."""

    def __init__(self) -> None:
        # The consumers whose failure was reported (held, so that an id is never reused).
        self._reported: list[object] = []

    def hand(self, consumer: Callable[[Any], object], item: object, owner: object = None) -> None:
        """Call ``consumer(item)``; if it raises, warn once for ``owner`` (the sink whose
        method ``consumer`` is; default: ``consumer`` itself) and return."""
        try:
            consumer(item)
        except Exception as error:
            who = consumer if owner is None else owner
            if any(seen is who for seen in self._reported):
                return
            self._reported.append(who)
            step = getattr(item, "step", None)
            at = "" if step is None else f" at step {step}"
            warn_at_caller(
                f"{who!r} raised {type(error).__name__}: {error}{at}. The other sinks and "
                "callbacks were served, and it will still be called at the next steps; this "
                "is reported once. Fix it, or detach it (scaler.detach(sink), or the "
                "function scaler.on() returned).",
                SinkWarning,
            )
