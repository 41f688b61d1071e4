"""What the scaler derives from a policy's dataclass fields: its name, its settings, torch's rule,
and whether its scale stays a power of two.

A policy class holds its state and its transition (:class:`~ampscaler.Policy`); everything
else the scaler needs of it is read from its fields here, so that a policy of one's own is a
dataclass and one method:

- **name**: the class name (``state_dict()["policy"]``);
- **settings**: the fields, as Python values; ranks compare them at every step, and checkpoints
  save them (the format is :mod:`ampscaler.checkpoint`'s);
- **torch's rule** (``get_growth_factor()`` & co., torch's checkpoint keys): the fields named
  ``growth_factor``, ``backoff_factor``, ``growth_interval``, torch's defaults for those it
  lacks (a :class:`~ampscaler.HeadroomPolicy` reports ``recovery_interval`` as its growth
  interval); ``set_growth_factor()`` & co. replace fields of those names, and are refused by a
  policy that has none;
- **powers of two**: an optional extra a policy may define (``power_of_two``; the built-in
  policies do), read here where present.

Example:
    >>> from ampscaler import ScalePolicy
    >>> policy = ScalePolicy(growth_interval=100)
    >>> policy_name(policy), torch_rule(policy).growth_interval
    ('ScalePolicy', 100)
    >>> with_rule(policy, "set_growth_interval", growth_interval=10).growth_interval
    10
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidConfigError, ScalerUsageError
from . import BUILT_IN
from .base import Policy, PowerOfTwo, TorchRule

__all__ = [
    "comparable",
    "policy_fields",
    "policy_name",
    "power_of_two",
    "rule_settings",
    "torch_rule",
    "with_fields",
    "with_rule",
]

#: Where a field of torch's rule lives in a built-in policy under another name (by its name).
_TORCH_ALIASES = {"HeadroomPolicy": {"growth_interval": "recovery_interval"}}


def policy_name(policy: Policy) -> str:
    """The name checkpoints know ``policy`` by: its class name."""
    return type(policy).__name__


def policy_fields(policy: Policy) -> dict[str, Any]:
    """``policy``'s settings: its dataclass fields, as Python values (none if it is not a
    dataclass)."""
    if not dataclasses.is_dataclass(policy):
        return {}
    return {field.name: getattr(policy, field.name) for field in dataclasses.fields(policy)}


def with_fields(policy: Policy, fields: Mapping[str, Any]) -> Policy:
    """A policy of ``policy``'s kind with the settings ``fields`` (from a checkpoint),
    validated by construction.

    Raises:
        InvalidConfigError: a setting is missing or invalid.
    """
    names = list(policy_fields(policy))
    missing = [name for name in names if name not in fields]
    if missing:
        raise InvalidConfigError(
            f"the checkpoint lacks the {policy_name(policy)} settings {missing}."
        )
    try:
        return type(policy)(**{name: fields[name] for name in names})
    except TypeError as error:
        raise InvalidConfigError(
            f"the {policy_name(policy)} settings do not fit: {error}."
        ) from error


def torch_rule(policy: Policy) -> TorchRule:
    """The rule torch's getters report and ``state_dict()`` saves under torch's keys."""
    aliases = _TORCH_ALIASES.get(policy_name(policy), {})
    fields = policy_fields(policy)
    named = {name: aliases.get(name, name) for name in TorchRule._fields}  # name -> its field
    return TorchRule(**{name: fields[field] for name, field in named.items() if field in fields})


def with_rule(policy: Policy, funcname: str, **changes: Any) -> Policy:
    """``policy`` with torch's rule numbers changed (``set_growth_factor()`` and friends), where
    it has fields of those names (validated by construction).

    Raises:
        ScalerUsageError: it has no such fields (the first line of its class docstring says
            what it does instead).
    """
    if all(name in policy_fields(policy) for name in changes):
        return dataclasses.replace(policy, **changes)  # type: ignore[type-var]
    what = (type(policy).__doc__ or "").strip().split("\n")[0].rstrip(".")
    raise ScalerUsageError(
        f"{funcname}() changes the dynamic rule, but this scaler's policy is {policy} ({what}), "
        "which has no growth rule to change; construct the scaler with the policy you want, "
        "or with policy=ScalePolicy(...) for torch's rule."
    )


def power_of_two(policy: Policy) -> PowerOfTwo | None:
    """How ``policy`` keeps a power-of-two scale one, where it says (an optional extra: the
    built-in policies have a ``power_of_two`` property), or ``None``: then unscaling is never
    assumed exact in float32 (the opt-in one-pass route takes torch's route)."""
    rule: PowerOfTwo | None = getattr(policy, "power_of_two", None)
    return rule


def rule_settings(policy: Policy) -> dict[str, Any] | None:
    """The rule's settings a built-in policy states whatever its kind (ampscaler 0.1's keys:
    ranks running different built-in policies name the numbers that differ, and a
    ``torch.distributed.checkpoint`` template of one finds them in another's); ``None`` for
    a policy of one's own.

    Example:
        >>> from ampscaler import StaticPolicy
        >>> rule_settings(StaticPolicy())["hysteresis"], rule_settings(StaticPolicy())["dynamic"]
        (1, False)
    """
    name = policy_name(policy)
    if name not in BUILT_IN:  # the built-in policies state them whatever their kind
        return None
    fields = policy_fields(policy)
    return {
        "hysteresis": fields.get("hysteresis", 1),
        "min_scale": fields.get("min_scale"),
        "max_scale": fields.get("max_scale"),
        "dynamic": name != "StaticPolicy",
        "backoff_on_nonfinite_loss": not policy.holds_on_nonfinite_loss,
    }


def comparable(policy: Policy) -> dict[str, Any]:
    """Everything ranks compare of ``policy``: torch's rule, its name, its settings."""
    return {
        **torch_rule(policy)._asdict(),
        "policy": policy_name(policy),
        **(rule_settings(policy) or {}),
        **policy_fields(policy),
    }
