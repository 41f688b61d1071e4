"""The policy protocol: everything a :class:`~ampscaler.GradScaler` needs of a policy.

A policy is a small immutable value that says how the loss scale moves. The scaler keeps the
policy's moving parts (its *state*: 0-dim tensors on the device, updated in place) and calls the
policy once per iteration with the iteration's inf/NaN flag. It never asks which policy it
holds: whatever differs between policies goes through the methods of :class:`Policy`, and a
policy written in a user's own file trains, checkpoints, resumes and agrees across ranks like
the built-in ones.

What a policy provides, and where the scaler uses it (eight things, one of them required):

========================================  ===================================================
:meth:`~Policy.update_`                   ``update()``: the transition, in place (required)
:meth:`~Policy.initial_state`             the state tensors, fresh or from saved values
:meth:`~Policy.own_values`                validating its own saved state values
:meth:`~Policy.set_scale_`                ``update(new_scale)``
:attr:`~Policy.holds_on_nonfinite_loss`   whether an inf/NaN loss leaves the state alone
:meth:`~Policy.check_scale`               validating ``init_scale``, ``new_scale``, loaded scales
:meth:`~Policy.starting_scale`            where a scaler starts, given its ``init_scale``
:meth:`~Policy.new_meter`                 what it needs measured (a hook), and how often
========================================  ===================================================

Everything else is derived from its dataclass fields by :mod:`ampscaler.policy.derived`: its
name, its settings (compared across ranks), torch's getters and checkpoint keys, and the pure
transition (:func:`adjusted`: :meth:`~Policy.update_` on copies); :mod:`ampscaler.checkpoint`
saves and restores its settings and state.

Writing one takes a frozen dataclass and :meth:`~Policy.update_`, written with ``torch.where``
so that it never waits for the device::

    >>> import dataclasses, torch
    >>> from ampscaler import GradScaler
    >>> from ampscaler.policy import Policy, PolicyState
    >>> @dataclasses.dataclass(frozen=True)
    ... class HalveOrDouble(Policy):
    ...     '''Halve on overflow, double after `interval` clean steps.'''
    ...     interval: int = 100
    ...     def update_(self, state: PolicyState, found_inf: torch.Tensor,
    ...                 measured: torch.Tensor | None = None) -> None:
    ...         clean = torch.where(found_inf > 0, 0, state.growth_tracker + 1)
    ...         grow = clean >= self.interval
    ...         factor = torch.where(found_inf > 0, 0.5, torch.where(grow, 2.0, 1.0))
    ...         state.scale.mul_(factor)
    ...         state.growth_tracker.copy_(torch.where(grow, 0, clean))
    >>> scaler = GradScaler("cpu", init_scale=1024.0, policy=HalveOrDouble(interval=2))
    >>> scaler.policy, scaler.state_dict()["policy"], scaler.state_dict()["policy_state"]
    (HalveOrDouble(interval=2), 'HalveOrDouble', {'interval': 2})

Its state is ``scale`` (float32) and ``growth_tracker`` (int32), the two tensors torch's scaler
has; a policy with more moving parts declares a :class:`~typing.NamedTuple` of tensors that
starts with those two and overrides :meth:`~Policy.initial_state` (see
:class:`~ampscaler.ScalePolicy`'s ``hysteresis_left``). docs/design.md has a longer example.
"""

from __future__ import annotations

import abc
import math
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from ..errors import InvalidConfigError

__all__ = [
    "FP16_MAX",
    "LOWEST_SCALE",
    "BasicState",
    "Meter",
    "Policy",
    "PolicyState",
    "PowerOfTwo",
    "TorchRule",
    "adjusted",
    "check_bounds",
    "check_number",
    "check_scale",
    "check_switch",
    "float32_value",
    "pow2_exponent",
    "require_int",
    "require_number",
    "require_state",
]

FP16_MAX = 65504.0
"""The largest finite float16 value: a gradient beyond it overflows to inf."""

