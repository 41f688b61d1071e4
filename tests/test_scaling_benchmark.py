"""benchmarks/scaling.py runs (its --quick mode) and its table says what the issue asks: the
arms, the columns, and the checks per workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_quick_benchmark_runs_every_arm_on_the_chosen_workloads(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    workloads = "token-sum,tiny-loss,mlp"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--quick",
         "--workloads", workloads, "--json", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(workloads.split(","))
    arms = {"torch", "ampscaler", "torch+attempts", "headroom", "headroom+attempts"}
    for name, result in results.items():
        rows = result["rows"]
        assert arms | {"hysteresis-2"} == set(rows), name
        for row in rows.values():
            assert {"lost", "lost_outliers", "skips", "extra_passes", "mean_log2_scale"} <= set(row)
            assert {"flushed", "held_out_vs_fp32", "clean_time_vs_torch"} <= set(row)
        # What attempts() costs a clean batch, paired with the same arm without it.
        for arm in ("torch+attempts", "headroom+attempts"):
            assert rows[arm]["attempts_cost"] is None or rows[arm]["attempts_cost"] > 0
        assert rows["torch"]["attempts_cost"] is None
        # ampscaler's defaults are torch's (the script exits otherwise) ...
        assert rows["ampscaler"]["mean_log2_scale"] == rows["torch"]["mean_log2_scale"]
    # ... and the warm-up from 2**16 loses no batch with attempts() (torch's rule alone does).
    warm_up = results["token-sum"]["rows"]
    assert warm_up["torch"]["lost"] > 0 and warm_up["torch+attempts"]["lost"] == 0
    # The loss that flushes at scale 1 trains under HeadroomPolicy (it stalled at 1 before).
    tiny = results["tiny-loss"]["rows"]["headroom+attempts"]
    assert tiny["mean_log2_scale"] > 8 and abs(tiny["held_out_vs_torch"] - 1) < 0.1


def test_attempts_cost_pairs_block_minima_on_batches_both_ran_clean() -> None:
    """att.: per block of 10 batches both arms ran clean, the ratio of the blocks' fastest; a
    batch slowed down by load in one arm only does not move it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import scaling
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    ours, twin = scaling.Tally(), scaling.Tally()
    for number in range(40):
        twin.clean_by_batch[number] = 1.0 + number % 3
        ours.clean_by_batch[number] = 1.02 * (1.0 + number % 3) + (5.0 if number % 7 == 0 else 0)
    twin.clean_by_batch.pop(3)  # a batch the twin replayed: left out of the pairs
    cost = scaling.attempts_cost(ours, twin)
    assert cost is not None and cost[0] == pytest.approx(1.02)
    assert scaling.attempts_cost(ours, scaling.Tally()) is None  # no pair: nothing to say


def _scaling_module() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import scaling
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return scaling


def test_seeds_move_the_weights_and_the_data_and_seed_0_keeps_the_batches() -> None:
    """--seeds: seed 0 trains on the batches of the runs before seeds, whatever --held-out;
    another seed draws other batches and other initial weights."""
    scaling = _scaling_module()
    (four,) = scaling.workloads(5, {"mlp"}, 0, 4)
    (many,) = scaling.workloads(5, {"mlp"}, 0, 32)
    (other,) = scaling.workloads(5, {"mlp"}, 1, 4)
    assert len(four.held_out) == 4 and len(many.held_out) == 32
    for a, b in zip(four.batches, many.batches, strict=True):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert not torch.equal(four.batches[0].inputs, other.batches[0].inputs)
    first, second = four.build(four.seed), other.build(other.seed)
    assert other.seed == 1
    assert not torch.equal(next(first.parameters()), next(second.parameters()))


