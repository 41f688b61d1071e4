"""DINO's and DINOv2's training step with an ``fp16_scaler``, re-created: ampscaler's against
torch's, bit for bit.

Neither project is installed here; this file re-creates, in its own words, what
``facebookresearch/dino`` (``main_dino.py``, ``utils.py``) does with its scaler:

- ``fp16_scaler = torch.cuda.amp.GradScaler()`` when ``use_fp16``, else ``None``: every call
  is then guarded by ``if fp16_scaler is None`` (plain ``backward()`` and ``step()``);
- each iteration: ``optimizer.zero_grad()``, the loss under autocast, then
  ``fp16_scaler.scale(loss).backward()``; if ``clip_grad``: ``fp16_scaler.unscale_(optimizer)``
  and ``utils.clip_gradients(student, clip_grad)``, which scales each parameter's gradient on its
  own (``p.grad.data.mul_(clip / (norm + 1e-6))`` when that is below 1, so an inf gradient turns
  NaN); then ``utils.cancel_gradients_last_layer(epoch, student, freeze_last_layer)``, which sets
  ``p.grad = None`` for the head's ``last_layer`` during the first epochs: **after**
  ``unscale_()`` and **before** ``step()``; then ``fp16_scaler.step(optimizer)`` and
  ``fp16_scaler.update()``, and the teacher follows the student by EMA;
- the checkpoint is a dict with ``"fp16_scaler": fp16_scaler.state_dict()`` (only when there is
  one); ``utils.restart_from_checkpoint(path, fp16_scaler=fp16_scaler, ...)`` loads each
  keyword's value by key, first as ``value.load_state_dict(checkpoint[key], strict=False)``,
  and on a ``TypeError`` (a scaler takes no ``strict``) again without it, catching
  ``ValueError``; a ``None`` value is skipped.

Why it matters: a gradient that held the overflow can be dropped between ``unscale_()`` and
``step()``; torch's scaler has recorded the overflow at ``unscale_()`` and skips the step all the
same, and so must ampscaler. DINOv2 does the same with ``ShardedGradScaler`` and lr 0 for the
last layer instead of dropping its gradient, which the step here covers too.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
EPOCHS, BATCHES = 3, 3
FREEZE_LAST_LAYER = 1  # epochs during which the last layer's gradients are dropped
LAST_LAYER_INF = 1  # in epoch 0 at this batch, an inf in the last layer's gradient (then dropped)
BODY_INF = (1, 2)  # (epoch, batch) whose body gradient gets an inf
LOSS_INF = (2, 0)  # (epoch, batch) whose loss is inf


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU())
        self.last_layer = torch.nn.Linear(8, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last_layer(torch.nn.functional.normalize(self.mlp(x), dim=-1))


def student_and_teacher() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), Head())
    teacher = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), Head())
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad_(False)
    return student, teacher


def clip_gradients(model: torch.nn.Module, clip: float) -> None:
    """DINO's per-parameter clipping (module docstring)."""
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.data.norm(2)
            coefficient = clip / (norm + 1e-6)
            if coefficient < 1:
                p.grad.data.mul_(coefficient)


def cancel_gradients_last_layer(epoch: int, model: torch.nn.Module) -> None:
    if epoch >= FREEZE_LAST_LAYER:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None


def restart_from_checkpoint(checkpoint: dict[str, Any], **kwargs: Any) -> None:
    """DINO's loader: by key, ``strict=False`` first, then without it on ``TypeError``."""
    for key, value in kwargs.items():
        if key in checkpoint and value is not None:
            try:
                value.load_state_dict(checkpoint[key], strict=False)
            except TypeError:
                with contextlib.suppress(ValueError):
                    value.load_state_dict(checkpoint[key])


