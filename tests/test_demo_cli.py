"""``python -m ampscaler demo``: the files it writes, its summary, bad input, and the defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from ampscaler.cli import main
from ampscaler.demo import FP16_AMPSCALER, FP16_HEADROOM, FP16_NO_SCALING, FP32, DemoConfig
from ampscaler.demo.run import DemoOutcome, run_demo

ARMS = [FP32, FP16_NO_SCALING, FP16_AMPSCALER]


def test_short_demo_writes_summary_log_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "12", "--out", str(out), "--seed", "3"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "loss.png",
        "scale.png",
        "steps.jsonl",
        "summary.json",
    ]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["arms"]) == ARMS
    for name in ARMS:
        arm = summary["arms"][name]
        assert {"final_loss", "skipped_steps", "final_scale", "underflow"} <= set(arm)
        assert arm["final_loss"] > 0 and arm["skipped_steps"] >= 0
    assert summary["arms"][FP32]["final_scale"] == 1.0
    assert summary["arms"][FP16_NO_SCALING]["final_scale"] == 1.0
    assert summary["arms"][FP16_AMPSCALER]["final_scale"] >= 2.0**16  # grew after 10 steps
    flushed = {name: summary["arms"][name]["underflow"]["flushed_to_zero"] for name in ARMS}
    assert flushed[FP16_NO_SCALING] > flushed[FP16_AMPSCALER]
    assert summary["config"]["steps"] == 12 and summary["config"]["seed"] == 3
    lines = (out / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 3 * 12
    first = json.loads(lines[0])
    assert first["label"] == FP32 and first["step"] == 0
    assert {"loss", "skipped", "scale", "lr"} <= set(first)
    for png in ("loss.png", "scale.png"):
        pixels = imread(out / png)
        assert pixels.shape[0] >= 300 and pixels.std() > 0.01
    printed = capsys.readouterr().out
    assert "fp16_no_scaling" in printed and "final loss" in printed and str(out) in printed


def test_default_out_is_a_new_folder_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", "2"]) == 0
    assert main(["demo", "--steps", "2"]) == 0
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and all(f.startswith("ampscaler-demo-") for f in folders)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--steps", "0"],
        ["demo", "--steps", "many"],
        ["demo", "--seed", "-1"],
        ["demo", "--colour", "red"],
    ],
    ids=["zero-steps", "word-steps", "negative-seed", "unknown-option"],
)
def test_bad_options_give_one_line_and_status_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_out_that_is_a_file_or_cannot_be_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert main(["demo", "--steps", "2", "--out", str(a_file)]) == 2
    assert main(["demo", "--steps", "2", "--out", str(a_file / "below")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("ampscaler demo: error:") for line in errors)


def test_module_entry_point_runs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ampscaler", "demo", "--steps", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--steps" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_default_demo_shows_underflow_and_its_rescue(
    default_demo: tuple[DemoOutcome, Path],
) -> None:
    """The documented claim: unscaled >= 1.5x the scaled arm, which is within 10% of fp32."""
    outcome, _ = default_demo
    final = {name: result.final_loss for name, result in outcome.results.items()}
    assert final[FP16_NO_SCALING] >= 1.5 * final[FP16_AMPSCALER]
    assert abs(final[FP16_AMPSCALER] - final[FP32]) <= 0.1 * final[FP32]
    assert outcome.results[FP16_AMPSCALER].skipped_steps > 0  # the scale really moved both ways


def test_policy_headroom_adds_a_fourth_arm_that_skips_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "30", "--out", str(out), "--policy", "headroom"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["arms"]) == [*ARMS, FP16_HEADROOM]
    assert summary["config"]["policy"] == "headroom"
    assert summary["arms"][FP16_HEADROOM]["skipped_steps"] == 0
    # Set by measurement at once, where growing every 10 steps from 2**16 reached 2**19.
    assert summary["arms"][FP16_AMPSCALER]["final_scale"] == 2.0**19
    assert summary["arms"][FP16_HEADROOM]["final_scale"] >= 2.0**20
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith(FP16_HEADROOM))
    assert row.split()[3] == "0"  # its skipped-step count, in the table
    assert "HeadroomPolicy skipped 0 steps" in printed and "four ways" in printed
    assert len((out / "steps.jsonl").read_text().splitlines()) == 4 * 30


def test_the_default_demo_has_no_policy_key_and_a_bad_policy_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--out", str(out)]) == 0
    assert "policy" not in json.loads((out / "summary.json").read_text())["config"]
    assert main(["demo", "--policy", "fixed"]) == 2
    assert "--policy" in capsys.readouterr().err
    with pytest.raises(ValueError, match="policy must be one of default, headroom"):
        run_demo(DemoConfig(steps=1), tmp_path, progress=False, policy="fixed")
