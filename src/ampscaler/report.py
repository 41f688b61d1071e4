"""Plots of a step log: the scale over steps, skipped steps per window, and what the probe measured.

Used by ``python -m ampscaler report LOG.jsonl [LOG.jsonl ...]``; callable from Python too. Needs
matplotlib (``pip install 'ampscaler[report]'``); it draws with the Agg canvas and never touches
pyplot's global state, so it works without a display and inside notebooks alike.

What each chart shows, and the file it goes to (a log of several labelled runs, like the demo's,
gets the per-run charts once per run, named ``skips-LABEL.png`` and so on, each titled with its
run's label):

- ``scale.png``: the loss scale of every run over steps, skipped steps marked. A run whose scale
  stayed 1 and that skipped nothing ran without a loss scaler (the demo's ``fp32`` and
  ``fp16_no_scaling`` arms): it is named in the legend, not drawn, so that it neither hides
  under another line nor stretches the axis down to 1.
- ``skips.png``: skipped steps per window, for runs with a loss scaler.
- ``probe.png``, for runs that probed (:class:`~ampscaler.GradientProbe`), up to three panels:
  the *activation gradients* (the output gradients of the watched modules, where fp16 flushes
  them: the measure of ``python -m ampscaler demo``'s table, and the same number), the
  *parameter gradients* (what the optimizer gets: the share of their elements that is zero in
  fp16, at the loss scale and without it) and the headroom to fp16's largest number.
- ``probe_modules.png``: the activation gradients per watched module over the run's probes:
  flushed to zero, and zero or subnormal. Left out (with a note) when none was either.

Example:
    >>> import tempfile
    >>> from ampscaler.observe.records import StepRecord
    >>> records = [StepRecord(step=i, scale=2.0**(16 - (i > 5)), new_scale=2.0**(16 - (i >= 5)),
    ...                       skipped=(i == 5), time=0.0) for i in range(10)]
    >>> [p.name for p in render_report(records, tempfile.mkdtemp())]
    ['scale.png', 'skips.png']
    >>> report_summary(records)
    ['10 steps, 1 skipped, final scale 32768']
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .observe.probe import ProbeResult, UnderflowCounts, flushed_wording
from .observe.records import StepRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "activation_counts",
    "by_label",
    "default_window",
    "has_scaler",
    "module_counts",
    "parameter_zeros",
    "percent",
    "plot_modules",
    "plot_probe",
    "plot_scale",
    "plot_skips",
    "render_report",
    "report_notes",
    "report_summary",
    "scale_figure",
    "scale_series",
]

_SKIP_COLOR = "#d62728"
_SUBNORMAL_COLOR = "#ff7f0e"
_SCALED_COLOR = "#2ca02c"
_MODULES_SHOWN = 10
_DIGITS = re.compile(r"(\d+)")
Probes = Sequence[tuple[int, ProbeResult]]
"""Probe results with the step each was measured at."""


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


def _titled(label: str | None, title: str) -> str:
    """``title``, prefixed by the run's label when it has one."""
    return title if label is None else f"{label}: {title[0].lower()}{title[1:]}"


def by_label(records: Sequence[StepRecord]) -> dict[str | None, list[StepRecord]]:
    """The records of each run in a log, by :attr:`~ampscaler.StepRecord.label`, in the order
    the labels first appear (one run labelled ``None`` for an ordinary scaler's log)."""
    runs: dict[str | None, list[StepRecord]] = {}
    for record in records:
        runs.setdefault(record.label, []).append(record)
    return runs


def has_scaler(run: Sequence[StepRecord]) -> bool:
    """Whether ``run`` was scaled: its scale was other than 1 at some step, or it skipped one.

    A run at scale 1 throughout that never skipped either had no loss scaler (the demo's
    ``fp32`` and ``fp16_no_scaling`` arms) or one that never did anything; a skip chart or a
    scale line says nothing about it.
    """
    return any(r.scale != 1.0 or r.new_scale != 1.0 or r.skipped or r.spike for r in run)


def scale_series(records: Sequence[StepRecord]) -> tuple[list[int], list[float]]:
    """Steps and the scale each used, then one point past the last step at the scale after
    its update: the line ends where the run's ``get_scale()`` ends."""
    steps = [r.step for r in records] + [records[-1].step + 1]
    return steps, [r.scale for r in records] + [records[-1].new_scale]


def _probes(run: Sequence[StepRecord]) -> list[tuple[int, ProbeResult]]:
    return [(r.step, r.probe) for r in run if r.probe is not None]


