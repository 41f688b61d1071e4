"""mmengine's ``AmpOptimWrapper``, re-created: ampscaler's scaler against torch's, bit for bit.

mmengine (open-mmlab/mmengine) is not a dependency here, so this file re-creates, in its own
words, what it does with a scaler, as read in ``mmengine/optim/optimizer/
amp_optimizer_wrapper.py`` and ``optimizer_wrapper.py`` (0.10.x):

- the scaler is built from ``loss_scale``: ``"dynamic"`` builds it with torch's defaults, a
  float ``s`` builds it with ``init_scale=s`` *and* passes ``s`` to ``update(s)`` after every
  step (a static scale: overflowing steps are still skipped, the scale never moves), a dict is
  passed as keyword arguments; anything else is a ``TypeError``;
- ``update_params(loss)`` divides the loss by the accumulation factor (``accumulative_counts``,
  or the remainder for the last updates when the total does not divide:
  ``initialize_count_status``), runs ``scale(loss).backward()`` and counts it, and when
  ``should_update()`` (the count divides by the accumulation, or is the last) steps:
  ``unscale_`` and a clip (``clip_grad_norm_`` or ``clip_grad_value_``, over parameters with a
  gradient) when ``clip_grad`` is given, ``step(optimizer, **step_kwargs)``,
  ``update(static_scale_or_None)``; then zeroes the gradients;
- ``state_dict()`` is the optimizer's with the scaler's added under ``"loss_scaler"``;
  ``load_state_dict()`` pops that key into the scaler before the optimizer loads the rest. The
  runner saves it with ``torch.save`` and loads checkpoints with ``torch.load``, whose default
  is ``weights_only=True`` since torch 2.6.

The static ``update(new_scale)`` on every step is what no other client test drives.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
ITERATIONS = 10
OVERFLOW_AT = (3, 7)  # 0-based iterations whose gradients get an inf / NaN after backward
RESUME_AT = 5  # after this iteration the wrapper goes through a checkpoint into a new one


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class MMStyleAmpWrapper:
    """An optimizer wrapper that drives its scaler as mmengine's ``AmpOptimWrapper`` does."""

    def __init__(
        self,
        factory: Factory,
        optimizer: torch.optim.Optimizer,
        loss_scale: Any = "dynamic",
        accumulative_counts: int = 1,
        clip_grad: dict[str, Any] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.accumulative_counts = accumulative_counts
        self.clip_grad = clip_grad
        self.inner_count, self.max_counts, self.remainder = 0, -1, -1
        self.static_scale: float | None = None
        if loss_scale == "dynamic":
            self.loss_scaler = factory("cpu")
        elif isinstance(loss_scale, float):
            self.static_scale = loss_scale
            self.loss_scaler = factory("cpu", init_scale=loss_scale)
        elif isinstance(loss_scale, dict):
            self.loss_scaler = factory("cpu", **loss_scale)
        else:
            raise TypeError(f'loss_scale must be a float, a dict or "dynamic", not {loss_scale}')

    def initialize_count_status(self, init_counts: int, max_counts: int) -> None:
        self.inner_count, self.max_counts = init_counts, max_counts
        self.remainder = max_counts % self.accumulative_counts

    def should_update(self) -> bool:
        return (
            self.inner_count % self.accumulative_counts == 0 or self.inner_count == self.max_counts
        )

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.accumulative_counts == 1:
            factor = 1
        elif self.max_counts == -1 or self.inner_count < self.max_counts - self.remainder:
            factor = self.accumulative_counts
        else:
            factor = self.remainder
        return loss / factor

    def backward(self, loss: torch.Tensor) -> None:
        self.loss_scaler.scale(loss).backward()
        self.inner_count += 1

    def step(self, **step_kwargs: Any) -> None:
        if self.clip_grad is not None:
            self.loss_scaler.unscale_(self.optimizer)
            params = [
                p
                for group in self.optimizer.param_groups
                for p in group["params"]
                if p.requires_grad and p.grad is not None
            ]
            kwargs = dict(self.clip_grad)
            if kwargs.pop("type") == "norm":
                torch.nn.utils.clip_grad_norm_(params, **kwargs)
            else:
                torch.nn.utils.clip_grad_value_(params, **kwargs)
        self.loss_scaler.step(self.optimizer, **step_kwargs)
        self.loss_scaler.update(self.static_scale)

    def update_params(self, loss: torch.Tensor, poison: float | None = None) -> bool:
        """mmengine's update_params; ``poison`` (inf or NaN) is written into a gradient
        after the backward, as an fp16 overflow would. Returns whether it stepped."""
        self.backward(self.scale_loss(loss))
        if poison is not None:
            grad = self.optimizer.param_groups[0]["params"][0].grad
            grad.view(-1)[0] = poison
        if not self.should_update():
            return False
        self.step()
        self.optimizer.zero_grad()
        return True

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.state_dict()
        state["loss_scaler"] = self.loss_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state.pop("loss_scaler"))
        self.optimizer.load_state_dict(state)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.Linear(12, 3))


