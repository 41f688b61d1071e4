"""GradScaler: the torch-compatible front, and the per-optimizer stage machine.

Each optimizer moves through three stages within an iteration::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()------------------------------^   (step() unscales itself when needed)

One step, as data, and who does each part (see docs/design.md)::

    scale(loss)      this module, reading the live scale          state.py
    collect          each optimizer's gradient views              grads/collect.py (grads/flat.py)
    check+unscale    found_inf on the device                      grads/check.py
    agree            found_inf max-reduced over the ranks         distributed.py
    decide           optimizer.step() or skip                     this module
    update           the policy moves the state in place          policy.py, state.py
    record           step records, reports, sinks                 observe/
"""

from __future__ import annotations

import enum
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch

from .checkpoint import CheckpointMethods, check_skip_limit, headroom_settings, policy_settings
from .compat import (
    TorchPolicyMethods,
    TorchPrivateMethods,
    TorchStateAccess,
    device_and_enabled,
    new_scale_value,
    scale_nested,
    step_fused,
)
from .distributed import GroupSpec, RankAgreement, SettingValue
from .errors import InvalidConfigError, PersistentOverflowError, ScalerUsageError
from .grads.check import FusedRoute, check_and_unscale_
from .grads.collect import GradGroups, collect
from .grads.flat import GradPlanner
from .guards import Guard, GuardSet
from .headroom import HeadroomMeter, check_alone
from .master import MasterWeightOptimizer
from .observe.api import ObserverMethods, StepOutcome
from .observe.monitor import Monitor
from .policy import HeadroomPolicy, Policy, policy_from_arguments, starting_scale
from .state import HostState, LiveState

__all__ = ["GradScaler", "OptState"]

GuardT = TypeVar("GuardT", bound=Guard)

BF16_MESSAGE = (
    "ampscaler: {what} bfloat16, whose range is float32's: bfloat16 needs no loss scaling. "
    "Turn the scaler off with GradScaler(enabled=False) (or drop it); it only costs time here."
)


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
    # The checked flag on the scale's device (agreed across ranks with a process group);
    # None before the check, or when the optimizer held no gradient.
    found_inf: torch.Tensor | None = None
    local_found_inf: torch.Tensor | None = None  # this rank's own flag, before agreement
    # The guards' verdict (0-dim float, > 0: skip although finite); None without guards.
    spike: torch.Tensor | None = None

    def skip_flag(self, found_inf: torch.Tensor) -> torch.Tensor:
        """The flag the step is decided by: ``found_inf``, or the guards' verdict with it."""
        return found_inf if self.spike is None else torch.maximum(found_inf, self.spike)


def _ignore(loss: torch.Tensor) -> None:
    """Keeps nothing (``scale()`` under ``torch.compile``)."""


