"""What one iteration gathers: per-optimizer records, the losses, and the outcome.

An iteration runs from the first ``scale()`` (or ``step()``) after an ``update()`` to the next
``update()``. The scaler keeps one :class:`Iteration` in progress and the last finished one;
everything that reports on steps (the overflow report, step records, skip awareness, guards)
reads them, and nothing else keeps per-iteration state of its own about the step.

Each optimizer moves through three stages within an iteration::

    READY --unscale_()--> UNSCALED --step()--> STEPPED --update()--> READY
    READY --step()------------------------------^   (step() unscales itself when needed)

Example:
    >>> import torch
    >>> iteration = Iteration()
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> record = iteration.record(opt, "step")
    >>> record.stage, iteration.stepped
    (<OptState.READY: 0>, False)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

import torch

from .errors import ScalerUsageError

__all__ = ["Iteration", "OptState", "OptimizerRecord", "SkipReason", "StepOutcome", "flag_sum"]

SkipReason = Literal["nonfinite", "spike"]

#: Losses kept per iteration before they are summed into one (a long accumulation).
_KEEP_LOSSES = 16


class OptState(enum.Enum):
    """Where an optimizer is within the current iteration."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


class StepOutcome:
    """One ``step()``'s verdict: the inf/NaN flag and a guard's flag, as device tensors (the
    fused path) or as known values; a tensor is read the first time it is asked about.

    Example:
        >>> outcome = StepOutcome(torch.tensor(0.0), torch.tensor(1.0))
        >>> outcome.skipped, outcome.reason
        (True, 'spike')
    """

    def __init__(
        self, found_inf: torch.Tensor | bool, spike: torch.Tensor | bool | None = None
    ) -> None:
        self._found_inf = found_inf
        self._spike = spike

    @property
    def reason(self) -> SkipReason | None:
        """``"nonfinite"``, ``"spike"``, or ``None`` when the step was taken (reads the flags
        still on the device: a host sync)."""
        if isinstance(self._found_inf, torch.Tensor):
            self._found_inf = bool(self._found_inf.item())
        if self._found_inf:
            return "nonfinite"
        if isinstance(self._spike, torch.Tensor):
            self._spike = bool(self._spike.item())
        return "spike" if self._spike else None

    @property
    def skipped(self) -> bool:
        """Whether ``optimizer.step()`` was skipped (may read the device, see :attr:`reason`)."""
        return self.reason is not None

    def settled(self) -> StepOutcome:
        """The same verdict as Python values (for a copied scaler)."""
        reason = self.reason
        return StepOutcome(reason == "nonfinite", reason == "spike")


@dataclass
class OptimizerRecord:
    """What one optimizer did in the iteration."""

    # Held so that the id() the record is keyed by cannot be reused within the iteration.
    optimizer: torch.optim.Optimizer
    stage: OptState = OptState.READY
    # The checked flag on the scale's device (agreed across ranks with a process group);
    # None before the check, or when the optimizer held no gradient.
    found_inf: torch.Tensor | None = None
    # This rank's own flag, before agreement (None: this rank held none of the gradients).
    local_found_inf: torch.Tensor | None = None
    # The guards' verdict (0-dim float, > 0: skip although finite); None without guards.
    spike: torch.Tensor | None = None
    outcome: StepOutcome | None = None  # set by step()

    def stepped(
        self, found_inf: torch.Tensor | bool, spike: torch.Tensor | bool | None
    ) -> StepOutcome:
        """The optimizer was stepped (or skipped) with this verdict; returns it."""
        self.stage = OptState.STEPPED
        self.outcome = StepOutcome(found_inf, spike)
        return self.outcome


def flag_sum(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """The flags added up (``None`` for none): > 0 iff any of them is.

    Example:
        >>> flag_sum([torch.tensor(0.0), torch.tensor(1.0)]), flag_sum([])
        (tensor(1.), None)
    """
    total = None
    for flag in flags:
        total = flag if total is None else total + flag
    return total


@dataclass
class Iteration:
    """One iteration's records, losses and outcome (module docstring).

    Attributes:
        records: per optimizer (by ``id``), in the order they were first seen.
        losses: the losses given to ``scale()``, detached (read only on skipped steps).
        scale: the live scale while the iteration runs; after ``update()`` a copy of the scale
            it ran at.
        found_inf: after ``update()``: the iteration's flag (> 0: some optimizer overflowed;
            ``None``: no optimizer was checked).
        spiked: after ``update()``: the guards' flag (``None``: no guard).
        new_scale: after ``update()``: the live scale (read only by consumers of records).
    """

    records: dict[int, OptimizerRecord] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    spiked: torch.Tensor | None = None
    new_scale: torch.Tensor | None = None

    def record(self, optimizer: torch.optim.Optimizer, funcname: str) -> OptimizerRecord:
        """``optimizer``'s record, made at its first call.

        Raises:
            TypeError: ``optimizer`` is not an optimizer (no ``param_groups`` and ``step``).
        """
        found = self.records.get(id(optimizer))
        if found is not None:
            return found
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"scaler.{funcname}() expects a torch.optim.Optimizer (an object with "
                f"param_groups and step()), got {type(optimizer).__name__}."
            )
        made = self.records[id(optimizer)] = OptimizerRecord(optimizer)
        return made

    @property
    def stepped(self) -> bool:
        """Whether any optimizer has been stepped in this iteration."""
        return any(record.stage is OptState.STEPPED for record in self.records.values())

    def keep_loss(self, loss: torch.Tensor) -> None:
        """Keep a loss given to ``scale()`` (detached; no device work unless many are kept,
        when they are summed into one)."""
        losses = self.losses
        losses.append(loss.detach())
        if len(losses) > _KEEP_LOSSES:
            losses[:] = [_loss_sum(losses)]

    def loss(self) -> torch.Tensor | None:
        """The sum of the iteration's losses so far, unscaled (on the device; ``None`` when
        ``scale()`` kept none)."""
        return _loss_sum(self.losses) if self.losses else None

    def flags(self) -> list[torch.Tensor]:
        """The inf flags of the optimizers that were checked."""
        return [r.found_inf for r in self.records.values() if r.found_inf is not None]

    def spikes(self) -> list[torch.Tensor]:
        """The guards' flags of the optimizers that had them."""
        return [r.spike for r in self.records.values() if r.spike is not None]

    def require_checked(self) -> None:
        """Raise unless some optimizer was checked (``update()`` needs a flag).

        Raises:
            ScalerUsageError: no ``step()`` or ``unscale_()`` in the iteration.
        """
        if not self.flags():
            raise ScalerUsageError(
                "No inf checks were recorded prior to update(). Call scaler.step(optimizer) "
                "for every optimizer of the iteration before scaler.update()."
            )


def _loss_sum(losses: list[torch.Tensor]) -> torch.Tensor:
    """The losses summed into one float32 value, on the first one's device."""
    device = losses[0].device
    if len(losses) == 1:
        return losses[0].to(torch.float32).sum()
    return torch.stack([loss.to(device, torch.float32).sum() for loss in losses]).sum()
