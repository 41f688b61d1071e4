"""Plots of a step log: the scale over steps, skipped steps per window, and probe results.

Used by ``python -m ampscaler report LOG.jsonl --out DIR``; callable from Python too. Needs
matplotlib (``pip install 'ampscaler[report]'``); it draws with the Agg canvas and never touches
pyplot's global state, so it works without a display and inside notebooks alike.

Example:
    >>> import tempfile
    >>> from ampscaler.observe.records import StepRecord
    >>> records = [StepRecord(step=i, scale=2.0**(16 - (i > 5)), new_scale=2.0**(16 - (i >= 5)),
    ...                       skipped=(i == 5), time=0.0) for i in range(10)]
    >>> [p.name for p in render_report(records, tempfile.mkdtemp())]
    ['scale.png', 'skips.png']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .observe.probe import ProbeResult
from .observe.records import StepRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "by_label",
    "default_window",
    "plot_modules",
    "plot_probe",
    "plot_scale",
    "plot_skips",
    "render_report",
    "scale_series",
]

_SKIP_COLOR = "#d62728"


def default_window(steps: int) -> int:
    """A window length giving about 50 bars for ``steps`` steps (at least 1)."""
    return max(1, math.ceil(steps / 50))


def _figure(rows: int = 1) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(8, 3.2 * rows), dpi=100, layout="constrained")


def _step_axis(axes: Axes) -> None:
    """Label the x axis "step", with whole-number ticks only."""
    from matplotlib.ticker import MaxNLocator

    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format="png")
    return path


def by_label(records: Sequence[StepRecord]) -> dict[str | None, list[StepRecord]]:
    """The records of each run in a log, by :attr:`~ampscaler.StepRecord.label`, in the order
    the labels first appear (one run labelled ``None`` for an ordinary scaler's log)."""
    runs: dict[str | None, list[StepRecord]] = {}
    for record in records:
        runs.setdefault(record.label, []).append(record)
    return runs


def scale_series(records: Sequence[StepRecord]) -> tuple[list[int], list[float]]:
    """Steps and the scale each used, then one point past the last step at the scale after
    its update: the line ends where the run's ``get_scale()`` ends."""
    steps = [r.step for r in records] + [records[-1].step + 1]
    return steps, [r.scale for r in records] + [records[-1].new_scale]


def plot_scale(records: Sequence[StepRecord], path: Path) -> Path:
    """The loss scale each step used (log axis), skipped steps marked with crosses; one line per
    labelled run."""
    figure = _figure()
    axes = figure.add_subplot()
    runs = by_label(records)
    for label, run in runs.items():
        steps, scales = scale_series(run)
        name = "loss scale" if label is None else label
        axes.step(steps, scales, where="post", label=name, color=None if label else "#1f77b4")
    skipped = [r for r in records if r.skipped]
    axes.scatter(
        [r.step for r in skipped],
        [r.scale for r in skipped],
        marker="x",
        color=_SKIP_COLOR,
        zorder=3,
        label=f"skipped step ({len(skipped)})",
    )
    axes.set_yscale("log", base=2)
    _step_axis(axes)
    axes.set_ylabel("scale")
    axes.set_title("Loss scale over steps")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="best")
    return _save(figure, path)


def plot_skips(records: Sequence[StepRecord], path: Path, window: int) -> Path:
    """Skipped steps per window of ``window`` steps, as bars."""
    from matplotlib.ticker import MaxNLocator

    first = min(r.step for r in records)
    counts: dict[int, int] = {}
    for record in records:
        start = first + (record.step - first) // window * window
        counts[start] = counts.get(start, 0) + int(record.skipped)
    figure = _figure()
    axes = figure.add_subplot()
    axes.bar(list(counts), list(counts.values()), width=window, align="edge", color=_SKIP_COLOR)
    total = sum(r.skipped for r in records)
    _step_axis(axes)
    axes.set_ylabel(f"skipped per {window} step{'s' if window > 1 else ''}")
    axes.set_title(f"Skipped steps: {total} of {len(records)}")
    axes.set_ylim(bottom=0, top=max(1, *counts.values()) * 1.1)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, axis="y", alpha=0.3)
    return _save(figure, path)


