"""Multi-process scenarios: ampscaler's ShardedGradScaler against torch's, side by side, on FSDP2
and FSDP1 ranks with overflows injected into one rank's shard.

Importing this module adds its scenarios to ``multirank.SCENARIOS``. Each scenario trains the
same model twice in every rank, once with torch's ``ShardedGradScaler`` and once with
ampscaler's, and returns both :class:`Run` records for the test to compare bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import ampscaler
import multirank

STEPS = 7
MICRO_BATCHES = 2
# step -> ranks whose shard overflows at that step (each rank alone, then both)
INJECT: Mapping[int, Iterable[int]] = {2: [1], 4: [0], 5: [0, 1]}
SCALER_ARGS: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


@dataclass
class Run:
    """What one rank saw in one run: the scale after each step, which steps were skipped (for
    torch's scaler: the scale went down), and the full parameters at the end."""

    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    reported: list[bool] = field(default_factory=list)  # ampscaler's last_step_skipped
    params: list[torch.Tensor] = field(default_factory=list)


def overflow_in_own_shard(model: torch.nn.Module, rank: int, step: int) -> None:
    """Put an inf into this rank's shard of the first gradient if ``INJECT`` says so."""
    if rank in INJECT.get(step, ()):
        grad = next(iter(model.parameters())).grad
        assert grad is not None
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = float("inf")


def train(
    model: torch.nn.Module,
    scaler: torch.amp.GradScaler | ampscaler.GradScaler,
    rank: int,
    full: Callable[[torch.Tensor], torch.Tensor],
) -> Run:
    """Micro-batches of fp16 losses (the scaled loss stays fp16), unscale_, clip, step, update.
    AdamW, except for float16 gradients (FSDP1 here), which only SGD steps fp32 weights with."""
    grads16 = isinstance(model, FullyShardedDataParallel)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if grads16
        else torch.optim.AdamW(model.parameters(), lr=1e-2)
    )
    run = Run()
    for step in range(STEPS):
        for micro in range(MICRO_BATCHES):
            x, y = multirank.batch(100 * step + 10 * micro + rank)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = ((out - y.half()) ** 2).mean() / MICRO_BATCHES  # float16, as FSDP gives it
            scaler.scale(loss).backward()
        overflow_in_own_shard(model, rank, step)
        before = scaler.get_scale()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        run.scales.append(scaler.get_scale())
        run.skipped.append(scaler.get_scale() < before)
        if isinstance(scaler, ampscaler.GradScaler):
            run.reported.append(scaler.last_step_skipped)
    run.params = [full(p.detach()).clone() for p in model.parameters()]
    return run


def fsdp2_model(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = multirank.FsdpNet()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def fsdp1_model(world: int) -> torch.nn.Module:
    """FSDP1 whose gradients stay float16 (reduced in float16, kept in low precision)."""
    torch.manual_seed(0)
    half = MixedPrecision(
        param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True
    )
    return FullyShardedDataParallel(
        multirank.FsdpNet(), device_id=torch.device("cpu"), mixed_precision=half
    )


def side_by_side(rank: int, world: int, *, fsdp: int) -> dict[str, Run]:
    """The same training with torch's and with ampscaler's ShardedGradScaler."""
    if fsdp == 2:
        build, full = fsdp2_model, lambda p: p.full_tensor()  # type: ignore[attr-defined]
    else:
        build, full = fsdp1_model, _gathered
    return {
        "torch": train(build(world), TorchSharded("cpu", **SCALER_ARGS), rank, full),
        "ampscaler": train(
            build(world), ampscaler.ShardedGradScaler("cpu", **SCALER_ARGS), rank, full
        ),
    }


def _gathered(shard: torch.Tensor) -> torch.Tensor:
    """An FSDP1 flat shard, gathered from every rank."""
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard.contiguous())
    return torch.cat(parts)


multirank.SCENARIOS.update(
    {
        "sharded_fsdp2": lambda r, w: side_by_side(r, w, fsdp=2),
        "sharded_fsdp1": lambda r, w: side_by_side(r, w, fsdp=1),
    }
)
