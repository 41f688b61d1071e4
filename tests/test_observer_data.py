"""What the observers produce: step records as plain data (observe/plain.py), every field
round-tripping through a JSONL line, and the overflow reports they are made of."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ampscaler
from ampscaler.observe.localize import merge_reports
from ampscaler.observe.probe import ProbeResult, UnderflowCounts


def test_a_non_finite_loss_is_written_as_a_string_and_read_back(tmp_path: Path) -> None:
    record = ampscaler.StepRecord(
        step=1, scale=2.0, new_scale=1.0, skipped=True, time=0.0, loss=math.inf, attempt=1
    )
    line = record.to_json_line()
    assert json.loads(line)["loss"] == "inf"
    path = tmp_path / "steps.jsonl"
    path.write_text(line + "\n")
    assert ampscaler.read_log(path) == [record]


def test_nested_results_round_trip_with_their_types() -> None:
    counts = UnderflowCounts(4, 2, 1)
    probe = ProbeResult(
        8.0, 10, 9, 0.1, 0.5, -math.inf,
        modules={"fc": 0.5}, module_counts={"fc": counts}, activations=counts,
        activation_dtypes=("float16",),
    )  # fmt: skip
    report = ampscaler.OverflowReport(
        step=3, names=["w"], kinds={"w": "inf"}, scale=8.0, ranks=(0, 1), cause="loss"
    )
    record = ampscaler.StepRecord(
        step=3, scale=8.0, new_scale=4.0, skipped=True, time=1.0, overflow=report, probe=probe
    )
    data = json.loads(record.to_json_line())
    assert data["probe"]["headroom_log2"] == "-inf" and data["overflow"]["ranks"] == [0, 1]
    assert "spike" not in data and "attempt" not in data and "loss" not in data
    back = ampscaler.StepRecord.from_dict(data)
    assert back == record and isinstance(back.overflow.ranks, tuple)  # type: ignore[union-attr]


def test_a_merged_report_keeps_what_the_iterations_losses_say() -> None:
    """Two optimizers skipped for the same non-finite loss: the iteration's report keeps the
    micro-batch it came from (it was dropped when the reports were merged)."""
    first, second = (
        ampscaler.OverflowReport(
            step=5, names=[name], kinds={name: "nan"}, scale=4.0, cause="loss", micro_batch=2
        )
        for name in ("a", "b")
    )
    merged = merge_reports([first, second])
    assert merged.names == ["a", "b"] and merged.kinds == {"a": "nan", "b": "nan"}
    assert (merged.cause, merged.micro_batch, merged.step, merged.scale) == ("loss", 2, 5, 4.0)
