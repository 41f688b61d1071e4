"""Saying when the loss scale does not help: every measured gradient flushed to zero.

A :class:`~ampscaler.HeadroomPolicy` measures the largest scaled gradient of an iteration; when
that is exactly 0, float16 flushed every gradient it measured to zero at the scale in force,
and the optimizer stepped on zeros. The policy counts such iterations
(``HeadroomState.flushed``) and grows the scale while it has measured nothing else; its meter
hands the count to :meth:`GradScaler.metrics <ampscaler.GradScaler.metrics>`, which reports it
as ``flushed_measurements``, and warns once, the first time ``metrics()`` reads a count above 0
(:meth:`HeadroomMeter.heard <ampscaler.policy.meter.HeadroomMeter.heard>`).

Example:
    >>> flushed_message(1.0, 3).splitlines()[0][:60]
    'ampscaler: at loss scale 1, 3 measured iteration(s) had ever'
"""

from __future__ import annotations

import warnings

__all__ = ["FLUSHED_READING", "GradientsFlushedWarning", "flushed_message", "warn_flushed"]

#: The name ``metrics()`` reports the count under.
FLUSHED_READING = "flushed_measurements"


class GradientsFlushedWarning(RuntimeWarning):
    """Every measured gradient of an iteration was zero in float16: the scale did not help."""


def flushed_message(scale: float, count: int) -> str:
    """What happened, and what to do."""
    return (
        f"ampscaler: at loss scale {scale:g}, {count} measured iteration(s) had every gradient "
        "flushed to zero in float16.\n"
        "Before anything was measured such a step is skipped (it would apply zeros; "
        "scaler.attempts() runs the batch again) and HeadroomPolicy raises the scale by "
        "2**16; later ones step on zeros. If this goes on, the loss is too small for "
        "float16 at the scales the run reaches: multiply the loss by a constant (and, for SGD, "
        "divide the learning rate by it), start higher (HeadroomPolicy(first_scale=2.0**16)), "
        "or train in bfloat16."
    )


def warn_flushed(scale: float, count: int, stacklevel: int = 2) -> None:
    """Warn with :func:`flushed_message` (a :class:`GradientsFlushedWarning`), from the frame
    ``stacklevel`` calls up (``2``: the caller's caller)."""
    warnings.warn(flushed_message(scale, count), GradientsFlushedWarning, stacklevel=stacklevel)
