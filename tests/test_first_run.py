"""What a new user meets first: the README, the CLI without extras, the demo's files and tables."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

import ampscaler
from ampscaler.cli import main
from ampscaler.demo import DemoConfig
from ampscaler.demo.run import DemoOutcome, run_demo, summary_table
from ampscaler.observe.probe import ProbeResult
from ampscaler.observe.records import StepRecord
from ampscaler.report import render_report, scale_series

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------- the README


def test_readme_python_blocks_run_in_order_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ```python block, run as a reader pastes them: in order, in one namespace."""
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 5
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "steps.jsonl").exists()  # the Diagnostics block's sink


def test_readme_demo_table_and_images_are_what_the_demo_makes(
    default_demo: tuple[DemoOutcome, Path],
) -> None:
    """On any machine: the demo computes with one thread, so its numbers are the README's."""
    outcome, written_to = default_demo
    shown = re.search(r"```\n(arm +final loss.*?\n)```", README, re.S)
    assert shown is not None
    assert summary_table(outcome) + "\n" == shown.group(1), (
        "README.md's demo table is out of date: PYTHONPATH=src python scripts/update_readme_demo.py"
    )
    for written, in_docs in (("loss.png", "demo-loss.png"), ("scale.png", "demo-scale.png")):
        fresh = imread(written_to / written)
        documented = imread(ROOT / "docs" / "images" / in_docs)
        assert fresh.shape == documented.shape
        assert float(np.abs(fresh - documented).mean()) < 0.01, in_docs


def test_demo_results_do_not_depend_on_the_callers_thread_count(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    tables = []
    try:
        for count in (2, 1):
            torch.set_num_threads(count)
            out = tmp_path / str(count)
            out.mkdir()
            tables.append(summary_table(run_demo(DemoConfig(steps=12), out, progress=False)))
            assert torch.get_num_threads() == count  # the demo put it back
    finally:
        torch.set_num_threads(threads)
    assert tables[0] == tables[1]


# ---------------------------------------------------------------------- the CLI


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"ampscaler {ampscaler.__version__} (torch ")


@pytest.mark.parametrize(
    ("command", "hidden", "extra"),
    [
        (["demo", "--steps", "2"], "tqdm", "demo"),
        (["demo", "--steps", "2"], "matplotlib", "demo"),
        (["report", "LOG"], "matplotlib", "report"),
    ],
)
def test_a_missing_extra_is_one_line_exit_2_and_nothing_written(
    command: list[str],
    hidden: str,
    extra: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = tmp_path / "steps.jsonl"
    log.write_text(
        StepRecord(step=0, scale=1.0, new_scale=1.0, skipped=False, time=0.0).to_json_line() + "\n"
    )
    argv = [str(log) if word == "LOG" else word for word in command]
    out = tmp_path / "out"
    monkeypatch.setitem(sys.modules, hidden, None)  # as if it were not installed
    assert main([*argv, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert hidden in error and f"pip install 'ampscaler[{extra}]'" in error
    assert not out.exists()


def test_demo_checks_its_folder_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained before the folder was checked")

    monkeypatch.setattr("ampscaler.demo.run.run_demo", never)

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "touch", read_only)
    assert main(["demo", "--out", str(tmp_path / "ro")]) == 2
    assert "cannot write into the output folder" in capsys.readouterr().err


def test_an_earlier_demo_folder_is_kept_unless_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "summary.json").write_text('{"mine": 1}')
    assert main(["demo", "--steps", "2", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text()) == {"mine": 1}
    assert main(["demo", "--steps", "2", "--out", str(out), "--overwrite"]) == 0
    assert "arms" in json.loads((out / "summary.json").read_text())


def test_report_says_when_a_cut_short_last_line_was_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = StepRecord(step=0, scale=8.0, new_scale=8.0, skipped=False, time=0.0)
    log = tmp_path / "steps.jsonl"
    log.write_text(record.to_json_line() + "\n" + record.to_json_line()[:20])
    assert main(["report", str(log), "--out", str(tmp_path / "plots")]) == 0
    assert "1 line left out" in capsys.readouterr().out


def test_report_draws_the_demos_arms_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--steps", "3", "--out", str(tmp_path / "demo")]) == 0
    log = tmp_path / "demo" / "steps.jsonl"
    assert main(["report", str(log), "--out", str(tmp_path / "r")]) == 0
    written = {path.name for path in (tmp_path / "r").iterdir()}
    assert "scale.png" in written and "skips-fp16_ampscaler.png" in written
    for arm in ("fp32", "fp16_no_scaling", "fp16_ampscaler"):
        assert f"probe-{arm}.png" in written
    for arm in ("fp32", "fp16_no_scaling"):  # no loss scaler, nothing to count
        assert f"skips-{arm}.png" not in written


# ---------------------------------------------------------------------- smaller items


def test_scaling_a_dict_says_dicts_are_not_supported() -> None:
    scaler = ampscaler.GradScaler("cpu")
    with pytest.raises(ValueError, match="not a dict"):
        scaler.scale({"a": torch.tensor(1.0), "b": torch.tensor(2.0)})  # type: ignore[arg-type]


def test_the_scale_line_ends_at_the_scale_after_the_last_update() -> None:
    records = [
        StepRecord(step=i, scale=2.0**i, new_scale=2.0 ** (i + 1), skipped=False, time=0.0)
        for i in range(3)
    ]
    steps, scales = scale_series(records)
    assert steps[-1] == 3 and scales[-1] == 2.0**3  # what get_scale() gives after the run


def _probed(fractions: dict[str, float]) -> list[StepRecord]:
    probe = ProbeResult(
        scale=8.0,
        elements=10,
        nonzero=10,
        underflow_at_scale=0.0,
        underflow_at_one=0.1,
        headroom_log2=3.0,
        modules=fractions,
    )
    return [StepRecord(step=0, scale=8.0, new_scale=8.0, skipped=False, time=0.0, probe=probe)]


def test_no_empty_modules_chart_when_nothing_underflowed(tmp_path: Path) -> None:
    quiet = render_report(_probed({"0": 0.0, "1": 0.0}), tmp_path)
    assert "probe_modules.png" not in {p.name for p in quiet}
    loud = render_report(_probed({"0": 0.25, "1": 0.0}), tmp_path)
    assert "probe_modules.png" in {p.name for p in loud}


def test_demo_table_explains_the_fp32_bracket(tmp_path: Path) -> None:
    table = summary_table(run_demo(DemoConfig(steps=4), tmp_path, progress=False))
    assert "in fp16)" in table and "fp32 flushes nothing" in table
    assert "more than fp16_no_scaling's: fp32 fits better" in table  # why its share is larger


def test_sharded_example_refuses_an_overflow_rank_it_does_not_have() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sharded.py"), "--overflow-rank", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--overflow-rank 5 is not a rank of this run" in done.stderr
