"""The scaler's ``state_dict``: its format, and its validation (all or nothing). The one place
that knows the format: the scaler's keys, and how a policy's settings and state are laid out.

A state dict holds torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``, ``_growth_tracker``) and ampscaler's own: ``policy`` (the policy's kind,
its class name) and what the policy saves of itself (:func:`policy_entries`), then
``max_consecutive_skips``, the counters (``stats``) and what the hooks save (the guards' state,
``guards``, one JSON string: see :meth:`ampscaler.guards.GuardSet.state_dict`).

A policy is saved from its dataclass fields and its own state values (beyond the scale and the
growth tracker): a policy of one's own in a ``policy_state`` section holding both. The built-in
policies keep the layout of ampscaler 0.1, so that older checkpoints load and a
``torch.distributed.checkpoint`` template of one finds its keys in another's: the rule's keys
beside torch's (``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic``,
``backoff_on_nonfinite_loss``) and the hysteresis budget ``_hysteresis_tracker``; a
:class:`~ampscaler.HeadroomPolicy` also a ``headroom`` section with its settings and
measurements. The built-in policies are known here by name (the ``policy`` key), never by type.

Torch's ``GradScaler.load_state_dict`` reads its five keys and ignores the rest, so ampscaler's
state loads into torch; a torch state dict loads here and leaves ampscaler's own options as
they were (the policy keeps its kind; a :class:`~ampscaler.ScalePolicy` takes torch's rule
numbers). Dicts saved by ampscaler 0.1.0 (without ``policy``) load too.

Loading validates everything before anything changes: a rejected dict leaves the scaler as it
was. Values are taken as torch takes them (``3``, ``3.0``, ``np.int64(3)`` or ``tensor(3)`` for a
counter; numpy or 0-dim tensor scalars for a scale or factor), and must fit the tensors they are
loaded into.

Example:
    >>> from ampscaler.policy import ScalePolicy
    >>> from ampscaler.state import HostState
    >>> saved = to_state_dict(
    ...     ScalePolicy(hysteresis=2), None, HostState(1024.0, 3, {"hysteresis_left": 2}), {}
    ... )
    >>> saved["scale"], saved["_growth_tracker"], saved["hysteresis"], saved["policy"]
    (1024.0, 3, 2, 'ScalePolicy')
    >>> loaded = from_state_dict(saved, ScalePolicy(), None)
    >>> loaded.policy.hysteresis, loaded.state.growth_tracker, loaded.state.own
    (2, 3, {'hysteresis_left': 2})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .arguments import check_skip_limit
from .errors import InvalidConfigError, InvalidStateDictError
from .policy import BUILT_IN, LOWEST_SCALE, Policy, TorchRule, float32_value
from .policy.base import check_switch, require_int, require_number
from .policy.derived import policy_fields, policy_name, rule_settings, torch_rule, with_fields
from .policy.scale import INT32_MAX
from .state import INT64_MAX, HostState, ScalerStats

__all__ = [
    "TORCH_KEYS",
    "Loaded",
    "from_state_dict",
    "policy_entries",
    "policy_from_state_dict",
    "to_state_dict",
]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

#: The section a policy's settings and own values are saved in (by default ``policy_state``).
_SECTIONS = {"HeadroomPolicy": "headroom"}
#: Settings a built-in policy gained since ampscaler 0.1, and the setting whose value an older
#: checkpoint's run had for it (a HeadroomPolicy's young history kept its one margin).
_ADDED_SINCE_0_1 = {"HeadroomPolicy": {"first_margin": "margin"}}


def to_state_dict(
    policy: Policy, limit: int | None, state: HostState, hooks: Mapping[str, Any]
) -> dict[str, Any]:
    """The state dict of a scaler with ``policy``, skip ``limit``, ``state`` (its own values
    complete) and what its hooks save (``guards``)."""
    return {
        "scale": state.scale,
        "_growth_tracker": state.growth_tracker,
        **torch_rule(policy)._asdict(),
        "policy": policy_name(policy),
        **policy_entries(policy, state.own),
        "max_consecutive_skips": limit,
        "stats": state.stats.as_dict(),
        **hooks,
    }


def policy_entries(policy: Policy, values: Mapping[str, Any]) -> dict[str, Any]:
    """What ``state_dict()`` holds for ``policy`` beyond torch's keys and its name, given its
    own state ``values`` (scale and growth tracker left out).

    Example:
        >>> from ampscaler.policy import ScalePolicy, StaticPolicy
        >>> policy_entries(StaticPolicy(), {})["dynamic"]
        False
        >>> policy_entries(ScalePolicy(hysteresis=2), {"hysteresis_left": 1})["_hysteresis_tracker"]
        1
    """
    name = policy_name(policy)
    section = {_SECTIONS.get(name, "policy_state"): {**policy_fields(policy), **values}}
    rule = rule_settings(policy)
    if rule is None:
        return section
    flat = {**rule, "_hysteresis_tracker": values.get("hysteresis_left", 1)}
    return {**flat, **section} if name in _SECTIONS else flat


def _legacy_kind(saved: Mapping[str, Any]) -> str | None:
    """The kind of policy a state dict without a ``policy`` key was saved with (ampscaler
    0.1.0's, which knew three); ``None`` for torch's own dict."""
    if "headroom" in saved:
        return "HeadroomPolicy"
    if "dynamic" not in saved:
        return None
    return "ScalePolicy" if check_switch("dynamic", saved["dynamic"]) else "StaticPolicy"


def policy_from_state_dict(
    saved: Mapping[str, Any], current: Policy
) -> tuple[Policy, dict[str, Any]]:
    """The policy a state dict restores, and its own state values (validated), for a scaler
    that holds ``current``; :func:`policy_entries`' counterpart.

    A dict names its policy under ``policy``; older ampscaler dicts are recognized by their
    keys. A policy of the same kind as ``current`` is restored through ``current`` (so a user's
    own policy restores), a built-in one through a default instance. Torch's own dict (only
    torch's keys) leaves ``current`` as it is, but for torch's rule numbers, which replace its
    fields of those names where it has all three (a :class:`~ampscaler.ScalePolicy`).

    Raises:
        InvalidConfigError: a policy this scaler cannot restore, or invalid values.
    """
    kind = saved.get("policy", _legacy_kind(saved))
    if kind is None:
        if not set(TorchRule._fields) <= set(policy_fields(current)):
            return current, {}
        rule = {name: saved[name] for name in TorchRule._fields}
        return dataclasses.replace(current, **rule), {}  # type: ignore[type-var]
    if not isinstance(kind, str):
        raise InvalidConfigError(f"policy must be the name of a policy, got {kind!r}.")
    current_kind = policy_name(current)
    prototype = current if kind == current_kind else BUILT_IN.get(kind)
    if prototype is None:
        raise InvalidConfigError(
            f"the checkpoint was saved by a scaler with policy {kind!r}, which this scaler "
            f"(policy {current_kind!r}) cannot make: construct the scaler with a {kind} before "
            "loading it."
        )
    if rule_settings(prototype) is not None and kind not in _SECTIONS:
        return _from_flat_keys(prototype, saved)
    section_name = _SECTIONS.get(kind, "policy_state")
    section = saved.get(section_name)
    if not isinstance(section, Mapping):
        raise InvalidConfigError(
            f"the checkpoint was saved with a {kind}, but holds no {section_name!r} section "
            f"with its settings (got {section!r}). When loading through a template "
            "(torch.distributed.checkpoint), make the template with a scaler constructed with "
            "the same policy, so that it has the section."
        )
    added = {new: section.get(old) for new, old in _ADDED_SINCE_0_1.get(kind, {}).items()}
    restored = with_fields(prototype, {**added, **section})
    own = {key: value for key, value in section.items() if key not in policy_fields(restored)}
    return restored, restored.own_values(own)


def _from_flat_keys(prototype: Policy, saved: Mapping[str, Any]) -> tuple[Policy, dict[str, Any]]:
    """A built-in policy saved without a section: its settings from torch's keys and the flat
    ones (``prototype``'s values where absent), and the hysteresis budget if it has one."""
    settings = policy_fields(prototype)
    restored = with_fields(prototype, {name: saved.get(name, v) for name, v in settings.items()})
    if "hysteresis" not in settings:
        return restored, {}
    hysteresis = policy_fields(restored)["hysteresis"]
    budget = require_int(
        "_hysteresis_tracker",
        saved.get("_hysteresis_tracker", hysteresis),
        0,
        hysteresis,
        integral_floats=True,
        meaning=" (the hysteresis)",
    )
    return restored, {"hysteresis_left": budget}


@dataclass(frozen=True)
class Loaded:
    """A validated state dict: the policy, skip limit and state it restores."""

    policy: Policy
    max_consecutive_skips: int | None
    state: HostState


_STAT_NAMES = [stat.name for stat in fields(ScalerStats)]
#: The counters every version's state_dict holds (later ones start at 0 when absent).
_FIRST_STATS = ("steps", "skipped", "growths", "backoffs", "consecutive_skips")


def _stats(counts: object) -> ScalerStats:
    if not isinstance(counts, Mapping):
        raise InvalidConfigError(f"stats must be a dict of counters, got {counts!r}.")
    unknown = [key for key in counts if key not in _STAT_NAMES]
    if unknown:
        raise InvalidConfigError(
            f"stats holds counters this version does not know: {unknown} (known: {_STAT_NAMES})."
        )
    values = {
        key: require_int(f"stats[{key!r}]", value, 0, INT64_MAX, integral_floats=True)
        for key, value in counts.items()
    }
    missing = [key for key in _FIRST_STATS if key not in counts]
    if missing:
        raise InvalidConfigError(
            f"stats lacks the counters {missing}, which every version saves: a dict missing "
            "them would start them again at 0. Load the dict state_dict() returned, or one "
            "without a 'stats' key to start every counter at 0."
        )
    return ScalerStats(**values)


def _saved_scale(policy: Policy, value: object) -> float:
    """The saved scale, validated by ``policy``; a scale of 0 or below ``2**-126`` (what
    torch's scaler saves after a collapse) is refused with what to do.

    Raises:
        InvalidConfigError: the scale is invalid.
    """
    number = float32_value(require_number("scale", value))
    try:
        return policy.check_scale("scale", value)
    except InvalidConfigError as error:
        if not 0.0 <= number < LOWEST_SCALE:
            raise
        raise InvalidConfigError(
            f"{error} torch's scaler saves such a scale after some 150 backoffs in a row (a "
            "collapsed run: its parameters are probably inf/NaN by now, since unscaling at "
            "such a scale turns finite gradients into inf/NaN). Load a checkpoint from before "
            "the collapse, or, to go on from this one, set its scale first "
            "(state_dict['scale'] = 65536.0)."
        ) from None


def _trial_state(policy: Policy, host: HostState) -> None:
    """Make ``policy``'s state tensors from ``host`` on the CPU, as loading will make them on
    the device, so that a value they cannot hold (an own value beyond its tensor's dtype, say,
    from a policy whose ``own_values`` checks less than its ``initial_state`` needs) is refused
    before anything changes.

    Raises:
        InvalidConfigError: naming the policy and torch's complaint.
    """
    try:
        policy.initial_state(host.scale, torch.device("cpu"), host.values())
    except (RuntimeError, ValueError, TypeError, OverflowError) as error:
        raise InvalidConfigError(
            f"the saved state does not fit {policy_name(policy)}'s state tensors ({error}); "
            f"saved values: {dict(host.values())!r:.200}."
        ) from error


def from_state_dict(saved: object, current: Policy, current_limit: int | None) -> Loaded:
    """Validate ``saved`` (torch's or ampscaler's state dict) for a scaler configured with
    ``current`` and ``current_limit``, which fill in what a torch state dict lacks.

    Raises:
        TypeError: ``saved`` is not a mapping.
        RuntimeError: an empty dict (saved from a disabled scaler).
        InvalidStateDictError: (a ``KeyError`` and a ``ValueError``) a dict that is not a
            scaler's, or holds invalid values; the message names the key.
    """
    if not isinstance(saved, Mapping):
        raise TypeError(
            f"load_state_dict() expects the dict returned by state_dict(), got "
            f"{type(saved).__name__}."
        )
    if len(saved) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled "
            "instance of GradScaler. Save the state of an enabled scaler, or skip loading."
        )
    missing = [key for key in TORCH_KEYS if key not in saved]
    if missing:
        raise InvalidStateDictError(
            f"This is not a GradScaler state dict: it lacks {missing}. Pass the dict "
            "returned by scaler.state_dict() (torch's or ampscaler's)."
        )
    try:
        policy, own = policy_from_state_dict(saved, current)
        limit = check_skip_limit(saved.get("max_consecutive_skips", current_limit))
        scale = _saved_scale(policy, saved["scale"])
        tracker = require_int(
            "_growth_tracker", saved["_growth_tracker"], 0, INT32_MAX, integral_floats=True
        )
        stats = _stats(saved["stats"]) if "stats" in saved else ScalerStats()
        host = HostState(scale, tracker, own, stats)
        _trial_state(policy, host)
        return Loaded(policy, limit, host)
    except (InvalidConfigError, TypeError, KeyError) as error:
        raise InvalidStateDictError(f"Invalid GradScaler state dict: {error}") from error