def _activations(probe: ProbeResult) -> UnderflowCounts | None:
    """All watched modules' counts of one probe (a log older than the ``activations`` field:
    the counts of the modules it kept)."""
    if probe.activations is not None:
        return probe.activations
    if probe.module_counts:
        return sum(probe.module_counts.values(), UnderflowCounts())
    return None


def activation_counts(probes: Probes) -> UnderflowCounts | None:
    """The activation-gradient counts of all ``probes`` together (``None``: no probe measured
    modules). Its :attr:`~ampscaler.UnderflowCounts.flushed_fraction` is the number
    ``python -m ampscaler demo`` prints in its table for the same run.

    Example:
        >>> one = ProbeResult(1.0, 0, 0, 0.0, 0.0, math.inf,
        ...                   activations=UnderflowCounts(10, 9, 8))
        >>> activation_counts([(0, one), (25, one)])
        UnderflowCounts(carrying_signal=20, underflowed=18, flushed=16)
    """
    counted = [c for c in (_activations(p) for _, p in probes) if c is not None]
    return sum(counted, UnderflowCounts()) if counted else None


def _dtypes(probes: Probes) -> list[str]:
    return sorted({dtype for _, p in probes for dtype in p.activation_dtypes})


def module_counts(probes: Probes) -> dict[str, UnderflowCounts]:
    """Each watched module's counts summed over ``probes`` (the modules each probe kept),
    in the order they first appear."""
    totals: dict[str, UnderflowCounts] = {}
    for _, probe in probes:
        for name, counts in probe.module_counts.items():
            totals[name] = totals.get(name, UnderflowCounts()) + counts
    return totals


def parameter_zeros(probe: ProbeResult) -> tuple[float, float]:
    """Of all the parameter-gradient elements a probe examined, the shares that are zero in
    fp16 at the loss scale and without loss scaling (divided by the scale).

    Zero either way: flushed on the way back, or zero in fp32 as well (the probe has no
    reference for parameter gradients). Unlike :attr:`~ampscaler.ProbeResult.underflow_at_one`
    (a share of the *non-zero* elements), these count what was already flushed, so a run without
    loss scaling shows its loss here. ``(0.0, 0.0)`` when the probe examined none.

    Example:
        >>> parameter_zeros(ProbeResult(scale=1024.0, elements=10, nonzero=8,
        ...                             underflow_at_scale=0.0, underflow_at_one=0.5,
        ...                             headroom_log2=3.0))
        (0.2, 0.6)
    """
    if not probe.elements:
        return 0.0, 0.0
    zeros = probe.elements - probe.nonzero
    return (
        (zeros + probe.underflow_at_scale * probe.nonzero) / probe.elements,
        (zeros + probe.underflow_at_one * probe.nonzero) / probe.elements,
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def percent(fraction: float) -> str:
    """A share as the report and the demo's table write it: one decimal, 2 significant digits
    below 0.1% so that a small share does not read as 0, and as many decimals as it takes
    above 99.9% so that a share short of all does not read as 100%.

    Example:
        >>> percent(0.865), percent(0.0000012), percent(0.0), percent(0.9999), percent(1.0)
        ('86.5%', '0.00012%', '0.0%', '99.99%', '100.0%')
    """
    if 0.999 < fraction < 1.0:
        short = 100 * (1.0 - fraction)  # what is missing, in percent: one significant digit
        return f"{100 * fraction:.{max(1, -math.floor(math.log10(short) + 1e-9))}f}%"
    if fraction == 0.0 or fraction >= 0.001:
        return f"{fraction:.1%}"
    return f"{100 * fraction:.2g}%"


# ---------------------------------------------------------------------- the charts


def plot_scale(records: Sequence[StepRecord], path: Path) -> Path:
    """Save :func:`scale_figure` of ``records`` as a PNG at ``path``."""
    return _save(scale_figure(records), path)


def scale_figure(records: Sequence[StepRecord]) -> Figure:
    """The loss scale each step used (log axis), skipped steps marked with crosses; one line per
    labelled run with a loss scaler (:func:`has_scaler`). Runs without one are named in the
    legend and not drawn (all are drawn when none has a scaler), so that the axis spans the
    scales that moved. The title names the run when one is drawn."""
    from matplotlib.lines import Line2D

    figure = _figure()
    axes = figure.add_subplot()
    runs = by_label(records)
    drawn = {label: run for label, run in runs.items() if has_scaler(run)} or runs
    for label, run in drawn.items():
        steps, scales = scale_series(run)
        name = "loss scale" if label is None else label
        axes.step(steps, scales, where="post", label=name, color=None if label else "#1f77b4")
    skipped = [r for run in drawn.values() for r in run if r.skipped]
    axes.scatter(
        [r.step for r in skipped],
        [r.scale for r in skipped],
        marker="x",
        color=_SKIP_COLOR,
        zorder=3,
        label=f"skipped step ({len(skipped)})",
    )
    handles, labels = axes.get_legend_handles_labels()
    unscaled = [str(label) for label in runs if label not in drawn]
    if unscaled:
        handles.append(Line2D([], [], linestyle="none"))
        labels.append(f"not drawn, no loss scaling (scale 1):\n{', '.join(unscaled)}")
    axes.set_yscale("log", base=2)
    _step_axis(axes)
    axes.set_ylabel("loss scale")
    only = next(iter(drawn)) if len(drawn) == 1 else None
    axes.set_title(_titled(only, "Loss scale over steps"))
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(handles, labels, loc="best")
    return figure


def plot_skips(
    records: Sequence[StepRecord], path: Path, window: int, label: str | None = None
) -> Path:
    """Skipped steps per window of ``window`` steps, as bars; the title names the run
    ``label``."""
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
    axes.set_title(_titled(label, f"Skipped steps: {total} of {len(records)}"))
    axes.set_ylim(bottom=0, top=max(1, *counts.values()) * 1.1)
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, axis="y", alpha=0.3)
    return _save(figure, path)


