"""Skip rules beyond inf/NaN, decided on the device: the spike guard.

A finite but huge gradient (a bad batch, a loss spike) passes the inf/NaN check and wrecks the
run anyway. A guard looks at each optimizer's step before it is taken and may veto it::

    check+unscale --> found_inf                     (inf/NaN: the scale backs off)
    guards        --> spike     (a 0-dim flag on the device; the scale does not back off)
    decide        --> skip when found_inf or spike  (one flag: the fused kernel gets it)

Everything stays on the device: a guard turns measurements into a flag with tensor operations,
so on the fused-optimizer path a guarded step still makes no host sync. Guards are the
composition point for skip rules: anything with ``check(measured) -> flag`` and
``end_iteration(skipped)`` (the :class:`Guard` protocol) can be added with
:meth:`GradScaler.attach <ampscaler.GradScaler.attach>`.

:class:`SpikeGuard` skips a step when the loss or the gradient norm exceeds the mean plus
``sigma`` standard deviations of the last ``window`` steps that were taken, as OLMo-core's
``SkipStepOptimizer`` does inside its own optimizers, here for any optimizer.

Example:
    >>> import torch, ampscaler
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
    >>> scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
    >>> guard = scaler.attach(ampscaler.SpikeGuard(sigma=6.0, window=8))
    >>> torch.manual_seed(0) is not None
    True
    >>> for step in range(12):
    ...     spike = 1000.0 if step == 10 else 1.0
    ...     loss = model(torch.randn(8, 4)).pow(2).mean() * spike
    ...     scaler.scale(loss).backward()
    ...     scaler.step(opt)
    ...     scaler.update()
    ...     opt.zero_grad()
    ...     if scaler.last_step_skipped:
    ...         print(step, scaler.last_overflow or "spike", scaler.get_scale())
    10 spike 256.0
"""

from __future__ import annotations

import copy
import functools
import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .errors import InvalidConfigError, InvalidStateDictError
from .grads.collect import GradGroups
from .hooks import Check, Hook
from .policy.base import require_int, require_number

if TYPE_CHECKING:
    from .iteration import Iteration
    from .state import LiveState

__all__ = ["Guard", "GuardSet", "SpikeGuard", "StepMeasurements"]


@dataclass(frozen=True)
class StepMeasurements:
    """What a guard sees of one optimizer's step, as 0-dim float32 tensors on the device.

    Attributes:
        optimizer: the optimizer about to step.
        grad_norm: the L2 norm of its gradients, unscaled (with a scaler ``process_group``,
            over the whole group: the shards' squared norms are summed across the ranks).
        loss: the iteration's loss, unscaled: the sum of what was passed to ``scale()`` since
            the last ``update()`` (averaged over the ranks with a ``process_group``); ``None``
            when it is not known (``scale()`` ran inside ``torch.compile``).
    """

    optimizer: torch.optim.Optimizer
    grad_norm: torch.Tensor
    loss: torch.Tensor | None


@runtime_checkable
class Guard(Protocol):
    """A skip rule, decided on the device.

    ``check`` is called once per optimizer and iteration, after the inf/NaN check, and returns
    a 0-dim bool tensor (``True``: skip this optimizer's step), or a float32 one of 1.0 or 0.0
    (as :class:`SpikeGuard`'s, which saves converting it); it must not read tensors back
    to the host. ``end_iteration`` is called at ``update()`` with whether the iteration was
    skipped (a 0-dim bool tensor, for any reason), so a guard can learn from the steps taken.

    A guard that also has ``state_dict()`` (returning JSON-ready data) and
    ``load_state_dict(state)`` is saved and restored with the scaler's ``state_dict``.
    """

    def check(self, measured: StepMeasurements) -> torch.Tensor: ...

    def end_iteration(self, skipped: torch.Tensor) -> None: ...


