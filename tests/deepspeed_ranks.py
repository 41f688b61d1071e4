"""DeepSpeed ZeRO-1, 2 and 3 training on CPU ranks, with its own scaler and with ampscaler's.

Importing this module imports DeepSpeed (before the ranks are forked, once) and registers the
scenarios in ``multirank.SCENARIOS``. Every rank builds an engine with ``deepspeed.initialize``
from a config whose ``"fp16"`` section sets the scaler, and trains on data of its own; an
overflow is injected on one rank (its loss times ``1e8``: float16 gradients overflow), and ZeRO
agrees on it over the data-parallel group, so the step is skipped on every rank.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param

import multirank
from ampscaler import patch_torch
from ampscaler.integrations.deepspeed import agree_across_ranks, patch_deepspeed
from engine_observed import observed, seen
from engine_shims import deepspeed_on_cpu
from user_policy import HalveOrDouble

STEPS = 20
RESUME_AT = 11
#: step -> the rank whose loss overflows (of 2; with one rank, rank 0 always)
OVERFLOWS = {1: 0, 2: 1, 5: 0, 6: 1, 7: 0, 8: 1, 12: 0, 13: 1, 17: 0}


@dataclass
class Run:
    """What one rank saw: per step whether it stepped and the scale after; the fp32 master
    parameters at the end."""

    stepped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    scaler: str = ""
    observed: dict[str, Any] = field(default_factory=dict)  # ampscaler's, at the end


def config(stage: int, hysteresis: int, consecutive: bool, min_power: int = 0) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "fp16": {
            "enabled": True,
            "initial_scale_power": 10,
            "loss_scale_window": 2,
            "hysteresis": hysteresis,
            "consecutive_hysteresis": consecutive,
            "min_loss_scale": 2**min_power,
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
    }


def _engine(settings: dict[str, Any], **patch: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    engine, *_ = deepspeed.initialize(model=model, config=settings)
    return engine


def _patched(ampscaler: bool, **patch: Any) -> contextlib.AbstractContextManager[Any]:
    """Patched for ampscaler's scaler (construction and loading a checkpoint), or not."""
    return patch_deepspeed(**patch) if ampscaler else contextlib.nullcontext()


def _step(engine: Any, rank: int, world: int, step: int, overflow: bool) -> bool:
    gen = torch.Generator().manual_seed(100 * rank + step)
    loss = engine(torch.randn(8, 4, generator=gen).half()).float().pow(2).mean()
    engine.backward(loss * 1e8 if overflow else loss)
    engine.step()
    return bool(engine.was_step_applied())


def train(
    rank: int,
    world: int,
    settings: dict[str, Any],
    ampscaler: bool,
    resumed_by: bool | None = None,
    overflows: dict[int, int] = OVERFLOWS,
    **patch: Any,
) -> Run:
    """``STEPS`` steps with DeepSpeed's scaler or ampscaler's; with ``resumed_by``, the run
    saves a checkpoint at ``RESUME_AT`` and a fresh engine (with ampscaler's scaler if
    ``resumed_by``) loads it and trains on."""
    with _patched(ampscaler, **patch):
        engine = _engine(settings)
    run = Run()
    for step in range(STEPS):
        if step == RESUME_AT and resumed_by is not None:
            folder = os.path.join(multirank.shared_dir(), f"ds{settings['zero_optimization']}")
            engine.save_checkpoint(folder, tag="resume")
            with _patched(resumed_by, **patch):
                engine = _engine(settings)
                engine.load_checkpoint(folder, tag="resume")
        overflow = step in overflows and overflows[step] % world == rank
        run.stepped.append(_step(engine, rank, world, step, overflow))
        run.scales.append(float(engine.optimizer.loss_scale))
    run.params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    run.scaler = type(engine.optimizer.loss_scaler).__name__
    if "configure" in patch:  # observed (engine_observed.observed)
        run.observed = seen(engine.optimizer.loss_scaler.scaler)
    return run


def twins(rank: int, world: int, stage: int, hysteresis: int, consecutive: bool) -> dict[str, Run]:
    """DeepSpeed's scaler, ampscaler's, and each resumed from the other's checkpoint."""
    settings = config(stage, hysteresis, consecutive)
    return {
        "deepspeed": train(rank, world, settings, ampscaler=False),
        "ampscaler": train(rank, world, settings, ampscaler=True),
        "deepspeed_to_ampscaler": train(rank, world, settings, False, resumed_by=True),
        "ampscaler_to_deepspeed": train(rank, world, settings, True, resumed_by=False),
    }


