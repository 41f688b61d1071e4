"""One rank of the 2-rank job of issue 34's exit hang: a plain DDP loop that builds torch's
scaler, run as ``python -m ampscaler run tests/exit_worker.py`` with ``AMPSCALER_PATCH`` set,
the environment a launcher gives (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

It ends as such scripts do, destroying the process group and returning; the test gives it a
hard timeout, so a rank that hangs at exit fails the test instead of hanging it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")  # ampscaler's, through the patch
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
