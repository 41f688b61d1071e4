"""torch.amp.GradScaler's private names, the only module that knows them.

Libraries and tests written against torch's scaler read a few of its private attributes.
:class:`TorchPrivateNames`, the one base class of :class:`~ampscaler.GradScaler`, gives them the
values and effects torch gives them, from the scaler's own parts: its state
(``self._state``, a :class:`~ampscaler.state.ScalerState`) and the iteration in progress
(``self._iteration``, an :class:`~ampscaler.iteration.Iteration`). Each name, and who uses it:

- ``_scale``, ``_growth_tracker``: the live tensors (``None`` before a device is known);
  torch's CUDA-graph tests and pickling test read them.
- ``_get_scale_async()``: the scale tensor without a sync (Accelerate, torch's tests);
  ``_get_growth_tracker()``: the growth tracker as an int (a host sync; torch's tests).
- ``_init_scale``, ``_init_growth_tracker``: the scale and growth tracker given at construction,
  loaded from a checkpoint, or held when the scaler was pickled (torch's pickling and
  state-dict tests).
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
- ``_enabled``: whether scaling is on (an attribute of the scaler itself).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Generic, TypeVar, cast

import torch
from torch.amp.grad_scaler import OptState as TorchOptState

from .errors import ScalerUsageError
from .grads.check import combined_flag, unscale_per_device_
from .grads.collect import collect
from .iteration import Iteration
from .policy.derived import torch_rule
from .state import ScalerState

__all__ = ["TorchPrivateNames"]

_N = TypeVar("_N", float, int)


def _ready_state() -> dict[str, Any]:
    return {"stage": TorchOptState.READY, "found_inf_per_device": {}}


class _RuleNumber(Generic[_N]):
    """``_growth_factor`` and friends: the policy's number of torch's rule, read and written
    (a write validated and applied as torch's setter of the same name would be)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = name.removeprefix("_")

    def __get__(self, scaler: TorchPrivateNames | None, owner: type) -> _N:
        # On the class (help(), inspect), the descriptor itself.
        if scaler is None:
            return cast(_N, self)
        return cast(_N, getattr(torch_rule(scaler._state.policy), self._field))

    def __set__(self, scaler: TorchPrivateNames, value: _N) -> None:
        scaler._state.change_rule(f"_{self._field}", **{self._field: value})


class TorchPrivateNames:
    """torch's private names over the scaler's state and iteration (module docstring).

    What it reads of the scaler, and nothing else: ``_enabled``, ``_state`` and
    ``_iteration``.
    """

    _enabled: bool
    _state: ScalerState
    _iteration: Iteration
    _init_scale: float
    _init_growth_tracker: int

    # ------------------------------------------------------------------ the state

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        live = self._state.live
        return None if live is None else live.growth_tracker

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (``None`` before a device is known)."""
        live = self._state.live
        return None if live is None else live.scale

    def _get_growth_tracker(self) -> int:
        """The growth tracker as an int (0 when disabled). A host sync."""
        return self._state.growth_tracker_value() if self._enabled else 0

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        self._state.use(torch.device(dev))

    # ------------------------------------------------------------------ the rule

    _growth_factor = _RuleNumber[float]()
    _backoff_factor = _RuleNumber[float]()
    _growth_interval = _RuleNumber[int]()

    # ------------------------------------------------------------------ per optimizer

    @property
    def _per_optimizer_states(self) -> defaultdict[int, dict[str, Any]]:
        states: defaultdict[int, dict[str, Any]] = defaultdict(_ready_state)
        for key, record in self._iteration.records.items():
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
        live = self._state.live
        if live is None:
            raise ScalerUsageError(
                "_check_inf_per_device() before the scale was used: call "
                "scaler.scale(loss).backward() first."
            )
        ones = torch.ones((), dtype=torch.float32, device=live.device)
        flags = self._unscale_grads_(optimizer, ones, torch.zeros_like(ones), True)
        record = self._iteration.record(optimizer, "_check_inf_per_device")
        record.found_inf = combined_flag(flags, live.device)
        return flags
