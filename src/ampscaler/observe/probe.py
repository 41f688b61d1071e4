"""The underflow and headroom probe: how much of the gradient fp16 loses, and how close to overflow.

Attach one with ``scaler.attach(GradientProbe(every=N))``. On the first iteration after
attaching and every ``N``-th after it, it measures

* **underflow** (a): of the non-zero gradient elements at the current scale (as the optimizer's
  gradients hold them before unscaling), the fraction that would flush to zero if stored in fp16
  (``|g| <= 2**-25``), and the same fraction for the gradients divided by the scale, i.e. what
  training without loss scaling would lose;
* **headroom** (b): ``log2(65504 / max|g|)`` for the scaled gradients ``g``, the number of times
  the scale could double before the largest gradient overflows fp16 (negative: it already
  overflowed; ``inf``: every gradient is zero);
* **per-module underflow** (c): through hooks on the leaf modules of the watched models, the
  gradient elements arriving at each module's outputs as fp16 holds them: how many are zero or
  subnormal (``|g| < 2**-14``, fewer than 10 significant bits left) and how many are exactly zero
  (:class:`UnderflowCounts`). A gradient of another dtype (an fp32 model, or a module autocast
  runs in fp32) is rounded to fp16 first, so for it the counts say what fp16 *would* lose; its
  exact zeros carry no signal and are not counted. An fp16 gradient's zeros are counted: without
  a reference, nothing tells a flushed element from one that was zero all along. A result keeps
  the worst modules (:attr:`ProbeResult.modules`) and the counts of all of them together
  (:attr:`ProbeResult.activations`), with the dtypes the gradients were held in.

(a) and (c) measure different gradients. The parameter gradients of (a) are what the optimizer
gets, and a parameter gradient that fp16 already flushed on the way back is an exact zero that
(a) cannot tell from a true zero, so it is left out: without loss scaling, (a) stays near 0% while
most of the signal is gone. The activation gradients of (c) are where the flushing happens; they
are the measure of the Mixed Precision Training paper, of ``python -m ampscaler demo``'s table,
and of the top panel of ``python -m ampscaler report``'s ``probe.png``.

**Against an fp32 reference.** An element that is zero in fp16 may have been flushed, or may
have been zero all along (behind a ReLU, say). To tell them apart, run the same step once more
without autocast and without loss scaling, on the same batch, inside
:meth:`GradientProbe.reference` just before the real backward: the module gradients of that pass
become the reference, and elements whose reference is zero carry no signal and are left out of
(c). This is the measurement the Mixed Precision Training paper (Micikevicius et al., 2018)
reports for SSD; ``python -m ampscaler demo`` makes it on every probed step. It costs one more
forward and backward, and holds the reference gradients until the probed backward has used them.

Everything is computed on the device. Attached to a scaler, the probe is one of its hooks
(:mod:`ampscaler.hooks`): it measures before each optimizer's check and ends its iteration
before the update, leaving the results in the iteration's notes (:data:`PROBE_NOTE`), where the
step record's one host sync reads them (:attr:`StepRecord.probe <ampscaler.StepRecord.probe>`).
Because its schedule is a Python count, ``update()`` runs eagerly under ``torch.compile`` while
a probe is attached. Standalone, :meth:`PendingProbe.read` reads the results. The module hooks
exist only during probed iterations.

Example:
    Standalone (a scaler calls :meth:`~GradientProbe.measure` and
    :meth:`~GradientProbe.end_iteration` itself):

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> probe = GradientProbe(every=100)
    >>> probe.watch(model)
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     out = model(torch.ones(2, 4))
    >>> (out.float().sum() * 1e-8).backward()   # the output's gradient is 1e-8: zero in fp16
    >>> probe.measure(optimizer, torch.tensor(1.0))
    >>> result = probe.end_iteration().read(scale=1.0)
    >>> result.module_counts["1"]
    UnderflowCounts(carrying_signal=2, underflowed=2, flushed=2)
    >>> probe.due   # the next probe is 100 iterations on
    False
"""

from __future__ import annotations

import functools
import math
import operator
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..grads.collect import grad_views
from ..hooks import Hook
from ..hostcopy import read_values
from ..policy.base import FP16_MAX, require_int
from ..taps import GradTaps, WatchedModels
from .plain import Plain

if TYPE_CHECKING:
    from ..iteration import Iteration, OptimizerRecord
    from ..state import LiveState

__all__ = [
    "FP16_MAX",
    "PROBE_NOTE",
    "GradientProbe",
    "PendingProbe",
    "ProbeResult",
    "UnderflowCounts",
    "count_underflow",
    "flushed_wording",
]

FLUSH_TO_ZERO = 2.0**-25  # fp16 rounds |x| <= 2**-25 to zero (half the smallest subnormal)
SMALLEST_NORMAL = 2.0**-14
WORST_MODULES = 10

