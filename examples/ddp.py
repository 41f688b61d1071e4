"""DistributedDataParallel with ampscaler: no process group needed.

DDP all-reduces the gradients during ``backward()``, so every rank holds the same gradients,
finds the same inf/NaN and moves its scale the same way: the plain ``GradScaler`` already
agrees across ranks. This script injects a loss spike on rank 0 at one step, shows every rank
skipping it, and checks after every step that all ranks hold the same scale.

Run on CPU (gloo) or on GPUs (NCCL, one process per GPU)::

    torchrun --nproc-per-node 2 examples/ddp.py
    torchrun --nproc-per-node 2 examples/ddp.py --steps 12 --spike-at 5
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _launch import init_distributed, report_step, run
from torch.nn.parallel import DistributedDataParallel

from ampscaler import GradScaler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--spike-at", type=int, default=3, help="step with a loss spike on rank 0")
    args = parser.parse_args()

    device = init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = GradScaler(device.type, init_scale=2.0**16, growth_interval=4)  # no process group

    data = torch.Generator().manual_seed(rank)  # each rank reads different data
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data).to(device)
        y = torch.randn(8, 1, generator=data).to(device)
        with torch.autocast(device.type, dtype=torch.float16):
            prediction = ddp(x)
        loss = torch.nn.functional.mse_loss(prediction.float(), y)
        if step == args.spike_at and rank == 0:
            loss = loss * 1e6  # its fp16 gradients overflow, on rank 0 only
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()  # DDP all-reduces: the inf reaches every rank
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        report_step(step, scale_before, scaler, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