def _plot_activations(axes: Axes, probes: Probes) -> None:
    measured = [(step, c) for step, c in ((s, _activations(p)) for s, p in probes) if c]
    steps = [step for step, _ in measured]
    flushed = [100 * c.flushed_fraction for _, c in measured]
    small = [100 * c.fraction for _, c in measured]
    wording = flushed_wording(_dtypes(probes))
    axes.plot(steps, flushed, marker="o", color=_SKIP_COLOR, label=wording)
    axes.plot(
        steps,
        small,
        marker="s",
        color=_SUBNORMAL_COLOR,
        linestyle="--",  # dashed on top
        label="zero or subnormal in fp16 (|g| < 2^-14)",
    )
    total = activation_counts(probes)
    assert total is not None  # the caller checked that some probe measured modules
    axes.set_title(
        f"Activation gradients (watched modules' outputs): {percent(total.flushed_fraction)} "
        f"{wording} over the run",
        fontsize="medium",
    )
    axes.set_ylim(0, max(1.0, *flushed, *small) * 1.15)
    axes.set_ylabel("% of the elements\ncarrying signal")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")


def _plot_parameters(axes: Axes, probes: Probes) -> None:
    steps = [step for step, _ in probes]
    shares = [parameter_zeros(p) for _, p in probes]
    at_one = [100 * one for _, one in shares]
    if all(p.scale == 1.0 for _, p in probes):
        axes.plot(
            steps,
            at_one,
            marker="o",
            color=_SKIP_COLOR,
            label="zero in fp16 (no loss scaling: scale 1)",
        )
    else:
        axes.plot(
            steps,
            at_one,
            marker="o",
            color=_SKIP_COLOR,
            linestyle="--",
            label="zero in fp16 without loss scaling (scale 1)",
        )
        axes.plot(
            steps,
            [100 * at for at, _ in shares],
            marker="o",
            color=_SCALED_COLOR,
            label="zero in fp16 at the loss scale",
        )
    axes.set_title(
        "Parameter gradients (what the optimizer gets): zero in fp16, flushed or zero in fp32 too",
        fontsize="medium",
    )
    axes.set_ylim(0, max(1.0, *at_one) * 1.15)
    axes.set_ylabel("% of parameter-\ngradient elements")
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")


def _plot_headroom(axes: Axes, probes: Probes) -> None:
    finite = [(step, p.headroom_log2) for step, p in probes if math.isfinite(p.headroom_log2)]
    axes.plot(
        [s for s, _ in finite],
        [h for _, h in finite],
        marker="o",
        color="#9467bd",
        label="headroom",
    )
    overflowed = [step for step, p in probes if not p.headroom_log2 > -math.inf]
    if overflowed:
        axes.scatter(
            overflowed,
            [0.0] * len(overflowed),
            marker="x",
            color=_SKIP_COLOR,
            zorder=3,
            label="overflowed (no headroom)",
        )
        axes.legend(loc="best", fontsize="small")
    axes.axhline(0.0, color=_SKIP_COLOR, linewidth=1, linestyle="--")
    axes.set_title(
        "Headroom: how often the scale could double before the largest parameter gradient "
        "overflows fp16",
        fontsize="medium",
    )
    axes.set_ylabel("log2(65504 / max|g|)")
    axes.grid(True, alpha=0.3)


