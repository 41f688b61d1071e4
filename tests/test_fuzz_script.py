"""``scripts/fuzz.py`` runs what its docstring says: a count of seeds, or as many as fit."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

import differential

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fuzz.py"


def _fuzz(monkeypatch: pytest.MonkeyPatch, differing: set[int]) -> ModuleType:
    """The script, with each script's check a stub (seeds in ``differing`` differ)."""
    monkeypatch.setattr(differential, "world_of_one", lambda: None)
    monkeypatch.setattr(
        differential, "check", lambda seed, world: f"seed {seed}" if seed in differing else None
    )
    spec = importlib.util.spec_from_file_location("fuzz_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _done(output: str) -> int:
    found = re.search(r"done: (\d+) scripts", output)
    assert found is not None, output
    return int(found.group(1))


def test_a_count_runs_that_many_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fuzz(monkeypatch, set()).main(["--seed", "5", "--count", "30"]) == 0
    assert _done(capsys.readouterr().out) == 30
    assert _fuzz(monkeypatch, set()).main([]) == 0
    assert _done(capsys.readouterr().out) == 1000  # the default


def test_minutes_alone_run_as_many_as_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fuzz(monkeypatch, set()).main(["--minutes", "0.005"]) == 0  # 0.3 s of stubs
    assert _done(capsys.readouterr().out) > 1000


def test_a_differing_seed_is_printed_and_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _fuzz(monkeypatch, {12}).main(["--seed", "10", "--count", "5"]) == 1
    output = capsys.readouterr().out
    assert "seed 12\n" in output and "1 differ: [12]" in output
