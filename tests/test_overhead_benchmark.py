"""The statistics of ``benchmarks/overhead.py``: paired medians, least times and spreads.

The benchmark's verdicts rest on these few lines, so they are checked on numbers whose
answers are known (no timing here).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def overhead() -> Any:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import overhead
    finally:
        sys.path.remove(str(BENCHMARKS))
    return overhead


def test_the_median_pairs_rounds_so_a_drift_cancels(overhead: Any) -> None:
    """A machine that slows down round by round moves both arms alike: the paired median
    sees the constant difference."""
    drift = [1.0 + 0.1 * i for i in range(10)]
    timings = overhead.Timings(
        {"plain": drift, "torch": [t + 0.2 for t in drift], "ours": [t + 0.1 for t in drift]},
        blocks=5,
    )
    assert timings.overhead("torch") == pytest.approx(0.2)
    assert timings.ratio("ours", "torch") == pytest.approx(0.5)
    assert timings.spread(lambda block: block.ratio("ours", "torch")) == pytest.approx((0.5, 0.5))


def test_least_times_leave_out_rounds_that_other_work_slowed(overhead: Any) -> None:
    """One disturbed round (other work took the caches) moves a median of two rounds but not
    the least times."""
    rounds = {"plain": [1.0, 1.0, 5.0], "ours": [1.3, 9.0, 1.3]}
    least = overhead.Timings(rounds, blocks=1, stat="min")
    assert least.median("ours") == 1.3
    assert least.overhead("ours") == pytest.approx(0.3)


def test_the_spread_is_taken_over_whole_blocks(overhead: Any) -> None:
    """Ten rounds in three blocks: three blocks of three, the last round left out of the
    spread (not of the whole-run value)."""
    plain = [1.0] * 10
    ours = [1.1, 1.1, 1.1, 1.2, 1.2, 1.2, 1.4, 1.4, 1.4, 9.0]
    timings = overhead.Timings({"plain": plain, "ours": ours}, blocks=3)
    low, high = timings.spread(lambda block: block.overhead("ours"))
    assert (low, high) == pytest.approx((0.1, 0.4))


def test_a_call_split_pairs_the_step_with_the_plain_step(overhead: Any) -> None:
    """``--calls``: ``step`` is what a scaler's step adds to the plain step of the same round;
    ``scale`` and ``update`` are their own times."""
    plain = [1.0, 2.0, 3.0]
    timings = overhead.Timings({"plain": plain}, blocks=1)
    calls = {"scale": [0.1, 0.1, 0.2], "step": [1.5, 2.5, 3.5], "update": [0.3, 0.2, 0.3]}
    row = overhead.Row("case", timings, 3, False, {"torch": calls})
    assert row.call("torch", "step") == pytest.approx(0.5)
    assert row.call("torch", "scale") == pytest.approx(0.1)
    assert row.call("torch", "update") == pytest.approx(0.3)