class _Window:
    """The last ``size`` values of ``rows`` quantities, on the device, with their mean and
    spread: one ``[rows, size + 1]`` tensor, so that each step costs the same few operations
    however many quantities are watched (eleven in all: four to decide, seven to append).

    Slots not filled yet hold ``+inf``, so that a row whose window is not full has a NaN bar
    and exceeds nothing: with the default warm-up (a row decides once its window is full) the
    decision needs no count. The last column is scratch: a value that must not enter the
    window (not finite, or the step was skipped) is written there instead of into the ring,
    so appending is one ``index_put_`` whatever the outcome.
    """

    def __init__(self, rows: int, size: int, device: torch.device) -> None:
        self.buffer = torch.full((rows, size + 1), math.inf, dtype=torch.float32, device=device)
        #: The ring of the last ``size`` values (a view of the buffer, made once).
        self.values = self.buffer[:, :size]
        self.count = torch.zeros(rows, dtype=torch.int64, device=device)
        self._positions = torch.arange(size, device=device)
        self._rows = torch.arange(rows, device=device)
        self._above = torch.zeros(rows, dtype=torch.float32, device=device)
        self._scratch = torch.tensor(size, device=device)  # the scratch column's index
        self._size = size

    def exceeds(self, values: torch.Tensor, sigma: float, ready_after: int) -> torch.Tensor:
        """Whether any of ``values`` (one per row; NaN: none) is above ``mean + sigma * std``
        of its row, in rows with at least ``ready_after`` values: a 0-dim float32 flag, 1.0 or
        0.0 (no sync).

        When a row is ready exactly when its window is full (``ready_after == size``, the
        default warm-up), one fused mean and deviation over the rows (``std_mean``) gives the
        bars, NaN for rows still holding ``+inf`` slots: four small operations in all, the
        comparison written as 0.0/1.0 into a buffer whose largest value is the flag."""
        if ready_after >= self._size:
            std, mean = torch.std_mean(self.values, dim=1)
            bar = torch.add(mean, std, alpha=sigma)
            if ready_after == self._size:
                return torch.gt(values, bar, out=self._above).amax()
            return ((self.count >= ready_after) & (values > bar)).any().to(torch.float32)
        held = self.count.clamp(max=self._size)
        valid = self._positions < held.unsqueeze(1)
        mean = torch.where(valid, self.values, 0.0).sum(1) / held.clamp(min=1)
        spread = torch.where(valid, (self.values - mean.unsqueeze(1)).square(), 0.0).sum(1)
        std = (spread / (held - 1).clamp(min=1)).sqrt()
        above = (self.count >= ready_after) & (values > mean + sigma * std)
        return above.any().to(torch.float32)

    def state(self) -> dict[str, Any]:
        """The values and counts as Python lists, slots not filled yet as 0.0 (a host sync)."""
        values = torch.where(torch.isinf(self.values), 0.0, self.values)
        return {"values": values.tolist(), "count": self.count.tolist()}

    @staticmethod
    def check_state(state: Mapping[str, Any], size: int) -> None:
        """Raise :class:`~ampscaler.InvalidStateDictError` unless ``state`` is a window of
        ``size`` values per row (2 rows), as :meth:`state` writes it."""
        values, count = state.get("values"), state.get("count")
        fits = (
            isinstance(values, list)
            and isinstance(count, list)
            and len(values) == len(count) == 2
            and all(isinstance(row, list) and len(row) == size for row in values)
            and all(type(c) is int and c >= 0 for c in count)
        )
        if not fits:
            raise InvalidStateDictError(
                f"A SpikeGuard window in the checkpoint is not 2 rows of {size} values with "
                "their counts (whole numbers >= 0); it was saved by another version, or edited."
            )

    def load(self, state: Mapping[str, Any]) -> None:
        """Take the values and counts of :meth:`state` (in place); slots not filled yet
        become ``+inf`` again."""
        rows = [
            list(row[:count]) + [math.inf] * (self._size - count) if count < self._size else row
            for row, count in zip(state["values"], state["count"], strict=True)
        ]
        self.values.copy_(torch.tensor(rows, dtype=torch.float32))
        self.count.copy_(torch.tensor(state["count"], dtype=torch.int64))

    def push(self, values: torch.Tensor, skipped: torch.Tensor) -> None:
        """Append each row's value unless the step was ``skipped`` (a 0-dim bool) or the
        value is not finite, overwriting the oldest (a value left out goes to the scratch
        column): seven small operations."""
        keep = values.sub(values).add_(skipped) == 0  # 0 where finite, NaN where not
        at = torch.where(keep, self.count % self._size, self._scratch)
        self.buffer.index_put_((self._rows, at), values)
        self.count.add_(keep)