#: Where an attached probe leaves an iteration's :class:`PendingProbe` in ``Iteration.notes``.
PROBE_NOTE = "probe"


@dataclass(frozen=True)
class UnderflowCounts(Plain):
    """Gradient elements as fp16 holds them: one module's on one probe, or any sum of those.

    Attributes:
        carrying_signal: the elements counted: those whose fp32 reference is non-zero; without
            a reference, every element of an fp16 gradient, the non-zero ones of any other.
        underflowed: of those, the ones zero or subnormal in fp16 (``|g| < 2**-14``).
        flushed: of those, the ones exactly zero in fp16 (``|g| <= 2**-25`` rounds to 0).

    Example:
        >>> UnderflowCounts(4, 3, 2) + UnderflowCounts(4, 1, 0)
        UnderflowCounts(carrying_signal=8, underflowed=4, flushed=2)
    """

    carrying_signal: int = 0
    underflowed: int = 0
    flushed: int = 0

    def __add__(self, other: UnderflowCounts) -> UnderflowCounts:
        return UnderflowCounts(*map(operator.add, astuple(self), astuple(other)))

    @property
    def fraction(self) -> float:
        """Underflowed (zero or subnormal) among the elements carrying signal; 0 if none."""
        return self.underflowed / self.carrying_signal if self.carrying_signal else 0.0

    @property
    def flushed_fraction(self) -> float:
        """Exactly zero among the elements carrying signal; 0 if none."""
        return self.flushed / self.carrying_signal if self.carrying_signal else 0.0


def _count(grad: torch.Tensor, reference: torch.Tensor | None) -> torch.Tensor:
    """``[carrying signal, underflowed, flushed]`` for ``grad``, an int64 tensor on its device.

    A gradient not held in fp16 is its own reference. No host sync.
    """
    if reference is None and grad.dtype is not torch.float16:
        reference = grad
    if reference is not None and reference.shape != grad.shape:
        raise ValueError(
            f"The gradient has shape {tuple(grad.shape)} but its reference has "
            f"{tuple(reference.shape)}; both must come from the same module and batch."
        )
    with torch.no_grad():
        held = grad.detach().to(torch.float16).abs()
        small = held < SMALLEST_NORMAL
        zero = held == 0
        if reference is None:
            signal = torch.full((), held.numel(), dtype=torch.int64, device=held.device)
        else:
            carries = reference.to(held.device) != 0
            small &= carries
            zero &= carries
            signal = torch.count_nonzero(carries)
        return torch.stack([signal, torch.count_nonzero(small), torch.count_nonzero(zero)])


def count_underflow(grad: torch.Tensor, reference: torch.Tensor | None = None) -> UnderflowCounts:
    """Count one gradient as fp16 holds it, against its fp32 ``reference`` if given (a host sync).

    This is what the probe's module hooks count, on the device, for every tapped gradient.

    Raises:
        ValueError: ``reference`` has another shape than ``grad``.

    Example:
        >>> count_underflow(torch.tensor([1e-9, 1e-6, 1.0, 0.0]))   # flushed, subnormal, normal
        UnderflowCounts(carrying_signal=3, underflowed=2, flushed=1)
        >>> count_underflow(torch.tensor([1e-9, 1e-6, 1.0, 0.0]).half())  # zero in fp16: counted
        UnderflowCounts(carrying_signal=4, underflowed=3, flushed=2)
    """
    return UnderflowCounts(*_count(grad, reference).tolist())


@dataclass(frozen=True)
class ProbeResult(Plain):
    """What one probe measured (the ``probe`` field of a step record).

    Attributes:
        scale: the loss scale of the probed gradients.
        elements: optimizer gradient elements examined (sparse gradients: their stored values;
            0 when only modules were measured).
        nonzero: of those, the non-zero ones.
        underflow_at_scale: fraction of the non-zero elements that would flush to zero in fp16
            at ``scale``.
        underflow_at_one: the same fraction for the gradients divided by ``scale``.
        headroom_log2: ``log2(65504 / max|scaled gradient|)``.
        modules: the worst watched leaf modules (up to ``worst_modules``, 10 by default) ->
            the fraction of their output gradients' elements carrying signal that are zero or
            subnormal in fp16; worst first.
        module_counts: the counts behind ``modules``, same modules, same order (empty when
            read from older logs, which hold only the fractions).
        activations: the counts of every measured module together, the kept and the others
            (``None`` when no module was measured, or read from an older log).
        activation_dtypes: the dtypes the counted module gradients were held in (``"float16"``,
            ``"float32"``, ...), sorted: without ``"float16"``, the counts say what fp16
            *would* do to them.
    """

    scale: float
    elements: int
    nonzero: int
    underflow_at_scale: float
    underflow_at_one: float
    headroom_log2: float
    modules: dict[str, float] = field(default_factory=dict)
    module_counts: dict[str, UnderflowCounts] = field(default_factory=dict)
    activations: UnderflowCounts | None = None
    activation_dtypes: tuple[str, ...] = ()