def extras(rank: int, world: int) -> dict[str, Run]:
    """What ampscaler adds, inside ZeRO-2: a user's own policy (resumed from a checkpoint
    midway), a bound on the scale, step records, metrics, the collapse watch."""
    settings = config(2, 2, False)
    low = config(2, 2, False)
    low["fp16"]["initial_scale_power"] = 3
    return {
        "deepspeed": train(rank, world, settings, False),
        "user_policy": train(rank, world, settings, True, True, **observed(HalveOrDouble(2))),
        "bounded": train(rank, world, low, True, overflows={}, max_scale=8.0),
        "unbounded": train(rank, world, low, False, overflows={}),
    }


def stuck_at_minimum(rank: int, world: int) -> dict[str, Any]:
    """Every step overflows from step 2 on (on the last rank). DeepSpeed raises once the scale
    is at the minimum; so does ampscaler by default; with ``max_consecutive_skips=6`` it
    skips on at the minimum and raises after the sixth skip in a row."""
    settings = config(2, 1, False, min_power=7)
    outcome: dict[str, Any] = {}
    for name, ampscaler, patch in (
        ("deepspeed", False, {}),
        ("ampscaler", True, {}),
        ("ampscaler_limit", True, {"max_consecutive_skips": 6}),
    ):
        with _patched(ampscaler, **patch):
            engine = _engine(settings)
        stepped: list[bool] = []
        try:
            for step in range(16):
                overflow = step >= 2 and rank == world - 1
                stepped.append(_step(engine, rank, world, step, overflow))
        except Exception as error:  # DeepSpeed raises a bare Exception
            outcome[name] = (len(stepped), type(error).__name__, str(error))
    return outcome


def _scenario(stage: int, hysteresis: int, consecutive: bool = False) -> Any:
    def run(rank: int, world: int) -> Any:
        deepspeed_on_cpu()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        return twins(rank, world, stage, hysteresis, consecutive)

    return run


def _on_cpu(body: Any) -> Any:
    def run(rank: int, world: int) -> Any:
        deepspeed_on_cpu()
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        return body(rank, world)

    return run


multirank.SCENARIOS.update(
    {
        "zero1_h1": _scenario(1, 1),
        "zero2_h2": _scenario(2, 2),
        "zero2_h2_consecutive": _scenario(2, 2, consecutive=True),
        "zero3_h3": _scenario(3, 3),
        "zero_minimum": _on_cpu(stuck_at_minimum),
        "zero_extras": _on_cpu(extras),
        "autocast_torch": _on_cpu(lambda r, w: autocast_route(r, w, False, norm=False)),
        "autocast_patched": _on_cpu(lambda r, w: autocast_route(r, w, True, norm=False)),
        "autocast_agreed": _on_cpu(lambda r, w: autocast_route(r, w, True, False, agree=True)),
        "autocast_torch_norm": _on_cpu(lambda r, w: autocast_route(r, w, False, norm=True)),
        "autocast_patched_norm": _on_cpu(lambda r, w: autocast_route(r, w, True, norm=True)),
    }
)


def autocast_route(
    rank: int, world: int, patched: bool, norm: bool, agree: bool = False
) -> list[float]:
    """ZeRO-1 with ``"torch_autocast"`` (fp16) builds ``torch.amp.GradScaler`` and steps its
    partition of the parameters through it; with ``patched``, under ``patch_torch()``. At step
    2 the gradient of the last bias (in the last rank's partition) overflows on rank 0. The
    scale after every step, on this rank."""
    settings = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "torch_autocast": {"enabled": True, "dtype": "float16"},
        "zero_optimization": {"stage": 1, "compute_grad_norm": norm},
        "gradient_clipping": 1.0 if norm else 0.0,
        "steps_per_print": 10**6,
    }
    with patch_torch() if patched else contextlib.nullcontext():
        engine = _engine(settings)
    if agree:
        agree_across_ranks(engine.optimizer)
    last_bias = list(engine.module.parameters())[-1]
    scales = []
    for step in range(4):
        overflow = step == 2 and rank == 0
        handle = last_bias.register_hook(lambda g: g * float("inf")) if overflow else None
        gen = torch.Generator().manual_seed(100 * rank + step)
        loss = engine(torch.randn(8, 4, generator=gen)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        scales.append(engine.optimizer.torch_autocast_gradscaler.get_scale())
    return scales
