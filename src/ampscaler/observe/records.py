"""Step records: what one iteration did to the scale, as plain data, and the JSONL log format.

A :class:`StepRecord` is made at the end of every ``update()`` that follows a ``step()`` while
something consumes records (a sink such as :class:`~ampscaler.StepHistory` or
:class:`~ampscaler.JsonlSink`, or an event callback). As JSON, one object per line::

    {"format": "ampscaler.step/1", "step": 41, "time": 1718000000.25, "scale": 65536.0,
     "new_scale": 32768.0, "skipped": true,
     "overflow": {"step": 41, "names": ["fc2.weight"], "kinds": {"fc2.weight": "inf"},
                  "scale": 65536.0, "rank": null, "ranks": [], "origin": null,
                  "cause": "gradients"},
     "probe": null}

``overflow`` is present on skipped steps, ``probe`` on probed ones (see
:mod:`ampscaler.observe.probe`). ``loss`` and ``lr`` are written when a record carries them (the
scaler's records do not; the demo's do). Non-finite numbers are written as the strings
``"inf"``, ``"-inf"`` and ``"nan"`` so that every line is strict JSON. ``"spike": true`` marks
a step a :class:`~ampscaler.SpikeGuard` skipped, ``"flushed": true`` one a
:class:`~ampscaler.HeadroomPolicy` skipped because its gradients all flushed to zero.
``label`` names the run a record belongs to when one log holds several (the demo's arms). A
line may hold other keys; :func:`read_log` ignores them.

:meth:`StepRecord.to_json_line` writes a line and :func:`read_log` reads a log back.

Example:
    >>> record = StepRecord(step=3, scale=1024.0, new_scale=2048.0, skipped=False, time=0.0)
    >>> str(record)
    'step 3: scale 1024, grew to 2048'
    >>> record.to_json_line()[:53]
    '{"format": "ampscaler.step/1", "step": 3, "time": 0.0'
    >>> StepRecord.from_dict(record.as_dict()) == record
    True
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import LogFormatError
from .localize import OverflowReport
from .plain import Plain
from .probe import ProbeResult, flushed_wording

__all__ = ["FORMAT", "StepLog", "StepRecord", "load_log", "read_log"]

FORMAT = "ampscaler.step/1"
_FORMAT_FAMILY = FORMAT.split("/")[0] + "/"


@dataclass(frozen=True)
class StepRecord(Plain):
    """One iteration, as Python values.

    Attributes:
        step: the iteration's number (``stats.steps`` before it was counted, from 0).
        scale: the loss scale its gradients were computed with.
        new_scale: the scale after ``update()``.
        skipped: whether the gradients held inf/NaN, so the optimizer step was skipped.
        time: wall-clock time of the ``update()`` (``time.time()``).
        overflow: on skipped steps, which parameters held inf/NaN.
        probe: on probed steps (a :class:`~ampscaler.GradientProbe` is attached), the underflow
            and headroom measurements.
        loss: the iteration's loss, when the code that made the record knows it (the scaler
            does not; the demo does).
        lr: the learning rate of the iteration, likewise.
        label: which run of a comparison the record belongs to (the demo labels its three
            arms); ``report`` draws the labels of one log side by side.
        spike: whether a guard (:class:`~ampscaler.SpikeGuard`) skipped the step although its
            gradients were finite (``skipped`` stays ``False``: the scale did not back off).
        flushed: whether a measuring policy's meter (:class:`~ampscaler.HeadroomPolicy`)
            skipped the step because every gradient it measured flushed to zero before it had
            measured anything (``skipped`` stays ``False``: the scale is raised, not backed
            off; :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>` runs the batch
            again).
        attempt: which attempt at its batch the iteration was, under
            :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>` (0: the first; a
            record with ``attempt > 0`` follows a skipped record of the same batch).
    """

    step: int
    scale: float
    new_scale: float
    skipped: bool
    time: float
    overflow: OverflowReport | None = None
    probe: ProbeResult | None = None
    loss: float | None = None
    lr: float | None = None
    label: str | None = None
    spike: bool = False
    flushed: bool = False
    attempt: int = 0

    @property
    def grew(self) -> bool:
        """Whether the scale went up in this update."""
        return self.new_scale > self.scale

    @property
    def backed_off(self) -> bool:
        """Whether the scale went down in this update."""
        return self.new_scale < self.scale

    def __str__(self) -> str:
        moved = "grew" if self.grew else "backed off" if self.backed_off else None
        move = f", {moved} to {self.new_scale:g}" if moved else ""
        replay = f" (attempt {self.attempt + 1} at its batch)" if self.attempt else ""
        text = f"step {self.step}{replay}: scale {self.scale:g}{move}"
        if self.skipped:
            text += "; skipped"
            if self.overflow is not None:
                text += f" ({self.overflow})"
        if self.spike:
            text += "; skipped by the spike guard (finite gradients, scale kept)"
        if self.flushed:
            text += "; skipped: every measured gradient flushed to zero (scale raised)"
        if self.probe is not None:
            p = self.probe
            text += (
                f"; probe: {p.underflow_at_scale:.2%} of non-zero parameter gradients underflow "
                f"at this scale, {p.underflow_at_one:.2%} at scale 1, headroom "
                f"2^{p.headroom_log2:.1f}"
            )
            if p.activations is not None:
                text += (
                    f", activation gradients {flushed_wording(p.activation_dtypes)}: "
                    f"{p.activations.flushed_fraction:.2%}"
                )
        return text

    def as_dict(self) -> dict[str, Any]:
        """The record as one JSON object (the JSONL line format, see the module docstring):
        ``loss``, ``lr``, ``label``, ``spike``, ``flushed`` and ``attempt`` only where they are
        set."""
        plain = {"format": FORMAT, "step": self.step, "time": self.time, **super().as_dict()}
        return {key: value for key, value in plain.items() if _UNSET.get(key, _KEPT) != value}

    def to_json_line(self) -> str:
        """The record as one line of the JSONL log, without the newline (strict JSON)."""
        return json.dumps(self.as_dict(), allow_nan=False)


#: The fields a JSON line leaves out when they hold these values.
_UNSET: dict[str, object] = dict(
    loss=None, lr=None, label=None, spike=False, flushed=False, attempt=0
)
_KEPT = object()  # what no value equals

#: What every error reading a log asks for.
_WANTED = "pass a JSONL log written by ampscaler.JsonlSink."


@dataclass(frozen=True)
class StepLog:
    """A step log as read: its records, and whether a last line cut short was left out."""

    records: list[StepRecord]
    cut_short: bool


def read_log(path: str | Path) -> list[StepRecord]:
    """Read the step records of a JSONL log written by :class:`~ampscaler.JsonlSink`.

    Blank lines are ignored, and so is a last line cut short without its newline (a run killed
    while writing; :func:`load_log` says whether there was one).

    Raises:
        OSError: the file cannot be read.
        LogFormatError: (a ``ValueError``) the file is empty or not an ampscaler step log; the
            message names the first bad line.
    """
    return load_log(path).records


def load_log(path: str | Path) -> StepLog:
    """:func:`read_log`, also telling whether a last line cut short was left out.

    Raises:
        OSError: the file cannot be read.
        LogFormatError: (a ``ValueError``) the file is empty or not an ampscaler step log; the
            message names the first bad line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise LogFormatError(f"{path} is not a text file ({error.reason}); {_WANTED}") from error
    lines = text.split("\n")
    records = []
    cut_short = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                cut_short = True  # the last line: the run stopped while writing it
                break
            raise LogFormatError(
                f"{path}, line {number}, is not JSON ({error.msg}); {_WANTED}"
            ) from error
        records.append(_parse(path, number, data))
    if not records and cut_short:
        raise LogFormatError(
            f"{path} is not an ampscaler step log: its only line is not JSON (binary data, "
            f"another format, or a run killed while writing its first record); {_WANTED}"
        )
    if not records:
        raise LogFormatError(
            f"{path} holds no step records (it is empty); records are written at each "
            "scaler.update() once a JsonlSink is attached with scaler.attach()."
        )
    return StepLog(records, cut_short)


def _parse(path: Path, number: int, data: object) -> StepRecord:
    where = f"{path}, line {number},"
    found = data.get("format") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(found, str):
        raise LogFormatError(
            f'{where} is not an ampscaler step record (it has no "format": "{FORMAT}" '
            f"field); {_WANTED}"
        )
    if found != FORMAT:
        newer = (
            " (written by another version of ampscaler)" if found.startswith(_FORMAT_FAMILY) else ""
        )
        raise LogFormatError(f"{where} has format {found!r}{newer}; this version reads {FORMAT!r}.")
    try:
        return StepRecord.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise LogFormatError(
            f"{where} is a damaged ampscaler step record ({type(error).__name__}: {error})."
        ) from error
