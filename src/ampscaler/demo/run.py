"""Running the whole demo: three arms with progress bars, then files a person can look at.

:func:`run_demo` trains the arms of :func:`~ampscaler.demo.standard_arms` with
``ampscaler.GradScaler`` in the scaled arm (and with ``policy="headroom"`` a fourth,
``fp16_headroom``: ``ampscaler.GradScaler(policy=HeadroomPolicy())``), and writes into one
folder:

- ``summary.json``: ``{"arms": {"fp32": {...}, "fp16_no_scaling": {...}, "fp16_ampscaler":
  {...}}, "config": {...}, "checks": {...}}``; each arm has ``final_loss`` (mean over the last
  10% of steps), ``skipped_steps``, ``final_scale`` (1.0 without a scaler), ``seconds`` and
  ``underflow`` (``null`` without the probe): what it ``measured`` (in words), the shares
  ``flushed_to_zero`` (the table's column) and ``zero_or_subnormal`` over all ``probes``, and
  the same two shares per layer in ``by_layer``;
- ``steps.jsonl``: one :class:`~ampscaler.StepRecord` per arm and step, as a line of the step
  log format (:mod:`ampscaler.observe.records`) labelled with the arm's name: ``step``,
  ``loss``, ``lr``, ``skipped``, ``scale``, ``new_scale`` and, on probed steps, ``probe``
  (whose ``activations`` summed over an arm's probes give its ``underflow``);
  ``python -m ampscaler report`` draws every arm from it;
- ``loss.png``: the loss curves on one chart, fp32 dashed on top; ``scale.png``: the scaled
  arm's loss scale over steps, skipped steps marked (both scaled arms' with
  ``policy="headroom"``).

Needs matplotlib and tqdm (``pip install 'ampscaler[demo]'``).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from ampscaler.demo.train import (
    FP16_AMPSCALER,
    FP16_HEADROOM,
    FP16_NO_SCALING,
    FP32,
    Arm,
    ArmResult,
    DemoConfig,
    LossScaler,
    standard_arms,
    train_arm,
)
from ampscaler.observe.records import StepRecord
from ampscaler.policy import HeadroomPolicy
from ampscaler.scaler import GradScaler

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DEMO_FILES",
    "DEMO_THREADS",
    "GROWTH_INTERVAL",
    "POLICIES",
    "DemoOutcome",
    "demo_arms",
    "demo_scaler",
    "headroom_scaler",
    "loss_figure",
    "run_demo",
    "summary_table",
]

DEMO_FILES = ("summary.json", "steps.jsonl", "loss.png", "scale.png")
"""What a demo run writes into its folder."""

DEMO_THREADS = 1
"""The demo computes with one CPU thread, whatever the machine: results then depend on the
arithmetic alone, not on how a thread count splits the sums, so every machine prints the same
table (the README's)."""

GROWTH_INTERVAL = 10
"""The scaled arm grows its scale every 10 clean steps (torch's default is 2000), so that a
300-step demo shows the scale climbing until fp16 overflows, backing off and skipping those
steps, which is what a dynamic loss scaler does over a long run."""


POLICIES = ("default", "headroom")
"""What ``policy=`` takes: the three arms, or those and ``fp16_headroom``."""


def demo_scaler() -> LossScaler:
    """The scaled arm's scaler: ``ampscaler.GradScaler("cpu", growth_interval=10)``."""
    return GradScaler("cpu", growth_interval=GROWTH_INTERVAL)


def headroom_scaler() -> LossScaler:
    """The ``fp16_headroom`` arm's scaler: ``ampscaler.GradScaler("cpu",
    policy=HeadroomPolicy())``, which the arm's trainer gives the model to watch."""
    return GradScaler("cpu", policy=HeadroomPolicy())


def demo_arms(policy: str = "default") -> tuple[Arm, ...]:
    """The arms of a demo run: :func:`~ampscaler.demo.standard_arms` with :func:`demo_scaler`,
    and for ``policy="headroom"`` the ``fp16_headroom`` arm after them.

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES`.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
    arms = standard_arms(demo_scaler)
    if policy == "headroom":
        return (*arms, Arm(FP16_HEADROOM, fp16=True, scaler_factory=headroom_scaler))
    return arms


@dataclass(frozen=True)
class DemoOutcome:
    """What a demo run produced: the arms' results and the files written."""

    results: dict[str, ArmResult]
    files: list[Path]

    @property
    def unscaled_over_scaled(self) -> float:
        """Final loss of fp16 without scaling divided by fp16 with ampscaler (> 1 is worse)."""
        return self.results[FP16_NO_SCALING].final_loss / self.results[FP16_AMPSCALER].final_loss

    @property
    def scaled_vs_fp32(self) -> float:
        """Relative difference of the scaled arm's final loss from fp32's."""
        fp32 = self.results[FP32].final_loss
        return (self.results[FP16_AMPSCALER].final_loss - fp32) / fp32


MEASURED = (
    "activation gradients: of the elements of the linear layers' output gradients that are "
    "non-zero in an fp32 reference pass of the same step, the share the arm holds as exactly 0 "
    "in fp16 (flushed_to_zero) and below 2**-14, 0 included (zero_or_subnormal), over every "
    "probed step"
)
"""What ``summary.json``'s ``underflow`` measures for an fp16 arm, written into it."""

MEASURED_FP32 = (
    "activation gradients: of the non-zero elements of the linear layers' output gradients, the "
    "share that would be exactly 0 if rounded to fp16 (flushed_to_zero; fp32 itself flushes "
    "none) and below 2**-14, 0 included (zero_or_subnormal), over every probed step"
)
"""The same for the fp32 arm, whose gradients are their own reference."""


def _arm_summary(name: str, result: ArmResult) -> dict[str, Any]:
    underflow = result.underflow
    return {
        "final_loss": result.final_loss,
        "skipped_steps": result.skipped_steps,
        "final_scale": result.final_scale,
        "seconds": round(result.seconds, 3),
        "underflow": None
        if underflow is None
        else {
            "measured": MEASURED_FP32 if name == FP32 else MEASURED,
            "flushed_to_zero": underflow.flushed_fraction,
            "zero_or_subnormal": underflow.fraction,
            "probes": underflow.probes,
            "by_layer": underflow.by_layer(),
        },
    }


def summary_table(outcome: DemoOutcome) -> str:
    """The summary as a fixed-width text table; its shares are written as
    ``python -m ampscaler report`` writes them (:func:`ampscaler.report.percent`)."""
    from ampscaler.report import percent

    fp32 = outcome.results[FP32].final_loss
    lines = [
        f"{'arm':<17} {'final loss':>11} {'vs fp32':>8} {'skipped':>8} {'final scale':>12} "
        f"{'act. grads flushed to 0':>24}",
    ]
    for name, result in outcome.results.items():
        if result.underflow is None:
            flushed = "-"
        elif name == FP32:  # fp32 flushes nothing: say what fp16 would do to these gradients
            flushed = f"({percent(result.underflow.flushed_fraction)} in fp16)"
        else:
            flushed = percent(result.underflow.flushed_fraction)
        lines.append(
            f"{name:<17} {result.final_loss:>11.3e} {result.final_loss / fp32:>7.2f}x "
            f"{result.skipped_steps:>8d} {result.final_scale:>12g} {flushed:>24}"
        )
    if outcome.results[FP32].underflow is not None:
        lines += [
            "(fp32 flushes nothing; in brackets: the share of its own activation gradients "
            "that fp16 would flush to 0,",
            " more than fp16_no_scaling's: fp32 fits better, and smaller errors make smaller "
            "gradients)",
        ]
    return "\n".join(lines)


def loss_figure(results: dict[str, ArmResult]) -> Figure:
    """``loss.png``: every arm's training loss over steps (log axis), the legend in the arms'
    order, fp32 drawn last, dashed and on top."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    # fp32, the reference, is drawn last and on top, thin and dashed, so that a scaled arm
    # that follows it shows as dashes lying on a wider, lighter line.
    styles: dict[str, dict[str, Any]] = {
        FP32: {"color": "black", "linestyle": (0, (4, 3)), "zorder": 4, "linewidth": 1.1},
        FP16_NO_SCALING: {"color": "#d62728", "linewidth": 1.2},
        FP16_AMPSCALER: {"color": "#1f77b4", "linewidth": 3.0, "alpha": 0.55},
        FP16_HEADROOM: {"color": "#2ca02c", "linewidth": 1.4},
    }
    for name, result in sorted(results.items(), key=lambda item: item[0] == FP32):
        axes.plot(result.losses, label=name, **styles.get(name, {}))
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (MSE)")
    ways = {3: "three", 4: "four"}.get(len(results), str(len(results)))
    axes.set_title(f"The same model, data and initialisation, trained {ways} ways")
    axes.grid(True, which="major", alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    order = [labels.index(name) for name in results]  # the legend lists the arms in order
    axes.legend([handles[i] for i in order], [labels[i] for i in order], loc="best")
    return figure


def _save_png(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format="png")
    return path


class _ProgressLines:
    """Progress as about ten plain lines per arm, for a stream that is not a terminal (a log a
    run is redirected into would otherwise fill with a bar's ``\r`` updates)."""

    def __init__(self, name: str, steps: int, stream: TextIO) -> None:
        self._name, self._steps, self._stream = name, steps, stream
        self._every = max(1, steps // 10)

    def advance(self, record: StepRecord) -> None:
        done = record.step + 1
        if done % self._every == 0 or done == self._steps:
            loss = record.loss if record.loss is not None else math.nan
            self._stream.write(
                f"{self._name}: step {done}/{self._steps}, loss {loss:.2e}, "
                f"scale {record.scale:g}\n"
            )
            self._stream.flush()

    def close(self) -> None:
        """Nothing to close (as a bar's ``close``)."""


def _progress(
    name: str, steps: int, enabled: bool, stream: TextIO | None = None
) -> tuple[Callable[[StepRecord], None], Any]:
    """A progress bar on ``stream`` (stderr), or plain lines when it is not a terminal."""
    stream = sys.stderr if stream is None else stream
    if enabled and not stream.isatty():
        lines = _ProgressLines(name, steps, stream)
        return lines.advance, lines
    from tqdm.auto import tqdm

    bar = tqdm(
        total=steps, desc=f"{name:<16}", unit="step", disable=not enabled, leave=True, file=stream
    )

    def advance(record: StepRecord) -> None:
        bar.update(1)
        if record.step % 10 == 0 or record.step == steps - 1:
            loss = record.loss if record.loss is not None else math.nan
            bar.set_postfix(loss=f"{loss:.2e}", scale=f"{record.scale:g}", refresh=False)

    return advance, bar


def _log_step(
    log: TextIO, arm_name: str, advance: Callable[[StepRecord], None], record: StepRecord
) -> None:
    log.write(replace(record, label=arm_name).to_json_line() + "\n")
    advance(record)


def _train_logged(
    config: DemoConfig, log: TextIO, progress: bool, arms: tuple[Arm, ...]
) -> dict[str, ArmResult]:
    results: dict[str, ArmResult] = {}
    for arm in arms:
        advance, bar = _progress(arm.name, config.steps, progress)
        try:
            results[arm.name] = train_arm(arm, config, partial(_log_step, log, arm.name, advance))
        finally:
            bar.close()
    return results


def _scaled_records(results: dict[str, ArmResult]) -> list[StepRecord]:
    """What scale.png shows: the scaled arm's records (and the headroom arm's), labelled by
    arm, so that the chart names each line."""
    return [
        replace(record, label=name)
        for name in (FP16_AMPSCALER, FP16_HEADROOM)
        if name in results
        for record in results[name].records
    ]


def run_demo(
    config: DemoConfig, out: Path, progress: bool = True, policy: str = "default"
) -> DemoOutcome:
    """Train the arms of :func:`demo_arms` with ``config`` and write the summary, log and plots
    into ``out``.

    ``out`` must exist. Progress bars go to stderr, as plain lines when it is not a terminal
    (off with ``progress=False``).

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES`.
    """
    from ampscaler.report import plot_scale

    arms = demo_arms(policy)
    steps_path = out / "steps.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_THREADS)
    try:
        with steps_path.open("w", encoding="utf-8") as log:
            results = _train_logged(config, log, progress, arms)
    finally:
        torch.set_num_threads(threads)
    outcome = DemoOutcome(results, [])
    summary = {
        "arms": {name: _arm_summary(name, result) for name, result in results.items()},
        "config": {
            "steps": config.steps,
            "lr": config.lr,
            "seed": config.seed,
            "probe_every": config.probe_every,
            "growth_interval": GROWTH_INTERVAL,
            "task": asdict(config.task),
            **({} if policy == "default" else {"policy": policy}),
        },
        "checks": {
            "unscaled_over_scaled": outcome.unscaled_over_scaled,
            "scaled_vs_fp32": outcome.scaled_vs_fp32,
        },
    }
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    files = [
        summary_path,
        steps_path,
        _save_png(loss_figure(results), out / "loss.png"),
        plot_scale(_scaled_records(results), out / "scale.png"),
    ]
    return DemoOutcome(results, files)
