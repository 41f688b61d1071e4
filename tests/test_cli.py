"""``python -m ampscaler report``: PNGs from a log a real training loop wrote, and bad input."""

from __future__ import annotations

import runpy
import struct
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from ampscaler import GradientProbe, GradScaler, JsonlSink, read_log
from ampscaler.cli import main
from training_loop import Net, run_loop

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def training_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JSONL log of 24 real fp16 iterations with overflows, growth and probes."""
    path = tmp_path_factory.mktemp("run") / "steps.jsonl"
    torch.manual_seed(0)
    model = Net()
    scaler = GradScaler("cpu", init_scale=2.0**14, growth_interval=4)
    scaler.attach(GradientProbe(every=5))
    scaler.watch(model)
    poison = {i: {"head.weight": float("inf")} for i in (6, 7, 17)}
    with scaler.add_sink(JsonlSink(path)):
        run_loop(scaler, model, torch.optim.SGD(model.parameters(), lr=1e-3), 24, poison)
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_report_renders_valid_pngs_from_a_training_log(
    training_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "report"
    assert main(["report", str(training_log), "--out", str(out), "--window", "5"]) == 0
    names = ["probe.png", "probe_modules.png", "scale.png", "skips.png"]
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        width, height = _png_size(out / name)
        pixels = imread(out / name)
        assert pixels.shape[:2] == (height, width) and width >= 600 and height >= 200
        assert pixels.std() > 0.01  # something is drawn, not a blank canvas
    records = read_log(training_log)
    skipped = [r.step for r in records if r.skipped]
    assert {6, 7, 17} <= set(skipped) and len(records) == 24
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(
        f"24 steps, {len(skipped)} skipped, final scale {records[-1].new_scale:g}; activation "
        "gradients flushed to 0: "
    )
    assert printed[0].endswith("% over 5 probed steps")
    assert printed[1:] == [
        str(out / name) for name in ("scale.png", "skips.png", "probe.png", "probe_modules.png")
    ]


def test_python_dash_m_runs_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["ampscaler", "report", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("ampscaler", run_name="__main__")
    assert exited.value.code == 0 and "LOG.jsonl" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("", "holds no step records (it is empty)"),
        ("\n\n", "holds no step records"),
        ('{"loss": 0.5, "step": 1}\n', "line 1, is not an ampscaler step record"),
        ("step,loss\n1,0.5\n2,0.4\n", "line 1, is not JSON"),
        ('{"format": "ampscaler.step/9", "step": 0}\n', "another version of ampscaler"),
        ('{"format": "ampscaler.step/1", "step": 0}\n', "line 1, is a damaged"),
    ],
    ids=["missing", "empty", "blank", "foreign-json", "csv", "newer", "damaged"],
)
def test_bad_logs_are_one_line_errors_with_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    log = tmp_path / "steps.jsonl"
    if content is not None:
        log.write_text(content)
    assert main(["report", str(log), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("ampscaler report: error: ") and message in captured.err


def test_an_out_path_that_is_a_file_is_a_one_line_error(
    training_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", str(training_log), "--out", str(blocker)]) == 2
    assert capsys.readouterr().err == (
        f"ampscaler report: error: --out {blocker} exists and is not a folder; pass a folder "
        "path.\n"
    )


def test_a_log_cut_short_by_a_crash_is_read_up_to_its_last_whole_line(
    training_log: Path, tmp_path: Path
) -> None:
    lines = training_log.read_text().splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])
    assert read_log(cut) == read_log(training_log)[:10]


@pytest.mark.parametrize(
    "argv", [[], ["report"], ["report", "x.jsonl", "--out", "d", "--window", "0"], ["explode"]]
)
def test_usage_errors_exit_2_without_traceback(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--help"]) == 0
    assert "--window" in capsys.readouterr().out
