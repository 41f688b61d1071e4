"""Multi-process scenarios for faults across ranks (issue #27, items 2 and 5): a checkpoint
loaded on some ranks only, or different ones; an optimizer without gradients on any rank; a
scale moved on one rank; a guard's verdict beside an overflow on one rank.

Importing this module adds its scenarios to ``multirank.SCENARIOS``. Each returns, per rank,
what the rank saw: the error it raised (type and message) and at which step and call, or its
trace. The launch runs with a short group timeout (``GROUP_TIMEOUT_S``): a rank waiting in a
collective its peers never make fails within seconds instead of hanging.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ampscaler
import multirank

GROUP_TIMEOUT_S = 10.0
STEPS = 5
LOAD_AT = 2


@dataclass
class Seen:
    """What one rank saw in a scenario."""

    error: str | None = None  # "ExceptionType: message"
    at: tuple[int, str] | None = None  # (step, call) that raised
    seconds: float = 0.0  # from the first step to the error (or the end)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)


def _parts(fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = multirank.Net()
    opt = multirank.make_optimizer(list(model.parameters()), "adam" if fused else "sgd")
    scaler = ampscaler.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=2, process_group=dist.group.WORLD
    )
    return model, opt, scaler


def _train(
    rank: int,
    fused: bool,
    before_step: Callable[[int, Any, int], None] = lambda rank, scaler, step: None,
    overflow: Callable[[int, int], bool] = lambda rank, step: False,
    guard: bool = False,
) -> Seen:
    """Train ``STEPS`` steps, calling ``before_step(rank, scaler, step)`` before each, and
    poisoning the gradients where ``overflow(rank, step)``, with a spike guard if ``guard``;
    catch the first error."""
    model, opt, scaler = _parts(fused)
    if guard:
        scaler.attach(ampscaler.SpikeGuard(window=8))
    seen = Seen()
    start = time.monotonic()
    call = "load"
    try:
        for step in range(STEPS):
            call = "load"
            before_step(rank, scaler, step)
            scaler.scale(multirank.loss_of(model, step)).backward()
            if overflow(rank, step):
                model.hidden.bias.grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            call = "step"
            scaler.step(opt)
            call = "update"
            scaler.update()
            opt.zero_grad(set_to_none=True)
            seen.scales.append(scaler.get_scale())
            seen.skipped.append(scaler.last_step_skipped)
    except Exception as error:  # what the rank saw is the result
        seen.error = f"{type(error).__name__}: {error}"
        seen.at = (step, call)
    seen.seconds = time.monotonic() - start
    seen.params = [p.detach().clone() for p in model.parameters()]
    return seen


def _state(init_scale: float) -> dict[str, Any]:
    return ampscaler.GradScaler("cpu", init_scale=init_scale, growth_interval=2).state_dict()


def _load_on(ranks: tuple[int, ...], scale: Callable[[int], float]) -> Callable[..., None]:
    def load(rank: int, scaler: Any, step: int) -> None:
        if step == LOAD_AT and rank in ranks:
            scaler.load_state_dict(_state(scale(rank)))

    return load


def _load_own_state_on_rank_1(rank: int, scaler: Any, step: int) -> None:
    """Rank 1 reloads exactly what it holds: the state is the same, the load is not."""
    if step == LOAD_AT and rank == 1:
        scaler.load_state_dict(scaler.state_dict())


def _new_scale_on_rank_1(rank: int, scaler: Any, step: int) -> None:
    """Rank 1 writes its scale between iterations (as update(new_scale) would)."""
    if step == LOAD_AT and rank == 1:
        scaler._scale.fill_(8.0)


def _same_scale_on_rank_1(rank: int, scaler: Any, step: int) -> None:
    """Rank 1 writes its scale with the value it holds (and every rank holds): the state
    agrees, the programs do not."""
    if step == LOAD_AT and rank == 1:
        scaler._scale.fill_(scaler.get_scale())


def _gradless(rank: int, fused: bool, beside: bool) -> Seen:
    """An optimizer whose parameters have no gradient on any rank, alone or ``beside`` one
    that has them."""
    model, opt, scaler = _parts(fused)
    idle = multirank.make_optimizer(list(model.spare.parameters()), "adam" if fused else "sgd")
    seen = Seen()
    call = "step"
    try:
        scaler.scale(multirank.loss_of(model, 0)).backward()
        if beside:
            scaler.step(opt)
        call = "idle step"
        scaler.step(idle)
        call = "update"
        scaler.update()
        seen.scales.append(scaler.get_scale())
    except Exception as error:
        seen.error = f"{type(error).__name__}: {error}"
        seen.at = (0, call)
    return seen


def _gradless_sharded(rank: int, fused: bool) -> list[tuple[str | None, list[float]]]:
    """ampscaler's ShardedGradScaler and torch's, an optimizer without gradients on any rank:
    what each raised, and the scales."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    seen = []
    for factory in (ampscaler.ShardedGradScaler, TorchSharded):
        torch.manual_seed(0)
        model = multirank.Net()
        idle = multirank.make_optimizer(list(model.spare.parameters()), "adam" if fused else "sgd")
        scaler = factory(
            "cpu", init_scale=2.0**10, growth_interval=1, process_group=dist.group.WORLD
        )
        scales: list[float] = []
        error = None
        try:
            for step in range(3):
                scaler.scale(multirank.loss_of(model, step)).backward()
                scaler.step(idle)
                scaler.update()
                scales.append(scaler.get_scale())
        except Exception as caught:
            error = f"{type(caught).__name__}: {caught}"
        seen.append((error, scales))
    return seen