class SpikeGuard:
    """Skip a step whose loss or gradient norm spikes; the scale stays where it is.

    After ``warmup`` steps have been taken, a step is skipped when its loss, or the norm of an
    optimizer's unscaled gradients, exceeds ``mean + sigma * std`` of the same quantity over the
    last ``window`` steps that were taken (skipped steps never enter the window, so a spike
    cannot raise the bar for the next one). Each optimizer's gradient norm has its own window.
    The decision is a flag on the device: with a fused optimizer it joins the inf flag handed
    to the kernel, and nothing waits for the device. A spike-skipped step does not back the
    scale off (the scale was not the problem); it is counted in
    ``metrics()["scaler/spike_skips"]``, and
    :attr:`GradScaler.last_step_skipped <ampscaler.GradScaler.last_step_skipped>` is true while
    :attr:`GradScaler.last_overflow <ampscaler.GradScaler.last_overflow>` is ``None`` (no
    gradient overflowed).

    Cost on every step: one read-only pass over the gradients (``torch._foreach_norm``: on a
    GPU one multi-tensor kernel per chunk of tensors, on a CPU one ``vector_norm`` per tensor),
    and about twenty small operations on ``window``-long tensors, however many gradients there
    are (``benchmarks/dispatch_count.py`` counts them; each is a kernel launch on a GPU and a
    few µs on a CPU); no host sync. With a scaler ``process_group``, one ``all_reduce`` of two
    numbers per optimizer and group. The windows are saved with the
    scaler's ``state_dict`` and restored by ``load_state_dict`` (to the optimizers in the order
    they first step), so a resumed run decides exactly as an uninterrupted one; a guard added
    mid-run warms up then.

    Args:
        sigma: how many standard deviations above the mean count as a spike (> 0).
        window: how many of the latest steps taken the mean and deviation cover (>= 2).
        warmup: steps taken before the guard may skip (>= 0; ``None``: ``window``). At least
            two are always needed for a deviation.

    Example:
        >>> SpikeGuard(sigma=6.0, window=128)
        SpikeGuard(sigma=6.0, window=128, warmup=128)

    Raises:
        InvalidConfigError: (a ``ValueError``) ``sigma <= 0``, ``window < 2`` or a negative
            ``warmup``, naming the argument.
    """

    def __init__(self, sigma: float = 6.0, window: int = 128, warmup: int | None = None) -> None:
        self.sigma = require_number("sigma", sigma)
        if not (math.isfinite(self.sigma) and self.sigma > 0):
            raise InvalidConfigError(
                f"sigma must be a finite number > 0 (how many standard deviations above the "
                f"mean count as a spike; 6.0 is usual), got {sigma!r}."
            )
        self.window = require_int(
            "window", window, 2, meaning=" (the steps the mean and deviation cover; 128 is usual)"
        )
        self.warmup = self.window
        if warmup is not None:
            self.warmup = require_int(
                "warmup", warmup, 0, meaning=f" or None (None: the window, {self.window})"
            )
        self._windows: dict[int, _Window] = {}
        self._pending: dict[int, torch.Tensor] = {}
        self._unknown: dict[torch.device, torch.Tensor] = {}  # a NaN loss, made once per device
        # Windows from a loaded state dict, for the optimizers in the order they first step.
        self._restored: list[dict[str, Any]] = []

    def check(self, measured: StepMeasurements) -> torch.Tensor:
        """Whether the step spikes: a 0-dim float32 flag on the device, 1.0 to skip (no
        sync)."""
        norm = measured.grad_norm
        loss = measured.loss
        if loss is None:
            loss = self._unknown.get(norm.device)
            if loss is None:
                loss = self._unknown[norm.device] = torch.full_like(norm, math.nan)
        values = torch.stack([norm, loss.to(norm.device, torch.float32)])
        key = id(measured.optimizer)
        window = self._windows.get(key)
        if window is None:  # each optimizer's own: its gradient norm, and the loss
            window = self._windows[key] = _Window(2, self.window, norm.device)
            if self._restored:
                window.load(self._restored.pop(0))
        self._pending[key] = values
        return window.exceeds(values, self.sigma, max(self.warmup, 2))

    def end_iteration(self, skipped: torch.Tensor) -> None:
        """Put the iteration's values into the windows unless it was skipped (no sync)."""
        for key, values in self._pending.items():
            self._windows[key].push(values, skipped.to(values.device))
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The settings and the windows (per optimizer, in the order they first stepped), as
        JSON-ready data. Reads the windows from the device (a host sync)."""
        return {
            "kind": type(self).__name__,
            "sigma": self.sigma,
            "window": self.window,
            "warmup": self.warmup,
            "windows": [window.state() for window in self._windows.values()] + self._restored,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the settings and windows of :meth:`state_dict`; each window goes to the next
        optimizer that steps for the first time.

        Raises:
            InvalidStateDictError: not a SpikeGuard's state, or windows of another size.
        """
        if state.get("kind") != type(self).__name__:
            raise InvalidStateDictError(
                f"The checkpoint holds the state of a {state.get('kind')!r} where this scaler "
                f"has a {type(self).__name__}: add the same guards, in the same order, before "
                "loading."
            )
        try:
            restored = SpikeGuard(state["sigma"], state["window"], state["warmup"])
            windows = [dict(w) for w in state["windows"]]
        except (KeyError, TypeError, InvalidConfigError) as error:
            raise InvalidStateDictError(f"Invalid SpikeGuard state: {error}") from error
        for window in windows:
            _Window.check_state(window, restored.window)
        self.sigma, self.window, self.warmup = restored.sigma, restored.window, restored.warmup
        self._windows, self._pending, self._restored = {}, {}, windows

    def __repr__(self) -> str:
        return f"SpikeGuard(sigma={self.sigma}, window={self.window}, warmup={self.warmup})"


