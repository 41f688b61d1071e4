"""timm's way of driving a GradScaler, re-created: ampscaler's against torch's, bit for bit.

timm (huggingface/pytorch-image-models) is not installed here: it needs torchvision, whose
wheels pin one torch release, and installing it would replace this environment's torch 2.13.0
CPU build with a CUDA build of another release. So this file re-creates, in its own words, what
timm does with a scaler, as read in timm's source:

- ``timm/utils/cuda.py``, ``NativeScaler.__call__(loss, optimizer, clip_grad, clip_mode,
  parameters, create_graph, need_update)``: ``scaler.scale(loss).backward(create_graph=...)``;
  then, only when ``need_update`` (the last micro-batch of an accumulation), if ``clip_grad`` is
  given ``scaler.unscale_(optimizer)`` and ``dispatch_clip_grad(parameters, clip_grad,
  mode)`` (``clip_grad_norm_`` for ``"norm"``, ``clip_grad_value_`` for ``"value"``), then
  ``scaler.step(optimizer)`` and ``scaler.update()``;
- ``timm/utils/checkpoint_saver.py`` saves ``scaler.state_dict()`` under the loss scaler's
  ``state_dict_key`` (``"amp_scaler"``) with ``torch.save``, and timm's ``resume_checkpoint``
  gives it back to a new loss scaler's ``load_state_dict``;
- ``train.py`` runs the forward under ``torch.autocast(device, dtype=torch.float16)``, divides
  the loss by the number of accumulation steps, passes ``create_graph=True`` for second-order
  optimizers, and zeroes the gradients after each update.

timm builds its scaler with torch's defaults; the runs here use a growth interval of 2 so that
the scale grows within a few steps, and an oversized loss on one step so that one is skipped.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
STEPS = 8
OVERFLOW_AT = 3  # the loss of this iteration is multiplied so that its fp16 gradients overflow
RESUME_AT = 4  # after this iteration the scaler goes through a checkpoint into a new one


class TimmStyleLossScaler:
    """A loss scaler called the way timm calls its ``NativeScaler`` (module docstring)."""

    state_dict_key = "amp_scaler"

    def __init__(self, factory: Factory) -> None:
        self.scaler = factory("cpu", growth_interval=2)

    def __call__(
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Iterable[torch.nn.Parameter] | None = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        self.scaler.scale(loss).backward(create_graph=create_graph)
        if not need_update:
            return
        if clip_grad is not None:
            assert parameters is not None
            self.scaler.unscale_(optimizer)
            if clip_mode == "norm":
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            else:
                torch.nn.utils.clip_grad_value_(parameters, clip_grad)
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)


def small_convnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.GELU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 5),
    )  # fmt: skip


OPTIMIZERS: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05, fused=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


def train_like_timm(
    factory: Factory,
    optimizer_name: str,
    *,
    clip_mode: str | None = None,
    accumulation: int = 1,
    create_graph: bool = False,
    resume_into: Factory | None = None,
) -> tuple[Trace, TimmStyleLossScaler]:
    """Train as timm's train_one_epoch does; after RESUME_AT the loss scaler goes through a
    timm checkpoint into a new one made by ``resume_into`` (default: ``factory``)."""
    model = small_convnet()
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    loss_scaler = TimmStyleLossScaler(factory)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for step in range(STEPS):
        for micro in range(accumulation):
            images = torch.randn(4, 3, 8, 8, generator=data)
            targets = torch.randint(0, 5, (4,), generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                output = model(images)
                loss = torch.nn.functional.cross_entropy(
                    output.float(), targets, label_smoothing=0.1
                )
            loss = loss * (1e5 if step == OVERFLOW_AT else 1.0) / accumulation
            loss_scaler(
                loss, optimizer,
                clip_grad=None if clip_mode is None else 0.5, clip_mode=clip_mode or "norm",
                parameters=model.parameters(), create_graph=create_graph,
                need_update=micro == accumulation - 1,
            )  # fmt: skip
        optimizer.zero_grad(set_to_none=True)
        if step == RESUME_AT:
            loss_scaler = resumed(loss_scaler, resume_into or factory)
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.params[-1] += [b.detach().clone() for b in model.buffers()]
        trace.scales.append(loss_scaler.scaler.get_scale())
        trace.trackers.append(loss_scaler.scaler._get_growth_tracker())
    return trace, loss_scaler


def resumed(loss_scaler: TimmStyleLossScaler, factory: Factory) -> TimmStyleLossScaler:
    """A checkpoint as timm's saver writes it, loaded as timm's resume_checkpoint does."""
    buffer = io.BytesIO()
    torch.save({"epoch": 0, loss_scaler.state_dict_key: loss_scaler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    fresh = TimmStyleLossScaler(factory)
    fresh.load_state_dict(checkpoint[fresh.state_dict_key])
    before = (loss_scaler.scaler.get_scale(), loss_scaler.scaler._get_growth_tracker())
    after = (fresh.scaler.get_scale(), fresh.scaler._get_growth_tracker())
    assert after == before != (2.0**16, 0)  # the state came through, and it was not the default
    return fresh


def assert_skipped_and_grew(trace: Trace) -> None:
    scales = trace.scales
    assert scales[OVERFLOW_AT] < scales[OVERFLOW_AT - 1]  # the overflow was skipped, backed off
    assert max(scales[OVERFLOW_AT:]) > scales[OVERFLOW_AT]  # and the scale grew again


@pytest.mark.parametrize(
    ("optimizer_name", "options"),
    [
        ("adamw", {"clip_mode": "norm"}),
        ("sgd-nesterov", {"clip_mode": "value"}),
        ("adamw-fused", {"clip_mode": "norm"}),
        ("adamw-fused", {"accumulation": 2}),
        ("adamw", {}),
    ],
    ids=["norm-clip", "value-clip", "fused-norm-clip", "fused-accumulation", "no-clip"],
)
def test_timm_style_training_matches_torch(optimizer_name: str, options: dict[str, Any]) -> None:
    theirs, _ = train_like_timm(torch.amp.GradScaler, optimizer_name, **options)
    ours, _ = train_like_timm(ampscaler.GradScaler, optimizer_name, **options)
    assert_same_trace(ours, theirs)
    assert_skipped_and_grew(ours)


def test_second_order_backward_with_create_graph_matches_torch() -> None:
    """timm passes create_graph=True for second-order optimizers; the gradients then carry
    a graph, and unscaling and clipping them must still give torch's results."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*create_graph=True.*reference cycle")
        theirs, _ = train_like_timm(
            torch.amp.GradScaler, "sgd-nesterov", clip_mode="norm", create_graph=True
        )
        ours, _ = train_like_timm(
            ampscaler.GradScaler, "sgd-nesterov", clip_mode="norm", create_graph=True
        )
    assert_same_trace(ours, theirs)
    assert_skipped_and_grew(ours)


def test_a_timm_checkpoint_from_torchs_scaler_resumes_into_ampscalers() -> None:
    """A run checkpointed with timm's (torch's) scaler continues with ampscaler's exactly as it
    would have continued with torch's; ampscaler's counters start at zero, as documented."""
    theirs, _ = train_like_timm(torch.amp.GradScaler, "adamw", clip_mode="norm")
    switched, loss_scaler = train_like_timm(
        torch.amp.GradScaler, "adamw", clip_mode="norm", resume_into=ampscaler.GradScaler
    )
    assert_same_trace(switched, theirs)
    assert isinstance(loss_scaler.scaler, ampscaler.GradScaler)
    assert loss_scaler.scaler.metrics("")["steps"] == STEPS - RESUME_AT - 1
