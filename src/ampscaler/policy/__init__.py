"""How the loss scale moves: the :class:`Policy` protocol and the built-in policies.

- :mod:`~ampscaler.policy.base`: the protocol (what the scaler needs of a policy), and writing a
  policy of one's own;
- :mod:`~ampscaler.policy.scale`: :class:`ScalePolicy` (torch's rule, with hysteresis and
  bounds) and :class:`StaticPolicy`;
- :mod:`~ampscaler.policy.headroom`: :class:`HeadroomPolicy` (the scale set from measured
  gradient magnitudes), and :mod:`~ampscaler.policy.meter`, which measures for it.

This module also turns a :class:`~ampscaler.GradScaler`'s arguments into a policy
(:func:`policy_from_arguments`), and holds the built-in policies by the name checkpoints know
them by (:data:`BUILT_IN`; the format itself is :mod:`ampscaler.checkpoint`'s).

Example:
    >>> import torch
    >>> policy = ScalePolicy(growth_interval=2, hysteresis=2)
    >>> state = policy.initial_state(1024.0, torch.device("cpu"))
    >>> policy.update_(state, torch.tensor(1.0))   # first overflow: budget absorbs it
    >>> policy.update_(state, torch.tensor(1.0))   # second overflow: back off
    >>> state.scale.item(), int(state.hysteresis_left)
    (512.0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..errors import InvalidConfigError
from .base import (
    FP16_MAX,
    LOWEST_SCALE,
    BasicState,
    Meter,
    Policy,
    PolicyState,
    PowerOfTwo,
    TorchRule,
    adjusted,
    check_scale,
    float32_value,
    pow2_exponent,
)
from .headroom import HeadroomPolicy, HeadroomState
from .scale import ScalePolicy, ScaleState, StaticPolicy

__all__ = [
    "BUILT_IN",
    "FP16_MAX",
    "LOWEST_SCALE",
    "BasicState",
    "HeadroomPolicy",
    "HeadroomState",
    "Meter",
    "Policy",
    "PolicyState",
    "PowerOfTwo",
    "ScalePolicy",
    "ScaleState",
    "StaticPolicy",
    "TorchRule",
    "adjusted",
    "check_scale",
    "float32_value",
    "policy_from_arguments",
    "pow2_exponent",
    "require_policy",
]

#: The built-in policies, by the name checkpoints know them by (a user's own policy is known
#: by the scaler that holds it).
BUILT_IN: dict[str, Policy] = {
    "ScalePolicy": ScalePolicy(),
    "StaticPolicy": StaticPolicy(),
    "HeadroomPolicy": HeadroomPolicy(),
}

_RULE_DEFAULTS = {rule.name: rule.default for rule in fields(ScalePolicy)}


def policy_from_arguments(policy: object, rule: Mapping[str, Any]) -> Policy:
    """The policy a :class:`~ampscaler.GradScaler` call asks for: ``policy=``, or else
    :class:`ScalePolicy` built from the shorthands ``rule`` (its fields, as given).

    Raises:
        InvalidConfigError: ``policy`` is not a :class:`Policy`, or is given together with
            shorthands that differ from their defaults; a shorthand out of range.
    """
    changed = [name for name, value in rule.items() if value != _RULE_DEFAULTS[name]]
    if policy is None:
        return ScalePolicy(**rule)
    chosen = require_policy(policy)
    if changed:
        raise InvalidConfigError(
            f"Pass either policy= or the policy's keyword arguments, not both: got "
            f"policy={chosen} and {', '.join(changed)}. Put them into the policy."
        )
    return chosen


def require_policy(value: object, also: str = "") -> Policy:
    """``value`` if it is a policy object.

    Raises:
        InvalidConfigError: anything else, naming what it got (``also`` adds to what is
            accepted).
    """
    if isinstance(value, Policy):
        return value
    accepted = "" if not also else f", {also}"
    raise InvalidConfigError(
        "policy must be an ampscaler.ScalePolicy or ampscaler.StaticPolicy, an "
        "ampscaler.HeadroomPolicy, or an object of your own subclass of ampscaler.Policy"
        f"{accepted}, got {type(value).__name__}."
    )