def _sum(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """The flags added up (``None`` for none): > 0 iff any of them is."""
    total = None
    for flag in flags:
        total = flag if total is None else total + flag
    return total


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1/scale`` as torch's scaler forms it: in float64, rounded once to float32."""
    return scale.double().reciprocal().float()


class GradScaler(
    TorchStateAccess, TorchPolicyMethods, TorchPrivateMethods, ObserverMethods, CheckpointMethods
):
    """Dynamic loss scaling for mixed-precision training; a drop-in ``torch.amp.GradScaler``.

    ``scale(loss)`` multiplies the loss by the scale ``S`` so that small fp16 gradients do not
    flush to zero; ``step(optimizer)`` unscales the gradients, checks them for inf/NaN and runs
    ``optimizer.step()`` only when they are finite; ``update()`` moves ``S`` by the policy: by
    default it backs off after an overflow and grows after ``growth_interval`` clean steps.

    With its default arguments the results (parameters, scale, growth tracker) are bit for bit
    those of ``torch.amp.GradScaler``, its ``state_dict`` loads into torch's scaler and torch's
    loads into it. Arguments after ``enabled`` are ampscaler's own and keyword-only. The scale
    and the rest of the per-step state live in tensors on the device that are updated in
    place, so a compiled or captured graph that read them sees the live values.

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
        policy: how the scale moves, as an object: :class:`~ampscaler.ScalePolicy` (torch's
            rule, plus hysteresis and bounds), :class:`~ampscaler.StaticPolicy`, or
            :class:`~ampscaler.HeadroomPolicy` (set from measured gradients; it starts at its
            own ``first_scale``, not at ``init_scale``, and measures the models given to
            :meth:`watch`). The arguments ``growth_factor`` to ``growth_interval`` and
            ``hysteresis`` to ``dynamic`` are shorthands for it; pass one or the other.
        hysteresis: shorthand for :class:`~ampscaler.ScalePolicy`'s (``1``: torch's rule).
        min_scale: shorthand for :class:`~ampscaler.ScalePolicy`'s (``None``: no bound).
        max_scale: shorthand for :class:`~ampscaler.ScalePolicy`'s (``None``: no bound).
        dynamic: ``False`` is ``policy=StaticPolicy()``.
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from
            :meth:`update` once this many iterations in a row were skipped, instead of skipping
            forever. Setting it makes :meth:`update` read one counter from the device (a sync).
        history_size: shorthand for ``add_sink(StepHistory(history_size))`` (0: none).
        probe_every: shorthand for ``attach(GradientProbe(every=probe_every))``.
        trace_nonfinite: shorthand for ``attach(NonFiniteTracer())``.
        process_group: a ``torch.distributed`` group whose ranks must agree on overflow (FSDP,
            ZeRO, tensor or pipeline parallelism; not needed with DDP), or a list of groups
            whose union must (Megatron's tensor- and data-parallel groups): each optimizer's
            flag is max-reduced over them before the step decision. One all_reduce per group,
            optimizer and iteration; see :mod:`ampscaler.distributed` and docs/distributed.md.
        flat_grads: move gradients that stay the same tensors from step to step into one flat
            buffer per device and dtype, so the check runs as one kernel (see
            :mod:`ampscaler.grads.flat`). Off by default: it relocates the gradients' memory.

    Raises:
        InvalidConfigError: (a ``ValueError``) for arguments out of range, naming the argument;
            ``policy=`` together with its shorthands; a ``process_group`` while
            torch.distributed is not initialized, or one this rank is not a member of; at the
            first step, ranks of ``process_group`` whose settings or scale differ; a
            ``policy`` that is not a policy object.
    """

    #: Whether :meth:`unscale_` accepts float16 gradients (torch's sharded scaler does; a
    #: subclass sets it, see :class:`~ampscaler.ShardedGradScaler`).
    _unscale_allows_fp16: bool = False

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        policy: Policy | None = None,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        dynamic: bool = True,
        max_consecutive_skips: int | None = None,
        history_size: int = 0,
        probe_every: int | None = None,
        trace_nonfinite: bool = False,
        process_group: GroupSpec | None = None,
        flat_grads: bool = False,
    ) -> None:
        rule = {
            "growth_factor": growth_factor, "backoff_factor": backoff_factor,
            "growth_interval": growth_interval, "hysteresis": hysteresis,
            "min_scale": min_scale, "max_scale": max_scale,
        }  # fmt: skip
        self._policy = policy_from_arguments(policy, dynamic, rule)
        scale = self._init_scale = starting_scale(self._policy, init_scale)
        self._max_consecutive_skips = check_skip_limit(max_consecutive_skips)
        if not isinstance(flat_grads, bool):
            raise InvalidConfigError(f"flat_grads must be True or False, got {flat_grads!r}.")
        self._device, self._enabled = device_and_enabled(device, enabled)
        # Python values until the first scale() puts the state on a device, then LiveState.
        self._state: LiveState | HostState = HostState(scale, 0, self._policy.hysteresis)
        self._route: FusedRoute | None = None  # created with the live state
        self._per_optimizer: dict[int, _OptimizerRecord] = {}
        self._planner = GradPlanner() if flat_grads else None
        self._guards = GuardSet()
        self._last_outcome: StepOutcome | None = None
        self._outcomes: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepOutcome] = (
            weakref.WeakKeyDictionary()
        )
        self._warned_bf16 = False
        # Whether the scaler is used with bfloat16 is looked at in the first iteration only.
        self._first_iteration = True
        self._monitor = Monitor(enabled=self._enabled)
        self._meter: HeadroomMeter | None = None  # measures for a HeadroomPolicy
        self._checked_alone = False  # whether a meter without process_group was allowed
        self._follow(self._policy)
        self._agreement = None if process_group is None else RankAgreement(process_group)
        self._attach_shorthands(history_size, probe_every, trace_nonfinite)
        if self._enabled and self._device == "cpu":
            # Nothing to wait for on the CPU: made now, a compiled step sees one type of state
            # from its first call (no recompile when it would otherwise be made).
            self._live(torch.device("cpu"))

    # ------------------------------------------------------------------ state plumbing

    def _live(self, device: torch.device) -> LiveState:
        """The live state (settled), put on ``device`` by the first call."""
        state = self._state
        if isinstance(state, LiveState):
            state.settle()
            return state
        live = self._state = LiveState.from_host(self._policy, device, state)
        # As held on the host: a power of two here is one in float32 too; a value that only
        # rounds to one counts as unknown, which is safe (torch's route until the next read).
        self._route = FusedRoute(self._policy, live.scale, state.scale)
        if self._device is None:
            self._device = device.type
        return live

    def _agree_over(self, process_group: GroupSpec) -> None:
        """Agree on overflow over ``process_group`` from the next check on, as if it had been
        given to the constructor (for a subclass whose group is known only once
        torch.distributed is initialized: :class:`~ampscaler.ShardedGradScaler`)."""
        self._agreement = RankAgreement(process_group)

    def _require_state(self, funcname: str) -> LiveState:
        if not isinstance(self._state, LiveState) or self._state.unused_scale is not None:
            raise ScalerUsageError(
                f"Attempted {funcname}() but the scale was never used: call "
                "scaler.scale(loss).backward() earlier in the iteration, before "
                f"scaler.{funcname}()."
            )
        return self._state  # settled by scale(), which every iteration starts with

    def _set_policy(self, policy: Policy, iteration: int = 0) -> None:
        """Use ``policy`` from now on (a setter, a loaded checkpoint whose policy's own count
        of iterations is ``iteration``)."""
        super()._set_policy(policy)
        self._follow(policy, iteration)

    def _follow(self, policy: Policy, iteration: int = 0) -> None:
        """Measure for ``policy`` if it is a HeadroomPolicy, from its iteration ``iteration``."""
        if not isinstance(policy, HeadroomPolicy):
            if self._meter is not None:
                self._meter = None
                self._monitor.set_meter(None)
        elif self._meter is None:
            self._meter = HeadroomMeter(policy, iteration)
            self._monitor.set_meter(self._meter)
        else:
            self._meter.restart(policy, iteration)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if self._meter is not None:  # a copy's monitor starts without the meter
            self._monitor.set_meter(self._meter)

    def _saw(self, value: float) -> None:
        if self._route is not None:
            self._route.saw(value)  # renews what the fused route knows, for free

    def _record(self, optimizer: torch.optim.Optimizer, funcname: str) -> _OptimizerRecord:
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"scaler.{funcname}() expects a torch.optim.Optimizer (an object with "
                f"param_groups and step()), got {type(optimizer).__name__}."
            )
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
        # The losses are kept (not read) for the skip's cause and the guards; not under
        # torch.compile, where a growing list would change a compiled guard every iteration.
        compiling = torch.compiler.is_compiling()
        if not compiling and self._first_iteration and not self._warned_bf16:
            device = outputs.device.type if isinstance(outputs, torch.Tensor) else self._device
            self._warn_if_bf16_autocast(device or "cuda")
        if isinstance(outputs, torch.Tensor):
            if not compiling:
                self._monitor.note_loss(outputs)
            return outputs * self._scale_on(outputs.device)
        scaled: Iterable[torch.Tensor] = scale_nested(
            outputs, self._scale_on, _ignore if compiling else self._monitor.note_loss
        )
        return scaled

    def _warn_if_bf16_autocast(self, device_type: str) -> None:
        if (
            device_type in ("cpu", "cuda", "xpu")
            and torch.is_autocast_enabled(device_type)
            and torch.get_autocast_dtype(device_type) == torch.bfloat16
        ):
            self._warn_bf16("scale() was called inside an autocast region of")

    def _warn_bf16(self, what: str) -> None:
        self._warned_bf16 = True
        warnings.warn(BF16_MESSAGE.format(what=what), UserWarning, stacklevel=4)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        live = self._live(device)
        live.unused_scale = None  # from now on the scale is the float32 tensor's value
        scale = live.scale
        return scale if scale.device == device else scale.to(device, non_blocking=True)

    # ------------------------------------------------------------------ unscale and step

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
        record = self._record(optimizer, "unscale_")
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
        groups = self._collect(optimizer, state, allow_fp16=self._unscale_allows_fp16)
        self._check(groups, record, state, _reciprocal(state.scale))
        record.stage = OptState.UNSCALED

    def _collect(
        self, optimizer: torch.optim.Optimizer, state: LiveState, allow_fp16: bool
    ) -> GradGroups:
        """``optimizer``'s gradient views (this rank's shards of them), grouped for the check."""
        if isinstance(optimizer, MasterWeightOptimizer):
            optimizer.copy_grads_to_masters()  # the masters' gradients are the ones checked
        self._monitor.before_check(optimizer, state.scale)
        local = self._agreement is not None  # then this scaler reduces the flag itself
        if self._planner is not None:
            groups = self._planner.groups(optimizer, allow_fp16, local)
        else:
            groups = collect(optimizer, allow_fp16=allow_fp16, local=local)
        # Under torch.compile the flags are not read: a guard on them would recompile.
        if not torch.compiler.is_compiling() and self._first_iteration and not self._warned_bf16:
            dtypes = {dtype for per_dtype in groups.values() for dtype in per_dtype}
            if dtypes == {torch.bfloat16}:
                self._warn_bf16("every gradient of this optimizer is")
        return groups

    def _check(
        self,
        groups: GradGroups,
        record: _OptimizerRecord,
        state: LiveState,
        multiplier: torch.Tensor,
    ) -> None:
        """Multiply the gradients in ``groups`` by ``multiplier``, flag inf/NaN in ``record``,
        and start agreeing on the flag across ranks. No host sync."""
        found_inf = check_and_unscale_(groups, multiplier, state.device)
        if self._guards:
            record.spike = self._guards.check(
                record.optimizer,
                groups,
                multiplier * state.scale,
                self._monitor.loss(),
                self._agreement,
            )
        if self._agreement is not None:
            record.local_found_inf, found_inf = self._agreement.agree(
                found_inf, state.device, self._settings
            )
        record.found_inf = found_inf

    def _settings(self) -> dict[str, SettingValue]:
        """What ranks compare before they agree: the configuration and the live state."""
        state = self._require_state("step")
        return {
            **policy_settings(self._policy, self._max_consecutive_skips),
            **headroom_settings(self._policy),
            # A HeadroomPolicy's history is compared by its sum (one number per setting).
            **{name: t if t.dim() == 0 else t.sum() for name, t in state.tensors._asdict().items()},
        }

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale ``optimizer``'s gradients if needed, then step it unless they hold inf/NaN.

        ``*args`` and ``**kwargs`` go to ``optimizer.step``; its return value is returned, or
        ``None`` when the step was skipped. For optimizers that skip inside their own kernel
        (``_step_supports_amp_scaling``, e.g. ``Adam(fused=True)``) the scale and the inf flag
        are handed to the optimizer and nothing waits for the device; for all others, deciding
        whether to step reads one flag from the device (a host sync), as in torch.

        With torch's own fused optimizers and a power-of-two scale the check pass also unscales,
        sparing the kernel a write pass; results are bit for bit torch's, but after a *skipped*
        fused step the gradients are left unscaled (see :mod:`ampscaler.grads.check`).

        Under ``torch.compile`` it runs eagerly, as torch's ``step()`` does (one graph break;
        the optimizer's own step breaks the graph anyway). Call :meth:`unscale_` first to have
        the check traced into the compiled graph, with the clipping that usually follows.

        Raises:
            RuntimeError: a ``closure=`` keyword (closures re-evaluate an unscaled loss, which
                the scaler cannot check; as in torch, a closure passed positionally goes to
                ``optimizer.step``), or a second ``step()`` before ``update()``.
        """
        if torch.compiler.is_compiling():
            return self._eager_step(optimizer, *args, **kwargs)  # a graph break, on purpose
        return self._step(optimizer, *args, **kwargs)

    def _step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:  # a positional closure goes to the optimizer, as in torch
            raise RuntimeError(
                "Closure use is not currently supported if GradScaler is enabled: compute the "
                "loss, call scaler.scale(loss).backward(), then scaler.step(optimizer) without "
                "a closure."
            )
        state = self._require_state("step")
        record = self._record(optimizer, "step")
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() "
                "once per iteration, after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, record, state, args, kwargs)
        if record.stage is OptState.READY:
            self.unscale_(optimizer)
        return self._plain_step(optimizer, record, state, args, kwargs)

    # step() runs eagerly under torch.compile, as torch's does (without the disable wrapper's
    # cost on every eager call).
    _eager_step = torch.compiler.disable(_step)  # type: ignore[no-untyped-call]

    def _plain_step(
        self,
        optimizer: torch.optim.Optimizer,
        record: _OptimizerRecord,
        state: LiveState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Read the (agreed) flag and step or skip: one host sync."""
        found_inf = record.found_inf
        ranks: tuple[int, ...] = ()
        if found_inf is None:
            raise ScalerUsageError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call scaler.scale(loss).backward() on a loss that depends on the "
                "optimizer's parameters before scaler.step(optimizer)."
            )
        skip = record.skip_flag(found_inf)
        if self._agreement is not None:  # the group's verdict, and who overflowed
            skipped, ranks = self._agreement.decide(record.local_found_inf, skip)
        else:
            skipped = bool(skip.item())
        # Only a skipped step with a guard needs to know which flag it was: a second read.
        nonfinite = skipped if record.spike is None else skipped and bool(found_inf.item())
        self._outcome(optimizer, StepOutcome(nonfinite, skipped and not nonfinite))
        record.stage = OptState.STEPPED
        self._monitor.note_step(optimizer, nonfinite, state.scale, state.counters, ranks)
        return None if skipped else optimizer.step(*args, **kwargs)

    def _outcome(self, optimizer: torch.optim.Optimizer, outcome: StepOutcome) -> None:
        self._last_outcome = outcome
        self._outcomes[optimizer] = outcome

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        record: _OptimizerRecord,
        state: LiveState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        grad_scale: torch.Tensor | None = getattr(optimizer, "grad_scale", None)
        if record.stage is OptState.READY:
            assert self._route is not None  # created with the live state
            groups = self._collect(optimizer, state, allow_fp16=True)
            multiplier, grad_scale = self._route.plan(optimizer, groups)
            self._check(groups, record, state, multiplier)
        if self._agreement is not None:
            self._agreement.settle()  # the kernel must see the agreed flag
        found_inf = record.found_inf
        if found_inf is None:  # no gradients: nothing to step, nothing recorded for update()
            found_inf = torch.zeros((), dtype=torch.float32, device=state.device)
        retval = step_fused(optimizer, grad_scale, record.skip_flag(found_inf), args, kwargs)
        record.stage = OptState.STEPPED
        self._outcome(optimizer, StepOutcome(found_inf, record.spike))
        self._monitor.note_step(optimizer, found_inf, state.scale, state.counters)
        return retval

    # ------------------------------------------------------------------ update

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale at the end of an iteration, after every optimizer's ``step()``.

        Without ``new_scale`` the policy decides: back off if any optimizer saw inf/NaN (after
        the hysteresis budget), grow after ``growth_interval`` clean iterations. With
        ``new_scale`` (a float, or a one-element tensor of shape ``[]`` or ``[1]``) the scale is
        set to it; the value is copied, so later changes to the tensor do not affect the scaler.
        Either way the scale tensor is updated in place.

        No host sync, except: a tensor ``new_scale`` is read, ``max_consecutive_skips`` reads
        the skip counter, and consumers of step records (sinks, history, :meth:`on`) read the
        iteration's outcome in one sync. With a :class:`~ampscaler.HeadroomPolicy` and a
        ``process_group``, a measured iteration max-reduces its measurement over the group
        (one all_reduce, waited for as the inf flags are: with gloo the host waits); with a
        HeadroomPolicy ``update()`` runs eagerly under ``torch.compile`` (a graph break).

        Under ``torch.compile`` (with none of those three) it hands the iteration's flags to the
        live state and the next ``scale()`` applies them, so it compiles with no device work of
        its own; anything that reads the state applies a pending update first, so the values
        are the eager run's (docs/compiled.md).

        Raises:
            AssertionError / RuntimeError: no ``step()`` (or ``unscale_``) was recorded in this
                iteration (:class:`~ampscaler.ScalerUsageError` is both).
            ValueError: a ``new_scale`` that is not finite, not > 0, outside
                ``[min_scale, max_scale]``, not one element, or requires grad.
            PersistentOverflowError: ``max_consecutive_skips`` iterations in a row skipped.
        """
        if not self._enabled:
            return
        if self._meter is not None and torch.compiler.is_compiling():
            self._eager_update(new_scale)  # a graph break: the meter's schedule is Python
            return
        state = self._require_state("update")
        if self._agreement is not None:
            self._agreement.settle()
        flags = [r.found_inf for r in self._per_optimizer.values() if r.found_inf is not None]
        if new_scale is None and flags and self._defers_update():
            state.defer(self._policy, flags)
            self._moved_by_policy()
            # The live scale still holds the old value until the update is applied.
            self._end_iteration(flags[0], state.scale, state)
            return
        state.settle()  # an earlier update handed over under torch.compile comes first
        found_inf = _sum(flags)  # > 0 iff any optimizer overflowed
        spiked = (
            _sum([r.spike for r in self._per_optimizer.values() if r.spike is not None])
            if self._guards
            else None
        )
        if new_scale is not None:
            value = new_scale_value(new_scale, self._policy)
            old_scale = state.set_scale(value, found_inf, spiked)
            self._saw(value)
            if self._meter is not None:
                self._meter.skip()
        elif found_inf is None:
            raise ScalerUsageError(
                "No inf checks were recorded prior to update(). Call scaler.step(optimizer) "
                "for every optimizer of the iteration before scaler.update()."
            )
        else:
            measured = None if self._meter is None else self._measured(self._meter, state)
            old_scale = state.advance(self._policy, found_inf, spiked, measured)
            if self._meter is not None:
                self._meter.advance()
            self._moved_by_policy()
        if found_inf is None:
            self._per_optimizer = {}
            return
        if spiked is not None:
            self._guards.end_iteration((found_inf + spiked) > 0)
        self._end_iteration(found_inf, old_scale, state, spiked)
        if self._max_consecutive_skips is not None:
            self._check_persistent_overflow(state, self._max_consecutive_skips)

    # update() runs eagerly under torch.compile with a HeadroomPolicy (whose measuring
    # schedule is a Python count, which a compiled graph would be guarded on).
    _eager_update = torch.compiler.disable(update)  # type: ignore[no-untyped-call]

    def _measured(self, meter: HeadroomMeter, state: LiveState) -> torch.Tensor | None:
        """The iteration's measurement for a HeadroomPolicy (``None``: not measured), agreed
        across the ranks of ``process_group`` (an all_reduce of one value, on measured
        iterations only: every rank follows the same schedule)."""
        measured = meter.take(state.device)
        if measured is None:
            return None
        if self._agreement is not None:
            measured = self._agreement.launch(measured)
            self._agreement.settle()
        elif not self._checked_alone:
            self._checked_alone = True
            check_alone()
        return measured

    def _defers_update(self) -> bool:
        """Whether ``update()`` hands its work to the next read of the state: under
        ``torch.compile``, when no host read is due now (no step records consumed, no skip
        limit); see :meth:`LiveState.defer`."""
        return (
            torch.compiler.is_compiling()
            and self._max_consecutive_skips is None
            and not self._monitor.consuming
            and not self._guards
        )

    def _moved_by_policy(self) -> None:
        assert self._route is not None  # created with the live state
        self._route.updated()

    def _end_iteration(
        self,
        found_inf: torch.Tensor,
        old_scale: torch.Tensor,
        state: LiveState,
        spiked: torch.Tensor | None = None,
    ) -> None:
        self._per_optimizer = {}
        self._first_iteration = False
        self._monitor.after_update(found_inf, old_scale, state.scale, state.counters, spiked)

    def _check_persistent_overflow(self, state: LiveState, limit: int) -> None:
        in_a_row = int(state.counters.consecutive_skips.item())
        if in_a_row >= limit:
            raise PersistentOverflowError.after(
                in_a_row, limit, self.get_scale(), self.last_overflow
            )

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    def add_guard(self, guard: GuardT) -> GuardT:
        """Add a skip rule beyond inf/NaN (a :class:`~ampscaler.SpikeGuard`, or anything with
        the :class:`~ampscaler.guards.Guard` protocol); returns it.

        From the next ``step()`` on, each optimizer's step is also skipped when a guard says
        so; the scale does not back off for it. The verdict stays on the device (a fused
        optimizer's kernel gets it with the inf flag), so no host sync is added; with a guard,
        ``update()`` under ``torch.compile`` runs in the compiled graph instead of being
        handed to the next ``scale()``. See :mod:`ampscaler.guards`.

        Example:
            >>> import ampscaler
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.add_guard(ampscaler.SpikeGuard(sigma=6.0, window=128))
            SpikeGuard(sigma=6.0, window=128, warmup=128)

        Raises:
            TypeError: not a guard. ValueError: added already.
        """
        self._guards.add(guard)
        return guard

    # ------------------------------------------------------------------ configuration

    @property
    def policy(self) -> Policy:
        """The scale policy in force (read-only; use the setters or a new scaler to change it)."""
        return self._policy

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        return (
            f"GradScaler(device={self._device!r}, scale={self.get_scale():g}, "
            f"policy={self._policy})"
        )
