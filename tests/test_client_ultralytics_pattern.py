"""ultralytics' trainer, re-created: ampscaler's scaler against torch's, bit for bit.

ultralytics is not a dependency here (it needs torchvision, OpenCV, ...), so this file
re-creates, in its own words, what ``ultralytics/engine/trainer.py`` (8.4) does with a scaler:

- the scaler is ``torch.amp.GradScaler("cuda", enabled=amp)``, where ``amp`` is ``False`` on a
  CPU and for bfloat16 training: the disabled scaler then runs every call of the loop;
- each batch runs ``scaler.scale(loss).backward()``; the optimizer steps once
  ``ni - last_opt_step >= accumulate``, where ``accumulate`` ramps up from 1 over the warm-up
  iterations; ``optimizer_step()`` is ``unscale_(optimizer)``, ``clip_grad_norm_(params,
  max_norm=10.0)``, ``step(optimizer)``, ``update()``, ``zero_grad()`` and then the EMA's
  update (``ema = d * ema + (1 - d) * model`` over the floating-point state, with ``d`` rising
  with the number of updates), whether the scaler skipped the step or not; the optimizer is an
  SGD (Nesterov) over three parameter groups: weights with decay, norm weights and biases
  without;
- at each epoch's end it saves ``{"ema": ..., "updates": ..., "optimizer": ..., "scaler":
  scaler.state_dict(), ...}`` with ``torch.save``; a resume loads the optimizer, then
  ``if ckpt.get("scaler"): scaler.load_state_dict(ckpt["scaler"])`` (a disabled scaler's ``{}``
  is skipped), then the EMA, and zeroes the gradients before training.

After a backward that fails (the trainer catches CUDA out-of-memory errors in
``scale(loss).backward()``, drops the loss and retries at half the batch) the scaler holds
nothing of the failed batch: each loss given to ``scale()`` is kept detached.

A known divergence, not changed here: ampscaler's ``load_state_dict()`` refuses to load after
``scale()`` and before ``update()``, which the trainer's NaN recovery does when an epoch ends
inside an accumulation (it zeroes the gradients right after), a documented stricter check
(docs/migration.md).
"""

from __future__ import annotations

import gc
import io
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
EPOCHS, BATCHES, WARMUP = 3, 5, 6
NOMINAL_ACCUMULATE = 2
OVERFLOW_AT = {3, 9}  # global batch indices whose gradients get an inf after backward


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def small_detector() -> torch.nn.Module:
    torch.manual_seed(0)
    body = [torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.SiLU()]
    return torch.nn.Sequential(*body, torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def three_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    """ultralytics' build_optimizer: decayed weights, norm weights, biases."""
    decay, norm, bias = [], [], []
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if name == "bias":
                bias.append(param)
            elif isinstance(module, torch.nn.BatchNorm2d):
                norm.append(param)
            else:
                decay.append(param)
    optimizer = torch.optim.SGD(bias, lr=0.01, momentum=0.9, nesterov=True)
    optimizer.add_param_group({"params": decay, "weight_decay": 5e-4})
    optimizer.add_param_group({"params": norm, "weight_decay": 0.0})
    return optimizer


class EMA:
    """ultralytics' ModelEMA: an exponential average of the model's floating-point state."""

    def __init__(self, model: torch.nn.Module, updates: int = 0) -> None:
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = updates

    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        d = 0.9999 * (1 - math.exp(-self.updates / 2000))
        for key, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                self.state[key].mul_(d).add_((1 - d) * value.detach())


class Trainer:
    def __init__(self, factory: Factory, device: str, amp: bool) -> None:
        self.model = small_detector()
        self.optimizer = three_groups(self.model)
        self.scaler = factory(device, enabled=amp, init_scale=2.0**10, growth_interval=1)
        self.ema = EMA(self.model)
        self.data = torch.Generator().manual_seed(1)
        self.scales: list[float] = []

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        self.ema.update(self.model)

    def train(self, epochs: range, last_opt_step: int = -1) -> int:
        for epoch in epochs:
            for i in range(BATCHES):
                ni = i + BATCHES * epoch
                accumulate = NOMINAL_ACCUMULATE
                if ni <= WARMUP:
                    accumulate = max(1, round(1 + (NOMINAL_ACCUMULATE - 1) * ni / WARMUP))
                images = torch.randn(2, 3, 6, 6, generator=self.data)
                with torch.autocast("cpu", dtype=torch.float16):
                    out = self.model(images)
                loss = torch.nn.functional.cross_entropy(
                    out.float(), torch.randint(0, 3, (2,), generator=self.data)
                )
                self.scaler.scale(loss).backward()
                if ni in OVERFLOW_AT:
                    self.model[-1].weight.grad.view(-1)[0] = float("inf")
                if ni - last_opt_step >= accumulate:
                    self.optimizer_step()
                    last_opt_step = ni
                self.scales.append(self.scaler.get_scale())
        return last_opt_step

    def checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "epoch": 0,
                "ema": {k: v.half() for k, v in self.ema.state.items()},
                "updates": self.ema.updates,
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
            },
            buffer,
        )
        return buffer.getvalue()

    def resume(self, saved: bytes, model_from: Trainer) -> None:
        ckpt = torch.load(io.BytesIO(saved), weights_only=True)
        self.model.load_state_dict(model_from.model.state_dict())
        self.optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self.ema = EMA(self.model, ckpt["updates"])
        self.ema.state = {k: v.float() for k, v in ckpt["ema"].items()}
        self.data = model_from.data
        self.optimizer.zero_grad()


