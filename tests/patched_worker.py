"""What the worker-process tests run in processes they do not patch by hand: code that only
knows torch's scaler classes, the way a framework's worker does.

``describe`` runs in a ``multiprocessing`` pool's worker; ``python tests/patched_worker.py``
runs as every rank of ``torchrun ... -m ampscaler run tests/patched_worker.py``, and rank 0
prints every rank's report as one JSON line.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch


def describe(scaler: Any) -> dict[str, Any]:
    """The class of ``scaler`` and the settings a patch would have given it."""
    state = scaler.state_dict()
    return {
        "class": f"{type(scaler).__module__}.{type(scaler).__qualname__}",
        "hysteresis": state.get("hysteresis"),
        "growth_interval": state["growth_interval"],
        "scale": scaler.get_scale(),
    }


def build_torch_scaler() -> dict[str, Any]:
    """A pool task: build torch's scaler as a framework would."""
    return describe(torch.amp.GradScaler("cpu", growth_interval=400))


def main() -> None:
    """One rank: torch's FSDP scaler, verbatim as verl builds it, takes one step."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    scaler = ShardedGradScaler(growth_interval=400)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 2)).sum() * (float("inf") if dist.get_rank() == 1 else 1.0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    report = describe(scaler)
    report["rank"] = dist.get_rank()
    report["skipped"] = getattr(scaler, "last_step_skipped", None)
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:  # one line: the ranks' prints would interleave
        print(json.dumps(reports), flush=True)
    dist.barrier()  # no rank tears gloo down while another still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
