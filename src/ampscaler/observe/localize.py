"""Where an overflow happened: the parameters whose gradients held inf or NaN, and the module
whose backward produced them.

**Naming parameters.** :func:`locate_overflow` runs only on steps already known to be skipped,
so clean steps pay nothing. It screens all gradients with one batched L1 norm per device and
dtype (one host sync each; a norm is non-finite when an element is), and looks closer only at
the tensors that fail the screen. Gradients come from
:func:`~ampscaler.grads.collect.grad_views` (DTensor shards, sparse values), names from
:class:`ParamNames`.

**Naming the module.** :class:`NonFiniteTracer` (``scaler.attach(NonFiniteTracer())``) taps
every leaf module of the watched models. During each backward it records, on the device and
without a host sync, whether the gradient arriving at a module's outputs, the gradient it passes
to its inputs and the gradients of its own parameters are finite; as a hook of the scaler it
leaves an iteration's flags in the iteration's notes (:data:`TRACE_NOTE`). Only when a step is
skipped are these flags read (one host sync) and judged:

* a module *produced* a non-finite gradient when its input or parameter gradients are
  non-finite while every gradient that arrived at its outputs was finite;
* the origin is the first such module in backward order;
* when no module produced one but some output gradient was already non-finite: if the first
  gradient backward brought to a watched module was, it came from the loss (or from code
  between the loss and the watched modules), :data:`LOSS_ORIGIN`; otherwise from code between
  two watched modules (a plain function such as ``sqrt`` at 0), and the origin is the first
  module it reached.

The tracer costs one small reduction per tapped tensor per backward, and a Python call per
hook; see docs/diagnostics.md for measurements.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> names = ParamNames()
    >>> names.watch(model)
    >>> tracer = NonFiniteTracer()
    >>> tracer.watch(model)
    >>> with torch.no_grad():
    ...     _ = model[1].weight.fill_(float("inf"))
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> origin = NonFiniteTracer.origin(tracer.take())   # one host sync
    >>> report = locate_overflow([opt], names, step=7, origin=origin)
    >>> report.names, report.kinds, report.origin
    (['0.weight', '0.bias'], {'0.weight': 'inf', '0.bias': 'inf'}, '1')
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..grads.collect import grad_views
from ..hooks import Hook
from ..taps import GradTaps
from .plain import Plain

if TYPE_CHECKING:
    from ..iteration import Iteration, OptimizerRecord
    from ..state import LiveState

__all__ = [
    "LOSS_ORIGIN",
    "TRACE_NOTE",
    "NonFiniteTracer",
    "OverflowReport",
    "ParamNames",
    "TraceEvent",
    "locate_overflow",
    "merge_reports",
    "nonfinite_kinds",
]

LOSS_ORIGIN = "<loss>"
"""The origin of a non-finite gradient that reached the watched modules from the loss."""

TraceEvent = tuple[str, str, torch.Tensor]
"""``(module name, "input" / "output" / "param", 0-dim finite flag)``: one tapped gradient."""

#: Where an attached tracer leaves an iteration's events in ``Iteration.notes``.
TRACE_NOTE = "trace"


class ParamNames:
    """Names for parameters, learned from ``model.named_parameters()``.

    Parameters are remembered by identity through weak references, so watching a model keeps
    nothing alive. Unwatched parameters are named by optimizer position, ``group0.param3``.
    """

    def __init__(self) -> None:
        self._names: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Learn the names of ``model``'s parameters (prefixed with ``prefix`` + ``.``)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"watch() expects a torch.nn.Module, got {type(model).__name__}; pass the model "
                "whose parameters the optimizer updates."
            )
        lead = f"{prefix}." if prefix else ""
        for name, param in model.named_parameters():
            if param not in self._names:
                self._names[param] = lead + name

    def name(self, param: torch.Tensor, group_index: int, param_index: int) -> str:
        """The watched name of ``param``, or its position in the optimizer."""
        if param in self._names:
            return str(self._names[param])
        return f"group{group_index}.param{param_index}"

    def __len__(self) -> int:
        return len(self._names)

    def __reduce__(self) -> tuple[type[ParamNames], tuple[()]]:
        # Weak references cannot be pickled, and a copy's parameters are new tensors anyway:
        # a copied scaler learns names again through watch().
        return ParamNames, ()


@dataclass(frozen=True)
class OverflowReport(Plain):
    """The parameters whose gradients were non-finite on one skipped step.

    Attributes:
        step: the step number (``stats.steps`` before the step was counted, from 0).
        names: the offending parameters, in optimizer parameter order.
        kinds: name -> ``"inf"``, ``"nan"`` or ``"inf+nan"``.
        scale: the loss scale the gradients were computed with.
        rank: the process's rank in the default process group, or ``None`` when not distributed.
        origin: with a :class:`NonFiniteTracer` attached, the first watched module whose
            gradient turned non-finite: its backward produced it, or it received it from code
            between it and the watched modules backward passed before (a plain function
            between two layers); ``"<loss>"`` when the first gradient backward brought to the
            watched modules was already non-finite (from the loss, or code between the loss
            and them); ``None`` when not traced.
        ranks: with a scaler ``process_group`` (plain optimizers), the global ranks the
            trouble came from, the same on every rank (the whole group skipped the step with
            them): for cause ``"loss"`` the ranks whose loss was non-finite, else the ranks
            whose gradients overflowed; empty otherwise.
        cause: ``"loss"`` when a loss passed to ``scale()`` in the iteration was already
            inf/NaN before scaling (a forward overflow in float16 activations, or bad data:
            lowering the scale cannot help); ``"gradients"`` when the losses were finite and
            the scaled gradients overflowed (what backing off is for); ``None`` when unknown
            (``scale()`` ran inside ``torch.compile``). With a ``process_group``, agreed: a
            non-finite loss on any rank is the cause on every rank.
        micro_batch: for cause ``"loss"``, which ``scale()`` call of the iteration (from 0)
            had the first non-finite loss (on the first of ``ranks`` with a process group);
            ``None`` when unknown.
    """

    step: int
    names: list[str]
    kinds: dict[str, str]
    scale: float
    rank: int | None = None
    ranks: Sequence[int] = field(default_factory=tuple)
    origin: str | None = None
    cause: str | None = None
    micro_batch: int | None = None

    def __str__(self) -> str:
        batch = "" if self.micro_batch is None else f" (micro-batch {self.micro_batch})"
        return self._where() + _CAUSE_NOTE.get(self.cause or "", "") + batch

    def _where(self) -> str:
        where = f" on rank {self.rank}" if self.rank is not None else ""
        traced = f"; first non-finite in the backward of {self.origin}" if self.origin else ""
        label = "rank" if len(self.ranks) == 1 else "ranks"
        culprits = f"{label} {', '.join(map(str, self.ranks))}"
        trouble = "a non-finite loss" if self.cause == "loss" else "an overflow"
        if self.ranks and self.rank not in self.ranks and not self.names:
            return (
                f"step {self.step}{where}: skipped with the whole process group because of "
                f"{trouble} on {culprits} at scale {self.scale:g}; this rank's gradients were "
                "finite"
            )
        if not self.names:
            return (
                f"step {self.step}{where}: overflow at scale {self.scale:g}, but no gradient "
                f"held inf/NaN any more when it was examined{traced}"
            )
        shown = ", ".join(f"{n} ({self.kinds[n]})" for n in self.names[:10])
        more = f" and {len(self.names) - 10} more" if len(self.names) > 10 else ""
        also = f" ({trouble} on {culprits})" if self.ranks else ""
        return (
            f"step {self.step}{where}: non-finite gradients at scale {self.scale:g} in "
            f"{len(self.names)} parameter(s): {shown}{more}{also}{traced}"
        )


_CAUSE_NOTE = {
    "loss": "; cause: loss (already inf/NaN before scaling: lowering the scale cannot help)",
    "gradients": "; cause: gradients",
}


def process_rank() -> int | None:
    """The process's rank in the default process group, ``None`` when not distributed."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def nonfinite_kinds(tensors: Sequence[torch.Tensor]) -> list[str]:
    """``"inf"``, ``"nan"``, ``"inf+nan"``, or ``""`` when finite, for each of ``tensors``.

    One batched L1 norm per device and dtype screens them all (it is NaN exactly when the
    tensor holds a NaN, and inf when it holds an inf, or, for a finite tensor, when the sum
    overflows float32); only the tensors that fail the screen are then checked for inf. Host
    syncs: one per device and dtype, plus one per device and dtype with failing tensors.

    Example:
        >>> nonfinite_kinds([torch.ones(2), torch.tensor([1.0, float("-inf"), float("nan")])])
        ['', 'inf+nan']
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        by_kind[(tensor.device, tensor.dtype)].append(index)
    kinds = [""] * len(tensors)
    for (_, dtype), indices in by_kind.items():
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        norms = torch._foreach_norm([tensors[i] for i in indices], 1, dtype=wide)
        norm_of = zip(indices, torch.stack(norms).tolist(), strict=True)
        failing = [(i, math.isnan(norm)) for i, norm in norm_of if not math.isfinite(norm)]
        if failing:
            has_inf = torch.stack([torch.isinf(tensors[i]).any() for i, _ in failing]).tolist()
            for (index, nan), inf in zip(failing, has_inf, strict=True):
                kinds[index] = "+".join(k for k, has in (("inf", inf), ("nan", nan)) if has)
    return kinds


def locate_overflow(
    optimizers: Iterable[torch.optim.Optimizer],
    names: ParamNames,
    step: int,
    scale: float = 1.0,
    origin: str | None = None,
    cause: str | None = None,
) -> OverflowReport:
    """Examine every gradient of ``optimizers`` and report the non-finite ones.

    Host syncs: see :func:`nonfinite_kinds`.
    """
    with torch.no_grad():
        views = list(grad_views(optimizers))
        kinds = nonfinite_kinds([grad for *_, grad in views])
    found: dict[str, str] = {}
    for (group_index, param_index, param, _), kind in zip(views, kinds, strict=True):
        if kind:
            found.setdefault(names.name(param, group_index, param_index), kind)
    return OverflowReport(
        step=step,
        names=list(found),
        kinds=found,
        scale=scale,
        rank=process_rank(),
        origin=origin,
        cause=cause,
    )


def merge_reports(reports: Sequence[OverflowReport]) -> OverflowReport:
    """One report for an iteration from the reports of its optimizers (in stepping order).

    Example:
        >>> a = OverflowReport(step=3, names=["w"], kinds={"w": "inf"}, scale=8.0)
        >>> b = OverflowReport(step=3, names=["b"], kinds={"b": "nan"}, scale=8.0)
        >>> merge_reports([a, b]).kinds
        {'w': 'inf', 'b': 'nan'}
    """
    kinds: dict[str, str] = {}
    for report in reports:
        for name in report.names:
            kinds.setdefault(name, report.kinds[name])
    origin = next((r.origin for r in reports if r.origin is not None), None)
    # The step, scale, rank and what the iteration's losses say are the same in every report.
    return dataclasses.replace(reports[0], names=list(kinds), kinds=kinds, origin=origin)


class NonFiniteTracer(Hook):
    """Records finiteness flags of the gradients around watched modules, judged on demand.

    Attach one to a scaler with ``scaler.attach(NonFiniteTracer())`` and ``scaler.watch(model)``:
    the scaler taps the models it watches, and the
    :attr:`OverflowReport.origin` of a skipped step names the module whose backward produced
    the inf or NaN. As a hook it hands each iteration its events (:data:`TRACE_NOTE`) once an
    optimizer stepped or skipped, and starts a new list after the update. Standalone,
    :meth:`watch` a model and judge :meth:`take`'s events with :meth:`origin` (see the module
    docstring).
    """

    unique = True  # one tracer covers every watched model

    def __init__(self) -> None:
        self._events: list[TraceEvent] = []
        self._taps = GradTaps(self._record, inputs=True, params=True)

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Tap the leaf modules of ``model`` (names prefixed by ``prefix``) from now on."""
        self._taps.attach(model, prefix)

    def detach(self) -> None:
        """Remove every hook (the tracer records nothing more)."""
        self._taps.detach()

    def _record(self, name: str, where: str, grad: torch.Tensor) -> None:
        """Record whether ``grad`` is all finite, as a 0-dim bool tensor (no host sync).

        A sum is non-finite when an element is, and far cheaper than ``isfinite(grad).all()``;
        half-precision gradients are summed in float32, so finite ones cannot overflow it.
        """
        with torch.no_grad():
            values = grad._values() if grad.is_sparse else grad
            wide = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else None
            self._events.append((name, where, torch.isfinite(values.sum(dtype=wide))))

    @property
    def events(self) -> list[TraceEvent]:
        """The flags recorded since the last :meth:`take`, in backward order."""
        return self._events

    def take(self) -> list[TraceEvent]:
        """Return the recorded flags and start a new list (called once per iteration)."""
        events, self._events = self._events, []
        return events

    def after_step(self, iteration: Iteration, record: OptimizerRecord, live: LiveState) -> None:
        """As a hook: the iteration's events so far are its trace."""
        iteration.notes[TRACE_NOTE] = self._events

    on_skip = after_step  # a skip known in unscale_(), before any step: the same

    def after_update(self, iteration: Iteration, live: LiveState, compiling: bool) -> None:
        """As a hook: the iteration keeps its events; the next one starts a new list."""
        iteration.notes[TRACE_NOTE] = self.take()

    @staticmethod
    def origin(events: list[TraceEvent]) -> str | None:
        """The origin of the non-finite gradients among ``events`` (one host sync), or ``None``.

        ``None`` when every recorded gradient was finite (for example when the inf or NaN was
        put into ``.grad`` after backward, or the culprit is not in a watched module).
        """
        if not events:
            return None
        target = events[0][2].device
        finite = torch.stack([flag.to(target) for _, _, flag in events]).tolist()
        received = [
            (name, ok) for (name, where, _), ok in zip(events, finite, strict=True)
            if where == "output"
        ]  # fmt: skip
        received_bad = {name for name, ok in received if not ok}
        for (name, where, _), ok in zip(events, finite, strict=True):
            if where != "output" and not ok and name not in received_bad:
                return name
        if not received_bad:
            return None
        if not received[0][1]:  # the first gradient backward brought was already bad
            return LOSS_ORIGIN
        # Finite gradients reached a watched module first: the inf/NaN came from code between
        # watched modules (a plain function), and reached this one first.
        return next(name for name, ok in received if not ok)

    def __reduce__(self) -> tuple[type[NonFiniteTracer], tuple[()]]:
        # Hooks belong to this process and these models: a copy is a fresh tracer, tapping the
        # models its scaler watches anew.
        return NonFiniteTracer, ()

    def __repr__(self) -> str:
        return "NonFiniteTracer()"
