"""What :func:`~ampscaler.patch_torch` applies to every scaler it builds: :class:`PatchSettings`,
checked all at once before anything is patched, and read from JSON (``AMPSCALER_PATCH``) for
processes started by a framework.

Settings of three kinds:

- torch's own arguments (``device``, ``init_scale``, ``growth_factor``, ``backoff_factor``,
  ``growth_interval``): the value a call gets when it leaves the argument out. A call that
  passes the argument with another value contradicts the setting, and is refused
  (:func:`merged_arguments`).
- ampscaler's constructor extras (``policy``, ``hysteresis``, ``min_scale``, ``max_scale``,
  ``max_consecutive_skips``, ``flat_grads``), given to every scaler built.
- what each scaler gets after construction: ``guards`` and ``sinks`` as *factories* (a guard or
  a sink holds per-run state, a file, a window of past norms; one instance shared by every
  scaler a framework builds would mix their runs, so each scaler calls the factory for its
  own), and ``configure``, a function called with each new scaler.

A string wherever a callable or a policy goes is an import path, ``"package.module:name"``,
resolved when the settings are checked: how a JSON setting names Python objects.

Example:
    >>> settings = checked(PatchSettings(hysteresis=2, guards=("ampscaler:SpikeGuard",)))
    >>> settings.guards[0]()
    SpikeGuard(sigma=6.0, window=128, warmup=128)
    >>> merged_arguments(settings, "torch.amp.GradScaler", {"device": "cpu"}, {"device": "cuda"})
    {'device': 'cpu', 'hysteresis': 2}
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..errors import InvalidConfigError, ScalerUsageError
from ..policy import Policy, require_policy
from ..policy.derived import with_rule
from ..scaler import GradScaler

__all__ = ["TORCH_ARGUMENTS", "PatchSettings", "checked", "from_json", "merged_arguments"]

#: torch's constructor arguments that a setting may give a default for.
TORCH_ARGUMENTS = ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval")
_RULE = ("growth_factor", "backoff_factor", "growth_interval")
_EXTRAS = ("policy", "hysteresis", "min_scale", "max_scale", "max_consecutive_skips", "flat_grads")

Factory = Callable[[], Any]


@dataclass(frozen=True)
class PatchSettings:
    """The settings of :func:`~ampscaler.patch_torch` (``None``: not set); see the module
    docstring for what each kind does."""

    device: str | None = None
    init_scale: float | None = None
    growth_factor: float | None = None
    backoff_factor: float | None = None
    growth_interval: int | None = None
    policy: Policy | str | None = None
    hysteresis: int | None = None
    min_scale: float | None = None
    max_scale: float | None = None
    max_consecutive_skips: int | None = None
    flat_grads: bool | None = None
    guards: Sequence[Factory | str] = ()
    sinks: Sequence[Factory | str] = ()
    configure: Callable[[GradScaler], object] | str | None = None

    def given(self, names: Sequence[str]) -> dict[str, Any]:
        """The settings among ``names`` that were set."""
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def apply(self, scaler: GradScaler) -> None:
        """Give a newly built ``scaler`` its own guards and sinks, then ``configure`` it."""
        for guard in self.guards:
            scaler.attach(_call(guard)())
        for sink in self.sinks:
            scaler.attach(_call(sink)())
        if self.configure is not None:
            _call(self.configure)(scaler)


def _call(value: object) -> Callable[..., Any]:
    assert callable(value)  # resolved and checked by checked()
    return value


def _imported(path: str, setting: str) -> Any:
    """The object an import path ``"package.module:name"`` names."""
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise InvalidConfigError(
            f"{setting}={path!r} is not an import path: write it as 'package.module:name' "
            "(for example 'ampscaler:SpikeGuard')."
        )
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        raise InvalidConfigError(
            f"{setting}={path!r} cannot be imported ({error}); check the module and the name, "
            "and that the package is installed in this process's environment."
        ) from error
    return found


def _factory(value: object, setting: str) -> Factory:
    named = value if isinstance(value, str) else None
    if named is not None:
        value = _imported(named, setting)
    if not callable(value):
        raise TypeError(
            f"{setting} takes factories (functions or classes called with no argument), one "
            f"per scaler built, got a {type(value).__name__}: one object shared by every scaler "
            "torch's names build would mix their runs. Pass, for example, "
            "guards=[lambda: SpikeGuard(sigma=6.0)] or guards=[SpikeGuard]."
        )
    try:
        inspect.signature(value).bind()
    except ValueError:
        pass  # no signature to read (a builtin): it is called as it is
    except TypeError as error:
        shown = named or getattr(value, "__qualname__", repr(value))
        raise TypeError(
            f"{setting} takes factories called with no argument, one per scaler built, but "
            f"{shown} needs one ({error}). Name a function of no argument that makes it, for "
            "example one in your module that returns JsonlSink(f'steps-{os.getpid()}.jsonl'), "
            "or pass lambda: ... from Python."
        ) from None
    return value


def _policy(value: object) -> Policy:
    if isinstance(value, str):
        value = _imported(value, "policy")
        if callable(value):  # a class or a function that returns a policy (policies are not)
            value = value()
    return require_policy(value, "or the import path of one or of a function returning one")


def _device(value: object) -> str:
    try:
        if not isinstance(value, str):
            raise TypeError(value)
        return torch.device(value).type
    except (RuntimeError, TypeError) as error:
        raise InvalidConfigError(
            f"device={value!r} is not a torch device type; use 'cuda', 'cpu', 'xpu', ..."
        ) from error


def checked(settings: PatchSettings) -> PatchSettings:
    """``settings`` with import paths resolved, every value checked as the scaler's
    constructor would check it, before any scaler is built.

    Raises:
        InvalidConfigError: a value out of range, ``policy`` together with ``hysteresis``,
            ``min_scale`` or ``max_scale``, a rule setting the policy contradicts, an import
            path that does not import.
        TypeError: a guard or sink that is not a factory, a ``configure`` that is not callable.
    """
    resolved = replace(
        settings,
        device=None if settings.device is None else _device(settings.device),
        policy=None if settings.policy is None else _policy(settings.policy),
        guards=tuple(_factory(g, "guards") for g in _sequence(settings.guards, "guards")),
        sinks=tuple(_factory(s, "sinks") for s in _sequence(settings.sinks, "sinks")),
    )
    if resolved.configure is not None:
        configure = resolved.configure
        if isinstance(configure, str):
            configure = _imported(configure, "configure")
        if not callable(configure):
            raise TypeError(
                f"configure must be a function called with each new scaler, got {configure!r}."
            )
        resolved = replace(resolved, configure=configure)
    # The scaler's own checks, on a throwaway scaler: the same ranges and conflicts.
    arguments = merged_arguments(resolved, "patch_torch", {}, {"device": "cpu"})
    GradScaler(**{**arguments, "device": "cpu"})
    return resolved


def _sequence(value: object, setting: str) -> Sequence[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"{setting} takes a list of factories, got {value!r}; for one, write {setting}=[...]."
        )
    return value


def merged_arguments(
    settings: PatchSettings, call: str, given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The constructor arguments of ampscaler's scaler for a call of torch's ``call`` that
    passed ``given`` (torch's own ``defaults`` for the rest), under ``settings``.

    Raises:
        InvalidConfigError: an argument the call passed that a setting (or the policy) gives
            another value.
    """
    arguments = {**defaults}
    for name, value in settings.given(TORCH_ARGUMENTS).items():
        if name in given and given[name] != value:
            raise InvalidConfigError(
                f"{call}({name}={given[name]!r}) was called while ampscaler.patch_torch("
                f"{name}={value!r}) is in force: the call and the setting disagree. A setting "
                "only fills in what the call leaves out; drop it from patch_torch's settings, "
                "or change the call."
            )
        arguments[name] = value
    arguments.update(given)
    arguments.update(settings.given(_EXTRAS))
    policy = settings.policy
    if policy is not None:
        policy = _policy(policy)  # resolved already by checked(); an import path otherwise
        for name in _RULE:
            value = arguments.pop(name, None)
            if name in given or settings.given([name]):
                _agrees_with_policy(policy, name, value, call)
    return arguments


