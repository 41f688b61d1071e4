"""GradScaler(process_group=...): ranks agree on overflow, on real gloo process groups.

The multi-rank scenarios run in one launch of 2 ranks and one of 4 (see ``multirank``); each
test below asserts on its part of the results. The single-process tests use a world of one.
"""

from __future__ import annotations

import copy
import gc
import pickle
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampscaler
import multirank
from twins import assert_same_trace, make_script, run_twin

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

TWO_RANK_INJECTIONS = {"sgd": {1: [1], 4: [0]}, "fused_adam": {2: [1], 3: [1]}}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    names = ["sgd", "fused_adam", "no_group", "fsdp2", "fsdp2_no_group", "mismatch"]
    names += ["spike_sgd", "spike_fused_adam"]
    return multirank.spawn(2, names)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return multirank.spawn(4, ["sgd_four", "subgroups", "outsider", "mismatch_hysteresis"])


def assert_params_equal(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- sharded training, 2 and 4 ranks


@pytest.mark.parametrize("scenario", ["sgd", "fused_adam"])
def test_two_sharded_ranks_skip_exactly_the_injected_steps_like_one_torch_process(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    inject = TWO_RANK_INJECTIONS[scenario]
    optimizer = "sgd" if scenario == "sgd" else "adam"
    reference = multirank.train_reference(2, optimizer=optimizer, inject=inject)
    expected_skips = [step in inject for step in range(multirank.STEPS)]
    assert reference.skipped == expected_skips
    for rank in range(2):
        trace = two_ranks[rank][scenario]
        assert trace.skipped == expected_skips
        assert trace.scales == reference.scales
        assert_params_equal(trace.params, reference.params)
        assert trace.stats.skipped == len(inject)


def test_the_overflow_report_names_the_rank_that_overflowed(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in range(2):
        trace = two_ranks[rank]["sgd"]
        assert trace.overflow_ranks == {1: (1,), 4: (0,)}
    clean, culprit = two_ranks[0]["sgd"].reports[1], two_ranks[1]["sgd"].reports[1]
    assert "overflow on rank 1" in clean and "this rank's gradients were finite" in clean
    assert "hidden.bias (inf)" in culprit and "step 1 on rank 1" in culprit


def test_without_a_process_group_the_sharded_ranks_diverge(
    two_ranks: list[dict[str, Any]],
) -> None:
    """The failure the option prevents: only the overflowing rank skips and backs off."""
    rank0, rank1 = two_ranks[0]["no_group"], two_ranks[1]["no_group"]
    assert rank1.skipped[1] and not rank0.skipped[1]
    assert rank1.scales[1] == rank0.scales[0] / 2 and rank0.scales[1] == rank0.scales[0] * 2
    assert all(a != b for a, b in zip(rank0.scales[1:], rank1.scales[1:], strict=True))


@pytest.mark.parametrize("scenario", ["spike_sgd", "spike_fused_adam"])
def test_a_spike_on_one_rank_is_skipped_by_every_rank(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    rank0, rank1 = (results[scenario] for results in two_ranks)
    assert rank0 == rank1  # the same verdicts and scales on both ranks
    *steps, stats = rank0
    reasons = [reason for reason, _ in steps]
    assert reasons == ["spike" if s == multirank.SPIKE_AT else None for s in range(len(steps))]
    scales = [scale for _, scale in steps]
    assert scales[multirank.SPIKE_AT] == scales[multirank.SPIKE_AT - 1]  # no backoff
    assert (stats.spike_skips, stats.skipped) == (1, 0)


def test_four_ranks_agree_including_a_rank_without_gradients(
    four_ranks: list[dict[str, Any]],
) -> None:
    """Rank 3 owns only the unused layer: it holds no gradient and still takes part."""
    inject = {1: [0, 2], 3: [1]}
    reference = multirank.train_reference(4, optimizer="sgd", inject=inject)
    for rank in range(4):
        trace = four_ranks[rank]["sgd_four"]
        assert trace.skipped == [step in inject for step in range(multirank.STEPS)]
        assert trace.scales == reference.scales
        assert trace.overflow_ranks == {1: (0, 2), 3: (1,)}
        assert_params_equal(trace.params, reference.params)


def test_each_subgroup_agrees_on_its_own_and_reports_global_ranks(
    four_ranks: list[dict[str, Any]],
) -> None:
    traces = [four_ranks[rank]["subgroups"] for rank in range(4)]
    assert traces[0].skipped == traces[1].skipped == [False, False, False]
    assert traces[2].skipped == traces[3].skipped == [False, True, False]
    assert traces[0].scales == traces[1].scales != traces[2].scales == traces[3].scales
    assert traces[2].overflow_ranks == traces[3].overflow_ranks == {1: (2,)}


# ---------------------------------------------------------------- FSDP2 (DTensor gradients)


def test_fsdp2_ranks_agree_through_the_process_group(two_ranks: list[dict[str, Any]]) -> None:
    inject = {1: [1], 4: [0]}
    reference = multirank.train_reference(2, optimizer="sgd", inject=inject, fsdp_net=True)
    for rank in range(2):
        trace = two_ranks[rank]["fsdp2"]
        assert trace.skipped == [step in inject for step in range(multirank.STEPS)]
        assert trace.scales == reference.scales
        assert trace.overflow_ranks == {1: (1,), 4: (0,)}
        assert_params_equal(trace.params, reference.params)


def test_fsdp2_without_a_group_agrees_through_dtensor_but_cannot_name_ranks(
    two_ranks: list[dict[str, Any]],
) -> None:
    """DTensor's own check reduces found_inf over the mesh; the scaler then cannot tell where."""
    rank0, rank1 = two_ranks[0]["fsdp2_no_group"], two_ranks[1]["fsdp2_no_group"]
    assert rank0.skipped == rank1.skipped == [s == 1 for s in range(multirank.STEPS)]
    assert rank0.scales == rank1.scales
    assert rank0.overflow_ranks == rank1.overflow_ranks == {1: ()}


# ---------------------------------------------------------------- bad input


def test_differing_settings_are_named_on_every_rank_at_the_first_step(
    two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]
) -> None:
    for rank in range(2):
        message = two_ranks[rank]["mismatch"]
        assert "growth_interval is 2000 on rank 0, 1000 on rank 1" in message
        assert "scale is 65536 on rank 0, 1024 on rank 1" in message
        assert "backoff_factor" not in message
    for rank in range(4):
        message = four_ranks[rank]["mismatch_hysteresis"]
        assert "hysteresis is 1 on ranks 0, 1, 2, 2 on rank 3" in message
        assert "dynamic is True on ranks 0, 1, 3, False on rank 2" in message
        assert "growth_interval" not in message


def test_a_group_this_rank_is_not_in_is_refused(four_ranks: list[dict[str, Any]]) -> None:
    assert [four_ranks[rank]["outsider"] for rank in (0, 1)] == ["member", "member"]
    for rank in (2, 3):
        assert f"rank {rank}) is not a member of process_group" in four_ranks[rank]["outsider"]


def test_a_process_group_without_initialized_distributed_is_refused() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    stale = dist.group.WORLD
    dist.destroy_process_group()
    with pytest.raises(ValueError, match=r"torch\.distributed is not initialized") as caught:
        ampscaler.GradScaler("cpu", process_group=stale)
    assert isinstance(caught.value, ampscaler.InvalidConfigError)
    assert "init_process_group()" in str(caught.value)


def test_something_other_than_a_process_group_is_refused(world_of_one: dist.ProcessGroup) -> None:
    expected = r"must be a torch\.distributed\.ProcessGroup"
    with pytest.raises(ampscaler.InvalidConfigError, match=expected):
        ampscaler.GradScaler("cpu", process_group="world")  # type: ignore[arg-type]


# ---------------------------------------------------------------- one rank: torch semantics kept


@pytest.mark.parametrize("seed", [4, 6])  # one fused Adam, one not; both poisoned, clipped
def test_a_group_of_one_matches_torch_bit_for_bit(
    world_of_one: dist.ProcessGroup, seed: int
) -> None:
    """Accumulation, clipping after unscale_, sparse and fused optimizers, checkpoints."""
    script = make_script(seed)

    def grouped(*args: Any, **kwargs: Any) -> ampscaler.GradScaler:
        return ampscaler.GradScaler(*args, process_group=world_of_one, **kwargs)

    assert_same_trace(run_twin(script, grouped), run_twin(script, torch.amp.GradScaler))


def test_unscale_starts_the_reduction_and_step_waits_for_it(
    world_of_one: dist.ProcessGroup,
) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", process_group=world_of_one)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)
    assert scaler._agreement is not None
    assert len(scaler._iteration.launched) == 1  # per-step state: kept by the iteration
    scaler.step(opt)
    assert scaler._iteration.launched == []
    scaler.update()
    assert scaler.metrics("")["steps"] == 1


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_an_optimizer_without_gradients_on_any_rank_is_refused_as_in_torch(
    world_of_one: dist.ProcessGroup, fused: bool
) -> None:
    """torch's error, at torch's place: a non-fused optimizer in step(), a fused one (whose
    step torch lets through, with nothing to update) in update(). A rank without gradients
    beside ranks with them takes part with a clean flag (tests/test_rank_faults.py)."""
    param = torch.nn.Parameter(torch.ones(2))
    idle = torch.optim.Adam([param], fused=True) if fused else torch.optim.SGD([param], lr=0.1)
    for group in (world_of_one, None):
        scaler = ampscaler.GradScaler("cpu", process_group=group)
        scaler.scale(torch.ones(()))
        with pytest.raises(AssertionError, match="No inf checks were recorded") as raised:
            scaler.step(idle)
            scaler.update()
        assert isinstance(raised.value, ampscaler.ScalerUsageError)


def test_a_scaler_with_a_group_deep_copies_but_refuses_to_pickle(
    world_of_one: dist.ProcessGroup,
) -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=8.0, process_group=world_of_one)
    twin = copy.deepcopy(scaler)
    assert twin._agreement is not None and twin._agreement.groups == (world_of_one,)
    assert twin.get_scale() == 8.0
    with pytest.raises(TypeError, match=r"save scaler\.state_dict\(\)"):
        pickle.dumps(scaler)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("factory", [ampscaler.GradScaler, ampscaler.ShardedGradScaler])
def test_a_scaler_with_a_group_is_freed_with_its_last_reference(
    world_of_one: dist.ProcessGroup, factory: type, fused: bool
) -> None:
    """No reference cycle: a scaler, and with it its hold on the process groups, goes when the
    loop drops it, not at some later garbage collection (at interpreter exit, gloo's threads
    can then abort the process)."""
    kwargs = {} if factory is ampscaler.ShardedGradScaler else {"process_group": world_of_one}
    scaler = factory("cpu", init_scale=8.0, **kwargs)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    for poison in (1.0, float("inf"), 1.0):
        scaler.scale(model(torch.ones(1, 2)).sum() * poison).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler._agreement is not None
    gone = weakref.ref(scaler)
    gc.disable()
    try:
        del scaler
        assert gone() is None
    finally:
        gc.enable()
