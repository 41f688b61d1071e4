"""A policy written in a user's own file (tests/user_policy.py) plugs in: it trains, checkpoints,
resumes, and agrees across ranks, with nothing in ampscaler knowing its class."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch

import ampscaler
import multirank
from user_policy import HalveOrDouble, reference_scales

POISONED = {1, 2, 6}  # iterations whose gradients overflow


def _train(
    scaler: ampscaler.GradScaler, steps: range, model: torch.nn.Module, opt: Any
) -> list[float]:
    scales = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 3, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if step in POISONED:
            model.bias.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_it_trains_by_its_own_rule_and_skips_overflows() -> None:
    model, opt = _setup()
    scaler = ampscaler.GradScaler("cpu", init_scale=64.0, policy=HalveOrDouble(interval=2))
    scales = _train(scaler, range(10), model, opt)
    expected = reference_scales(64.0, [s in POISONED for s in range(10)], 2, 2.0**20)
    assert scales == expected
    assert scaler.metrics("")["skips"] == len(POISONED)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_its_checkpoint_holds_its_settings_and_state_and_resumes_exactly() -> None:
    model, opt = _setup()
    whole = ampscaler.GradScaler("cpu", init_scale=64.0, policy=HalveOrDouble(interval=2))
    whole_scales = _train(whole, range(10), model, opt)
    whole_params = [p.detach().clone() for p in model.parameters()]

    model, opt = _setup()
    first = ampscaler.GradScaler("cpu", init_scale=64.0, policy=HalveOrDouble(interval=2))
    scales = _train(first, range(5), model, opt)
    saved = first.state_dict()
    assert saved["policy"] == "HalveOrDouble"
    assert saved["policy_state"] == {"interval": 2, "ceiling": 2.0**20, "overflows": 2}
    buffer = io.BytesIO()
    torch.save({"scaler": saved, "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)

    resumed = ampscaler.GradScaler("cpu", policy=HalveOrDouble())  # settings from the file
    resumed.load_state_dict(loaded["scaler"])
    assert resumed.policy == HalveOrDouble(interval=2)
    scales += _train(resumed, range(5, 10), model, opt)
    assert scales == whole_scales
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole_params, strict=True))
    assert resumed.state_dict() == whole.state_dict()


def test_copies_keep_it_and_torchs_scaler_loads_its_checkpoint() -> None:
    model, opt = _setup()
    scaler = ampscaler.GradScaler("cpu", init_scale=64.0, policy=HalveOrDouble(interval=2))
    _train(scaler, range(4), model, opt)
    for twin in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert twin.policy == scaler.policy
        assert twin.state_dict() == scaler.state_dict()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(scaler.state_dict())
    assert theirs.get_scale() == scaler.get_scale()


def test_what_it_does_not_have_is_refused_clearly() -> None:
    scaler = ampscaler.GradScaler("cpu", policy=HalveOrDouble())
    with pytest.raises(ampscaler.ScalerUsageError, match="no growth rule"):
        scaler.set_growth_factor(4.0)
    assert scaler.get_growth_interval() == 2000  # torch's default under torch's key
    saved = scaler.state_dict()
    other = ampscaler.GradScaler("cpu")
    with pytest.raises(ampscaler.InvalidStateDictError, match="construct the scaler with a Halve"):
        other.load_state_dict(saved)
    assert other.policy == ampscaler.ScalePolicy() and other.get_scale() == 2.0**16
    bad = {**saved, "policy_state": {**saved["policy_state"], "overflows": -1}}
    with pytest.raises(ampscaler.InvalidStateDictError, match="overflows"):
        scaler.load_state_dict(bad)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return multirank.spawn(2, ["user_policy", "user_policy_mismatch"])


def test_ranks_agree_on_its_steps_and_compare_its_settings(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Overflow in one rank's shard at steps 1 and 4: both ranks skip and move alike."""
    traces = [two_ranks[rank]["user_policy"] for rank in (0, 1)]
    overflowed = [step in (1, 4) for step in range(multirank.STEPS)]
    assert traces[0].skipped == traces[1].skipped == overflowed
    expected = reference_scales(2.0**10, overflowed, 2, 2.0**20)
    assert traces[0].scales == traces[1].scales == expected
    for rank in (0, 1):
        message = two_ranks[rank]["user_policy_mismatch"]
        assert "interval is 2 on rank 0, 3 on rank 1" in message
