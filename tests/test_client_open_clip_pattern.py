"""open_clip's ``train_one_epoch`` with ``accum_freq`` > 1, re-created: ampscaler's scaler
against torch's, bit for bit.

open_clip is not installed here; this file re-creates, in its own words, what
``mlfoundations/open_clip`` (``src/open_clip_train/train.py``, ``main.py``) does with a scaler:

- ``scaler = GradScaler(device=device)`` (torch's ``torch.amp``) when ``precision == "amp"``,
  else ``None``; ``backward(total_loss, scaler)`` is ``scaler.scale(total_loss).backward()``
  or a plain ``backward()`` without one;
- with ``accum_freq`` > 1, each batch is first run under ``torch.no_grad()`` and autocast and
  its features cached (no ``scale()``); every ``accum_freq``-th batch, after
  ``optimizer.zero_grad()``, each cached batch is run again with gradients, its features put
  in place of the cached ones among all ``accum_freq`` batches' (``torch.cat``), and the
  contrastive loss of the whole lot goes through ``backward``: ``accum_freq`` scaled backwards
  into the same gradients;
- then ``scaler.unscale_(optimizer)`` and ``clip_grad_norm_(..., norm_type=2.0)`` only when
  ``grad_clip_norm`` is set, ``scaler.step(optimizer)``, ``scaler.update()``; after the step,
  ``logit_scale.clamp_(0, math.log(100))`` in place on the parameter;
- checkpoints hold ``"scaler": scaler.state_dict()`` when there is a scaler; a resume loads it
  ``if scaler is not None and "scaler" in checkpoint``.

Why it matters: several scaled backwards of losses that share cached (detached) features, an
``unscale_()`` that happens only sometimes, a parameter changed in place after ``step()``, and
a run without a scaler beside one with it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
BATCHES = 12
OVERFLOW_BATCH = 5  # the step that ends with this batch gets an inf in a gradient
RESUME_AFTER = 7


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class TinyClip(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)
        )
        self.text = torch.nn.Embedding(10, 4)
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "image_features": torch.nn.functional.normalize(self.visual(images), dim=-1),
            "text_features": torch.nn.functional.normalize(self.text(texts).mean(1), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }


def clip_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor
) -> torch.Tensor:
    logits = logit_scale * image_features.float() @ text_features.float().T
    labels = torch.arange(logits.shape[0])
    return (
        torch.nn.functional.cross_entropy(logits, labels)
        + torch.nn.functional.cross_entropy(logits.T, labels)
    ) / 2


def train_like_open_clip(
    factory: Factory | None,
    accum_freq: int = 3,
    grad_clip_norm: float | None = 1.0,
    resume_into: Factory | None = None,
) -> Trace:
    """open_clip's loop (module docstring); ``factory=None`` is a precision without a scaler.
    After batch ``RESUME_AFTER`` the scaler goes through a checkpoint into a new one."""
    torch.manual_seed(0)
    model = TinyClip()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, eps=1e-6)
    scaler = None if factory is None else factory(device="cpu", growth_interval=2)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    accum_images: list[torch.Tensor] = []
    accum_texts: list[torch.Tensor] = []
    accum_features: dict[str, list[torch.Tensor]] = {}
    for i in range(BATCHES):
        images = torch.randn(4, 6, generator=data)
        texts = torch.randint(0, 10, (4, 3), generator=data)
        if accum_freq == 1:
            optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
            if accum_freq == 1:
                total = clip_loss(**model(images, texts))
                backward(total, scaler)
            else:
                with torch.no_grad():
                    cached = model(images, texts)
                    cached.pop("logit_scale")
                    for key, value in cached.items():
                        accum_features.setdefault(key, []).append(value)
                    accum_images.append(images)
                    accum_texts.append(texts)
                if (i + 1) % accum_freq > 0:
                    continue
                optimizer.zero_grad()
                for j in range(accum_freq):
                    out = model(accum_images[j], accum_texts[j])
                    logit_scale = out.pop("logit_scale")
                    inputs = {
                        key: torch.cat([*values[:j], out[key], *values[j + 1 :]])
                        for key, values in accum_features.items()
                    }
                    backward(clip_loss(**inputs, logit_scale=logit_scale), scaler)
        if i == OVERFLOW_BATCH and scaler is not None:
            model.visual[0].weight.grad[2, 3] = float("inf")
        if scaler is not None:
            if grad_clip_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm, norm_type=2.0)
            scaler.step(optimizer)
            scaler.update()
            trace.scales.append(scaler.get_scale())
            trace.trackers.append(scaler._get_growth_tracker())
        else:
            if grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm, norm_type=2.0)
            optimizer.step()
        accum_images, accum_texts, accum_features = [], [], {}
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        trace.params.append([p.detach().clone() for p in model.parameters()])
        if i == RESUME_AFTER and scaler is not None:
            scaler = resumed(scaler, resume_into or factory)
    return trace


def backward(total_loss: torch.Tensor, scaler: Any) -> None:
    if scaler is not None:
        scaler.scale(total_loss).backward()
    else:
        total_loss.backward()


def resumed(scaler: Any, factory: Factory | None) -> Any:
    """open_clip's checkpoint, through ``torch.save`` and ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save({"epoch": 1, "scaler": scaler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    assert factory is not None
    fresh = factory(device="cpu", growth_interval=2)
    if fresh is not None and "scaler" in checkpoint:
        fresh.load_state_dict(checkpoint["scaler"])
    assert fresh.get_scale() == scaler.get_scale() != 2.0**16
    return fresh


@pytest.mark.parametrize(
    "options",
    [{}, {"grad_clip_norm": None}, {"accum_freq": 1}, {"accum_freq": 2, "grad_clip_norm": None}],
    ids=["accum3-clip", "accum3-no-clip", "no-accum", "accum2-no-clip"],
)
def test_open_clip_training_matches_torch(options: dict[str, Any]) -> None:
    theirs = train_like_open_clip(torch.amp.GradScaler, **options)
    ours = train_like_open_clip(ampscaler.GradScaler, **options)
    assert_same_trace(ours, theirs)
    overflowed = (OVERFLOW_BATCH + 1) // options.get("accum_freq", 3) - 1  # its step's index
    assert ours.scales[overflowed] < ours.scales[overflowed - 1]  # skipped, backed off
    assert all(
        torch.equal(a, b)
        for a, b in zip(ours.params[overflowed], ours.params[overflowed - 1], strict=True)
    )


def test_open_clip_resume_across_scalers_and_under_patch() -> None:
    theirs = train_like_open_clip(torch.amp.GradScaler)
    into_ours = train_like_open_clip(torch.amp.GradScaler, resume_into=ampscaler.GradScaler)
    into_theirs = train_like_open_clip(ampscaler.GradScaler, resume_into=torch.amp.GradScaler)
    with ampscaler.patch_torch():
        patched = train_like_open_clip(torch.amp.GradScaler)
    for trace in (into_ours, into_theirs, patched):
        assert_same_trace(trace, theirs)


def test_open_clip_without_a_scaler_trains() -> None:
    """``precision`` other than ``"amp"``: ``scaler = None`` and the plain branch runs."""
    plain = train_like_open_clip(None)
    assert plain.scales == [] and len(plain.params) == BATCHES // 3
    assert not torch.equal(plain.params[0][0], plain.params[-1][0])
