"""Where step records go: memory, a JSONL file, TensorBoard, Python ``logging``.

A sink is any object with ``write(record)`` (the :class:`Sink` protocol); attach it with
``scaler.attach(sink)`` and it receives a :class:`~ampscaler.StepRecord` at the end of every
``update()``. Attaching a sink makes ``update()`` read the step's outcome from the device: one
host sync per iteration.

Example:
    >>> import logging, tempfile, torch
    >>> from ampscaler import GradScaler, JsonlSink, LoggingSink, StepHistory
    >>> scaler = GradScaler("cpu")
    >>> history = scaler.attach(StepHistory(1000))       # history.records reads it
    >>> folder = tempfile.mkdtemp()
    >>> jsonl = scaler.attach(JsonlSink(f"{folder}/steps.jsonl"))
    >>> logged = scaler.attach(LoggingSink("train.scaler", level=logging.DEBUG))
    >>> # TensorBoard (pip install 'ampscaler[tensorboard]'):
    >>> # scaler.attach(TensorBoardSink("runs/exp1"))
    >>> jsonl.close()
"""

from __future__ import annotations

import logging
import math
import sys
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import InvalidConfigError, SinkError
from ..policy.base import pow2_exponent, require_int, require_number
from .localize import process_rank
from .records import StepRecord

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = ["JsonlSink", "LoggingSink", "Sink", "StepHistory", "TensorBoardSink"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(record)``: what ``scaler.attach()`` takes."""

    def write(self, record: StepRecord) -> None:
        """Take one step record (called at the end of ``update()``)."""


class StepHistory:
    """Keeps the last ``maxlen`` step records in memory.

    Attach it with ``history = scaler.attach(StepHistory(N))`` and read ``history.records``.
    Copies of a scaler keep it (with its records), unlike other sinks.

    Args:
        maxlen: how many records to keep; older ones are dropped.

    Raises:
        InvalidConfigError: (a ``ValueError``) ``maxlen`` is not an int >= 1.

    Example:
        >>> history = StepHistory(2)
        >>> for step in range(3):
        ...     history.write(StepRecord(step, 8.0, 8.0, skipped=False, time=0.0))
        >>> [record.step for record in history.records]
        [1, 2]
    """

    def __init__(self, maxlen: int) -> None:
        # The longest history a deque can hold: its ``maxlen`` is a C ``Py_ssize_t``.
        self._maxlen = require_int("StepHistory maxlen", maxlen, 1, sys.maxsize)
        self._records: deque[StepRecord] = deque(maxlen=self._maxlen)

    @property
    def maxlen(self) -> int:
        """How many records are kept at most."""
        return self._maxlen

    @property
    def records(self) -> list[StepRecord]:
        """The kept records, oldest first (a copy)."""
        return list(self._records)

    def write(self, record: StepRecord) -> None:
        """Keep ``record``, dropping the oldest one when full."""
        self._records.append(record)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"StepHistory({self._maxlen})"


class JsonlSink:
    """Writes each step record as one line of JSON (format: :mod:`ampscaler.observe.records`).

    The file is opened (and its folder created) at construction, so a bad path fails before
    training starts; each line is flushed as it is written, so a crashed run keeps its log.
    Read it back with :func:`ampscaler.read_log` or plot it with
    ``python -m ampscaler report LOG.jsonl --out DIR``.

    Args:
        path: the file to write.
        append: add to an existing log (resuming a run) instead of replacing it.

    Raises:
        SinkError: (an ``OSError``) the path cannot be opened for writing.

    Example:
        >>> import tempfile
        >>> from ampscaler import GradScaler, JsonlSink
        >>> scaler = GradScaler("cpu")
        >>> with JsonlSink(f"{tempfile.mkdtemp()}/steps.jsonl") as sink:
        ...     _ = scaler.attach(sink)
        ...     # ... train ...
    """

    def __init__(self, path: str | Path, *, append: bool = False) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a" if append else "w", encoding="utf-8")
        except OSError as error:
            raise SinkError(
                f"Cannot open the step log {str(self.path)!r} for writing "
                f"({error.strerror or error}); pass a file path in a writable folder."
            ) from error

    def write(self, record: StepRecord) -> None:
        """Append ``record`` as one line and flush it.

        Raises:
            SinkError: (an ``OSError``) the file cannot be written (a full disk).
            ValueError: the sink was closed.
        """
        line = record.to_json_line()
        if self._file.closed:
            raise ValueError(
                f"{self!r} was closed and cannot write step {record.step}: remove it with "
                "scaler.detach(sink) before closing it, or close it after training."
            )
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as error:
            raise SinkError(
                f"Cannot write to the step log {str(self.path)!r} ({error.strerror or error})."
            ) from error

    def close(self) -> None:
        """Close the file (records written after this raise a ``ValueError`` naming it)."""
        self._file.close()

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *raised: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


class TensorBoardSink:
    """Writes step records as TensorBoard scalars (and overflow reports as text).

    Tags, under ``prefix`` (default ``ampscaler``): ``scale``, ``skipped`` (0 or 1), and on
    probed steps ``probe/underflow_at_scale``, ``probe/underflow_at_one``,
    ``probe/headroom_log2`` (when finite) and ``probe/module/<name>`` for the worst modules;
    text ``overflow`` on skipped steps. The global step is the record's ``step``.

    Args:
        log_dir: the run's folder, as for ``SummaryWriter`` (``None``: ``runs/<date>...``).
        writer: an existing ``torch.utils.tensorboard.SummaryWriter`` to share instead
            (not closed by :meth:`close`).
        prefix: the tag prefix.

    Raises:
        ImportError: the ``tensorboard`` package is missing
            (``pip install 'ampscaler[tensorboard]'``).
        SinkError: (an ``OSError``) ``log_dir`` cannot be created.

    Example:
        >>> import tempfile
        >>> from ampscaler import GradScaler, TensorBoardSink
        >>> scaler = GradScaler("cpu")
        >>> sink = scaler.attach(TensorBoardSink(tempfile.mkdtemp()))
        >>> sink.close()
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        writer: SummaryWriter | None = None,
        prefix: str = "ampscaler",
    ) -> None:
        if writer is not None and log_dir is not None:
            raise ValueError("Pass TensorBoardSink either log_dir or writer, not both.")
        self._owns_writer = writer is None
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    "TensorBoardSink needs the tensorboard package: "
                    "pip install 'ampscaler[tensorboard]'."
                ) from error
            try:
                writer = SummaryWriter(log_dir=None if log_dir is None else str(log_dir))
            except OSError as error:
                raise SinkError(
                    f"Cannot create the TensorBoard log folder {str(log_dir)!r} "
                    f"({error.strerror or error}); pass a folder that can be created."
                ) from error
        self.writer = writer
        self.prefix = prefix

    def write(self, record: StepRecord) -> None:
        """Add ``record``'s scalars at global step ``record.step``."""
        tag, step, add = self.prefix, record.step, self.writer.add_scalar
        add(f"{tag}/scale", record.scale, step)
        add(f"{tag}/skipped", float(record.skipped), step)
        if record.overflow is not None:
            self.writer.add_text(f"{tag}/overflow", str(record.overflow), step)
        probe = record.probe
        if probe is not None:
            add(f"{tag}/probe/underflow_at_scale", probe.underflow_at_scale, step)
            add(f"{tag}/probe/underflow_at_one", probe.underflow_at_one, step)
            if math.isfinite(probe.headroom_log2):
                add(f"{tag}/probe/headroom_log2", probe.headroom_log2, step)
            for name, fraction in probe.modules.items():
                add(f"{tag}/probe/module/{name}", fraction, step)

    def flush(self) -> None:
        """Write pending events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush, and close the writer if this sink created it."""
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