def flushed_wording(dtypes: Sequence[str]) -> str:
    """How to say "flushed to 0" of activation gradients held in ``dtypes`` (see
    :attr:`ProbeResult.activation_dtypes`): gradients held in another dtype than float16 are
    rounded to fp16 to be counted, so for them it is what fp16 *would* do.

    Example:
        >>> flushed_wording(["float16"]), flushed_wording(["float32"])
        ('flushed to 0', 'would be flushed to 0 in fp16')
    """
    if not dtypes or list(dtypes) == ["float16"]:
        return "flushed to 0"
    if "float16" not in dtypes:
        return "would be flushed to 0 in fp16"
    return "flushed to 0 (those held in another dtype: would be, in fp16)"


def _headroom(largest: float) -> float:
    """``log2(65504 / largest)``, NaN for NaN; ``inf`` for 0 and ``-inf`` for inf."""
    if largest == 0.0:
        return math.inf
    return -math.inf if math.isinf(largest) else math.log2(FP16_MAX / largest)


@dataclass(frozen=True)
class PendingProbe:
    """A probe's results on the device, waiting for a host sync.

    Attributes:
        elements: optimizer gradient elements measured (0: none, only modules).
        values: three tensors on one device: the int64 counts of the zeros and of the elements
            at or below the flush threshold at the scale and at scale 1; the float32 largest
            magnitude; the int64 counts of ``modules``, three each (:class:`UnderflowCounts`'
            fields).
        modules: the modules measured, in the order they were first tapped.
        keep: how many of the worst modules the result keeps (``None``: all).
        dtypes: the dtypes the modules' gradients were held in, sorted.
    """

    elements: int
    values: list[torch.Tensor]
    modules: list[str]
    keep: int | None
    dtypes: tuple[str, ...] = ()

    def finish(self, values: Sequence[Any], scale: float) -> ProbeResult:
        """The result from :attr:`values` as :func:`~ampscaler.hostcopy.read_values` reads
        them back from the device, for gradients at ``scale``."""
        (zeros, flush_at_scale, flush_at_one), largest, per_module = values
        nonzero = self.elements - zeros
        counts = {
            name: UnderflowCounts(*per_module[3 * i : 3 * i + 3])
            for i, name in enumerate(self.modules)
        }
        worst = sorted(counts.items(), key=lambda item: item[1].fraction, reverse=True)
        kept = dict(worst[: self.keep])
        return ProbeResult(
            scale=scale,
            elements=self.elements,
            nonzero=nonzero,
            underflow_at_scale=(flush_at_scale - zeros) / nonzero if nonzero else 0.0,
            underflow_at_one=(flush_at_one - zeros) / nonzero if nonzero else 0.0,
            headroom_log2=_headroom(largest),
            modules={name: c.fraction for name, c in kept.items()},
            module_counts=kept,
            activations=sum(counts.values(), UnderflowCounts()) if counts else None,
            activation_dtypes=self.dtypes,
        )

    def read(self, scale: float) -> ProbeResult:
        """Read :attr:`values` (one host sync) and :meth:`finish`."""
        return self.finish(read_values(self.values), scale)


