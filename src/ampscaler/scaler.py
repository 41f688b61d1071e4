"""GradScaler: torch's API, the per-optimizer stage machine, and the composition of the parts.

One step, as data, and who does each part (see docs/design.md)::

    scale(loss)      this module, reading the live scale                state.py
    collect          each optimizer's gradient views                    grads/collect.py
    check+unscale    found_inf on the device                            grads/check.py
    guard            other skip rules join found_inf on the device      guards.py
    agree            found_inf max-reduced over the ranks               distributed.py
    decide           optimizer.step() or skip                           this module (grads/fused.py)
    update           the policy moves the state in place                policy/, state.py
    record           step records, reports, sinks                       observe/

What one iteration gathers (per-optimizer records, the losses, the outcome) is an
:class:`~ampscaler.iteration.Iteration`; the moving values are the
:class:`~ampscaler.state.ScalerState`. Everything optional plugs in through a small protocol: the
policy (:class:`~ampscaler.Policy`, and the meter a measuring policy asks for), guards
(:class:`~ampscaler.guards.Guard`), observers (:class:`~ampscaler.observe.monitor.Monitor`),
optimizer wrappers that prepare their gradients (``prepare_grads_for_scaler()``), and the opt-in
performance routes (``flat_grads``, ``one_pass_fused``).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import torch

from .arguments import (
    check_attempts,
    check_skip_limit,
    check_switch,
    device_and_enabled,
    new_scale_value,
    refusing_removed_options,
    starting_scale,
)
from .checkpoint import from_state_dict, to_state_dict
from .compat import TorchPrivateNames
from .distributed import (
    NO_GROUP,
    Agreement,
    GroupSpec,
    RankAgreement,
    SettingValue,
    agreement_for,
    refuse_alone,
    warn_if_world_came_later,
)
from .errors import PersistentOverflowError, ScalerUsageError
from .grads.check import check_and_unscale_
from .grads.collect import GradGroups, collect
from .grads.flat import GradPlanner
from .grads.fused import FusedRoute, step_fused
from .guards import GuardSet
from .hooks import Check, Hook, HookList, MeterHook, VetoCause
from .hostcopy import read_values
from .iteration import (
    Attempt,
    Iteration,
    OptimizerRecord,
    OptState,
    SkipReason,
    StepOutcome,
)
from .observe.monitor import Callback, CollapseCallback, Monitor, RecordCallback
from .observe.sinks import Sink
from .policy import Policy, policy_from_arguments
from .policy.derived import torch_rule
from .precision import Bfloat16Watch
from .replay import gallop_scale, retry_scale
from .state import HostState, LiveState, ScalerState, ScalerStats
from .taps import WatchedModels
from .wrap import unwrap as unwrap_loop
from .wrap import wrap as wrap_loop

if TYPE_CHECKING:
    from .observe.localize import OverflowReport

__all__ = ["GradScaler", "OptState"]


def _deprecated(old: str, new: str) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (removed in the next release)."""
    warnings.warn(
        f"GradScaler.{old} is deprecated and will be removed in the next release; use {new} "
        "instead.",
        DeprecationWarning,
        stacklevel=3,
    )


SinkT = TypeVar("SinkT", bound="Sink")
PluginT = TypeVar("PluginT")


def _reciprocal(live: LiveState, iteration: Iteration) -> torch.Tensor:
    """``1/scale`` as torch's scaler forms it: in float64, rounded once to float32. The float64
    copy of the scale that takes is kept as ``iteration.start_scale`` (``update()`` counts the
    iteration from it, and a second optimizer's reciprocal starts from it). On a device without
    float64 it is formed in float32, which gives the same value for every power-of-two scale
    (the default policy keeps one). No host sync."""
    if live.float64:
        start = iteration.start_scale
        if start is None:
            start = iteration.start_scale = live.scale.double()
        return start.reciprocal().float()
    return live.scale.reciprocal()


def _scale_nested(
    outputs: object,
    scale_on: Callable[[torch.device], torch.Tensor],
    seen: Callable[[torch.Tensor], None],
) -> Any:
    """Every tensor in nested lists/tuples/iterables multiplied by ``scale_on(its device)``,
    each passed to ``seen`` first. Lists and tuples come back as the same type; other
    iterables as a lazy iterator (as in torch). The scale is fetched once per device.

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


#: Whether this build of torch has torch.distributed (it cannot change while running).
_DISTRIBUTED = torch.distributed.is_available()


def _distributed_started() -> bool:
    """Whether torch.distributed runs a process group in this process (no collective)."""
    return _DISTRIBUTED and torch.distributed.is_initialized()


#: The first try of a batch, by ``max_attempts``: made once (a clean batch's only try).
_FIRST_TRIES: dict[int, Attempt] = {}


def _outlier_start(
    carried: float | torch.Tensor | None, start: torch.Tensor | None
) -> float | None:
    """``attempts()``, at a batch's second overflow: the scale it started at (``start``) where
    that is the one the batch before stepped at (``carried``), so that the scale carries the
    run's batches and this batch is an outlier, to be given it back; ``None`` otherwise. Reads
    the device copies (a host sync each)."""
    if carried is None or start is None:
        return None
    value = float(start)
    return value if float(carried) == value else None


#: Where a replayed batch's try from the third on runs: from the scale that last overflowed,
#: the try's number counted from the batch's first overflow, and the tries left.
_LaterTry = Callable[[float, int, int], float]


def _later_tries(outlier: bool, skipped: int) -> _LaterTry | None:
    """``attempts()``, at a batch's second overflow: where its later tries run. A guessed scale
    is searched below; an outlier gallops down in a warm-up (its first overflow is the run's
    first skip, ``skipped == 1``) and runs at the policy's backoffs after it (``None``)."""
    if not outlier:
        return lambda failed, retry, tries_left: retry_scale(failed, tries_left)
    if skipped == 1:
        return lambda failed, retry, tries_left: gallop_scale(failed, retry)
    return None


def _first_try(limit: int) -> Attempt:
    first = _FIRST_TRIES.get(limit)
    if first is None:
        first = _FIRST_TRIES.setdefault(limit, Attempt(0, limit))
    return first


