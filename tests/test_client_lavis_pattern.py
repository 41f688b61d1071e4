"""Salesforce LAVIS's runner and task loop driving a scaler, re-created: ampscaler's against
torch's, bit for bit.

LAVIS is not installed here; this file re-creates, in its own words, what
``lavis/runners/runner_base.py`` and ``lavis/tasks/base_task.py`` (``_train_inner_loop``) do with
the scaler (BLIP-2, InstructBLIP and the projects built on LAVIS copy both):

- the runner's ``scaler`` property: with ``run_cfg.amp``, a ``torch.cuda.amp.GradScaler()``
  built at first use and cached in ``self._scaler``; ``None`` without AMP;
- ``_train_inner_loop``: per iteration ``lr_scheduler.step(cur_epoch=..., cur_step=i)`` (a
  linear warmup, then a cosine over epochs, written into the param groups), the loss under
  ``torch.cuda.amp.autocast(enabled=use_amp)``, ``loss /= accum_grad_iters`` (in place),
  ``scaler.scale(loss).backward()``, and every ``accum_grad_iters`` iterations
  ``scaler.step(optimizer)``, ``scaler.update()``, ``optimizer.zero_grad()``: no ``unscale_``, no
  clipping, and gradients left over at the end of an epoch (iterations not a multiple of
  ``accum_grad_iters``) carried into the next epoch's first step;
- ``_save_checkpoint``: ``{"model", "optimizer", "config", "scaler": self.scaler.state_dict()
  if self.scaler else None, "epoch"}``; ``_load_checkpoint`` (resume): ``if self.scaler and
  "scaler" in checkpoint: self.scaler.load_state_dict(checkpoint["scaler"])``; so a run started
  without AMP (``"scaler": None``) and resumed with it hands ``None`` to ``load_state_dict``.

Why it matters: accumulation across ``scale()`` calls with no ``unscale_()``, a schedule set
directly on the param groups between ``update()`` calls, leftovers across epochs, and the
errors torch's scaler raises for what LAVIS's resume hands it.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[[], Any]
ITERS_PER_EPOCH, EPOCHS = 5, 3
INF_AT = {(1, 1)}  # (epoch, iteration): an inf loss


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class WarmupCosine:
    """LAVIS's LinearWarmupCosineLRScheduler: linear warmup over the first iterations of
    epoch 0, then a cosine over epochs, set into every param group."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_epoch: int) -> None:
        self.optimizer, self.max_epoch = optimizer, max_epoch
        self.init_lr, self.min_lr, self.warmup_steps, self.warmup_start = 1e-2, 1e-4, 3, 1e-3

    def step(self, cur_epoch: int, cur_step: int) -> None:
        if cur_epoch == 0 and cur_step < self.warmup_steps:
            lr = (
                self.warmup_start
                + (self.init_lr - self.warmup_start) * cur_step / self.warmup_steps
            )
        else:
            cosine = 0.5 * (1.0 + math.cos(math.pi * cur_epoch / self.max_epoch))
            lr = self.min_lr + (self.init_lr - self.min_lr) * cosine
        for group in self.optimizer.param_groups:
            group["lr"] = lr


class Runner:
    def __init__(self, make_scaler: Factory, amp: bool, accum_grad_iters: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3)
        )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.05)
        self.lr_scheduler = WarmupCosine(self.optimizer, EPOCHS)
        self.make_scaler, self.amp, self._scaler = make_scaler, amp, None
        self.accum_grad_iters = accum_grad_iters
        self.start_epoch = 0
        self.trace = Trace()

    @property
    def scaler(self) -> Any:
        if self.amp and self._scaler is None:
            self._scaler = self.make_scaler()
        return self._scaler

    def train_epoch(self, epoch: int) -> None:
        scaler = self.scaler
        use_amp = scaler is not None
        data = torch.Generator().manual_seed(100 + epoch)
        for i in range(ITERS_PER_EPOCH):
            x, y = torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data)
            self.lr_scheduler.step(cur_epoch=epoch, cur_step=i)
            with torch.autocast("cpu", dtype=torch.float16, enabled=use_amp):
                loss = torch.nn.functional.cross_entropy(self.model(x).float(), y)
                if (epoch, i) in INF_AT:
                    loss = loss * float("inf")
                loss /= self.accum_grad_iters
            if use_amp:
                scaler.scale(loss).backward()
            else:
                loss.backward()
            if (i + 1) % self.accum_grad_iters == 0:
                if use_amp:
                    scaler.step(self.optimizer)
                    scaler.update()
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad()
            self.trace.params.append([p.detach().clone() for p in self.model.parameters()])
            self.trace.grads.append(
                [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]
            )
            self.trace.scales.append(scaler.get_scale() if use_amp else 1.0)
            self.trace.returns.append(self.optimizer.param_groups[0]["lr"])

    def train(self, until: int = EPOCHS) -> None:
        for epoch in range(self.start_epoch, until):
            self.train_epoch(epoch)

    def save_checkpoint(self, cur_epoch: int) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "config": {"amp": self.amp, "accum_grad_iters": self.accum_grad_iters},
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "epoch": cur_epoch,
            },
            buffer,
        )
        return buffer.getvalue()

    def load_checkpoint(self, saved: bytes) -> None:
        checkpoint = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=True)
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        if self.scaler and "scaler" in checkpoint:
            self.scaler.load_state_dict(checkpoint["scaler"])
        self.start_epoch = checkpoint["epoch"] + 1


