"""What the distributed examples share: starting the process group and comparing scales."""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from ampscaler import GradScaler


def init_distributed() -> torch.device:
    """NCCL and this process's GPU when there are GPUs, else gloo on the CPU (torchrun's env)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sharded_mlp(device: torch.device) -> torch.nn.Sequential:
    """A small MLP sharded with FSDP2 over every rank (each linear layer, then the whole):
    its parameters and gradients are DTensor shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def report_step(step: int, scale_before: float, scaler: GradScaler, device: torch.device) -> None:
    """Check that every rank holds the same scale; rank 0 prints the step's outcome."""
    mine = torch.tensor([scaler.get_scale()], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    scales = torch.cat(gathered).tolist()
    assert len(set(scales)) == 1, f"ranks disagree on the scale: {scales}"
    if dist.get_rank() == 0:
        outcome = "skipped on every rank" if scaler.last_step_skipped else "stepped"
        print(
            f"step {step}: {outcome}; scale {scale_before:g} -> {scales[0]:g} on all "
            f"{len(scales)} ranks",
            flush=True,
        )


def outcome(scaler: GradScaler) -> str:
    """How the last iteration ended: ``"stepped"``, ``"nonfinite"`` (inf/NaN gradients or loss:
    ``scaler.last_overflow`` says which), or ``"spike"`` (a guard vetoed finite gradients)."""
    if not scaler.last_step_skipped:
        return "stepped"
    return "spike" if scaler.last_overflow is None else "nonfinite"


def resumable_run_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the arguments of a run that saves a DCP checkpoint or resumes from one;
    parse with :func:`parse_resumable`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint", required=True, help="folder for the DCP checkpoint")
    parser.add_argument("--save-at", type=int, default=None, help="save after this many steps")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    parser.add_argument("--overflow-at", type=int, default=2, help="step with an overflow")
    return parser


def parse_resumable(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if args.resume and args.save_at is not None:
        parser.error("--resume continues a saved run; --save-at starts one: pass one of them")
    return args


def print_checksum(model: torch.nn.Module, scaler: GradScaler) -> None:
    """Rank 0 prints the final scale and a checksum of the full parameters and the scaler's
    state, equal for an uninterrupted run and a resumed one."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.full_tensor().detach().cpu().numpy().tobytes())  # type: ignore[attr-defined]
    digest.update(repr(sorted(scaler.state_dict().items())).encode())
    if dist.get_rank() == 0:
        print(f"final scale {scaler.get_scale():g}, counts {scaler.metrics('')}")
        print(f"checksum {digest.hexdigest()[:16]}", flush=True)


def run(main: Callable[[], None]) -> None:
    """Run ``main``, then free what it held (the process group included) while Python is whole.

    DDP and FSDP keep the process group alive in reference cycles that only the garbage
    collector frees. Left to interpreter shutdown, gloo's worker threads may still be releasing
    the last collective's tensors, which takes the GIL, and the process aborts after training
    ("terminate called without an active exception"): 4 runs in 8 of examples/sharded.py on a
    loaded 2-core machine, none in 8 with this collection.
    """
    main()
    gc.collect()
