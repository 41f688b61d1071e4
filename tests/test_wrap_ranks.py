"""``scaler.wrap()`` on 2 gloo ranks (``wrap_scenarios``): DDP, FSDP2 with float16 parameters,
FSDP1 and an engine shaped like verl's train bit for bit as the same loops with torch's scaler
written in, on both ranks, with faults on one rank only."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import multirank
import wrap_scenarios

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _assert_same_everywhere(name: str, settings: int, *, replicated: bool = True) -> None:
    """On every rank, the wrapped run is torch's written-in one; ``replicated``: the runs (full
    parameters, norms) are the same on both ranks too."""
    results = multirank.spawn(2, [name])
    per_rank = [result[name] for result in results]
    assert len(per_rank[0]) == settings
    for rank_runs in per_rank:
        for setting, (theirs, ours) in rank_runs.items():
            assert ours.same_as(theirs), setting
            skips = ours.metrics["scaler/skips"]
            assert skips == len(wrap_scenarios.FAULTS), setting  # rank 1's faults, on every rank
    if replicated:
        for setting, (_, ours) in per_rank[0].items():
            assert ours.same_as(per_rank[1][setting][1]), setting


def test_ddp_with_and_without_no_sync() -> None:
    _assert_same_everywhere("wrap_ddp", settings=3)


def test_fsdp2_with_fp16_parameters_and_gradient_sync_off() -> None:
    """Also without a process group (DTensor's check agrees over the mesh) and with float16
    reduction (the scaled gradients go through FSDP's reduce-scatter as in torch's loop)."""
    _assert_same_everywhere("wrap_fsdp2", settings=4)


def test_fsdp1_flat_and_original_parameters() -> None:
    """FSDP1's parameters (flat or not) are this rank's shards, and torch's clip_grad_norm_ of
    them a local norm: compared rank by rank."""
    _assert_same_everywhere("wrap_fsdp1", settings=2, replicated=False)


def test_engine_shaped_loop_matches_sharded_grad_scaler_written_in() -> None:
    _assert_same_everywhere("wrap_engine", settings=1)
