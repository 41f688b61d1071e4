"""Sharded training (FSDP2, ``fully_shard``) with ampscaler: pass the process group.

With sharded gradients each rank checks only its own shard, so an overflow can show up on one
rank alone. ``GradScaler(process_group=...)`` max-reduces every step's inf/NaN flag over the
group, so all ranks skip that step together and keep identical scales, and the overflow report
names the rank where it happened. The same option covers ZeRO-style optimizers and tensor or
pipeline parallelism (pass the group whose ranks share one optimizer step).

This script plants an inf in one rank's gradient shard at one step, as a real overflow inside
that shard would, and checks after every step that all ranks hold the same scale.

Run on CPU (gloo) or on GPUs (NCCL, one process per GPU)::

    torchrun --nproc-per-node 2 examples/sharded.py
    torchrun --nproc-per-node 4 examples/sharded.py --overflow-at 2 --overflow-rank 3
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _launch import init_distributed, report_step, run, sharded_mlp

from ampscaler import GradScaler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--overflow-at", type=int, default=3, help="step with the overflow")
    parser.add_argument("--overflow-rank", type=int, default=1, help="rank whose shard overflows")
    args = parser.parse_args()

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= args.overflow_rank < world:
        dist.destroy_process_group()
        parser.error(
            f"--overflow-rank {args.overflow_rank} is not a rank of this run (ranks 0 to "
            f"{world - 1}); pass one of them, or start more ranks (--nproc-per-node)"
        )
    if not 0 <= args.overflow_at < args.steps:
        dist.destroy_process_group()
        parser.error(f"--overflow-at must be a step from 0 to {args.steps - 1}")
    model = sharded_mlp(device)  # FSDP2: parameters and gradients are DTensor shards
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(
        device.type, init_scale=2.0**10, growth_interval=4, process_group=dist.group.WORLD
    )
    scaler.watch(model)  # parameter names for the overflow report

    data = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randn(8, 1, generator=data).to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            prediction = model(x)
        scaler.scale(torch.nn.functional.mse_loss(prediction.float(), y)).backward()
        if step == args.overflow_at and rank == args.overflow_rank:
            shard = model[0].weight.grad.to_local()  # this rank's part of the gradient
            shard.view(-1)[0] = float("inf")
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        report_step(step, scale_before, scaler, device)
        if scaler.last_overflow is not None:
            print(f"rank {rank}: {scaler.last_overflow}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
