"""The scaler's ``state_dict``: its format, its validation, and interchange with torch.

A state dict holds torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``, ``_growth_tracker``) and ampscaler's own: the rest of the policy
(``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic``), the hysteresis budget
(``_hysteresis_tracker``), ``max_consecutive_skips``, the counters (``stats``) and the guards'
state (``guards``, one JSON string: see :meth:`ampscaler.guards.GuardSet.state_dict`). Torch's
``GradScaler.load_state_dict`` reads its five keys and ignores the rest, so ampscaler's state
loads into torch; a torch state dict loads here and leaves ampscaler's own options as they were.

A :class:`~ampscaler.policy.StaticPolicy` is saved as ``dynamic: False`` with torch's default
factors under torch's keys (torch's scaler has no static mode; it needs the keys).

A :class:`~ampscaler.HeadroomPolicy` adds one key, ``headroom``: its configuration and its own
state (``target``, ``history``, ``measured``, ``iteration``), so a resumed run measures and
scales exactly as the uninterrupted one. Under torch's keys it saves ``growth_interval =
recovery_interval`` and its ``backoff_factor`` (torch's scaler, loading it, grows as rarely as
the policy recovers from an overflow). A dict without ``headroom`` (torch's, or one saved with
another policy) loaded into a scaler with a HeadroomPolicy: torch's leaves the policy as
constructed, with nothing measured yet; ampscaler's replaces it, as any ampscaler dict does.

Example:
    >>> from ampscaler.policy import ScalePolicy
    >>> from ampscaler.state import HostState
    >>> saved = to_state_dict(ScalePolicy(hysteresis=2), None, HostState(1024.0, 3, 2))
    >>> saved["scale"], saved["_growth_tracker"], saved["hysteresis"]
    (1024.0, 3, 2)
    >>> loaded = from_state_dict(saved, ScalePolicy(), None)
    >>> loaded.policy.hysteresis, loaded.state.growth_tracker
    (2, 3)
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .distributed import RankAgreement
from .errors import InvalidConfigError, InvalidStateDictError, ScalerUsageError
from .guards import GuardSet
from .observe.api import StepOutcome
from .policy import (
    HEADROOM_FIELDS,
    HeadroomPolicy,
    Policy,
    ScalePolicy,
    StaticPolicy,
    float32_value,
    initial_state,
    torch_rule,
)
from .state import HostState, LiveState, ScalerStats

__all__ = [
    "TORCH_KEYS",
    "CheckpointMethods",
    "Loaded",
    "check_skip_limit",
    "from_state_dict",
    "headroom_settings",
    "policy_settings",
    "to_state_dict",
]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def check_skip_limit(limit: object) -> int | None:
    """Validate ``max_consecutive_skips``: an int >= 1, or ``None`` for no limit."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidConfigError(
            f"max_consecutive_skips must be an int >= 1 or None, got {limit!r}."
        )
    return limit


def policy_settings(policy: Policy, limit: int | None) -> dict[str, float | int | bool | None]:
    """The configuration part of a state dict (also what ranks compare before agreeing)."""
    rule = torch_rule(policy)
    return {
        "growth_factor": rule.growth_factor,
        "backoff_factor": rule.backoff_factor,
        "growth_interval": rule.growth_interval,
        "hysteresis": rule.hysteresis,
        "min_scale": rule.min_scale,
        "max_scale": rule.max_scale,
        "dynamic": not isinstance(policy, StaticPolicy),
        "max_consecutive_skips": limit,
    }


def _headroom_config(policy: HeadroomPolicy) -> dict[str, float | int | None]:
    return {f.name: getattr(policy, f.name) for f in fields(policy)}


def headroom_settings(policy: Policy) -> dict[str, float | int | None]:
    """A HeadroomPolicy's own configuration, as ranks compare it (empty for other policies)."""
    if not isinstance(policy, HeadroomPolicy):
        return {}
    return {f"headroom.{name}": value for name, value in _headroom_config(policy).items()}