def plot_probe(probes: Probes, path: Path, label: str | None = None) -> Path | None:
    """What the probe measured at each probed step, one panel each: the activation gradients
    flushed to zero (when modules were watched), the parameter gradients that are zero in fp16
    and the headroom (when the optimizer's gradients were measured). ``None``, and no file,
    when the probes measured neither."""
    with_parameters = [(step, p) for step, p in probes if p.elements]
    panels = [
        *([(_plot_activations, probes)] if activation_counts(probes) is not None else []),
        *(
            [(_plot_parameters, with_parameters), (_plot_headroom, with_parameters)]
            if with_parameters
            else []
        ),
    ]
    if not panels:
        return None
    figure = _figure(rows=len(panels))
    grid = figure.subplots(len(panels), 1, sharex=True, squeeze=False)
    for axes, (panel, measured) in zip(grid[:, 0], panels, strict=True):
        panel(axes, measured)
    _step_axis(grid[-1, 0])
    figure.suptitle(_titled(label, f"Gradient underflow ({_count(len(probes), 'probed step')})"))
    return _save(figure, path)


def _module_shares(probes: Probes) -> dict[str, tuple[float, float]]:
    """Per watched module, the shares flushed and zero or subnormal over ``probes``; from a log
    older than the counts, the last probe's zero-or-subnormal shares (flushed: NaN)."""
    totals = module_counts(probes)
    if totals:
        return {name: (c.flushed_fraction, c.fraction) for name, c in totals.items()}
    last = probes[-1][1].modules if probes else {}
    return {name: (math.nan, fraction) for name, fraction in last.items()}


def _name_order(name: str) -> tuple[tuple[int, str], ...]:
    """Sorts module names with the numbers in them compared as numbers."""
    parts = _DIGITS.split(name)  # text, number, text, ...: the numbers at the odd places
    return tuple((int(part), "") if i % 2 else (-1, part) for i, part in enumerate(parts))


def shown_modules(shares: dict[str, tuple[float, float]]) -> list[str]:
    """The modules a per-module chart shows: the worst (by zero-or-subnormal share, then
    flushed), at most ten, in one order for every chart: by name, the numbers in the names
    compared as numbers (``layers.2`` before ``layers.10``; the demo's ``hidden1`` to
    ``output``, the model's order).

    A log does not hold the model's order: each probe lists its modules worst first, so the
    order they first appear in differs from run to run.

    Example:
        >>> shown_modules({"out": (0.0, 0.0), "fc10": (0.5, 0.9), "fc2": (0.1, 0.2)})
        ['fc2', 'fc10', 'out']
    """
    worst = sorted(shares, key=lambda name: shares[name][::-1], reverse=True)[:_MODULES_SHOWN]
    return sorted(worst, key=_name_order)


def plot_modules(probes: Probes, path: Path, label: str | None = None) -> Path | None:
    """The watched modules' activation gradients over ``probes``: the share flushed to zero
    and the share zero or subnormal, for the worst modules, with each value written at its
    bar. The axis runs to 100% unless every share is below 10%; then it runs a little past the
    largest (the axis label says so), so that small shares still show. ``None``, and no file,
    when no module had a zero or subnormal gradient.

    A log older than the per-module counts has only the last probe's zero-or-subnormal shares;
    those are drawn alone.
    """
    shares = _module_shares(probes)
    shown = shown_modules(shares)
    if not any(shares[name][1] > 0 for name in shown):
        return None
    names = shown[::-1]  # barh draws bottom-up: the model's first module on top
    counted = bool(module_counts(probes))
    series = [("zero or subnormal in fp16 (|g| < 2^-14)", 1, _SUBNORMAL_COLOR)]
    if counted:  # the flushed bar above the subnormal one, in each module's row
        series.insert(0, (flushed_wording(_dtypes(probes)), 0, _SKIP_COLOR))
    height = 0.8 / len(series)
    figure = _figure()
    figure.set_figheight(1.8 + 0.3 * len(names) * len(series))
    axes = figure.add_subplot()
    for place, (text, index, color) in enumerate(series):
        values = [100 * shares[name][index] for name in names]
        offset = 0.4 - height / 2 - place * height
        bars = axes.barh(
            [row + offset for row in range(len(names))],
            values,
            height=height,
            color=color,
            label=text,
        )
        axes.bar_label(bars, labels=[percent(v / 100) for v in values], padding=3, fontsize="small")
    axes.set_yticks(range(len(names)), names)
    largest = max(100 * shares[name][1] for name in names)
    full = largest >= 10.0
    axes.set_xlim(0, 112 if full else largest * 1.3)  # room for the values at the bars' ends
    if full:
        axes.set_xticks(range(0, 101, 20))
    axes.set_xlabel(
        "% of each module's output-gradient elements carrying signal"
        + ("" if full else f" (at most {percent(largest / 100)}: the axis is zoomed in)")
    )
    where = f"over {_count(len(probes), 'probed step')}" if counted else f"at step {probes[-1][0]}"
    axes.set_title(_titled(label, f"Activation gradients per module, {where}"))
    axes.grid(True, axis="x", alpha=0.3)
    figure.legend(loc="outside lower center", ncols=len(series), fontsize="small")
    return _save(figure, path)


