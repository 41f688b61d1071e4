"""torch's private names and argument semantics, side by side with torch.amp.GradScaler.

Libraries reach for names torch's scaler has (Accelerate reads ``_growth_factor`` and calls
``_lazy_init_scale_growth_tracker``; torch's own tests read ``_per_optimizer_states`` and call
``_unscale_grads_``). Each must give what torch's gives.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import ampscaler

BOTH = [torch.amp.GradScaler, ampscaler.GradScaler]


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(scaler: Any, model: torch.nn.Module, poison: bool = False) -> None:
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    if poison:
        model.bias.grad[0] = float("inf")


@pytest.mark.parametrize("poison", [False, True])
def test_per_optimizer_states_after_unscale_and_step(poison: bool) -> None:
    seen = []
    for factory in BOTH:
        model, opt = _model_and_opt()
        scaler = factory("cpu")
        _backward(scaler, model, poison)
        assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"
        scaler.unscale_(opt)
        state = scaler._per_optimizer_states[id(opt)]
        flags = scaler._found_inf_per_device(opt)
        seen.append((state["stage"].name, {d.type: float(f) for d, f in flags.items()}))
        assert state["stage"] is torch.amp.grad_scaler.OptState.UNSCALED
        scaler.step(opt)
        assert scaler._per_optimizer_states[id(opt)]["stage"].name == "STEPPED"
        scaler.update()
        assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"
    assert seen[0] == seen[1]


@pytest.mark.parametrize("poison", [False, True])
def test_an_entry_taken_before_unscale_shows_what_unscale_and_step_did(poison: bool) -> None:
    """torch's entry is the dict its unscale_() and step() write into: code that takes it
    first (a SAM hook: the entry, then unscale_(), then its flags decide the first step) reads
    the flags unscale_() found, and an entry taken in an iteration keeps that iteration's end."""
    seen = []
    for factory in BOTH:
        model, opt = _model_and_opt()
        scaler = factory("cpu")
        _backward(scaler, model, poison)
        entry = scaler._per_optimizer_states[id(opt)]
        scaler.unscale_(opt)
        flags = {d.type: float(f) for d, f in entry["found_inf_per_device"].items()}
        unscaled = (entry["stage"].name, flags)
        scaler.step(opt)
        stepped = entry["stage"].name
        scaler.update()
        seen.append((unscaled, stepped, entry["stage"].name, len(entry["found_inf_per_device"])))
    assert seen[0] == seen[1] == (("UNSCALED", {"cpu": float(poison)}), "STEPPED", "STEPPED", 1)


def test_unscale_grads_gives_torchs_flags_and_gradients() -> None:
    results = []
    for factory in BOTH:
        model, opt = _model_and_opt()
        scaler = factory("cpu", init_scale=4.0)
        _backward(scaler, model, poison=True)
        found = torch.zeros(())
        flags = scaler._unscale_grads_(opt, torch.tensor(0.25), found, False)
        results.append(([p.grad.clone() for p in model.parameters()], flags))
        assert float(flags[torch.device("cpu")]) == 1.0 and float(found) == 0.0
    for mine, theirs in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())


def test_check_inf_per_device_checks_without_unscaling() -> None:
    for factory in BOTH:
        model, opt = _model_and_opt()
        scaler = factory("cpu", init_scale=4.0)
        _backward(scaler, model, poison=True)
        before = model.weight.grad.clone()
        flags = scaler._check_inf_per_device(opt)
        assert float(flags[torch.device("cpu")]) == 1.0
        assert torch.equal(model.weight.grad, before)
        assert float(next(iter(scaler._found_inf_per_device(opt).values()))) == 1.0


def test_check_inf_per_device_before_the_first_scale_raises_as_torchs() -> None:
    """A ``GradScaler("cpu")`` has its state from construction, but no iteration was scaled:
    torch's refuses with an AssertionError, as ampscaler's _check_scale_growth_tracker does
    (found by tests/test_fuzz_private.py)."""
    for factory in BOTH:
        model, opt = _model_and_opt()
        model(torch.ones(2, 3)).sum().backward()
        scaler = factory("cpu")
        with pytest.raises(AssertionError, match="_check_inf_per_device"):
            scaler._check_inf_per_device(opt)
        assert scaler._found_inf_per_device(opt) == {}


