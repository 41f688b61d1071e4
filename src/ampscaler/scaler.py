"""GradScaler: the torch-compatible front, and the per-optimizer stage machine.

Each optimizer moves through three stages within an iteration::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()------------------------------^   (step() unscales itself when needed)

The scale policy lives in :mod:`ampscaler.policy`, the gradient work in :mod:`ampscaler.grads`;
this module only sequences them and keeps torch's semantics, exceptions and ``state_dict`` keys.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import torch

from .counters import FIELDS, ScalerStats, StepCounters
from .diagnostics import OverflowReport
from .distributed import RankAgreement, local_shards
from .errors import (
    InvalidConfigError,
    InvalidStateDictError,
    PersistentOverflowError,
    ScalerUsageError,
)
from .gradplan import GradPlanner
from .grads import GradGroups, check_and_unscale_
from .master import MasterWeightOptimizer
from .policy import ScalePolicy, ScaleState, adjust, float32_value, initial_state
from .pow2 import Pow2Watch
from .records import StepRecord
from .telemetry import Callback, Monitor, Sink

__all__ = ["GradScaler", "OptState"]

SinkT = TypeVar("SinkT", bound=Sink)

_TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


@functools.lru_cache(maxsize=64)
def _takes_grad_scaler(step: Callable[..., Any]) -> bool:
    """Whether an optimizer class's ``step`` has torch's legacy ``grad_scaler`` parameter."""
    try:
        return "grad_scaler" in inspect.signature(step).parameters
    except (TypeError, ValueError):  # no introspectable signature
        return False


# torch's fused optimizers, whose kernels divide each gradient by ``grad_scale`` (when given)
# in float32/float64 arithmetic before using it, and touch ``grad_scale`` nowhere else.
_DIVIDING_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)

# Gradient dtypes the fused kernels compute in as they are: unscaling one in the check pass
# rounds exactly as the kernel's division would. (float16/bfloat16 would round to their
# own precision in the check, where the kernel divides in float32.)
_WIDE_FLOATS = frozenset((torch.float32, torch.float64))


def _kernel_divides_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's fused optimizers (possibly wrapped by
    :class:`~ampscaler.MasterWeightOptimizer`) and has no ``grad_scale`` of its own."""
    if hasattr(optimizer, "grad_scale"):
        return False
    stepping = optimizer.inner if isinstance(optimizer, MasterWeightOptimizer) else optimizer
    return type(stepping) in _DIVIDING_FUSED


def _all_wide(groups: GradGroups) -> bool:
    return all(dtype in _WIDE_FLOATS for per_dtype in groups.values() for dtype in per_dtype)


