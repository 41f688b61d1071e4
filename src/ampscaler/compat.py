"""torch.amp.GradScaler compatibility: its private names, argument semantics and accessors.

Libraries and tests written against torch's scaler read a few of its private attributes. They
are given the values and effects torch gives them here, apart from the front class, so the
design of :class:`~ampscaler.GradScaler` stays readable. Each name, and who uses it:

- ``_scale``, ``_growth_tracker``: the live tensors (``None`` before the first ``scale()``);
  torch's CUDA-graph tests and pickling test read them.
- ``_get_scale_async()``: the scale tensor without a sync (Accelerate, torch's tests);
  ``_get_growth_tracker()``: the growth tracker as an int (a host sync; torch's tests).
- ``_per_optimizer_states``: ``{id(optimizer): {"stage": torch's OptState,
  "found_inf_per_device": {device: flag}}}`` for the iteration in progress, a new
  ``defaultdict`` on each read (torch's tests, code that checks whether an optimizer was
  unscaled). The flag is the optimizer's combined flag, on the scale's device.
- ``_found_inf_per_device(optimizer)``: that entry's ``found_inf_per_device``.
- ``_check_inf_per_device(optimizer)``: checks without unscaling and records the flag, as
  torch's deprecated ``grad_scaler=`` step protocol uses it.
- ``_unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)``: torch's unscale-and-check,
  per device (torch's tests).
- ``_lazy_init_scale_growth_tracker(device)``: makes the live state on ``device``
  (Accelerate's FSDP2 checkpoint loading calls it).
- ``_growth_factor``, ``_backoff_factor``, ``_growth_interval``: the dynamic rule's numbers,
  readable and writable (Accelerate's ``GradScalerKwargs`` test reads them; writes are
  validated as the setters' are).
- ``_init_scale``: the scale given at construction or loaded from a checkpoint;
  ``_enabled``: whether scaling is on.

Torch's argument semantics live here too: which ``device`` values mean what (and that
``"cuda"`` without CUDA warns and disables the scaler), and the nested structures ``scale()``
accepts. So do torch's getters and setters of the dynamic rule (``get_growth_factor()``, ...),
mapped onto the scaler's :class:`~ampscaler.ScalePolicy`, and the recognition of optimizers
that still use torch's deprecated ``grad_scaler=`` step protocol (refused, see
docs/migration.md).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.amp.grad_scaler import OptState as TorchOptState

from .errors import InvalidConfigError, ScalerUsageError
from .grads.check import FusedRoute, combined_flag, unscale_per_device_
from .grads.collect import collect
from .policy import HeadroomPolicy, Policy, ScalePolicy, float32_value, torch_rule
from .state import HostState, LiveState

__all__ = [
    "TorchPolicyMethods",
    "TorchPrivateMethods",
    "TorchStateAccess",
    "device_and_enabled",
    "new_scale_value",
    "refuse_legacy_protocol",
    "scale_nested",
    "step_fused",
]


class TorchStateAccess:
    """Mixin: torch's names that read the scaler's state: ``get_scale()`` and the private
    names of the module docstring."""

    _enabled: bool
    _state: LiveState | HostState
    _saw: Callable[[float], None]  # tells the fused route the scale's value

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    def get_scale(self) -> float:
        """The current scale as a Python float; 1.0 when disabled. A host sync.

        Example:
            >>> import ampscaler
            >>> ampscaler.GradScaler("cpu", init_scale=128.0).get_scale()
            128.0
        """
        if not self._enabled:
            return 1.0
        state = self._state
        if isinstance(state, HostState):
            return state.scale
        if state.unused_scale is not None:
            return state.unused_scale
        state.settle()
        value = float(state.scale.item())
        self._saw(value)
        return value

    def _settled(self) -> LiveState | None:
        state = self._state
        if not isinstance(state, LiveState):
            return None
        state.settle()
        return state

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        state = self._settled()
        return None if state is None else state.growth_tracker

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (``None`` before the first ``scale()``)."""
        state = self._settled()
        return None if state is None else state.scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (0 when disabled). A host sync."""
        if not self._enabled:
            return 0
        state = self._settled()
        if state is None:
            assert isinstance(self._state, HostState)
            return self._state.growth_tracker
        return int(state.growth_tracker.item())


class TorchPolicyMethods:
    """Mixin: torch's getters and setters of the dynamic rule, over the scaler's policy."""

    _policy: Policy
    _route: FusedRoute | None

    def _set_policy(self, policy: Policy) -> None:
        self._policy = policy
        if self._route is not None:
            self._route.set_policy(policy)

    def _set_rule(self, funcname: str, **changes: Any) -> None:
        if isinstance(self._policy, HeadroomPolicy):
            raise ScalerUsageError(
                f"{funcname}() changes the growth rule, but this scaler's policy is "
                f"{self._policy}, which sets the scale from measured gradients and has no "
                "growth rule; construct the scaler with the HeadroomPolicy you want, or with "
                "policy=ScalePolicy(...) for torch's rule."
            )
        if not isinstance(self._policy, ScalePolicy):
            raise ScalerUsageError(
                f"{funcname}() changes the dynamic rule, but this scaler's policy is "
                f"{self._policy}, whose scale never moves; construct the scaler with "
                "policy=ScalePolicy(...) to use a dynamic scale."
            )
        self._set_policy(replace(self._policy, **changes))

    def _rule(self) -> ScalePolicy:
        """The dynamic rule's numbers, as saved (:func:`~ampscaler.policy.torch_rule`)."""
        return torch_rule(self._policy)

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._rule().growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._set_rule("set_growth_factor", growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by after an overflow."""
        return self._rule().backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._set_rule("set_backoff_factor", backoff_factor=new_factor)

    @property
    def _growth_factor(self) -> float:
        return self._rule().growth_factor

    @_growth_factor.setter
    def _growth_factor(self, value: float) -> None:
        self._set_rule("_growth_factor", growth_factor=value)

    @property
    def _backoff_factor(self) -> float:
        return self._rule().backoff_factor

    @_backoff_factor.setter
    def _backoff_factor(self, value: float) -> None:
        self._set_rule("_backoff_factor", backoff_factor=value)

    @property
    def _growth_interval(self) -> int:
        return self._rule().growth_interval

    @_growth_interval.setter
    def _growth_interval(self, value: int) -> None:
        self._set_rule("_growth_interval", growth_interval=value)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._rule().growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        self._set_rule("set_growth_interval", growth_interval=new_interval)


def _ready_state() -> dict[str, Any]:
    return {"stage": TorchOptState.READY, "found_inf_per_device": {}}


class TorchPrivateMethods:
    """Mixin: torch's private per-optimizer bookkeeping and unscale helpers (module docstring)."""

    _state: LiveState | HostState
    _per_optimizer: dict[int, Any]  # the scaler's per-optimizer records (stage, found_inf)
    _live: Callable[[torch.device], LiveState]
    _record: Callable[[torch.optim.Optimizer, str], Any]

    @property
    def _per_optimizer_states(self) -> defaultdict[int, dict[str, Any]]:
        states: defaultdict[int, dict[str, Any]] = defaultdict(_ready_state)
        for key, record in self._per_optimizer.items():
            found = record.found_inf
            states[key] = {
                "stage": TorchOptState[record.stage.name],
                "found_inf_per_device": {} if found is None else {found.device: found},
            }
        return states

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        found: dict[torch.device, Any] = self._per_optimizer_states[id(optimizer)][
            "found_inf_per_device"
        ]
        return found

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # torch flags into copies of found_inf, one per device, and leaves found_inf as it was
        groups = collect(optimizer, allow_fp16=allow_fp16)
        return unscale_per_device_(groups, inv_scale, found_inf.clone())

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Any]:
        state = self._state
        if not isinstance(state, LiveState):
            raise ScalerUsageError(
                "_check_inf_per_device() before the scale was used: call "
                "scaler.scale(loss).backward() first."
            )
        ones = torch.ones((), dtype=torch.float32, device=state.device)
        flags = self._unscale_grads_(optimizer, ones, torch.zeros_like(ones), True)
        self._record(optimizer, "_check_inf_per_device").found_inf = combined_flag(
            flags, state.device
        )
        return flags

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        self._live(torch.device(dev)).unused_scale = None


