"""AllenNLP's ``GradientDescentTrainer``, re-created: ampscaler's scaler against torch's.

AllenNLP is not installed here (archived; it pins old torch); this file re-creates, in its own
words, what ``allennlp/training/gradient_descent_trainer.py`` (2.10) does with a scaler, as
read in its source:

- ``from torch.cuda import amp`` at import, and with ``use_amp`` (and ``grad_scaling``, the
  default) ``self._scaler = amp.GradScaler()``: torch's deprecated name, looked up on the
  module when the trainer is built; ``from torch.cuda.amp.grad_scaler import OptState``;
- each batch group (gradient accumulation): ``optimizer.zero_grad()``, then per batch the
  forward under ``amp.autocast(use_amp)``, ``ValueError("nan loss encountered")`` when the
  loss is NaN, the local loss divided by the group's size, and the backward through the
  ``MixedPrecisionBackwardCallback``: ``trainer._scaler.scale(batch_outputs["loss"])
  .backward()``, which scales the output's loss, not the divided one;
- ``rescale_gradients()``: with ``grad_norm`` a float, ``self._scaler.unscale_(optimizer)``
  and ``clip_grad_norm_`` over the parameters that have gradients, returning ``.item()`` of
  the norm (inf on an overflow); with ``grad_norm=True`` the norm alone, of the scaled
  gradients;
- ``clip_gradient()``: with ``grad_clipping``, it reads
  ``self._scaler._per_optimizer_states[id(self.optimizer)]["stage"]`` and unscales only when
  it ``is not OptState.UNSCALED`` (``rescale_gradients()`` may have), then
  ``clip_grad_value_``;
- the learning-rate and momentum schedulers' ``step_batch``, then ``self._scaler.step
  (optimizer)`` and ``self._scaler.update()``, then the moving average's ``apply``, whether
  the step was skipped or not;
- ``get_checkpoint_state()`` saves the model, optimizer, schedulers, moving average and
  counters, and not the scaler: a resumed run starts it again at its initial scale.

Why it matters: a trainer that reads the scaler's per-optimizer stage through torch's private
names and compares it by identity with torch's enum, so that two unscaling paths share one
``unscale_()`` per step.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.cuda.amp.grad_scaler import OptState

import ampscaler

STEPS, GROUP = 6, 2
INF_AT = {2, 7}  # batches (counted over the run) whose gradients get an inf after backward


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Trainer:
    """The trainer's batch loop around its scaler (module docstring)."""

    def __init__(
        self, make_scaler: Callable[[], Any], grad_norm: float | bool, grad_clipping: float | None
    ) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.average = [p.detach().clone() for p in self.model.parameters()]
        self._scaler = make_scaler()
        self._grad_norm, self._grad_clipping = grad_norm, grad_clipping
        self.data = torch.Generator().manual_seed(1)
        self.batches = self.completed = 0
        self.log: list[tuple[float, float | None]] = []  # (scale, grad norm) per batch group

    def rescale_gradients(self) -> float | None:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not isinstance(self._grad_norm, bool):
            self._scaler.unscale_(self.optimizer)
            return torch.nn.utils.clip_grad_norm_(params, self._grad_norm).item()
        if self._grad_norm:
            return torch.norm(torch.stack([torch.norm(p.grad.detach()) for p in params])).item()
        return None

    def clip_gradient(self) -> None:
        if self._grad_clipping is not None:
            state = self._scaler._per_optimizer_states[id(self.optimizer)]
            if state["stage"] is not OptState.UNSCALED:
                self._scaler.unscale_(self.optimizer)
            params = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_value_(params, self._grad_clipping)

    def train_batch_group(self) -> None:
        self.optimizer.zero_grad()
        for _ in range(GROUP):
            inputs = torch.randn(4, 6, generator=self.data)
            labels = torch.randint(0, 3, (4,), generator=self.data)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = self.model(inputs)
                outputs = {"loss": torch.nn.functional.cross_entropy(logits.float(), labels)}
                loss = outputs["loss"]
                if torch.isnan(loss):
                    raise ValueError("nan loss encountered")
                loss = loss / GROUP  # for the logged loss; the callback scales the output's
            self._scaler.scale(outputs["loss"]).backward()
            if self.batches in INF_AT:
                self.model[0].weight.grad.view(-1)[self.batches] = float("inf")
            self.batches += 1
        grad_norm = self.rescale_gradients()
        self.clip_gradient()
        for group in self.optimizer.param_groups:  # a warm-up scheduler's step_batch
            group["lr"] = 0.1 * min(1.0, (self.completed + 1) / 3)
        self._scaler.step(self.optimizer)
        self._scaler.update()
        decay = min(0.9, (1 + self.completed) / (10 + self.completed))
        for shadow, param in zip(self.average, self.model.parameters(), strict=True):
            shadow.mul_(decay).add_(param.detach(), alpha=1 - decay)
        self.completed += 1
        self.log.append((self._scaler.get_scale(), grad_norm))

    def get_checkpoint_state(self) -> bytes:
        buffer = io.BytesIO()
        training_states = {
            "optimizer": self.optimizer.state_dict(),
            "moving_average": self.average,
            "batches_in_epoch_completed": self.completed,
            "batches": self.batches,
            "data": self.data.get_state(),
        }
        torch.save((self.model.state_dict(), training_states), buffer)
        return buffer.getvalue()

    def restore_checkpoint(self, saved: bytes) -> None:
        model_state, training_state = torch.load(io.BytesIO(saved))
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(training_state["optimizer"])
        self.average = training_state["moving_average"]
        self.completed = training_state["batches_in_epoch_completed"]
        self.batches = training_state["batches"]
        self.data.set_state(training_state["data"])