def train_like_dino(
    factory: Factory | None,
    clip_grad: float | None = 0.3,
    resume_into: Factory | None = None,
    fused: bool = False,
) -> Trace:
    """DINO's epochs; ``factory=None`` is ``use_fp16=False`` (``fp16_scaler = None``). After
    epoch 0 the run goes through a checkpoint into a new scaler made by ``resume_into``."""
    student, teacher = student_and_teacher()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2, fused=fused)
    fp16_scaler = None if factory is None else factory("cpu", growth_interval=2)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for epoch in range(EPOCHS):
        for batch in range(BATCHES):
            images = torch.randn(8, 4, generator=data)
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_scaler is not None):
                student_out = student(images + 0.1 * torch.randn(8, 4, generator=data))
                teacher_out = teacher(images)
            loss = torch.sum(
                -torch.softmax(teacher_out.float() / 0.04, dim=-1)
                * torch.log_softmax(student_out.float() / 0.1, dim=-1),
                dim=-1,
            ).mean()
            if (epoch, batch) == LOSS_INF:
                loss = loss * float("inf")
            optimizer.zero_grad()
            if fp16_scaler is None:
                loss.backward()
                if clip_grad is not None:
                    clip_gradients(student, clip_grad)
                cancel_gradients_last_layer(epoch, student)
                optimizer.step()
            else:
                fp16_scaler.scale(loss).backward()
                if epoch == 0 and batch == LAST_LAYER_INF:
                    student[2].last_layer.weight.grad[0, 0] = float("inf")
                if (epoch, batch) == BODY_INF:
                    student[0].weight.grad[1, 1] = float("inf")
                if clip_grad is not None:
                    fp16_scaler.unscale_(optimizer)
                    clip_gradients(student, clip_grad)
                cancel_gradients_last_layer(epoch, student)
                trace.returns.append(fp16_scaler.step(optimizer))
                fp16_scaler.update()
            with torch.no_grad():
                for q, k in zip(student.parameters(), teacher.parameters(), strict=True):
                    k.data.mul_(0.9).add_(0.1 * q.detach().data)
            trace.params.append([p.detach().clone() for p in student.parameters()])
            trace.params[-1] += [p.detach().clone() for p in teacher.parameters()]
            trace.grads.append(
                [None if p.grad is None else p.grad.clone() for p in student.parameters()]
            )
            if fp16_scaler is not None:
                trace.scales.append(fp16_scaler.get_scale())
                trace.trackers.append(fp16_scaler._get_growth_tracker())
        if epoch == 0 and fp16_scaler is not None:
            buffer = io.BytesIO()
            torch.save(
                {"student": student.state_dict(), "fp16_scaler": fp16_scaler.state_dict()}, buffer
            )
            buffer.seek(0)
            checkpoint = torch.load(buffer, weights_only=True)
            before = fp16_scaler.get_scale(), fp16_scaler._get_growth_tracker()
            fp16_scaler = (resume_into or factory)("cpu", growth_interval=2)
            restart_from_checkpoint(checkpoint, student=student, fp16_scaler=fp16_scaler)
            assert (fp16_scaler.get_scale(), fp16_scaler._get_growth_tracker()) == before
    return trace


def assert_dropped_overflow_skipped(trace: Trace) -> None:
    """The step whose inf gradient was dropped after ``unscale_()`` was skipped, and backed off."""
    assert trace.scales[LAST_LAYER_INF] < trace.scales[LAST_LAYER_INF - 1]
    before, after = trace.params[LAST_LAYER_INF - 1], trace.params[LAST_LAYER_INF]
    student_count = len(trace.grads[0])
    assert all(
        torch.equal(a, b)
        for a, b in zip(before[:student_count], after[:student_count], strict=True)
    )


@pytest.mark.parametrize(
    ("clip_grad", "fused"),
    [(0.3, False), (None, False), (0.3, True)],
    ids=["clip", "no-clip", "fused-clip"],
)
def test_dino_step_matches_torch(clip_grad: float | None, fused: bool) -> None:
    """A fused AdamW takes the flag ``unscale_()`` recorded into its kernel: the gradients it
    is given no longer include the dropped one."""
    theirs = train_like_dino(torch.amp.GradScaler, clip_grad, fused=fused)
    ours = train_like_dino(ampscaler.GradScaler, clip_grad, fused=fused)
    assert_same_trace(ours, theirs)
    if clip_grad is not None:
        assert_dropped_overflow_skipped(ours)
    else:  # nothing checked the gradient before it was dropped: the step ran, as in torch
        assert ours.scales[LAST_LAYER_INF] > ours.scales[LAST_LAYER_INF - 1]
    assert len(set(ours.scales)) > 2  # skips backed off and clean steps grew the scale