class LoggingSink:
    """Sends step records to a Python logger: a line per step, or a summary per ``every`` steps.

    Per step (the default): skipped steps log at ``WARNING`` (with the overflow report), scale
    changes, spike skips and probe results at ``INFO``, other steps at ``level`` (``DEBUG`` by
    default, so an ``INFO`` logger shows only what changed).

    With ``every=N``: one line per ``N`` steps, on rank 0 only when ``torch.distributed`` is
    initialized (``all_ranks=True``: on every rank), at ``INFO`` when fewer than
    ``warn_rate`` of the steps were skipped and ``WARNING`` otherwise::

        steps 2000-2999: 1 skipped (0.1%), scale 2^15 -> 2^16, normal

    so that a long run's log holds the one line that matters instead of a line per skip.
    :meth:`close` logs the steps of a last, shorter period.

    Args:
        logger: a logger or a logger name.
        level: the level of ordinary steps (per-step mode).
        every: steps per summary line (``None``: a line per step).
        all_ranks: in summary mode, log on every rank, not only rank 0.
        warn_rate: in summary mode, the skipped fraction from which a period is not "normal".

    Example:
        >>> from ampscaler import GradScaler, LoggingSink
        >>> scaler = GradScaler("cpu")
        >>> _ = scaler.attach(LoggingSink("train.scaler"))
        >>> _ = scaler.attach(LoggingSink("train.summary", every=1000))

    Raises:
        InvalidConfigError: (a ``ValueError``) ``every`` not an int >= 1, or ``warn_rate``
            outside (0, 1].
    """

    def __init__(
        self,
        logger: logging.Logger | str = "ampscaler",
        *,
        level: int = logging.DEBUG,
        every: int | None = None,
        all_ranks: bool = False,
        warn_rate: float = 0.05,
    ) -> None:
        if not 0 < require_number("warn_rate", warn_rate) <= 1:
            raise InvalidConfigError(f"warn_rate must be in (0, 1], got {warn_rate!r}.")
        self.logger = logging.getLogger(logger) if isinstance(logger, str) else logger
        self.level = level
        self.every = None if every is None else require_int("every", every, 1)
        self.all_ranks = all_ranks
        self.warn_rate = float(warn_rate)
        self._period: list[StepRecord] = []

    def write(self, record: StepRecord) -> None:
        """Log ``record``, or keep it for the period's summary."""
        if self.every is not None:
            self._period.append(record)
            if len(self._period) >= self.every:
                self._summarize()
            return
        changed = record.grew or record.backed_off or record.spike or record.probe is not None
        level = logging.WARNING if record.skipped else logging.INFO if changed else self.level
        self.logger.log(level, "%s", record)

    def _summarize(self) -> None:
        period, self._period = self._period, []
        if not period or not (self.all_ranks or process_rank() in (None, 0)):
            return
        skipped = sum(r.skipped for r in period)
        spikes = sum(r.spike for r in period)
        rate = skipped / len(period)
        normal = rate < self.warn_rate
        text = (
            f"steps {period[0].step}-{period[-1].step}: {skipped} skipped ({rate:.1%}), "
            f"scale {_power(period[0].scale)} -> {_power(period[-1].new_scale)}"
        )
        if spikes:
            text += f", {spikes} skipped by the spike guard"
        text += ", normal" if normal else ", frequent skips"
        self.logger.log(logging.INFO if normal else logging.WARNING, "%s", text)

    def close(self) -> None:
        """Log the summary of a last, shorter period (summary mode); nothing to release."""
        if self.every is not None:
            self._summarize()

    def __repr__(self) -> str:
        every = "" if self.every is None else f", every={self.every}"
        return f"LoggingSink({self.logger.name!r}{every})"


def _power(scale: float) -> str:
    """``2^k`` for a power of two, else the number."""
    exponent = pow2_exponent(scale)
    return f"{scale:g}" if exponent is None else f"2^{exponent}"