class OneRank:
    """The :class:`~ampscaler.distributed.Agreement` of a rank that decides alone (no
    ``process_group``): the verdict is the rank's own flag, read where the step needs it.

    Args:
        look_for_world: at the first check, warn if torch.distributed turned out to run
            several ranks (``process_group=None`` given before ``init_process_group()``).
    """

    ranks: RankAgreement | None = None
    local_shards = False
    flags_losses = False

    def __init__(self, look_for_world: bool = False) -> None:
        self._look_for_world = look_for_world

    def agree(
        self,
        record: OptimizerRecord,
        found_inf: torch.Tensor | None,
        iteration: Iteration,
        device: torch.device,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> None:
        """The verdict is the check's flag."""
        record.found_inf = found_inf
        if self._look_for_world:
            self._look_for_world = False
            warn_if_world_came_later()

    def read_early(self, record: OptimizerRecord) -> bool | None:
        """A plain optimizer's flag, read now (the host sync its step needs anyway); ``None``
        for a fused optimizer, whose kernel takes the flag, or one without gradients."""
        found_inf = record.found_inf
        if found_inf is None or getattr(record.optimizer, "_step_supports_amp_scaling", False):
            return None
        return bool(found_inf.item())

    def decide(
        self,
        record: OptimizerRecord,
        iteration: Iteration,
        settings: Callable[[], Mapping[str, SettingValue]],
    ) -> bool:
        """Whether the step is skipped: known from ``unscale_()``, or read now (a host sync)."""
        found_inf, spike = record.found_inf, record.spike
        assert found_inf is not None, "step() refuses an optimizer without gradients"
        if record.known_overflow is not None and spike is None:
            return record.known_overflow
        skip = found_inf if spike is None else torch.maximum(found_inf, spike)
        return bool(skip.item())

    def before_kernel(self, record: OptimizerRecord, iteration: Iteration) -> None:
        """The check's flag is final."""

    #: The iteration's flags as checked: ``flags(iteration)`` is ``iteration.checked_flags()``
    #: (no frame of its own in every ``update()``).
    flags = staticmethod(Iteration.checked_flags)

    def moved(self) -> None:
        """Nothing to compare with."""

    def loaded(self) -> None:
        """Nothing to compare with."""

    def refuse_alone(self, reason: str) -> None:
        """Raise if this rank is one of several (:func:`~ampscaler.distributed.refuse_alone`)."""
        refuse_alone(reason)

    def max_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value``: this rank is the only one."""
        return value


class GradScaler(TorchPrivateNames):
    """Dynamic loss scaling for mixed-precision training; a drop-in ``torch.amp.GradScaler``.

    ``scale(loss)`` multiplies the loss by the scale ``S`` so that small fp16 gradients do not
    flush to zero; ``step(optimizer)`` unscales the gradients, checks them for inf/NaN and runs
    ``optimizer.step()`` only when they are finite; ``update()`` moves ``S`` by the policy: by
    default it backs off after an overflow and grows after ``growth_interval`` clean steps.

    With its default arguments the results (parameters, gradients, optimizer state, scale,
    growth tracker) are bit for bit those of ``torch.amp.GradScaler``, its ``state_dict`` loads
    into torch's scaler and torch's loads into it. Arguments after ``enabled`` are ampscaler's
    own and keyword-only. The scale and the rest of the per-step state live in tensors on the
    device that are updated in place, so a compiled or captured graph that read them sees the
    live values.

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
        init_scale: the initial scale (at least ``2**-126``, where unscaling stays exact).
        growth_factor: multiplies the scale after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplies the scale after an overflow (in (0, 1)).
        growth_interval: clean steps in a row before the scale grows (in [1, 2**31 - 1]).
        enabled: ``False`` makes every method a pass-through: ``scale`` returns its input,
            ``step`` calls ``optimizer.step``, ``get_scale`` returns 1.0.
        policy: how the scale moves, as an object: :class:`~ampscaler.ScalePolicy` (torch's
            rule, plus hysteresis and bounds), :class:`~ampscaler.StaticPolicy`,
            :class:`~ampscaler.HeadroomPolicy` (set from measured gradients; it starts at its
            own ``first_scale``, not at ``init_scale``, and measures the models given to
            :meth:`watch`), or a policy of your own (:class:`~ampscaler.Policy`). The
            arguments ``growth_factor`` to ``growth_interval`` and ``hysteresis`` to
            ``max_scale`` are shorthands for a :class:`~ampscaler.ScalePolicy`; pass one or
            the other.
        hysteresis: shorthand for :class:`~ampscaler.ScalePolicy`'s (``1``: torch's rule).
        min_scale: shorthand for :class:`~ampscaler.ScalePolicy`'s (``None``: no bound).
        max_scale: shorthand for :class:`~ampscaler.ScalePolicy`'s (``None``: no bound).
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from
            :meth:`update` once this many iterations in a row were skipped, instead of skipping
            forever. Setting it makes :meth:`update` read one counter from the device (a sync).
        process_group: a ``torch.distributed`` group whose ranks must agree on overflow (FSDP,
            ZeRO, tensor or pipeline parallelism; not needed with DDP), or a list of groups
            whose union must (Megatron's tensor- and data-parallel groups): each optimizer's
            flag is max-reduced over them before the step decision. Left out (or ``None``): no
            agreement; a ``None`` given before ``init_process_group()``, when
            ``torch.distributed.group.WORLD`` is still ``None``, warns at the first step if this
            process then turns out to be one of several ranks. One all_reduce per group,
            optimizer and iteration; see :mod:`ampscaler.distributed` and docs/distributed.md.
        flat_grads: an opt-in speed-up for many small gradients: move gradients that stay the
            same tensors from step to step into one flat buffer per device and dtype, so the
            check runs as one kernel (see :mod:`ampscaler.grads.flat`; it flattens only where
            that pays). Off by default: it relocates the gradients' memory.
        one_pass_fused: an opt-in speed-up for torch's fused optimizers: with a power-of-two
            scale, unscale in the pass that checks the gradients and hand the kernel no
            ``grad_scale`` (parameters stay bit for bit torch's; after a *skipped* step the
            gradients are left unscaled, where torch leaves them scaled). See
            :mod:`ampscaler.grads.fused`.

    Raises:
        InvalidConfigError: (a ``ValueError``) for arguments out of range, naming the argument;
            ``policy=`` together with its shorthands; a ``process_group`` while
            torch.distributed is not initialized, or one this rank is not a member of; at a
            step, ranks of ``process_group`` whose settings, scale or loaded checkpoints
            differ (every rank raises); a ``policy`` that is not a policy object.
    """

    #: Whether :meth:`unscale_` accepts float16 gradients (torch's sharded scaler does; a
    #: subclass sets it, see :class:`~ampscaler.ShardedGradScaler`).
    _unscale_allows_fp16: bool = False
    #: Whether float16 gradients are collected for ``_unscale_grads_`` to refuse or not (an
    #: override of it, or one assigned to the scaler, is handed torch's ``allow_fp16`` and
    #: decides, as in torch; see :mod:`ampscaler.compat`).
    _fp16_to_override: bool = False
    #: Whether an optimizer with gradients on no rank of ``process_group`` is refused, as
    #: torch's ``GradScaler`` refuses one without gradients (torch's sharded scaler steps it as
    #: clean; :class:`~ampscaler.ShardedGradScaler` sets it ``False``).
    _refuses_unchecked: bool = True
    #: Whether :meth:`unscale_` reads a plain optimizer's flag at once (``False`` where a
    #: subclass's ``unscale_`` may still change the flags after it, as torch's sharded scaler
    #: does: then ``step()`` reads them; see :mod:`ampscaler.compat`).
    _reads_early: bool = True

    @refusing_removed_options
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
        max_consecutive_skips: int | None = None,
        process_group: GroupSpec | None = NO_GROUP,
        flat_grads: bool = False,
        one_pass_fused: bool = False,
    ) -> None:
        rule = {
            "growth_factor": growth_factor, "backoff_factor": backoff_factor,
            "growth_interval": growth_interval, "hysteresis": hysteresis,
            "min_scale": min_scale, "max_scale": max_scale,
        }  # fmt: skip
        chosen = policy_from_arguments(policy, rule)
        start = starting_scale(chosen, init_scale)
        self._max_consecutive_skips = check_skip_limit(max_consecutive_skips)
        self._gather: Callable[..., GradGroups] = collect  # one walk over the gradients
        self._planner: GradPlanner | None = None
        if check_switch("flat_grads", flat_grads):  # or flat buffers (opt-in: grads/flat.py)
            self._planner = GradPlanner()
            self._gather = self._planner.groups
        self._fused = FusedRoute(one_pass=check_switch("one_pass_fused", one_pass_fused))
        self._device, self._enabled = device_and_enabled(device, enabled)
        self._agreement: Agreement = agreement_for(process_group, self._refuses_unchecked, OneRank)
        if self._enabled:  # torch's constructor keeps no start when disabled
            self._keep_start(start, 0)
        self._state = ScalerState(chosen, start)
        self._iteration = Iteration()
        self._finished: Iteration | None = None  # the last iteration update() ended
        # The scale the last batch under attempts() stepped at, where the policy set it (its
        # first or second try): a device copy or a float; None where no batch carried one.
        self._carried: float | torch.Tensor | None = None
        self._hooks = HookList()
        self._observers = self._hooks.add(Monitor())  # reports, sinks...
        self._hooks.add(GuardSet())  # skip rules: costs nothing until it holds a guard
        self._watched = WatchedModels()  # for the policy's meter
        self._add_meter(chosen, 0)
        # Whether the scaler is used with bfloat16 is looked at in the first iteration only.
        self._bf16 = Bfloat16Watch()
        if self._enabled and self._device == "cpu":
            # Nothing to wait for on the CPU: made now, a compiled step sees one type of state
            # from its first call (no recompile when it would otherwise be made).
            self._state.on(torch.device("cpu"))

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
            RuntimeError: an optimizer was unscaled (``unscale_``) and not yet stepped in this
                iteration (stricter than torch: :class:`~ampscaler.ScalerUsageError`).
        """
        if not self._enabled:
            return outputs
        compiling = torch.compiler.is_compiling()
        if not compiling and self._iteration.records:
            self._iteration.require_none_unscaled()
        # The losses are kept (not read) for the skip's cause and the guards.
        if not compiling and self._bf16.active:
            self._bf16.look_at_loss(outputs, self._device)
        if isinstance(outputs, torch.Tensor):
            self._keep_loss(outputs, compiling)
            return outputs * self._scale_on(outputs.device)
        scaled: Iterable[torch.Tensor] = _scale_nested(
            outputs, self._scale_on, lambda loss: self._keep_loss(loss, compiling)
        )
        return scaled

    def _keep_loss(self, loss: torch.Tensor, compiling: bool) -> None:
        iteration = self._iteration
        iteration.keep_loss(loss, flag=self._agreement.flags_losses)
        if not compiling:  # a Python count read under torch.compile would be guarded on
            for hook in self._hooks.at_scale:
                hook.at_scale(iteration)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._device is None:
            self._device = device.type  # the first scaled tensor's
        scale = self._state.use(device).scale
        return scale if scale.device == device else scale.to(device, non_blocking=True)

    # ------------------------------------------------------------------ unscale and step

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place, and check them for inf/NaN.

        Optional: :meth:`step` unscales by itself. Call it to clip or inspect true gradients
        between ``backward()`` and :meth:`step`, once per optimizer per iteration, after all
        gradients of the iteration have been accumulated.

        For a plain (not fused) optimizer it reads the check's flag at once: the one host sync
        the :meth:`step` decision needs anyway, taken here instead (so a step still costs one),
        so that an overflow is examined while the gradients are as the check saw them, before
        clipping turns an inf into NaN (``inf * 0``). No host sync for a fused optimizer, with
        a ``process_group`` (the flag is agreed in ``step()``), or under ``torch.compile``
        (where ``unscale_`` traces into the graph).

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
        live = self._state.require("unscale_")
        record = self._iteration.record(optimizer, "unscale_")
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
        self._unscale(record, live)
        if self._reads_early and not torch.compiler.is_compiling():
            record.known_overflow = self._agreement.read_early(record)
            if record.known_overflow:  # heard now, while the gradients are as checked
                record.reported = True
                for hook in self._hooks.on_skip:
                    hook.on_skip(self._iteration, record, live)

    def _unscale(self, record: OptimizerRecord, live: LiveState) -> None:
        allow_fp16 = self._unscale_allows_fp16
        groups = self._collect(record, live, allow_fp16)
        self._check(groups, record, live, _reciprocal(live, self._iteration), allow_fp16)
        record.stage = OptState.UNSCALED

    def _collect(self, record: OptimizerRecord, live: LiveState, allow_fp16: bool) -> GradGroups:
        """``optimizer``'s gradient views (this rank's shards of them), grouped for the check."""
        optimizer = record.optimizer
        prepare = getattr(optimizer, "prepare_grads_for_scaler", None)
        if prepare is not None:
            prepare()  # e.g. master weights: the gradients checked are the masters'
        for hook in self._hooks.before_check:
            hook.before_check(record, live.scale)
        local = self._agreement.local_shards
        groups = self._gather(
            optimizer, allow_fp16=allow_fp16 or self._fp16_to_override, local=local
        )
        # Under torch.compile the flags are not read: a guard on them would recompile.
        if not torch.compiler.is_compiling() and self._bf16.active:
            self._bf16.look_at_gradients({dtype for per in groups.values() for dtype in per})
        return groups

    def _check(
        self,
        groups: GradGroups,
        record: OptimizerRecord,
        live: LiveState,
        multiplier: torch.Tensor,
        allow_fp16: bool,
    ) -> None:
        """Multiply the gradients in ``groups`` by ``multiplier``, flag inf/NaN in ``record``,
        and start agreeing on the flag across ranks. No host sync."""
        found_inf = self._unscale_and_check(record, groups, multiplier, live.device, allow_fp16)
        iteration = self._iteration
        for hook in self._hooks.after_check:
            unscaled_by = multiplier * live.scale
            check = Check(iteration, record, groups, unscaled_by, live, self._agreement.ranks)
            veto = hook.after_check(check)
            if veto is not None:
                iteration.veto(record, veto)
        self._agreement.agree(record, found_inf, iteration, live.device, self._settings)
        iteration.scale = live.scale

    def _settings(self) -> dict[str, SettingValue]:
        """What ranks compare before they agree: the configuration and the live state."""
        return {
            **self._state.comparable(),
            "max_consecutive_skips": self._max_consecutive_skips,
        }

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale ``optimizer``'s gradients if needed, then step it unless they hold inf/NaN.

        ``*args`` and ``**kwargs`` go to ``optimizer.step``; its return value is returned, or
        ``None`` when the step was skipped. For optimizers that skip inside their own kernel
        (``_step_supports_amp_scaling``, e.g. ``Adam(fused=True)``) the scale and the inf flag
        are handed to the optimizer and nothing waits for the device; for all others, deciding
        whether to step reads one flag from the device (a host sync, as in torch; made by
        :meth:`unscale_` when it ran).

        Under ``torch.compile`` it runs eagerly, as torch's ``step()`` does (one graph break;
        the optimizer's own step breaks the graph anyway). Call :meth:`unscale_` first to have
        the check traced into the compiled graph, with the clipping that usually follows.

        Raises:
            RuntimeError: a ``closure=`` keyword (closures re-evaluate an unscaled loss, which
                the scaler cannot check; as in torch, a closure passed positionally goes to
                ``optimizer.step``), or a second ``step()`` before ``update()``.
        """
        if torch.compiler.is_compiling():
            return _step_eagerly(self, optimizer, *args, **kwargs)  # a graph break, on purpose
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
        live = self._state.require("step")
        record = self._iteration.record(optimizer, "step")
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(). Call scaler.update() "
                "once per iteration, after stepping every optimizer."
            )
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(record, live, args, kwargs)
        if record.stage is OptState.READY:
            self._unscale_in_step(record, live)
        return self._plain_step(record, live, args, kwargs)

    def _plain_step(
        self,
        record: OptimizerRecord,
        live: LiveState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Read the (agreed) flag and step or skip: one host sync."""
        found_inf = record.found_inf
        if found_inf is None:
            raise ScalerUsageError(
                "No inf checks were recorded for this optimizer: none of its parameters has a "
                "gradient. Call scaler.scale(loss).backward() on a loss that depends on the "
                "optimizer's parameters before scaler.step(optimizer)."
            )
        iteration = self._iteration
        skipped = self._agreement.decide(record, iteration, self._settings)
        # Only a skipped step with a guard needs to know which flag it was: a second read.
        nonfinite = skipped if record.spike is None else skipped and bool(found_inf.item())
        self._stepped(record, nonfinite, skipped and not nonfinite, live)
        if nonfinite and not record.reported:
            if record.origin is None:  # not told by the agreement: this rank's own
                record.origin = iteration.loss_origin()
            for hook in self._hooks.on_skip:
                hook.on_skip(iteration, record, live)
        return self._step_optimizer(record, skipped, args, kwargs)

    # What torch's scaler does through methods a subclass may override (``unscale_``,
    # ``_unscale_grads_``, ``_maybe_opt_step``): a subclass that overrides one of those gets
    # these routed through it (ampscaler.compat).

    #: ``step()``'s unscale of a plain optimizer that ``unscale_()`` did not unscale.
    _unscale_in_step = _unscale

    def _unscale_and_check(
        self,
        record: OptimizerRecord,
        groups: GradGroups,
        multiplier: torch.Tensor,
        device: torch.device,
        allow_fp16: bool,
    ) -> torch.Tensor | None:
        """The check of ``record``'s gradients (``groups``, as collected with ``allow_fp16``):
        their flag on ``device``, ``None`` for no gradients. No host sync."""
        return check_and_unscale_(groups, multiplier, device)

    def _step_optimizer(
        self, record: OptimizerRecord, skipped: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``record``'s optimizer's own ``step`` unless the step is ``skipped``."""
        return None if skipped else record.optimizer.step(*args, **kwargs)

    def _fused_step(
        self,
        record: OptimizerRecord,
        live: LiveState,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        optimizer = record.optimizer
        grad_scale: torch.Tensor | None = getattr(optimizer, "grad_scale", None)
        if record.stage is OptState.READY:
            groups = self._collect(record, live, allow_fp16=True)
            one_pass = self._fused.one_pass
            if one_pass:  # watched from the first fused step on: nothing to pay before
                self._state.watch_powers_of_two()
            exact = one_pass and self._state.exact_reciprocal
            multiplier, grad_scale = self._fused.plan(optimizer, groups, live.scale, exact)
            self._check(groups, record, live, multiplier, allow_fp16=True)
        self._agreement.before_kernel(record, self._iteration)
        found_inf = record.found_inf
        if found_inf is None:  # no gradients: nothing to step, nothing recorded for update()
            found_inf = torch.zeros((), dtype=torch.float32, device=live.device)
        skip = found_inf if record.spike is None else torch.maximum(found_inf, record.spike)
        retval = step_fused(optimizer, grad_scale, skip, args, kwargs)
        self._stepped(record, found_inf, record.spike, live)
        return retval

    def _stepped(
        self,
        record: OptimizerRecord,
        found_inf: torch.Tensor | bool,
        spike: torch.Tensor | bool | None,
        live: LiveState,
    ) -> None:
        record.stage = OptState.STEPPED
        outcome = record.outcome = StepOutcome(found_inf, spike)
        outcomes, key = self._state.outcomes, id(record.optimizer)
        outcomes.last = outcome
        if key not in outcomes:  # dropped when the optimizer is, before its id is reused
            weakref.finalize(record.optimizer, outcomes.pop, key, None)
        outcomes[key] = outcome
        for hook in self._hooks.after_step:
            hook.after_step(self._iteration, record, live)

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
        iteration's outcome in one sync. With a measuring policy
        (:class:`~ampscaler.HeadroomPolicy`) and a ``process_group``, a measured iteration
        max-reduces its measurement over the group (one all_reduce, waited for as the inf flags
        are: with gloo the host waits); with a measuring policy ``update()`` runs eagerly under
        ``torch.compile`` (a graph break).

        Under ``torch.compile``, without ``new_scale``, ``max_consecutive_skips``, consumers of
        step records, guards or a policy that holds on a non-finite loss, it hands the
        iteration's flags to the state and the next ``scale()`` applies them, so it compiles
        with no device work of its own; anything that reads the state applies a pending update
        first, so the values are the eager run's (docs/compiled.md).

        Raises:
            AssertionError / RuntimeError: no ``step()`` (or ``unscale_``) was recorded in this
                iteration (:class:`~ampscaler.ScalerUsageError` is both).
            ValueError: a ``new_scale`` that is not finite, not > 0, outside
                ``[min_scale, max_scale]``, not one element, or requires grad.
            PersistentOverflowError: ``max_consecutive_skips`` iterations in a row skipped.
        """
        if not self._enabled:
            return
        # Dynamo's own test (one frame, where is_compiling() takes two); named through `torch`,
        # so that dynamo, which skips a frame that names nothing of torch's, traces this one.
        compiling = torch.compiler.is_dynamo_compiling()
        hooks = self._hooks
        if hooks.before_update and compiling:
            _update_eagerly(self, new_scale)  # a graph break: a measurement's schedule is Python
            return
        iteration = self._iteration
        # found_inf > 0 iff any overflowed; overflowed: whether, where the host knows it
        flags, found_inf, overflowed, spiked = self._agreement.flags(iteration)
        iteration.found_inf, iteration.spiked = found_inf, spiked
        if new_scale is not None or found_inf is None:
            live = self._set_scale(new_scale, iteration)
            if live is None:  # nothing stepped: nothing to count
                return
        elif compiling and self._defers_update():
            live = self._state.require("update")
            self._state.defer(flags)
            # The copy its unscale made, else the live scale: the old value until applied.
            iteration.scale = live.scale if iteration.start_scale is None else iteration.start_scale
        else:
            for hook in hooks.before_update:
                hook.before_update(iteration, self._state.require("update"))
            live = self._state.advance(iteration, overflowed, compiling)
            if not compiling:
                self._agreement.moved()  # every rank moved alike: no new fingerprint
        self._end(iteration, live, compiling)

    def _end(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """End ``iteration``, whose update has moved the state: it is kept for its report until
        the next one ends, and the hooks hear of it."""
        hooks = self._hooks
        iteration.new_scale = live.scale
        self._finished, self._iteration = iteration, Iteration()
        if self._bf16.active:
            self._bf16.stop()
        for hook in hooks.after_update:
            hook.after_update(iteration, live, compiling)
        if not compiling:  # periodic hooks count eager updates only
            hooks.due_in -= 1
            if hooks.due_in <= 0:
                hooks.run_periodic(iteration, live)
        if self._max_consecutive_skips is not None:
            self._check_persistent_overflow(live, self._max_consecutive_skips)

    def _end_moved_outside(self) -> None:
        """End the iteration in progress as torch's scaler ends it when its
        ``_per_optimizer_states`` are assigned afresh (:mod:`ampscaler.compat`), with the state
        as the code that assigned them left it: torch's ``update()`` assigns them at its end,
        after it moved the scale, and so does a subclass's copy of it (NeMo's, for hysteresis).
        An iteration that stepped an optimizer ends as :meth:`update` ends it, counted from
        the scale it ran at, the scale held at the floor; one that stepped none is dropped,
        not counted (a trainer that runs a batch again after running out of memory drops it
        so; a subclass's ``__init__`` that assigns them finds none). No host sync."""
        iteration = self._iteration
        _, found_inf, _, spiked = self._agreement.flags(iteration)
        if found_inf is None or not iteration.stepped:
            self._iteration = Iteration()
            return
        iteration.found_inf, iteration.spiked = found_inf, spiked
        live = self._state.require("update")
        iteration.by_policy = False
        for hook in self._hooks.before_update:
            hook.before_update(iteration, live)
        self._state.moved_outside(iteration)
        self._agreement.moved()
        self._end(iteration, live, compiling=False)

    def _set_scale(
        self, new_scale: float | torch.Tensor | None, iteration: Iteration
    ) -> LiveState | None:
        """``update(new_scale)``: validate it, write it by the policy; the live state, or
        ``None`` where nothing stepped (the iteration is then dropped, not counted). A host
        sync for a tensor ``new_scale``. Without ``new_scale`` (an iteration that checked no
        optimizer): refuse."""
        live = self._state.require("update")
        if new_scale is None:
            iteration.refuse_unchecked()
        value = new_scale_value(new_scale, self._state.policy)
        iteration.by_policy = False
        for hook in self._hooks.before_update:
            hook.before_update(iteration, live)
        found_inf = iteration.found_inf
        iteration.scale = self._state.set_scale(value, found_inf, iteration.vetoes)
        if found_inf is None:
            self._iteration = Iteration()
            return None
        return live

    def _defers_update(self) -> bool:
        """Whether ``update()`` under ``torch.compile`` hands its work to the next read of the
        state: when no host read is due now (no step records consumed, no skip limit, no
        guard)."""
        return (
            self._max_consecutive_skips is None
            and not self._hooks.after_update
            and not self._state.policy.holds_on_nonfinite_loss
        )

    def _check_persistent_overflow(self, live: LiveState, limit: int) -> None:
        in_a_row = int(live.counters.consecutive_skips.item())
        if in_a_row >= limit:
            raise PersistentOverflowError.after(
                in_a_row, limit, self.get_scale(), self.last_overflow
            )

    # ------------------------------------------------------------------ replay

    def attempts(self, max_attempts: int = 3) -> Iterator[Attempt]:
        """Run a batch again when its step was skipped because the scaled gradients
        overflowed, at the backed-off scale, instead of losing it; at most ``max_attempts``
        tries in all.

        A loop the user can read; the body is one whole iteration (forward, ``scale``,
        ``backward``, ``step`` for every optimizer, ``update``)::

            for inputs, targets in loader:
                for _ in scaler.attempts():
                    optimizer.zero_grad()
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = loss_fn(model(inputs), targets)
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()

        After each try the body ran, the batch runs again only when the iteration was
        skipped because its *scaled gradients* held inf/NaN (``update()`` has backed the
        scale off): never when a loss was already inf/NaN before scaling (cause ``"loss"``: a
        lower scale cannot help) and never for a guard's veto (:class:`~ampscaler.SpikeGuard`).
        After ``max_attempts`` tries the batch is skipped, as without the loop. Every try is a
        full iteration of the scaler (counted in ``stats.steps``; a skipped one in
        ``stats.skipped``; a replayed one also in ``stats.replays``).

        The backoffs a batch takes are the batch's (:mod:`ampscaler.replay`): the second try
        runs where the policy's reaction to the overflow put the scale, so a batch that one
        retry gets through (a growth probe) equals torch's scaler driven by the same loop
        written by hand, bit for bit. A batch that overflows again is one of two kinds. When
        it started at the scale the batch before stepped at, that scale carries the run's
        batches and this one is larger: an outlier. Its later tries run at the policy's
        further backoffs (in a warm-up, before the run skipped any step, they gallop, each
        backing off twice as many binades as the one before: under torch's rule ``S``,
        ``S/2``, ``S/8``, :func:`~ampscaler.replay.gallop_scale`), after ``max_attempts`` it
        is skipped as torch skips it, and once done it leaves the policy's state where its
        first overflow left it but with the scale it started at (the outlier is the batch's,
        not the run's). Otherwise the scale is a guess no batch carried yet (the first batch,
        after a growth or a measured jump, after a batch that needed more): its later tries
        bisect in binades down to 1, the last try at 1
        (:func:`~ampscaler.replay.retry_scale`), and once done it leaves the policy's state
        one backoff below its start, as a skipped batch without the loop: a warm-up from
        ``2**16`` to a ceiling of ``2**7`` loses no batch at the default ``max_attempts``. A
        try whose steps a hook vetoed with a :class:`~ampscaler.hooks.Veto` that says
        ``replay`` (and no other veto fired) runs again within ``max_attempts`` at the scale
        the update left; nothing is rewound: a
        measuring policy's meter vetoes so where every measured gradient flushed to zero
        (:class:`~ampscaler.HeadroomPolicy`'s first iterations on a tiny loss), and the
        policy raised the scale.
        Accumulation over micro-batches, several optimizers, fused optimizers and a compiled
        step inside the body all work; checkpoints go between batches.

        What it reads from the device: nothing after a try whose plain optimizers all stepped
        (their step already read the flag); one read (the iteration's flags) after a skipped
        try, and after every try that steps a fused optimizer (whose kernel decided alone);
        and, for a batch that overflows twice, the policy's state once (to return to it) and
        the scales it and the batch before started at (the copies their updates made).
        With a ``process_group`` the decision comes from values agreed across the ranks, so
        every rank replays or none.

        Example:
            >>> import torch, ampscaler
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8)
            >>> tries = []
            >>> for attempt in scaler.attempts():
            ...     opt.zero_grad()
            ...     loss = model(torch.ones(1, 2)).sum()
            ...     scaler.scale(loss).backward()
            ...     if not attempt.replay:
            ...         _ = model.bias.grad.fill_(float("inf"))   # the first try overflows
            ...     scaler.step(opt)
            ...     scaler.update()
            ...     tries.append(scaler.get_scale())
            >>> tries, scaler.metrics("")["replays"]
            ([128.0, 128.0], 1)

        Raises:
            ScalerUsageError: (a ``RuntimeError``) a body that does not call ``update()``
                exactly once.
            InvalidConfigError: (a ``ValueError``) ``max_attempts`` is not an int >= 1; more
                than one rank and no ``process_group`` (the ranks could decide differently,
                and a rank that replays alone leaves the others waiting).
        """
        limit = check_attempts(max_attempts)
        self._refuse_a_rank_alone()
        first_backoff: HostState | None = None  # the state the first overflow left
        start: torch.Tensor | None = None  # the scale it started at (read at a second overflow)
        carried, self._carried = self._carried, None  # the scale the batch before stepped at
        give_back: float | None = None  # an outlier's start, decided at its second overflow
        later: _LaterTry | None = None  # and where its later tries run (None: the policy's)
        failed, first = 0.0, 0  # the scale of the last try that overflowed, the first's number
        for number in range(limit):
            if later is not None and first_backoff is not None:
                failed = later(failed, number - first, limit - number)
                self._rewind(first_backoff, failed)
            started = self._iteration
            started.attempt = number  # the try at its batch the iteration in progress is
            try:
                yield _first_try(limit) if number == 0 else Attempt(number, limit)
            finally:
                if self._iteration is started:  # the body did not end it: not a try
                    started.attempt = 0
            if not self._enabled:
                return
            self._require_one_update(started)  # raises: not one update() in the body
            last = number + 1 == limit
            if first_backoff is None:  # no overflow yet
                start = self._state.kept(started.scale)  # the scale this try ran at
                if last:
                    return  # max_attempts=1, or flushed to the last: nothing to decide
                # Stepped, known on the host (the common case): nothing to read.
                clean = started.overflow_known() is False and not started.vetoes
                if not clean and started.vetoed_for_replay():  # again, at the scale it left
                    carried = None  # the try after runs at a jump no batch carried
                    self._state.count_replay()
                    continue
                if clean or not self._overflowed(started):
                    self._carried = start
                    return
                first_backoff = self._state.snapshot()
                failed, first = first_backoff.scale, number
            else:
                overflowed = self._overflowed(started)
                if number == first + 1 and not overflowed:
                    self._carried = first_backoff.scale
                    return  # one retry got it through: torch's scaler under a loop by hand
                if number == first + 1:  # the batch's second overflow
                    give_back = _outlier_start(carried, start)
                    later = _later_tries(give_back is not None, first_backoff.stats.skipped)
                if last or not overflowed:
                    self._rewind(first_backoff, give_back or first_backoff.scale)
                    return
            self._state.count_replay()

    def _refuse_a_rank_alone(self) -> None:
        """``attempts()`` refuses a rank alone among several (asked only where a process group
        runs)."""
        if self._enabled and self._agreement.ranks is None and _distributed_started():
            self._agreement.refuse_alone(
                "attempts() decides on each rank whether to run a batch again, and a rank that "
                "ran it again alone would leave the others waiting in its collectives (DDP's)."
            )

    def _rewind(self, to: HostState, scale: float) -> None:
        """``attempts()``: put the policy's state back to ``to`` with the scale ``scale`` (the
        counters go on); the meter follows the policy's schedule from there."""
        policy = self._state.policy
        self._state.load(dataclasses.replace(to, scale=scale, stats=self._state.stats()), policy)
        self._add_meter(policy, to.own.get("iteration", 0))

    def _require_one_update(self, started: Iteration) -> None:
        """Check that the try ended the iteration it started with ``update()``, and no other:
        exactly one ``update()`` in the body."""
        if self._finished is not started:
            called = "did not call" if self._iteration is started else "called more than once"
            raise ScalerUsageError(
                f"The body of scaler.attempts() {called} update(); it must call it exactly "
                "once per try (after step() for every optimizer), so that each try is one "
                "iteration the scaler can decide on."
            )

    def _overflowed(self, iteration: Iteration) -> bool:
        """Whether ``iteration`` was skipped because its scaled gradients overflowed (and not
        because a loss was inf/NaN). Reads the device only when that is not known yet."""
        known = iteration.overflow_known()
        if known is False:
            return False
        found, cause = iteration.found_inf, iteration.cause_flag()
        read = read_values([t for t in (found, cause) if t is not None])
        found_value = read[0] if found is not None else 0.0
        loss_value = read[-1] if cause is not None else 0.0
        return found_value > 0 and not loss_value > 0

    # ------------------------------------------------------------------ the scale and rule

    def get_scale(self) -> float:
        """The current scale as a Python float; 1.0 when disabled. A host sync.

        Example:
            >>> import ampscaler
            >>> ampscaler.GradScaler("cpu", init_scale=128.0).get_scale()
            128.0
        """
        return self._state.scale_value() if self._enabled else 1.0

    def _require_rule(self, getter: str) -> None:
        """Refuse torch's rule getter ``getter`` on a disabled scaler, as torch's does.

        torch's disabled scaler never sets ``_growth_factor`` and friends, so its getters raise
        ``AttributeError``; code written against it (``hasattr``, ``except AttributeError``)
        meets the same error here, with a message that says where the value is.
        """
        if not self._enabled:
            raise AttributeError(
                f"{type(self).__name__}.{getter}(): this scaler is disabled (built with "
                "enabled=False, or for a device that is not available), and a disabled scaler "
                "keeps no growth settings: torch's raises AttributeError here too. The value it "
                f"was configured with is in scaler.policy: {self._state.policy!r}."
            )

    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` clean steps.

        Raises:
            AttributeError: the scaler is disabled, as torch's; read :attr:`policy` instead.
        """
        self._require_rule("get_growth_factor")
        return torch_rule(self._state.policy).growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1)."""
        self._state.change_rule("set_growth_factor", growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale backs off by after an overflow.

        Raises:
            AttributeError: the scaler is disabled, as torch's; read :attr:`policy` instead.
        """
        self._require_rule("get_backoff_factor")
        return torch_rule(self._state.policy).backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1))."""
        self._state.change_rule("set_backoff_factor", backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows.

        Raises:
            AttributeError: the scaler is disabled, as torch's; read :attr:`policy` instead.
        """
        self._require_rule("get_growth_interval")
        return torch_rule(self._state.policy).growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (in [1, 2**31 - 1])."""
        self._state.change_rule("set_growth_interval", growth_interval=new_interval)

    def is_enabled(self) -> bool:
        """Whether scaling is on."""
        return self._enabled

    @property
    def policy(self) -> Policy:
        """The scale policy in force (read-only; use the setters or a new scaler to change it)."""
        return self._state.policy

    def metrics(self, prefix: str = "scaler/") -> dict[str, float | int]:
        """The scaler's numbers for a logger: a flat dict of plain Python numbers, their names
        starting with ``prefix``.

        - ``scale``: the loss scale now (a float);
        - ``skipped``: 1 if the last iteration (the last ``update()``) skipped a step, else 0;
        - ``skip_cause``: why, as a number: 0 it stepped, 1 its scaled gradients overflowed
          (the scale backed off), 2 a loss was already inf/NaN before scaling; a hook vetoed
          finite gradients (:class:`~ampscaler.hooks.VetoCause`, the highest that fired): 3 a
          guard, 4 a measuring policy's meter because every measured gradient flushed to zero
          before anything was measured (it would have applied zeros; the scale grows, and
          :meth:`attempts` runs the batch again);
        - ``steps``, ``skips``, ``replays``, ``growths``, ``backoffs``, ``spike_skips``,
          ``flush_skips``, ``consecutive_skips``: the running counts (:attr:`stats`; ``skips``
          is ``stats.skipped``; ``spike_skips`` counts the guards' vetoes, cause 3, and
          ``flush_skips`` the meter's, cause 4);
        - ``flushed_measurements``, with a measuring policy (:class:`~ampscaler.HeadroomPolicy`):
          measured iterations whose every measured gradient was zero in float16 at their scale.
          The first time it reads a count above 0 it warns (a
          :class:`~ampscaler.flushed.GradientsFlushedWarning`, once per scaler) with what to do.

        One host sync, whatever is asked: every value is read from the device in one copy
        (what ``get_scale()`` alone costs). Call it after :meth:`update`, every step if you
        like::

            wandb.log(scaler.metrics(), step=step)                           # Weights & Biases
            for name, value in scaler.metrics().items():                     # TensorBoard
                writer.add_scalar(name, value, step)
            self.log_dict(scaler.metrics())                                  # Lightning module

        Example:
            >>> import torch, ampscaler
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
            >>> scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> metrics = scaler.metrics()
            >>> metrics["scaler/scale"], metrics["scaler/skipped"], metrics["scaler/skip_cause"]
            (128.0, 1, 2)
        """
        live = self._state.live if self._enabled else None
        finished = self._finished
        readings: dict[str, torch.Tensor] = {}
        read_out: list[float] = []
        if live is None or finished is None:
            scale, stats, cause = self.get_scale(), self._state.stats(), 0
        else:
            for hook in self._hooks:
                readings.update(hook.readings(live))
            vetoes = finished.vetoes
            flags = finished.outcome_flags()
            extra = [veto.flag for veto in vetoes.values()] + list(readings.values())
            read = read_values([live.scale, live.counters.values, flags, *extra])
            scale, stats = read[0], ScalerStats(*read[1])
            found, spike, loss = read[2]
            fired = [c for c, value in zip(vetoes, read[3:], strict=False) if value > 0]
            cause = max(fired, default=VetoCause.GUARD) if spike > 0 else 0
            if found > 0:
                cause = 2 if loss > 0 else 1
            read_out = read[3 + len(vetoes) :]
        values: dict[str, float | int] = {
            "scale": float(scale),
            "skipped": int(cause > 0),
            "skip_cause": int(cause),
            "steps": stats.steps,
            "skips": stats.skipped,
            "replays": stats.replays,
            "growths": stats.growths,
            "backoffs": stats.backoffs,
            "spike_skips": stats.spike_skips,
            "consecutive_skips": stats.consecutive_skips,
            "flush_skips": stats.flush_skips,
        }
        heard = dict(zip(readings, read_out, strict=True))
        for hook in self._hooks:
            hook.heard(heard, float(scale))
        values.update(heard)
        return {prefix + name: value for name, value in values.items()}

    @property
    def stats(self) -> ScalerStats:
        """Deprecated: :meth:`metrics` gives the same counters (``skips`` is ``skipped``), the
        scale and the last skip's cause, in one host sync."""
        _deprecated("stats", "scaler.metrics()")
        return self._state.stats()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state: torch's five keys plus ampscaler's policy state and counters.

        Torch's ``GradScaler.load_state_dict`` reads the five keys it knows and ignores the
        rest, so this loads into torch's scaler too (format: :mod:`ampscaler.checkpoint`).
        Empty when disabled. A host sync. Take it after :meth:`update`.

        Example:
            >>> import ampscaler
            >>> sorted(ampscaler.GradScaler("cpu").state_dict())[:3]
            ['_growth_tracker', '_hysteresis_tracker', 'backoff_factor']
        """
        if not self._enabled:
            return {}
        saved = {key: value for hook in self._hooks for key, value in hook.save().items()}
        return to_state_dict(
            self._state.policy, self._max_consecutive_skips, self._state.snapshot(), saved
        )

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state saved by this class or by ``torch.amp.GradScaler``.

        Everything is validated before anything changes: a rejected dict leaves the scaler as
        it was. With a ``process_group``, the ranks compare what they hold at the next step
        (in the all_reduce they make anyway): ranks that loaded different checkpoints, or only
        some of them, stop with an error naming the ranks and what differs, every rank alike.

        Like torch, the checkpoint's configuration (factors, interval, and here also the rest
        of the policy and ``max_consecutive_skips`` when present) replaces the constructor's.
        A torch state dict leaves ampscaler's own options as constructed and starts the
        counters at 0. The live state is overwritten in place. No-op when disabled.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler); called mid-iteration,
                after ``scale()`` of a loss with a graph and before ``update()`` (stricter
                than torch: :class:`~ampscaler.ScalerUsageError`).
            KeyError / ValueError: a dict that is not a scaler's, or holds invalid values
                (:class:`~ampscaler.InvalidStateDictError` is both).
        """
        if not self._enabled:
            return
        self._iteration.require_unstarted("load_state_dict")
        loaded = from_state_dict(state_dict, self._state.policy, self._max_consecutive_skips)
        restores = [hook.prepare_load(state_dict) for hook in self._hooks]
        # Everything is valid: from here on nothing raises.
        self._state.load(loaded.state, loaded.policy)
        self._max_consecutive_skips = loaded.max_consecutive_skips
        self._keep_start(loaded.state.scale, loaded.state.growth_tracker)
        self._add_meter(loaded.policy, loaded.state.own.get("iteration", 0))
        for restore in restores:
            if restore is not None:
                restore()
        self._agreement.loaded()  # the ranks compare what they hold at the next step

    def _agree_over(self, process_group: GroupSpec) -> None:
        """Agree on overflow over ``process_group`` from the next check on, as if it had been
        given to the constructor (for a subclass whose group is known only once
        torch.distributed is initialized: :class:`~ampscaler.ShardedGradScaler`)."""
        self._agreement = RankAgreement(process_group, self._refuses_unchecked)
        if self._hooks.find(MeterHook):  # measured values are agreed over the group from now on
            self._add_meter(self._state.policy, 0)

    def _add_meter(self, policy: Policy, iteration: int) -> None:
        """Hook in the meter ``policy`` asks for (in place of the one before), watching the
        models watched so far."""
        old = self._hooks.find(MeterHook)
        if old is not None:
            old.meter.detach()
            self._hooks.remove(old)
        meter = policy.new_meter(iteration, agreed=self._agreement.ranks is not None)
        if meter is None or not self._enabled:
            return
        for model, prefix in self._watched:
            meter.watch(model, prefix)
        hook = self._hooks.add(MeterHook(meter, self._agreement))
        hook.warned = old is not None and old.warned

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and self._iteration.records:
            raise ScalerUsageError(
                "A GradScaler instance may only be pickled at the beginning of an iteration, "
                "or at the end after scaler.update()."
            )
        state = self.__dict__.copy()
        if self._enabled:  # as torch's: a copy starts from the values held now
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
        # Which models are watched belongs to this object.
        state["_watched"] = WatchedModels()
        state["_finished"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------ skips and reports

    @property
    def last_step_skipped(self) -> bool:
        """Whether the most recent :meth:`step` skipped ``optimizer.step()`` (False before any).

        Use it to keep LR schedulers and weight averages in step with the parameters::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped:
                scheduler.step()
                ema.update_parameters(model)

        A step a guard skipped (:class:`~ampscaler.SpikeGuard`) counts as skipped;
        :attr:`last_overflow` tells the two apart (``None`` after a guard's veto),
        :meth:`step_skipped` follows each optimizer of a loop with several.

        A host sync on the fused-optimizer path (it reads the inf flag handed to the kernel);
        free otherwise, since the decision already read it.
        """
        outcome = self._state.outcomes.last
        return outcome is not None and outcome.skipped

    @property
    def last_skip_reason(self) -> SkipReason | None:
        """Deprecated: :attr:`last_step_skipped` says whether the step was skipped, and
        :attr:`last_overflow` why (``None`` after a skip: a guard vetoed finite gradients)."""
        _deprecated("last_skip_reason", "scaler.last_step_skipped and scaler.last_overflow")
        outcome = self._state.outcomes.last
        return None if outcome is None else outcome.reason

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the latest :meth:`step` of ``optimizer`` was skipped (for any reason).

        For loops with several optimizers, where :attr:`last_step_skipped` follows only the
        last ``step()``: keep each optimizer's scheduler in step with its parameters. Valid
        until that optimizer's next ``step()``, across ``update()``. A host sync on the fused
        path, as :attr:`last_step_skipped`.

        Example:
            >>> import ampscaler, torch
            >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
            >>> opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
            >>> opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> x = torch.ones(1, 2)
            >>> scaler.scale(a(x).sum() + b(x).sum()).backward()
            >>> b.bias.grad.fill_(float("inf"))
            tensor([inf])
            >>> scaler.step(opt_a), scaler.step(opt_b)
            (None, None)
            >>> scaler.update()
            >>> scaler.step_skipped(opt_a), scaler.step_skipped(opt_b)
            (False, True)

        Raises:
            ScalerUsageError: (a ``RuntimeError``) ``optimizer`` has not been stepped through
                this scaler.
        """
        outcome = self._state.outcomes.of(optimizer)
        if outcome is None:
            raise ScalerUsageError(
                f"step_skipped() was asked about an optimizer ({type(optimizer).__name__}) "
                "that this scaler has not stepped: call it after scaler.step(optimizer)."
            )
        return outcome.skipped

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
            >>> import ampscaler, torch
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.watch(model)
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> model.bias.grad.fill_(float("nan"))
            tensor([nan])
            >>> scaler.step(opt)
            >>> scaler.update()
            >>> report = scaler.last_overflow
            >>> report.names, report.kinds, report.cause
            (['bias'], {'bias': 'nan'}, 'gradients')
            >>> print(report)  # doctest: +ELLIPSIS
            step 0: non-finite gradients at scale 65536 in 1 parameter(s): bias (nan); cause: ...
        """
        live = self._state.live
        in_progress = self._iteration.stepped
        iteration = self._iteration if in_progress else self._finished
        counters = None if live is None else live.counters
        return self._observers.last_overflow(iteration, in_progress, counters)

    # ------------------------------------------------------------------ plug-ins

    def attach(self, plugin: PluginT) -> PluginT:
        """Plug ``plugin`` into the iteration; returns it. The one way to add a plug-in (a
        callback goes to :meth:`on`):

        - a :class:`~ampscaler.Hook` of your own (:mod:`ampscaler.hooks`: the moments of an
          iteration it is told about);
        - a guard, a skip rule beyond inf/NaN (a :class:`~ampscaler.SpikeGuard`, or anything
          with the :class:`~ampscaler.guards.Guard` protocol): from the next ``step()`` on,
          each optimizer's step is also skipped when a guard says so, and the scale does not
          back off for it. The verdict stays on the device, so no host sync is added; with a
          guard, ``update()`` under ``torch.compile`` runs at once (a graph break) instead of
          being handed to the next ``scale()``;
        - a :class:`~ampscaler.GradientProbe` or a :class:`~ampscaler.NonFiniteTracer` on the
          models given to :meth:`watch`, or a :class:`~ampscaler.CollapseWatch` in place of
          the default one;
        - a sink, anything with ``write(record)`` (:class:`~ampscaler.StepHistory`,
          :class:`~ampscaler.JsonlSink`, :class:`~ampscaler.LoggingSink`, ...; see
          :mod:`ampscaler.observe.sinks`): it gets every step record at the end of
          :meth:`update`, which then syncs once per iteration.

        :meth:`detach` takes any of them out again (a sink is not closed).

        Example:
            >>> import ampscaler
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> guard = scaler.attach(ampscaler.SpikeGuard(sigma=6.0, window=128))
            >>> probe = scaler.attach(ampscaler.GradientProbe(every=100))
            >>> history = scaler.attach(ampscaler.StepHistory(1000))
            >>> scaler.detach(guard)

        Raises:
            TypeError: none of these. ValueError: attached already (a probe or tracer: one of
                each).
        """
        if isinstance(plugin, Hook):
            self._hooks.add(plugin)
            for model, prefix in self._watched:  # it watches the models watched so far
                plugin.watch(model, prefix)
        elif not any(hook.adopt(plugin) for hook in self._hooks):
            raise TypeError(
                "attach() takes an ampscaler.Hook, a guard (check and end_iteration), a "
                "GradientProbe, a NonFiniteTracer, a CollapseWatch or a sink (an object "
                f"with write(record), what add_sink() took), got {type(plugin).__name__}."
            )
        return plugin

    def detach(self, plugin: object) -> None:
        """Take a hook, guard, observer or sink that :meth:`attach` added out again (a sink is
        not closed).

        Raises:
            ValueError: it is not attached.
        """
        if isinstance(plugin, Hook):
            self._hooks.remove(plugin)
            return
        if not any(hook.release(plugin) for hook in self._hooks):
            raise ValueError(f"{plugin!r} is not attached to this scaler; see scaler.attach().")

    def add_guard(self, guard: PluginT) -> PluginT:
        """Deprecated: :meth:`attach` takes guards."""
        _deprecated("add_guard(guard)", "scaler.attach(guard)")
        if isinstance(guard, Hook) or not any(hook.adopt(guard) for hook in self._hooks):
            raise TypeError(
                f"add_guard() takes a guard (an object with check(measured) and "
                f"end_iteration(skipped), such as ampscaler.SpikeGuard), got "
                f"{type(guard).__name__}."
            )
        return guard

    def add_sink(self, sink: SinkT) -> SinkT:
        """Deprecated: :meth:`attach` takes sinks.

        Raises:
            TypeError: ``sink`` has no ``write`` method.
        """
        _deprecated("add_sink(sink)", "scaler.attach(sink)")
        self._observers.add_sink(sink)
        return sink

    def remove_sink(self, sink: Sink) -> None:
        """Deprecated: :meth:`detach` takes sinks out.

        Raises:
            ValueError: ``sink`` is not attached.
        """
        _deprecated("remove_sink(sink)", "scaler.detach(sink)")
        self._observers.remove_sink(sink)

    def watch(self, *models: torch.nn.Module, **named_models: torch.nn.Module) -> None:
        """Learn parameter names from ``models`` so overflow reports can name them; a measuring
        policy and attached probes and tracers watch their modules too.

        Keyword arguments prefix the names, which keeps several models apart
        (``watch(encoder=enc, decoder=dec)`` names ``decoder.fc.weight``). Without
        ``watch()``, reports name parameters by position (``group0.param3``).

        Example:
            >>> import ampscaler, torch
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> scaler.watch(torch.nn.Linear(2, 2))
            >>> scaler.watch(head=torch.nn.Linear(2, 1))
        """
        watched = [(model, "") for model in models] + [
            (model, prefix) for prefix, model in named_models.items()
        ]
        for model, prefix in watched:
            if self._enabled:  # a disabled scaler taps nothing
                self._watched.add(model, prefix)
                for hook in self._hooks:
                    hook.watch(model, prefix)

    def wrap(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> None:
        """Scale a loop that never calls the scaler: ``loss.backward()``, clipping and
        ``optimizer.step()`` as written for fp32 train in fp16 with this scaler.

        Each output of ``model`` that requires grad has its gradient multiplied by the scale
        in backward (float16/bfloat16 outputs come back as float32, so the loss is computed in
        float32); after each backward the gradients are true (unscaled), so clipping and
        logging see what they would without fp16; ``optimizer.step()`` runs this scaler's
        ``unscale_()``, ``step()`` and, after the last wrapped optimizer, ``update()``. A step
        the loop skips itself (on a non-finite gradient norm) still counts at the optimizer's
        next ``zero_grad()``, so the scale backs off. State, policy, guards, sinks,
        ``metrics()`` and checkpoints are this scaler's, as in the written-in loop, and with a
        power-of-two scale (the default policy's) the run is that loop's bit for bit. Works with
        DDP (wrap the DDP module), FSDP2 (wrap the root after ``fully_shard``) and FSDP1. The
        loop must not call ``scale()``/``step()``/``update()`` itself. Disabled: does nothing.

        Host syncs: those of the written-in loop (a plain optimizer's step decision reads one
        flag); the backward hooks and the multiplications by the scale read nothing.

        Example:
            >>> import torch, ampscaler
            >>> model = torch.nn.Linear(4, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = ampscaler.GradScaler("cpu", init_scale=1024.0)
            >>> scaler.wrap(model, opt)
            >>> with torch.autocast("cpu", dtype=torch.float16):
            ...     out = model(torch.ones(2, 4))
            >>> out.dtype                                   # the loss is computed in float32
            torch.float32
            >>> out.pow(2).mean().backward()
            >>> _ = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            >>> opt.step()                                  # the scaler's step and update
            >>> scaler.get_scale(), scaler.metrics()["scaler/steps"]
            (1024.0, 1)
            >>> scaler.unwrap()

        Raises:
            TypeError: not a module, or not optimizers.
            ValueError: an optimizer holds parameters ``model`` does not own (their gradients
                would never be scaled).
            ScalerUsageError: (a ``RuntimeError``) this scaler already wraps a model; later, at
                ``optimizer.step()``, gradients that no backward through ``model``'s outputs
                produced. :class:`~ampscaler.wrap.HalfLossError` (one) at a forward that
                returns a 0-dim float16 tensor requiring grad (a loss computed in fp16).

        See docs/loop-free.md for the limits and the costs.
        """
        wrap_loop(self, model, optimizers)

    def unwrap(self) -> None:
        """Undo :meth:`wrap`: remove its hooks and give the optimizers their own ``step`` and
        ``zero_grad`` back. The gradients are left true (unscaled). Not wrapped: does
        nothing."""
        unwrap_loop(self)

    @overload
    def on(self, event: Literal["collapse"], fn: CollapseCallback) -> Callable[[], None]: ...

    @overload
    def on(self, event: str, fn: RecordCallback) -> Callable[[], None]: ...

    def on(self, event: str, fn: Callback) -> Callable[[], None]:
        """Call ``fn(record)`` at the end of :meth:`update` when ``event`` happened.

        Events: ``"step"`` (every iteration), ``"overflow"`` (skipped), ``"backoff"`` (the
        scale went down), ``"growth"`` (it went up); ``fn`` gets the
        :class:`~ampscaler.StepRecord`, and registering it makes :meth:`update` sync once per
        iteration. ``"collapse"``: the scale fell far below its running maximum or skips piled
        up (see :class:`~ampscaler.CollapseWatch`); ``fn`` gets a
        :class:`~ampscaler.CollapseAlert`, and registering it costs nothing per iteration.
        Returns a function that unregisters ``fn``.

        Example:
            >>> import ampscaler, torch
            >>> scaler = ampscaler.GradScaler("cpu")
            >>> stop = scaler.on("overflow", lambda record: print(record.overflow))
            >>> stop()

        Raises:
            ValueError: an unknown event (:class:`~ampscaler.InvalidConfigError`).
            TypeError: ``fn`` is not callable.
        """
        return self._observers.on(event, fn)

    @property
    def history(self) -> list[Any]:
        """Deprecated: attach a :class:`~ampscaler.StepHistory` and read its ``records``."""
        _deprecated("history", "the records of an attached StepHistory (history.records)")
        return self._observers.history

    def __repr__(self) -> str:
        if not self._enabled:
            return "GradScaler(enabled=False)"
        return (
            f"GradScaler(device={self._device!r}, scale={self.get_scale():g}, "
            f"policy={self._state.policy})"
        )


# Under torch.compile, step() runs eagerly, as torch's does, and update() with a measuring
# policy (whose schedule is a Python count a compiled graph would be guarded on). The wrappers
# import dynamo only when first called (which only happens under torch.compile), so importing
# ampscaler does not.
_step_eagerly = torch._disable_dynamo(GradScaler._step)  # type: ignore[attr-defined]
_update_eagerly = torch._disable_dynamo(GradScaler.update)  # type: ignore[attr-defined]