def run(
    factory: Factory, resume_into: Factory | None = None, device: str = "cpu", amp: bool = True
) -> tuple[list[float], list[torch.Tensor], Trainer]:
    """Train EPOCHS epochs; after the first the run stops and a new trainer made with
    ``resume_into`` resumes from its checkpoint."""
    first = Trainer(factory, device, amp)
    last_opt_step = first.train(range(1))
    second = Trainer(resume_into or factory, device, amp)
    second.resume(first.checkpoint(), first)
    second.train(range(1, EPOCHS), last_opt_step)
    params = [p.detach().clone() for p in second.model.parameters()]
    return first.scales + second.scales, params + list(second.ema.state.values()), second


def assert_same(ours: Any, theirs: Any) -> None:
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("how", ["direct", "patched", "resumed-from-torch", "resumed-into-torch"])
def test_ultralytics_style_training_with_resume_matches_torch(how: str) -> None:
    theirs = run(torch.amp.GradScaler)
    if how == "patched":
        with ampscaler.patch_torch():
            ours = run(lambda *a, **k: torch.amp.GradScaler(*a, **k))
    elif how == "direct":
        ours = run(ampscaler.GradScaler)
    elif how == "resumed-from-torch":
        ours = run(torch.amp.GradScaler, resume_into=ampscaler.GradScaler)
    else:
        ours = run(ampscaler.GradScaler, resume_into=torch.amp.GradScaler)
    assert_same(ours, theirs)
    scales = theirs[0]
    # the steps that end the overflows' accumulations (batches 4 and 10) were skipped
    assert scales[4] < scales[3] and scales[10] < scales[9]
    assert max(scales[11:]) > scales[10]  # and the scale grew again
    assert all(torch.isfinite(t).all() for t in ours[1])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_amp_off_runs_every_call_on_a_disabled_scaler_as_torch(device: str) -> None:
    """``enabled=False`` (a CPU run, bfloat16): every call passes through, the clipping sees
    the raw gradients (an inf one makes NaN parameters in both), the checkpoint's ``"scaler"``
    is ``{}`` and the resume skips it."""
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this checks the disabled path built for 'cuda' without CUDA")
    theirs = run(torch.amp.GradScaler, device=device, amp=False)
    ours = run(ampscaler.GradScaler, device=device, amp=False)
    assert_same(ours, theirs)
    assert set(ours[0]) == {1.0}
    assert ours[2].scaler.state_dict() == theirs[2].scaler.state_dict() == {}


def test_an_amp_checkpoint_resumed_with_amp_off_is_ignored_as_by_torch() -> None:
    """A run checkpointed with AMP and resumed with it off (on a CPU): the disabled scaler
    takes the state and ignores it, as torch's does."""
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
        trained = Trainer(factory, "cpu", amp=True)
        trained.train(range(1))
        saved = torch.load(io.BytesIO(trained.checkpoint()), weights_only=True)["scaler"]
        assert saved["scale"] != 2.0**10
        off = factory("cuda", enabled=False)
        off.load_state_dict(saved)
        assert (off.is_enabled(), off.get_scale(), off.state_dict()) == (False, 1.0, {})


def test_a_failed_backward_leaves_no_activations_held_by_the_scaler() -> None:
    """ultralytics retries a CUDA out-of-memory error at half the batch: the failed batch's
    activations must not outlive the loss the trainer dropped (torch's scaler holds none)."""
    alive = {}
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
        model = small_detector()
        scaler = factory("cpu")
        hidden = model[:4](torch.randn(2, 3, 6, 6))
        activation = weakref.ref(hidden)  # the head's Linear saves it for its backward
        loss = model[4:](hidden).sum()
        try:
            scaler.scale(loss)
            raise RuntimeError("CUDA out of memory")  # as in backward(), before it ran
        except RuntimeError:
            hidden = loss = None  # the trainer drops the batch, clears memory and retries
        gc.collect()
        alive[factory.__module__] = activation() is not None
    assert alive == {"torch.amp.grad_scaler": False, "ampscaler.scaler": False}
