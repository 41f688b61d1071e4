"""Measuring the headroom a :class:`~ampscaler.HeadroomPolicy` sets the scale from.

:class:`HeadroomMeter` measures, on the iterations the policy's schedule asks for
(:meth:`HeadroomPolicy.measures <ampscaler.HeadroomPolicy.measures>`), the largest magnitude of
the scaled gradients of one iteration, where float16 overflows:

* **activation gradients**: through the probe's taps (:class:`~ampscaler.observe.taps.GradTaps`)
  on the leaf modules of the models given to ``scaler.watch(model)``, the gradient arriving at
  each module's outputs during the backward, one ``aminmax`` per tapped tensor (a read of the
  gradient, no copy; on the CPU some 20x faster than ``vector_norm(inf)`` for float16);
* **parameter gradients** that float16 computed, when the scaler checks them: the gradients of
  parameters of leaf modules whose output gradient was float16 (a linear layer under autocast),
  of parameters not in any watched leaf module, and float16 gradients: on CUDA one fused
  ``torch._foreach_norm(inf)`` per device and dtype, elsewhere one ``aminmax`` per gradient.
  The gradients of modules autocast runs in
  float32 (layer norms, embeddings) are left out: they cannot overflow float16, and a layer
  norm's parameter gradients, sums over every token, would otherwise hold the scale down.

Without ``scaler.watch(model)`` only parameter gradients are measured, all of them.

Taps that fire before the iteration's first ``scale()`` are dropped: such a backward did not run
at the scale (an fp32 reference pass of :meth:`GradientProbe.reference
<ampscaler.GradientProbe.reference>`, say). Everything stays on the device until the policy's
update reads it there; the hooks exist only during measured iterations.

What it costs: on a measured iteration, a forward hook and a tensor hook per leaf module and one
reduction per tapped gradient, plus one pass over the parameter gradients; nothing on the other
iterations. Every iteration measures while the history is young (the first
``history_length``), then every ``sample_every``-th: at the defaults (64, 32) the cost after
the first 64 iterations is a 32nd of a measured iteration's, and the history spans the last
2048 iterations. The trade-off: between measurements the scale only falls (on an overflow), so
a gradient that grows past the margin between two measurements overflows once, and a gradient
that shrinks is followed late (the history's largest entry holds the scale down until it has
left the history).

Example:
    >>> import torch
    >>> from ampscaler import GradScaler, HeadroomPolicy
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> scaler = GradScaler("cpu", policy=HeadroomPolicy())
    >>> scaler.watch(model)
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     loss = model(torch.ones(8, 4)).float().mean()
    >>> scaler.scale(loss).backward()   # at scale 1: the largest gradient is 1.0
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> scaler.get_scale() == 2.0**14   # 2**14 * 1.0 * first_margin 2 <= 65504 < 2**15 * ...
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import refuse_alone
from ..flushed import FLUSHED_READING, warn_flushed
from ..grads.collect import grad_views
from ..taps import GradTaps, WatchedModels, leaf_modules
from .base import PolicyState
from .headroom import HeadroomPolicy, HeadroomState

if TYPE_CHECKING:
    from ..distributed import RankAgreement

__all__ = ["NOT_MEASURED", "HeadroomMeter"]

NOT_MEASURED = -1.0
"""The measurement of an iteration that measured nothing (any value ``< 0`` means that)."""


class HeadroomMeter:
    """Measures the largest scaled gradient on the iterations ``policy`` measures.

    The scaler calls, per iteration: :meth:`start` (first ``scale()``), :meth:`measure` (per
    optimizer, before the check), :meth:`take` and then :meth:`advance` (in ``update()``), or
    :meth:`skip` (``update(new_scale)``, which does not consult the policy).

    Args:
        policy: the policy whose schedule it follows.
        iteration: the policy's iteration count to start from (a resumed run's).
        agreed: whether the scaler agrees on the measurements across ranks (its
            ``process_group``); without, measuring on one rank of several is refused at the
            first measurement.
    """

    def __init__(self, policy: HeadroomPolicy, iteration: int = 0, *, agreed: bool = False) -> None:
        self._policy = policy
        self._iteration = iteration
        self._agreed = agreed
        self._models = WatchedModels()
        self._taps = GradTaps(self._tap)
        self._owners: dict[int, str] = {}  # id(parameter) -> its watched leaf module
        self._reset()

    def _reset(self) -> None:
        self._started = False
        # Per dtype, the extremes seen (minima and maxima; the largest magnitude among them is
        # taken once, at take()).
        self._seen: dict[torch.dtype, list[torch.Tensor]] = {}
        self._half_modules: set[str] = set()  # modules whose output gradient was float16
        # The last peek(): how many extremes it reduced, and the result.
        self._peeked: tuple[int, torch.Tensor] | None = None

    @property
    def iteration(self) -> int:
        """The policy's iteration count: the iteration in progress, counting from 0."""
        return self._iteration

    @property
    def due(self) -> bool:
        """Whether the iteration in progress is measured."""
        return self._policy.measures(self._iteration)

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Measure the activation gradients of ``model``'s leaf modules (held weakly)."""
        self._models.add(model, prefix)
        for name, module in leaf_modules(model, prefix):
            for param in module.parameters(recurse=False):
                self._owners[id(param)] = name
        if self.due:
            self._taps.attach(model, prefix)

    def detach(self) -> None:
        """Remove the hooks and forget the watched models."""
        self._taps.detach()
        self._models.clear()
        self._owners = {}

    def start(self) -> None:
        """The iteration's first scaled loss: what was tapped before it is dropped."""
        if not self._started and self.due:
            self._reset()
            self._started = True

    def _tap(self, name: str, where: str, grad: torch.Tensor) -> None:
        values = grad._values() if grad.is_sparse else grad
        if values.numel() == 0:
            return
        if values.dtype is torch.float16:
            self._half_modules.add(name)
        self._note(values)

    def _note(self, values: torch.Tensor) -> None:
        with torch.no_grad():  # the extremes need no graph, and the gradient no detached view
            self._seen.setdefault(values.dtype, []).extend(torch.aminmax(values))

    def measure(self, optimizer: torch.optim.Optimizer) -> None:
        """Take ``optimizer``'s parameter gradients (scaled, before the check) into the
        iteration's measurement, if it is measured. No host sync."""
        if not self.due:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for _, _, param, view in grad_views([optimizer]):
            owner = self._owners.get(id(param))
            half = view.dtype is torch.float16
            if view.numel() and (half or owner is None or owner in self._half_modules):
                groups.setdefault((view.device, view.dtype), []).append(view)
        with torch.no_grad():
            for (device, dtype), views in groups.items():
                if device.type == "cuda":  # one fused kernel for them all
                    norms = torch._foreach_norm(views, float("inf"))
                    self._seen.setdefault(dtype, []).append(torch.stack(norms).max())
                else:
                    for view in views:
                        self._note(view)

    def take(self, device: torch.device) -> torch.Tensor | None:
        """The iteration's measurement on ``device``: a 0-dim float32 tensor holding the largest
        gradient magnitude seen (inf for inf or NaN; :data:`NOT_MEASURED` if nothing was
        seen), or ``None`` when the iteration is not measured. Forgets it. No host sync."""
        if not self.due:  # nothing was collected: the hooks are off, measure() returned
            self._started = False
            return None
        if not self._agreed:
            refuse_alone(
                "HeadroomPolicy measures the gradients on each rank, and ranks that measure "
                "differently would set different scales (with DDP, gradients scaled "
                "differently would be averaged)."
            )
            self._agreed = True  # checked once: the world does not change size
        measured = self.peek(device)
        self._reset()
        return measured

    def peek(self, device: torch.device) -> torch.Tensor:
        """What :meth:`take` would return now, on a measured iteration, without forgetting it:
        the largest magnitude seen so far in the iteration (its taps, and the optimizers
        measured so far). A few device ops; no host sync."""
        seen = self._seen
        if not seen:
            return torch.full((), NOT_MEASURED, dtype=torch.float32, device=device)
        count = sum(len(values) for values in seen.values())
        if self._peeked is not None and self._peeked[0] == count:
            return self._peeked[1]  # nothing seen since: the veto's reduction serves take()
        stacks = [torch.stack([v.to(device) for v in values]).float() for values in seen.values()]
        extremes = stacks[0] if len(stacks) == 1 else torch.cat(stacks)
        largest = torch.nan_to_num(extremes.abs().max(), nan=float("inf"))
        self._peeked = (count, largest)
        return largest

    @property
    def may_veto(self) -> bool:
        """Whether :meth:`veto` may skip the iteration in progress: while the history is young
        (its first ``history_length`` iterations, every one measured). After that a veto could
        not help: each flushed iteration before a measurement raises the target by ``2**16``,
        so sixteen of them reach the top of the range, where nothing is vetoed."""
        return self._iteration < self._policy.history_length

    def veto(self, state: PolicyState, agreement: RankAgreement | None) -> torch.Tensor | None:
        """Whether to skip the step just checked although its gradients are finite: a 0-dim
        float32 flag, 1.0 when every gradient measured so far in the iteration is zero (float16
        flushed them at the scale in force), the policy has measured nothing yet (nothing
        stored in its history) and its target can still grow; ``None`` where it may not veto
        (:attr:`may_veto`). Such a step would apply zero gradients; the policy jumps on the
        measurement (:data:`~ampscaler.policy.headroom.FLUSH_JUMP`). With an ``agreement`` the
        measurement is max-reduced over its ranks first (one all_reduce of one value), so
        every rank decides alike. A few device ops; no host sync.

        Example:
            >>> policy = HeadroomPolicy()
            >>> state = policy.initial_state(1.0, torch.device("cpu"))
            >>> meter = HeadroomMeter(policy)
            >>> meter.start()
            >>> meter._note(torch.zeros(3, dtype=torch.float16))   # everything flushed
            >>> meter.veto(state, None)
            tensor(1.)
        """
        if not self.may_veto:
            return None
        assert isinstance(state, HeadroomState), "the meter of a HeadroomPolicy"
        seen = self.peek(state.scale.device)
        if agreement is not None:
            seen = agreement.max_over_ranks(seen)
        can_grow = state.target < 2.0 ** self._policy.exponents[1]
        nothing_yet = state.measured == 0  # nothing stored: the history is empty
        return ((seen == 0.0) & nothing_yet & can_grow).float()

    def readings(self, state: PolicyState) -> dict[str, torch.Tensor]:
        """What :meth:`GradScaler.metrics <ampscaler.GradScaler.metrics>` reports of the
        policy's ``state``: ``flushed_measurements``, the measured iterations whose every
        measured gradient was zero in float16 at their scale (read with the rest)."""
        assert isinstance(state, HeadroomState), "the meter of a HeadroomPolicy"
        return {FLUSHED_READING: state.flushed}

    def heard(self, values: Mapping[str, float], scale: float) -> bool:
        """``metrics()`` read ``values`` (:meth:`readings`, at the scale ``scale``): warn with
        what to do (:class:`~ampscaler.flushed.GradientsFlushedWarning`, from the caller of
        ``metrics()``) where a measured iteration flushed; whether it warned."""
        count = int(values.get(FLUSHED_READING, 0))
        if count:
            warn_flushed(scale, count, stacklevel=5)  # metrics() <- MeterHook.heard <- this
        return count > 0

    def advance(self) -> None:
        """The policy moved on by one iteration: arm the hooks for the next."""
        self._iteration += 1
        self._started = False  # take() emptied the rest
        self._taps.arm(self.due, self._models)

    def skip(self) -> None:
        """The iteration ended without the policy: the next one is the same iteration of the
        schedule."""
        self._reset()

    def __reduce__(self) -> tuple[Any, ...]:
        # Hooks and watched models belong to this process: a copy is a fresh meter, watched anew.
        return functools.partial(type(self), agreed=self._agreed), (self._policy, self._iteration)

    def __repr__(self) -> str:
        return f"HeadroomMeter({self._policy}, iteration={self._iteration})"
