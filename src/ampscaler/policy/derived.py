"""What the scaler derives from a policy's dataclass fields: its name, its settings, torch's rule,
its checkpoint entries, and whether its scale stays a power of two.

A policy class holds its state and its transition (:class:`~ampscaler.Policy`); everything
else the scaler needs of it is read from its fields here, so that a policy of one's own is a
dataclass and one method:

- **name**: the class name (``state_dict()["policy"]``);
- **settings**: the fields, as Python values; ranks compare them at every step;
- **torch's rule** (``get_growth_factor()`` & co., torch's checkpoint keys): the fields named
  ``growth_factor``, ``backoff_factor``, ``growth_interval``, torch's defaults for those it
  lacks (a :class:`~ampscaler.HeadroomPolicy` reports ``recovery_interval`` as its growth
  interval); ``set_growth_factor()`` & co. replace fields of those names, and are refused by a
  policy that has none;
- **checkpoint entries**: a ``policy_state`` section with the fields and the policy's own state
  values. The built-in policies keep the layout of ampscaler 0.1 (the rule's keys beside
  torch's, a :class:`~ampscaler.HeadroomPolicy`'s section named ``headroom``), so that older
  checkpoints load;
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
from .base import Policy, PowerOfTwo, TorchRule
from .headroom import HeadroomPolicy
from .scale import INT32_MAX, ScalePolicy, StaticPolicy, saved_int

__all__ = [
    "checkpoint_entries",
    "comparable",
    "compared_settings",
    "from_checkpoint",
    "from_torch_dict",
    "policy_fields",
    "policy_name",
    "power_of_two",
    "torch_rule",
    "with_fields",
    "with_rule",
]

#: Where a field of torch's rule lives in a built-in policy under another name.
_TORCH_ALIASES: dict[type[Policy], dict[str, str]] = {
    HeadroomPolicy: {"growth_interval": "recovery_interval"},
}
#: Settings a built-in policy gained since ampscaler 0.1, and the setting whose value an older
#: checkpoint's run had for it (a HeadroomPolicy's young history kept its one margin).
_ADDED_SINCE_0_1: dict[type[Policy], dict[str, str]] = {
    HeadroomPolicy: {"first_margin": "margin"},
}
#: The built-in policies that save the rule's keys beside torch's (ampscaler 0.1's layout).
_FLAT: tuple[type[Policy], ...] = (
    ScalePolicy,
    StaticPolicy,
    HeadroomPolicy,
)
#: The section a policy's settings and own values are saved in (by default ``policy_state``).
_SECTIONS: dict[type[Policy], str] = {
    HeadroomPolicy: "headroom",
}


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
    aliases = _TORCH_ALIASES.get(type(policy), {})
    fields = policy_fields(policy)
    found = {
        name: fields[aliases.get(name, name)]
        for name in TorchRule._fields
        if aliases.get(name, name) in fields
    }
    return TorchRule(**found)


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


def _flat_settings(policy: Policy) -> dict[str, Any]:
    """The rule's keys every built-in policy saves beside torch's (ampscaler 0.1's layout), so
    that a ``torch.distributed.checkpoint`` template of one finds them in another's."""
    fields = policy_fields(policy)
    return {
        "hysteresis": fields.get("hysteresis", 1),
        "min_scale": fields.get("min_scale"),
        "max_scale": fields.get("max_scale"),
        "dynamic": not isinstance(policy, StaticPolicy),
        "backoff_on_nonfinite_loss": not policy.holds_on_nonfinite_loss,
    }


def compared_settings(policy: Policy) -> dict[str, Any]:
    """The settings ranks compare before they agree (beside torch's rule and the name), each a
    Python number, string, bool or ``None``."""
    if not isinstance(policy, _FLAT):
        return policy_fields(policy)
    own = {}
    if type(policy) in _SECTIONS:
        section = _SECTIONS[type(policy)]
        own = {f"{section}.{name}": value for name, value in policy_fields(policy).items()}
    return {**_flat_settings(policy), **own}


def comparable(policy: Policy) -> dict[str, Any]:
    """Everything ranks compare of ``policy``: torch's rule, its name, its settings."""
    return {
        **torch_rule(policy)._asdict(),
        "policy": policy_name(policy),
        **compared_settings(policy),
    }


def checkpoint_entries(policy: Policy, values: Mapping[str, Any]) -> dict[str, Any]:
    """What ``state_dict()`` holds for ``policy`` beyond torch's keys, given its own state
    ``values`` (scale and growth tracker left out)."""
    section = _SECTIONS.get(type(policy), "policy_state")
    if not isinstance(policy, _FLAT):
        return {section: {**policy_fields(policy), **values}}
    entries = {**_flat_settings(policy), "_hysteresis_tracker": values.get("hysteresis_left", 1)}
    if type(policy) in _SECTIONS:
        entries[section] = {**policy_fields(policy), **values}
    return entries


def from_checkpoint(policy: Policy, saved: Mapping[str, Any]) -> tuple[Policy, dict[str, Any]]:
    """The policy of ``policy``'s kind and its own state values that ``saved`` (a state dict
    naming that kind) restores, validated; :func:`checkpoint_entries`' counterpart.

    Raises:
        InvalidConfigError: the section is missing or holds invalid values.
    """
    if isinstance(policy, ScalePolicy):
        return _scale_policy(policy, saved)
    if isinstance(policy, StaticPolicy):
        return StaticPolicy(), {}
    name = _SECTIONS.get(type(policy), "policy_state")
    section = saved.get(name)
    if not isinstance(section, Mapping):
        raise InvalidConfigError(
            f"the checkpoint was saved with a {policy_name(policy)}, but holds no {name!r} "
            f"section with its settings (got {section!r}). When loading through a template "
            "(torch.distributed.checkpoint), make the template with a scaler constructed with "
            f"the same policy, so that it has the section."
        )
    restored = with_fields(policy, {**_added_since_0_1(policy, section), **section})
    own = {key: value for key, value in section.items() if key not in policy_fields(restored)}
    return restored, restored.own_values(own)


def _scale_policy(current: ScalePolicy, saved: Mapping[str, Any]) -> tuple[Policy, dict[str, Any]]:
    """The rule from torch's keys, and from ampscaler's where present (``current``'s values
    where not), and the hysteresis budget."""
    fields = policy_fields(current)
    restored = ScalePolicy(**{name: saved.get(name, value) for name, value in fields.items()})
    budget = saved_int(
        "_hysteresis_tracker",
        saved.get("_hysteresis_tracker", restored.hysteresis),
        0,
        INT32_MAX,
    )
    if budget > restored.hysteresis:
        raise InvalidConfigError(
            f"_hysteresis_tracker must not exceed hysteresis ({restored.hysteresis}), got {budget}."
        )
    return restored, {"hysteresis_left": budget}


def _added_since_0_1(policy: Policy, section: Mapping[str, Any]) -> dict[str, Any]:
    """Settings added since ampscaler 0.1, with the values an older checkpoint's run had."""
    return {new: section.get(old) for new, old in _ADDED_SINCE_0_1.get(type(policy), {}).items()}


def from_torch_dict(policy: Policy, saved: Mapping[str, Any]) -> Policy:
    """The policy after loading torch's own state dict (only torch's five keys): torch's rule
    numbers replace the fields of those names, where ``policy`` has them (a
    :class:`~ampscaler.ScalePolicy`); any other policy stays as constructed."""
    if not isinstance(policy, ScalePolicy):
        return policy
    return dataclasses.replace(policy, **{name: saved[name] for name in TorchRule._fields})
