"""The cost table holds: ampscaler dispatches no more aten ops, and reads the device no more
often, than torch's scaler in every configuration of ``benchmarks/dispatch_count.py``.

On a GPU every op is a kernel launch and every read a wait for the device, so this is the
machine-independent guard against a slower hot path. Rows where torch's arm does less (a
feature torch has no counterpart of: a spike guard, a measuring policy, agreement for a fused
optimizer) are held to a ceiling instead, ampscaler's defaults on the same loop plus what the
feature adds today, so that a regression still fails.

The table runs in its own process: a configuration with a ``process_group`` initializes a
one-rank gloo group, which must not leak into the other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "dispatch_count.py"

#: The configurations issue #36 asks the table for (others may add rows).
ASKED_FOR = {
    "plain SGD",
    "many small gradients",
    "fused Adam",
    "AdamW",
    "unscale_ + clipping",
    "process_group",
    "ShardedGradScaler",
    "HeadroomPolicy unmeasured",
    "HeadroomPolicy measured",
    "SpikeGuard",
    "flat_grads=True",
    "one_pass_fused=True + fused Adam",
}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return table


def test_the_table_covers_every_configuration_asked_for(rows: list[dict[str, Any]]) -> None:
    assert {row["name"] for row in rows} >= ASKED_FOR


def test_ampscaler_is_at_or_below_torch_in_every_configuration(
    rows: list[dict[str, Any]],
) -> None:
    over = [row for row in rows if not row["within"]]
    assert not over, "\n".join(
        f"{row['name']}: {row['ours_ops']} ops and {row['ours_reads']} host reads against "
        f"{row['torch']}'s {row['torch_ops']} and {row['torch_reads']}"
        + ("" if row["ceiling"] is None else f" (ceiling {row['ceiling']} ops)")
        for row in over
    )


def test_like_for_like_rows_compare_with_torch_itself(rows: list[dict[str, Any]]) -> None:
    """Only rows naming why torch's arm does less may use a ceiling: the defaults, the opt-in
    settings and a process group are held to torch's own counts."""
    ceilinged = {row["name"] for row in rows if row["ceiling"] is not None}
    assert ceilinged <= {
        "process_group + fused Adam",
        "HeadroomPolicy unmeasured",
        "HeadroomPolicy measured",
        "SpikeGuard",
        # scaler.wrap(): the loop never calls the scaler, so torch's arm is the loop with its
        # calls written in; wrap may add a constant (per device, dtype and micro-batch)
        *(f"wrap: {tensors} tensors" for tensors in (6, 30, 300)),
    }
    assert "process_group" not in ceilinged and "plain SGD" not in ceilinged


def test_the_counter_counts_host_reads_that_dispatch_nothing() -> None:
    """``tolist()`` reads without an aten op; the counter must see it as a read, and must not
    count what runs outside a phase or in an iteration not counted."""
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        import dispatch_count
    finally:
        sys.path.remove(str(BENCHMARK.parent))

    def iteration(counter: dispatch_count.Counter, index: int) -> None:
        values = torch.ones(2)
        values.sum()  # outside any phase: not counted
        with counter.phase("update"):
            values.mul(2).tolist()
            float(values.sum())

    counts = dispatch_count.count_arm(iteration, iterations=2)
    assert counts.reads == 2  # the tolist() and the float()
    assert counts.own == 3  # mul, sum, _local_scalar_dense