def to_state_dict(policy: Policy, limit: int | None, state: HostState) -> dict[str, Any]:
    """The state dict of a scaler with ``policy``, skip ``limit`` and ``state``."""
    saved: dict[str, Any] = {
        "scale": state.scale,
        "_growth_tracker": state.growth_tracker,
        "_hysteresis_tracker": state.hysteresis_left,
        **policy_settings(policy, limit),
        "stats": state.stats.as_dict(),
    }
    if isinstance(policy, HeadroomPolicy):
        extra = state.extra or _fresh_headroom(policy, state.scale)
        saved["headroom"] = {**_headroom_config(policy), **extra}
    return saved


def _fresh_headroom(policy: HeadroomPolicy, scale: float) -> dict[str, Any]:
    """A HeadroomPolicy's own state before anything was measured (at ``scale``)."""
    live = initial_state(policy, scale, torch.device("cpu"))
    values = live._asdict()
    return {name: values[name].tolist() for name in HEADROOM_FIELDS}


@dataclass(frozen=True)
class Loaded:
    """A validated state dict: the policy, skip limit and state it restores."""

    policy: Policy
    max_consecutive_skips: int | None
    state: HostState


def _headroom_section(saved: Mapping[str, Any]) -> Mapping[str, Any] | None:
    section = saved.get("headroom")
    if section is not None and not isinstance(section, Mapping):
        raise InvalidConfigError(f"headroom must be a dict, got {section!r}.")
    return section


def _loaded_policy(saved: Mapping[str, Any], current: Policy) -> Policy:
    section = _headroom_section(saved)
    if section is not None:
        names = [f.name for f in fields(HeadroomPolicy)]
        missing = [name for name in names if name not in section]
        if missing:
            raise InvalidConfigError(f"headroom lacks {missing}.")
        return HeadroomPolicy(**{name: section[name] for name in names})
    if isinstance(current, HeadroomPolicy) and "dynamic" not in saved:
        return current  # torch's dict: ampscaler's own options stay as constructed
    dynamic = saved.get("dynamic", isinstance(current, ScalePolicy))
    if not isinstance(dynamic, bool):
        raise InvalidConfigError(f"dynamic must be True or False, got {dynamic!r}.")
    if not dynamic:
        return StaticPolicy()
    rule = current if isinstance(current, ScalePolicy) else ScalePolicy()
    return ScalePolicy(
        growth_factor=saved["growth_factor"],
        backoff_factor=saved["backoff_factor"],
        growth_interval=saved["growth_interval"],
        hysteresis=saved.get("hysteresis", rule.hysteresis),
        min_scale=saved.get("min_scale", rule.min_scale),
        max_scale=saved.get("max_scale", rule.max_scale),
    )


def _loaded_state(saved: Mapping[str, Any], policy: Policy) -> HostState:
    scale = policy.check_scale("scale", saved["scale"])
    tracker = saved["_growth_tracker"]
    budget = saved.get("_hysteresis_tracker", policy.hysteresis)
    counts = saved.get("stats", {})
    if not isinstance(counts, Mapping):
        raise InvalidConfigError(f"stats must be a dict of counters, got {counts!r}.")
    checked = [("_growth_tracker", tracker), ("_hysteresis_tracker", budget)]
    checked += [(f"stats[{key!r}]", value) for key, value in counts.items()]
    for name, value in checked:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidConfigError(f"{name} must be an int >= 0, got {value!r}.")
    if budget > policy.hysteresis:
        raise InvalidConfigError(
            f"_hysteresis_tracker must not exceed hysteresis ({policy.hysteresis}), got {budget}."
        )
    extra = {}
    section = _headroom_section(saved)
    if isinstance(policy, HeadroomPolicy) and section is not None:
        extra = _loaded_headroom(section, policy)
    return HostState(scale, tracker, budget, ScalerStats(**counts), extra)