def refuse_legacy_protocol(optimizer: torch.optim.Optimizer) -> None:
    """Refuse optimizers whose ``step`` takes torch's deprecated ``grad_scaler`` argument."""
    if _takes_grad_scaler(type(optimizer).step):
        raise TypeError(
            f"{type(optimizer).__name__}.step() takes a grad_scaler argument: the legacy "
            "protocol, deprecated by torch since 2.0, in which the optimizer drives the "
            "scaler. ampscaler hands optimizers optimizer.grad_scale and optimizer.found_inf "
            "instead; update the optimizer to read those, or use torch.amp.GradScaler for it."
        )


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether an optimizer class's ``step`` has torch's legacy ``grad_scaler`` parameter."""
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


def _device_type(device: object) -> str | None:
    if device is None or isinstance(device, torch.device):
        return None if device is None else device.type
    if not isinstance(device, str):
        # One line: a long repr (an optimizer's spans many lines) is named by its type.
        shown = repr(device)
        if isinstance(device, torch.optim.Optimizer):
            shown = (f"the optimizer {type(device).__name__}; the optimizer goes to "
                     "scaler.step(optimizer), not to GradScaler()")
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

    Like torch, ``"cuda"`` on a machine without CUDA warns and disables the scaler.

    Raises:
        InvalidConfigError: ``device`` is not a device.
    """
    enabled = bool(enabled)  # torch takes any truthy value (enabled=args.amp, numpy.bool_, 1)
    device_type = _device_type(device)
    if enabled and device_type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            "ampscaler.GradScaler is enabled for 'cuda', but CUDA is not available. Disabling "
            "(as torch.amp.GradScaler does); pass device='cpu' or None to scale on the CPU.",
            stacklevel=3,
        )
        return device_type, False
    return device_type, enabled


