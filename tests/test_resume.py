"""Exact resume: a run stopped at iteration K and restarted from its checkpoint goes on bit for bit.

In new processes (tests/resume_worker.py: one process trains every case uninterrupted and saves
checkpoints with ``torch.save``, a second loads them into fresh objects and continues) and in
this one at every K, for every policy option and for fused Adam, with overflows of every kind
before and after K. Checkpoints of another configuration: the checkpoint's configuration wins,
as in torch; a torch checkpoint leaves ampscaler's own options as constructed.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampscaler
from resume_plan import (
    CASES,
    CHECKPOINTS,
    FAULTS,
    STEPS,
    Case,
    Record,
    build,
    checkpoint,
    play,
    restore,
    through_bytes,
)

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Record]]]:
    """Every case run through, saving a checkpoint file at each of ``CHECKPOINTS``."""
    folder = tmp_path_factory.mktemp("resume")
    runs = {}
    for case in CASES:
        run = build(case)
        records = []
        for iteration in range(STEPS):
            if iteration in CHECKPOINTS:
                torch.save(checkpoint(run), folder / f"{case.name}-at-{iteration}.pt")
            records += play(run, range(iteration, iteration + 1))
        runs[case.name] = records
    return folder, runs


@pytest.fixture(scope="module")
def resumed(uninterrupted: tuple[Path, dict[str, list[Record]]]) -> Path:
    """The checkpoints continued by tests/resume_worker.py in a new process."""
    folder = uninterrupted[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    done = subprocess.run(
        [sys.executable, str(TESTS / "resume_worker.py"), str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # The worker ran this checkout's ampscaler, not an installed copy.
    assert Path(done.stdout.strip()).resolve() == SRC / "ampscaler" / "__init__.py"
    return folder


def test_plan_overflows_before_and_after_every_checkpoint() -> None:
    for start in CHECKPOINTS:
        assert any(i < start for i in FAULTS) and any(i >= start for i in FAULTS)
    kinds = {(kind, value if kind == "grad" else what) for kind, what, value in FAULTS.values()}
    assert {str(v) for _, v in kinds} >= {"inf", "-inf", "nan", "1000000.0"}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_resume_in_a_new_process_is_bit_for_bit(
    case: Case, resumed: Path, uninterrupted: tuple[Path, dict[str, list[Record]]]
) -> None:
    full = uninterrupted[1][case.name]
    for start in CHECKPOINTS:
        continued = pickle.loads((resumed / f"{case.name}-from-{start}.pkl").read_bytes())
        assert continued == full[start:], start


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_checkpoint_into_a_scaler_of_other_options_continues_exactly(
    case: Case, uninterrupted: tuple[Path, dict[str, list[Record]]]
) -> None:
    """A checkpoint loaded into a scaler built with other options: the checkpoint's win."""
    full = uninterrupted[1][case.name]
    for start in CHECKPOINTS:
        run = build(case)
        play(run, range(start))
        resumed = restore(case, through_bytes(checkpoint(run)), scaler_kwargs={"hysteresis": 4})
        assert play(resumed, range(start, STEPS)) == full[start:], start


def _states(records: list[Record]) -> list[dict[str, str]]:
    return [dict(r.state) for r in records]


def test_every_case_exercises_its_option(
    uninterrupted: tuple[Path, dict[str, list[Record]]],
) -> None:
    runs = {name: (records, _states(records)) for name, records in uninterrupted[1].items()}
    scales = {name: [r.scale for r in records] for name, (records, _) in runs.items()}
    assert min(scales["fused-adam"]) < min(scales["min-scale"]) == 2.0**10
    assert scales["max-scale"][3:5] == [1658.8800048828125, 2.0**11]  # doubling capped
    assert max(scales["max-scale"]) == 2.0**11
    assert set(scales["static"]) == {2.0**11}
    budgets = [int(s["_hysteresis_tracker"]) for s in runs["hysteresis"][1]]
    assert {0, 1, 2, 3} <= set(budgets)
    assert [budgets[k - 1] for k in CHECKPOINTS] == [2, 2, 0]  # saved mid-budget
    for name in ("max-consecutive-skips", "every-option", "fused-adam-every-option"):
        # Raised right after each checkpoint: only a restored skip count can tell.
        assert [i for i, r in enumerate(runs[name][0]) if r.raised] == list(CHECKPOINTS)
    for records, _ in runs.values():
        assert [r.skipped for r in records] == [i in FAULTS for i in range(STEPS)]


def test_torch_checkpoint_keeps_own_options_and_starts_counters_at_zero() -> None:
    case = Case("torch-into-ampscaler", {})
    ours = build(case, {"hysteresis": 3, "min_scale": 4.0, "growth_interval": 7})
    theirs = torch.amp.GradScaler("cpu", init_scale=512.0, growth_factor=3.0, growth_interval=5)
    theirs._lazy_init_scale_growth_tracker(torch.device("cpu"))
    theirs._growth_tracker.fill_(2)
    ours.scaler.load_state_dict(through_bytes({"s": theirs.state_dict()})["s"])
    saved = ours.scaler.state_dict()
    assert saved["scale"] == 512.0 and saved["_growth_tracker"] == 2
    assert (saved["growth_factor"], saved["growth_interval"]) == (3.0, 5)  # torch's keys win
    assert (saved["hysteresis"], saved["_hysteresis_tracker"], saved["min_scale"]) == (3, 3, 4.0)
    assert saved["stats"] == ampscaler.ScalerStats().as_dict()


def test_ampscaler_checkpoint_loads_into_torch_and_continues_alike() -> None:
    case = Case("ampscaler-into-torch", {})
    run = build(case)
    play(run, range(5))
    saved = checkpoint(run)
    ours = restore(case, through_bytes(saved), scaler_kwargs={})
    # A copy of its own: optimizers share the state tensors of the dict they load.
    theirs = restore(case, through_bytes(saved), scaler_kwargs={})
    theirs.scaler = torch.amp.GradScaler("cpu")  # type: ignore[assignment]
    theirs.scaler.load_state_dict(saved["scaler"])
    mine, other = play(ours, range(5, STEPS)), play(theirs, range(5, STEPS))
    assert [(r.scale, r.params) for r in mine] == [(r.scale, r.params) for r in other]


def test_bounds_that_float32_cannot_hold_survive_a_round_trip() -> None:
    """min_scale=33554401 is 33554400 as a float32; the scale sits there and must reload."""
    scaler = ampscaler.GradScaler(
        "cpu", init_scale=33554401.0, min_scale=33554401.0, max_scale=2.0**26 + 5
    )
    scaler.scale(torch.ones(()))
    scaler.update(2.0**26 + 5)
    saved = through_bytes({"s": scaler.state_dict()})["s"]
    assert saved["scale"] == 2.0**26 + 8  # the float32 nearest to max_scale
    fresh = ampscaler.GradScaler("cpu")
    fresh.load_state_dict(saved)
    fresh.scale(torch.ones(()))
    fresh.update(33554401.0)
    assert fresh.get_scale() == 33554400.0
