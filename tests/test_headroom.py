"""HeadroomPolicy: the pure transition against a reference model.

- ``adjust`` equals tests/headroom_reference.py after every update, for any configuration and
  any mix of overflows, measurements, non-finite measurements and unmeasured iterations;
  ``update_`` (in place, with its fast path) equals ``adjust``; neither modifies its input.
- A scripted sequence of measurements gives the scales worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampscaler
from ampscaler import HeadroomPolicy, ScalePolicy
from ampscaler.policy import HeadroomState, initial_state
from headroom_reference import FP16_MAX, HeadroomRef
from reference import f32

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------- the pure rule

POW2 = st.integers(-126, 127).map(lambda e: 2.0**e)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    """Any valid HeadroomPolicy configuration (its fields as keyword arguments)."""
    low, first, high = sorted(draw(st.lists(st.integers(-126, 127), min_size=3, max_size=3)))
    return {
        "margin": draw(st.one_of(st.sampled_from([1.0, 2.0, 1.5, 4.0]), st.floats(1.0, 1e6))),
        "history_length": draw(st.integers(1, 5)),
        "sample_every": draw(st.integers(1, 4)),
        "backoff_factor": draw(st.sampled_from([0.5, 0.25, 2.0**-10])),
        "recovery_interval": draw(st.integers(1, 4)),
        "first_scale": 2.0**first,
        "min_scale": draw(st.sampled_from([None, 2.0**low])),
        "max_scale": draw(st.sampled_from([None, 2.0**high])),
    }


# A measurement: none, a float32 magnitude from far below to beyond float16's range, or a
# non-finite one (what an overflowing backward measures).
MEASURED = st.one_of(
    st.none(),
    st.floats(2.0**-100, 1e5, width=32),
    st.sampled_from([0.0, FP16_MAX, 65536.0, math.inf, math.nan, -1.0]),
)
EVENTS = st.lists(st.tuples(st.booleans(), MEASURED), max_size=40)


def _ref_of(config: dict[str, object]) -> HeadroomRef:
    names = ("margin", "history_length", "backoff_factor", "recovery_interval", "first_scale")
    return HeadroomRef(
        **{name: config[name] for name in names},  # type: ignore[arg-type]
        min_scale=config["min_scale"],  # type: ignore[arg-type]
        max_scale=config["max_scale"],  # type: ignore[arg-type]
    )


def _assert_matches(state: HeadroomState, ref: HeadroomRef) -> None:
    assert float(state.scale) == ref.scale
    assert int(state.growth_tracker) == ref.tracker
    assert float(state.cap) == ref.cap
    assert float(state.target) == ref.target
    assert state.history.tolist() == ref.history
    assert int(state.measured) == ref.stored
    assert int(state.iteration) == ref.iteration


def _tensor(measured: float | None) -> torch.Tensor | None:
    return None if measured is None else torch.tensor(measured, dtype=torch.float32)


@settings(max_examples=150, deadline=None)
@given(config=configs(), events=EVENTS)
def test_adjust_and_update_match_the_reference(
    config: dict[str, object], events: list[tuple[bool, float | None]]
) -> None:
    policy = HeadroomPolicy(**config)  # type: ignore[arg-type]
    state = initial_state(policy, policy.first_scale, CPU)
    live = initial_state(policy, policy.first_scale, CPU)
    assert isinstance(state, HeadroomState) and isinstance(live, HeadroomState)
    identities = [id(t) for t in live]
    ref = _ref_of(config)
    for overflow, measured in events:
        before = [t.clone() for t in state]
        found = torch.tensor(float(overflow))
        moved = policy.adjust(state, found, _tensor(measured))
        assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True))  # pure
        policy.update_(live, found, _tensor(measured))
        ref.adjust(overflow, None if measured is None else f32(measured))
        _assert_matches(moved, ref)
        _assert_matches(live, ref)
        assert [id(t) for t in live] == identities  # in place
        low, high = policy.exponents
        exponent = math.frexp(ref.scale)[1] - 1
        assert ref.scale == 2.0**exponent and low <= exponent <= high  # a power of two
        state = moved


def test_a_scripted_sequence_of_measurements_gives_the_expected_scales() -> None:
    policy = HeadroomPolicy(margin=2.0, history_length=2, recovery_interval=3)
    state = initial_state(policy, 1.0, CPU)
    clean, overflow = torch.tensor(0.0), torch.tensor(1.0)
    scales = []
    # (found_inf, the largest gradient measured at the scale in force, None: not measured)
    script = [
        (clean, 1e-3),  # at scale 1: 65504 / (1e-3 * 2) = 32.75e6 -> 2**24
        (clean, 2**24 * 1e-3),  # the same gradient at 2**24: the same
        (clean, 2**24 * 3e-3),  # 3x larger (still below 65504 at 2**24): 2**23
        (clean, 2**23 * 1e-3),  # back to 1e-3, but 3e-3 is still in the history: 2**23
        (clean, 2**23 * 1e-3),  # 3e-3 has left the history (length 2): 2**24
        (clean, None),  # not measured: unchanged
        (overflow, None),  # the safety net: back off, cap at 2**23
        (clean, 2**23 * 1e-3),  # measured 2**24 again, but capped at 2**23
        (clean, None),
        (clean, None),  # three clean steps: the cap doubles to 2**24
        (clean, 2**24 * 3.5e-3),  # larger gradients: 2**23 before they can overflow
        (clean, 2**23 * float("inf")),  # a measurement that overflowed: back off to 2**22
    ]
    for found, measured in script:
        state = policy.adjust(state, found, _tensor(measured))
        scales.append(math.log2(float(state.scale)))
    assert scales == [24, 24, 23, 23, 24, 24, 23, 23, 23, 24, 23, 22]
    assert float(state.cap) == 2.0**22


def test_the_first_measurement_sets_the_scale_and_unmeasured_iterations_keep_it() -> None:
    policy = HeadroomPolicy(margin=1.0)
    state = initial_state(policy, 1.0, CPU)
    state = policy.adjust(state, torch.tensor(0.0))  # nothing measured yet: first_scale
    assert float(state.scale) == 1.0
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(65504.0 / 2**10))
    assert float(state.scale) == 2.0**10  # 2**10 * 63.97 = 65504: exactly at the limit
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(-1.0))  # measured nothing
    assert float(state.scale) == 2.0**10


def test_bounds_hold_and_a_non_float32_flag_takes_the_general_path() -> None:
    policy = HeadroomPolicy(min_scale=2.0**-2, max_scale=2.0**8, first_scale=2.0**4)
    state = initial_state(policy, 2.0**4, CPU)
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(1e-9))  # wants ~2**44
    assert float(state.scale) == 2.0**8
    for _ in range(20):
        policy.update_(state, torch.tensor(3.0, dtype=torch.float64))  # overflows, float64 flag
    assert float(state.scale) == 2.0**-2
    assert float(state.cap) == 2.0**-2


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"margin": 0.5}, ("margin", ">= 1")),
        ({"margin": float("nan")}, ("margin",)),
        ({"history_length": 0}, ("history_length", ">= 1")),
        ({"sample_every": 1.5}, ("sample_every", "int")),
        ({"recovery_interval": 0}, ("recovery_interval", ">= 1")),
        ({"backoff_factor": 0.3}, ("backoff_factor", "power of two")),
        ({"backoff_factor": 2.0}, ("backoff_factor", "below 1")),
        ({"first_scale": 1000.0}, ("first_scale", "2**e", "2.0**10")),
        ({"first_scale": 2.0**20, "max_scale": 2.0**10}, ("first_scale", "max_scale")),
        ({"min_scale": 2.0**4, "max_scale": 2.0**2}, ("min_scale", "max_scale")),
        ({"min_scale": 2.0**-140}, ("min_scale", "-126")),
        ({"max_scale": "big"}, ("max_scale", "number")),
    ],
)
def test_bad_configurations_are_refused_naming_the_argument(
    kwargs: dict[str, object], words: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as raised:
        HeadroomPolicy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(raised.value, ampscaler.InvalidConfigError)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_adjust_refuses_another_policys_state() -> None:
    with pytest.raises(TypeError, match="HeadroomState"):
        HeadroomPolicy().adjust(initial_state(ScalePolicy(), 1.0, CPU), torch.tensor(0.0))
