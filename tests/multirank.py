"""Multi-process scenarios for the distributed tests: real gloo groups on 127.0.0.1.

``spawn(world, scenarios)`` starts ``world`` processes once, runs the named scenarios in order
in every one of them over one process group, and returns ``results[rank][scenario]``. Each
scenario is a function ``(rank, world) -> object`` that records what the test asserts on.

The training scenarios shard like ZeRO-2: every rank holds the same model and data, keeps only
the gradients of the parameters it owns (parameter ``i`` belongs to rank ``i % world``), steps
an optimizer over those alone, and then broadcasts what it owns. A single process training the
whole model with ``torch.amp.GradScaler`` is the reference they must match bit for bit.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ampscaler
from scaler_readings import counts, skip_reason
from user_policy import HalveOrDouble

STEPS = 6
TIMEOUT_S = 90.0


class Net(torch.nn.Module):
    """Three trained parameters, then a spare layer the forward pass never uses (no gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1, bias=False)
        self.spare = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x))).squeeze(-1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return ((out.float() - y) ** 2).mean()


def make_optimizer(params: list[torch.nn.Parameter], kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.Adam(params, lr=0.01, fused=True)


@dataclass
class Trace:
    """What one rank saw: after every step its scale and skip flag; at the end its parameters."""

    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    overflow_ranks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    reports: dict[int, str] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)
    stats: ampscaler.ScalerStats | None = None

    def record(self, scaler: ampscaler.GradScaler, step: int) -> None:
        """Note the scale, the skip and the overflow report after ``step``'s ``update()``."""
        self.scales.append(scaler.get_scale())
        self.skipped.append(scaler.last_step_skipped)
        report = scaler.last_overflow
        if report is not None:
            self.overflow_ranks[step] = tuple(report.ranks)
            self.reports[step] = str(report)


SCALER_KWARGS: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}


def train_sharded(
    rank: int,
    world: int,
    *,
    optimizer: str,
    inject: Mapping[int, Iterable[int]],
    group: dist.ProcessGroup | list[dist.ProcessGroup] | None,
    scaler_kwargs: Mapping[str, Any] = SCALER_KWARGS,
) -> Trace:
    """ZeRO-2 style training; ``inject[step]`` lists the ranks that overflow at ``step``."""
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    mine = [p for i, p in enumerate(params) if i % world == rank]
    opt = make_optimizer(mine, optimizer)
    scaler = ampscaler.GradScaler("cpu", **scaler_kwargs, process_group=group)
    scaler.watch(model)
    trace = Trace()
    for step in range(STEPS):
        scaler.scale(loss_of(model, step)).backward()
        for i, p in enumerate(params):
            if i % world != rank:
                p.grad = None  # ZeRO-2: a rank keeps only the gradients of what it owns
        if rank in inject.get(step, ()):
            mine[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % world)
        trace.record(scaler, step)
    trace.params = [p.detach().clone() for p in params]
    trace.stats = counts(scaler)
    return trace


def train_reference(
    world: int, *, optimizer: str, inject: Mapping[int, Iterable[int]], fsdp_net: bool = False
) -> Trace:
    """One process, the whole model, ``torch.amp.GradScaler``, the same overflows."""
    torch.manual_seed(0)
    model: torch.nn.Module = FsdpNet() if fsdp_net else Net()
    params = list(model.parameters())
    opt = make_optimizer(params, optimizer)
    scaler = torch.amp.GradScaler("cpu", **SCALER_KWARGS)
    trace = Trace()
    for step in range(STEPS):
        scaler.scale(loss_of(model, step)).backward()
        for owner in inject.get(step, ()):
            params[owner].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        trace.scales.append(scaler.get_scale())
        trace.skipped.append(scaler.get_scale() < scale_before)
    trace.params = [p.detach().clone() for p in params]
    return trace


class FsdpNet(torch.nn.Sequential):
    """Two linear layers for FSDP2 (every parameter receives a gradient)."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).squeeze(-1)


def train_fsdp2(
    rank: int, world: int, *, inject: Mapping[int, Iterable[int]], with_group: bool
) -> Trace:
    """FSDP2 (``fully_shard``, DTensor parameters and gradients) on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = FsdpNet()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    group = dist.group.WORLD if with_group else None
    scaler = ampscaler.GradScaler("cpu", **SCALER_KWARGS, process_group=group)
    trace = Trace()
    for step in range(STEPS):
        scaler.scale(loss_of(model, step)).backward()
        if rank in inject.get(step, ()):
            # Overflow in this rank's shard only: the first element the rank holds.
            params[rank % len(params)].grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        trace.record(scaler, step)
    trace.params = [p.full_tensor().detach().clone() for p in params]  # type: ignore[attr-defined]
    return trace


