"""patch_torch / unpatch_torch in one process: torch's names build ampscaler's scalers with
torch's defaults and the settings; isinstance checks keep working; torch is restored exactly;
bad settings and contradicting calls are refused, changing nothing."""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import sharded_grad_scaler

import ampscaler
from ampscaler.integrations import patch

NAMES = [(module, name) for module, name, _ in patch._NAMES]


def current() -> dict[tuple[str, str], object]:
    return {
        (module, name): getattr(importlib.import_module(module), name, None)
        for module, name in NAMES
    }


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[dict[tuple[str, str], object]]:
    """Every test starts and ends with torch unpatched; yields torch's own objects."""
    originals = current()
    yield originals
    ampscaler.unpatch_torch()
    assert current() == originals


def test_every_name_builds_ampscalers_scaler_with_torchs_defaults() -> None:
    ampscaler.patch_torch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = {
            "amp": torch.amp.GradScaler("cpu"),
            "module": torch.amp.grad_scaler.GradScaler("cpu"),
            "cpu": torch.cpu.amp.GradScaler(init_scale=8.0),
            "cuda": torch.cuda.amp.GradScaler(),
            "default": torch.amp.GradScaler(),
            "sharded": sharded_grad_scaler.ShardedGradScaler("cpu", 4.0, 0.25),
        }
    messages = [str(w.message) for w in caught]
    assert any("torch.cpu.amp.GradScaler(args...)` is deprecated" in m for m in messages)
    assert any("torch.cuda.amp.GradScaler(args...)` is deprecated" in m for m in messages)
    assert all(isinstance(s, ampscaler.GradScaler) for s in built.values())
    assert isinstance(built["sharded"], ampscaler.ShardedGradScaler)
    assert built["sharded"].get_backoff_factor() == 0.25  # torch's argument order
    assert built["cpu"].get_scale() == 8.0 and built["cpu"].is_enabled()
    # torch's default device is "cuda": without CUDA, disabled (with torch's warning), as torch's
    cuda = torch.cuda.is_available()
    assert built["default"].is_enabled() == built["cuda"].is_enabled() == cuda
    with pytest.raises(TypeError):
        torch.amp.GradScaler("cpu", growth_intervall=3)  # a wrong call: torch's TypeError


def test_unpatch_restores_torchs_objects_and_both_are_idempotent(
    unpatched: dict[tuple[str, str], object],
) -> None:
    ampscaler.patch_torch(hysteresis=2)
    ampscaler.patch_torch(hysteresis=3)  # replaces the settings; the names stay patched once
    assert torch.amp.GradScaler("cpu").policy.hysteresis == 3
    patched = current()
    assert all(patched[key] is not unpatched[key] for key in unpatched if unpatched[key])
    ampscaler.unpatch_torch()
    ampscaler.unpatch_torch()
    assert all(current()[key] is unpatched[key] for key in unpatched)
    assert type(torch.amp.GradScaler("cpu")) is unpatched["torch.amp", "GradScaler"]


def test_isinstance_and_issubclass_hold_for_ours_and_for_torchs_made_before() -> None:
    theirs = torch.amp.GradScaler("cpu")
    theirs_sharded = sharded_grad_scaler.ShardedGradScaler("cpu")
    ampscaler.patch_torch()
    ours, ours_sharded = torch.amp.GradScaler("cpu"), ampscaler.ShardedGradScaler("cpu")
    standalone = ampscaler.GradScaler("cpu")
    amp, sharded = torch.amp.GradScaler, sharded_grad_scaler.ShardedGradScaler
    for scaler in (theirs, theirs_sharded, ours, ours_sharded, standalone):
        assert isinstance(scaler, amp) and issubclass(type(scaler), amp)
    for scaler in (theirs_sharded, ours_sharded):
        assert isinstance(scaler, sharded)
    for scaler in (theirs, ours, standalone):
        assert not isinstance(scaler, sharded)
    assert issubclass(torch.cuda.amp.GradScaler, amp) and issubclass(sharded, amp)
    assert not isinstance(ours, torch.cpu.amp.GradScaler)

    class FrameworkScaler(torch.amp.GradScaler):  # a subclass made while patched
        pass

    assert isinstance(FrameworkScaler("cpu"), amp) and not isinstance(ours, FrameworkScaler)


