"""Hypothesis strategies for scaler configurations, shared by the property and stateful tests."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from ampscaler.policy import Policy, ScalePolicy, StaticPolicy
from reference import RefConfig

# Scales from tiny to a hair below float32's maximum, where growth must stop short of inf.
SCALES = st.one_of(
    st.sampled_from([2.0**16, 1.0, 3.0e4, 0.1, 2.0**-20, 2.0**126, 3.0e38]),
    st.floats(min_value=1e-30, max_value=3.0e38, allow_subnormal=False),
)
GROWTH = st.one_of(
    st.sampled_from([2.0, 1.5, 3.0, 1.37]), st.floats(min_value=1.001, max_value=16.0)
)
BACKOFF = st.one_of(st.sampled_from([0.5, 0.25, 0.31]), st.floats(min_value=0.001, max_value=0.999))


@dataclass(frozen=True)
class Setup:
    """A policy, an initial scale inside its bounds, and the skip limit."""

    config: RefConfig
    init_scale: float
    max_consecutive_skips: int | None

    def scaler_kwargs(self) -> dict[str, object]:
        """Every keyword argument of ``ampscaler.GradScaler`` for this setup."""
        return {
            "init_scale": self.init_scale,
            "max_consecutive_skips": self.max_consecutive_skips,
            **self.config.scaler_kwargs(),
        }


@st.composite
def setups(draw: st.DrawFn, torch_compatible: bool = False, skip_limits: bool = True) -> Setup:
    """Any valid configuration; ``torch_compatible`` keeps to what torch's scaler can express."""
    growth_factor = draw(GROWTH)
    backoff_factor = draw(BACKOFF)
    growth_interval = draw(st.integers(1, 5))
    if torch_compatible:
        return Setup(RefConfig(growth_factor, backoff_factor, growth_interval), draw(SCALES), None)
    values = sorted(draw(st.lists(SCALES, min_size=3, max_size=3)))
    low, init_scale, high = values
    limit = draw(st.one_of(st.none(), st.integers(1, 4))) if skip_limits else None
    if not draw(st.booleans()):  # static: the dynamic rule's arguments do not apply
        return Setup(RefConfig(dynamic=False), init_scale, limit)
    config = RefConfig(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        hysteresis=draw(st.integers(1, 4)),
        min_scale=draw(st.sampled_from([None, low])),
        max_scale=draw(st.sampled_from([None, high])),
    )
    return Setup(config, init_scale, limit)


def policy_of(config: RefConfig) -> Policy:
    """The ampscaler policy object that ``config`` describes."""
    if not config.dynamic:
        return StaticPolicy()
    return ScalePolicy(**config.scaler_kwargs())  # type: ignore[arg-type]