def test_lazy_init_makes_the_state_on_the_device() -> None:
    for factory in BOTH:
        scaler = factory(init_scale=8.0)  # no device yet (ours) / "cuda" default (torch)
        if not scaler.is_enabled():
            scaler = factory("cpu", init_scale=8.0)
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        assert scaler._scale is not None and scaler._scale.device.type == "cpu"
        assert scaler._scale.item() == 8.0 and scaler.get_scale() == 8.0


def test_rule_attributes_read_and_write_like_torchs() -> None:
    for factory in BOTH:
        scaler = factory("cpu", growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
        assert (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (
            4.0,
            0.25,
            7,
        )
        scaler._growth_factor = 3.0
        assert scaler.get_growth_factor() == 3.0
        assert scaler._init_scale == 2.0**16 and scaler._enabled is True
    ours = ampscaler.GradScaler("cpu")
    with pytest.raises(ValueError, match="growth_factor"):
        ours._growth_factor = 0.5  # validated as set_growth_factor() is


def test_init_scale_follows_a_loaded_checkpoint() -> None:
    for factory in BOTH:
        scaler = factory("cpu")
        scaler.load_state_dict({**factory("cpu", init_scale=32.0).state_dict()})
        assert scaler._init_scale == 32.0


@pytest.mark.parametrize("value", [1, 0, np.bool_(True), "yes", ""])
def test_enabled_takes_any_truthy_value_like_torch(value: object) -> None:
    ours = ampscaler.GradScaler("cpu", enabled=value)  # type: ignore[arg-type]
    theirs = torch.amp.GradScaler("cpu", enabled=value)  # type: ignore[arg-type]
    assert ours.is_enabled() is bool(value) and bool(theirs.is_enabled()) is bool(value)
    assert ours.scale(torch.tensor(1.0)).item() == theirs.scale(torch.tensor(1.0)).item()


def _lbfgs_with_positional_closure(factory: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    scaler = factory("cpu", init_scale=1.0)
    inputs = torch.randn(8, 3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(inputs).pow(2).mean()
        loss.backward()
        return loss

    scaler.scale(model(inputs).pow(2).mean()).backward()
    scaler.step(opt, closure)
    scaler.update()
    return [p.detach().clone() for p in model.parameters()]


def test_a_positional_closure_goes_to_the_optimizer_like_torchs() -> None:
    """scaler.step(lbfgs, closure): torch runs the closure through optimizer.step."""
    ours, theirs = (_lbfgs_with_positional_closure(factory) for factory in BOTH[::-1])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(ours, _untrained(), strict=True))


def _untrained() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in torch.nn.Linear(3, 1).parameters()]


def _floored_run(factory: Any) -> tuple[list[float], dict[str, Any], list[torch.Tensor]]:
    """Training code that keeps the scale at a floor of its own by assigning ``_scale`` (a
    pattern of several public training scripts), with overflows at steps 1 and 2."""
    model, opt = _model_and_opt()
    scaler = factory("cpu", init_scale=256.0)
    scales = []
    for step in range(4):
        opt.zero_grad()
        _backward(scaler, model, poison=step in (1, 2))
        scaler.step(opt)
        scaler.update()
        if scaler._scale < 200:
            scaler._scale = torch.tensor(200.0).to(scaler._scale)
        scales.append(scaler.get_scale())
    return scales, scaler.state_dict(), [p.detach().clone() for p in model.parameters()]


def test_assigning_the_scale_sets_its_value_as_torchs_assignment_does() -> None:
    (torch_scales, torch_saved, torch_params), (scales, saved, params) = map(_floored_run, BOTH)
    assert scales == torch_scales == [256.0, 200.0, 200.0, 200.0]
    assert {key: saved[key] for key in torch_saved} == torch_saved
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params, strict=True))
    # The counters still see both backoffs: each iteration ended before the assignment.
    assert saved["stats"]["backoffs"] == saved["stats"]["skipped"] == 2