for _fused, _name in ((False, "sgd"), (True, "fused")):
    multirank.SCENARIOS.update({
        f"load_on_one_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _load_on((1,), lambda rank: 8.0)
        ),
        f"load_own_state_on_one_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _load_own_state_on_rank_1
        ),
        f"load_different_on_every_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _load_on((0, 1), lambda rank: 2.0 ** (4 + rank))
        ),
        f"load_same_on_every_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _load_on((0, 1), lambda rank: 64.0)
        ),
        f"scale_written_on_one_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _new_scale_on_rank_1
        ),
        f"scale_rewritten_on_one_rank_{_name}": lambda r, w, f=_fused: _train(
            r, f, _same_scale_on_rank_1
        ),
        f"gradless_everywhere_{_name}": lambda r, w, f=_fused: _gradless(r, f, beside=False),
        f"gradless_beside_{_name}": lambda r, w, f=_fused: _gradless(r, f, beside=True),
        f"gradless_sharded_{_name}": lambda r, w, f=_fused: _gradless_sharded(r, f),
        f"guard_beside_overflow_{_name}": lambda r, w, f=_fused: _train(
            r, f, overflow=lambda rank, step: rank == 1 and step == 3, guard=True
        ),
    })  # fmt: skip


def world_read_too_early(rank: int, world: int) -> list[list[str]]:
    """A scaler built while ``torch.distributed.group.WORLD`` is still ``None`` (the group is
    destroyed and made again around it), and one that leaves ``process_group`` out: the
    warnings each gives over two steps once the ranks exist. Runs last: it replaces the group."""
    dist.destroy_process_group()
    early = ampscaler.GradScaler("cpu", process_group=dist.group.WORLD)  # None here
    omitted = ampscaler.GradScaler("cpu")
    store = dist.FileStore(os.path.join(multirank.shared_dir(), "world-again"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for scaler in (early, omitted):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                scaler.scale(model(torch.ones(1, 2)).sum()).backward()
                scaler.step(opt)
                scaler.update()
        seen.append([str(w.message) for w in caught if w.category is UserWarning])
    return seen


multirank.SCENARIOS["world_read_too_early"] = world_read_too_early

#: The scenarios, in the order one launch runs them (the last one replaces the group).
NAMES = [
    name
    for name in multirank.SCENARIOS
    if name.startswith(("load_", "scale_", "gradless_", "guard_"))
] + ["world_read_too_early"]


def same_run_uninterrupted(fused: bool, load_at: int, scale: float) -> Seen:
    """One process, no group: what ``load_same_on_every_rank`` must match."""
    torch.manual_seed(0)
    model = multirank.Net()
    opt = multirank.make_optimizer(list(model.parameters()), "adam" if fused else "sgd")
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    seen = Seen()
    for step in range(STEPS):
        if step == load_at:
            scaler.load_state_dict(_state(scale))
        scaler.scale(multirank.loss_of(model, step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        seen.scales.append(scaler.get_scale())
        seen.skipped.append(scaler.last_step_skipped)
    seen.params = [p.detach().clone() for p in model.parameters()]
    return seen