@dataclass(eq=False)
class GradientProbe(Hook):
    """Measures the gradients of every ``every``-th iteration; see the module docstring.

    Attached to a scaler (``scaler.attach(GradientProbe(...))``), it is a hook that measures
    each optimizer's gradients before their check and ends its iteration before the update;
    a scaler takes one (a step record holds one probe's results).

    Args:
        every: probe the first iteration after attaching and every ``every``-th after it.
        worst_modules: how many modules a result keeps, worst first (``None``: all).

    Raises:
        InvalidConfigError: (a ``ValueError``) ``every`` or ``worst_modules`` is not an int >= 1.
    """

    every: int = 1
    worst_modules: int | None = field(default=WORST_MODULES, kw_only=True)
    unique = True  # a step record holds one probe's results

    def __post_init__(self) -> None:
        self.every = require_int("GradientProbe every", self.every, 1)
        if self.worst_modules is not None:
            self.worst_modules = require_int("GradientProbe worst_modules", self.worst_modules, 1)
        self._taps = GradTaps(self._tap)
        self._models = WatchedModels()
        self._iteration = 0
        self._recording_reference = False
        self._reference: dict[str, list[torch.Tensor]] = {}
        # (a) and (b), per device and dtype: [zeros, <= flush at scale, <= flush at 1], max|g|.
        self._counts: list[torch.Tensor] = []
        self._maxima: list[torch.Tensor] = []
        self._elements = 0
        # (c): module name -> [carrying signal, underflowed, flushed], summed over its taps,
        # and the dtypes those gradients were held in.
        self._modules: dict[str, torch.Tensor] = {}
        self._dtypes: set[torch.dtype] = set()

    @property
    def due(self) -> bool:
        """Whether the iteration in progress is probed."""
        return self._iteration % self.every == 0

    def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Measure the leaf modules of ``model`` (names prefixed by ``prefix``) on probed
        iterations. The model is held weakly."""
        self._models.add(model, prefix)
        if self.due:
            self._taps.attach(model, prefix)

    def detach(self) -> None:
        """Remove the module hooks and forget the watched models."""
        self._taps.detach()
        self._models.clear()

    @contextmanager
    def reference(self) -> Iterator[None]:
        """Inside, the backward passes tapped on a probed iteration record the fp32 reference.

        Run the same forward and backward as the step to come, without autocast and without
        loss scaling, then zero the gradients; the step's own backward is then counted against
        it, module by module and in backward order (see the module docstring).

        Example::

            if probe.due:
                with probe.reference():
                    loss_fn(model(x).float(), y).backward()
                optimizer.zero_grad()
        """
        self._reference = {}
        self._recording_reference = True
        try:
            yield
        finally:
            self._recording_reference = False

    def _tap(self, name: str, where: str, grad: torch.Tensor) -> None:
        values = grad._values() if grad.is_sparse else grad
        if values.numel() == 0:
            return
        if self._recording_reference:
            self._reference.setdefault(name, []).append(values.detach())
            return
        queue = self._reference.get(name)
        counts = _count(values, queue.pop(0) if queue else None)
        self._dtypes.add(values.dtype)
        previous = self._modules.get(name)
        self._modules[name] = counts if previous is None else previous + counts

    def measure(self, optimizer: torch.optim.Optimizer, scale: torch.Tensor) -> None:
        """Count ``optimizer``'s gradients at ``scale`` (before unscaling) if the iteration is
        probed. Reads ``scale`` now. No host sync."""
        if not self.due:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for _, _, _, view in grad_views([optimizer]):
            if view.numel():
                groups[(view.device, view.dtype)].append(view.reshape(-1))
        with torch.no_grad():
            for (device, _), grads in groups.items():
                flat = torch.cat(grads).abs_() if len(grads) > 1 else grads[0].abs()
                at_one = scale.to(device, non_blocking=True) * FLUSH_TO_ZERO
                # |g| <= each bound: zero; flushed at the scale; flushed at scale 1
                bounds = (0.0, FLUSH_TO_ZERO, at_one)
                self._counts.append(torch.stack([torch.count_nonzero(flat <= b) for b in bounds]))
                self._maxima.append(flat.max().float())
                self._elements += flat.numel()

    def before_check(self, record: OptimizerRecord, scale: torch.Tensor) -> None:
        """As a hook: :meth:`measure` the optimizer's gradients, still scaled by ``scale``."""
        self.measure(record.optimizer, scale)

    def before_update(self, iteration: Iteration, live: LiveState) -> None:
        """As a hook: :meth:`end_iteration`, leaving its results in ``iteration``'s notes
        (:data:`PROBE_NOTE`; ``None``: nothing measured) for the step record."""
        iteration.notes[PROBE_NOTE] = self.end_iteration()

    def end_iteration(self) -> PendingProbe | None:
        """End the iteration: its results (``None`` if it measured nothing), and the hooks set
        for the next one (registered when it is probed, removed otherwise). No host sync."""
        pending = self._take() if self._elements or self._modules else None
        self._counts, self._maxima, self._elements, self._modules = [], [], 0, {}
        self._dtypes, self._reference = set(), {}
        self._iteration += 1
        self._taps.arm(self.due, self._models)
        return pending

    def _take(self) -> PendingProbe:
        """What the iteration measured, on the device: (a) and (b), and (c) per module."""
        modules = list(self._modules.values())
        device = (self._counts or modules)[0].device
        if self._elements:
            counts = torch.stack([c.to(device) for c in self._counts]).sum(dim=0)
            largest = torch.stack([m.to(device) for m in self._maxima]).max()
        else:
            counts = torch.zeros(3, dtype=torch.int64, device=device)
            largest = torch.zeros((), device=device)
        per_module = torch.cat([c.to(device) for c in modules]) if modules else counts[:0]
        return PendingProbe(
            self._elements,
            [counts, largest, per_module],
            list(self._modules),
            self.worst_modules,
            tuple(sorted(str(dtype).removeprefix("torch.") for dtype in self._dtypes)),
        )

    def __reduce__(self) -> tuple[Callable[..., GradientProbe], tuple[Any, ...]]:
        # Hooks and watched models belong to this process: a copy starts a fresh schedule and
        # is given its scaler's models anew.
        return functools.partial(GradientProbe, worst_modules=self.worst_modules), (self.every,)
