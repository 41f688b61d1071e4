"""detrex's ``Trainer`` (detectron2's ``SimpleTrainer`` and ``AMPTrainer`` in one), re-created.

detrex trains DETR-family detectors (DINO, Deformable-DETR, ...) on detectron2's engine. Read in
``IDEA-Research/detrex`` ``tools/train_net.py`` (the ``projects/*/train_net.py`` copies do the
same); what differs from detectron2's ``AMPTrainer`` (``tests/test_client_detectron2_pattern.py``):

- the scaler is the ``grad_scaler`` passed in, else ``torch.cuda.amp.GradScaler()`` when ``amp``;
  ``self.grad_scaler`` is set either way (``None`` without amp and without one passed);
- ``run_step``: the model and ``sum(loss_dict.values())`` under autocast, ``zero_grad()``,
  ``scale(losses).backward()``; with ``clip_grad_params`` (detrex's configs:
  ``max_norm=0.1, norm_type=2``): ``unscale_`` and ``clip_grad_norm_`` over the parameters
  that have a gradient; ``step``, ``update``; *then* ``_write_metrics``, which raises
  ``FloatingPointError`` on a NaN loss: the NaN iteration's step is skipped and its
  ``update()`` backs the scale off before the run stops (detectron2's ``AMPTrainer`` stops
  before the step);
- ``state_dict()`` adds ``"grad_scaler"`` and ``load_state_dict()`` loads it, each only
  ``if self.grad_scaler and self.amp``: the scaler's truth value decides, and a checkpoint of
  a run without amp (no ``"grad_scaler"`` key) fails to load with ``KeyError`` into one with
  amp.

Why it matters: a scaler whose truth value were false (a ``__len__`` of 0) would never be
saved or loaded; the state a resumed run gets must be torch's, after a skipped step too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from test_client_dreamfusion_pattern import TORCH_KEYS, saved

Factory = Callable[..., Any]
MAX_ITER, NAN_LOSS_AT, CHECKPOINT_AT = 8, 6, 3
OVERFLOW_AT = {1, 4}
CLIP = {"max_norm": 0.1, "norm_type": 2}


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Detector(torch.nn.Module):
    """Returns a dict of losses, as detectron2's models do in training; a frozen backbone
    stem leaves parameters without a gradient (filtered out before the clip)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(6, 8).requires_grad_(False)
        self.body = torch.nn.Linear(8, 8)
        self.cls, self.box = torch.nn.Linear(8, 3), torch.nn.Linear(8, 4)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, labels = batch
        h = torch.relu(self.body(self.stem(x)))
        loss_cls = torch.nn.functional.cross_entropy(self.cls(h).float(), labels)
        loss_box = self.box(h).float().abs().mean()
        return {"loss_cls": loss_cls, "loss_bbox": loss_box}


class Trainer:
    """detrex's ``Trainer`` (module docstring), without detectron2's hooks and storage."""

    def __init__(self, grad_scaler: Any, amp: bool = True, clip: bool = True) -> None:
        torch.manual_seed(0)
        self.model = Detector()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=1e-3, weight_decay=1e-4
        )
        self.grad_scaler, self.amp = grad_scaler, amp
        self.clip_grad_params = CLIP if clip else None
        self.iter = 0
        self.scales: list[float] = []  # get_scale() after each completed run_step

    def run_step(self, batch: tuple[torch.Tensor, torch.Tensor], nan: bool) -> None:
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.amp):
            loss_dict = self.model(batch)
            if nan:
                loss_dict["loss_bbox"] = loss_dict["loss_bbox"] * float("nan")
            losses = sum(loss_dict.values())
        self.optimizer.zero_grad()
        assert isinstance(losses, torch.Tensor)
        self.grad_scaler.scale(losses).backward()
        if self.iter in OVERFLOW_AT:
            grad = self.model.body.weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        if self.clip_grad_params is not None:
            self.grad_scaler.unscale_(self.optimizer)
            params = [p for p in self.model.parameters() if p.requires_grad and p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, **self.clip_grad_params)
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        if not all(torch.isfinite(v).all() for v in loss_dict.values()):  # _write_metrics
            raise FloatingPointError(f"Loss became infinite or NaN at iteration={self.iter}!")

    def state_dict(self) -> dict[str, Any]:
        ret: dict[str, Any] = {"iteration": self.iter, "optimizer": self.optimizer.state_dict()}
        if self.grad_scaler and self.amp:
            ret["grad_scaler"] = self.grad_scaler.state_dict()
        return ret

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.iter = state_dict["iteration"]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler and self.amp:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def train(self, start: int, until: int) -> None:
        data = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(4, 6, generator=data), torch.randint(0, 3, (4,), generator=data))
            for _ in range(MAX_ITER)
        ]
        for self.iter in range(start, until):
            self.run_step(batches[self.iter], nan=self.iter == NAN_LOSS_AT)
            self.scales.append(self.grad_scaler.get_scale())