def through_checkpoint(
    wrapper: MMStyleAmpWrapper, model: torch.nn.Module, factory: Factory, **options: Any
) -> MMStyleAmpWrapper:
    """A runner checkpoint with the wrapper's state, read back with ``weights_only=True`` into
    a new wrapper (the optimizer's tensors, the scaler's state) made by ``factory``."""
    buffer = io.BytesIO()
    torch.save({"state_dict": model.state_dict(), "optimizer": wrapper.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh = MMStyleAmpWrapper(factory, optimizer, **options)
    fresh.initialize_count_status(wrapper.inner_count, wrapper.max_counts)
    fresh.load_state_dict(checkpoint["optimizer"])
    return fresh


def train_like_mmengine(
    factory: Factory, resume_into: Factory | None = None, **options: Any
) -> tuple[list[tuple[float, int, bool]], list[torch.Tensor], dict[str, Any]]:
    """ITERATIONS iterations of a runner's train loop; returns per iteration (scale, growth
    tracker, whether the parameters moved), the parameters and the final state dict."""
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapper = MMStyleAmpWrapper(factory, optimizer, **options)
    wrapper.initialize_count_status(0, ITERATIONS)
    data = torch.Generator().manual_seed(1)
    trace = []
    for iteration in range(ITERATIONS):
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 6, generator=data))
        loss = torch.nn.functional.cross_entropy(
            out.float(), torch.randint(0, 3, (4,), generator=data)
        )
        poison = None
        if iteration in OVERFLOW_AT:
            poison = float("inf") if iteration == OVERFLOW_AT[0] else float("nan")
        wrapper.update_params(loss, poison)
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        scaler = wrapper.loss_scaler
        trace.append((scaler.get_scale(), scaler._get_growth_tracker(), moved))
        if iteration == RESUME_AT:
            wrapper = through_checkpoint(wrapper, model, resume_into or factory, **options)
    return trace, [p.detach().clone() for p in model.parameters()], wrapper.state_dict()


CONFIGS = {
    "static": {"loss_scale": 512.0},
    "static-accumulate-clip-norm": {
        "loss_scale": 512.0,
        "accumulative_counts": 3,
        "clip_grad": {"type": "norm", "max_norm": 0.5},
    },
    "dynamic": {"loss_scale": "dynamic", "clip_grad": {"type": "value", "clip_value": 0.1}},
    "dict-accumulate": {
        "loss_scale": {"init_scale": 2.0**10, "growth_interval": 1, "growth_factor": 4.0},
        "accumulative_counts": 4,
    },
}


def assert_same(ours: Any, theirs: Any) -> None:
    assert ours[0] == theirs[0]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
    their_state, our_state = theirs[2], ours[2]
    their_scaler, our_scaler = their_state.pop("loss_scaler"), our_state.pop("loss_scaler")
    assert {key: our_scaler[key] for key in their_scaler} == their_scaler
    assert torch.equal(our_state["state"][0]["exp_avg"], their_state["state"][0]["exp_avg"])


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("how", ["direct", "patched", "resumed-from-torch"])
def test_mmengine_style_training_matches_torch(config: str, how: str) -> None:
    options = CONFIGS[config]
    theirs = train_like_mmengine(torch.amp.GradScaler, **options)
    if how == "direct":
        ours = train_like_mmengine(ampscaler.GradScaler, **options)
    elif how == "patched":
        with ampscaler.patch_torch():
            ours = train_like_mmengine(torch.amp.GradScaler, **options)
    else:
        ours = train_like_mmengine(
            torch.amp.GradScaler, resume_into=ampscaler.GradScaler, **options
        )
    assert_same(ours, theirs)
    accumulation = options.get("accumulative_counts", 1)
    ends = [it for it in range(ITERATIONS) if (it + 1) % accumulation == 0 or it == ITERATIONS - 1]
    skipped = {min(end for end in ends if end >= overflow) for overflow in OVERFLOW_AT}
    assert [it for it in range(ITERATIONS) if ours[0][it][2]] == sorted(set(ends) - skipped)
    if isinstance(options["loss_scale"], float):
        assert {scale for scale, _, _ in ours[0]} == {options["loss_scale"]}  # never moved


def test_a_static_scale_through_update_new_scale_is_kept_in_ampscalers_state_dict() -> None:
    """With mmengine's static scale, ``update(s)`` runs after every step, skipped or not: the
    checkpoint holds ``s`` and the growth tracker torch's ``update(new_scale)`` leaves (it
    never resets or advances it)."""
    _, _, state = train_like_mmengine(ampscaler.GradScaler, loss_scale=512.0)
    saved = state["loss_scaler"]
    assert (saved["scale"], saved["_growth_tracker"]) == (512.0, 0)
    assert saved["stats"]["skipped"] == len(OVERFLOW_AT)