def test_dino_under_patch_torch_matches_torch() -> None:
    """DINO's ``torch.cuda.amp.GradScaler()``: made here as torch's ``GradScaler("cpu")`` names
    build it, unpatched and under ``patch_torch()``."""
    theirs = train_like_dino(torch.amp.GradScaler)
    with ampscaler.patch_torch():
        assert isinstance(torch.amp.GradScaler("cpu"), ampscaler.GradScaler)
        ours = train_like_dino(torch.amp.GradScaler)
    assert_same_trace(ours, theirs)


def test_dino_checkpoint_moves_between_torch_and_ampscaler() -> None:
    """``restart_from_checkpoint``'s ``strict=False`` attempt fails with a ``TypeError`` on both
    scalers (neither takes ``strict``), and the fallback loads the state either way."""
    theirs = train_like_dino(torch.amp.GradScaler)
    assert_same_trace(
        train_like_dino(torch.amp.GradScaler, resume_into=ampscaler.GradScaler), theirs
    )
    assert_same_trace(
        train_like_dino(ampscaler.GradScaler, resume_into=torch.amp.GradScaler), theirs
    )
    with pytest.raises(TypeError):
        ampscaler.GradScaler("cpu").load_state_dict({}, strict=False)  # type: ignore[call-arg]


def test_dino_without_fp16_scaler_is_untouched() -> None:
    """``use_fp16=False``: ``fp16_scaler`` is ``None``; the loop's plain branch runs without a
    warning, and the teacher still follows the student."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = train_like_dino(None)
    assert plain.scales == [] and plain.returns == []
    assert len(plain.params) == EPOCHS * BATCHES
    assert not torch.equal(plain.params[0][0], plain.params[-1][0])


def train_like_dinov2(factory: Factory, clip_grad: float | None) -> Trace:
    """DINOv2's step (``train/train.py``): ``fp16_scaler`` is FSDP's ``ShardedGradScaler()``;
    ``zero_grad(set_to_none=True)``, ``scale(loss).backward()``, and when ``clip_grad``
    ``unscale_()`` then a clip per student module; ``step()``, ``update()``. The last layer is
    frozen through its parameter group's lr (0 for the first steps), not by dropping its
    gradient. An inf in the last layer's gradient at step 2, a NaN loss at step 6."""
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU())
    head = Head()
    groups = [
        {"params": list(backbone.parameters()) + list(head.mlp.parameters())},
        {"params": list(head.last_layer.parameters()), "lr": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    fp16_scaler = factory("cpu", growth_interval=2)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for step in range(8):
        optimizer.param_groups[1]["lr"] = 0.0 if step < 4 else 1e-2
        images = torch.randn(8, 4, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            out = head(backbone(images))
        loss = out.float().logsumexp(-1).mean() * (float("nan") if step == 6 else 1.0)
        optimizer.zero_grad(set_to_none=True)
        fp16_scaler.scale(loss).backward()
        if step == 2:
            head.last_layer.weight.grad[0, 0] = float("inf")
        if clip_grad is not None:
            fp16_scaler.unscale_(optimizer)
            for module in (backbone, head):
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad)
        fp16_scaler.step(optimizer)
        fp16_scaler.update()
        trace.params.append([p.detach().clone() for m in (backbone, head) for p in m.parameters()])
        trace.scales.append(fp16_scaler.get_scale())
        trace.trackers.append(fp16_scaler._get_growth_tracker())
    return trace


@pytest.mark.parametrize("clip_grad", [0.3, None], ids=["clip", "no-clip"])
def test_dinov2_sharded_scaler_step_matches_torch(clip_grad: float | None) -> None:
    """ampscaler's ``ShardedGradScaler`` against torch's FSDP one, in a process group of one."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    try:
        theirs = train_like_dinov2(ShardedGradScaler, clip_grad)
        ours = train_like_dinov2(ampscaler.ShardedGradScaler, clip_grad)
    finally:
        torch.distributed.destroy_process_group()
    assert_same_trace(ours, theirs)
    assert ours.scales[2] < ours.scales[1] and ours.scales[6] < ours.scales[5]
