"""``python -m ampscaler report`` on the demo's own log: the charts tell the table's story."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from matplotlib.figure import Figure

import ampscaler.report
from ampscaler import GradientProbe, GradScaler, JsonlSink, read_log
from ampscaler.cli import main
from ampscaler.demo import FP16_AMPSCALER, FP16_NO_SCALING, FP32, DemoConfig
from ampscaler.demo.run import DemoOutcome, loss_figure, run_demo, summary_table
from ampscaler.observe.probe import ProbeResult, UnderflowCounts
from ampscaler.observe.records import StepRecord
from ampscaler.report import (
    activation_counts,
    by_label,
    has_scaler,
    parameter_zeros,
    percent,
    plot_modules,
    render_report,
    report_notes,
    report_summary,
    scale_figure,
    shown_modules,
)

ARMS = (FP32, FP16_NO_SCALING, FP16_AMPSCALER)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, DemoOutcome]:
    """A 30-step demo (probes at steps 0 and 25): its folder and outcome."""
    out = tmp_path_factory.mktemp("ampscaler-demo-1")
    return out, run_demo(DemoConfig(steps=30), out, progress=False)


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> dict[str, Figure]:
    """Every figure the report saves, by file name."""
    saved: dict[str, Figure] = {}
    real = ampscaler.report._save

    def keep(figure: Figure, path: Path) -> Path:
        saved[path.name] = figure
        return real(figure, path)

    monkeypatch.setattr(ampscaler.report, "_save", keep)
    return saved


def _summary(folder: Path) -> dict[str, Any]:
    arms: dict[str, Any] = json.loads((folder / "summary.json").read_text())["arms"]
    return arms


def test_the_unscaled_arms_chart_data_is_the_tables_number(demo: tuple[Path, DemoOutcome]) -> None:
    folder, outcome = demo
    runs = by_label(read_log(folder / "steps.jsonl"))
    summary = _summary(folder)
    table = summary_table(outcome)
    for arm in ARMS:
        probes = [(r.step, r.probe) for r in runs[arm] if r.probe is not None]
        counts = activation_counts(probes)
        assert counts is not None
        assert counts.flushed_fraction == summary[arm]["underflow"]["flushed_to_zero"]
        assert percent(counts.flushed_fraction) in table  # written the same way, too
    unscaled = [r.probe for r in runs[FP16_NO_SCALING] if r.probe is not None]
    assert activation_counts([(0, p) for p in unscaled]).flushed_fraction > 0.5  # type: ignore[union-attr]
    # The parameter-gradient panel counts what was flushed on the way back: not 0% any more.
    assert parameter_zeros(unscaled[-1])[0] > 0.3
    assert unscaled[-1].underflow_at_one == 0.0  # the non-zero-only measure never sees it


def test_summary_json_names_what_by_layer_holds(demo: tuple[Path, DemoOutcome]) -> None:
    underflow = _summary(demo[0])[FP16_NO_SCALING]["underflow"]
    assert "activation gradients" in underflow["measured"]
    layers = underflow["by_layer"]
    assert set(layers) == {"hidden1", "hidden2", "hidden3", "output"}
    for shares in layers.values():
        assert set(shares) == {"flushed_to_zero", "zero_or_subnormal"}
        assert shares["flushed_to_zero"] <= shares["zero_or_subnormal"]
    assert "would be" in _summary(demo[0])[FP32]["underflow"]["measured"]


def test_one_line_per_arm_no_skip_chart_without_a_scaler_and_titles_naming_the_arm(
    demo: tuple[Path, DemoOutcome],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    figures: dict[str, Figure],
) -> None:
    out = tmp_path / "plots"
    assert main(["report", str(demo[0] / "steps.jsonl"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"{FP32}: 30 steps, no loss scaling (scale 1 throughout")
    assert "would be flushed to 0 in fp16" in printed[0]
    assert printed[1].startswith(f"{FP16_NO_SCALING}: 30 steps, no loss scaling")
    assert printed[2].startswith(f"{FP16_AMPSCALER}: 30 steps, 0 skipped, final scale 524288")
    assert f"{FP16_NO_SCALING}: no skips chart: it ran without loss scaling" in printed
    written = {path.name for path in out.iterdir()}
    assert written == {
        "scale.png",
        f"skips-{FP16_AMPSCALER}.png",
        *(f"probe-{arm}.png" for arm in ARMS),
        *(f"probe_modules-{arm}.png" for arm in ARMS),
    }
    for name, figure in figures.items():
        if name != "scale.png":  # (its title: test_the_scale_chart_leaves_out_...)
            arm = name.split("-", 1)[1].removesuffix(".png")
            title = figure.get_suptitle() or figure.axes[0].get_title()
            assert title.startswith(f"{arm}: "), (name, title)


def test_the_scale_chart_leaves_out_runs_without_a_scaler(demo: tuple[Path, DemoOutcome]) -> None:
    records = read_log(demo[0] / "steps.jsonl")
    axes = scale_figure(records).axes[0]
    lines = [line.get_label() for line in axes.get_lines()]
    assert lines == [FP16_AMPSCALER]  # fp32 neither hidden under it nor stretching the axis
    assert axes.get_ylim()[0] >= 2.0**14
    assert axes.get_title() == f"{FP16_AMPSCALER}: loss scale over steps"
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert f"{FP32}, {FP16_NO_SCALING}" in legend[-1] and "not drawn" in legend[-1]
    assert [has_scaler(run) for run in by_label(records).values()] == [False, False, True]


def _probed(counts: dict[str, UnderflowCounts]) -> list[StepRecord]:
    """One probed step of a run whose watched modules had ``counts``."""
    total = sum(counts.values(), UnderflowCounts())
    probe = ProbeResult(
        scale=8.0,
        elements=4,
        nonzero=4,
        underflow_at_scale=0.0,
        underflow_at_one=0.0,
        headroom_log2=3.0,
        modules={name: c.fraction for name, c in counts.items()},
        module_counts=counts,
        activations=total,
        activation_dtypes=("float16",),
    )
    return [StepRecord(step=0, scale=8.0, new_scale=8.0, skipped=False, time=0.0, probe=probe)]


def test_a_module_chart_of_small_shares_zooms_in_and_writes_the_values(
    demo: tuple[Path, DemoOutcome], tmp_path: Path, figures: dict[str, Figure]
) -> None:
    """The scaled arm's shares are near 0%: on a 0-100% axis its bars would look blank."""
    small = {"hidden1": UnderflowCounts(100_000, 190, 1), "output": UnderflowCounts(10**5, 4, 0)}
    render_report(_probed(small), tmp_path)
    axes = figures["probe_modules.png"].axes[0]
    assert 0.19 < axes.get_xlim()[1] < 1 and "at most 0.2%: the axis is zoomed in" in (
        axes.get_xlabel()
    )
    assert [text.get_text() for text in axes.texts] == ["0.0%", "0.001%", "0.004%", "0.2%"]
    run = by_label(read_log(demo[0] / "steps.jsonl"))[FP16_NO_SCALING]
    plot_modules([(r.step, r.probe) for r in run if r.probe is not None], tmp_path / "m.png")
    unscaled = figures["m.png"].axes[0]
    assert unscaled.get_xlim()[1] > 100 and "zoomed" not in unscaled.get_xlabel()