def config_error(rank: int, world: int, **per_rank: Callable[[int], Any]) -> str:
    """The error every rank gets at the first step when ``per_rank`` settings differ."""
    kwargs = {name: value(rank) for name, value in per_rank.items()}
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", **kwargs, process_group=dist.group.WORLD)
    scaler.scale(loss_of(model, 0)).backward()
    try:
        scaler.step(opt)
    except ampscaler.InvalidConfigError as error:
        return str(error)
    return "no error"


def subgroups(rank: int, world: int) -> Trace:
    """Pairs {0, 1} and {2, 3} agree separately; an overflow on rank 2 stays in its pair."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return train_sharded_in_pair(rank, pairs[rank // 2])


def train_sharded_in_pair(rank: int, pair: dist.ProcessGroup) -> Trace:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", **SCALER_KWARGS, process_group=pair)
    trace = Trace()
    for step in range(3):
        scaler.scale(loss_of(model, step)).backward()
        if rank == 2 and step == 1:
            model.hidden.bias.grad.view(-1)[0] = float("nan")  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        trace.record(scaler, step)
    return trace


def outsider_error(rank: int, world: int) -> str:
    """Passing a group this rank is not in."""
    first_pair = dist.new_group([0, 1])
    if rank < 2:
        return "member"
    try:
        ampscaler.GradScaler("cpu", process_group=first_pair)
    except ampscaler.InvalidConfigError as error:
        return str(error)
    return "no error"


SPIKE_STEPS = 12
SPIKE_AT = 10


def train_with_spike(rank: int, world: int, *, optimizer: str) -> list[Any]:
    """ZeRO-2 style training with a spike guard; at ``SPIKE_AT`` only the last rank's
    gradients spike (finite, 1000 times their size). Returns, per step, the skip reason and
    the scale, then the stats."""
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    mine = [p for i, p in enumerate(params) if i % world == rank]
    opt = make_optimizer(mine, optimizer)
    scaler = ampscaler.GradScaler("cpu", **SCALER_KWARGS, process_group=dist.group.WORLD)
    scaler.attach(ampscaler.SpikeGuard(sigma=6.0, window=8))
    seen: list[Any] = []
    for step in range(SPIKE_STEPS):
        scaler.scale(loss_of(model, step)).backward()
        for i, p in enumerate(params):
            if i % world != rank:
                p.grad = None
        if step == SPIKE_AT and rank == world - 1:
            for p in mine:
                if p.grad is not None:  # the spare layer has none
                    p.grad.mul_(1000.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % world)
        seen.append((skip_reason(scaler), scaler.get_scale()))
    seen.append(counts(scaler))
    return seen


REPLAY_STEPS = 6
#: (batch, first try) -> (rank, what): an inf loss on rank 1 in batch 1's second micro-batch;
#: an overflow in rank 0's own shard in batch 3.
REPLAY_TROUBLE = {1: (1, "loss"), 3: (0, "gradients")}


def train_with_replay(rank: int, world: int) -> list[Any]:
    """ZeRO-2 style training under ``attempts()``, two micro-batches per try; returns, per
    batch, the tries it took and each skipped try's cause, origin ranks and micro-batch."""
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    mine = [p for i, p in enumerate(params) if i % world == rank]
    opt = make_optimizer(mine, "sgd")
    scaler = ampscaler.GradScaler("cpu", **SCALER_KWARGS, process_group=dist.group.WORLD)
    seen: list[Any] = []
    for batch in range(REPLAY_STEPS):
        tries: list[Any] = []
        for attempt in scaler.attempts():
            trouble = REPLAY_TROUBLE.get(batch) if not attempt.replay else None
            for micro in range(2):
                loss = loss_of(model, 10 * batch + micro)
                if trouble == (rank, "loss") and micro == 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            for i, p in enumerate(params):
                if i % world != rank:
                    p.grad = None
            if trouble == (rank, "gradients"):
                mine[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            report = scaler.last_overflow
            tries.append(
                None if report is None else (report.cause, tuple(report.ranks), report.micro_batch)
            )
        for i, p in enumerate(params):
            dist.broadcast(p.data, src=i % world)
        seen.append(tries)
    seen.append(counts(scaler))
    return seen


def replay_without_group(rank: int, world: int) -> str:
    """What ``attempts()`` says with several ranks and no process group."""
    scaler = ampscaler.GradScaler("cpu")
    try:
        next(iter(scaler.attempts()))
    except ampscaler.InvalidConfigError as error:
        return str(error)
    return "no error"


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    "sgd": lambda r, w: train_sharded(
        r, w, optimizer="sgd", inject={1: [1], 4: [0]}, group=dist.group.WORLD
    ),
    "fused_adam": lambda r, w: train_sharded(
        r, w, optimizer="adam", inject={2: [1], 3: [1]}, group=dist.group.WORLD
    ),
    "no_group": lambda r, w: train_sharded(r, w, optimizer="sgd", inject={1: [1]}, group=None),
    "fsdp2": lambda r, w: train_fsdp2(r, w, inject={1: [1], 4: [0]}, with_group=True),
    "fsdp2_no_group": lambda r, w: train_fsdp2(r, w, inject={1: [1]}, with_group=False),
    "mismatch": lambda r, w: config_error(
        r,
        w,
        growth_interval=lambda rank: 1000 if rank == 1 else 2000,
        init_scale=lambda rank: 1024.0 if rank == 1 else 65536.0,
    ),
    "mismatch_hysteresis": lambda r, w: config_error(
        r,
        w,
        hysteresis=lambda rank: 2 if rank == 3 else 1,
        policy=lambda rank: ampscaler.StaticPolicy() if rank == 2 else None,
    ),
    "sgd_four": lambda r, w: train_sharded(
        r, w, optimizer="sgd", inject={1: [0, 2], 3: [1]}, group=dist.group.WORLD
    ),
    "spike_sgd": lambda r, w: train_with_spike(r, w, optimizer="sgd"),
    "spike_fused_adam": lambda r, w: train_with_spike(r, w, optimizer="adam"),
    "subgroups": subgroups,
    "replay": train_with_replay,
    "replay_without_group": replay_without_group,
    "user_policy": lambda r, w: train_sharded(
        r,
        w,
        optimizer="sgd",
        inject={1: [1], 4: [0]},
        group=dist.group.WORLD,
        scaler_kwargs={"init_scale": 2.0**10, "policy": HalveOrDouble(interval=2)},
    ),
    "user_policy_mismatch": lambda r, w: config_error(
        r, w, policy=lambda rank: HalveOrDouble(interval=2 + rank)
    ),
    "outsider": outsider_error,
}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_SHARED_DIR: list[str] = []


