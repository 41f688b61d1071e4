"""ampscaler inside a real ``accelerate.Accelerator`` on CPU, against a plain torch loop."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import GradScalerKwargs

import ampscaler
from ampscaler.integrations.accelerate import use_scaler

STEPS = 8
BIG = (2, 5)  # iterations whose inputs are scaled so that their fp16 gradients overflow

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    data = []
    for i in range(STEPS):
        x = torch.randn(4, 4, generator=generator) * (300.0 if i in BIG else 1.0)
        data.append((x, torch.randn(4, 1, generator=generator)))
    return data


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def scaler_args() -> dict[str, Any]:
    return {"init_scale": 2.0**12, "growth_interval": 2}


def train_with_accelerate(
    accelerator: Accelerator, net: torch.nn.Module, fused: bool = False
) -> tuple[Any, Any, list[bool]]:
    optimizer = (
        torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
        if fused
        else torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    net, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    skipped = []
    for x, y in batches():
        loss = torch.nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        if not fused:
            accelerator.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(optimizer.step_was_skipped)
    return optimizer, scheduler, skipped


def test_trains_bit_for_bit_like_a_plain_torch_loop() -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = use_scaler(accelerator, ampscaler.GradScaler("cpu", **scaler_args()))
    net = model()
    _, scheduler, skipped = train_with_accelerate(accelerator, net)

    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    torch_scaler = torch.amp.GradScaler("cpu", **scaler_args())
    reference_skipped = []
    for x, y in batches():
        with torch.autocast("cpu", dtype=torch.float16):
            out = reference(x)
        torch_scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        torch_scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        before = torch_scaler.get_scale()
        torch_scaler.step(optimizer)
        torch_scaler.update()
        reference_skipped.append(torch_scaler.get_scale() < before)
        if not reference_skipped[-1]:
            reference_scheduler.step()
        optimizer.zero_grad()

    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert skipped == reference_skipped and any(skipped)
    assert scaler.get_scale() == torch_scaler.get_scale()
    assert scaler.metrics("")["skips"] == sum(skipped) and scaler.metrics("")["growths"] > 0
    # Accelerate's scheduler wrapper holds the schedule back on skipped steps.
    assert scheduler.scheduler.last_epoch == STEPS - sum(skipped)


def test_save_state_and_load_state_carry_the_full_scaler_state(tmp_path: Path) -> None:
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = use_scaler(
        accelerator,
        ampscaler.GradScaler(
            "cpu", init_scale=2.0**12, growth_interval=3, hysteresis=3, min_scale=8.0
        ),
    )
    train_with_accelerate(accelerator, model())
    accelerator.save_state(tmp_path)
    saved = scaler.state_dict()
    assert saved["_hysteresis_tracker"] < saved["hysteresis"] and saved["stats"]["skipped"] > 0

    AcceleratorState._reset_state(reset_partial_state=True)
    restored = Accelerator(mixed_precision="fp16", cpu=True)
    fresh = use_scaler(restored)
    net = model()
    restored.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2))
    restored.load_state(tmp_path)
    assert fresh.state_dict() == saved


def test_builds_the_scaler_from_grad_scaler_kwargs() -> None:
    handler = GradScalerKwargs(init_scale=1024.0, growth_interval=7)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[handler])
    scaler = use_scaler(accelerator)
    assert accelerator.scaler is scaler and isinstance(scaler, ampscaler.GradScaler)
    assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 7


def first_layer_output_dtype(accelerator: Accelerator) -> torch.dtype:
    net = accelerator.prepare(model())
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    net(torch.ones(1, 4))
    return seen[0]


def test_fp16_on_cpu_needs_use_scaler() -> None:
    """The limitation use_scaler works around: on CPU Accelerate ignores fp16."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None
    assert first_layer_output_dtype(accelerator) == torch.float32

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    use_scaler(accelerator)
    assert first_layer_output_dtype(accelerator) == torch.float16


def test_fused_optimizer_skips_are_reported_to_accelerate() -> None:
    """accelerate#4242: with torch's scaler a skip inside the fused kernel is invisible to
    Accelerate, so step_was_skipped stays False and the LR schedule advances anyway."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = use_scaler(accelerator, ampscaler.GradScaler("cpu", **scaler_args()))
    net = model()
    _, scheduler, skipped = train_with_accelerate(accelerator, net, fused=True)
    assert scaler.metrics("")["skips"] > 0
    assert sum(skipped) == scaler.metrics("")["skips"]  # each skip is seen, and nothing else
    assert scheduler.scheduler.last_epoch == STEPS - scaler.metrics("")["skips"]  # held after skips


def test_a_scheduler_built_after_prepare_wraps_a_fused_optimizer() -> None:
    """The Trainer builds its LR scheduler after prepare; torch's scheduler then wraps
    ``optimizer.step`` through ``__func__``, so the reporting step must stay a bound method."""
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = use_scaler(accelerator, ampscaler.GradScaler("cpu", **scaler_args()))
    net = model()
    optimizer = accelerator.prepare(torch.optim.Adam(net.parameters(), lr=1e-2, fused=True))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    net = accelerator.prepare(net)
    held = 0
    for x, y in batches():
        accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
        optimizer.step()
        if accelerator.optimizer_step_was_skipped:
            held += 1
        else:
            scheduler.step()
        optimizer.zero_grad()
    assert held == scaler.metrics("")["skips"] > 0
    assert scheduler.last_epoch == STEPS - held


def test_refuses_what_it_cannot_honour() -> None:
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    with pytest.raises(ampscaler.InvalidConfigError, match="fp16"):
        use_scaler(accelerator)

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.prepare(model())
    with pytest.raises(RuntimeError, match=r"after accelerator\.prepare"):
        use_scaler(accelerator)

    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" on machines without it
        cuda_scaler = ampscaler.GradScaler("cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        use_scaler(accelerator, cuda_scaler)
