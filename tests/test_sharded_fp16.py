"""Sharded fp16 at scale: several process groups, FSDP2 with distributed checkpoints, resume
safety, a changed world size and tensor parallelism, on real gloo ranks (see
``sharded_scenarios``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampscaler
import multirank
import sharded_scenarios

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    names = ["fsdp2_resume", "fsdp2_resume_fused", "resume_mismatch", "tensor_parallel"]
    return multirank.spawn(2, names)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return multirank.spawn(4, ["grid_both", "grid_tp_only", "fsdp2_resume", "new_world_size"])


# ---------------------------------------------------------------- several groups


def test_a_tensor_and_a_data_parallel_group_agree_over_the_whole_grid(
    four_ranks: list[dict[str, Any]],
) -> None:
    traces = [results["grid_both"] for results in four_ranks]
    expected = [step in (1, 4) for step in range(multirank.STEPS)]
    for trace in traces:
        assert trace.skipped == expected
        assert trace.scales == traces[0].scales
        assert trace.overflow_ranks == {1: (2,), 4: (2,)}  # named across the grid
    for a, b in zip(traces[0].params, traces[3].params, strict=True):
        assert torch.equal(a, b)


def test_without_the_data_parallel_group_the_grid_diverges(
    four_ranks: list[dict[str, Any]],
) -> None:
    traces = [results["grid_tp_only"] for results in four_ranks]
    assert traces[2].skipped == traces[3].skipped == [s in (1, 4) for s in range(6)]
    assert traces[0].skipped == traces[1].skipped == [False] * 6
    assert traces[0].scales != traces[3].scales


def test_repeated_and_contained_groups_add_no_collective(world_of_one: dist.ProcessGroup) -> None:
    from ampscaler.distributed import RankAgreement

    assert RankAgreement([world_of_one, world_of_one]).groups == (world_of_one,)
    with pytest.raises(ampscaler.InvalidConfigError, match="empty list"):
        ampscaler.GradScaler("cpu", process_group=[])
    with pytest.raises(ampscaler.InvalidConfigError, match="ProcessGroup or a list"):
        ampscaler.GradScaler("cpu", process_group=[world_of_one, "tp"])  # type: ignore[list-item]


def test_a_destroyed_group_is_refused_at_construction(world_of_one: dist.ProcessGroup) -> None:
    group = dist.new_group([0])
    dist.destroy_process_group(group)
    with pytest.raises(ampscaler.InvalidConfigError, match="destroyed"):
        ampscaler.GradScaler("cpu", process_group=[world_of_one, group])


# ---------------------------------------------------------------- FSDP2 and DCP


@pytest.mark.parametrize(
    ("world", "scenario"),
    [(2, "fsdp2_resume"), (2, "fsdp2_resume_fused"), (4, "fsdp2_resume")],
)
def test_fsdp2_resumed_from_dcp_continues_bit_for_bit(
    two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]], world: int, scenario: str
) -> None:
    ranks = two_ranks if world == 2 else four_ranks
    for results in ranks:
        run = results[scenario]
        assert run["resumed"] == run["whole"][sharded_scenarios.SAVE_AFTER :]
        for a, b in zip(run["whole_params"], run["resumed_params"], strict=True):
            assert torch.equal(a, b)
        assert run["whole_state"] == run["resumed_state"]  # counters, hysteresis, guard windows
    reasons = [reason for _, reason in ranks[0][scenario]["whole"]]
    assert reasons[sharded_scenarios.OVERFLOW_STEP] == "nonfinite"
    assert reasons[sharded_scenarios.SPIKE_STEP] == "spike"
    assert reasons.count(None) == len(reasons) - 2


def test_ranks_that_loaded_different_checkpoints_stop_naming_them(
    two_ranks: list[dict[str, Any]],
) -> None:
    for results in two_ranks:
        message = results["resume_mismatch"]
        assert "scale is 1024 on rank 0, 4096 on rank 1" in message
        assert "load the same state_dict on every rank" in message


def test_a_checkpoint_from_two_ranks_loads_on_four(four_ranks: list[dict[str, Any]]) -> None:
    states = [results["new_world_size"] for results in four_ranks]
    assert all(state == states[0] for state in states)
    assert states[0]["hysteresis"] == 3 and states[0]["stats"]["steps"] == 3
    assert states[0]["stats"]["skipped"] == 1


# ---------------------------------------------------------------- tensor parallelism


def test_an_overflow_in_one_tensor_parallel_shard_skips_on_every_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = (results["tensor_parallel"] for results in two_ranks)
    assert rank0.skipped == rank1.skipped == [False, True, False, False]
    assert rank0.scales == rank1.scales
    assert rank0.overflow_ranks == rank1.overflow_ranks == {1: (1,)}
    assert "0.weight" in rank1.reports[1]


# ---------------------------------------------------------------- the example, under torchrun


@pytest.mark.slow
def test_the_fsdp2_example_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    first = multirank.torchrun_example("fsdp2.py", "--steps", "6", "--save-at", "3",
                                       "--checkpoint", folder)  # fmt: skip
    resumed = multirank.torchrun_example("fsdp2.py", "--steps", "6", "--resume",
                                         "--checkpoint", folder)  # fmt: skip
    assert "step 2: nonfinite" in first and "saved after 3 steps" in first
    assert "resumed after 3 steps" in resumed
    checksums = [out.strip().splitlines()[-1] for out in (first, resumed)]
    assert checksums[0].startswith("checksum ") and checksums[0] == checksums[1]
