"""load_state_dict() under faults: all or nothing, and torch's value types taken as torch does.

A rejected state dict changes nothing: the scale tensor and its value, the growth tracker, the
policy and its settings, the skip limit, the counters and the guards are as before, whether the
state lives on the device yet or not (issue #27, items 3 and 4). Values that torch's scaler takes
from numpy and tensor-only converters (DCP, safetensors-style flattening) load here and train
bit for bit as torch's scaler does with them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import ampscaler
from user_policy import HalveOrDouble

# ---------------------------------------------------------------- all or nothing


def _target(live: bool, policy: ampscaler.Policy | None = None) -> ampscaler.GradScaler:
    """A scaler with state worth keeping: scale 8, interval 7, a guard, some counted steps."""
    kwargs: dict[str, Any] = {"policy": policy} if policy is not None else {"growth_interval": 7}
    scaler = ampscaler.GradScaler("cpu", init_scale=8.0, max_consecutive_skips=5, **kwargs)
    if live:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.step(opt)
            scaler.update()
    return scaler


def _everything(scaler: ampscaler.GradScaler) -> tuple[Any, ...]:
    """What a load could change: the whole state dict (scale, tracker, policy, limit, counters,
    guards), the policy object, and the identity of the live scale tensor."""
    return scaler.state_dict(), scaler.policy, scaler._scale


def _source(policy: ampscaler.Policy | None = None, **changes: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"policy": policy} if policy is not None else {"growth_interval": 99}
    saved = ampscaler.GradScaler("cpu", init_scale=1024.0, **kwargs).state_dict()
    for key, value in changes.items():
        section, _, name = key.partition(".")
        if name:
            saved[section] = {**saved[section], name: value}
        else:
            saved[key] = value
    return saved


REJECTED: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "growth tracker beyond int32": (
        lambda: _source(_growth_tracker=2**31),
        r"_growth_tracker must be >= 0 and <= 2\*\*31 - 1",
    ),
    "steps beyond int64": (
        lambda: _source(**{"stats.steps": 2**64}),
        r"stats\['steps'\] must be >= 0 and <= 2\*\*63 - 1",
    ),
    "hysteresis beyond int32": (
        lambda: _source(hysteresis=2**31),
        r"hysteresis must be >= 1 and <= 2\*\*31 - 1",
    ),
    "growth interval beyond int32": (
        lambda: _source(growth_interval=2**31),
        r"growth_interval must be >= 1 and <= 2\*\*31 - 1",
    ),
}


@pytest.mark.parametrize("live", [False, True], ids=["before-scale", "live"])
@pytest.mark.parametrize("case", list(REJECTED))
def test_a_rejected_state_dict_changes_nothing(case: str, live: bool) -> None:
    make, message = REJECTED[case]
    scaler = _target(live)
    scaler.attach(ampscaler.SpikeGuard(window=8))
    before = _everything(scaler)
    with pytest.raises(ampscaler.InvalidStateDictError, match=message):
        scaler.load_state_dict(make())
    after = _everything(scaler)
    assert after[0] == before[0] and after[1] == before[1] and after[2] is before[2]


@pytest.mark.parametrize("live", [False, True], ids=["before-scale", "live"])
def test_a_value_the_policys_own_tensors_cannot_hold_is_refused_before_anything_changes(
    live: bool,
) -> None:
    """A policy of one's own whose ``own_values`` checks less than its tensors need (here an
    int64 counter): the state is tried out on the CPU while validating, so the load is refused
    with the policy's name, not half done with torch's raw RuntimeError."""
    scaler = _target(live, HalveOrDouble(interval=3))
    before = _everything(scaler)
    saved = _source(HalveOrDouble(interval=9), **{"policy_state.overflows": 2**63})
    with pytest.raises(ampscaler.InvalidStateDictError, match="does not fit HalveOrDouble's state"):
        scaler.load_state_dict(saved)
    after = _everything(scaler)
    assert after[0] == before[0] and after[1] == before[1] and after[2] is before[2]


def test_a_guard_warning_turned_into_an_error_leaves_the_scaler_as_it_was() -> None:
    """Dropping a guard's state warns before anything changes, so a filter that turns the
    warning into an error (``-W error``, pytest's ``filterwarnings = error``) rejects the whole
    dict."""
    guarded = ampscaler.GradScaler("cpu", init_scale=1024.0, growth_interval=99)
    guarded.attach(ampscaler.SpikeGuard())
    scaler = _target(live=True)
    before = _everything(scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"the other 1 \(SpikeGuard\) is dropped"):
            scaler.load_state_dict(guarded.state_dict())
    after = _everything(scaler)
    assert after[0] == before[0] and after[1] == before[1] and after[2] is before[2]
    with pytest.warns(UserWarning, match="is dropped"):  # as a warning: loaded, guard dropped
        scaler.load_state_dict(guarded.state_dict())
    assert scaler.get_scale() == 1024.0 and scaler.get_growth_interval() == 99


# ---------------------------------------------------------------- torch's value types


def _train(scaler: Any, steps: int = 8) -> tuple[list[float], list[int], list[torch.Tensor]]:
    """A few steps with overflows at 1 and 5; the scales, growth trackers and parameters."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scales, trackers = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(3, 4, generator=gen)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step in (1, 5):
            model.bias.grad.fill_(float("inf"))  # type: ignore[union-attr]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
        trackers.append(int(scaler._get_growth_tracker()))
    return scales, trackers, [p.detach().clone() for p in model.parameters()]


def _assert_same_training(ours: Any, theirs: Any) -> None:
    (scales_a, trackers_a, params_a), (scales_b, trackers_b, params_b) = ours, theirs
    assert scales_a == scales_b
    assert trackers_a == trackers_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


LOADED: dict[str, dict[str, Any]] = {
    "scale as a 0-dim tensor": {"scale": torch.tensor(1024.0)},
    "scale as np.float32": {"scale": np.float32(1024.0)},
    "growth factor as np.float32": {"growth_factor": np.float32(1.5)},
    "growth interval as np.int64": {"growth_interval": np.int64(3)},
    "growth tracker 3.0": {"_growth_tracker": 3.0},
    "growth tracker as np.int64": {"_growth_tracker": np.int64(2)},
    "growth tracker as a tensor": {"_growth_tracker": torch.tensor(2)},
    "everything as tensors": {
        "scale": torch.tensor(512.0),
        "growth_factor": torch.tensor(4.0),
        "backoff_factor": torch.tensor(0.25),
        "growth_interval": torch.tensor(3),
        "_growth_tracker": torch.tensor(1),
    },
}


@pytest.mark.parametrize("live", [False, True], ids=["before-scale", "live"])
@pytest.mark.parametrize("case", list(LOADED))
def test_state_dict_values_torch_takes_load_and_train_as_in_torch(case: str, live: bool) -> None:
    results = []
    for factory in (ampscaler.GradScaler, torch.amp.GradScaler):
        scaler = factory("cpu", init_scale=2.0**10, growth_interval=2)
        if live:
            _train(scaler, steps=2)
        saved = {**torch.amp.GradScaler("cpu", growth_interval=4).state_dict(), **LOADED[case]}
        scaler.load_state_dict(saved)
        results.append(_train(scaler))
    _assert_same_training(*results)


CONSTRUCTED: dict[str, dict[str, Any]] = {
    "init_scale as np.float32": {"init_scale": np.float32(2048.0)},
    "init_scale as a 0-dim tensor": {"init_scale": torch.tensor(2048.0)},
    "growth_interval as np.int64": {"growth_interval": np.int64(2)},
    "factors as numpy": {"growth_factor": np.float64(3.0), "backoff_factor": np.float32(0.25)},
}


@pytest.mark.parametrize("case", list(CONSTRUCTED))
def test_constructor_values_torch_takes_build_a_scaler_that_trains_as_torchs(case: str) -> None:
    kwargs = {"growth_interval": 3, **CONSTRUCTED[case]}
    ours = ampscaler.GradScaler("cpu", **kwargs)
    theirs = torch.amp.GradScaler("cpu", **kwargs)
    assert ours.get_scale() == float(theirs.get_scale())
    _assert_same_training(_train(ours), _train(theirs))
    assert isinstance(ours.state_dict()["scale"], float)  # saved as a plain number


# ---------------------------------------------------------------- bounds and templates (item 6)


def test_growth_interval_is_bounded_by_the_int32_growth_tracker_everywhere() -> None:
    """torch's int32 growth tracker wraps after 2**31 - 1 clean steps; an interval beyond it
    would never be reached and the wrapped tracker would not load again. Refused wherever an
    interval comes in; at the bound itself, the tracker grows, resets and reloads."""
    bound = 2**31 - 1
    message = r"growth_interval must be >= 1 and <= 2\*\*31 - 1"
    with pytest.raises(ampscaler.InvalidConfigError, match=message):
        ampscaler.GradScaler("cpu", growth_interval=bound + 1)
    scaler = ampscaler.GradScaler("cpu", growth_interval=bound)
    for write in (scaler.set_growth_interval, lambda v: setattr(scaler, "_growth_interval", v)):
        with pytest.raises(ampscaler.InvalidConfigError, match=message):
            write(bound + 1)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": bound - 1})
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(opt)
    scaler.update()  # the 2**31 - 1st clean step: grows, the tracker back to 0
    assert scaler.get_scale() == 2.0**17 and scaler._get_growth_tracker() == 0
    ampscaler.GradScaler("cpu").load_state_dict(scaler.state_dict())


def _dcp_round_trip(saved: ampscaler.GradScaler, template: ampscaler.GradScaler, path: str) -> None:
    """``saved`` through torch.distributed.checkpoint into ``template`` (one process): DCP loads
    into the layout the template's state_dict() gives, then calls its load_state_dict()."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"scaler": saved}, checkpoint_id=path)
        dcp.load({"scaler": template}, checkpoint_id=path)


def test_a_dcp_template_without_the_headroom_section_is_refused(tmp_path: Any) -> None:
    """A HeadroomPolicy checkpoint loaded into a ScalePolicy scaler's template: DCP keeps only
    the template's keys, so the measurements are lost on the way; the dict still names its
    policy, and the load is refused instead of turning it into a ScalePolicy."""
    saved = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy())
    template = ampscaler.GradScaler("cpu", init_scale=8.0)
    before = _everything(template)
    with pytest.raises(ampscaler.InvalidStateDictError, match="holds no 'headroom' section"):
        _dcp_round_trip(saved, template, str(tmp_path / "headroom"))
    after = _everything(template)
    assert after[0] == before[0] and after[1] == before[1]
    same_policy = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy(margin=4.0))
    _dcp_round_trip(saved, same_policy, str(tmp_path / "headroom-again"))
    assert same_policy.policy == saved.policy  # the checkpoint's settings win


def test_guard_state_dropped_through_dcp_is_said_or_refused(tmp_path: Any) -> None:
    """The checkpoint's guard state has no guard to go to: DCP's load warns as a direct load
    does, and a filter that makes the warning an error rejects the whole load."""
    saved = ampscaler.GradScaler("cpu", init_scale=1024.0)
    saved.attach(ampscaler.SpikeGuard(window=16))
    template = ampscaler.GradScaler("cpu", init_scale=8.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="The checkpoint holds the state")
        with pytest.raises(UserWarning, match=r"\(SpikeGuard\) is dropped"):
            _dcp_round_trip(saved, template, str(tmp_path / "refused"))
    assert template.get_scale() == 8.0
    with pytest.warns(UserWarning, match=r"the state of the other 1 \(SpikeGuard\) is dropped"):
        _dcp_round_trip(saved, template, str(tmp_path / "said"))
    assert template.get_scale() == 1024.0
