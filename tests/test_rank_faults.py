"""Faults across ranks become the same clear error on every rank, within seconds (issue #27).

One launch of 2 gloo ranks with a 10-second group timeout runs every scenario of
``fault_scenarios``: before the fix, a checkpoint loaded on one rank only left the ranks in
different collectives (one gathering the settings, the other reducing its flag) until gloo's
timeout, with an error that said nothing about the scaler.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampscaler
import fault_scenarios
import multirank
from fault_scenarios import LOAD_AT, Seen

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

KINDS = ["sgd", "fused"]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return multirank.spawn(
        2, fault_scenarios.NAMES, group_timeout_s=fault_scenarios.GROUP_TIMEOUT_S
    )


def _both(ranks: list[dict[str, Any]], name: str) -> tuple[Seen, Seen]:
    return ranks[0][name], ranks[1][name]


def _raised_where_expected(seen: Seen, kind: str, step: int = LOAD_AT) -> None:
    """Non-fused optimizers raise in the step() that reads the verdict; fused ones at the
    next check (the mismatched step was skipped on every rank)."""
    assert seen.at == ((step, "step") if kind == "sgd" else (step + 1, "step")), seen.at
    assert seen.seconds < fault_scenarios.GROUP_TIMEOUT_S / 2  # not a timeout


# What each rank's error must say and must not, per scenario: a checkpoint loaded on one rank
# (another one, or the very state it held: the state agrees, the programs do not); different
# checkpoints on every rank; a scale written on one rank. The fused step that found it was
# skipped, and one update moved each rank's scale by its own backoff in between.
MISMATCHES: dict[str, tuple[list[str], list[str]]] = {
    "load_on_one_rank": (
        ["load_state_dict() calls is 0 on rank 0, 1 on rank 1", "on rank 1", "scale is "],
        [],
    ),
    "load_own_state_on_one_rank": (
        ["load_state_dict() calls is 0 on rank 0, 1 on rank 1"],
        ["scale is"],
    ),
    "load_different_on_every_rank": (["scale is {low} on rank 0, {high} on rank 1"], ["calls"]),
    "scale_written_on_one_rank": (["scale is ", "on rank 1"], ["calls"]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", list(MISMATCHES))
def test_ranks_that_differ_get_the_same_error_on_every_rank_within_seconds(
    ranks: list[dict[str, Any]], scenario: str, kind: str
) -> None:
    said, unsaid = MISMATCHES[scenario]
    halve = 2 if kind == "fused" else 1  # the backoff of the skipped fused step
    said = [text.format(low=16 // halve, high=32 // halve) for text in said]
    errors = set()
    for seen in _both(ranks, f"{scenario}_{kind}"):
        assert seen.error is not None and seen.error.startswith("InvalidConfigError: ")
        assert all(text in seen.error for text in said), seen.error
        assert not any(text in seen.error for text in unsaid), seen.error
        assert "load the same state_dict on every rank or on none" in seen.error
        _raised_where_expected(seen, kind)
        errors.add(seen.error)
    assert len(errors) == 1  # word for word the same on both ranks


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_on_one_rank_is_found_even_of_the_value_every_rank_holds(
    ranks: list[dict[str, Any]], kind: str
) -> None:
    """The state is hashed anew only after a write other than the scaler's own update; a
    write on one rank only is then a difference of programs, as a reload on one rank is."""
    errors = set()
    for seen in _both(ranks, f"scale_rewritten_on_one_rank_{kind}"):
        assert seen.error is not None and seen.error.startswith("InvalidConfigError: ")
        assert "though they agree again now" in seen.error, seen.error
        _raised_where_expected(seen, kind)
        errors.add(seen.error)
    assert len(errors) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_checkpoint_on_every_rank_trains_on_as_one_process(
    ranks: list[dict[str, Any]], kind: str
) -> None:
    reference = fault_scenarios.same_run_uninterrupted(kind == "fused", LOAD_AT, 64.0)
    for seen in _both(ranks, f"load_same_on_every_rank_{kind}"):
        assert seen.error is None
        assert seen.scales == reference.scales and seen.skipped == reference.skipped
        assert all(torch.equal(a, b) for a, b in zip(seen.params, reference.params, strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_an_optimizer_without_gradients_on_any_rank_is_torchs_error_on_every_rank(
    ranks: list[dict[str, Any]], kind: str
) -> None:
    """torch's error at torch's place: step() for a non-fused optimizer, update() for a
    fused one (whose step torch lets through); the rank joins the collective, no hang."""
    for seen in _both(ranks, f"gradless_everywhere_{kind}"):
        assert seen.error is not None and seen.error.startswith("ScalerUsageError")
        assert "No inf checks were recorded" in seen.error
        assert seen.at == (0, "idle step" if kind == "sgd" else "update")
    beside = _both(ranks, f"gradless_beside_{kind}")
    if kind == "fused":  # beside an optimizer that has them, as in torch: nothing to refuse
        assert [seen.error for seen in beside] == [None, None]
    else:
        assert all(seen.at == (0, "idle step") for seen in beside)


@pytest.mark.parametrize("kind", KINDS)
def test_the_sharded_scaler_steps_an_optimizer_without_gradients_as_torchs_does(
    ranks: list[dict[str, Any]], kind: str
) -> None:
    """torch's ShardedGradScaler gives it a clean flag (and the scale grows); so does ours."""
    for rank in range(2):
        (ours, theirs) = ranks[rank][f"gradless_sharded_{kind}"]
        assert ours == theirs == (None, [2.0**11, 2.0**12, 2.0**13])


@pytest.mark.parametrize("kind", KINDS)
def test_a_guard_beside_an_overflow_on_one_rank_skips_on_every_rank(
    ranks: list[dict[str, Any]], kind: str
) -> None:
    """The guard's verdict joins the inf flag only once the flag is agreed (it was joined to
    the local flag before the reduction had finished)."""
    rank0, rank1 = _both(ranks, f"guard_beside_overflow_{kind}")
    assert rank0.error is None and rank1.error is None
    assert rank0.skipped == rank1.skipped == [s == 3 for s in range(fault_scenarios.STEPS)]
    assert rank0.scales == rank1.scales


def test_a_world_group_read_before_init_process_group_is_named_at_the_first_step(
    ranks: list[dict[str, Any]],
) -> None:
    """``process_group=dist.group.WORLD`` at import time is ``None``: the scaler cannot agree,
    and says so once the process turns out to be one of several ranks (not when
    ``process_group`` was left out, as with DDP)."""
    for rank in range(2):
        early, omitted = ranks[rank]["world_read_too_early"]
        assert len(early) == 1 and omitted == []
        assert f"rank {rank} of 2" in early[0]
        assert "torch.distributed.group.WORLD, which is None until init_process_group()" in early[0]
        assert "construct the scaler after init_process_group()" in early[0]


def test_process_group_none_alone_says_nothing() -> None:
    """A single process (torch.distributed never initialized) has nothing to agree on."""
    import warnings

    scaler = ampscaler.GradScaler("cpu", process_group=None)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt)
        scaler.update()