def test_held_out_ratio_errors_over_the_set_and_over_seeds() -> None:
    scaling = _scaling_module()
    # ours = 2 * theirs on every batch: the ratio is exact, its sampling error 0.
    assert scaling.held_out_error([2.0, 4.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(0.0)
    # ours - 1.0 * theirs = [+1, -1] / mean(theirs) = 2: stdev sqrt(2) / (sqrt(2) * 2).
    assert scaling.held_out_error([3.0, 1.0], [2.0, 2.0]) == pytest.approx(0.5)
    assert scaling.over_seeds([1.0]) == (1.0, None)
    mean, error = scaling.over_seeds([0.98, 1.02])
    assert mean == pytest.approx(1.0) and error == pytest.approx(0.02)


def test_block_ratios_take_each_sides_fastest_per_block() -> None:
    scaling = _scaling_module()
    ours = [1.1, 5.0, 1.2, 2.2, 2.4, 9.0]
    theirs = [7.0, 1.0, 1.0, 2.0, 8.0, 2.0]
    assert scaling.block_ratios(ours, theirs, 3) == pytest.approx([1.1, 1.1])
    assert scaling.block_ratios(ours, theirs, 4) == pytest.approx([1.1])  # the rest left out


def test_the_same_model_timing_leaves_out_measured_rounds() -> None:
    """attempts()'s cost is timed on one copy of the arm without the loop: every round kept
    under torch's rule; none while HeadroomPolicy measures every iteration (its young
    history), since a measured iteration is not a clean batch's cost."""
    scaling = _scaling_module()
    torch.set_num_threads(1)
    (work,) = scaling.workloads(6, {"mlp"}, 0, 2)
    trainers = scaling.run_workload(work, 1000)
    arms = {arm.name: arm for arm in scaling.ARMS}
    rounds = 2 * scaling.ROUND_BLOCK
    paired = scaling.time_attempts(work, trainers["ampscaler"], arms["torch+attempts"], rounds, 1e9)
    assert paired is not None and paired.rounds == rounds and paired.blocks == 2
    assert all(value > 0 for value in (*paired.cost, *paired.control))
    young = scaling.time_attempts(
        work, trainers["headroom"], arms["headroom+attempts"], rounds, 1e9
    )
    assert young is None
    # The trained arm itself is left as it was: the timing runs on a copy.
    assert trainers["ampscaler"].tally.tries == len(work.batches)


def test_the_same_model_timing_puts_every_side_in_every_place(monkeypatch: Any) -> None:
    """Over four rounds the loop's side (B) and the control's (Y) run in every place of a
    round: where the middle of each half runs 1% faster, the cost still reads the loop's own
    time, and the control 1 (A B B A in every round read 1.01 and 0.99)."""
    scaling = _scaling_module()
    (work,) = scaling.workloads(6, {"mlp"}, 0, 2)
    trainers = scaling.run_workload(work, 1000)
    places = iter(range(10**6))

    def fake(work: Any, trainer: Any, batch: Any, loop: bool) -> tuple[float, bool]:
        fast = next(places) % 4 in (1, 2)  # the second and third of each half
        return (0.99 if fast else 1.0) + (0.02 if loop else 0.0), True

    monkeypatch.setattr(scaling, "timed_try", fake)
    arm = {arm.name: arm for arm in scaling.ARMS}["torch+attempts"]
    rounds = 2 * scaling.ROUND_BLOCK
    paired = scaling.time_attempts(work, trainers["ampscaler"], arm, rounds, 1e9)
    assert paired is not None and paired.blocks == 2
    # Each block's fastest: both sides in the fast places, the loop 0.02 slower per batch.
    assert paired.cost[0] == pytest.approx((2 * 0.99 + 0.04) / (2 * 0.99))
    assert paired.control[0] == pytest.approx(1.0)


def test_gpt2_trains_on_the_standard_librarys_packages_not_on_our_docs() -> None:
    """gpt2's batches come from text fixed for a Python version (its packages' sources), so
    an edit of docs/ leaves the benchmark's numbers alone (they came from docs/*.md)."""
    pytest.importorskip("transformers")
    scaling = _scaling_module()
    (work,) = scaling.workloads(5, {"gpt2"}, 0, 2)
    text = scaling.stdlib_text(400_000, "*/*.py")
    train, held = scaling.text_batches(text, 5, 8, 32, 3, 2)
    for ours, theirs in zip(work.batches + work.held_out, train + held, strict=True):
        assert torch.equal(ours.inputs, theirs.inputs)
    assert b"site-packages" not in text and b"HeadroomPolicy" not in text


def test_the_held_out_bar_is_a_cost_judged_on_its_upper_bound() -> None:
    scaling = _scaling_module()
    assert scaling.held_out_claim(0.9388, 0.0227, 4)[1]  # 6% lower: no cost
    assert "6.1% lower" in scaling.held_out_claim(0.9388, 0.0227, 4)[0]
    assert scaling.held_out_claim(1.0000, 0.0013, 8)[1]
    assert not scaling.held_out_claim(1.02, None, 1)[1]  # 2% above
    text, met = scaling.held_out_claim(1.0, 0.01, 4)  # could be 2% above
    assert not met and "too wide to tell 1%" in text


def test_a_cost_the_run_did_not_time_is_not_a_failed_check() -> None:
    scaling = _scaling_module()
    row: dict[str, Any] = {
        "lost": 0, "mean_log2_scale": 16.0, "flushed": 0.0, "flushed_from_batch_1": 0.0,
        "held_out_vs_torch": 1.0, "held_out_vs_torch_se": None, "held_out_vs_torch_seeds": [1.0],
        "outlier_gap": None, "attempts_cost": None,
    }  # fmt: skip
    rows = {arm: dict(row) for arm in ("torch", "torch+attempts", "headroom+attempts")}
    verdicts = dict(scaling.checks(rows))
    timed = {claim: met for claim, met in verdicts.items() if "clean batch" in claim}
    assert list(timed.values()) == [None, None]  # "--", not "NO"
    assert all(met is True for claim, met in verdicts.items() if claim not in timed)
    timing = {"attempts_cost_quartiles": (1.0, 1.03), "control": 1.0, "control_quartiles": (1, 1)}
    rows["torch+attempts"].update(timing, attempts_cost=1.02)
    rows["headroom+attempts"].update(timing, attempts_cost=1.005)
    timed = [met for claim, met in scaling.checks(rows) if "clean batch" in claim]
    assert timed == [False, True]
    assert [scaling.VERDICTS[met] for met in (True, False, None)] == ["yes", "NO", "--"]