def _loaded_headroom(section: Mapping[str, Any], policy: HeadroomPolicy) -> dict[str, Any]:
    """A HeadroomPolicy's own state from ``headroom``, validated."""
    extra: dict[str, Any] = {name: section.get(name) for name in HEADROOM_FIELDS}
    history = extra["history"]
    if not (
        isinstance(history, (list, tuple))
        and len(history) == policy.history_length
        and all(_finite(value, at_least=0.0) for value in history)
    ):
        raise InvalidConfigError(
            f"headroom['history'] must be a list of {policy.history_length} finite numbers "
            f">= 0 (history_length), got {history!r}."
        )
    extra["history"] = [float(value) for value in history]
    extra["target"] = policy.check_scale("headroom['target']", extra["target"])
    for name in ("measured", "iteration"):
        value = extra[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidConfigError(f"headroom[{name!r}] must be an int >= 0, got {value!r}.")
    return extra


def _finite(value: object, at_least: float) -> bool:
    """Whether ``value`` is a real number, finite and >= ``at_least``."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and at_least <= value < math.inf
    )


def from_state_dict(
    saved: object, current: Policy, current_limit: int | None
) -> Loaded:
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
        policy = _loaded_policy(saved, current)
        limit = check_skip_limit(saved.get("max_consecutive_skips", current_limit))
        state = _loaded_state(saved, policy)
    except (InvalidConfigError, TypeError) as error:
        raise InvalidStateDictError(f"Invalid GradScaler state dict: {error}") from error
    return Loaded(policy, limit, state)


class CheckpointMethods:
    """Mixin: the scaler's ``state_dict``, ``load_state_dict`` and pickling (copies hold the
    state as Python values; the device state is made again at the next ``scale()``)."""

    _enabled: bool
    _policy: Policy
    _max_consecutive_skips: int | None
    _state: LiveState | HostState
    _per_optimizer: dict[int, Any]
    _last_outcome: StepOutcome | None
    _outcomes: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepOutcome]
    _saw: Callable[[float], None]  # tells the fused route the scale's value
    _set_policy: Callable[[Policy, int], None]
    _init_scale: float
    _agreement: RankAgreement | None
    _guards: GuardSet

    def _host_state(self) -> HostState:
        """The state as Python values (a host sync once it lives on a device)."""
        state = self._state
        if isinstance(state, HostState):
            return state
        state.settle()
        host = state.to_host()
        self._saw(host.scale)
        return host

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys plus ampscaler's policy state and counters.

        Torch's ``GradScaler.load_state_dict`` reads the five keys it knows and ignores the
        rest, so this loads into torch's scaler too (format: :mod:`ampscaler.checkpoint`).
        Empty when disabled. A host sync. Take it after :meth:`update`.

        Example:
            >>> import ampscaler
            >>> sorted(ampscaler.GradScaler("cpu").state_dict())[:5]
            ['_growth_tracker', '_hysteresis_tracker', 'backoff_factor', 'dynamic', 'growth_factor']
        """
        if not self._enabled:
            return {}
        saved = to_state_dict(self._policy, self._max_consecutive_skips, self._host_state())
        saved["guards"] = self._guards.state_dict()
        return saved

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler``.

        With a ``process_group``, the ranks compare what they loaded at the next step (one
        gather per group) and stop with an error naming the ranks that differ.

        Like torch, the checkpoint's configuration (factors, interval, and here also
        hysteresis, bounds, ``dynamic`` and ``max_consecutive_skips`` when present) replaces
        the constructor's. A torch state dict leaves ampscaler's own options as constructed
        and starts the counters at 0. The live state is overwritten in place. No-op when
        disabled.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler).
            KeyError / ValueError: a dict that is not a scaler's, or holds invalid values
                (:class:`~ampscaler.InvalidStateDictError` is both).
        """
        if not self._enabled:
            return
        loaded = from_state_dict(state_dict, self._policy, self._max_consecutive_skips)
        if isinstance(self._state, LiveState):
            self._state.settle()  # an update handed over under torch.compile: done before
        self._set_policy(loaded.policy, loaded.state.extra.get("iteration", 0))
        self._max_consecutive_skips = loaded.max_consecutive_skips
        self._init_scale = loaded.state.scale
        if isinstance(self._state, LiveState):
            self._state.load(loaded.state, loaded.policy)
            self._saw(float32_value(loaded.state.scale))
        else:
            self._state = loaded.state
        if "guards" in state_dict:
            self._guards.load_state_dict(state_dict["guards"])
        if self._agreement is not None:
            self._agreement.recheck()  # the ranks compare what they loaded at the next step

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer:
                raise ScalerUsageError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update()."
                )
            state["_state"] = self._host_state()
            state["_route"] = None
            outcome = self._last_outcome
            state["_last_outcome"] = None if outcome is None else outcome.settled()
        # Which optimizers skipped belongs to this object: a copy steps its own optimizers.
        state["_outcomes"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._outcomes = weakref.WeakKeyDictionary()
