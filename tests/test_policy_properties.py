"""Random overflow patterns through the policy and a real GradScaler, against tests/reference.py.

Every combination of hysteresis, min/max scale, growth interval, factors and static mode; the
scale, growth tracker, hysteresis budget and counters must equal the reference after every
step. With torch's options only, torch.amp.GradScaler runs alongside and must agree too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ampscaler
from policy_strategies import Setup, policy_of, setups
from reference import RefConfig, Reference
from scaler_readings import counts

# None: a clean step; otherwise (parameter, value) written into one gradient element.
POISON = st.one_of(
    st.none(),
    st.none(),
    st.tuples(
        st.sampled_from(["weight", "bias"]),
        st.sampled_from([float("inf"), float("-inf"), float("nan")]),
    ),
)
PATTERNS = st.lists(POISON, min_size=1, max_size=30)


# Found by CI: torch's kernel path of adjust() backed off below the 2**-126 floor.
_TO_THE_FLOOR = Setup(RefConfig(backoff_factor=2.0**-9, growth_interval=1), 1e-30, None)


@settings(max_examples=150, deadline=None)
@given(setup=setups(skip_limits=False), pattern=st.lists(st.booleans(), max_size=60))
@example(setup=_TO_THE_FLOOR, pattern=[True, True, True])
def test_adjust_matches_reference(setup: Setup, pattern: list[bool]) -> None:
    policy = policy_of(setup.config)
    state = policy.initial_state(setup.init_scale, torch.device("cpu"))
    ref = Reference(setup.config, setup.init_scale)
    for overflow in pattern:
        before = state
        snapshot = [t.clone() for t in before]
        state = policy.adjust(state, torch.tensor(float(overflow)))
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot, strict=True))
        ref.adjust(overflow)
        assert float(state.scale) == ref.scale
        assert int(state.growth_tracker) == ref.tracker
        if setup.config.hysteresis > 1:
            assert int(state.hysteresis_left) == ref.budget
        low, high = ref.bounds()
        assert low <= ref.scale <= high


class _Rig:
    """A two-parameter model, its optimizer and one scaler, played one iteration at a time."""

    def __init__(self, factory: type, kwargs: dict[str, object], fused: bool) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 2)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01, fused=fused)
        self.scaler = factory("cpu", **kwargs)
        self.inputs = torch.linspace(-1.0, 1.0, 6).reshape(2, 3)

    def iterate(self, poison: tuple[str, float] | None) -> None:
        loss = self.model(self.inputs).pow(2).mean()
        self.scaler.scale(loss).backward()
        if poison is not None:
            name, value = poison
            getattr(self.model, name).grad.view(-1)[0] = value
        before = [p.detach().clone() for p in self.model.parameters()]
        self.scaler.step(self.optimizer)
        if poison is not None:
            after = list(self.model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        self.optimizer.zero_grad()


@settings(max_examples=60, deadline=None)
@given(setup=setups(), pattern=PATTERNS, fused=st.booleans())
def test_scaler_matches_reference(
    setup: Setup, pattern: list[tuple[str, float] | None], fused: bool
) -> None:
    rig = _Rig(ampscaler.GradScaler, setup.scaler_kwargs(), fused)
    ref = Reference(setup.config, setup.init_scale)
    limit = setup.max_consecutive_skips
    for poison in pattern:
        rig.iterate(poison)
        ref.update(overflow=poison is not None)
        if limit is not None and ref.stats["consecutive_skips"] >= limit:
            with pytest.raises(ampscaler.PersistentOverflowError):
                rig.scaler.update()
        else:
            rig.scaler.update()
        assert rig.scaler.last_step_skipped is (poison is not None)
        assert rig.scaler.get_scale() == ref.scale
        assert counts(rig.scaler).as_dict() == ref.stats
        saved = rig.scaler.state_dict()
        assert saved["_growth_tracker"] == ref.tracker
        if setup.config.hysteresis > 1:
            assert saved["_hysteresis_tracker"] == ref.budget


@settings(max_examples=40, deadline=None)
@given(setup=setups(torch_compatible=True), pattern=PATTERNS, fused=st.booleans())
def test_default_policy_matches_torch_and_reference(
    setup: Setup, pattern: list[tuple[str, float] | None], fused: bool
) -> None:
    kwargs = {
        "init_scale": setup.init_scale,
        "growth_factor": setup.config.growth_factor,
        "backoff_factor": setup.config.backoff_factor,
        "growth_interval": setup.config.growth_interval,
    }
    ours = _Rig(ampscaler.GradScaler, kwargs, fused)
    theirs = _Rig(torch.amp.GradScaler, kwargs, fused)
    ref = Reference(setup.config, setup.init_scale)
    for poison in pattern:
        for rig in (ours, theirs):
            rig.iterate(poison)
            rig.scaler.update()
        ref.update(overflow=poison is not None)
        assert ours.scaler.get_scale() == theirs.scaler.get_scale() == ref.scale
        assert ours.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker()
        assert ours.scaler._get_growth_tracker() == ref.tracker
        for mine, other in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
            assert torch.equal(mine, other)
