"""fairseq2's ``StandardFloat16LossScaler``, re-created: ampscaler's scaler against torch's,
bit for bit.

fairseq2 is not installed here; this file re-creates, in its own words, what its loss scaler
(``src/fairseq2/optim/fp16_loss_scaler.py``), its trainer's step (``src/fairseq2/trainer.py``,
``_run_step``) and its factory (``src/fairseq2/recipe/internal/trainer.py``) do with torch's
scaler:

- the factory: ``init_scale, min_scale = fp16_loss_scale`` (``(128.0, 0.0001)``),
  ``scale_window = max(int(2**14 / dp_size / grad_accumulation), 1)``;
- without sharding, ``_InternalGradScaler(init_scale=..., growth_factor=scale_factor,
  backoff_factor=1 / scale_factor, growth_interval=scale_window)``: a subclass of
  ``torch.amp.GradScaler``, made at import, whose ``_unscale_grads_`` calls ``super()`` with
  ``allow_fp16=True`` (fairseq2 trains float16 models with a plain optimizer); with FSDP or
  model parallelism, torch's ``ShardedGradScaler(..., process_group=root_pg)``;
- a step: per batch ``scale(loss).backward()`` (the loss divided by the number of batches),
  then ``unscale_(optimizer)``, gradient clipping, ``step(optimizer, closure)`` -- the
  closure, ``None`` here, passed **positionally** -- then ``_update_scale``: ``get_scale()``,
  ``update()``, ``get_scale()`` again; a higher scale is a growth, a lower one an overflow, and
  a scale under ``min_scale`` is set to it with a second ``update(min_scale)`` in the same
  iteration, and the run stops (``MinimumLossScaleReachedError``); then
  ``optimizer.zero_grad(set_to_none=True)``; an overflowed step is run again on new data;
- ``state_dict()``: ``{"grad_scaler": scaler.state_dict()}``; ``load_state_dict`` hands it to
  the scaler's, turning its ``RuntimeError``, ``ValueError`` or ``TypeError`` into fairseq2's
  ``StateDictError``.

Why it matters: float16 gradients unscaled through an override, a second ``update()`` with a
value right after the first, and the scale read around ``update()`` to tell what happened.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import ampscaler

Factory = Callable[..., Any]


class StateDictError(ValueError):
    """fairseq2's error for a state dict it cannot load."""


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def internal_scaler_class(base: type) -> type:
    """fairseq2's ``_InternalGradScaler`` over ``base``."""

    class InternalGradScaler(base):  # type: ignore[misc, valid-type]
        def _unscale_grads_(
            self,
            optimizer: torch.optim.Optimizer,
            inv_scale: torch.Tensor,
            found_inf: torch.Tensor,
            allow_fp16: bool,
        ) -> Any:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=True)

    return InternalGradScaler


def patched_internal(*args: Any, **kwargs: Any) -> Any:
    """The class made while torch is patched (fairseq2 imported after ``patch_torch()``)."""
    with ampscaler.patch_torch():
        return internal_scaler_class(torch.amp.grad_scaler.GradScaler)(*args, **kwargs)