def test_every_module_chart_lists_the_layers_in_one_order(
    demo: tuple[Path, DemoOutcome], tmp_path: Path, figures: dict[str, Figure]
) -> None:
    """Item 11: a chart listed its layers as its run's first probe met them (worst first), so
    two runs' charts could disagree; and the demo's charts put the output layer on top."""
    render_report(read_log(demo[0] / "steps.jsonl"), tmp_path)
    for arm in ARMS:
        axes = figures[f"probe_modules-{arm}.png"].axes[0]
        top_down = [label.get_text() for label in axes.get_yticklabels()][::-1]
        assert top_down == ["hidden1", "hidden2", "hidden3", "output"], arm
    first_met = {"out": (0.0, 0.9), "layers.10": (0.0, 0.5), "layers.2": (0.0, 0.1)}
    other_run = {"layers.2": (0.0, 0.9), "out": (0.0, 0.1), "layers.10": (0.0, 0.5)}
    assert shown_modules(first_met) == shown_modules(other_run) == ["layers.2", "layers.10", "out"]


def test_a_module_chart_with_nothing_to_show_is_left_out_with_a_note(tmp_path: Path) -> None:
    records = _probed({"fc": UnderflowCounts(carrying_signal=100, underflowed=0, flushed=0)})
    assert {p.name for p in render_report(records, tmp_path)} == {
        "scale.png",
        "skips.png",
        "probe.png",
    }
    assert report_notes(records) == [
        "no module chart: no watched module's gradient was zero or subnormal"
    ]


