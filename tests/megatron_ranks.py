"""Megatron-core training on CPU ranks, with its own scaler and with ampscaler's.

Importing this module imports Megatron-core (seconds: before the ranks are forked, once) and
registers the scenarios in ``multirank.SCENARIOS``. Every rank trains a small fp16 model
through Megatron's own optimizer factory (``get_megatron_optimizer``: a ``ChainedOptimizer`` of
one ``Float16OptimizerWithFloat16Params``), on data of its own. With 2 ranks, tensor-model
parallelism is 2, so the gradient-stats group Megatron max-reduces ``found_inf`` over holds
both ranks: an overflow injected on one rank skips the step on every rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core import optimizer as megatron_optimizer
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig

import multirank
from ampscaler import PersistentOverflowError
from ampscaler.integrations.megatron import patch_megatron, use_ampscaler
from engine_observed import observed, seen
from engine_shims import cuda_is_identity, cuda_type_names, megatron_on_cpu
from user_policy import HalveOrDouble

STEPS = 24
RESUME_AT = 14
#: step -> the rank whose gradient overflows (of 2; with one rank, rank 0 always)
OVERFLOWS = {1: 0, 2: 1, 3: 0, 7: 1, 8: 0, 9: 1, 10: 0, 11: 1, 15: 0, 16: 1, 17: 0, 21: 1}


@dataclass
class Run:
    """What one rank saw: per step whether it stepped and the scale after; the parameters and
    Megatron's scaler keys at the end."""

    stepped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    keys: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)  # ampscaler's, at the end