def _grad_norm(groups: GradGroups, device: torch.device) -> torch.Tensor:
    """The L2 norm of every gradient in ``groups``, as they are now, accumulated in float32 so
    that float16 gradients cannot overflow it: one read-only pass, a multi-tensor
    ``_foreach_norm`` per device and dtype and the norm of those norms (three operations; one
    ``vector_norm`` where a device and dtype holds one tensor, as a flat buffer does).

    On a GPU ``_foreach_norm`` is one kernel per chunk of tensors; torch's CPU implementation
    runs ``vector_norm`` tensor by tensor (about a µs each beyond the bandwidth), in C++."""
    norms: list[torch.Tensor] = []
    for per_dtype in groups.values():
        for grads in per_dtype.values():
            if len(grads) == 1:
                norms.append(torch.linalg.vector_norm(grads[0], dtype=torch.float32))
            else:
                partial = torch._foreach_norm(grads, 2, dtype=torch.float32)
                norms.append(torch.linalg.vector_norm(torch.stack(partial)))
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(norms) == 1:
        return norms[0].to(device)
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    return total


class GuardSet(Hook):
    """The guards of one scaler, and the measurements they are given: one hook
    (:mod:`ampscaler.hooks`), at the check (``after_check``: the guards' flag) and at the end
    of the iteration (``after_update``: whether it was skipped).

    Example:
        >>> guards = GuardSet()
        >>> guards.moments(), guards.adopt(SpikeGuard()), guards.adopt("a sink?")
        ([], True, False)
        >>> guards.moments()
        ['after_check', 'after_update']
    """

    def __init__(self) -> None:
        self._guards: list[Guard] = []

    def adopt(self, plugin: object) -> bool:
        """Add ``plugin`` if it is a guard (``check`` and ``end_iteration``); it decides from
        the next step on.

        Raises:
            InvalidConfigError: it is added already.
        """
        if not isinstance(plugin, Guard):
            return False
        if any(existing is plugin for existing in self._guards):
            raise InvalidConfigError(f"{plugin!r} is added to this scaler already.")
        self._guards.append(plugin)
        self.changed()
        return True

    def release(self, plugin: object) -> bool:
        """Remove ``plugin`` if it is one of the guards."""
        kept = [existing for existing in self._guards if existing is not plugin]
        if len(kept) == len(self._guards):
            return False
        self._guards = kept
        self.changed()
        return True

    def save(self) -> dict[str, Any]:
        """``guards``: :meth:`state_dict`."""
        return {"guards": self.state_dict()}

    def moments(self) -> list[str]:
        """Due at the check and the update while it holds a guard; never when empty."""
        return ["after_check", "after_update"] if self._guards else []

    def after_check(self, check: Check) -> torch.Tensor:
        """Ask every guard about the step of the optimizer just checked; the flag (0-dim
        float32, 1.0: skip).

        ``check.groups`` hold the gradients as checked; dividing them by ``check.unscaled_by``
        gives the true gradients. With an agreement (the scaler's ``process_group``), the
        squared norm is summed and the loss averaged over its ranks first (one ``all_reduce``
        per group), so every rank decides alike. No host sync.
        """
        device = check.unscaled_by.device
        norm = _grad_norm(check.groups, device) / check.unscaled_by
        loss = check.iteration.loss()
        if loss is not None:
            loss = loss.to(device, torch.float32)
        if check.agreement is not None:
            packed = torch.stack([norm.square(), torch.zeros_like(norm) if loss is None else loss])
            ranks = check.agreement.sum_(packed)
            norm = packed[0].sqrt()
            if loss is not None:
                loss = packed[1] / ranks
        measured = StepMeasurements(check.record.optimizer, norm, loss)
        flags = (guard.check(measured).to(device, torch.float32) for guard in self._guards)
        return functools.reduce(torch.maximum, flags)  # due only while it holds a guard

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """Tell every guard whether the iteration was skipped (a 0-dim bool tensor)."""
        found_inf, spiked = iteration.found_inf, iteration.spiked
        if found_inf is not None and spiked is not None:
            skipped = torch.logical_or(found_inf, spiked)
            for guard in self._guards:
                guard.end_iteration(skipped)

    def state_dict(self) -> str:
        """The guards' states, in the order they were added, as one JSON string (a single
        value, so that a checkpoint's layout does not depend on how many optimizers stepped:
        ``torch.distributed.checkpoint`` loads into a layout it is given)."""
        return json.dumps([_guard_state(guard) for guard in self._guards])

    def prepare_load(self, state_dict: Mapping[str, Any]) -> Callable[[], None] | None:
        """Validate what :meth:`state_dict` saved under ``guards`` (``None`` when the checkpoint
        has no such entry) for the guards added now, in order; returns the function that
        restores it (nothing changes before it is called, so a scaler can validate all of a
        checkpoint before it loads any of it).

        A checkpoint with more guards than this scaler has warns here, before anything changes
        (their state would be dropped; a warnings filter that turns the warning into an error
        leaves the scaler as it was); guards this scaler has beyond the checkpoint's start
        their warm-up.

        Raises:
            InvalidStateDictError: ``text`` is not such a JSON list, or a guard's state does not
                fit the guard in its place.
        """
        if "guards" not in state_dict:
            return None
        text = state_dict["guards"]
        try:
            states = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            states = None
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            raise InvalidStateDictError(
                f"guards must be the JSON list that state_dict() writes, got {text!r:.80}."
            )
        loads = [
            (guard, state)
            for guard, state in zip(self._guards, states, strict=False)
            if hasattr(guard, "load_state_dict")
        ]
        for guard, state in loads:  # on copies: raises if a state does not fit its guard
            copy.deepcopy(guard).load_state_dict(state)
        dropped = len(states) - len(self._guards)
        if dropped > 0:
            kinds = ", ".join(str(state.get("kind")) for state in states[len(self._guards) :])
            warnings.warn(
                f"The checkpoint holds the state of {len(states)} guard(s), this scaler has "
                f"{len(self._guards)}: the state of the other {dropped} ({kinds}) is dropped. "
                "Add the same guards, in the same order, before load_state_dict() to keep it.",
                UserWarning,
                stacklevel=3,
            )

        def restore() -> None:
            for guard, state in loads:
                guard.load_state_dict(state)

        return restore


def _guard_state(guard: Guard) -> dict[str, Any]:
    save = getattr(guard, "state_dict", None)
    return {"kind": type(guard).__name__} if save is None else dict(save())
