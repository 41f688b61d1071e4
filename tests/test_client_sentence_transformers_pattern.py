"""sentence-transformers' ``fit()`` before v3, re-created: ampscaler's scaler against torch's.

sentence-transformers 2.x is not installed here; this file re-creates, in its own words, what
``SentenceTransformer.fit()`` in ``sentence_transformers/SentenceTransformer.py`` (2.2) does
with a scaler, as read in its source:

- ``use_amp=True`` builds one ``torch.cuda.amp.GradScaler()`` (torch's deprecated name,
  default arguments) for the whole fit, and the forward runs under ``autocast()``;
- each of the train objectives (a data loader and a loss module that holds the shared
  model) gets its own ``AdamW`` over the loss module's parameters, in two groups (``bias``
  and ``LayerNorm`` without weight decay), and its own warm-up-linear ``LambdaLR``: the
  shared encoder's parameters are in every optimizer;
- each step takes one batch of each objective in turn, and for each: ``scale_before_step =
  scaler.get_scale()``, ``scaler.scale(loss_value).backward()``, ``scaler.unscale_
  (optimizer)``, ``clip_grad_norm_(loss_model.parameters(), max_grad_norm)``,
  ``scaler.step(optimizer)``, ``scaler.update()``, ``skip_scheduler = scaler.get_scale() !=
  scale_before_step``, ``optimizer.zero_grad()``, and that objective's scheduler steps
  unless ``skip_scheduler``: one ``update()`` per objective, so several per step, and a
  growth of the scale skips the schedule too, as a backoff does.

Why it matters: the schedule follows the scale's every change, read through ``get_scale()``
around each update; one scaler serves several optimizers over shared parameters, each
scaled, unscaled, stepped and updated in turn; and the scaler is built through the
deprecated ``torch.cuda.amp`` name, whose warnings programs filter.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

STEPS, WARMUP = 8, 3
INF_AT = {(1, 0), (5, 0), (5, 1)}  # (step, objective) whose gradients get an inf


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Encoder(torch.nn.Module):
    """The shared model: token embeddings, a LayerNorm'd projection, mean pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = torch.nn.Embedding(30, 8)
        self.dense = torch.nn.Linear(8, 8)
        self.LayerNorm = torch.nn.LayerNorm(8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(torch.tanh(self.dense(self.embeddings(tokens)))).mean(1)


class SoftmaxLoss(torch.nn.Module):
    """An NLI-style objective: a classifier over ``(u, v, |u - v|)``."""

    def __init__(self, model: Encoder) -> None:
        super().__init__()
        self.model, self.classifier = model, torch.nn.Linear(24, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u, v = self.model(a), self.model(b)
        logits = self.classifier(torch.cat([u, v, (u - v).abs()], 1))
        return torch.nn.functional.cross_entropy(logits.float(), labels % 3)


class CosineLoss(torch.nn.Module):
    """An STS-style objective: the cosine of the two embeddings against a score."""

    def __init__(self, model: Encoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        cosine = torch.cosine_similarity(self.model(a).float(), self.model(b).float())
        return ((cosine - labels.float() / 3) ** 2).mean()


def warmup_linear(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < WARMUP:
            return step / WARMUP
        return max(0.0, (STEPS - step) / (STEPS - WARMUP))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fit(make_scaler: Callable[[], Any]) -> dict[str, Any]:
    """``fit()`` with two objectives and ``use_amp=True`` (module docstring)."""
    torch.manual_seed(0)
    model = Encoder()
    loss_models = [SoftmaxLoss(model), CosineLoss(model)]
    scaler = make_scaler()
    optimizers, schedulers = [], []
    for loss_model in loss_models:
        named = list(loss_model.named_parameters())
        no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
        groups = [
            {"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
             "weight_decay": 0.01},
            {"params": [p for n, p in named if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]  # fmt: skip
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
        optimizers.append(optimizer)
        schedulers.append(warmup_linear(optimizer))
    data = torch.Generator().manual_seed(1)
    record: dict[str, Any] = {"scales": [], "skipped_schedule": [], "lrs": []}
    skip_scheduler = False
    for loss_model in loss_models:
        loss_model.zero_grad()
        loss_model.train()
    for step in range(STEPS):
        for index, (loss_model, optimizer, scheduler) in enumerate(
            zip(loss_models, optimizers, schedulers, strict=True)
        ):
            a, b = (torch.randint(0, 30, (4, 5), generator=data) for _ in range(2))
            labels = torch.randint(0, 4, (4,), generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                loss_value = loss_model(a, b, labels)
            scale_before_step = scaler.get_scale()
            scaler.scale(loss_value).backward()
            if (step, index) in INF_AT:
                model.dense.weight.grad.view(-1)[step] = float("inf")
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(loss_model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            skip_scheduler = scaler.get_scale() != scale_before_step
            optimizer.zero_grad()
            if not skip_scheduler:
                scheduler.step()
            record["scales"].append(scaler.get_scale())
            record["skipped_schedule"].append(skip_scheduler)
            record["lrs"].append([s.get_last_lr()[0] for s in schedulers])
    record["params"] = [p.detach().clone() for m in loss_models for p in m.parameters()]
    record["optimizers"] = [o.state_dict() for o in optimizers]
    record["scaler"] = scaler.state_dict()
    return record


def assert_same_fit(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key in ("scales", "skipped_schedule", "lrs"):
        assert ours[key] == theirs[key], key
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(a, b)
    for mine, other in zip(ours["optimizers"], theirs["optimizers"], strict=True):
        for key, state in other["state"].items():
            for name, value in state.items():
                assert torch.equal(mine["state"][key][name], value)
    assert {k: ours["scaler"][k] for k in theirs["scaler"]} == theirs["scaler"]


def recorded(run: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [f"{w.category.__name__}: {w.message}" for w in caught]


def test_fit_with_two_objectives_matches_torch_directly() -> None:
    theirs, torch_warnings = recorded(lambda: fit(lambda: torch.amp.GradScaler("cpu")))
    ours, our_warnings = recorded(lambda: fit(lambda: ampscaler.GradScaler("cpu")))
    assert_same_fit(ours, theirs)
    assert our_warnings == torch_warnings
    # the skips backed the scale off and held both schedules, each on its own objective
    expected = [(step, index) in INF_AT for step in range(STEPS) for index in (0, 1)]
    assert theirs["skipped_schedule"] == expected
    assert theirs["lrs"][-1][0] != theirs["lrs"][-1][1]  # objective 0 skipped once more


def test_fit_under_patch_torch_builds_and_trains_as_torchs() -> None:
    """``torch.cuda.amp.GradScaler()`` as fit() writes it: under ``patch_torch(device="cpu")``
    an ampscaler scaler on this CPU, with torch's deprecation warning; it trains as
    ``torch.amp.GradScaler("cpu")`` does."""
    theirs, _ = recorded(lambda: fit(lambda: torch.amp.GradScaler("cpu")))
    with ampscaler.patch_torch(device="cpu"):
        ours, our_warnings = recorded(lambda: fit(lambda: torch.cuda.amp.GradScaler()))
    assert_same_fit(ours, theirs)
    assert our_warnings == [
        "FutureWarning: `torch.cuda.amp.GradScaler(args...)` is deprecated. Please use "
        "`torch.amp.GradScaler('cuda', args...)` instead."
    ]


def test_a_growth_also_holds_the_schedule_as_with_torchs() -> None:
    """fit() compares the scale before and after ``update()``: a growth (here every second
    clean update) skips the schedule as a backoff does."""

    def grow(factory: Callable[..., Any]) -> dict[str, Any]:
        return fit(lambda: factory("cpu", init_scale=4.0, growth_interval=2))

    theirs, ours = grow(torch.amp.GradScaler), grow(ampscaler.GradScaler)
    assert_same_fit(ours, theirs)
    assert max(theirs["scales"]) > 4.0
    assert sum(theirs["skipped_schedule"]) > len(INF_AT)