class OptState(enum.Enum):
    """Where an optimizer is within the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class _OptimizerRecord:
    # Held so that the id() this record is keyed by cannot be reused within the iteration.
    optimizer: torch.optim.Optimizer
    stage: OptState = OptState.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    local_found_inf: torch.Tensor | None = None  # this rank's own flag, before agreement


def _sum_flags(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """The sum of inf flags (> 0 iff any was set), ``None`` for none; no host sync."""
    if not flags:
        return None
    combined = flags[0]
    for flag in flags[1:]:
        combined = combined + flag
    return combined


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1/scale`` as torch's scaler forms it: in float64, rounded once to float32."""
    return scale.double().reciprocal().float()


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` (non-blocking), without a dispatch when it is there already."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _device_type(device: str | torch.device | None) -> str | None:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    if not isinstance(device, str):
        raise InvalidConfigError(
            f"device must be a device type string such as 'cpu' or 'cuda', a torch.device, or "
            f"None, got {device!r}."
        )
    try:
        return torch.device(device).type
    except RuntimeError as error:
        raise InvalidConfigError(
            f"device {device!r} is not a torch device type; use 'cpu', 'cuda', 'mps', 'xpu', ... "
            "or None for the device of the first scaled tensor."
        ) from error


def _check_skip_limit(limit: object) -> int | None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InvalidConfigError(
            f"max_consecutive_skips must be an int >= 1 or None, got {limit!r}."
        )
    return limit


class GradScaler:
    """Dynamic loss scaling for mixed-precision training; a drop-in ``torch.amp.GradScaler``.

    ``scale(loss)`` multiplies the loss by the scale ``S`` so that small fp16 gradients do not
    flush to zero; ``step(optimizer)`` unscales the gradients, checks them for inf/NaN and runs
    ``optimizer.step()`` only when they are finite; ``update()`` moves ``S``: it backs off after
    an overflow and grows after ``growth_interval`` clean steps.

    With its default arguments the results (parameters, scale, growth tracker) are bit for bit
    those of ``torch.amp.GradScaler``, its ``state_dict`` loads into torch's scaler and torch's
    loads into it. Arguments after ``enabled`` are ampscaler's own and keyword-only.

    Example:
        >>> import torch
        >>> from ampscaler import GradScaler
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scaler = GradScaler("cpu", init_scale=1024.0)
        >>> with torch.autocast("cpu", dtype=torch.float16):
        ...     loss = model(torch.ones(2, 4)).float().pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.unscale_(opt)                 # optional: to clip or inspect gradients
        >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> scaler.get_scale(), scaler.last_step_skipped
        (1024.0, False)

    Args:
        device: device type the scaler runs on ("cpu", "cuda", ...), or ``None`` for the device
            of the first tensor passed to :meth:`scale`. Like torch, ``"cuda"`` on a machine
            without CUDA warns and disables the scaler.
        init_scale: the initial scale.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale after an overflow (in (0, 1)).
        growth_interval: clean steps in a row before the scale grows (>= 1).
        enabled: ``False`` makes every method a pass-through: ``scale`` returns its input,
            ``step`` calls ``optimizer.step``, ``get_scale`` returns 1.0.
        hysteresis: overflows absorbed before the scale backs off; refilled when it grows.
            Every overflowing step is skipped regardless. ``1`` is torch's rule.
        min_scale: the scale never backs off below this.
        max_scale: the scale never grows above this.
        dynamic: ``False`` keeps the scale at ``init_scale``; non-finite steps are still skipped.
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from
            :meth:`update` once this many iterations in a row were skipped, instead of skipping
            forever. Setting it makes :meth:`update` read one counter from the device (a sync).
        history_size: keep the last ``history_size`` step records in :attr:`history`
            (0: none). Like a sink, it makes :meth:`update` sync once per iteration.
        probe_every: measure gradient underflow and headroom on every ``probe_every``-th
            iteration (see :mod:`ampscaler.probe`); ``None``: never, and nothing is hooked.
        trace_nonfinite: hook the leaf modules of watched models to name, in overflow
            reports, the first module whose backward produced inf/NaN (costs work on every
            backward; see docs/diagnostics.md).
        process_group: a ``torch.distributed`` process group whose ranks must agree on overflow:
            each optimizer's inf/NaN flag is max-reduced over it before the step decision, so
            all its ranks step or skip together and keep identical scales. Needed when ranks
            hold different gradients (FSDP, ZeRO, tensor or pipeline parallelism); not with
            DDP, whose gradients are already all-reduced. Construct the scaler after
            ``init_process_group``, with the same arguments on every rank, and call its methods
            in the same order on every rank. Costs one asynchronous all_reduce per optimizer
            and iteration, plus host syncs at the first step (the ranks' settings are compared)
            and on skipped steps (the ranks that overflowed are gathered for the report). See
            ``docs/distributed.md``.

    Raises:
        InvalidConfigError: (a ``ValueError``) for arguments out of range, naming the argument;
            a ``process_group`` while torch.distributed is not initialized, or one this rank is
            not a member of; at the first step, ranks of ``process_group`` whose settings or
            scale differ (naming the differences).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        max_consecutive_skips: int | None = None,
        history_size: int = 0,
        probe_every: int | None = None,
        trace_nonfinite: bool = False,
        process_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        self._policy = ScalePolicy(
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            dynamic=dynamic,
        )
        self._init_scale = self._policy.check_scale("init_scale", init_scale)
        max_consecutive_skips = _check_skip_limit(max_consecutive_skips)
        if not isinstance(enabled, bool):
            raise InvalidConfigError(f"enabled must be True or False, got {enabled!r}.")
        self._max_consecutive_skips = max_consecutive_skips
        self._device = _device_type(device)
        self._enabled = enabled
        if enabled and self._device == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "ampscaler.GradScaler is enabled for 'cuda', but CUDA is not available. Disabling "
                "(as torch.amp.GradScaler does); pass device='cpu' or None to scale on the CPU.",
                stacklevel=2,
            )
            self._enabled = False
        # Device state, created lazily on the device of the first scaled tensor.
        self._state: ScaleState | None = None
        self._counters: StepCounters | None = None
        self._pow2: Pow2Watch | None = None  # created with the state
        # What the device state starts from when it is created (or re-created after unpickling).
        self._init_growth_tracker = 0
        self._init_hysteresis_left = hysteresis
        self._init_stats = ScalerStats()
        self._per_optimizer: dict[int, _OptimizerRecord] = {}
        self._planner = GradPlanner()
        self._last_found_inf: torch.Tensor | bool | None = None
        self._monitor = Monitor(
            enabled=self._enabled,
            history_size=history_size,
            probe_every=probe_every,
            trace_nonfinite=trace_nonfinite,
        )
        self._agreement = None if process_group is None else RankAgreement(process_group)

    # ------------------------------------------------------------------ state plumbing

    def _create_state(self, device: torch.device) -> ScaleState:
        self._state = initial_state(
            self._policy,
            self._init_scale,
            device,
            growth_tracker=self._init_growth_tracker,
            hysteresis_left=self._init_hysteresis_left,
        )
        self._counters = StepCounters(device, self._init_stats)
        self._pow2 = Pow2Watch(self._policy, device)
        self._pow2.saw(float32_value(self._init_scale))
        if self._device is None:
            self._device = device.type
        return self._state

    def _require_state(self, funcname: str) -> ScaleState:
        if self._state is None:
            raise ScalerUsageError(
                f"Attempted {funcname}() but the scale was never used: call "
                "scaler.scale(loss).backward() earlier in the iteration, before "
                f"scaler.{funcname}()."
            )
        return self._state

    def _record(self, optimizer: torch.optim.Optimizer) -> _OptimizerRecord:
        record = self._per_optimizer.get(id(optimizer))
        if record is None:
            record = self._per_optimizer[id(optimizer)] = _OptimizerRecord(optimizer)
        return record

    # ------------------------------------------------------------------ scale

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...

    def scale(
        self, outputs: torch.Tensor | Iterable[torch.Tensor]
    ) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiply a tensor, or every tensor in nested lists/tuples/iterables, by the scale.

        Lists and tuples come back as the same type; other iterables come back as a lazy
        iterator (as in torch). Disabled: returns ``outputs`` unchanged. No host sync.

        Example:
            >>> scaler = GradScaler("cpu", init_scale=8.0)
            >>> scaler.scale([torch.tensor(1.0), (torch.tensor(2.0),)])
            [tensor(8.), (tensor(16.),)]

        Raises:
            ValueError: a leaf that is not a tensor.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale_on(outputs.device)
        scaled: Iterable[torch.Tensor] = self._scale_nested(outputs, {})
        return scaled

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        state = self._state if self._state is not None else self._create_state(device)
        return _on(state.scale, device)

    def _scale_nested(
        self, value: object, per_device: dict[torch.device, torch.Tensor]
    ) -> Any:
        if isinstance(value, torch.Tensor):
            scale = per_device.get(value.device)
            if scale is None:
                scale = per_device[value.device] = self._scale_on(value.device)
            return value * scale
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise ValueError(
                "outputs must be a Tensor or an iterable of Tensors, found a "
                f"{type(value).__name__}; pass the loss tensor(s) to scale()."
            )
        scaled = (self._scale_nested(item, per_device) for item in value)
        if isinstance(value, (list, tuple)):
            return type(value)(scaled)
        return scaled

    # ------------------------------------------------------------------ unscale and step

    def _check_optimizer(self, optimizer: object, funcname: str) -> None:
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"scaler.{funcname}() expects a torch.optim.Optimizer (an object with "
                f"param_groups and step()), got {type(optimizer).__name__}."
            )

    def _prepare_grads(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
        # Optimizers that keep float32 master weights (ampscaler.MasterWeightOptimizer) copy
        # the model's low-precision gradients onto the masters before they are checked.
        copy_grads = getattr(optimizer, "copy_grads_to_masters", None)
        if copy_grads is not None:
            copy_grads()
        self._monitor.before_check(optimizer, scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, and check them for inf/NaN.

        Optional: :meth:`step` unscales by itself. Call it to clip or inspect true gradients
        between ``backward()`` and :meth:`step`, once per optimizer per iteration, after all
        gradients of the iteration have been accumulated. No host sync.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu", init_scale=4.0)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.unscale_(opt)
            >>> model.bias.grad
            tensor([1.])

        Raises:
            RuntimeError: called twice for ``optimizer`` in one iteration, or after ``step()``.
            ValueError: a float16 gradient (see :class:`~ampscaler.MasterWeightOptimizer`).

        Sparse gradients in float16 are coalesced, replacing their ``.grad``.
        """
        if not self._enabled:
            return
        state = self._require_state("unscale_")
        self._check_optimizer(optimizer, "unscale_")
        record = self._record(optimizer)
        if record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(). "
                "Call it at most once per optimizer per iteration, after the last backward()."
            )
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(). Call scaler.unscale_(optimizer) "
                "before scaler.step(optimizer), or not at all: step() unscales by itself."
            )
        groups = self._gather_grads(optimizer, state, allow_fp16=False)
        self._check_grads(groups, record, state, _reciprocal(state.scale))
        record.stage = OptState.UNSCALED

    def _gather_grads(
        self, optimizer: torch.optim.Optimizer, state: ScaleState, allow_fp16: bool
    ) -> GradGroups:
        """``optimizer``'s gradients (this rank's shards of them), grouped for the check."""
        self._prepare_grads(optimizer, state.scale)
        groups = self._planner.groups(optimizer, allow_fp16=allow_fp16)
        return groups if self._agreement is None else local_shards(groups)

    def _check_grads(
        self,
        groups: GradGroups,
        record: _OptimizerRecord,
        state: ScaleState,
        multiplier: torch.Tensor,
    ) -> None:
        """Multiply the gradients in ``groups`` by ``multiplier``, flag inf/NaN in ``record``,
        and start agreeing on the flag across ranks. No host sync."""
        found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
        record.found_inf_per_device = check_and_unscale_(groups, multiplier, found_inf)
        self._agree(record, state)

    def _agree(self, record: _OptimizerRecord, state: ScaleState) -> None:
        """With a process group: start max-reducing ``record``'s flag over it (no host sync).

        A rank whose optimizer holds no gradients takes part with a zero flag. The first call
        also checks that every rank has the same settings (a host sync, once).
        """
        agreement = self._agreement
        if agreement is None:
            return
        device = state.scale.device
        if not agreement.checked:
            agreement.check_settings(
                {
                    **dataclasses.asdict(self._policy),
                    "max_consecutive_skips": self._max_consecutive_skips,
                    **state._asdict(),
                }
            )
        local = (
            self._combined_found_inf(record, device)
            if record.found_inf_per_device
            else torch.zeros((), dtype=torch.float32, device=device)
        )
        record.local_found_inf = local
        record.found_inf_per_device = {device: agreement.launch(local)}

    def _combined_found_inf(self, record: _OptimizerRecord, device: torch.device) -> torch.Tensor:
        combined = _sum_flags([_on(f, device) for f in record.found_inf_per_device.values()])
        if combined is None:
            raise ScalerUsageError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call scaler.scale(loss).backward() on a loss that depends on the "
                "optimizer's parameters before scaler.step(optimizer)."
            )
        return combined

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale ``optimizer``'s gradients if needed, then step it unless they hold inf/NaN.

        ``*args`` and ``**kwargs`` go to ``optimizer.step``; its return value is returned, or
        ``None`` when the step was skipped. For optimizers that skip inside their own kernel
        (``_step_supports_amp_scaling``, e.g. ``Adam(fused=True)``) the scale and the inf flag
        are handed to the optimizer and nothing waits for the device; for all others, deciding
        whether to step reads one flag from the device (a host sync), as in torch.

        With torch's own fused optimizers (Adam, AdamW, SGD, Adagrad), float32/float64
        gradients and a scale that is a power of two (torch's defaults keep it one), the check
        pass also unscales the gradients and the optimizer gets no ``grad_scale``: its kernel
        then reads the gradients without writing them back, one pass less than torch's route.
        Parameters and optimizer state come out bit for bit the same (see :mod:`ampscaler.pow2`);
        the one visible difference is that after a *skipped* step the gradients are unscaled,
        as on the plain route, where torch's fused route leaves them scaled.

        Raises:
            RuntimeError: a ``closure`` (closures re-evaluate an unscaled loss, which the
                scaler cannot check), or a second ``step()`` before ``update()``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: compute the "
                "loss, call scaler.scale(loss).backward(), then scaler.step(optimizer) without "
                "a closure."
            )
        state = self._require_state("step")
        self._check_optimizer(optimizer, "step")
        record = self._record(optimizer)
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() "
                "once per iteration, after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, record, state, args, kwargs)
        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        if self._agreement is not None:
            self._agreement.settle()  # the decision below needs the agreed flag
        found_inf = self._combined_found_inf(record, state.scale.device)
        skipped = bool(found_inf.item())
        self._last_found_inf = skipped
        record.stage = OptState.STEPPED
        self._monitor.note_step(optimizer, skipped, state.scale, self._counters)
        if skipped:
            if self._agreement is not None and record.local_found_inf is not None:
                # Every rank skipped together; name the ranks that overflowed (a collective).
                ranks = self._agreement.ranks_with_overflow(record.local_found_inf)
                self._monitor.note_ranks(ranks)
            return None
        return optimizer.step(*args, **kwargs)

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        record: _OptimizerRecord,
        state: ScaleState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if _takes_grad_scaler(type(optimizer).step):
            raise TypeError(
                f"{type(optimizer).__name__}.step() takes a grad_scaler argument: the legacy "
                "protocol, deprecated by torch since 2.0, in which the optimizer drives the "
                "scaler. ampscaler hands optimizers optimizer.grad_scale and optimizer.found_inf "
                "instead; update the optimizer to read those, or use torch.amp.GradScaler for it."
            )
        grad_scale: torch.Tensor | None
        if record.stage is OptState.READY:
            groups = self._gather_grads(optimizer, state, allow_fp16=True)
            if (
                self._pow2 is not None
                and self._pow2.exact
                and _kernel_divides_grads(optimizer)
                and _all_wide(groups)
            ):
                # The scale is a power of two, so multiplying by its reciprocal here rounds
                # exactly as the kernel's division would: unscale in the check pass (which
                # writes the gradients anyway) and spare the kernel a second write of them.
                # (1/scale is exact in float32 here: no need to form it in float64 first.)
                self._check_grads(groups, record, state, state.scale.reciprocal())
                grad_scale = None
            else:
                # Check only (as torch does): the kernel unscales with grad_scale as it steps.
                ones = torch.ones((), dtype=torch.float32, device=state.scale.device)
                self._check_grads(groups, record, state, ones)
                grad_scale = state.scale * getattr(optimizer, "grad_scale", 1)
        else:
            grad_scale = getattr(optimizer, "grad_scale", None)
        if self._agreement is not None:
            self._agreement.settle()  # the kernel must see the agreed flag
        if record.found_inf_per_device:
            found_inf = self._combined_found_inf(record, state.scale.device)
        else:
            # No gradients: nothing to step, and (as in torch) nothing recorded for update().
            found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
        record.stage = OptState.STEPPED
        self._last_found_inf = found_inf
        self._monitor.note_step(optimizer, found_inf, state.scale, self._counters)
        return retval

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale at the end of an iteration, after every optimizer's ``step()``.

        Without ``new_scale`` the policy decides: back off if any optimizer saw inf/NaN (after
        the hysteresis budget), grow after ``growth_interval`` clean iterations. With
        ``new_scale`` (a float, or a one-element tensor of shape ``[]`` or ``[1]``) the scale is
        set to it; the value is copied, so later changes to the tensor do not affect the scaler.

        No host sync, except: validating a tensor ``new_scale`` reads it,
        ``max_consecutive_skips`` reads the skip counter, and while step records are consumed
        (``history_size``, :meth:`add_sink`, :meth:`on`) the iteration's outcome is read in
        one sync (plus localization on a skipped step).

        Raises:
            AssertionError / RuntimeError: no ``step()`` (or ``unscale_``) was recorded in this
                iteration (:class:`~ampscaler.ScalerUsageError` is both).
            ValueError: a ``new_scale`` that is not finite, not > 0, outside
                ``[min_scale, max_scale]``, not one element, or requires grad.
            PersistentOverflowError: ``max_consecutive_skips`` iterations in a row skipped.
        """
        if not self._enabled:
            return
        state = self._require_state("update")
        if self._agreement is not None:
            self._agreement.settle()
        found_inf = _sum_flags(
            [
                _on(flag, state.scale.device)
                for record in self._per_optimizer.values()
                for flag in record.found_inf_per_device.values()
            ]
        )
        if new_scale is not None:
            value = self._new_scale_value(new_scale)
            scale = torch.full((), value, dtype=torch.float32, device=state.scale.device)
            new_state = state._replace(scale=scale)
        elif found_inf is None:
            raise ScalerUsageError(
                "No inf checks were recorded prior to update(). Call scaler.step(optimizer) "
                "for every optimizer of the iteration before scaler.update()."
            )
        else:
            new_state = adjust(self._policy, state, found_inf)
        if found_inf is not None and self._counters is not None:
            self._counters.record(found_inf, state.scale, new_state.scale)
        self._state = new_state
        self._per_optimizer = {}
        if self._pow2 is not None:
            if new_scale is not None:
                self._pow2.saw(value)
            else:
                self._pow2.updated(new_state.scale)
        if found_inf is not None and self._counters is not None:
            self._monitor.after_update(found_inf, state.scale, new_state.scale, self._counters)
        if self._max_consecutive_skips is not None and found_inf is not None:
            self._check_persistent_overflow()

    def _new_scale_value(self, new_scale: float | torch.Tensor) -> float:
        """The validated ``new_scale`` as the float32 value the scale will hold."""
        if isinstance(new_scale, torch.Tensor):
            if new_scale.numel() != 1 or new_scale.requires_grad:
                raise InvalidConfigError(
                    "new_scale should be a float or a 1-element tensor with requires_grad=False, "
                    f"got a tensor of shape {list(new_scale.shape)} with "
                    f"requires_grad={new_scale.requires_grad}."
                )
            new_scale = float(new_scale.item())
        return float32_value(self._policy.check_scale("new_scale", new_scale))

    def _check_persistent_overflow(self) -> None:
        assert self._counters is not None and self._max_consecutive_skips is not None
        in_a_row = int(self._counters.tensor()[FIELDS.index("consecutive_skips")].item())
        if in_a_row < self._max_consecutive_skips:
            return
        report = self.last_overflow
        found = report.kinds.values() if report is not None else ()
        kinds = {part for kind in found for part in kind.split("+")}
        spelled = [word for kind, word in (("inf", "inf"), ("nan", "NaN")) if kind in kinds]
        held = " and ".join(spelled) if spelled else "inf/NaN"
        nan_hint = (
            " NaN that persists at a small scale is a bug in the model or the data (a log of "
            "0, a division by zero, a bad sample), not an overflow: look there first."
            if "nan" in kinds
            else ""
        )
        where = f" Affected: {report}." if report is not None and report.names else ""
        raise PersistentOverflowError(
            f"{in_a_row} optimizer steps in a row were skipped because the gradients held "
            f"{held} (max_consecutive_skips={self._max_consecutive_skips}); the scale is now "
            f"{self.get_scale():g}.{where}{nan_hint} What usually helps: a lower learning rate "
            "or warm-up, gradient clipping after scaler.unscale_(), checking the loss for "
            "inf/NaN before backward(), or training in bfloat16, whose range needs no scaling."
        )

    # ------------------------------------------------------------------ observation

    def get_scale(self) -> float:
        """The current scale as a Python float; 1.0 when disabled. A host sync.

        Example:
            >>> GradScaler("cpu", init_scale=128.0).get_scale()
            128.0
        """
        if not self._enabled:
            return 1.0
        if self._state is None:
            return self._init_scale
        value = float(self._state.scale.item())
        if self._pow2 is not None:
            self._pow2.saw(value)  # renews what the fused path knows, for free
        return value

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor without a sync (``None`` before the first ``scale()``)."""
        return None if self._state is None else self._state.scale

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return None if self._state is None else self._state.growth_tracker

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._state is None:
            return self._init_growth_tracker
        return int(self._state.growth_tracker.item())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent :meth:`step` skipped ``optimizer.step()`` (False before any).

        Use it to keep LR schedulers and weight averages in step with the parameters::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped:
                scheduler.step()
                ema.update_parameters(model)

        A host sync on the fused-optimizer path (it reads the inf flag handed to the kernel);
        free otherwise, since the decision already read it.
        """
        found = self._last_found_inf
        if isinstance(found, torch.Tensor):
            found = self._last_found_inf = bool(found.item())
        return bool(found)

    @property
    def last_overflow(self) -> OverflowReport | None:
        """Which parameters held inf/NaN in the latest iteration, or ``None`` if it was clean.

        The iteration is the one in progress once it has called :meth:`step`, otherwise the
        last one that reached :meth:`update`; the report covers all of its optimizers.
        Parameters are named as :meth:`watch` learned them.

        Plain optimizers are localized inside :meth:`step` when it skips (it already knows).
        Fused optimizers (``Adam(fused=True)``) decide inside their kernel, so nothing is
        known without a host sync: their overflow is localized when this property is first
        read (or at :meth:`update` when step records are consumed). Read it before
        ``optimizer.zero_grad()``; afterwards the gradients are gone and the report can only
        say that the step overflowed. Clean iterations never run a localization pass.

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu")
            >>> scaler.watch(model)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> model.bias.grad.fill_(float("nan"))
            tensor([nan])
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> print(scaler.last_overflow)
            step 0: non-finite gradients at scale 65536 in 1 parameter(s): bias (nan)
        """
        return self._monitor.last_overflow(self._counters)

    @property
    def history(self) -> list[StepRecord]:
        """The last ``history_size`` step records, oldest first (empty when it is 0).

        Example:
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = GradScaler("cpu", init_scale=256.0, history_size=100)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> record = scaler.history[-1]
            >>> record.step, record.scale, record.skipped
            (0, 256.0, False)
        """
        return self._monitor.history

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` at the end of :meth:`update` when ``event`` happened.

        Events: ``"step"`` (every iteration), ``"overflow"`` (skipped), ``"backoff"`` (the
        scale went down), ``"growth"`` (it went up). ``fn`` gets the
        :class:`~ampscaler.StepRecord`. Registering a callback makes :meth:`update` sync once
        per iteration. Returns a function that unregisters ``fn``.

        Example:
            >>> scaler = GradScaler("cpu")
            >>> stop = scaler.on("overflow", lambda record: print(record.overflow))
            >>> stop()

        Raises:
            ValueError: an unknown event (:class:`~ampscaler.InvalidConfigError`).
            TypeError: ``fn`` is not callable.
        """
        return self._monitor.on(event, fn)

    def add_sink(self, sink: SinkT) -> SinkT:
        """Send every step record to ``sink`` (an object with ``write(record)``); returns it.

        Attaching a sink makes :meth:`update` sync once per iteration. See
        :mod:`ampscaler.sinks`.

        Example:
            >>> from ampscaler import LoggingSink
            >>> scaler = GradScaler("cpu")
            >>> sink = scaler.add_sink(LoggingSink("train"))
            >>> scaler.remove_sink(sink)

        Raises:
            TypeError: ``sink`` has no ``write`` method.
        """
        self._monitor.add_sink(sink)
        return sink

    def remove_sink(self, sink: Sink) -> None:
        """Stop sending records to ``sink`` (without closing it).

        Raises:
            ValueError: ``sink`` is not attached.
        """
        self._monitor.remove_sink(sink)

    @property
    def stats(self) -> ScalerStats:
        """Counters so far: steps, skipped, growths, backoffs, consecutive_skips. A host sync.

        Example:
            >>> GradScaler("cpu").stats
            ScalerStats(steps=0, skipped=0, growths=0, backoffs=0, consecutive_skips=0)
        """
        if self._counters is None:
            return self._init_stats
        return self._counters.stats()

    def watch(self, *models: torch.nn.Module, **named_models: torch.nn.Module) -> None:
        """Learn parameter names from ``models`` so overflow reports can name them.

        Keyword arguments prefix the names, which keeps several models apart
        (``watch(encoder=enc, decoder=dec)`` names ``decoder.fc.weight``). With
        ``probe_every`` or ``trace_nonfinite`` set, the models' leaf modules are also hooked.
        Without ``watch()``, reports name parameters by position (``group0.param3``).

        Example:
            >>> scaler = GradScaler("cpu")
            >>> scaler.watch(torch.nn.Linear(2, 2))
            >>> scaler.watch(head=torch.nn.Linear(2, 1))
        """
        for model in models:
            self._monitor.watch(model)
        for prefix, model in named_models.items():
            self._monitor.watch(model, prefix)

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    # ------------------------------------------------------------------ configuration

    def _replace_policy(self, **changes: Any) -> None:
        self._policy = dataclasses.replace(self._policy, **changes)
        if self._pow2 is not None:
            self._pow2.set_policy(self._policy)

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps."""
        return self._policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._replace_policy(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by after an overflow."""
        return self._policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._replace_policy(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (>= 1)."""
        self._replace_policy(growth_interval=new_interval)

    @property
    def policy(self) -> ScalePolicy:
        """The scale policy in force (read-only; use the setters or a new scaler to change it)."""
        return self._policy

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys plus ampscaler's policy state and counters.

        Torch's ``GradScaler.load_state_dict`` reads the five keys it knows and ignores the
        rest, so this loads into torch's scaler too. Empty when disabled. A host sync. Take it
        after :meth:`update`.

        Example:
            >>> sorted(GradScaler("cpu").state_dict())[:5]
            ['_growth_tracker', '_hysteresis_tracker', 'backoff_factor', 'dynamic', 'growth_factor']
        """
        if not self._enabled:
            return {}
        hysteresis_left = (
            self._init_hysteresis_left
            if self._state is None
            else int(self._state.hysteresis_left.item())
        )
        return {
            "scale": self.get_scale(),
            "growth_factor": self._policy.growth_factor,
            "backoff_factor": self._policy.backoff_factor,
            "growth_interval": self._policy.growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            "hysteresis": self._policy.hysteresis,
            "_hysteresis_tracker": hysteresis_left,
            "min_scale": self._policy.min_scale,
            "max_scale": self._policy.max_scale,
            "dynamic": self._policy.dynamic,
            "max_consecutive_skips": self._max_consecutive_skips,
            "stats": self.stats.as_dict(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler``.

        Like torch, the checkpoint's configuration (factors, interval, and here also
        hysteresis, bounds, ``dynamic`` and ``max_consecutive_skips`` when present) replaces
        the constructor's. A torch state dict leaves ampscaler's own options as constructed
        and starts the counters at 0. No-op when disabled.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler).
            KeyError / ValueError: a dict that is not a scaler's, or holds invalid values
                (:class:`~ampscaler.InvalidStateDictError` is both).
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"load_state_dict() expects the dict returned by state_dict(), got "
                f"{type(state_dict).__name__}."
            )
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler. Save the state of an enabled scaler, or skip loading."
            )
        missing = [key for key in _TORCH_KEYS if key not in state_dict]
        if missing:
            raise InvalidStateDictError(
                f"This is not a GradScaler state dict: it lacks {missing}. Pass the dict "
                "returned by scaler.state_dict() (torch's or ampscaler's)."
            )
        policy = self._policy
        try:
            policy = ScalePolicy(
                growth_factor=state_dict["growth_factor"],
                backoff_factor=state_dict["backoff_factor"],
                growth_interval=state_dict["growth_interval"],
                hysteresis=state_dict.get("hysteresis", policy.hysteresis),
                min_scale=state_dict.get("min_scale", policy.min_scale),
                max_scale=state_dict.get("max_scale", policy.max_scale),
                dynamic=state_dict.get("dynamic", policy.dynamic),
            )
            scale = policy.check_scale("scale", state_dict["scale"])
            tracker = state_dict["_growth_tracker"]
            budget = state_dict.get("_hysteresis_tracker", policy.hysteresis)
            limit = _check_skip_limit(
                state_dict.get("max_consecutive_skips", self._max_consecutive_skips)
            )
            counts = state_dict.get("stats", {})
            if not isinstance(counts, Mapping):
                raise InvalidConfigError(f"stats must be a dict of counters, got {counts!r}.")
            checked = [("_growth_tracker", tracker), ("_hysteresis_tracker", budget)]
            checked += [(f"stats[{key!r}]", value) for key, value in counts.items()]
            for name, value in checked:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidConfigError(f"{name} must be an int >= 0, got {value!r}.")
            if budget > policy.hysteresis:
                raise InvalidConfigError(
                    f"_hysteresis_tracker must not exceed hysteresis ({policy.hysteresis}), "
                    f"got {budget}."
                )
            stats = ScalerStats(**counts)
        except (InvalidConfigError, TypeError) as error:
            raise InvalidStateDictError(f"Invalid GradScaler state dict: {error}") from error
        self._policy = policy
        self._max_consecutive_skips = limit
        self._init_scale = scale
        self._init_growth_tracker = tracker
        self._init_hysteresis_left = budget
        self._init_stats = stats
        if self._state is not None:
            self._create_state(self._state.scale.device)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if self._per_optimizer:
                raise ScalerUsageError(
                    "A GradScaler instance may only be pickled at the beginning of an iteration, "
                    "or at the end after scaler.update()."
                )
            saved = self.state_dict()
            state["_init_scale"] = saved["scale"]
            state["_init_growth_tracker"] = saved["_growth_tracker"]
            state["_init_hysteresis_left"] = saved["_hysteresis_tracker"]
            state["_init_stats"] = self.stats
            state["_state"] = None
            state["_counters"] = None
            state["_pow2"] = None
            state["_last_found_inf"] = self.last_step_skipped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        return (
            f"GradScaler(device={self._device!r}, scale={self.get_scale():g}, "
            f"policy={self._policy})"
        )

