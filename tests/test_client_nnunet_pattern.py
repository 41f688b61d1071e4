"""nnU-Net v2's trainer, re-created: ampscaler's scaler against torch's, bit for bit.

nnU-Net is not installed here (it needs batchgenerators, SimpleITK, ...); this file re-creates,
in its own words, what ``nnunetv2/training/nnUNetTrainer/nnUNetTrainer.py`` does with its
scaler, as read in its source:

- ``self.grad_scaler = GradScaler("cuda") if self.device.type == 'cuda' else None``, with
  ``from torch import GradScaler`` (torch's top-level name; ``torch.cuda.amp.GradScaler()``
  before torch 2.3), default arguments; on a CPU (or MPS) device there is no scaler and no
  autocast, and the step is a plain ``backward()``;
- ``train_step``: ``optimizer.zero_grad(set_to_none=True)``, the forward under autocast,
  ``grad_scaler.scale(l).backward()``, ``unscale_(optimizer)``, ``clip_grad_norm_(params,
  12)``, ``step(optimizer)``, ``update()``; nothing is read back from the scaler;
- the optimizer is an SGD (momentum 0.99, Nesterov, weight decay 3e-5) and its learning rate
  a poly schedule set at each epoch's start from the epoch number (``PolyLRScheduler.step
  (current_epoch)``), so a skipped step never shifts the schedule;
- the warm-up trainer (``nnUNetTrainer_warmup``) builds a new optimizer and schedule when
  the warm-up epochs end, and keeps the scaler; the Primus trainers use ``AdamW(fused=True)``
  and clip at 1;
- ``save_checkpoint`` stores ``'grad_scaler_state': grad_scaler.state_dict() if grad_scaler
  is not None else None`` beside the weights and the optimizer with ``torch.save``;
  ``load_checkpoint`` reads it with ``torch.load(..., map_location=device,
  weights_only=False)`` and calls ``grad_scaler.load_state_dict`` only when the trainer has a
  scaler and the checkpoint holds a state: a checkpoint written on a CPU (``None``) resumed
  on a GPU starts the scaler afresh, and a GPU checkpoint resumed on a CPU drops the state.

Why it matters: one of the most used medical segmentation frameworks; it resumes from its
checkpoints routinely (``--c``), across machines with and without a scaler, and across the
two scaler classes once ampscaler is in; a resume must continue the scale exactly.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[[], Any] | None
EPOCHS, ITERATIONS = 4, 3
INF_AT = {1, 5, 6}  # global iterations whose gradients get an inf/NaN after backward
WARMUP = 2  # epochs of the warm-up trainer's first optimizer


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def torch_scaler() -> Any:
    # nnU-Net's line is GradScaler("cuda") with torch's defaults; here the CPU stands in for
    # CUDA, and a short growth interval lets the scale grow within the test.
    return torch.amp.GradScaler("cpu", growth_interval=2)


def patched_scaler() -> Any:
    return torch.GradScaler("cpu", growth_interval=2)  # the name nnU-Net imports


class Trainer:
    """nnU-Net's trainer around one scaler (module docstring); ``make_scaler`` ``None`` is
    the trainer on a CPU device: no scaler, no autocast."""

    def __init__(self, make_scaler: Factory, warmup: bool = False, fused: bool = False) -> None:
        torch.manual_seed(0)
        self.network = torch.nn.Sequential(
            torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.InstanceNorm2d(4, affine=True),
            torch.nn.LeakyReLU(0.01), torch.nn.Conv2d(4, 3, 1),
        )  # fmt: skip
        self.grad_scaler = None if make_scaler is None else make_scaler()
        self.initial_lr, self.num_epochs, self.current_epoch = 1e-2, EPOCHS, 0
        self.warmup, self.fused = warmup, fused
        self.optimizer = self.configure_optimizer("warmup" if warmup else "train")
        self.data = torch.Generator().manual_seed(1)
        self.iteration = 0
        self.record: list[tuple[float, float, int]] = []  # (lr, scale, tracker) per step

    def configure_optimizer(self, stage: str) -> torch.optim.Optimizer:
        params = self.network.parameters()
        if self.fused:  # Primus
            return torch.optim.AdamW(params, self.initial_lr, weight_decay=5e-2, fused=True)
        lr = self.initial_lr / 10 if stage == "warmup" else self.initial_lr
        return torch.optim.SGD(params, lr, weight_decay=3e-5, momentum=0.99, nesterov=True)

    def on_train_epoch_start(self) -> None:
        if self.warmup and self.current_epoch == WARMUP:
            self.optimizer = self.configure_optimizer("train")  # the scaler is kept
        progress = 1 - self.current_epoch / self.num_epochs
        for group in self.optimizer.param_groups:
            group["lr"] = self.initial_lr * progress**0.9

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(output.float(), target)
        probs = output.float().softmax(1)
        onehot = torch.nn.functional.one_hot(target, 3).permute(0, 3, 1, 2)
        dice = (2 * (probs * onehot).sum((0, 2, 3)) + 1e-5) / (probs + onehot).sum((0, 2, 3))
        return ce - dice.mean()

    def train_step(self) -> float:
        data = torch.randn(2, 2, 8, 8, generator=self.data)
        target = torch.randint(0, 3, (2, 8, 8), generator=self.data)
        self.optimizer.zero_grad(set_to_none=True)
        amp = self.grad_scaler is not None
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            loss = self.loss(self.network(data), target)
        clip = 1.0 if self.fused else 12.0
        params = self.network.parameters()
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
            self.poison()
            self.grad_scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(params, clip)
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
            scale, tracker = self.grad_scaler.get_scale(), self.grad_scaler._get_growth_tracker()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            self.optimizer.step()
            scale, tracker = 1.0, 0
        self.record.append((self.optimizer.param_groups[0]["lr"], scale, tracker))
        self.iteration += 1
        return loss.item()

    def poison(self) -> None:
        if self.iteration in INF_AT:
            value = float("nan") if self.iteration == 5 else float("inf")
            self.network[0].weight.grad.view(-1)[self.iteration] = value

    def run_epochs(self, until: int) -> None:
        while self.current_epoch < until:
            self.on_train_epoch_start()
            for _ in range(ITERATIONS):
                self.train_step()
            self.current_epoch += 1

    def save_checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        scaler = self.grad_scaler
        torch.save(
            {
                "network_weights": self.network.state_dict(),
                "optimizer_state": self.optimizer.state_dict(),
                "grad_scaler_state": scaler.state_dict() if scaler is not None else None,
                "current_epoch": self.current_epoch,
                "iteration": self.iteration,
                "data": self.data.get_state(),
            },
            buffer,
        )
        return buffer.getvalue()

    def load_checkpoint(self, saved: bytes, weights_only: bool = False) -> None:
        checkpoint = torch.load(io.BytesIO(saved), map_location="cpu", weights_only=weights_only)
        self.network.load_state_dict(checkpoint["network_weights"])
        self.current_epoch = checkpoint["current_epoch"]
        if self.warmup and self.current_epoch >= WARMUP:
            self.optimizer = self.configure_optimizer("train")
        self.optimizer.load_state_dict(checkpoint["optimizer_state"])
        if self.grad_scaler is not None and checkpoint["grad_scaler_state"] is not None:
            self.grad_scaler.load_state_dict(checkpoint["grad_scaler_state"])
        self.iteration = checkpoint["iteration"]
        self.data.set_state(checkpoint["data"])


_SAME: Any = object()


def train(
    make_scaler: Factory, resume_with: Factory = _SAME, weights_only: bool = False, **options: bool
) -> tuple[Trainer, list[tuple[float, float, int]]]:
    """Two epochs, a checkpoint, and the rest in a new trainer (built with ``resume_with``,
    by default as the first) resumed from it; returns the second trainer and the steps'
    records of both."""
    first = Trainer(make_scaler, **options)
    first.run_epochs(2)
    second = Trainer(make_scaler if resume_with is _SAME else resume_with, **options)
    second.load_checkpoint(first.save_checkpoint(), weights_only)
    second.run_epochs(EPOCHS)
    return second, first.record + second.record


def assert_same(ours: tuple[Trainer, list[Any]], theirs: tuple[Trainer, list[Any]]) -> None:
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0].network.parameters(), theirs[0].network.parameters(), strict=True):
        assert torch.equal(a, b)
    mine, other = ours[0].optimizer.state_dict(), theirs[0].optimizer.state_dict()
    for key, state in other["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(mine["state"][key][name]), torch.as_tensor(value))
    scaler, torchs = ours[0].grad_scaler, theirs[0].grad_scaler
    if torchs is not None:
        assert {k: scaler.state_dict()[k] for k in torchs.state_dict()} == torchs.state_dict()


def our_scaler() -> Any:
    return ampscaler.GradScaler("cpu", growth_interval=2)


MAKERS: dict[str, Factory] = {"none": None, "torch": torch_scaler, "ours": our_scaler}


@pytest.mark.parametrize("how", ["direct", "patched"])
@pytest.mark.parametrize("variant", ["plain", "warmup", "primus"])
def test_nnunet_training_with_resume_matches_torch(how: str, variant: str) -> None:
    options = {"warmup": variant == "warmup", "fused": variant == "primus"}
    with warnings.catch_warnings(record=True) as torch_warnings:
        warnings.simplefilter("always")
        theirs = train(torch_scaler, **options)
    with warnings.catch_warnings(record=True) as our_warnings:
        warnings.simplefilter("always")
        if how == "patched":
            with ampscaler.patch_torch():
                ours = train(patched_scaler, **options)
        else:
            ours = train(our_scaler, **options)
    assert_same(ours, theirs)
    assert [str(w.message) for w in our_warnings] == [str(w.message) for w in torch_warnings]
    scales = [scale for _, scale, _ in theirs[1]]
    # iterations 1, 5 and 6 were skipped (backoff), the others counted towards growth
    assert scales[1] < scales[0] and scales[5] < scales[4] and scales[6] < scales[5]
    assert max(scales[7:]) > scales[6]
    if how == "patched":
        assert isinstance(ours[0].grad_scaler, ampscaler.GradScaler)


@pytest.mark.parametrize("direction", ["torch-to-ours", "ours-to-torch"])
def test_a_checkpoint_resumes_across_the_two_scaler_classes(direction: str) -> None:
    theirs = train(torch_scaler)
    if direction == "torch-to-ours":
        ours = train(torch_scaler, resume_with=our_scaler)
    else:
        ours = train(our_scaler, resume_with=torch_scaler)
    assert_same(ours, theirs)


def test_a_checkpoint_loads_with_weights_only() -> None:
    """nnU-Net loads with ``weights_only=False``; torch's default is ``True``, and the scaler's
    state must not be what stops a checkpoint from loading so."""
    theirs = train(torch_scaler, weights_only=True)
    ours = train(our_scaler, weights_only=True)
    assert_same(ours, theirs)


@pytest.mark.parametrize(("saved_with", "resumed_with"), [("none", "ours"), ("ours", "none")])
def test_checkpoints_with_and_without_a_scaler_resume_as_nnunet_does(
    saved_with: str, resumed_with: str
) -> None:
    """A CPU trainer's checkpoint (``grad_scaler_state`` ``None``) into a trainer with a
    scaler starts the scale afresh; a checkpoint with a scaler's state into a CPU trainer
    drops it. The run goes on exactly as with torch's scaler in the same place."""
    torchs = {"ours": "torch"}
    saved, resumed = torchs.get(saved_with, saved_with), torchs.get(resumed_with, resumed_with)
    theirs = train(MAKERS[saved], resume_with=MAKERS[resumed])
    ours = train(MAKERS[saved_with], resume_with=MAKERS[resumed_with])
    assert_same(ours, theirs)
    if saved_with == "none":  # a fresh scaler, at its initial scale; iteration 6 overflows
        assert ours[1][2 * ITERATIONS][1] == 2.0**15
    else:  # trained on without a scaler from where the scaled run left off
        assert [scale for _, scale, _ in ours[1][2 * ITERATIONS :]] == [1.0] * 2 * ITERATIONS