# ---------------------------------------------------------------------- the report


def _file_suffix(runs: dict[str | None, list[StepRecord]], label: str | None) -> str:
    """``""`` for a log of one run, else ``-LABEL`` with characters unsafe in file names
    replaced."""
    if len(runs) == 1 or label is None:
        return ""
    return "-" + re.sub(r"[^A-Za-z0-9._-]", "_", label)


def render_report(
    records: Sequence[StepRecord], out_dir: str | Path, *, window: int | None = None
) -> list[Path]:
    """Write the report's PNG files into ``out_dir`` (which must exist); returns their paths.

    ``scale.png`` (every labelled run on one chart); per run: ``skips.png`` when it had a loss
    scaler (:func:`has_scaler`), and when it probed ``probe.png`` and, when some watched
    module's gradients were zero or subnormal, ``probe_modules.png``. A log of several labelled
    runs (the demo's) gets the per-run files once per label, named ``skips-LABEL.png`` and so
    on. :func:`report_notes` says which charts were left out and why.

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
        suffix = _file_suffix(runs, label)
        if has_scaler(run):
            paths.append(
                plot_skips(
                    run, out / f"skips{suffix}.png", window or default_window(len(run)), label
                )
            )
        probes = _probes(run)
        if probes:
            drawn = [
                plot_probe(probes, out / f"probe{suffix}.png", label),
                plot_modules(probes, out / f"probe_modules{suffix}.png", label),
            ]
            paths += [path for path in drawn if path is not None]
    return paths


def report_summary(records: Sequence[StepRecord]) -> list[str]:
    """One line per run: its steps, skips and final scale (or that it ran without a loss
    scaler) and, when it probed modules, the share of activation gradients flushed to zero
    (the number in ``python -m ampscaler demo``'s table, written the same way).

    Example:
        >>> report_summary([StepRecord(step=0, scale=1.0, new_scale=1.0, skipped=False,
        ...                            time=0.0, label="fp32")])
        ['fp32: 1 step, no loss scaling (scale 1 throughout, nothing skipped)']
    """
    lines = []
    for label, run in by_label(records).items():
        line = ("" if label is None else f"{label}: ") + _count(len(run), "step")
        if has_scaler(run):
            line += f", {sum(r.skipped for r in run)} skipped, final scale {run[-1].new_scale:g}"
        else:
            line += ", no loss scaling (scale 1 throughout, nothing skipped)"
        probes = _probes(run)
        counts = activation_counts(probes)
        if counts is not None:
            line += (
                f"; activation gradients {flushed_wording(_dtypes(probes))}: "
                f"{percent(counts.flushed_fraction)} over {_count(len(probes), 'probed step')}"
            )
        lines.append(line)
    return lines


def report_notes(records: Sequence[StepRecord]) -> list[str]:
    """Which of :func:`render_report`'s charts were left out for which run, and why."""
    notes = []
    for label, run in by_label(records).items():
        run_name = "" if label is None else f"{label}: "
        if not has_scaler(run):
            notes.append(f"{run_name}no skips chart: it ran without loss scaling")
        shares = _module_shares(_probes(run))
        if shares and not any(small > 0 for _, small in shares.values()):
            notes.append(
                f"{run_name}no module chart: no watched module's gradient was zero or subnormal"
            )
    return notes
