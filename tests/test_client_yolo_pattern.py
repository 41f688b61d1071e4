"""yolov5's ``train.py`` and ultralytics' ``BaseTrainer`` driving a scaler, re-created.

Neither is installed here; this file re-creates, in its own words, their scaler calls as read
in ``ultralytics/yolov5`` ``train.py`` and ``ultralytics/engine/trainer.py``:

- the scaler is ``torch.cuda.amp.GradScaler(enabled=amp)`` (yolov5) or
  ``torch.amp.GradScaler("cuda", enabled=amp)`` (ultralytics, torch >= 2.4), with ``amp``
  false off CUDA: the disabled scaler is then called exactly as the enabled one;
- three parameter groups (biases, decayed weights, norm weights) of a Nesterov SGD; during the
  warmup every batch sets each group's ``lr`` and ``momentum`` from ``np.interp`` (numpy
  floats in yolov5, Python floats in ultralytics) and ``accumulate`` grows from 1 to
  ``nbs / batch_size``;
- every batch: the forward under autocast, the loss (a one-element tensor, scaled by the batch
  size), ``scaler.scale(loss).backward()``; when ``ni - last_opt_step >= accumulate``:
  ``unscale_``, ``clip_grad_norm_(max_norm=10.0)``, ``step``, ``update``, ``zero_grad()``, then
  the EMA update. ``ni`` runs on across epochs, so an accumulation can span an epoch boundary:
  yolov5 calls ``optimizer.zero_grad()`` at each epoch's start (dropping the scaled gradients
  of a partial accumulation, with no ``update()``), ultralytics does not (they carry on);
- ultralytics saves ``"scaler": scaler.state_dict()`` in every epoch's checkpoint, and
  ``resume_training`` loads it into the new run's scaler before its first batch.

Why it matters: the scaler sees iterations of varying length, some ended by ``zero_grad()``
alone, lr and momentum that are numpy floats, and one-element 1-d losses; a drop-in must give
the same parameters, EMA and scales, enabled or not, and resume from torch's checkpoint.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import ampscaler
from test_client_ultralytics_pattern import three_groups

Factory = Callable[..., Any]
EPOCHS, NB, BATCH, NBS, WARMUP = 3, 7, 4, 16, 12
INF_AT = 9  # in this batch a gradient element is inf after backward


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def detector() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
        torch.nn.Conv2d(8, 6, 1),
    )  # fmt: skip


def train(
    factory: Factory,
    amp: bool,
    ultralytics: bool,
    resume_from: bytes | None = None,
    epochs: range = range(EPOCHS),
) -> dict[str, Any]:
    model = detector()
    ema = copy.deepcopy(model).eval()
    optimizer = three_groups(model)  # yolov5's smart_optimizer builds the same three
    schedule = lambda epoch: (1 - epoch / EPOCHS) * 0.99 + 0.01  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
    scaler = factory(enabled=amp)
    if resume_from is not None:  # ultralytics' resume_training
        checkpoint = torch.load(io.BytesIO(resume_from), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        ema.load_state_dict(checkpoint["ema"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        scheduler.last_epoch = epochs.start - 1
    data = torch.Generator().manual_seed(1 + epochs.start)
    last_opt_step, accumulate = -1, 1
    scales, checkpoints = [], []
    for epoch in epochs:
        if not ultralytics:
            optimizer.zero_grad()
        for i in range(NB):
            ni = i + NB * epoch
            if ni <= WARMUP:
                accumulate = max(1, int(np.interp(ni, [0, WARMUP], [1, NBS / BATCH]).round()))
                for j, group in enumerate(optimizer.param_groups):
                    lr = np.interp(
                        ni, [0, WARMUP], [0.1 if j == 0 else 0.0, 0.01 * schedule(epoch)]
                    )
                    momentum = np.interp(ni, [0, WARMUP], [0.8, 0.937])
                    group["lr"] = float(lr) if ultralytics else lr
                    group["momentum"] = float(momentum) if ultralytics else momentum
            images = torch.rand(BATCH, 3, 8, 8, generator=data)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                pred = model(images)
                loss = pred.float().pow(2).mean().reshape(1) * BATCH
            scaler.scale(loss).backward()
            if ni == INF_AT and amp:  # a disabled scaler has nothing to skip it with
                grad = model[0].weight.grad
                assert grad is not None
                grad[0, 0, 0, 0] = float("inf")
            if ni - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                with torch.no_grad():
                    for e, m in zip(
                        ema.state_dict().values(), model.state_dict().values(), strict=True
                    ):
                        if e.dtype.is_floating_point:
                            e.mul_(0.9).add_(m.detach(), alpha=0.1)
                last_opt_step = ni
                scales.append((ni, scaler.get_scale()))
        scheduler.step()
        buffer = io.BytesIO()
        torch.save(
            {
                "model": model.state_dict(),
                "ema": ema.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
            },
            buffer,
        )
        checkpoints.append(buffer.getvalue())
    states = [t.clone() for t in (*model.state_dict().values(), *ema.state_dict().values())]
    return {"scales": scales, "states": states, "checkpoints": checkpoints}


def assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["scales"] == theirs["scales"]
    assert all(torch.equal(a, b) for a, b in zip(ours["states"], theirs["states"], strict=True))


def with_cpu(factory: Factory) -> Factory:
    return lambda **kwargs: factory("cpu", init_scale=2.0**16, growth_interval=3, **kwargs)


@pytest.mark.parametrize("amp", [True, False], ids=["amp", "disabled"])
@pytest.mark.parametrize("ultralytics", [False, True], ids=["yolov5", "ultralytics"])
def test_yolo_training_matches_torch(amp: bool, ultralytics: bool) -> None:
    theirs = train(with_cpu(torch.amp.GradScaler), amp, ultralytics)
    ours = train(with_cpu(ampscaler.GradScaler), amp, ultralytics)
    assert_same_training(ours, theirs)
    steps = [ni for ni, _ in theirs["scales"]]
    assert steps[:4] == [0, 1, 3, 5]  # accumulate grew during the warmup
    if amp:  # the accumulation holding the inf backed the scale off
        skipped = min(ni for ni in steps if ni >= INF_AT)
        scales = dict(theirs["scales"])
        assert scales[skipped] < max(scale for ni, scale in theirs["scales"] if ni < skipped)
    else:
        assert {scale for _, scale in theirs["scales"]} == {1.0}


def test_ultralytics_resumes_from_torchs_checkpoint_and_under_patch_torch() -> None:
    """A run checkpointed by torch's scaler after its first epoch resumes into ampscaler's (the
    name ultralytics calls, under the patch) exactly as into torch's."""
    theirs = train(with_cpu(torch.amp.GradScaler), True, True)
    first_epoch = theirs["checkpoints"][0]
    resumed_theirs = train(
        with_cpu(torch.amp.GradScaler), True, True, first_epoch, range(1, EPOCHS)
    )
    resumed_ours = train(with_cpu(ampscaler.GradScaler), True, True, first_epoch, range(1, EPOCHS))
    assert_same_training(resumed_ours, resumed_theirs)
    ampscaler.patch_torch()
    patched = train(with_cpu(torch.amp.GradScaler), True, True, first_epoch, range(1, EPOCHS))
    assert_same_training(patched, resumed_theirs)