class LossScaler:
    """fairseq2's ``StandardFloat16LossScaler`` (the module docstring)."""

    def __init__(self, scaler: Any, min_scale: float) -> None:
        self.scaler, self.min_scale = scaler, min_scale

    def run_optimizer_step(self, optimizer: torch.optim.Optimizer) -> tuple[float, float, str]:
        self.scaler.step(optimizer, None)
        old_scale = self.scaler.get_scale()
        self.scaler.update()
        new_scale = self.scaler.get_scale()
        if math.isclose(new_scale, old_scale, rel_tol=1.3e-6, abs_tol=1e-5):
            return old_scale, new_scale, ""
        if new_scale > old_scale:
            return old_scale, new_scale, "scaled"
        if self.min_scale > new_scale:
            self.scaler.update(self.min_scale)
            return old_scale, self.min_scale, "exploded"
        return old_scale, new_scale, "overflowed"

    def state_dict(self) -> dict[str, object]:
        return {"grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        try:
            self.scaler.load_state_dict(state_dict["grad_scaler"])
        except (RuntimeError, ValueError, TypeError) as error:
            raise StateDictError("not a valid grad scaler state") from error


def scaler_kwargs(grad_accumulation: int) -> dict[str, Any]:
    init_scale, _ = (128.0, 0.0001)
    window = max(int(2**14 / 1 / grad_accumulation), 1) // 2048  # 4: growth within the test
    return {"init_scale": init_scale, "growth_factor": 2.0, "backoff_factor": 1 / 2.0,
            "growth_interval": window}  # fmt: skip


def train(
    factory: Factory,
    dtype: torch.dtype,
    min_scale: float,
    steps: int = 14,
    resume_at: int | None = None,
) -> tuple[list[Any], list[list[torch.Tensor]]]:
    """``steps`` trainer steps of two batches each; inf losses at some batches, with a long run
    of them at the end when ``min_scale`` is to be reached. Returns the scale results (or
    ``"stopped"``) and the parameters after each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    model = model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    scaler = LossScaler(factory("cpu", **scaler_kwargs(2)), min_scale)
    data = torch.Generator().manual_seed(1)
    bad = {(2, 1), (8, 0), (9, 0)} | {(s, 0) for s in range(11, steps)}
    results: list[Any] = []
    params: list[list[torch.Tensor]] = []
    for step in range(steps):
        for batch in range(2):
            inputs = torch.randn(3, 4, generator=data).to(dtype)
            with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float32):
                loss = model(inputs).float().pow(2).mean() / 2
            scaler.scaler.scale(loss * (math.inf if (step, batch) in bad else 1.0)).backward()
        scaler.scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        result = scaler.run_optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        results.append(result)
        params.append([p.detach().clone() for p in model.parameters()])
        if result[2] == "exploded":
            results.append(("stopped", scaler.scaler.get_scale()))
            break
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save({"_fp16_loss_scaler": scaler.state_dict()}, buffer)
            buffer.seek(0)
            scaler = LossScaler(factory("cpu", **scaler_kwargs(2)), min_scale)
            scaler.load_state_dict(torch.load(buffer, weights_only=True)["_fp16_loss_scaler"])
    return results, params


def same(ours: tuple[list[Any], list[list[torch.Tensor]]], theirs: Any) -> None:
    assert ours[0] == theirs[0]
    assert len(ours[1]) == len(theirs[1])
    for mine, other in zip(ours[1], theirs[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, other, strict=True))


OURS = {
    "direct": internal_scaler_class(ampscaler.GradScaler),
    "patch": patched_internal,
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16 model", "autocast"])
@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_steps_growth_overflow_and_resume_are_torchs(ours: Factory, dtype: torch.dtype) -> None:
    theirs = train(internal_scaler_class(torch.amp.GradScaler), dtype, min_scale=1e-4)
    kinds = [kind for _, _, kind in theirs[0]]
    assert "scaled" in kinds and "overflowed" in kinds and "exploded" not in kinds
    same(train(ours, dtype, min_scale=1e-4), theirs)
    same(train(ours, dtype, min_scale=1e-4, resume_at=4), theirs)


@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_the_minimum_scale_set_by_a_second_update_stops_as_with_torchs(ours: Factory) -> None:
    theirs = train(internal_scaler_class(torch.amp.GradScaler), torch.float16, min_scale=10.0)
    assert theirs[0][-2][2] == "exploded" and theirs[0][-1] == ("stopped", 10.0)
    same(train(ours, torch.float16, min_scale=10.0), theirs)


def test_a_checkpoint_moves_between_torchs_scaler_and_ours() -> None:
    """Saved by one, loaded by the other, either way: the same scale and tracker; a damaged
    one becomes fairseq2's ``StateDictError`` from either."""
    for source, target in ((torch.amp.GradScaler, patched_internal),
                           (patched_internal, torch.amp.GradScaler)):  # fmt: skip
        saved = LossScaler(source("cpu", **scaler_kwargs(2)), 1e-4)
        saved.scaler.load_state_dict({**saved.scaler.state_dict(), "scale": 32.0,
                                      "_growth_tracker": 3})  # fmt: skip
        loaded = LossScaler(target("cpu", **scaler_kwargs(2)), 1e-4)
        loaded.load_state_dict(saved.state_dict())
        assert (loaded.scaler.get_scale(), loaded.scaler._get_growth_tracker()) == (32.0, 3)
    with pytest.raises(StateDictError):
        LossScaler(patched_internal("cpu"), 1e-4).load_state_dict({"grad_scaler": {"scale": 1.0}})


def test_the_sharded_path_with_a_process_group_is_torchs(world_of_one: dist.ProcessGroup) -> None:
    def sharded(cls: type) -> Factory:
        def build(device: str, **kwargs: Any) -> Any:
            return cls(device, **kwargs, process_group=world_of_one)

        return build

    theirs = train(sharded(ShardedGradScaler), torch.float16, min_scale=1e-4)
    same(train(sharded(ampscaler.ShardedGradScaler), torch.float16, min_scale=1e-4), theirs)