def test_settings_reach_every_scaler_and_stateful_ones_are_never_shared() -> None:
    made: list[ampscaler.StepHistory] = []
    configured: list[ampscaler.GradScaler] = []

    def history() -> ampscaler.StepHistory:
        made.append(ampscaler.StepHistory(4))
        return made[-1]

    ampscaler.patch_torch(
        device="cpu", init_scale=2.0**10, hysteresis=2, max_consecutive_skips=7,
        guards=[ampscaler.SpikeGuard, "ampscaler:SpikeGuard"], sinks=[history],
        configure=configured.append,
    )  # fmt: skip
    first, second = torch.amp.GradScaler(), sharded_grad_scaler.ShardedGradScaler()
    for scaler in (first, second):
        state = scaler.state_dict()
        assert repr(scaler).startswith(("GradScaler(device='cpu', scale=1024,",
                                        "ShardedGradScaler(device='cpu', scale=1024,"))  # fmt: skip
        assert state["hysteresis"] == 2 and state["max_consecutive_skips"] == 7
        assert len(json.loads(state["guards"])) == 2
    assert configured == [first, second]
    assert len(made) == 2 and made[0] is not made[1]  # a sink of its own for each scaler
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first.scale(model(torch.ones(1, 2)).sum()).backward()
    first.step(opt)
    first.update()
    firsts, seconds = made  # in the order the scalers were built
    assert len(firsts.records) == 1 and seconds.records == []
    assert first.state_dict()["guards"] != second.state_dict()["guards"]  # own windows


def test_a_call_that_contradicts_a_setting_is_refused() -> None:
    ampscaler.patch_torch(growth_interval=1000)
    assert torch.amp.GradScaler("cpu").get_growth_interval() == 1000  # fills in the default
    assert torch.amp.GradScaler("cpu", growth_interval=1000).get_growth_interval() == 1000
    with pytest.raises(ampscaler.InvalidConfigError, match=r"growth_interval=400\) was called"):
        sharded_grad_scaler.ShardedGradScaler(growth_interval=400)
    ampscaler.patch_torch(policy=ampscaler.HeadroomPolicy())
    with pytest.raises(ampscaler.InvalidConfigError, match="hysteresis=, min_scale="):
        sharded_grad_scaler.ShardedGradScaler("cpu", growth_interval=400)
    ampscaler.patch_torch(policy=ampscaler.ScalePolicy(growth_interval=400))
    assert sharded_grad_scaler.ShardedGradScaler("cpu", growth_interval=400).policy == (
        ampscaler.ScalePolicy(growth_interval=400)
    )
    ampscaler.patch_torch(device="cuda")
    with (
        pytest.raises(ampscaler.InvalidConfigError, match="device='cpu'"),
        pytest.warns(FutureWarning),
    ):
        torch.cpu.amp.GradScaler()


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"hysterisis": 2}, TypeError, "hysterisis"),
        ({"guards": [ampscaler.SpikeGuard()]}, TypeError, "factories"),
        ({"sinks": ampscaler.StepHistory}, TypeError, "list of factories"),
        ({"policy": ampscaler.ScalePolicy(), "hysteresis": 2}, ValueError, "either policy="),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"device": "gpu"}, ValueError, "not a torch device"),
        ({"configure": "ampscaler:no_such_thing"}, ValueError, "cannot be imported"),
        ({"policy": "ampscaler.GradScaler"}, ValueError, "not an import path"),
    ],
)
def test_bad_settings_are_refused_and_change_nothing(
    unpatched: dict[tuple[str, str], object], settings: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        ampscaler.patch_torch(**settings)
    assert current() == unpatched


def test_the_with_form_restores_what_was_before() -> None:
    with ampscaler.patch_torch(hysteresis=2) as outer:
        with ampscaler.patch_torch(hysteresis=3):
            assert torch.amp.GradScaler("cpu").policy.hysteresis == 3
        assert torch.amp.GradScaler("cpu").policy.hysteresis == 2
        assert outer.settings.hysteresis == 2
    assert type(torch.amp.GradScaler("cpu")).__module__ == "torch.amp.grad_scaler"


def test_a_patched_training_loop_is_bit_for_bit_torchs() -> None:
    """Code that builds torch's scaler trains the same with the patch in force, skips
    included."""

    def train() -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
        scales = []
        for step in range(6):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.full((2, 4), 10.0 ** (step % 3)))
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales, [p.detach().clone() for p in model.parameters()]

    theirs = train()
    with ampscaler.patch_torch():
        ours = train()
    assert ours[0] == theirs[0] and len(set(theirs[0])) > 2  # backed off and grew
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