def test_assigning_the_state_before_saving_is_saved_as_torchs() -> None:
    saved = []
    for factory in BOTH:
        scaler = factory("cpu")
        scaler._scale = torch.tensor(32768.0)
        scaler._growth_tracker = torch.tensor(5)
        saved.append(scaler.state_dict())
        disabled = factory("cpu", enabled=False)
        disabled._scale = torch.tensor(1024.0)  # a disabled scaler never uses it
        assert disabled.state_dict() == {}
    theirs, ours = saved
    assert {key: ours[key] for key in theirs} == theirs
    assert (theirs["scale"], theirs["_growth_tracker"]) == (32768.0, 5)


def test_the_live_scale_keeps_its_identity_when_assigned() -> None:
    scaler = ampscaler.GradScaler("cpu")
    live = scaler._scale
    scaler._scale = 8.0
    assert scaler._scale is live and live.item() == 8.0


@pytest.mark.parametrize(
    ("name", "value", "wrong"),
    [
        ("_scale", 0.0, "_scale must be"),
        ("_scale", float("inf"), "_scale must be"),
        ("_scale", torch.ones(2), "_scale must be a real number"),
        ("_growth_tracker", -1, "_growth_tracker must be >= 0"),
        ("_growth_tracker", 1.5, "_growth_tracker must be an int"),
    ],
)
def test_assigning_a_value_the_state_cannot_hold_is_refused_and_changes_nothing(
    name: str, value: object, wrong: str
) -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=64.0)
    before = scaler.state_dict()
    with pytest.raises(ampscaler.InvalidConfigError, match=wrong):
        setattr(scaler, name, value)
    assert scaler.state_dict() == before


def _started_run(scaler: Any) -> tuple[list[float], dict[str, Any], list[torch.Tensor]]:
    """Code that chooses where its run starts by assigning torch's ``_init_scale`` and
    ``_init_growth_tracker`` after construction, before the first ``scale()`` (torch reads
    them only then); three iterations, the second overflowing."""
    scaler._init_scale = 32.0
    scaler._init_growth_tracker = 1
    before = scaler.get_scale()
    model, opt = _model_and_opt()
    scales = [before]
    for step in range(3):
        opt.zero_grad()
        _backward(scaler, model, poison=step == 1)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, scaler.state_dict(), [p.detach().clone() for p in model.parameters()]


def test_assigning_where_the_run_starts_before_it_starts_is_where_it_starts() -> None:
    (torch_scales, torch_saved, torch_params), (scales, saved, params) = map(
        _started_run, [factory("cpu", growth_interval=2) for factory in BOTH]
    )
    assert scales == torch_scales == [32.0, 64.0, 32.0, 32.0]  # grew at once: tracker 1 of 2
    assert {key: saved[key] for key in torch_saved} == torch_saved
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params, strict=True))


def test_assigning_where_the_run_starts_after_it_started_keeps_it_and_sets_nothing() -> None:
    """As torch's own load_state_dict() does (and a subclass's copy of it): the value is kept,
    and the live tensors are what it fills beside it."""
    for factory in BOTH:
        scaler = factory("cpu")
        model, opt = _model_and_opt()
        _backward(scaler, model)
        scaler.step(opt)
        scaler.update()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler._init_scale = 8.0
        assert scaler._init_scale == 8.0 and scaler.get_scale() == 2.0**16
        scaler._scale.fill_(8.0)  # what torch's load_state_dict() does next
        assert scaler.get_scale() == 8.0


@pytest.mark.parametrize(
    ("name", "value", "wrong"),
    [
        ("_init_scale", 0.0, "_init_scale must be"),
        ("_init_scale", "big", "_init_scale must be a real number"),
        ("_init_growth_tracker", -1, "_init_growth_tracker must be >= 0"),
    ],
)
def test_a_start_the_state_cannot_hold_is_refused_and_changes_nothing(
    name: str, value: object, wrong: str
) -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=64.0)
    with pytest.raises(ampscaler.InvalidConfigError, match=wrong):
        setattr(scaler, name, value)
    assert (scaler.get_scale(), scaler._init_scale, scaler._init_growth_tracker) == (64.0, 64.0, 0)


def test_a_disabled_scaler_keeps_the_start_it_is_given_and_never_uses_it() -> None:
    for factory in BOTH:
        scaler = factory("cpu", enabled=False)
        scaler._init_scale = 32.0
        assert (scaler._init_scale, scaler.get_scale()) == (32.0, 1.0)
