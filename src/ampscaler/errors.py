"""Exceptions raised by ampscaler.

Each one subclasses the built-in exception that ``torch.amp.GradScaler`` raises in the same
situation, so code written against torch keeps catching what it caught before, while the
message says what went wrong and what to do about it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .observe.localize import OverflowReport

__all__ = [
    "InvalidConfigError",
    "InvalidStateDictError",
    "LogFormatError",
    "PersistentOverflowError",
    "ScaleFloorWarning",
    "ScalerUsageError",
    "SinkError",
    "SinkWarning",
    "warn_at_caller",
]


class InvalidConfigError(ValueError, AssertionError):
    """An argument that makes no sense for a loss scaler (``growth_factor=0.9``, ...).

    A :class:`ValueError` as users expect, and an :class:`AssertionError` because that is what
    ``torch.amp.GradScaler`` raises for the arguments it checks.
    """


class ScalerUsageError(RuntimeError, AssertionError):
    """A call made in an order the scaler cannot honour (``step()`` before ``scale()``, ...).

    torch raises :class:`RuntimeError` for some wrong orders and :class:`AssertionError` for
    others; this class is both, so an ``except`` written for torch's scaler still matches.
    """


class InvalidStateDictError(KeyError, ValueError):
    """A ``state_dict`` that is not a loss scaler's, or whose values are out of range."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class PersistentOverflowError(RuntimeError):
    """Raised when ``max_consecutive_skips`` steps in a row held inf or NaN gradients.

    Skipping forever is the failure mode this replaces: training that looks alive while no
    parameter moves. The message says how many steps were skipped, the current scale, whether
    the gradients held inf or NaN, which parameters were affected when known, and what usually
    helps for the cause of the latest skip (:attr:`OverflowReport.cause
    <ampscaler.OverflowReport.cause>`): a loss already inf/NaN before scaling, or gradients that
    overflowed.

    Attributes:
        cause: the latest skip's cause, ``"loss"`` or ``"gradients"`` (``None``: unknown).
    """

    cause: str | None = None

    @classmethod
    def after(
        cls, in_a_row: int, limit: int, scale: float, report: OverflowReport | None
    ) -> PersistentOverflowError:
        """The error for ``in_a_row`` skipped steps (``limit`` allowed) at ``scale``, with
        what ``report`` says of the latest one."""
        found = report.kinds.values() if report is not None else ()
        kinds = {part for kind in found for part in kind.split("+")}
        spelled = [word for kind, word in (("inf", "inf"), ("nan", "NaN")) if kind in kinds]
        held = " and ".join(spelled) if spelled else "inf/NaN"
        nan_hint = (
            " NaN that persists at a small scale is a bug in the model or the data (a log of "
            "0, a division by zero, a bad sample), not an overflow: look there first."
            if "nan" in kinds
            else ""
        )
        where = f" Affected: {report}." if report is not None and report.names else ""
        cause = None if report is None else report.cause
        error = cls(
            f"{in_a_row} optimizer steps in a row were skipped because the gradients held "
            f"{held} (max_consecutive_skips={limit}); the scale is now {scale:g}.{where}"
            f"{nan_hint} {_ADVICE[cause]}"
        )
        error.cause = cause
        return error


_ADVICE = {
    "loss": (
        "The loss itself was already inf/NaN before it was scaled, so lowering the scale cannot "
        "help: check the inputs for inf/NaN, look for activations that exceed float16's 65504 "
        "(attention logits, large residuals: keep them in float32 or rescale them), or lower "
        "the learning rate if the loss diverged."
    ),
    "gradients": (
        "The loss was finite and the scaled gradients overflowed: start lower (init_scale) or "
        "keep the scale from falling further (min_scale), and lower the learning rate or clip "
        "gradients after scaler.unscale_() if the gradients themselves grow; bfloat16 needs "
        "no scaling at all."
    ),
    None: (
        "What usually helps: a lower learning rate or warm-up, gradient clipping after "
        "scaler.unscale_(), checking the loss for inf/NaN before backward(), or training in "
        "bfloat16, whose range needs no scaling."
    ),
}


class ScaleFloorWarning(RuntimeWarning):
    """The scale reached its floor, ``2**-126``, where backing off cannot go further.

    Issued once per scaler, the first time the scale reaches the floor (see
    :class:`~ampscaler.CollapseWatch`), before any step runs there on the non-fused path; a
    scale that leaves the floor and comes back calls the ``"collapse"`` callbacks again, but
    does not warn again. The message says how many steps in a row were skipped
    and in how many of them the loss itself was already inf/NaN (then lowering the scale never
    could help). To stop a run there instead of training on at a scale where float16 gradients
    underflow: ``warnings.simplefilter("error", ampscaler.ScaleFloorWarning)``.
    """


class SinkError(OSError):
    """A telemetry sink could not open or write its destination (a JSONL path, a log dir).

    An :class:`OSError`, as the failed ``open()`` underneath; the message names the path.
    """


class SinkWarning(RuntimeWarning):
    """A sink's ``write`` or an event callback raised: it is reported once with this warning,
    and the other sinks and callbacks are still served (a full disk under a
    :class:`~ampscaler.JsonlSink` starves neither TensorBoard nor the callbacks).

    To stop training on the first failure instead:
    ``warnings.simplefilter("error", ampscaler.SinkWarning)``.
    """


class LogFormatError(ValueError):
    """A step log that ampscaler cannot read: empty, or not written by ampscaler."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn, pointing at the innermost caller outside ampscaler (the training loop's line),
    whichever of the scaler's calls found it."""
    frame = sys._getframe(1)  # the caller: warnings.warn's stacklevel 2
    level = 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