def _agrees_with_policy(policy: Policy, name: str, value: object, call: str) -> None:
    try:
        if with_rule(policy, call, **{name: value}) == policy:
            return  # the policy moves the scale with that very number
    except (ScalerUsageError, InvalidConfigError):
        pass  # a policy without torch's rule, or a value no rule takes
    raise InvalidConfigError(
        f"{call} sets {name}={value!r} while ampscaler.patch_torch(policy={policy}) is in force, "
        f"which does not move the scale with that {name}. Give patch_torch the rule as settings "
        "that combine with the call's arguments (hysteresis=, min_scale=, max_scale=), or a "
        "policy that agrees with the call."
    )


def from_json(text: str, variable: str) -> PatchSettings:
    """The settings a JSON object names, such as ``{"hysteresis": 2, "guards":
    ["ampscaler:SpikeGuard"]}``, checked (:func:`checked`).

    Raises:
        InvalidConfigError: naming ``variable`` and its value: not JSON, not an object, an
            unknown setting, or a setting :func:`checked` refuses.
    """
    where = f"{variable}={text!r}"
    try:
        parsed = json.loads(text, object_pairs_hook=_without_repeats)
    except _RepeatedKeyError as error:
        raise InvalidConfigError(
            f"{where} names the setting {error.args[0]!r} more than once; keep one."
        ) from None
    except json.JSONDecodeError as error:
        raise InvalidConfigError(
            f"{where} is not valid JSON ({error}); set it to a JSON object of patch_torch "
            """settings, such as '{"hysteresis": 2}', or to '{}' for none."""
        ) from None
    if not isinstance(parsed, dict):
        raise InvalidConfigError(
            f"{where} must be a JSON object of patch_torch settings, such as "
            f"""'{{"hysteresis": 2}}', not a {type(parsed).__name__}."""
        )
    known = [field.name for field in fields(PatchSettings)]
    for name in parsed:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidConfigError(
                f"{where} names an unknown setting {name!r}{hint}; the settings are "
                f"{', '.join(known)}."
            )
    try:
        return checked(PatchSettings(**parsed))
    except (InvalidConfigError, TypeError) as error:
        raise InvalidConfigError(f"{where}: {error}") from error


class _RepeatedKeyError(ValueError):
    """A JSON object that names a key twice (``json`` would keep the last silently)."""


def _without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKeyError(key)
        found[key] = value
    return found
