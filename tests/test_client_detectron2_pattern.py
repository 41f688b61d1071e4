"""detectron2's ``AMPTrainer``, re-created: ampscaler's scaler against torch's.

detectron2 is not on PyPI and builds C++ extensions, so this file re-creates, in its own words,
what it does with a scaler, as read in ``detectron2/engine/train_loop.py`` and ``hooks.py``
and fvcore's ``Checkpointer``:

- without a ``grad_scaler`` argument the trainer builds ``torch.cuda.amp.GradScaler()``
  (deprecated in torch: a ``FutureWarning``; without CUDA, torch's "is enabled, but CUDA is not
  available" warning, and a disabled scaler);
- ``run_step``: the model returns a dict of losses, summed with ``sum(loss_dict.values())``;
  ``zero_grad()`` before the forward or after it (``zero_grad_before_forward``);
  ``scale(losses).backward()``; with ``log_grad_scaler`` it logs ``get_scale()`` *between the
  backward and the step* (a read in the middle of the iteration); ``_write_metrics`` raises
  ``FloatingPointError`` on an inf/NaN loss, before the step (the training stops there); then
  ``step(optimizer)`` and ``update()``;
- the trainer's ``state_dict()`` is ``{"iteration", "hooks", "optimizer", "grad_scaler"}``;
  ``PeriodicCheckpointer`` saves it after a step with the model's weights (``torch.save``), and
  ``resume_or_load`` gives ``grad_scaler`` back to a new trainer's scaler.

Overflows come as they come in fp16 training, in the gradients with a finite loss (here a
gradient hook multiplies one parameter's gradient by inf on chosen iterations).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
MAX_ITER = 9
OVERFLOW_AT = {2, 6}  # iterations whose gradients overflow
NAN_LOSS_AT = 4  # the iteration whose loss is NaN: FloatingPointError, the run stops
CHECKPOINT_PERIOD = 2


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class TwoLossModel(torch.nn.Module):
    """A model that returns a dict of losses, as detectron2's meta-architectures do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(5, 8)
        self.cls, self.box = torch.nn.Linear(8, 3), torch.nn.Linear(8, 4)
        self.poison = False
        self.backbone.weight.register_hook(lambda g: g * float("inf") if self.poison else g)

    def forward(self, data: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, Any]:
        x, labels, boxes = data
        features = torch.relu(self.backbone(x))
        return {
            "loss_cls": torch.nn.functional.cross_entropy(self.cls(features).float(), labels),
            "loss_box": torch.nn.functional.smooth_l1_loss(self.box(features).float(), boxes),
        }


