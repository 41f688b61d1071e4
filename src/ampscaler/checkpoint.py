"""The scaler's ``state_dict``: its format, and its validation (all or nothing).

A state dict holds torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``, ``_growth_tracker``) and ampscaler's own: ``policy`` (the policy's kind)
and what the policy saves of itself (:func:`~ampscaler.policy.derived.checkpoint_entries`:
for :class:`~ampscaler.ScalePolicy` the rest of the rule,
``hysteresis``, ``min_scale``, ``max_scale``, ``dynamic``, and the hysteresis budget
``_hysteresis_tracker``; for :class:`~ampscaler.HeadroomPolicy` also a ``headroom`` section with
its settings and measurements), ``max_consecutive_skips``, the counters (``stats``) and the
guards' state (``guards``, one JSON string: see :meth:`ampscaler.guards.GuardSet.state_dict`).

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

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from .arguments import check_skip_limit
from .errors import InvalidConfigError, InvalidStateDictError
from .policy import LOWEST_SCALE, Policy, float32_value, policy_from_state_dict
from .policy.base import require_int, require_number
from .policy.derived import checkpoint_entries, policy_name, torch_rule
from .policy.scale import INT32_MAX
from .state import INT64_MAX, HostState, ScalerStats

__all__ = ["TORCH_KEYS", "Loaded", "from_state_dict", "to_state_dict"]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


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
        **checkpoint_entries(policy, state.own),
        "max_consecutive_skips": limit,
        "stats": state.stats.as_dict(),
        **hooks,
    }


@dataclass(frozen=True)
class Loaded:
    """A validated state dict: the policy, skip limit and state it restores."""

    policy: Policy
    max_consecutive_skips: int | None
    state: HostState


_STAT_NAMES = [stat.name for stat in fields(ScalerStats)]


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
    return ScalerStats(**values)


def _validated(saved: Mapping[str, Any], current: Policy, current_limit: int | None) -> Loaded:
    policy, own = policy_from_state_dict(saved, current)
    limit = check_skip_limit(saved.get("max_consecutive_skips", current_limit))
    scale = _saved_scale(policy, saved["scale"])
    tracker = require_int(
        "_growth_tracker", saved["_growth_tracker"], 0, INT32_MAX, integral_floats=True
    )
    stats = _stats(saved.get("stats", {}))
    host = HostState(scale, tracker, own, stats)
    _trial_state(policy, host)
    return Loaded(policy, limit, host)


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
        return _validated(saved, current, current_limit)
    except (InvalidConfigError, TypeError, KeyError) as error:
        raise InvalidStateDictError(f"Invalid GradScaler state dict: {error}") from error
