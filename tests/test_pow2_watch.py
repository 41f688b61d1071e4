"""Pow2Watch against the real policy transition: it may only say ``exact`` when the scale is a
power of two at least ``2**-126``, and on the CPU (where its renewals land at once) it must say
so whenever that holds and the policy keeps powers of two."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampscaler.grads.pow2 import Pow2Watch, pow2_exponent
from ampscaler.policy import Policy, ScalePolicy, StaticPolicy, float32_value

CPU = torch.device("cpu")
POW2_GROWTH = st.sampled_from([2.0, 4.0, 2.0**10])
POW2_BACKOFF = st.sampled_from([0.5, 0.25, 2.0**-30])
EXPONENTS = st.integers(-149, 127)


def _watch(policy: Policy, device: torch.device) -> Pow2Watch:
    """A watch for ``policy``'s scale on ``device``, as the scaler's state makes one."""
    watch = Pow2Watch(policy.power_of_two)
    watch.use_device(device)
    return watch


@st.composite
def pow2_policies(draw: st.DrawFn) -> tuple[Policy, float]:
    low, start, high = sorted(draw(st.lists(EXPONENTS, min_size=3, max_size=3)))
    if not draw(st.booleans()):
        return StaticPolicy(), 2.0**start
    policy = ScalePolicy(
        growth_factor=draw(POW2_GROWTH),
        backoff_factor=draw(POW2_BACKOFF),
        growth_interval=draw(st.integers(1, 3)),
        hysteresis=draw(st.integers(1, 3)),
        min_scale=draw(st.sampled_from([None, 2.0**low])),
        max_scale=draw(st.sampled_from([None, 2.0**high])),
    )
    return policy, 2.0**start


def _truly_exact(scale: torch.Tensor) -> bool:
    exponent = pow2_exponent(float(scale))
    return exponent is not None and exponent >= -126


@settings(max_examples=120, deadline=None)
@given(setup=pow2_policies(), flags=st.lists(st.booleans(), min_size=1, max_size=400))
def test_exact_iff_the_scale_is_an_exactly_invertible_power_of_two(
    setup: tuple[Policy, float], flags: list[bool]
) -> None:
    policy, start = setup
    state = policy.initial_state(start, CPU)
    watch = _watch(policy, CPU)
    watch.saw(start)
    assert watch.exact == _truly_exact(state.scale)
    for overflow in flags:
        state = policy.adjust(state, torch.tensor(float(overflow)))
        watch.updated(state.scale)
        assert watch.exact == _truly_exact(state.scale), float(state.scale)


@settings(max_examples=80, deadline=None)
@given(
    setup=pow2_policies(),
    events=st.lists(
        st.one_of(
            st.booleans(),  # an update that overflowed or not
            st.floats(min_value=1e-30, max_value=1e30),  # a scale set by hand
            st.sampled_from([3.0, 2.0, 0.3, 0.5]),  # a new growth or backoff factor
        ),
        max_size=120,
    ),
)
def test_never_exact_when_the_scale_is_not_a_power_of_two(
    setup: tuple[Policy, float], events: list[object]
) -> None:
    drawn, start = setup
    rule = drawn if isinstance(drawn, ScalePolicy) else ScalePolicy()
    policy = ScalePolicy(growth_factor=rule.growth_factor, backoff_factor=rule.backoff_factor)
    state = policy.initial_state(start, CPU)
    watch = _watch(policy, CPU)
    watch.saw(start)
    for event in events:
        if isinstance(event, bool):
            state = policy.adjust(state, torch.tensor(float(event)))
            watch.updated(state.scale)
        elif event in (3.0, 2.0):
            policy = ScalePolicy(growth_factor=event, backoff_factor=policy.backoff_factor)
            watch.set_policy(policy.power_of_two)
        elif event in (0.3, 0.5):
            policy = ScalePolicy(growth_factor=policy.growth_factor, backoff_factor=event)
            watch.set_policy(policy.power_of_two)
        else:
            assert isinstance(event, float)
            state = state._replace(scale=torch.tensor(event, dtype=torch.float32))
            watch.saw(float32_value(event))
        if watch.exact:
            assert _truly_exact(state.scale), float(state.scale)


def test_following_the_updates_never_reads_the_scale() -> None:
    """Every update leaves the scale at or above the floor (2**-126), so a power of two stays
    exactly invertible however many backoffs there were: the watch never reads the scale (it
    read it twice in 200 updates while it kept a lower bound that had to be renewed)."""
    reads: list[float] = []

    class CountingScale(torch.Tensor):
        def tolist(self) -> Any:
            reads.append(1.0)
            return super().tolist()

    policy = ScalePolicy(growth_interval=1)
    watch = _watch(policy, CPU)
    watch.saw(2.0**16)
    state = policy.initial_state(2.0**16, CPU)
    for update in range(1, 200):
        state = policy.adjust(state, torch.tensor(float(update % 2)))
        watch.updated(state.scale.as_subclass(CountingScale))
        assert watch.exact
    assert reads == []


@pytest.mark.parametrize(
    ("policy", "drop"),
    [
        (ScalePolicy(), 1),
        (ScalePolicy(backoff_factor=0.25), 2),
        (StaticPolicy(), 0),
        (ScalePolicy(growth_factor=3.0), None),
        (ScalePolicy(backoff_factor=0.3), None),
        (ScalePolicy(min_scale=3.0), None),
        (ScalePolicy(max_scale=2.0**20, min_scale=2.0**-3), 1),
    ],
)
def test_which_policies_keep_powers_of_two(policy: Policy, drop: int | None) -> None:
    watch = _watch(policy, CPU)
    watch.saw(1024.0)
    assert watch.exact == (drop is not None)
    rule = policy.power_of_two
    assert (None if rule is None else rule.drop) == drop


def test_devices_without_a_way_to_renew_are_never_exact() -> None:
    watch = _watch(ScalePolicy(), torch.device("meta"))
    watch.saw(1024.0)
    assert not watch.exact


def test_a_changed_backoff_applies_only_to_later_updates() -> None:
    watch = _watch(ScalePolicy(backoff_factor=2.0**-30), CPU)
    watch.saw(2.0**120)
    scale = torch.tensor(2.0**100)
    for _ in range(4):  # bound: 120 - 4 * 30 = 0
        watch.updated(scale)
    watch.set_policy(ScalePolicy(backoff_factor=0.5).power_of_two)
    for _ in range(60):
        watch.updated(scale)
    assert watch.exact


def test_a_forgotten_watch_renews_from_a_copy_of_the_scale_on_the_cpu() -> None:
    """An update under torch.compile makes the watch forget; the next eager question reads a
    copy of the scale (free on the CPU) instead of answering from the stale bound."""
    policy = ScalePolicy()
    state = policy.initial_state(2.0**10, CPU)
    watch = _watch(policy, CPU)
    watch.saw(2.0**10)
    state.scale.fill_(3.0)  # moved behind the watch's back
    watch.forget(state.scale)
    assert not watch.exact  # 3.0: read from the copy, not from the old bound
    state.scale.fill_(2.0**-3)
    watch.forget(state.scale)
    assert watch.exact
