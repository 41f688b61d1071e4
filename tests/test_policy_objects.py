"""Policies as objects: ``GradScaler(policy=...)``, and the keyword shorthands that build them."""

from __future__ import annotations

import pickle

import pytest
import torch

import ampscaler
from ampscaler import ScalePolicy, StaticPolicy


def _iteration(scaler: ampscaler.GradScaler, poison: bool) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    if poison:
        assert model.bias.grad is not None
        model.bias.grad.fill_(float("inf"))
    scaler.step(opt)
    scaler.update()


def test_policy_object_and_shorthands_build_the_same_scaler() -> None:
    by_object = ampscaler.GradScaler(
        "cpu", init_scale=64.0, policy=ScalePolicy(growth_interval=2, hysteresis=2, min_scale=8.0)
    )
    by_keywords = ampscaler.GradScaler(
        "cpu", init_scale=64.0, growth_interval=2, hysteresis=2, min_scale=8.0
    )
    assert by_object.policy == by_keywords.policy
    for poison in [True, True, True, False, False, True, True, True, True, False]:
        _iteration(by_object, poison)
        _iteration(by_keywords, poison)
        assert by_object.state_dict() == by_keywords.state_dict()
    assert by_object.get_scale() == 8.0  # held at min_scale


def test_static_policy_never_moves_but_skips() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=512.0, policy=StaticPolicy())
    for poison in [True, False, False, True, False]:
        _iteration(scaler, poison)
        assert scaler.get_scale() == 512.0
    assert scaler.metrics("")["skips"] == 2
    assert scaler.state_dict()["dynamic"] is False


def test_a_static_checkpoint_loads_as_a_static_policy_and_back() -> None:
    static = ampscaler.GradScaler("cpu", init_scale=32.0, policy=StaticPolicy())
    dynamic = ampscaler.GradScaler("cpu")
    dynamic.load_state_dict(static.state_dict())
    assert dynamic.policy == StaticPolicy()
    assert dynamic.get_scale() == 32.0
    static.load_state_dict(ampscaler.GradScaler("cpu", growth_interval=7).state_dict())
    assert static.policy == ScalePolicy(growth_interval=7)


def test_torch_loads_a_static_checkpoint_with_its_default_factors() -> None:
    saved = ampscaler.GradScaler("cpu", init_scale=32.0, policy=StaticPolicy()).state_dict()
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    assert theirs.get_scale() == 32.0
    assert theirs.get_growth_interval() == 2000


def test_policy_with_its_shorthands_is_refused() -> None:
    with pytest.raises(ValueError, match="either policy= or"):
        ampscaler.GradScaler("cpu", policy=ScalePolicy(), hysteresis=2)
    with pytest.raises(ValueError, match="either policy= or"):
        ampscaler.GradScaler("cpu", 2.0**16, 4.0, policy=ScalePolicy())
    with pytest.raises(ValueError, match="either policy= or"):
        ampscaler.GradScaler("cpu", policy=StaticPolicy(), min_scale=1.0)


def test_a_policy_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="ScalePolicy or ampscaler.StaticPolicy"):
        ampscaler.GradScaler("cpu", policy={"hysteresis": 2})  # type: ignore[arg-type]


def test_torch_setters_change_the_dynamic_policy_and_refuse_a_static_one() -> None:
    scaler = ampscaler.GradScaler("cpu", policy=ScalePolicy(hysteresis=3))
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(9)
    assert scaler.policy == ScalePolicy(4.0, 0.25, 9, hysteresis=3)
    static = ampscaler.GradScaler("cpu", policy=StaticPolicy())
    assert static.get_growth_factor() == 2.0  # what its checkpoint says under torch's key
    with pytest.raises(RuntimeError, match="never moves"):
        static.set_growth_factor(4.0)


def test_policies_pickle_and_compare_by_value() -> None:
    for policy in (ScalePolicy(hysteresis=2, max_scale=2.0**20), StaticPolicy()):
        assert pickle.loads(pickle.dumps(policy)) == policy
    scaler = ampscaler.GradScaler("cpu", policy=StaticPolicy())
    assert pickle.loads(pickle.dumps(scaler)).policy == StaticPolicy()