class AMPStyleTrainer:
    def __init__(
        self, grad_scaler: Any = None, zero_grad_before_forward: bool = False, start_iter: int = 0
    ) -> None:
        self.model = TwoLossModel()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        if grad_scaler is None:
            grad_scaler = torch.cuda.amp.GradScaler()
        self.grad_scaler = grad_scaler
        self.zero_grad_before_forward = zero_grad_before_forward
        self.iter = start_iter
        self.logged: list[float] = []

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + self.iter)
        return (
            torch.randn(6, 5, generator=g),
            torch.randint(0, 3, (6,), generator=g),
            (torch.randn(6, 4, generator=g)),
        )

    def run_step(self) -> None:
        data = self.data()
        if self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        self.model.poison = self.iter in OVERFLOW_AT
        with torch.autocast("cpu", dtype=torch.float16):
            loss_dict = self.model(data)
            if self.iter == NAN_LOSS_AT:
                loss_dict["loss_box"] = loss_dict["loss_box"] * float("nan")
            losses = sum(loss_dict.values())
        if not self.zero_grad_before_forward:
            self.optimizer.zero_grad()
        self.grad_scaler.scale(losses).backward()
        self.logged.append(self.grad_scaler.get_scale())  # log_grad_scaler
        metrics = {k: v.detach().cpu().item() for k, v in loss_dict.items()}
        if not all(torch.isfinite(torch.tensor(list(metrics.values())))):
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!")
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {
            "iteration": self.iter,
            "hooks": {},
            "optimizer": self.optimizer.state_dict(),
            "grad_scaler": self.grad_scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = state["iteration"] + 1
        self.optimizer.load_state_dict(state["optimizer"])
        self.grad_scaler.load_state_dict(state["grad_scaler"])

    def train(self, saved: list[bytes]) -> None:
        """The train loop with a PeriodicCheckpointer; stops at the FloatingPointError."""
        while self.iter < MAX_ITER:
            try:
                self.run_step()
            except FloatingPointError:
                return
            if (self.iter + 1) % CHECKPOINT_PERIOD == 0:
                buffer = io.BytesIO()
                torch.save({"model": self.model.state_dict(), "trainer": self.state_dict()}, buffer)
                saved.append(buffer.getvalue())
            self.iter += 1


def train_and_resume(factory: Factory, zero_grad_before_forward: bool) -> dict[str, Any]:
    """Train until the NaN loss stops the run, resume a new trainer (its scaler built with
    torch's defaults) from the last checkpoint, and train on to MAX_ITER, past the NaN batch
    (a restarted detectron2 run would meet it again; here its data is left out)."""
    saved: list[bytes] = []
    first = AMPStyleTrainer(factory("cpu", init_scale=2.0**8, growth_interval=2),
                            zero_grad_before_forward)  # fmt: skip
    first.train(saved)
    assert first.iter == NAN_LOSS_AT
    checkpoint = torch.load(io.BytesIO(saved[-1]), weights_only=True)
    second = AMPStyleTrainer(factory("cpu"), zero_grad_before_forward)
    second.model.load_state_dict(checkpoint["model"])
    second.load_state_dict(checkpoint["trainer"])
    resumed_at = second.iter
    second.iter = NAN_LOSS_AT + 1
    second.train(saved)
    return {
        "logged": first.logged + second.logged,
        "resumed_at": resumed_at,
        "params": [p.detach().clone() for p in second.model.parameters()],
        "state": second.grad_scaler.state_dict(),
    }


@pytest.mark.parametrize("zero_grad_before_forward", [False, True])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_amp_trainer_style_training_and_resume_match_torch(
    how: str, zero_grad_before_forward: bool
) -> None:
    theirs = train_and_resume(torch.amp.GradScaler, zero_grad_before_forward)
    if how == "patched":
        ampscaler.patch_torch()
        ours = train_and_resume(lambda *a, **k: torch.amp.GradScaler(*a, **k),
                                zero_grad_before_forward)  # fmt: skip
    else:
        ours = train_and_resume(ampscaler.GradScaler, zero_grad_before_forward)
    assert ours["logged"] == theirs["logged"]
    logged = theirs["logged"]
    assert logged[3] < logged[2]  # the overflow at 2 backed off before 3 read the scale
    assert ours["resumed_at"] == theirs["resumed_at"] == NAN_LOSS_AT
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True))
    assert {key: ours["state"][key] for key in theirs["state"]} == theirs["state"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default scaler disables on CPU")
def test_the_default_scaler_without_cuda_warns_logs_and_checkpoints_as_torchs() -> None:
    """``torch.cuda.amp.GradScaler()`` under ``patch_torch`` on a CPU: the same two warnings
    (by category and torch's words), a disabled scaler whose logged scale is 1.0, an empty
    ``"grad_scaler"`` in the checkpoint that a disabled scaler takes and an enabled one refuses
    with torch's error."""

    def build() -> tuple[Any, list[tuple[type[Warning], str]]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = AMPStyleTrainer()
        return trainer, [(w.category, str(w.message)) for w in caught]

    theirs, their_warnings = build()
    torchs = torch.amp.GradScaler
    ampscaler.patch_torch()
    ours, our_warnings = build()
    assert isinstance(ours.grad_scaler, ampscaler.GradScaler)
    assert [c for c, _ in our_warnings] == [c for c, _ in their_warnings]
    assert all(o.startswith(t) for (_, o), (_, t) in zip(our_warnings, their_warnings, strict=True))
    for trainer in (theirs, ours):
        for _ in range(3):
            trainer.run_step()
            trainer.iter += 1
    assert ours.logged == theirs.logged == [1.0, 1.0, 1.0]
    assert all(torch.equal(a, b) for a, b in
               zip(ours.model.parameters(), theirs.model.parameters(), strict=True))  # fmt: skip
    state = ours.state_dict()["grad_scaler"]
    assert state == theirs.state_dict()["grad_scaler"] == {}
    ours.grad_scaler.load_state_dict(state)
    for enabled in (torchs("cpu"), ampscaler.GradScaler("cpu")):
        with pytest.raises(RuntimeError, match="The source state dict is empty"):
            enabled.load_state_dict(state)