def scale_nested(
    outputs: object,
    scale_on: Callable[[torch.device], torch.Tensor],
    seen: Callable[[torch.Tensor], None],
) -> Any:
    """Every tensor in nested lists/tuples/iterables multiplied by ``scale_on(its device)``,
    each passed to ``seen`` first.

    Lists and tuples come back as the same type; other iterables as a lazy iterator (as in
    torch). The scale is fetched once per device.

    Raises:
        ValueError: a leaf that is not a tensor.
    """
    per_device: dict[torch.device, torch.Tensor] = {}

    def scaled(value: object) -> Any:
        if isinstance(value, torch.Tensor):
            seen(value)
            scale = per_device.get(value.device)
            if scale is None:
                scale = per_device[value.device] = scale_on(value.device)
            return value * scale
        if isinstance(value, Mapping):
            raise ValueError(
                "scale() takes a Tensor or a list/tuple of Tensors, not a dict (as torch's): "
                "scale the values, e.g. scaler.scale(list(losses.values())), or their sum."
            )
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ValueError(
                "outputs must be a Tensor or an iterable of Tensors, found a "
                f"{type(value).__name__}; pass the loss tensor(s) to scale()."
            )
        items = (scaled(item) for item in value)
        return type(value)(items) if isinstance(value, (list, tuple)) else items

    return scaled(outputs)


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


def step_fused(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step an optimizer that unscales by ``optimizer.grad_scale`` and skips on
    ``optimizer.found_inf`` inside its kernel; the attributes exist only during the step.
    Optimizers with torch's deprecated ``grad_scaler=`` protocol are refused.
    """
    refuse_legacy_protocol(optimizer)
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
