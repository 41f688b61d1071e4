"""ESPnet's ``Trainer`` driving a scaler, re-created: ampscaler's against torch's, bit for bit.

ESPnet is not installed here; this file re-creates, in its own words, what
``espnet2/train/trainer.py`` does with a scaler, as read in its source:

- ``Trainer.run`` builds ``GradScaler()`` (``torch.cuda.amp``'s, imported with the module) when
  ``use_amp``; ``Trainer.resume`` does ``torch.load(checkpoint, map_location="cpu")`` and
  ``scaler.load_state_dict(states["scaler"])``; each epoch ends with ``torch.save`` of one dict
  holding the model, ``"optimizers"``, ``"schedulers"`` and ``"scaler": scaler.state_dict()``.
- ``train_one_epoch``: the model returns the loss, and an ``optim_idx`` (an int, or a 1-dim
  tensor of one repeated value) when only one optimizer is to be stepped (GAN-style turns);
  ``scaler.scale(loss / accum_grad).backward()`` on every batch; every ``accum_grad`` batches:
  ``unscale_`` each optimizer (those of ``optim_idx``), ``clip_grad_norm_`` over all the
  model's parameters, and then, whether the norm is finite or not (to end the iteration that
  ``unscale_`` began), **for each optimizer ``scaler.step(optimizer)`` then
  ``scaler.update()``**, reporting ``scaler.get_scale()`` as ``loss_scale``; then
  ``zero_grad()`` of those optimizers only.

Why it matters: with several optimizers the first ``update()`` ends the iteration, so the
second optimizer, already unscaled, is READY again: its ``step()`` unscales its gradients a
second time, at the scale that update left, and a second ``update()`` counts another iteration.
With ``optim_idx`` the other optimizer's gradients are neither stepped nor zeroed: they pile
up over turns, made at different scales. Both are what torch does, and a drop-in must do the
same, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
EPOCHS, BATCHES, ACCUM_GRAD = 2, 8, 2
INF_AT = 5  # after this batch's backward (an accumulation boundary) a gradient is inf
NAN_LOSS_AT = 11  # this batch's loss is NaN (its accumulation's norm too)


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class TwoPartModel(torch.nn.Module):
    """An ESPnet model: returns ``(loss, stats, weight)``, or a dict with ``optim_idx``."""

    def __init__(self, turns: bool) -> None:
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
        self.decoder = torch.nn.Linear(8, 3)
        self.turns = turns
        self.calls = 0

    def forward(self, speech: torch.Tensor, text: torch.Tensor) -> Any:
        self.calls += 1
        logits = self.decoder(self.encoder(speech))
        loss = torch.nn.functional.cross_entropy(logits.float(), text)
        stats = {"loss": loss.detach()}
        weight = torch.tensor(speech.shape[0])
        if not self.turns:
            return loss, stats, weight
        turn = (self.calls - 1) // ACCUM_GRAD % 2  # the accumulation's optimizer, alternating
        optim_idx = torch.full((speech.shape[0],), turn)
        return {"loss": loss, "stats": stats, "weight": weight, "optim_idx": optim_idx}


def run(factory: Factory, turns: bool, tmp_path: Path) -> dict[str, Any]:
    """Train EPOCHS epochs, each ending with ESPnet's checkpoint, and the second resuming from
    it into a new scaler (the model, optimizers and schedulers go on as resumed)."""
    tmp_path.mkdir()
    torch.manual_seed(0)
    model = TwoPartModel(turns)
    optimizers = [
        torch.optim.Adam(model.encoder.parameters(), lr=0.01),
        torch.optim.SGD(model.decoder.parameters(), lr=0.05, momentum=0.9),
    ]
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, 4) for optimizer in optimizers]
    scaler = factory("cpu", init_scale=2.0**8, growth_interval=3)
    data = torch.Generator().manual_seed(1)
    reported: list[tuple[bool, float, float, int]] = []
    for epoch in range(EPOCHS):
        if epoch:
            scaler = factory("cpu", init_scale=2.0**8, growth_interval=3)
            states = torch.load(tmp_path / "checkpoint.pth", map_location="cpu")
            scaler.load_state_dict(states["scaler"])
        for iiter in range(1, BATCHES + 1):
            batch = epoch * BATCHES + iiter
            speech, text = (
                torch.randn(5, 6, generator=data),
                torch.randint(0, 3, (5,), generator=data),
            )
            with torch.autocast("cpu", dtype=torch.float16):
                retval = model(speech=speech, text=text)
            if isinstance(retval, dict):
                loss, optim_idx = retval["loss"], retval["optim_idx"]
                assert all(value == optim_idx[0] for value in optim_idx)
                optim_idx = optim_idx[0].item()
            else:
                (loss, _, _), optim_idx = retval, None
            if batch == NAN_LOSS_AT:
                loss = loss * float("nan")
            loss = loss / ACCUM_GRAD
            scaler.scale(loss).backward()
            if batch == INF_AT:
                grad = model.decoder.weight.grad
                assert grad is not None
                grad[1, 1] = float("inf")
            if iiter % ACCUM_GRAD:
                continue
            chosen = [o for i, o in enumerate(optimizers) if optim_idx in (None, i)]
            for optimizer in chosen:
                scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            loss_scale = scaler.get_scale()
            for optimizer in chosen:
                scaler.step(optimizer)
                scaler.update()
            for optimizer in chosen:
                optimizer.zero_grad()
            finite = bool(torch.isfinite(grad_norm))
            reported.append((finite, loss_scale, scaler.get_scale(), scaler._get_growth_tracker()))
        for scheduler in schedulers:
            scheduler.step()
        torch.save(
            {
                "model": model.state_dict(),
                "optimizers": [o.state_dict() for o in optimizers],
                "schedulers": [s.state_dict() for s in schedulers],
                "scaler": scaler.state_dict(),
            },
            tmp_path / "checkpoint.pth",
        )
    grads = [p.grad for p in model.parameters()]
    return {
        "reported": reported,
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if g is None else g.clone() for g in grads],
        "state": scaler.state_dict(),
    }


def assert_same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    """Bit for bit, NaN included (gradients left over from the NaN batch hold NaN)."""
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def assert_same_run(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["reported"] == theirs["reported"]
    for key in ("params", "grads"):
        for a, b in zip(ours[key], theirs[key], strict=True):
            assert_same_tensor(a, b)
    assert {key: ours["state"][key] for key in theirs["state"]} == theirs["state"]


@pytest.mark.parametrize("turns", [False, True], ids=["both-optimizers", "optim_idx-turns"])
def test_espnets_update_after_each_optimizer_step_matches_torch(
    turns: bool, tmp_path: Path
) -> None:
    theirs = run(torch.amp.GradScaler, turns, tmp_path / "torch")
    ours = run(ampscaler.GradScaler, turns, tmp_path / "ours")
    assert_same_run(ours, theirs)
    infinite = [i for i, (finite, *_) in enumerate(theirs["reported"]) if not finite]
    assert (INF_AT - 1) // ACCUM_GRAD in infinite and (NAN_LOSS_AT - 1) // ACCUM_GRAD in infinite
    if turns:
        # the norm is over all parameters: the other optimizer's gradients, left for its next
        # turn, keep it non-finite after the step that skipped; the encoder's gradients of the
        # last accumulation are still there
        assert len(infinite) > 2
        assert all(grad is not None for grad in theirs["grads"][:2])
    else:
        # the non-finite accumulations backed the scale off; two updates per accumulation:
        # the tracker counts both
        assert len(infinite) == 2
        assert all(theirs["reported"][i][2] < theirs["reported"][i][1] for i in infinite)
        assert theirs["reported"][1][3] == 2 * 2 % 3


def test_under_patch_torch_espnets_run_is_torchs(tmp_path: Path) -> None:
    """ESPnet's own ``GradScaler()`` is CUDA's (disabled on this CPU): the scaler is built by
    torch's name for "cpu" while patched, as ESPnet's line builds it on a GPU."""
    theirs = run(torch.amp.GradScaler, True, tmp_path / "torch")
    ampscaler.patch_torch()
    ours = run(torch.amp.GradScaler, True, tmp_path / "ours")
    assert_same_run(ours, theirs)
