"""fairscale's scalers (``fairscale/optim/grad_scaler.py``), re-created over ampscaler's.

fairscale is not installed here (its last release pins old torch). Read in its source:

- ``fairscale.optim.GradScaler`` subclasses torch's scaler and overrides only
  ``_unscale_grads_``, calling ``super()._unscale_grads_`` with ``allow_fp16`` ``True``: its
  sharded models (``ShardedDataParallel``/``OSS``, ``FullyShardedDataParallel`` without fp32
  reduce-scatter) hand the scaler float16 gradients, which torch's ``unscale_()`` refuses.
- ``fairscale.optim.grad_scaler.ShardedGradScaler`` overrides ``update()`` with a copy of torch's
  whose CPU branch moves the scale in Python: ``self._scale *= backoff_factor`` and
  ``self._growth_tracker = 0`` (an int) after an overflow, ``successful =
  self._growth_tracker + 1`` and ``self._scale *= growth_factor`` at the interval; it adds the
  optimizers' flags into the first one in place and ends by assigning
  ``_per_optimizer_states`` a fresh ``defaultdict`` (here torch's factory: fairscale's own
  fills in its own ``OptState``, which only its copy of torch's ``step()`` understands). Its
  ``unscale_()`` writes the per-optimizer entries, which ampscaler refuses with a message
  (``test_subclass_hooks``).

Each is run over ampscaler's scaler (the first also defined over torch's name while
``patch_torch()`` is in force, as when fairscale is imported after the patch) and compared
with the same class over torch's scaler: scales, parameters and what ``step()`` returned.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampscaler

STEPS = 8
INF_AT = (2, 5)  # in these iterations a gradient element is inf after backward


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Fp16Unscale:
    """fairscale's ``GradScaler``: torch's, with float16 gradients allowed."""

    def _unscale_grads_(
        self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        flags: dict[torch.device, torch.Tensor] = super()._unscale_grads_(  # type: ignore[misc]
            optimizer, inv_scale, found_inf, True
        )
        return flags


class PythonUpdate:
    """fairscale's ``ShardedGradScaler.update()`` on the CPU (module docstring)."""

    _enabled: bool
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _scale: Any
    _growth_tracker: Any
    _per_optimizer_states: Any
    _check_scale_growth_tracker: Callable[[str], tuple[torch.Tensor, torch.Tensor]]

    def _amp_update_scale_cpu_(self, found_inf: torch.Tensor) -> None:
        if found_inf.item() == 1.0:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            successful = self._growth_tracker + 1
            if successful == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker = successful

    def update(self, new_scale: float | None = None) -> None:
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._scale.fill_(new_scale)
        else:
            found_infs = [
                found_inf.to(device=scale.device, non_blocking=True)
                for state in self._per_optimizer_states.values()
                for found_inf in state["found_inf_per_device"].values()
            ]
            assert len(found_infs) > 0, "No inf checks were recorded prior to update."
            combined = found_infs[0]
            for other in found_infs[1:]:
                combined += other
            self._amp_update_scale_cpu_(combined)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def over(mixin: type, base: type) -> type:
    return type(f"{mixin.__name__}Scaler", (mixin, base), {})


def train(scaler: Any, fp16: bool, clip: bool) -> dict[str, Any]:
    """Two optimizers over one small model (float16 weights when ``fp16``), one scaler."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    if fp16:
        model = model.half()
    first = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01, eps=1e-4)
    data = torch.Generator().manual_seed(1)
    scales, params, returns = [], [], []
    for step in range(STEPS):
        inputs = torch.randn(4, 6, generator=data).to(torch.float16 if fp16 else torch.float32)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(inputs)
        scaler.scale(out.float().pow(2).mean()).backward()
        if step in INF_AT:
            grad = model[2 if step == INF_AT[0] else 0].weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        if clip:
            scaler.unscale_(first)
            torch.nn.utils.clip_grad_norm_(model[0].parameters(), 0.5)
        returns += [scaler.step(first, None), scaler.step(second)]
        scaler.update()
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in model.parameters()])
    return {"scales": scales, "params": params, "returns": returns}


def assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["scales"] == theirs["scales"]
    assert ours["returns"] == theirs["returns"]
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("clip", [False, True], ids=["step-unscales", "unscale_-and-clip"])
def test_fairscales_grad_scaler_trains_float16_gradients_as_over_torchs(clip: bool) -> None:
    theirs = train(
        over(Fp16Unscale, torch.amp.GradScaler)("cpu", 2.0**8, growth_interval=2), True, clip
    )
    ours = train(
        over(Fp16Unscale, ampscaler.GradScaler)("cpu", 2.0**8, growth_interval=2), True, clip
    )
    assert_same_training(ours, theirs)
    assert theirs["scales"][INF_AT[0]] == theirs["scales"][INF_AT[0] - 1] / 2  # skipped
    ampscaler.patch_torch()  # fairscale imported after the patch: its base is the stand-in
    patched = over(Fp16Unscale, torch.amp.GradScaler)("cpu", 2.0**8, growth_interval=2)
    assert isinstance(patched, ampscaler.GradScaler)
    assert_same_training(train(patched, True, clip), theirs)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32-weights", "fp16-weights"])
def test_fairscales_python_update_moves_the_scale_as_over_torchs(fp16: bool) -> None:
    mixins: tuple[type, ...] = (PythonUpdate, Fp16Unscale) if fp16 else (PythonUpdate,)
    theirs_class = type("Theirs", (*mixins, torch.amp.GradScaler), {})
    ours_class = type("Ours", (*mixins, ampscaler.GradScaler), {})
    theirs = train(theirs_class("cpu", 2.0**8, growth_interval=2), fp16, clip=True)
    ours = train(ours_class("cpu", 2.0**8, growth_interval=2), fp16, clip=True)
    assert_same_training(ours, theirs)
    scales = theirs["scales"]
    assert scales[INF_AT[1]] == scales[INF_AT[1] - 1] / 2 and max(scales) > 2.0**8