def shared_dir() -> str:
    """A folder every rank of this launch sees (for checkpoints); removed after the launch."""
    return _SHARED_DIR[0]


def _run_rank(
    rank: int, world: int, port: int, out_dir: str, names: list[str], timeout_s: float
) -> None:
    torch.set_num_threads(1)
    _SHARED_DIR[:] = [out_dir]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        results = {name: SCENARIOS[name](rank, world) for name in names}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(world: int, names: list[str], group_timeout_s: float = TIMEOUT_S) -> list[dict[str, Any]]:
    """Run ``names`` on ``world`` fresh gloo ranks; ``results[rank][name]``. Fails on a hang.

    ``group_timeout_s`` is the process group's timeout: a collective that waits longer raises
    in its rank (for fault scenarios, where a hang must fail fast). On Linux the ranks are
    forked, after importing here what they need (optimizers import torch._dynamo lazily,
    seconds per process): a spawned rank pays every import again.
    """
    import torch._dynamo
    import torch.distributed.fsdp
    import torch.distributed.tensor

    method = "fork" if sys.platform == "linux" else "spawn"
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _run_rank,
            args=(world, _free_port(), out_dir, names, group_timeout_s),
            nprocs=world,
            join=False,
            start_method=method,
        )
        deadline = time.monotonic() + max(TIMEOUT_S, group_timeout_s + 30.0)
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.terminate()
                raise TimeoutError(f"{world} ranks running {names} did not finish in time")
        return [
            torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            for rank in range(world)
        ]


ROOT = Path(__file__).resolve().parent.parent


def torchrun(*args: str, env: Mapping[str, str] | None = None) -> str:
    """``torchrun --standalone --nproc-per-node 2 ARGS`` with this checkout's ``src`` on the
    path (and ``env`` added to the environment); its stdout. Fails on an error or a hang."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *args],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def torchrun_example(example: str, *args: str) -> str:
    """Run ``examples/EXAMPLE ARGS`` on 2 ranks (:func:`torchrun`)."""
    return torchrun(str(ROOT / "examples" / example), *args)
