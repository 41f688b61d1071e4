"""ColossalAI's torch-AMP optimizer wrapper, re-created: ampscaler's scaler against torch's.

ColossalAI is not installed here; this file re-creates, in its own words, what
``colossalai/booster/mixed_precision/fp16_torch.py`` does, as read in its source.
``FP16TorchMixedPrecision.configure`` wraps the optimizer in ``TorchAMPOptimizer``, which:

- builds ``torch.cuda.amp.GradScaler(init_scale=..., growth_factor=..., backoff_factor=...,
  growth_interval=...)`` (no device: CUDA's, disabled with torch's warning where there is none);
- ``backward(loss, *args, **kwargs)``: ``scaler.scale(loss).backward(*args, **kwargs)``
  (``retain_graph=True`` when a graph is walked twice);
- ``step(*args, **kwargs)``: ``out = scaler.step(optim, *args, **kwargs)``, then
  ``scaler.update()``, and returns ``out`` (a closure passed positionally reaches the optimizer);
- ``clip_grad_by_norm``/``clip_grad_by_value``: ``scaler.unscale_(optim)`` first, each time
  (calling both in one iteration is the error torch raises for a second ``unscale_()``).
(ColossalAI's ``naive_amp`` wrappers use a loss scaler of its own, not torch's.)

Under ``patch_torch(device="cpu")`` ColossalAI's own line builds an enabled ampscaler scaler on
this CPU. Programs that run such code without CUDA silence torch's warning by its text
(``warnings.filterwarnings("ignore", message="torch.cuda.amp.GradScaler is enabled, but CUDA
is not available.  Disabling.")``); the scaler that replaces torch's must be silenced by it too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[[], Any]
TORCHS_WARNING = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
AMP_KWARGS = {"init_scale": 2.0**8, "growth_factor": 2.0, "backoff_factor": 0.5}


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class TorchAMPOptimizer:
    """ColossalAI's wrapper (module docstring); ``make_scaler`` stands for its line."""

    def __init__(self, optim: torch.optim.Optimizer, make_scaler: Factory) -> None:
        self.optim = optim
        self.scaler = make_scaler()

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.scaler.scale(loss).backward(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = self.scaler.step(self.optim, *args, **kwargs)
        self.scaler.update()
        return out

    def clip_grad_by_norm(self, max_norm: float) -> None:
        self.scaler.unscale_(self.optim)
        params = [p for group in self.optim.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def clip_grad_by_value(self, clip_value: float) -> None:
        self.scaler.unscale_(self.optim)
        params = [p for group in self.optim.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_value)

    def zero_grad(self) -> None:
        self.optim.zero_grad()


def colossalai_line() -> Any:
    """ColossalAI's own construction, verbatim in its arguments: torch's name read at the call."""
    return torch.cuda.amp.GradScaler(**AMP_KWARGS, growth_interval=2)


def cpu_scaler(factory: Callable[..., Any]) -> Factory:
    return lambda: factory("cpu", **AMP_KWARGS, growth_interval=2)


def train(make_scaler: Factory) -> dict[str, Any]:
    """Two losses over one graph (the first backward retains it), clipping by norm, an
    overflow at step 2, and an LBFGS head stepped with a positional closure."""
    torch.manual_seed(0)
    body, head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)
    optimizer = TorchAMPOptimizer(torch.optim.AdamW(body.parameters(), lr=0.01), make_scaler)
    data = torch.Generator().manual_seed(1)
    scales, returns = [], []
    for step in range(6):
        optimizer.zero_grad()
        head.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = torch.tanh(body(torch.randn(3, 4, generator=data)))
            first, second = hidden.float().pow(2).mean(), head(hidden).float().abs().mean()
        optimizer.backward(first, retain_graph=True)
        optimizer.backward(second * (float("inf") if step == 2 else 1.0))
        optimizer.clip_grad_by_norm(1.0)
        returns.append(optimizer.step())
        scales.append(optimizer.scaler.get_scale())
    params = [p.detach().clone() for p in (*body.parameters(), *head.parameters())]
    return {"scales": scales, "returns": returns, "params": params}


def assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["scales"] == theirs["scales"] and ours["returns"] == theirs["returns"]
    assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True))


def test_colossalais_wrapper_trains_as_over_torchs_scaler() -> None:
    theirs = train(cpu_scaler(torch.amp.GradScaler))
    assert theirs["scales"][2] == theirs["scales"][1] / 2  # the overflow was skipped
    assert_same_training(train(cpu_scaler(ampscaler.GradScaler)), theirs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.cuda.amp's deprecation
        ampscaler.patch_torch(device="cpu")
        assert colossalai_line().is_enabled()
        assert_same_training(train(colossalai_line), theirs)


@pytest.mark.parametrize("factory", [torch.amp.GradScaler, ampscaler.GradScaler])
def test_clipping_by_value_then_by_norm_is_torchs_error(factory: Callable[..., Any]) -> None:
    body = torch.nn.Linear(2, 1)
    optimizer = TorchAMPOptimizer(torch.optim.SGD(body.parameters(), lr=0.1), cpu_scaler(factory))
    optimizer.backward(body(torch.ones(1, 2)).sum())
    optimizer.clip_grad_by_value(0.5)
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called"):
        optimizer.clip_grad_by_norm(1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
@pytest.mark.parametrize("patched", [False, True], ids=["torch", "patch_torch"])
def test_torchs_no_cuda_warning_is_silenced_by_its_text(patched: bool) -> None:
    """ColossalAI's line on a machine without CUDA: torch's warning (and the scaler disabled),
    silenced by a filter on torch's text, under the patch as without it."""
    if patched:
        ampscaler.patch_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch.cuda.amp's deprecation
        warnings.filterwarnings("ignore", message=TORCHS_WARNING)
        scaler = colossalai_line()
    assert [str(w.message) for w in caught] == []
    assert not scaler.is_enabled() and scaler.get_scale() == 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=FutureWarning)
        colossalai_line()  # without the filter it is there, in torch's words
        ampscaler.GradScaler("cuda")  # and so for ampscaler's scaler built directly
    assert [str(w.message).startswith(TORCHS_WARNING) for w in caught] == [True, True]