def run(factory: Factory, resume_into: Factory | None = None) -> dict[str, Any]:
    """Train to the checkpoint, resume a new trainer from it, train on to the NaN loss."""
    first = Trainer(factory("cpu", growth_interval=2))
    first.train(0, CHECKPOINT_AT)
    checkpoint = saved(first.state_dict())
    second = Trainer((resume_into or factory)("cpu", growth_interval=2))
    torch.manual_seed(0)
    second.model.load_state_dict(first.model.state_dict())
    second.load_state_dict(checkpoint)
    with pytest.raises(FloatingPointError, match=f"iteration={NAN_LOSS_AT}"):
        second.train(CHECKPOINT_AT, MAX_ITER)
    return {
        "scales": first.scales + second.scales + [second.grad_scaler.get_scale()],
        "checkpoint": checkpoint["grad_scaler"],
        "final": second.state_dict()["grad_scaler"],
        "params": [p.detach().clone() for p in second.model.parameters()],
    }


@pytest.mark.parametrize("how", ["direct", "patched", "torch-into-ours", "ours-into-torch"])
def test_detrex_training_resume_and_nan_stop_match_torch(how: str) -> None:
    theirs = run(torch.amp.GradScaler)
    if how == "direct":
        ours = run(ampscaler.GradScaler)
    elif how == "patched":
        ampscaler.patch_torch()
        ours = run(lambda *a, **k: torch.amp.GradScaler(*a, **k))
    elif how == "torch-into-ours":
        ours = run(torch.amp.GradScaler, resume_into=ampscaler.GradScaler)
    else:
        ours = run(ampscaler.GradScaler, resume_into=torch.amp.GradScaler)
    assert ours["scales"] == theirs["scales"]
    for key in ("checkpoint", "final"):
        assert {k: ours[key][k] for k in TORCH_KEYS} == {k: theirs[key][k] for k in TORCH_KEYS}
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True))
    # the overflows backed off, the clean pairs grew it, and the NaN loss's iteration backed it
    # off before the FloatingPointError (its scale is the last one read)
    assert theirs["scales"] == [65536.0, 32768.0, 32768.0, 65536.0, 32768.0, 32768.0, 16384.0]
    assert theirs["final"]["scale"] == theirs["scales"][-1]


def test_the_scalers_truth_value_saves_and_loads_it_as_torchs() -> None:
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
        assert bool(factory("cpu")) and bool(factory("cpu", enabled=False))
        assert "grad_scaler" in Trainer(factory("cpu")).state_dict()
        assert "grad_scaler" not in Trainer(factory("cpu"), amp=False).state_dict()


def test_a_checkpoint_without_amp_fails_to_load_with_amp_as_torchs() -> None:
    """A run without amp saves no ``"grad_scaler"``; resuming it with amp raises ``KeyError``
    in ``load_state_dict`` (after the optimizer loaded), and the scaler is unchanged."""
    plain = Trainer(None, amp=False)
    state = saved(plain.state_dict())
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
        trainer = Trainer(factory("cpu"))
        with pytest.raises(KeyError, match="grad_scaler"):
            trainer.load_state_dict(state)
        assert trainer.grad_scaler.get_scale() == 65536.0
