"""The scaler's arguments, validated: what each value means, as torch's scaler reads it.

Example:
    >>> device_and_enabled("cpu", 1)
    ('cpu', True)
    >>> check_skip_limit(50), check_switch("flat_grads", False)
    (50, False)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast

import torch

from .errors import InvalidConfigError, warn_at_caller
from .policy.base import Policy, check_switch, float32_value, require_int

__all__ = [
    "DEFAULT_INIT_SCALE",
    "check_attempts",
    "check_skip_limit",
    "check_switch",
    "device_and_enabled",
    "new_scale_value",
    "no_cuda_warner",
    "refusing_removed_options",
    "starting_scale",
]

#: torch's (and ampscaler's) default ``init_scale``.
DEFAULT_INIT_SCALE = 2.0**16

#: torch's warning when its scaler for ``"cuda"`` finds no CUDA, word for word: programs
#: silence it by this text (``warnings.filterwarnings("ignore", message=...)``), so
#: ampscaler's, for torch's names under ``patch_torch()`` and its own, begins with it.
TORCH_NO_CUDA_WARNING = (
    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
)

#: Who warns that a scaler built for ``"cuda"`` has no CUDA: at the caller's line, as torch's
#: ``torch.amp.GradScaler`` does; the stand-ins for torch's subclasses set torch's own line
#: while they build (:mod:`ampscaler.integrations.standins`).
no_cuda_warner: ContextVar[Callable[[str, type[Warning]], None]] = ContextVar(
    "no_cuda_warner", default=warn_at_caller
)

#: The constructor options ampscaler 0.1.0 took and 0.2.0 removed, with what replaces each.
REMOVED_OPTIONS = {
    "history_size": "scaler.attach(ampscaler.StepHistory(N))",
    "probe_every": "scaler.attach(ampscaler.GradientProbe(every=N))",
    "trace_nonfinite": "scaler.attach(ampscaler.NonFiniteTracer()) and scaler.watch(model)",
    "dynamic": "GradScaler(..., policy=ampscaler.StaticPolicy()) for a scale that never moves",
}

_Init = TypeVar("_Init", bound=Callable[..., None])


def refusing_removed_options(init: _Init) -> _Init:
    """``init`` (a constructor), raising a ``TypeError`` that names the replacement when given
    an option of :data:`REMOVED_OPTIONS` (Python's own says only "unexpected keyword").

    Example:
        >>> class Scaler:
        ...     @refusing_removed_options
        ...     def __init__(self, *, hysteresis=1): ...
        >>> Scaler(history_size=100)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: Scaler() no longer takes history_size= ...StepHistory(N)).
    """

    @functools.wraps(init)
    def checked(*args: Any, **kwargs: Any) -> None:
        for name in kwargs.keys() & REMOVED_OPTIONS.keys():
            made = type(args[0]).__name__ if args else "GradScaler"
            raise TypeError(
                f"{made}() no longer takes {name}= (removed in ampscaler 0.2.0): use "
                f"{REMOVED_OPTIONS[name]}."
            )
        init(*args, **kwargs)

    return cast(_Init, checked)


def starting_scale(policy: Policy, init_scale: object) -> float:
    """The scale a scaler with ``policy`` starts from, given ``init_scale`` (validated).

    Raises:
        InvalidConfigError: ``init_scale`` is out of the policy's range; when it is the
            default's value, the message says so (the user may never have written it).

    Example:
        >>> from ampscaler.policy import ScalePolicy
        >>> starting_scale(ScalePolicy(max_scale=1024.0), 512.0)
        512.0
    """
    try:
        return policy.starting_scale(init_scale)
    except InvalidConfigError as error:
        if init_scale != DEFAULT_INIT_SCALE:
            raise
        raise InvalidConfigError(
            f"init_scale is {DEFAULT_INIT_SCALE:g} (2**16), the default when none is passed, "
            f"and this scaler's policy refuses it: {error} Pass an init_scale within the "
            "bounds, e.g. GradScaler(..., max_scale=1024.0, init_scale=1024.0)."
        ) from None


def _device_type(device: object) -> str | None:
    if device is None or isinstance(device, torch.device):
        return None if device is None else device.type
    if not isinstance(device, str):
        # One line: a long repr (an optimizer's spans many lines) is named by its type.
        shown = repr(device)
        if isinstance(device, torch.optim.Optimizer):
            shown = (
                f"the optimizer {type(device).__name__}; the optimizer goes to "
                "scaler.step(optimizer), not to GradScaler()"
            )
        elif len(shown) > 40 or "\n" in shown:
            shown = f"an object of type {type(device).__name__}"
        raise InvalidConfigError(
            f"device must be a device type string such as 'cpu' or 'cuda', a torch.device, or "
            f"None, got {shown}."
        )
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise InvalidConfigError(
            f"device {device!r} is not a torch device type; use 'cpu', 'cuda', 'mps', 'xpu', ... "
            "or None for the device of the first scaled tensor."
        ) from error


def device_and_enabled(device: object, enabled: object) -> tuple[str | None, bool]:
    """The device type (``None``: the first scaled tensor's) and whether the scaler is on.

    Like torch, ``"cuda"`` on a machine without CUDA warns (torch's words first, which
    programs filter it by, then ampscaler's hint; by :data:`no_cuda_warner`) and disables the
    scaler, and ``enabled`` takes any
    truthy value (``enabled=args.amp``, ``numpy.bool_``, ``1``).

    Raises:
        InvalidConfigError: ``device`` is not a device.
    """
    enabled = bool(enabled)
    device_type = _device_type(device)
    if enabled and device_type == "cuda" and not torch.cuda.is_available():
        no_cuda_warner.get()(
            f"{TORCH_NO_CUDA_WARNING} (ampscaler.GradScaler, as torch's: pass device='cpu' "
            "or None to scale on the CPU.)",
            UserWarning,
        )
        return device_type, False
    return device_type, enabled


def check_skip_limit(limit: object) -> int | None:
    """``max_consecutive_skips``: an int >= 1, or ``None`` for no limit.

    Raises:
        InvalidConfigError: anything else.
    """
    return None if limit is None else _at_least_one("max_consecutive_skips", limit, " or None")


def check_attempts(limit: object) -> int:
    """``max_attempts`` of :meth:`GradScaler.attempts <ampscaler.GradScaler.attempts>`: an
    int >= 1 (1: no replay).

    Raises:
        InvalidConfigError: anything else.
    """
    return _at_least_one("max_attempts", limit, " (how many tries a batch gets; 1: no replay)")


def _at_least_one(name: str, value: object, meaning: str) -> int:
    """``value`` as an int >= 1 (numpy integers and one-element tensors too), else an
    :class:`InvalidConfigError` saying what ``name`` takes (``meaning``)."""
    if type(value) is int and value >= 1:
        return value  # the common case, at every batch: the general check cost ~1% of a 0.7 ms one
    return require_int(name, value, 1, meaning=meaning)


def new_scale_value(new_scale: float | torch.Tensor, policy: Policy) -> float:
    """``update(new_scale)``'s argument, validated for ``policy``, as the float32 value the scale
    will hold. Like torch, a one-element tensor is accepted (and read: a host sync).

    Raises:
        InvalidConfigError: not one element, requires grad, or out of the policy's range.
    """
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1 or new_scale.requires_grad:
            raise InvalidConfigError(
                "new_scale should be a float or a 1-element tensor with requires_grad=False, "
                f"got a tensor of shape {list(new_scale.shape)} with "
                f"requires_grad={new_scale.requires_grad}."
            )
        new_scale = float(new_scale.item())
    return float32_value(policy.check_scale("new_scale", new_scale))
