"""What the README and docs say about running their own snippets and commands."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from ampscaler import GradScaler, JsonlSink, OverflowReport

ROOT = Path(__file__).resolve().parent.parent


def _python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / name).read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_quickstart_prints_the_two_reports_the_readme_announces(seed: int) -> None:
    """The README says the Quickstart prints two overflow reports at the starting scale, and
    that this is the scale finding its ceiling: a changed loop or policy must change the text."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert (
        "this prints two overflow reports, usually on the first few steps, both at the "
        "starting scale (`step 1: non-finite gradients at scale 65536 ...`)" in readme
    )
    torch.manual_seed(seed)  # the Quickstart's model and data are random
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_python_blocks("README.md")[0], "README.md", "exec"), {})
    lines = printed.getvalue().splitlines()
    assert len(lines) == 2
    assert all(re.match(r"step \d+: non-finite gradients at scale 65536 ", line) for line in lines)


def test_ci_runs_the_readmes_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(python -m venv .*?)\n```", readme)
    test_command = next(c for c in commands if c.endswith("python -m pytest -q"))
    assert test_command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_the_tracer_snippet_runs_after_a_clean_iteration() -> None:
    """docs/diagnostics.md's `last_overflow.origin` snippet, where nothing overflowed: it must
    not read an attribute of None."""
    snippet = next(b for b in _python_blocks("docs/diagnostics.md") if ".origin" in b)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = (
        "scaler.scale(model(torch.ones(2, 4)).sum()).backward()\n"
        "scaler.step(optimizer)\n"
        "scaler.update()\n"
    )
    code = snippet.replace('"cuda"', '"cpu"').replace("\n...\n", "\n" + step)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(
            code, {"model": model, "optimizer": optimizer, "torch": torch, "GradScaler": GradScaler}
        )
    assert printed.getvalue() == ""  # a clean iteration: no overflow, nothing to print


def test_the_test_command_installs_the_engines_it_tests() -> None:
    """CI runs the README's test command: it must install the engines, so that the engine tests
    run there rather than skip, at the versions docs/integrations.md names."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(python -m venv .*?)\n```", readme)
    test_command = next(c for c in commands if c.endswith("python -m pytest -q"))
    assert "bash scripts/install_engines.sh && python -m pytest -q" in test_command
    script = (ROOT / "scripts" / "install_engines.sh").read_text(encoding="utf-8")
    guide = (ROOT / "docs" / "integrations.md").read_text(encoding="utf-8")
    for name in ("MEGATRON_CORE", "DEEPSPEED"):
        version = re.search(rf"^{name}=(\S+)$", script, re.MULTILINE)
        assert version is not None and version.group(1) in guide


@pytest.mark.parametrize(
    ("name", "index"),
    [("README.md", 2), ("docs/guide.md", 1), ("docs/guide.md", 2), ("docs/headroom.md", 0)],
)
def test_the_self_contained_snippets_run_as_written(name: str, index: int) -> None:
    """Snippets that import what they use run on the CPU as they are printed (README's policies,
    the guide's policy objects, the headroom loop)."""
    snippet = _python_blocks(name)[index]
    assert snippet.startswith(("from ampscaler import", "import torch"))
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(snippet, name, "exec"), {})


def test_the_overflow_report_reads_as_diagnostics_shows_it() -> None:
    """docs/diagnostics.md prints a report in a comment: the text a report of those parameters
    gives, its cause included."""
    snippet = next(b for b in _python_blocks("docs/diagnostics.md") if "# step 1412:" in b)
    shown = " ".join(line.lstrip("# ") for line in snippet.splitlines() if line.startswith("# "))
    report = OverflowReport(
        step=1412,
        names=["decoder.fc2.weight", "decoder.fc2.bias"],
        kinds={"decoder.fc2.weight": "inf", "decoder.fc2.bias": "inf"},
        scale=65536.0,
        cause="gradients",
    )
    assert shown == str(report)


def test_the_jsonl_example_has_the_keys_a_record_is_written_with(tmp_path: Path) -> None:
    """docs/diagnostics.md's JSONL line: the keys of a skipped step's record and of its
    overflow report, as JsonlSink writes them."""
    text = (ROOT / "docs" / "diagnostics.md").read_text(encoding="utf-8")
    example = json.loads(re.findall(r"```json\n(.*?)```", text, re.S)[0])
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    with JsonlSink(tmp_path / "steps.jsonl") as sink:
        scaler.attach(sink)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        model.weight.grad.fill_(float("inf"))  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
    written = json.loads((tmp_path / "steps.jsonl").read_text(encoding="utf-8"))
    assert example.keys() == written.keys()
    assert example["overflow"].keys() == written["overflow"].keys()


def test_the_rank_reports_read_as_distributed_shows_them() -> None:
    """docs/distributed.md's two lines, one per rank, for an overflow on rank 1 of two."""
    text = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    shown = re.findall(r"^rank (\d): (.*)$", text, re.MULTILINE)
    reports = [
        OverflowReport(3, [], {}, 65536.0, rank=0, ranks=(1,), cause="gradients"),
        OverflowReport(3, ["0.weight"], {"0.weight": "inf"}, 65536.0, 1, (1,), cause="gradients"),
    ]
    assert shown == [(str(report.rank), str(report)) for report in reports]