def _model(rank: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = model.half()
    model.ddp_config = DistributedDataParallelConfig()  # what the factory reads of a chunk
    return model


def _optimizer(
    model: torch.nn.Module,
    hysteresis: int,
    ampscaler: bool,
    initial: float = 2.0**10,
    **settings: Any,
) -> Any:
    config = megatron_optimizer.OptimizerConfig(
        optimizer="adam",
        lr=0.01,
        fp16=True,
        initial_loss_scale=initial,
        min_loss_scale=2.0**5,
        loss_scale_window=3,
        hysteresis=hysteresis,
        clip_grad=0.0,
    )
    with cuda_type_names():
        if not ampscaler:
            return megatron_optimizer.get_megatron_optimizer(config, [model])
        with patch_megatron(**settings):
            return megatron_optimizer.get_megatron_optimizer(config, [model])


def _step(model: torch.nn.Module, optimizer: Any, rank: int, world: int, step: int) -> bool:
    gen = torch.Generator().manual_seed(100 * rank + step)
    optimizer.zero_grad()
    loss = model(torch.randn(8, 4, generator=gen).half()).float().pow(2).mean()
    optimizer.scale_loss(loss).backward()
    if step in OVERFLOWS and OVERFLOWS[step] % world == rank:
        next(model.parameters()).grad[0, 0] = float("inf")
    stepped, _, _ = optimizer.step()
    return bool(stepped)


def train(
    rank: int,
    world: int,
    hysteresis: int,
    ampscaler: bool,
    resumed_by: bool | None = None,
    initial: float = 2.0**10,
    **settings: Any,
) -> Run:
    """``STEPS`` steps with Megatron's scaler or ampscaler's (patched with ``settings``); with
    ``resumed_by``, the run stops at ``RESUME_AT`` and a fresh model and optimizer (ampscaler's
    scaler if ``resumed_by``) load its checkpoint and train on."""
    model = _model(rank)
    optimizer = _optimizer(model, hysteresis, ampscaler, initial, **settings)
    run = Run()
    for step in range(STEPS):
        if step == RESUME_AT and resumed_by is not None:
            saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
            model = _model(rank)
            optimizer = _optimizer(model, hysteresis, resumed_by, initial, **settings)
            model.load_state_dict(saved[0])
            with cuda_is_identity():  # Megatron's own scaler moves the loaded scale to CUDA
                optimizer.load_state_dict(saved[1])
        run.stepped.append(_step(model, optimizer, rank, world, step))
        run.scales.append(float(optimizer.get_loss_scale().item()))
    run.params = [p.detach().clone() for p in model.parameters()]
    run.keys = optimizer.state_dict()["grad_scaler"]
    if "configure" in settings:  # observed (engine_observed.observed)
        run.observed = seen(optimizer.chained_optimizers[0].grad_scaler.scaler)
    return run


def twins(rank: int, world: int, hysteresis: int) -> dict[str, Any]:
    """Megatron's scaler, ampscaler's, and each resumed from the other's checkpoint."""
    return {
        "megatron": train(rank, world, hysteresis, ampscaler=False),
        "ampscaler": train(rank, world, hysteresis, ampscaler=True),
        "megatron_to_ampscaler": train(rank, world, hysteresis, False, resumed_by=True),
        "ampscaler_to_megatron": train(rank, world, hysteresis, True, resumed_by=False),
    }


def stuck_at_minimum(rank: int, world: int) -> dict[str, Any]:
    """Every step overflows from step 2 on (on one rank): the scale reaches the minimum and
    stays. Megatron skips on silently; ampscaler with ``max_consecutive_skips=6`` raises."""
    outcome: dict[str, Any] = {}
    for ampscaler in (False, True):
        model = _model(rank)
        optimizer = _optimizer(model, 1, ampscaler, max_consecutive_skips=6)
        stepped = []
        try:
            for step in range(16):
                gen = torch.Generator().manual_seed(step)
                optimizer.zero_grad()
                loss = model(torch.randn(8, 4, generator=gen).half()).float().pow(2).mean()
                optimizer.scale_loss(loss).backward()
                if step >= 2 and rank == world - 1:
                    next(model.parameters()).grad[0, 0] = float("nan")
                stepped.append(optimizer.step()[0])
        except PersistentOverflowError as error:
            outcome["error"] = (len(stepped), str(error))
        outcome["ampscaler" if ampscaler else "megatron"] = (
            stepped,
            float(optimizer.get_loss_scale().item()),
        )
    return outcome


def handed_over(rank: int, world: int) -> dict[str, Any]:
    """``use_ampscaler`` on an optimizer Megatron built with its own scaler, after a few steps:
    the run goes on as Megatron's would (scale and trackers carried over)."""
    runs = {}
    for hand_over in (False, True):
        model = _model(rank)
        optimizer = _optimizer(model, 2, ampscaler=False)
        run = Run()
        for step in range(STEPS):
            if step == RESUME_AT and hand_over:
                use_ampscaler(optimizer)
            run.stepped.append(_step(model, optimizer, rank, world, step))
            run.scales.append(float(optimizer.get_loss_scale().item()))
        run.params = [p.detach().clone() for p in model.parameters()]
        runs["ampscaler" if hand_over else "megatron"] = run
    runs["kind"] = type(optimizer.chained_optimizers[0].grad_scaler).__name__
    return runs


def extras(rank: int, world: int) -> dict[str, Any]:
    """What ampscaler adds, inside Megatron: a user's own policy (resumed from a checkpoint
    midway), a bound on the scale, step records, metrics, the collapse watch."""
    return {
        "user_policy": train(rank, world, 2, True, True, **observed(HalveOrDouble(interval=2))),
        "megatron": train(rank, world, 2, False),
        "bounded": train(rank, world, 2, True, initial=2.0**5, max_scale=2.0**5),
        "unbounded": train(rank, world, 2, False, initial=2.0**5),
    }


def _scenario(body: Any) -> Any:
    def run(rank: int, world: int) -> Any:
        megatron_on_cpu()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        try:
            return body(rank, world)
        finally:
            parallel_state.destroy_model_parallel()

    return run


multirank.SCENARIOS.update(
    {
        "megatron_h1": _scenario(lambda r, w: twins(r, w, 1)),
        "megatron_h2": _scenario(lambda r, w: twins(r, w, 2)),
        "megatron_h3": _scenario(lambda r, w: twins(r, w, 3)),
        "megatron_minimum": _scenario(stuck_at_minimum),
        "megatron_handed_over": _scenario(handed_over),
        "megatron_extras": _scenario(extras),
    }
)
