"""The live state is created once and updated in place: its tensors keep their identity.

A compiled graph or a CUDA graph that captured ``scaler.scale(loss)`` (or a fused step handed
``grad_scale``) holds the scale tensor itself; if ``update()`` replaced the tensor, the graph
would keep multiplying by a stale scale. Checked here by identity and by value, against torch's
scaler run side by side.
"""

from __future__ import annotations

import pytest
import torch

import ampscaler
from ampscaler import ScalePolicy


def _live(scaler: ampscaler.GradScaler) -> tuple[torch.Tensor, ...]:
    state = scaler._state.live
    assert isinstance(state, ampscaler.state.LiveState)
    return (*state.tensors, state.counters._values)


def _step(scaler: ampscaler.GradScaler, model: torch.nn.Module, poison: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    if poison:
        model.bias.grad.fill_(float("nan"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


@pytest.mark.parametrize(
    "policy",
    [
        ScalePolicy(growth_interval=1),
        ScalePolicy(growth_interval=1, hysteresis=2, min_scale=1.0, max_scale=2.0**20),
    ],
)
def test_updates_setters_and_loads_keep_the_same_tensors(policy: ScalePolicy) -> None:
    model = torch.nn.Linear(2, 1)
    scaler = ampscaler.GradScaler("cpu", init_scale=1024.0, policy=policy)
    scaler.scale(torch.tensor(1.0))
    tensors = _live(scaler)
    for poison in [False, True, True, False, True]:
        _step(scaler, model, poison)
    scaler.update(new_scale=64.0)
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(3)
    scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=8.0).state_dict())
    assert all(a is b for a, b in zip(_live(scaler), tensors, strict=True))
    assert tensors[0].item() == 8.0  # the captured tensor holds the loaded value


def test_a_captured_scale_tensor_follows_every_update_like_torchs() -> None:
    """What torch's CUDA-graph test relies on: the tensor scale() multiplied by is the one
    update() writes, so a graph replaying ``loss * scale`` sees each new scale."""
    model = torch.nn.Linear(2, 1)
    ours = ampscaler.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2)
    ours.scale(torch.tensor(1.0))
    theirs.scale(torch.tensor(1.0))
    captured_ours, captured_theirs = ours._scale, theirs._scale
    for poison in [False, False, True, False, False, False, True]:
        _step(ours, model, poison)
        _step(theirs, model, poison)
        assert captured_ours is not None and captured_theirs is not None
        assert captured_ours.item() == captured_theirs.item() == ours.get_scale()


def test_counters_are_read_by_name() -> None:
    model = torch.nn.Linear(2, 1)
    scaler = ampscaler.GradScaler("cpu", init_scale=4.0)
    for poison in [False, True, True]:
        _step(scaler, model, poison)
    state = scaler._state.live
    assert isinstance(state, ampscaler.state.LiveState)
    assert int(state.counters.steps) == 3
    assert int(state.counters.consecutive_skips) == 2
    assert scaler.metrics("")["backoffs"] == 2


def test_before_the_first_scale_the_state_is_host_values_and_moves_to_the_device_once() -> None:
    scaler = ampscaler.GradScaler(init_scale=16.0)
    assert scaler._scale is None and scaler.get_scale() == 16.0
    scaler.load_state_dict({**scaler.state_dict(), "scale": 32.0, "_growth_tracker": 3})
    scaler.scale(torch.tensor(1.0))
    first = scaler._scale
    scaler.scale(torch.tensor(2.0))
    assert scaler._scale is first
    assert scaler.get_scale() == 32.0 and scaler._get_growth_tracker() == 3
