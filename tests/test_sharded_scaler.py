"""ampscaler.ShardedGradScaler: torch's FSDP scaler's API, and its results bit for bit on real
gloo ranks (FSDP2 and FSDP1, overflows in one rank's shard); see ``sharded_twins``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import ampscaler
import multirank
import sharded_twins

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return multirank.spawn(2, ["sharded_fsdp2", "sharded_fsdp1"])


@pytest.mark.parametrize("scenario", ["sharded_fsdp2", "sharded_fsdp1"])
def test_matches_torchs_sharded_scaler_bit_for_bit(
    two_ranks: list[dict[str, Any]], scenario: str
) -> None:
    expected_skips = [step in sharded_twins.INJECT for step in range(sharded_twins.STEPS)]
    for results in two_ranks:
        theirs, ours = results[scenario]["torch"], results[scenario]["ampscaler"]
        assert theirs.skipped == expected_skips  # an overflow on either rank skips both
        assert ours.skipped == ours.reported == theirs.skipped
        assert ours.scales == theirs.scales
        assert max(ours.scales) > sharded_twins.SCALER_ARGS["init_scale"]  # it grew too
        for a, b in zip(ours.params, theirs.params, strict=True):
            assert torch.equal(a, b)
    rank0, rank1 = (results[scenario]["ampscaler"] for results in two_ranks)
    for a, b in zip(rank0.params, rank1.params, strict=True):
        assert torch.equal(a, b)


def test_takes_torchs_arguments_in_torchs_order() -> None:
    theirs = list(inspect.signature(TorchSharded).parameters)
    ours = list(inspect.signature(ampscaler.ShardedGradScaler).parameters)
    assert ours[: len(theirs)] == theirs
    scaler = ampscaler.ShardedGradScaler("cpu", 8.0, 0.25, 4.0, 3)  # backoff before growth
    assert (scaler.get_backoff_factor(), scaler.get_growth_factor()) == (0.25, 4.0)
    assert scaler.get_growth_interval() == 3 and scaler.process_group is None


def test_a_float16_loss_scales_to_float16_and_float16_gradients_unscale() -> None:
    scaler = ampscaler.ShardedGradScaler("cpu", init_scale=4.0, process_group=None)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        loss = torch.tensor(3.0, dtype=torch.float16)
        assert scaler.scale(loss).dtype == torch.float16
        nested = scaler.scale([loss, (torch.tensor(1.0),)])
        assert nested[0].dtype == torch.float16 and nested[1][0].dtype == torch.float32
        model = torch.nn.Linear(2, 1).half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).sum()).backward()
        scaler.unscale_(opt)  # torch's sharded scaler accepts float16 gradients too
        assert torch.equal(model.bias.grad, torch.ones(1, dtype=torch.float16))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="FP16"):
            ampscaler.GradScaler("cpu")._unscale_grads_(opt, torch.ones(()), torch.zeros(()), False)
    finally:
        dist.destroy_process_group()


def test_without_torch_distributed_the_first_scale_says_what_to_do() -> None:
    scaler = ampscaler.ShardedGradScaler("cpu")  # building it before init_process_group is fine
    with pytest.raises(ampscaler.InvalidConfigError, match="init_process_group"):
        scaler.scale(torch.tensor(1.0))
    assert ampscaler.ShardedGradScaler("cpu", enabled=False).scale(torch.ones(1)).item() == 1.0


def test_state_dict_is_torchs(world_of_one: dist.ProcessGroup) -> None:
    ours = ampscaler.ShardedGradScaler("cpu", init_scale=2.0**5, growth_interval=7)
    theirs = TorchSharded("cpu", init_scale=2.0**5, growth_interval=7)
    theirs_state = theirs.state_dict()
    assert {key: ours.state_dict()[key] for key in theirs_state} == theirs_state
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs_state)
    assert repr(ours).startswith("ShardedGradScaler(device='cpu', scale=32")


def test_a_float16_loss_that_overflows_once_scaled_skips_as_in_torch(
    world_of_one: dist.ProcessGroup,
) -> None:
    """2 * 2**16 is beyond float16's range: the loss's gradient overflows and the step is
    skipped, as in torch; the scaled loss stays float16."""
    runs = []
    for scaler in (TorchSharded("cpu"), ampscaler.ShardedGradScaler("cpu")):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.ones(1, 2)).sum() * 0 + 2.0  # a float16 loss of 2
            scaled = scaler.scale(loss)
            scaled.backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        params = [p.detach().clone() for p in model.parameters()]
        runs.append((scaled.dtype, scaler.get_scale(), params))
    (dtype, scale, params), (our_dtype, our_scale, our_params) = runs
    assert dtype == our_dtype == torch.float16 and scale == our_scale == 2.0**15
    assert all(torch.equal(a, b) for a, b in zip(params, our_params, strict=True))
