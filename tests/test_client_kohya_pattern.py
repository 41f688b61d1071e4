"""kohya-ss sd-scripts' full fp16 training, re-created: ampscaler's scaler against torch's.

sd-scripts (and the diffusers training scripts and Fabric setups that copied it) train weights
kept in float16 (``--full_fp16``). torch's ``unscale_()`` refuses float16 gradients, so they
replace the method on the one scaler, as read in sd-scripts' ``library/train_util.py``
(``patch_accelerator_for_fp16_training``): the bound ``scaler._unscale_grads_`` is kept, and the
instance attribute ``_unscale_grads_`` becomes a function that calls it with ``allow_fp16``
``True``. torch's ``unscale_()``, its ``step()`` (through ``unscale_()``) and its fused route
call ``self._unscale_grads_``, so they call the replacement.

The loop is sd-scripts' ``train_network.py`` as Accelerate runs it with gradient accumulation:
``scaler.scale(loss / accumulation).backward()`` on every micro-batch; on the last one, when
``max_grad_norm`` is not 0, ``unscale_()`` and ``clip_grad_norm_`` (Accelerate's
``clip_grad_norm_``), then ``step()`` and ``update()`` (Accelerate's optimizer step) and
``zero_grad(set_to_none=True)``. Accelerate is left out: it only forwards these calls.

Why it matters: a scaler that ignores the replacement refuses the float16 gradients (the run
stops at its first step) or checks them by other rules than the ones the replacement asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
STEPS = 8
ACCUMULATION = 2
INF_AT = 3  # in this step an fp16 gradient element is inf after the last backward


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def patch_scaler_for_fp16_training(scaler: Any, log: list[tuple[float, bool]]) -> None:
    """sd-scripts' replacement of the scaler's ``_unscale_grads_`` (module docstring), also
    logging the ``inv_scale`` and ``allow_fp16`` the scaler called it with."""
    original = scaler._unscale_grads_

    def _unscale_grads_replacer(
        optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> Any:
        log.append((inv_scale.item(), allow_fp16))
        return original(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = _unscale_grads_replacer


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4, foreach=False),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-4, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def train(factory: Factory, optimizer_name: str, max_grad_norm: float) -> dict[str, Any]:
    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)
    ).half()  # --full_fp16: the trained weights themselves are float16
    optimizer = OPTIMIZERS[optimizer_name](network.parameters())
    scaler = factory("cpu", init_scale=2.0**10, growth_interval=3)
    log: list[tuple[float, bool]] = []
    patch_scaler_for_fp16_training(scaler, log)
    data = torch.Generator().manual_seed(1)
    scales, params, returns = [], [], []
    for step in range(STEPS):
        for _ in range(ACCUMULATION):
            latents = torch.randn(4, 8, generator=data).half()
            target = torch.randn(4, 4, generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                prediction = network(latents)
            loss = torch.nn.functional.mse_loss(prediction.float(), target)
            scaler.scale(loss / ACCUMULATION).backward()
        if step == INF_AT:
            grad = network[0].weight.grad
            assert grad is not None and grad.dtype == torch.float16
            grad[1, 2] = float("inf")
        if max_grad_norm != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(network.parameters(), max_grad_norm)
        returns.append(scaler.step(optimizer))
        scaler.update()
        if step != INF_AT:
            grads = [p.grad.clone() for p in network.parameters() if p.grad is not None]
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        params.append([p.detach().clone() for p in network.parameters()])
    return {"scales": scales, "params": params, "grads": grads, "log": log, "returns": returns}


def assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["scales"] == theirs["scales"]
    assert ours["log"] == theirs["log"]  # called as often, with the same arguments
    assert ours["returns"] == theirs["returns"]
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(ours["grads"], theirs["grads"], strict=True))


@pytest.mark.parametrize(
    ("optimizer_name", "max_grad_norm"),
    [("adamw", 1.0), ("adamw", 0.0), ("sgd", 0.5), ("adamw-fused", 1.0), ("adamw-fused", 0.0)],
    ids=["clip", "step-unscales", "sgd-clip", "fused-clip", "fused"],
)
def test_full_fp16_training_with_the_replaced_unscale_grads_matches_torch(
    optimizer_name: str, max_grad_norm: float
) -> None:
    theirs = train(torch.amp.GradScaler, optimizer_name, max_grad_norm)
    ours = train(ampscaler.GradScaler, optimizer_name, max_grad_norm)
    assert_same_training(ours, theirs)
    # the inf step was skipped (the scale backed off), the clean ones grew it
    assert theirs["scales"][INF_AT] == theirs["scales"][INF_AT - 1] / 2
    assert max(theirs["scales"]) > 2.0**10
    fused = optimizer_name == "adamw-fused"
    # unscale_() passes torch's allow_fp16 (False), a fused step's check True at 1.0
    expected = (1.0, True) if fused and not max_grad_norm else (2.0**-10, False)
    assert theirs["log"][0] == expected and len(theirs["log"]) == STEPS


def test_under_patch_torch_the_scaler_accelerate_builds_takes_the_replacement() -> None:
    theirs = train(torch.amp.GradScaler, "adamw", 1.0)
    ampscaler.patch_torch()
    ours = train(torch.amp.GradScaler, "adamw", 1.0)
    assert_same_training(ours, theirs)


@pytest.mark.parametrize("factory", [torch.amp.GradScaler, ampscaler.GradScaler])
@pytest.mark.parametrize("by_step", [False, True], ids=["unscale_", "step"])
@pytest.mark.parametrize("assigned", [False, True], ids=["as-built", "passing-allow_fp16-on"])
def test_without_allow_fp16_fp16_gradients_are_still_refused(
    factory: Factory, by_step: bool, assigned: bool
) -> None:
    """What lets float16 gradients through is the replacement's ``allow_fp16=True``: without a
    replacement, or with one that passes ``allow_fp16`` on as given, both scalers refuse them,
    at ``unscale_()`` and at the ``step()`` that unscales."""
    network = torch.nn.Linear(3, 2).half()
    optimizer = torch.optim.SGD(network.parameters(), lr=0.1)
    scaler = factory("cpu")
    if assigned:
        original = scaler._unscale_grads_
        scaler._unscale_grads_ = lambda *args: original(*args)
    scaler.scale(network(torch.ones(2, 3).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(optimizer) if by_step else scaler.unscale_(optimizer)
