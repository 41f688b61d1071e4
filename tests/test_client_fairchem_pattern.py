"""fairchem's (formerly OCP's) trainers driving a scaler, re-created: ampscaler's against
torch's, bit for bit.

fairchem is not installed here; this file re-creates, in its own words, what
``fairchem/core/trainers/base_trainer.py`` and ``ocp_trainer.py`` (``ocpmodels/trainers/`` in
OCP) do with the scaler:

- ``self.scaler = torch.cuda.amp.GradScaler() if amp and not self.cpu else None``: no scaler at
  all without AMP, and every use is guarded by ``if self.scaler`` (the object's truthiness);
- ``train()``: forward and loss under ``torch.cuda.amp.autocast(enabled=self.scaler is not
  None)``, then ``loss = self.scaler.scale(loss) if self.scaler else loss`` (the *scaled* loss
  is what ``_backward`` gets), divided by ``grad_accumulation_steps`` in some versions;
- ``_backward(loss)``: ``optimizer.zero_grad()``, ``loss.backward()``, the gradients of the
  model's ``shared_parameters`` divided in place (``p.grad.detach().div_(factor)``, still
  scaled), then with ``clip_grad_norm``: ``scaler.unscale_(optimizer)`` and
  ``clip_grad_norm_`` (the norm logged); ``scaler.step(optimizer)``, ``scaler.update()``; then
  the EMA of the parameters updated, after every iteration, skipped or not;
- after ``_backward``: ``scale = self.scaler.get_scale() if self.scaler else 1.0`` (read after
  ``update()``) and the logged loss ``loss.item() / scale``; the LR scheduler stepped each
  iteration;
- ``save()``: ``"amp": self.scaler.state_dict() if self.scaler else None`` beside the model,
  optimizer, scheduler and EMA; ``load_checkpoint()``: ``torch.load(..., map_location=...)``, then
  ``if self.scaler and checkpoint["amp"]: self.scaler.load_state_dict(checkpoint["amp"])``.

Why it matters: the scale read after ``update()`` divides the logged loss, in-place edits of
scaled gradients before ``unscale_()``, an EMA that follows skipped steps too, and checkpoint
code that tests the scaler's truthiness and the state dict's.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[[], Any]
STEPS = 12
INF_AT = {3, 8}  # an inf in a gradient after backward
SHARED_FACTOR = 3.0


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Model(torch.nn.Module):
    """An embedding whose weight is used three times in the forward: a shared parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.out = torch.nn.Linear(8, 1)
        self.shared_parameters = [(self.embed.weight, SHARED_FACTOR)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sum(torch.tanh(self.embed(x * k)) for k in (1.0, 0.5, 0.25))
        return self.out(h).squeeze(-1)


class EMA:
    """fairchem's ExponentialMovingAverage: decay warmed up by the update count."""

    def __init__(self, parameters: list[torch.nn.Parameter], decay: float) -> None:
        self.parameters, self.decay, self.updates = parameters, decay, 0
        self.shadow = [p.detach().clone() for p in parameters]

    def update(self) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        with torch.no_grad():
            for s, p in zip(self.shadow, self.parameters, strict=True):
                s.sub_((1 - decay) * (s - p))

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = [s.clone() for s in state["shadow"]]
        self.updates = state["updates"]


class Trainer:
    def __init__(
        self, make_scaler: Factory | None, clip_grad_norm: float | None, accumulation: int
    ) -> None:
        torch.manual_seed(0)
        self.model = Model()
        self.scaler = make_scaler() if make_scaler is not None else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=5e-3, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 4)
        )
        self.ema = EMA(list(self.model.parameters()), 0.999)
        self.clip_grad_norm = clip_grad_norm
        self.grad_accumulation_steps = accumulation
        self.step = 0
        self.trace = Trace()

    def _backward(self, loss: torch.Tensor) -> Any:
        self.optimizer.zero_grad()
        loss.backward()
        if self.step in INF_AT:
            self.model.out.bias.grad.fill_(float("inf"))
        for p, factor in self.model.shared_parameters:
            if p.grad is not None:
                p.grad.detach().div_(factor)
        grad_norm = None
        if self.clip_grad_norm:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.ema.update()
        return grad_norm

    def train(self, batches: list[tuple[torch.Tensor, torch.Tensor]], until: int = STEPS) -> None:
        for x, y in batches[self.step : until]:
            with torch.autocast("cpu", dtype=torch.float16, enabled=self.scaler is not None):
                loss = torch.nn.functional.l1_loss(self.model(x).float(), y)
            loss = self.scaler.scale(loss) if self.scaler else loss
            if self.grad_accumulation_steps != 1:
                loss = loss / self.grad_accumulation_steps
            grad_norm = self._backward(loss)
            scale = self.scaler.get_scale() if self.scaler else 1.0
            self.scheduler.step()
            self.step += 1
            self.trace.params.append([p.detach().clone() for p in self.model.parameters()])
            self.trace.params[-1].extend(s.clone() for s in self.ema.shadow)
            self.trace.scales.append(scale)
            enabled = self.scaler is not None and self.scaler.is_enabled()
            self.trace.trackers.append(self.scaler._get_growth_tracker() if enabled else 0)
            logged = loss.item() / scale * self.grad_accumulation_steps
            self.trace.returns.append(
                (repr(logged), None if grad_norm is None else repr(grad_norm.item()))
            )

    def save(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "step": self.step,
                "state_dict": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "ema": self.ema.state_dict(),
                "amp": self.scaler.state_dict() if self.scaler else None,
            },
            buffer,
        )
        return buffer.getvalue()

    def load_checkpoint(self, saved: bytes) -> None:
        checkpoint = torch.load(
            io.BytesIO(saved), map_location=torch.device("cpu"), weights_only=True
        )
        self.step = checkpoint["step"]
        self.model.load_state_dict(checkpoint["state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.ema.load_state_dict(checkpoint["ema"])
        if self.scaler and checkpoint["amp"]:
            self.scaler.load_state_dict(checkpoint["amp"])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    return [
        (torch.randn(6, 4, generator=data), torch.randn(6, generator=data)) for _ in range(STEPS)
    ]


def run(
    make_scaler: Factory | None,
    clip_grad_norm: float | None = 10.0,
    accumulation: int = 1,
    resume_at: int | None = None,
    resume_with: Factory | None = None,
) -> Trainer:
    trainer = Trainer(make_scaler, clip_grad_norm, accumulation)
    if resume_at is None:
        trainer.train(batches())
        return trainer
    trainer.train(batches(), until=resume_at)
    saved = trainer.save()
    resumed = Trainer(resume_with, clip_grad_norm, accumulation)
    resumed.load_checkpoint(saved)
    resumed.train(batches())
    resumed.trace = Trace(
        params=trainer.trace.params + resumed.trace.params,
        scales=trainer.trace.scales + resumed.trace.scales,
        trackers=trainer.trace.trackers + resumed.trace.trackers,
        returns=trainer.trace.returns + resumed.trace.returns,
    )
    return resumed


def torch_scaler() -> Any:
    return torch.amp.GradScaler("cpu", growth_interval=3)


def our_scaler() -> Any:
    return ampscaler.GradScaler("cpu", growth_interval=3)


def patched_scaler() -> Any:
    return torch.cuda.amp.GradScaler(growth_interval=3)  # fairchem's name


@pytest.mark.parametrize(
    "options",
    [{}, {"clip_grad_norm": None}, {"accumulation": 2}],
    ids=["clip", "no-clip", "divided-scaled-loss"],
)
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_training_matches_torch(options: dict[str, Any], how: str) -> None:
    theirs = run(torch_scaler, **options)
    if how == "patched":
        with ampscaler.patch_torch(device="cpu"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
            ours = run(patched_scaler, **options)
        assert isinstance(ours.scaler, ampscaler.GradScaler)
    else:
        ours = run(our_scaler, **options)
    assert_same_trace(ours.trace, theirs.trace)
    # growth every 3 clean steps, each inf backs off; the loss logged is divided by the
    # scale read after update(), so it doubles at each backoff, as with torch's
    scales = theirs.trace.scales
    assert scales[2] > scales[0] and scales[3] < scales[2] and scales[8] < scales[7]
    assert max(scales[4:8]) > scales[3]
    assert bool(ours.scaler) is True  # `if self.scaler` takes the AMP branch


@pytest.mark.parametrize(
    ("first", "then"),
    [(our_scaler, our_scaler), (torch_scaler, our_scaler), (our_scaler, torch_scaler)],
    ids=["ours", "torch-to-ours", "ours-to-torch"],
)
def test_a_checkpoint_resumes_as_torchs(first: Factory, then: Factory) -> None:
    whole = run(torch_scaler)
    resumed = run(first, resume_at=5, resume_with=then)
    assert_same_trace(resumed.trace, whole.trace)


def test_checkpoints_across_amp_and_no_amp_as_torchs() -> None:
    """An fp32 run saves ``"amp": None``; resumed with AMP, the load is skipped and the fresh
    scaler starts at 2**16; an AMP checkpoint resumed without AMP skips the load too."""
    theirs = run(None, resume_at=4, resume_with=torch_scaler)
    ours = run(None, resume_at=4, resume_with=our_scaler)
    assert_same_trace(ours.trace, theirs.trace)
    assert theirs.trace.scales[:5] == [1.0] * 4 + [2.0**16]
    theirs = run(torch_scaler, resume_at=4, resume_with=None)
    ours = run(our_scaler, resume_at=4, resume_with=None)
    assert_same_trace(ours.trace, theirs.trace)
    assert theirs.trace.scales[4:] == [1.0] * (STEPS - 4)
