"""benchmarks/scaling.py runs (its --quick mode) and its table says what the issue asks: the
arms, the columns, and the checks per workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