def torch_scaler() -> Any:
    return torch.amp.GradScaler("cpu", growth_interval=2)


def our_scaler() -> Any:
    return ampscaler.GradScaler("cpu", growth_interval=2)


def patched_scaler() -> Any:
    return torch.cuda.amp.GradScaler(growth_interval=2)  # LAVIS's name


def run(make_scaler: Factory, amp: bool = True, accum_grad_iters: int = 1) -> Runner:
    runner = Runner(make_scaler, amp, accum_grad_iters)
    runner.train()
    return runner


@pytest.mark.parametrize("accum_grad_iters", [1, 2, 3])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_train_inner_loop_matches_torch(accum_grad_iters: int, how: str) -> None:
    theirs = run(torch_scaler, accum_grad_iters=accum_grad_iters)
    if how == "patched":
        with ampscaler.patch_torch(device="cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
            ours = run(patched_scaler, accum_grad_iters=accum_grad_iters)
        assert isinstance(ours.scaler, ampscaler.GradScaler)
    else:
        ours = run(our_scaler, accum_grad_iters=accum_grad_iters)
    assert_same_trace(ours.trace, theirs.trace)
    scales = theirs.trace.scales
    # the inf loss of epoch 1 backed the scale off at the update that took it in
    backoff = ITERS_PER_EPOCH + 1
    while (backoff % ITERS_PER_EPOCH + 1) % accum_grad_iters:
        backoff += 1
    assert scales[backoff] < scales[backoff - 1]
    if accum_grad_iters == 3:  # 2 micro-batches left over at epoch 0's end, carried into 1
        assert theirs.trace.grads[ITERS_PER_EPOCH - 1][0] is not None


def test_no_amp_runs_without_a_scaler() -> None:
    """``amp`` off: the property gives ``None``, the checkpoint's scaler is ``None``; the
    scaler classes play no part (nothing differs, nothing is built)."""
    made: list[Any] = []
    runner = run(lambda: made.append(1), amp=False)
    assert made == [] and runner.scaler is None
    assert torch.load(io.BytesIO(runner.save_checkpoint(0)))["scaler"] is None


@pytest.mark.parametrize(
    ("first", "then"),
    [(our_scaler, our_scaler), (torch_scaler, our_scaler), (our_scaler, torch_scaler)],
    ids=["ours", "torch-to-ours", "ours-to-torch"],
)
def test_a_resumed_run_matches_torchs(first: Factory, then: Factory) -> None:
    def resumed(make: Factory, make_then: Factory) -> Runner:
        runner = Runner(make, True, 1)
        runner.train(until=2)
        saved = runner.save_checkpoint(1)
        again = Runner(make_then, True, 1)
        again.load_checkpoint(saved)
        again.train()
        return again

    theirs, ours = resumed(torch_scaler, torch_scaler), resumed(first, then)
    assert_same_trace(ours.trace, theirs.trace)
    whole = run(torch_scaler)
    assert theirs.trace.scales == whole.trace.scales[2 * ITERS_PER_EPOCH :]
    assert theirs.trace.scales[0] != 2.0**16  # the loaded scale, not a fresh one


def test_resuming_a_run_without_amp_with_amp_fails_as_torchs() -> None:
    """``"scaler": None`` from a run without AMP, resumed with AMP: ``load_state_dict(None)``
    raises torch's TypeError with either scaler."""
    saved = Runner(torch_scaler, False, 1).save_checkpoint(0)
    for make in (torch_scaler, our_scaler):
        runner = Runner(make, True, 1)
        with pytest.raises(TypeError):
            runner.load_checkpoint(saved)