def train(
    make_scaler: Callable[[], Any], grad_norm: float | bool, grad_clipping: float | None
) -> tuple[Trainer, list[tuple[float, float | None]]]:
    """Half the batch groups, a checkpoint, and the rest in a new trainer restored from it."""
    first = Trainer(make_scaler, grad_norm, grad_clipping)
    for _ in range(STEPS // 2):
        first.train_batch_group()
    second = Trainer(make_scaler, grad_norm, grad_clipping)
    second.restore_checkpoint(first.get_checkpoint_state())
    for _ in range(STEPS - STEPS // 2):
        second.train_batch_group()
    return second, first.log + second.log


def allennlps_line() -> Any:
    from torch.cuda import amp

    return amp.GradScaler(init_scale=2.0**12)  # AllenNLP's takes the defaults; a GPU's


CLIPPING = [(1.0, None), (1.0, 0.5), (True, 0.5), (False, None)]


@pytest.mark.parametrize(("grad_norm", "grad_clipping"), CLIPPING)
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_trainer_matches_torch(
    how: str, grad_norm: float | bool, grad_clipping: float | None
) -> None:
    theirs = train(
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12), grad_norm, grad_clipping
    )
    if how == "direct":
        ours = train(
            lambda: ampscaler.GradScaler("cpu", init_scale=2.0**12), grad_norm, grad_clipping
        )
    else:
        with ampscaler.patch_torch(device="cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
            ours = train(allennlps_line, grad_norm, grad_clipping)
        assert isinstance(ours[0]._scaler, ampscaler.GradScaler)
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0].model.parameters(), theirs[0].model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours[0].average, theirs[0].average, strict=True):
        assert torch.equal(a, b)
    scales = [scale for scale, _ in theirs[1]]
    # groups 1 (batch 2) and 3 (batch 7) skipped; the restore after group 2 restarted the
    # scaler at its initial scale, as the checkpoint holds none
    assert scales[:2] == [2.0**12, 2.0**11] and scales[3] == 2.0**11


def test_the_stage_check_sees_torchs_enum_after_unscale() -> None:
    """``clip_gradient()`` compares the stage with torch's ``OptState.UNSCALED`` by identity:
    after ``unscale_()`` ampscaler's per-optimizer view must hold torch's very member, and
    before it one that is not ``UNSCALED`` (a second ``unscale_()`` would raise)."""
    for scaler in (torch.amp.GradScaler("cpu"), ampscaler.GradScaler("cpu")):
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.unscale_(optimizer)
        assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED
        with pytest.raises(RuntimeError, match="unscale_"):
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
