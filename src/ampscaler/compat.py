"""torch.amp.GradScaler's private names, for code that reaches for them.

Libraries and tests written against torch's scaler read a few of its private attributes. They
are given the values and effects torch gives them here, apart from the front class, so the
design of :class:`~ampscaler.GradScaler` stays readable. Each name, and who uses it:

==========================  ====================================================================
``_scale``                  the live scale tensor (``None`` before the first ``scale()``); torch's
                            CUDA-graph tests and pickling test read it
``_growth_tracker``         the live growth tracker tensor (``None`` before the first ``scale()``)
``_get_scale_async()``      the scale tensor without a sync (Accelerate, torch's tests)
``_get_growth_tracker()``   the growth tracker as an int (a host sync; torch's tests)
==========================  ====================================================================

Torch's public getters and setters of the dynamic rule (``get_growth_factor()``, ...) map onto
the scaler's :class:`~ampscaler.ScalePolicy` here too, and optimizers that still use torch's
deprecated ``grad_scaler=`` step protocol are recognized (and refused, see docs/migration.md).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .errors import ScalerUsageError
from .grads.check import FusedRoute
from .policy import Policy, ScalePolicy
from .state import HostState, LiveState

__all__ = ["TorchPolicyMethods", "TorchPrivateNames", "refuse_legacy_protocol"]


class TorchPrivateNames:
    """Mixin: torch's private names over the scaler's state (see the module docstring)."""

    _enabled: bool
    _state: LiveState | HostState

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        state = self._state
        return state.growth_tracker if isinstance(state, LiveState) else None

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (``None`` before the first ``scale()``)."""
        state = self._state
        return state.scale if isinstance(state, LiveState) else None

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (0 when disabled). A host sync."""
        if not self._enabled:
            return 0
        state = self._state
        if isinstance(state, LiveState):
            return int(state.growth_tracker.item())
        return state.growth_tracker


class TorchPolicyMethods:
    """Mixin: torch's getters and setters of the dynamic rule, over the scaler's policy."""

    _policy: Policy
    _route: FusedRoute | None

    def _set_policy(self, policy: Policy) -> None:
        self._policy = policy
        if self._route is not None:
            self._route.set_policy(policy)

    def _set_rule(self, funcname: str, **changes: Any) -> None:
        if not isinstance(self._policy, ScalePolicy):
            raise ScalerUsageError(
                f"{funcname}() changes the dynamic rule, but this scaler's policy is "
                f"{self._policy}, whose scale never moves; construct the scaler with "
                "policy=ScalePolicy(...) to use a dynamic scale."
            )
        self._set_policy(replace(self._policy, **changes))

    def _rule(self) -> ScalePolicy:
        """The dynamic rule's numbers (torch's defaults for a static policy, as saved)."""
        return self._policy if isinstance(self._policy, ScalePolicy) else ScalePolicy()

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

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._rule().growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        self._set_rule("set_growth_interval", growth_interval=new_interval)


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