def _demo_like_log(folder: Path) -> Path:
    """A small log shaped as the demo's: an arm without a scaler and one with, 3 steps each."""
    folder.mkdir(parents=True)
    log = folder / "steps.jsonl"
    log.write_text(
        "".join(
            StepRecord(
                step=i, scale=scale, new_scale=scale, skipped=False, time=0.0, label=arm
            ).to_json_line()
            + "\n"
            for arm, scale in ((FP32, 1.0), (FP16_AMPSCALER, 1024.0))
            for i in range(3)
        )
    )
    return log


def test_report_takes_several_logs_each_into_its_own_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's `report ampscaler-demo-*/steps.jsonl`, once the demo ran twice."""
    logs = [_demo_like_log(tmp_path / name) for name in ("ampscaler-demo-1", "ampscaler-demo-2")]
    out = tmp_path / "plots"
    assert main(["report", *map(str, logs), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ampscaler-demo-1", "ampscaler-demo-2"]
    for folder in out.iterdir():
        assert sorted(p.name for p in folder.iterdir()) == [
            "scale.png",
            f"skips-{FP16_AMPSCALER}.png",
        ]
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if not line.startswith("  ")] == [f"{log}:" for log in logs]
    assert printed.count(f"  {FP16_AMPSCALER}: 3 steps, 0 skipped, final scale 1024") == 2


def test_without_out_the_charts_go_beside_each_log(tmp_path: Path) -> None:
    log = _demo_like_log(tmp_path / "run")
    assert main(["report", str(log)]) == 0
    assert (tmp_path / "run" / "steps-report" / "scale.png").exists()


def test_one_bad_log_of_several_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\nat all\n")
    out = tmp_path / "plots"
    good = _demo_like_log(tmp_path / "good")
    assert main(["report", str(good), str(bad), "--out", str(out)]) == 2
    assert "bad.jsonl, line 1, is not JSON" in capsys.readouterr().err
    assert not out.exists()


def test_the_loss_chart_draws_fp32_dashed_on_top(demo: tuple[Path, DemoOutcome]) -> None:
    axes = loss_figure(demo[1].results).axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    fp32 = lines[FP32]
    assert fp32.get_linestyle() == "--"
    assert all(
        fp32.get_zorder() > line.get_zorder() for name, line in lines.items() if name != FP32
    )
    assert fp32.get_linewidth() < lines[FP16_AMPSCALER].get_linewidth()  # the blue shows
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == list(ARMS)


def test_report_summary_of_a_plain_log() -> None:
    records = [
        StepRecord(step=i, scale=4.0, new_scale=4.0 if i else 2.0, skipped=i == 0, time=0.0)
        for i in range(3)
    ]
    assert report_summary(records) == ["3 steps, 1 skipped, final scale 4"]
    assert report_notes(records) == []


def test_the_readme_names_the_files_report_writes(tmp_path: Path) -> None:
    """README: `report steps.jsonl --out plots/   # scale.png, ...`, on a log made as its
    Diagnostics block makes one, from a model whose fp16 gradients underflow."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    promised = re.search(r"report steps\.jsonl --out plots/ +# (.*)\n", readme)
    assert promised is not None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = GradScaler("cpu")
    scaler.watch(model)
    scaler.attach(GradientProbe(every=2))
    with scaler.add_sink(JsonlSink(tmp_path / "steps.jsonl")):
        for _ in range(4):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(32, 16)).float().pow(2).mean() * 1e-12  # too small
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert main(["report", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "plots")]) == 0
    written = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert written == sorted(promised.group(1).split(", "))
