"""Multi-process scenarios for sharded fp16: several groups, FSDP2 with distributed checkpoints,
resume safety, a changed world size, tensor parallelism.

Importing this module adds its scenarios to ``multirank.SCENARIOS``, so that
``multirank.spawn(world, names)`` runs them. Checkpoints go to the folder ``multirank`` gives
every launch (``multirank.shared_dir()``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ampscaler
import multirank
from scaler_readings import skip_reason

RESUME_STEPS = 8
SAVE_AFTER = 4  # the checkpoint holds the state after steps 0-3
OVERFLOW_STEP = 2  # the last rank's shard overflows
SPIKE_STEP = 6  # rank 0's shard spikes (finite): the guard skips it


def grid_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Megatron's layout for 4 ranks: tensor-parallel pairs {0, 1}, {2, 3} and data-parallel
    pairs {0, 2}, {1, 3}; every rank creates every group, in the same order."""
    assert world == 4
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return tp[rank // 2], dp[rank % 2]


def grid(rank: int, world: int, *, both: bool) -> multirank.Trace:
    """ZeRO-2 style training over the grid; rank 2 overflows at steps 1 and 4. With ``both``
    groups every rank skips; with the tensor-parallel group alone only ranks 2 and 3 do."""
    tp, dp = grid_groups(rank, world)
    groups = [tp, dp] if both else tp
    return multirank.train_sharded(rank, world, optimizer="sgd", inject={1: [2], 4: [2]},
                                   group=groups)  # fmt: skip


def _fsdp2_parts(
    world: int, fused: bool, seed: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, ampscaler.GradScaler]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = multirank.FsdpNet()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = ampscaler.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2,
        process_group=dist.group.WORLD,
    )  # fmt: skip
    scaler.attach(ampscaler.SpikeGuard(sigma=50.0, window=4))  # few steps: a wide margin
    return model, opt, scaler


def _train_fsdp2(
    rank: int,
    world: int,
    parts: tuple[torch.nn.Module, torch.optim.Optimizer, ampscaler.GradScaler],
    steps: range,
    seen: list[tuple[float, str | None]],
) -> None:
    """Two micro-batches per step (different data on every rank), clipping over the DTensor
    gradients after ``unscale_``, an overflow and a spike in one rank's shard."""
    model, opt, scaler = parts
    for step in steps:
        for micro in range(2):
            x, y = multirank.batch(100 * step + 10 * micro + rank)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(((out.float() - y) ** 2).mean() / 2).backward()
        first = next(iter(model.parameters())).grad
        assert first is not None
        if step == OVERFLOW_STEP and rank == world - 1:
            first.to_local().view(-1)[0] = float("inf")
        if step == SPIKE_STEP and rank == 0:
            for p in model.parameters():
                p.grad.to_local().mul_(1000.0)  # type: ignore[union-attr]
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        seen.append((scaler.get_scale(), skip_reason(scaler)))


def _checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer,
                scaler: ampscaler.GradScaler) -> dict[str, Any]:  # fmt: skip
    model_state, opt_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": opt_state, "scaler": scaler}


def fsdp2_resume(rank: int, world: int, *, fused: bool) -> dict[str, Any]:
    """The uninterrupted run against one saved with DCP after ``SAVE_AFTER`` steps and resumed
    in fresh objects (built from another seed, so only the checkpoint can make them equal)."""
    path = os.path.join(multirank.shared_dir(), f"fsdp2-{world}-{fused}")
    whole = _fsdp2_parts(world, fused, seed=0)
    seen: list[tuple[float, str | None]] = []
    _train_fsdp2(rank, world, whole, range(SAVE_AFTER), seen)
    dcp.save(_checkpoint(*whole), checkpoint_id=path)
    _train_fsdp2(rank, world, whole, range(SAVE_AFTER, RESUME_STEPS), seen)

    resumed = _fsdp2_parts(world, fused, seed=1)
    state = _checkpoint(*resumed)
    dcp.load(state, checkpoint_id=path)  # the scaler is loaded through its load_state_dict
    set_state_dict(resumed[0], resumed[1], model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    again: list[tuple[float, str | None]] = []
    _train_fsdp2(rank, world, resumed, range(SAVE_AFTER, RESUME_STEPS), again)

    def params(model: torch.nn.Module) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]

    return {
        "whole": seen, "resumed": again,
        "whole_params": params(whole[0]), "resumed_params": params(resumed[0]),
        "whole_state": whole[2].state_dict(), "resumed_state": resumed[2].state_dict(),
    }  # fmt: skip


def resume_mismatch(rank: int, world: int) -> str:
    """Rank 1 loads a checkpoint with another scale: every rank stops at the next step."""
    model = multirank.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", **multirank.SCALER_KWARGS, process_group=dist.group.WORLD)
    scaler.scale(multirank.loss_of(model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    saved = scaler.state_dict()
    if rank == 1:
        saved["scale"] = saved["scale"] * 4
    scaler.load_state_dict(saved)
    scaler.scale(multirank.loss_of(model, 1)).backward()
    try:
        scaler.step(opt)
    except ampscaler.InvalidConfigError as error:
        return str(error)
    return "no error"


def new_world_size(rank: int, world: int) -> dict[str, Any]:
    """A scaler saved with DCP by ranks 0 and 1 alone loads on all four ranks."""
    pair = dist.new_group([0, 1])
    path = os.path.join(multirank.shared_dir(), "two-to-four")
    if rank < 2:
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12, hysteresis=3, process_group=pair)
        model = multirank.Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            poison = float("inf") if step == 1 else 1.0
            scaler.scale(multirank.loss_of(model, step) * poison).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        dcp.save({"scaler": scaler}, checkpoint_id=path, process_group=pair)
    dist.barrier()
    fresh = ampscaler.GradScaler("cpu", process_group=dist.group.WORLD)
    dcp.load({"scaler": fresh}, checkpoint_id=path)
    return fresh.state_dict()


def tensor_parallel(rank: int, world: int) -> multirank.Trace:
    """A column-parallel then row-parallel pair of linear layers over 2 ranks (DTensor);
    rank 1's shard of the first weight overflows at step 1."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", **multirank.SCALER_KWARGS, process_group=dist.group.WORLD)
    scaler.watch(model)
    trace = multirank.Trace()
    for step in range(4):
        x, y = multirank.batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(((out.float().squeeze(-1) - y) ** 2).mean()).backward()
        if step == 1 and rank == 1:
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        trace.record(scaler, step)
    return trace


multirank.SCENARIOS.update(
    {
        "grid_both": lambda r, w: grid(r, w, both=True),
        "grid_tp_only": lambda r, w: grid(r, w, both=False),
        "fsdp2_resume": lambda r, w: fsdp2_resume(r, w, fused=False),
        "fsdp2_resume_fused": lambda r, w: fsdp2_resume(r, w, fused=True),
        "resume_mismatch": resume_mismatch,
        "new_world_size": new_world_size,
        "tensor_parallel": tensor_parallel,
    }
)