LOWEST_SCALE = 2.0**-126
"""The smallest scale a policy may hold: float32's smallest normal number. Below it ``1/scale``
is no longer exact in float32, and from ``2**-128`` on it is infinite: unscaling would write
inf/NaN into finite gradients (docs/migration.md)."""


def _held(value: object) -> object:
    """The Python number a one-element tensor or a numpy scalar holds (torch accepts them where
    it takes a number); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.item()
    if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()  # a numpy scalar
    return value


def require_number(name: str, value: object) -> float:
    """``value`` as a float if it is a real number (numpy scalars and one-element tensors
    included, as torch accepts them), else :class:`InvalidConfigError` naming ``name``."""
    value = _held(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidConfigError(f"{name} must be a real number, got {value!r}.")
    return float(value)


def check_number(name: str, value: object, fits: Callable[[float], bool], must: str) -> float:
    """``value`` as a float if it is a real number (as :func:`require_number` takes it) that
    ``fits``, else :class:`InvalidConfigError` saying that ``name`` must be ``must``."""
    number = require_number(name, value)
    if not fits(number):
        raise InvalidConfigError(f"{name} must be {must}, got {value!r}.")
    return number


def require_int(
    name: str,
    value: object,
    minimum: int,
    maximum: int | None = None,
    *,
    integral_floats: bool = False,
    meaning: str = "",
) -> int:
    """``value`` as an int if it is an integer (numpy integers and one-element integer tensors
    included, as torch accepts them; with ``integral_floats`` also floats such as ``3.0``)
    within ``[minimum, maximum]``, else :class:`InvalidConfigError` naming ``name`` (and
    ``meaning``, what the value is for, after the range)."""
    number = _held(value)
    if integral_floats and isinstance(number, float) and number.is_integer():
        number = int(number)
    within = f">= {minimum}" if maximum is None else f">= {minimum} and <= {_shown(maximum)}"
    within += meaning
    if isinstance(number, bool) or not isinstance(number, int):
        raise InvalidConfigError(f"{name} must be an int {within}, got {value!r}.")
    if number < minimum or (maximum is not None and number > maximum):
        raise InvalidConfigError(f"{name} must be {within}, got {value!r}.")
    return number


def check_switch(name: str, value: object) -> bool:
    """An on/off setting: ``True`` or ``False``.

    Raises:
        InvalidConfigError: anything else (a typo such as ``flat_grads="yes"`` must not pass
            as true).
    """
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{name} must be True or False, got {value!r}.")
    return value


def _shown(number: int) -> str:
    """``number`` as a person reads a bound: ``2**31 - 1`` rather than ``2147483647``."""
    for offset, suffix in ((0, ""), (1, " - 1")):
        power = number + offset  # exactly a power of two (as an int: no rounding to float)
        if power > 2**16 and power & (power - 1) == 0:
            return f"2**{power.bit_length() - 1}{suffix}"
    return str(number)


def float32_value(value: float) -> float:
    """``value`` as the float32 the scale tensor holds (``inf`` beyond float32's range).

    Example:
        >>> float32_value(0.1), float32_value(1e39)
        (0.10000000149011612, inf)
    """
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except OverflowError:  # beyond float32's range
        return math.copysign(math.inf, value)


def pow2_exponent(value: float | None) -> int | None:
    """``e`` when ``value`` is exactly ``2**e`` (a positive finite power of two), else ``None``.

    Example:
        >>> pow2_exponent(65536.0), pow2_exponent(0.25), pow2_exponent(3.0), pow2_exponent(None)
        (16, -2, None, None)
    """
    if value is None or not (value > 0.0 and math.isfinite(value)):
        return None
    mantissa, exponent = math.frexp(value)
    return exponent - 1 if mantissa == 0.5 else None


def check_bounds(policy: Any, low: float | None, high: float | None) -> None:
    """Refuse a ``policy`` whose ``min_scale`` exceeds its ``max_scale`` (``low`` and ``high``:
    them validated, as numbers or as exponents; ``None`` where not given)."""
    if low is not None and high is not None and low > high:
        raise InvalidConfigError(
            f"min_scale ({policy.min_scale}) must not exceed max_scale ({policy.max_scale})."
        )


def check_scale(
    name: str, scale: object, min_scale: float | None = None, max_scale: float | None = None
) -> float:
    """``scale`` as a float if float32 holds it finite, normal (``>= 2**-126``, where
    ``1/scale`` is exact and finite) and within the bounds, else
    :class:`InvalidConfigError` naming ``name`` and the allowed range.

    Example:
        >>> check_scale("init_scale", 1024)
        1024.0
    """
    value = require_number(name, scale)
    stored = float32_value(value)
    low = LOWEST_SCALE if min_scale is None else max(float32_value(min_scale), LOWEST_SCALE)
    high = math.inf if max_scale is None else float32_value(max_scale)
    if not (math.isfinite(stored) and low <= stored <= high):
        bounds = f"[min_scale, max_scale] = [{min_scale or 0}, {max_scale or math.inf}]"
        within = "" if (min_scale, max_scale) == (None, None) else f" and within {bounds}"
        raise InvalidConfigError(
            f"{name} must be a number > 0 that is finite as a float32 and at least 2**-126 "
            f"(float32's smallest normal number: below it unscaling is not exact){within}, "
            f"got {scale!r}."
        )
    return value


class PolicyState(Protocol):
    """A policy's moving parts: a :class:`~typing.NamedTuple` of tensors on the scale's
    device whose first two fields are ``scale`` (0-dim float32) and ``growth_tracker`` (0-dim
    int32), torch's names for them. The scaler creates it with :meth:`Policy.initial_state`
    and keeps the same tensor objects for its lifetime."""

    @property
    def scale(self) -> torch.Tensor: ...

    @property
    def growth_tracker(self) -> torch.Tensor: ...

    def _asdict(self) -> dict[str, Any]: ...

    def __iter__(self) -> Iterator[torch.Tensor]: ...

    def __len__(self) -> int: ...


class BasicState(NamedTuple):
    """The state of a policy with no moving parts of its own: torch's two tensors.

    Attributes:
        scale: float32, the loss scale.
        growth_tracker: int32, clean steps in a row (what torch's scaler counts).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor


class PowerOfTwo(NamedTuple):
    """How a policy keeps a scale that is a power of two one (see :attr:`Policy.power_of_two`).

    Attributes:
        drop: by how many binades one ``update()`` can lower the scale at most (``0``: the
            scale never leaves float32's normal range, whatever happens).
        floor: the lowest exponent ``e`` of a scale ``2**e`` it can reach (``None``: none).
    """

    drop: int
    floor: int | None


class TorchRule(NamedTuple):
    """The dynamic rule as torch's scaler names it: what ``get_growth_factor()`` and friends
    return, and what ``state_dict()`` saves under torch's keys (torch's scaler needs them)."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


class Meter(Protocol):
    """What a measuring policy's meter does (see :meth:`Policy.new_meter`).

    The scaler calls, per iteration: :meth:`start` at the first ``scale()``, :meth:`measure`
    per optimizer with the scaled gradients before they are checked, :meth:`take` in
    ``update()`` (then agrees on the value across ranks) and :meth:`advance`, or :meth:`skip`
    for ``update(new_scale)``, which does not consult the policy. :meth:`watch` gets the models
    of ``scaler.watch()``; :meth:`detach` ends the meter (a loaded checkpoint replaced it).
    """

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None: ...

    def start(self) -> None: ...

    def measure(self, optimizer: torch.optim.Optimizer) -> None: ...

    def take(self, device: torch.device) -> torch.Tensor | None: ...

    def advance(self) -> None: ...

    def skip(self) -> None: ...

    def detach(self) -> None: ...


class Policy(abc.ABC):
    """How the loss scale moves: the protocol every policy implements (module docstring).

    Subclasses are frozen dataclasses of Python numbers, validated on construction. Only
    :meth:`update_` is required; the other seven have defaults that fit a policy whose state is
    :class:`BasicState` and whose scale may take any value. Its name, the settings ranks
    compare and torch's getters are read from its dataclass fields by
    :mod:`ampscaler.policy.derived`, its checkpoint entries by :mod:`ampscaler.checkpoint`, not
    asked of it.
    """

    # ------------------------------------------------------------------ the state

    def initial_state(
        self, scale: float, device: torch.device, values: Mapping[str, Any] | None = None
    ) -> PolicyState:
        """The state on ``device``: ``scale``, and the other fields from ``values`` (by name,
        as Python numbers or lists, as :meth:`own_values` gives them; validated already),
        fresh where ``values`` lacks them. The default makes a :class:`BasicState`."""
        tracker = 0 if values is None else int(values.get("growth_tracker", 0))
        return BasicState(
            torch.full((), scale, dtype=torch.float32, device=device),
            torch.full((), tracker, dtype=torch.int32, device=device),
        )

    def own_values(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """This policy's own state values (beyond scale and growth tracker) from a checkpoint's
        section, validated: what :meth:`initial_state` takes as ``values``. Raises
        :class:`InvalidConfigError` naming the bad value. The default has none."""
        return {}

    # ------------------------------------------------------------------ the transition

    @abc.abstractmethod
    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """Move ``state`` in place (its tensors keep their identity) after one iteration whose
        gradients held inf/NaN iff ``found_inf > 0`` (a 0-dim float32 tensor on the state's
        device). ``measured`` is the iteration's measurement, on the iterations the meter of
        :meth:`new_meter` measures (``None`` otherwise). Must not wait for the device."""

    def set_scale_(self, state: PolicyState, value: float) -> None:
        """``update(new_scale)``: put ``value`` (validated by :meth:`check_scale`) into the
        state, in place."""
        state.scale.fill_(value)

    @property
    def holds_on_nonfinite_loss(self) -> bool:
        """Whether the state stays as it is after an iteration whose loss was already inf/NaN
        before scaling (a lower scale cannot help such a step; the scaler then leaves the
        state untouched instead of calling :meth:`update_`). ``False`` by default: every
        skipped iteration moves the policy, as torch's rule does."""
        return False

    # ------------------------------------------------------------------ values

    def check_scale(self, name: str, scale: object) -> float:
        """Validate a scale value for this policy (``init_scale``, ``new_scale``, a loaded
        one): the default takes any number float32 holds finite and >= 2**-126. Returns it as
        a float, or raises :class:`InvalidConfigError` naming ``name``."""
        return check_scale(name, scale)

    def starting_scale(self, init_scale: object) -> float:
        """The scale a scaler starts from, given its ``init_scale`` (validated)."""
        return self.check_scale("init_scale", init_scale)

    def new_meter(self, iteration: int, agreed: bool) -> Meter | None:
        """The meter that measures for this policy from its iteration number ``iteration``
        (``agreed``: the scaler agrees across ranks, so measurements may differ by rank);
        ``None`` for a policy that measures nothing (the default)."""
        return None


State = TypeVar("State", bound=PolicyState)


def require_state(kind: type[State], state: PolicyState, user: str) -> State:
    """``state`` if it is a ``kind``, else :class:`TypeError` saying that ``user`` (a policy, or
    one of its methods) needs one."""
    if not isinstance(state, kind):
        raise TypeError(
            f"{user} needs a {kind.__name__} (policy.initial_state(...) makes one), got "
            f"{type(state).__name__}."
        )
    return state


def adjusted(
    policy: Policy,
    state: State,
    found_inf: torch.Tensor,
    measured: torch.Tensor | None = None,
) -> State:
    """The state after one iteration, leaving ``state`` as it was: ``policy``'s
    :meth:`~Policy.update_` run on copies of its tensors (a compiled ``update()`` applies it
    masked)."""
    moved = type(state)(*(tensor.clone() for tensor in state))
    policy.update_(moved, found_inf, measured)
    return moved
