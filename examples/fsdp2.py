"""FSDP2 in fp16 with ampscaler: train, checkpoint with torch.distributed.checkpoint, resume.

The model is sharded with ``fully_shard`` (DTensor parameters and gradients); the scaler gets
the process group so that every rank skips an overflowing step together. Model, optimizer and
scaler are saved together with DCP (``get_state_dict`` for the sharded model and optimizer, the
scaler as it is: DCP calls its ``state_dict``/``load_state_dict``). After loading, the ranks
compare their scalers at the next step and stop, naming the ranks, if they differ.

Each step accumulates two micro-batches, unscales, clips over the DTensor gradients and steps
fused or plain AdamW. One rank's shard overflows at ``--overflow-at`` (as a real overflow in
that shard would) and every rank skips it.

Run on CPU (gloo) or on GPUs (NCCL, one process per GPU); the second command resumes from the
checkpoint the first one wrote and ends where an uninterrupted run ends::

    torchrun --nproc-per-node 2 examples/fsdp2.py --steps 8 --save-at 4 --checkpoint /tmp/ckpt
    torchrun --nproc-per-node 2 examples/fsdp2.py --steps 8 --resume --checkpoint /tmp/ckpt

The last line rank 0 prints is a checksum of the parameters and the scaler's state, equal for
both ways of getting there. A 2-rank checkpoint also resumes on 4 ranks (``--nproc-per-node
4 --resume``): DCP reshards the model and optimizer, and the scaler's state is replicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _launch import (
    init_distributed,
    outcome,
    parse_resumable,
    print_checksum,
    resumable_run_arguments,
    run,
    sharded_mlp,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ampscaler import GradScaler, SpikeGuard


def build(
    device: torch.device, fused: bool
) -> tuple[torch.nn.Module, torch.optim.Optimizer, GradScaler]:
    model = sharded_mlp(device)  # FSDP2: parameters and gradients are DTensor shards
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    scaler = GradScaler(
        device.type, init_scale=2.0**10, growth_interval=4, hysteresis=2,
        process_group=dist.group.WORLD,
    )  # fmt: skip
    scaler.attach(SpikeGuard(window=16))  # its windows are checkpointed too
    scaler.watch(model)
    return model, optimizer, scaler


def checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: GradScaler
) -> dict[str, object]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "scaler": scaler}


def main() -> None:
    parser = resumable_run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--fused", action="store_true", help="fused AdamW")
    args = parse_resumable(parser)

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scaler = build(device, args.fused)
    start = 0
    if args.resume:
        state = checkpoint(model, optimizer, scaler)
        dcp.load(state, checkpoint_id=args.checkpoint)  # loads the scaler in place
        set_state_dict(
            model, optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        )  # fmt: skip
        start = int(scaler.metrics("")["steps"])
        if rank == 0:
            print(f"resumed after {start} steps at scale {scaler.get_scale():g}", flush=True)

    for step in range(start, args.steps):
        for micro in range(2):
            data = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(8, 16, generator=data).to(device)
            y = torch.randn(8, 1, generator=data).to(device)
            with torch.autocast(device.type, dtype=torch.float16):
                prediction = model(x)
            loss = torch.nn.functional.mse_loss(prediction.float(), y) / 2
            scaler.scale(loss).backward()
        if step == args.overflow_at and rank == world - 1:
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")  # this rank's shard
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # over the DTensor shards
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: {outcome(scaler)}; scale {scaler.get_scale():g}", flush=True)
        if args.save_at is not None and step + 1 == args.save_at:
            dcp.save(checkpoint(model, optimizer, scaler), checkpoint_id=args.checkpoint)
            if rank == 0:
                print(f"saved after {step + 1} steps to {args.checkpoint}", flush=True)

    print_checksum(model, scaler)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
