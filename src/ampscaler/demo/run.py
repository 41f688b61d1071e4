"""Running the whole demo: three arms with progress bars, then files a person can look at.

:func:`run_demo` trains the arms of :func:`~ampscaler.demo.standard_arms` with
``ampscaler.GradScaler`` in the scaled arm, and writes into one folder:

- ``summary.json``: ``{"arms": {"fp32": {...}, "fp16_no_scaling": {...}, "fp16_ampscaler":
  {...}}, "config": {...}, "checks": {...}}``; each arm has ``final_loss`` (mean over the last
  10% of steps), ``skipped_steps``, ``final_scale`` (1.0 without a scaler), ``seconds`` and
  ``underflow`` (the probe's fractions, or ``null``);
- ``steps.jsonl``: one :class:`~ampscaler.StepRecord` per arm and step, as a line of the step
  log format (:mod:`ampscaler.observe.records`) labelled with the arm's name: ``step``,
  ``loss``, ``lr``, ``skipped``, ``scale``, ``new_scale`` and, on probed steps, ``probe``;
- ``loss.png``: the three loss curves on one chart; ``scale.png``: the scaled arm's loss scale
  over steps, skipped steps marked.

Needs matplotlib and tqdm (``pip install 'ampscaler[demo]'``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import torch

from ampscaler.demo.train import (
    FP16_AMPSCALER,
    FP16_NO_SCALING,
    FP32,
    ArmResult,
    DemoConfig,
    LossScaler,
    standard_arms,
    train_arm,
)
from ampscaler.observe.records import StepRecord
from ampscaler.scaler import GradScaler

__all__ = [
    "DEMO_FILES",
    "DEMO_THREADS",
    "GROWTH_INTERVAL",
    "DemoOutcome",
    "demo_scaler",
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


def demo_scaler() -> LossScaler:
    """The scaled arm's scaler: ``ampscaler.GradScaler("cpu", growth_interval=10)``."""
    return GradScaler("cpu", growth_interval=GROWTH_INTERVAL)


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


def _arm_summary(result: ArmResult) -> dict[str, Any]:
    underflow = result.underflow
    return {
        "final_loss": result.final_loss,
        "skipped_steps": result.skipped_steps,
        "final_scale": result.final_scale,
        "seconds": round(result.seconds, 3),
        "underflow": None
        if underflow is None
        else {
            "flushed_to_zero": underflow.flushed_fraction,
            "zero_or_subnormal": underflow.fraction,
            "probes": underflow.probes,
            "by_layer": underflow.by_layer(),
        },
    }


def summary_table(outcome: DemoOutcome) -> str:
    """The summary as a fixed-width text table."""
    fp32 = outcome.results[FP32].final_loss
    lines = [
        f"{'arm':<17} {'final loss':>11} {'vs fp32':>8} {'skipped':>8} {'final scale':>12} "
        f"{'act. grads flushed to 0':>24}",
    ]
    for name, result in outcome.results.items():
        if result.underflow is None:
            flushed = "-"
        elif name == FP32:  # fp32 flushes nothing: say what fp16 would do to these gradients
            flushed = f"({result.underflow.flushed_fraction:.1%} in fp16)"
        else:
            flushed = f"{result.underflow.flushed_fraction:.1%}"
        lines.append(
            f"{name:<17} {result.final_loss:>11.3e} {result.final_loss / fp32:>7.2f}x "
            f"{result.skipped_steps:>8d} {result.final_scale:>12g} {flushed:>24}"
        )
    if outcome.results[FP32].underflow is not None:
        lines.append(
            "(fp32 flushes nothing; in brackets: the share of its activation gradients that "
            "fp16 would flush to 0)"
        )
    return "\n".join(lines)


def _plot_losses(results: dict[str, ArmResult], path: Path) -> Path:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.6), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    styles: dict[str, dict[str, Any]] = {
        FP32: {"color": "black", "linestyle": "--", "zorder": 3, "linewidth": 1.0},
        FP16_NO_SCALING: {"color": "#d62728", "linewidth": 1.2},
        FP16_AMPSCALER: {"color": "#1f77b4", "linewidth": 2.0},
    }
    for name, result in results.items():
        axes.plot(result.losses, label=name, **styles.get(name, {}))
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (MSE)")
    axes.set_title("The same model, data and initialisation, trained three ways")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(loc="best")
    figure.savefig(path, format="png")
    return path


def _progress(name: str, steps: int, enabled: bool) -> tuple[Callable[[StepRecord], None], Any]:
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, desc=f"{name:<16}", unit="step", disable=not enabled, leave=True)

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
    config: DemoConfig, log: TextIO, progress: bool
) -> dict[str, ArmResult]:
    results: dict[str, ArmResult] = {}
    for arm in standard_arms(demo_scaler):
        advance, bar = _progress(arm.name, config.steps, progress)
        try:
            results[arm.name] = train_arm(arm, config, partial(_log_step, log, arm.name, advance))
        finally:
            bar.close()
    return results


def run_demo(config: DemoConfig, out: Path, progress: bool = True) -> DemoOutcome:
    """Train the three arms with ``config`` and write the summary, log and plots into ``out``.

    ``out`` must exist. Progress bars go to stderr (off with ``progress=False``).
    """
    from ampscaler.report import plot_scale

    steps_path = out / "steps.jsonl"
    threads = torch.get_num_threads()
    torch.set_num_threads(DEMO_THREADS)
    try:
        with steps_path.open("w", encoding="utf-8") as log:
            results = _train_logged(config, log, progress)
    finally:
        torch.set_num_threads(threads)
    outcome = DemoOutcome(results, [])
    summary = {
        "arms": {name: _arm_summary(result) for name, result in results.items()},
        "config": {
            "steps": config.steps,
            "lr": config.lr,
            "seed": config.seed,
            "probe_every": config.probe_every,
            "growth_interval": GROWTH_INTERVAL,
            "task": asdict(config.task),
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
        _plot_losses(results, out / "loss.png"),
        plot_scale(results[FP16_AMPSCALER].records, out / "scale.png"),
    ]
    return DemoOutcome(results, files)