def plot_probe(probes: Sequence[tuple[int, ProbeResult]], path: Path) -> Path:
    """Underflow fractions (at the scale and at scale 1) and headroom, per probed step."""
    figure = _figure(rows=2)
    top, bottom = figure.subplots(2, 1, sharex=True)
    steps = [step for step, _ in probes]
    top.plot(
        steps, [100 * p.underflow_at_one for _, p in probes], marker="o", color=_SKIP_COLOR,
        label="without scaling (scale 1)",
    )
    top.plot(
        steps, [100 * p.underflow_at_scale for _, p in probes], marker="o", color="#2ca02c",
        label="at the loss scale",
    )
    top.set_ylim(bottom=0)
    top.set_ylabel("% of non-zero grads\nflushed to zero in fp16")
    top.set_title("Gradient underflow and headroom (probed steps)")
    top.grid(True, alpha=0.3)
    top.legend(loc="best")
    finite = [(step, p.headroom_log2) for step, p in probes if math.isfinite(p.headroom_log2)]
    bottom.plot([s for s, _ in finite], [h for _, h in finite], marker="o", color="#9467bd")
    overflowed = [step for step, p in probes if not p.headroom_log2 > -math.inf]
    if overflowed:
        bottom.scatter(
            overflowed, [0.0] * len(overflowed), marker="x", color=_SKIP_COLOR, zorder=3,
            label="overflowed (no headroom)",
        )
        bottom.legend(loc="best")
    bottom.axhline(0.0, color=_SKIP_COLOR, linewidth=1, linestyle="--")
    bottom.set_ylabel("headroom\nlog2(65504 / max|g|)")
    _step_axis(bottom)
    bottom.grid(True, alpha=0.3)
    return _save(figure, path)


def plot_modules(step: int, probe: ProbeResult, path: Path) -> Path:
    """The worst modules of one probe: the fraction of fp16 gradients zero or subnormal."""
    names = list(probe.modules)[::-1]
    figure = _figure()
    figure.set_figheight(1.2 + 0.35 * len(names))
    axes = figure.add_subplot()
    axes.barh(names, [100 * probe.modules[n] for n in names], color="#ff7f0e")
    axes.set_xlabel("% of fp16 output gradients that are zero or subnormal")
    axes.set_title(f"Worst modules at step {step} (scale {probe.scale:g})")
    axes.set_xlim(0, 100)
    axes.grid(True, axis="x", alpha=0.3)
    return _save(figure, path)


def render_report(
    records: Sequence[StepRecord], out_dir: str | Path, *, window: int | None = None
) -> list[Path]:
    """Write the report's PNG files into ``out_dir`` (which must exist); returns their paths.

    Always ``scale.png`` (every labelled run on one chart) and ``skips.png``; with probe
    results also ``probe.png``, and ``probe_modules.png`` when the last probe found zero or
    subnormal gradients in watched modules. A log of several labelled runs (the demo's) gets
    the per-run charts once per label, named ``skips-LABEL.png`` and so on.

    Raises:
        ValueError: ``records`` is empty or ``window`` < 1.
        OSError: a file cannot be written.
    """
    if not records:
        raise ValueError("render_report() needs at least one step record.")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}.")
    out = Path(out_dir)
    paths = [plot_scale(records, out / "scale.png")]
    runs = by_label(records)
    for label, run in runs.items():
        suffix = "" if len(runs) == 1 or label is None else f"-{label}"
        paths.append(
            plot_skips(run, out / f"skips{suffix}.png", window or default_window(len(run)))
        )
        probes = [(r.step, r.probe) for r in run if r.probe is not None]
        if probes:
            paths.append(plot_probe(probes, out / f"probe{suffix}.png"))
            step, last = probes[-1]
            if any(fraction > 0 for fraction in last.modules.values()):
                paths.append(plot_modules(step, last, out / f"probe_modules{suffix}.png"))
    return paths
