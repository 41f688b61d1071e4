"""Training one arm of the demo: fp32, fp16 autocast alone, or fp16 autocast with a loss scaler.

Every arm starts from the same weights and sees the same batches in the same order (both come from
``DemoConfig.seed``), uses Adam with a cosine learning-rate decay, and runs on the CPU. The only
differences between arms are whether the forward pass runs under fp16 autocast and whether the
loss goes through a scaler before ``backward()``.

Example::

    from ampscaler.demo import DemoConfig, standard_arms, train_arm

    for arm in standard_arms():                  # fp32, fp16_no_scaling, fp16_ampscaler
        result = train_arm(arm, DemoConfig(steps=300))
        print(arm.name, result.final_loss, result.skipped_steps, result.final_scale)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ampscaler.demo.model import TaskSpec, batches, build_student
from ampscaler.observe.probe import GradientProbe, ProbeResult, UnderflowCounts
from ampscaler.observe.records import StepRecord

FP32 = "fp32"
FP16_NO_SCALING = "fp16_no_scaling"
FP16_AMPSCALER = "fp16_ampscaler"
FP16_HEADROOM = "fp16_headroom"


class LossScaler(Protocol):
    """What the demo needs from a loss scaler: the torch.amp.GradScaler interface.

    If the scaler also has a ``last_step_skipped`` attribute (as ampscaler's does), it is used to
    tell skipped steps; otherwise a step counts as skipped when the scale went down in ``update()``,
    which for torch.amp.GradScaler happens exactly on the steps it skipped.
    """

    def scale(self, outputs: Tensor) -> Tensor: ...

    def step(self, optimizer: torch.optim.Optimizer) -> object: ...

    def update(self) -> None: ...

    def get_scale(self) -> float: ...


ScalerFactory = Callable[[], LossScaler]
"""Makes a fresh scaler for one arm, e.g. ``lambda: ampscaler.GradScaler("cpu")``."""


def torch_grad_scaler() -> LossScaler:
    """``torch.amp.GradScaler("cpu")``, defaults: initial scale 2**16, growth every 2000 steps."""
    return torch.amp.GradScaler("cpu")


@dataclass(frozen=True)
class Arm:
    """One way of training: a name, fp16 autocast on or off, and an optional scaler factory."""

    name: str
    fp16: bool
    scaler_factory: ScalerFactory | None = None


def standard_arms(scaler_factory: ScalerFactory = torch_grad_scaler) -> tuple[Arm, Arm, Arm]:
    """The demo's three arms: fp32, fp16 without scaling, and fp16 with ``scaler_factory``'s scaler.

    The default factory is torch's GradScaler; pass one that makes ``ampscaler.GradScaler``.
    """
    return (
        Arm(FP32, fp16=False),
        Arm(FP16_NO_SCALING, fp16=True),
        Arm(FP16_AMPSCALER, fp16=True, scaler_factory=scaler_factory),
    )


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run; the defaults are the documented demo.

    Attributes:
        steps: optimizer steps per arm.
        lr: Adam's peak learning rate, decayed to 0 over ``steps`` along a half cosine.
        seed: draws the initial weights, the teacher and the batches.
        probe_every: measure activation-gradient underflow every this many steps (from step 0);
            ``None`` turns the probe off. In the fp16 arms each probe costs one extra fp32
            forward and backward, the reference (see :func:`activation_probe`).
        task: sizes of the model, data and batch.
    """

    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    probe_every: int | None = 25
    task: TaskSpec = field(default_factory=TaskSpec)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"DemoConfig.steps must be at least 1, got {self.steps}")
        if not self.lr > 0:
            raise ValueError(f"DemoConfig.lr must be positive, got {self.lr}")
        if self.probe_every is not None and self.probe_every < 1:
            raise ValueError(
                f"DemoConfig.probe_every must be at least 1 or None, got {self.probe_every}"
            )


def activation_probe(model: nn.Module, every: int) -> GradientProbe:
    """The library's probe on the output gradients of ``model``'s ``nn.Linear`` layers.

    Its module counts are the demo's underflow numbers. Here an *activation gradient* is the
    gradient of the loss with respect to a linear layer's output, an fp16 tensor under fp16
    autocast (the output is). In the fp16 arms each probed step first runs the same step as an
    fp32 reference (same weights and batch, no autocast, no loss scaling) inside
    :meth:`~ampscaler.GradientProbe.reference`; an element carries signal when its reference is
    non-zero, *underflowed* when the arm holds it zero or subnormal in fp16 (``|g| < 2**-14``,
    fewer than 10 significant bits left) and was *flushed* when it is exactly zero there. The
    values are taken as the arm has them: a scaled arm's gradients include its loss scale, which
    is what lifts them out of the subnormal range. The fp32 arm has no fp16 values and needs no
    reference pass, its fp32 gradients being their own: they are rounded to fp16 and counted, so
    for it the numbers say how many *would* underflow (the statistic the Mixed Precision Training
    paper reports for SSD).

    On the same steps the probe counts the parameter gradients the optimizer gets (the middle
    panel of ``python -m ampscaler report``'s ``probe-ARM.png``), of the parameters whose fp32
    gradient (the reference pass's; the fp32 arm's own) has a non-zero element. At step 0 that
    leaves out the hidden layers: behind the zero-initialised output layer no gradient reaches
    them, in fp32 either, and counted they would read as 86% of the elements zero in fp16 at
    any loss scale, as if scaling had failed.
    """
    probe = GradientProbe(every, worst_modules=None)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            probe.watch(module, name)
    return probe


@dataclass(frozen=True)
class UnderflowStats:
    """Activation-gradient underflow of one arm: counts per linear layer over its probes.

    Attributes:
        layers: layer name -> its counts summed over the probed steps, in the model's order.
        probes: how many steps were probed.
    """

    layers: dict[str, UnderflowCounts]
    probes: int

    @classmethod
    def of(cls, layers: Sequence[str], results: Sequence[ProbeResult]) -> UnderflowStats:
        """Sum the module counts of ``results`` for each of ``layers``."""
        none = UnderflowCounts()
        return cls(
            layers={
                name: sum((r.module_counts.get(name, none) for r in results), none)
                for name in layers
            },
            probes=len(results),
        )

    def total(self) -> UnderflowCounts:
        """The counts of all layers together."""
        return sum(self.layers.values(), UnderflowCounts())

    @property
    def fraction(self) -> float:
        """Share of signal-carrying activation-gradient elements that were zero or subnormal."""
        return self.total().fraction

    @property
    def flushed_fraction(self) -> float:
        """Share of signal-carrying activation-gradient elements that were exactly zero."""
        return self.total().flushed_fraction

    def by_layer(self) -> dict[str, dict[str, float]]:
        """Per layer name, in the model's order, its ``flushed_to_zero`` and
        ``zero_or_subnormal`` shares (the two measures of :attr:`flushed_fraction` and
        :attr:`fraction`, named as in ``summary.json``)."""
        return {
            name: {"flushed_to_zero": c.flushed_fraction, "zero_or_subnormal": c.fraction}
            for name, c in self.layers.items()
        }


StepCallback = Callable[[StepRecord], None]
"""Called after every step with its :class:`~ampscaler.StepRecord` (``loss`` and ``lr`` set),
e.g. to advance a progress bar or write a line of a log."""


@dataclass(frozen=True)
class ArmResult:
    """What one arm's training produced.

    Attributes:
        name: the arm's name.
        records: one :class:`~ampscaler.StepRecord` per step: its loss (before any scaling) and
            learning rate, whether the scaler skipped the optimizer step (never without one), the
            loss scale its backward used and the scale after it (1.0 without a scaler), and on
            probed steps the probe's result.
        underflow: activation-gradient underflow counts, or None when the probe was off.
        seconds: wall-clock time of the training loop, probes included.
    """

    name: str
    records: list[StepRecord]
    underflow: UnderflowStats | None
    seconds: float

    @property
    def losses(self) -> list[float]:
        """The training loss of every step (every demo record has one)."""
        return [r.loss for r in self.records if r.loss is not None]

    @property
    def skipped(self) -> list[bool]:
        """Per step, whether the scaler skipped the optimizer step."""
        return [r.skipped for r in self.records]

    @property
    def scales(self) -> list[float]:
        """Per step, the loss scale that step's backward used."""
        return [r.scale for r in self.records]

    @property
    def final_loss(self) -> float:
        """Mean of ``losses`` over the last 10% of steps."""
        return tail_mean(self.losses)

    @property
    def final_scale(self) -> float:
        """The scale after the last update (1.0 without a scaler)."""
        return self.records[-1].new_scale

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps the scaler skipped."""
        return sum(self.skipped)


def cosine_lr(step: int, steps: int, peak: float) -> float:
    """Learning rate at ``step`` of ``steps``: ``peak`` at step 0, down to 0 along a half cosine."""
    return peak * 0.5 * (1.0 + math.cos(math.pi * step / steps))


def tail_mean(values: Sequence[float], fraction: float = 0.1) -> float:
    """Mean of the last ``fraction`` of ``values`` (at least one value)."""
    if not values:
        raise ValueError("tail_mean needs at least one value")
    count = max(1, round(len(values) * fraction))
    return sum(values[-count:]) / count


def compute_loss(model: nn.Module, x: Tensor, y: Tensor, *, fp16: bool) -> Tensor:
    """Mean squared error of ``model(x)`` against ``y``, optionally under CPU fp16 autocast.

    Under autocast the linear layers run in fp16 (so do their outputs' gradients in backward) and
    the loss itself is computed in fp32, as autocast does for ``mse_loss``.
    """
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
        return F.mse_loss(model(x), y)


class _ArmTrainer:
    """The state of one arm while it trains; ``step`` runs one batch."""

    def __init__(self, arm: Arm, config: DemoConfig) -> None:
        self.arm = arm
        self.config = config
        self.model = build_student(config.task, config.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.scaler = arm.scaler_factory() if arm.scaler_factory is not None else None
        watch = getattr(self.scaler, "watch", None)
        if watch is not None:  # ampscaler's: names its overflow reports; a HeadroomPolicy
            watch(self.model)  # measures the model's activation gradients
        every = config.probe_every
        self.probe = activation_probe(self.model, every) if every is not None else None

    def step(self, index: int, x: Tensor, y: Tensor) -> StepRecord:
        """Train on one batch and say what happened."""
        lr = cosine_lr(index, self.config.steps, self.config.lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        probed = self.probe is not None and self.probe.due
        # fp16 arms: the parameters with a gradient in fp32, from the reference pass
        with_signal = self._reference_backward(x, y) if probed and self.arm.fp16 else None
        loss = self._backward(x, y)
        scale = self._scale()
        if probed:
            self._measure(self._with_gradient() if with_signal is None else with_signal, scale)
        skipped = self._optimizer_step(scale)
        pending = self.probe.end_iteration() if self.probe is not None else None
        return StepRecord(
            step=index,
            scale=scale,
            new_scale=self._scale(),
            skipped=skipped,
            time=time.time(),
            # why a step was skipped (ampscaler's scaler says; torch's has no report)
            overflow=getattr(self.scaler, "last_overflow", None) if skipped else None,
            probe=pending.read(scale) if pending is not None else None,
            loss=loss,
            lr=lr,
        )

    def _scale(self) -> float:
        """The scaler's current scale, 1.0 without a scaler."""
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def _reference_backward(self, x: Tensor, y: Tensor) -> list[nn.Parameter]:
        """The step in fp32, unscaled, as the probe's reference (see :func:`activation_probe`);
        returns the parameters whose gradient it made non-zero."""
        assert self.probe is not None
        self.optimizer.zero_grad(set_to_none=True)
        with self.probe.reference():
            compute_loss(self.model, x, y, fp16=False).backward()  # type: ignore[no-untyped-call]
        return self._with_gradient()

    def _with_gradient(self) -> list[nn.Parameter]:
        """The model's parameters whose gradient has a non-zero element (a host read each)."""
        return [p for p in self.model.parameters() if p.grad is not None and bool(p.grad.any())]

    def _measure(self, with_signal: list[nn.Parameter], scale: float) -> None:
        """Let the probe count the optimizer's gradients of ``with_signal`` at ``scale``.

        A parameter whose fp32 gradient is all zero is left out: no fp16 value of it can have
        lost anything. At step 0 that is every hidden layer, behind the zero-initialised
        output layer (no gradient reaches them in fp32 either); counted, they made 86% of the
        parameter-gradient elements "zero in fp16" for every arm, the scaled one included.
        """
        assert self.probe is not None
        if with_signal:  # the probe counts the gradients of an optimizer's parameters
            counted = torch.optim.SGD(with_signal, lr=0.0)  # never stepped
            self.probe.measure(counted, torch.tensor(scale))

    def _backward(self, x: Tensor, y: Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(self.model, x, y, fp16=self.arm.fp16)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()  # type: ignore[no-untyped-call]
        return float(loss.item())

    def _optimizer_step(self, scale: float) -> bool:
        """Step (through the scaler if any) at ``scale``; returns whether it was skipped."""
        if self.scaler is None:
            self.optimizer.step()
            return False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        flag = getattr(self.scaler, "last_step_skipped", None)
        return bool(flag) if flag is not None else self._scale() < scale


def train_arm(
    arm: Arm, config: DemoConfig | None = None, on_step: StepCallback | None = None
) -> ArmResult:
    """Train the demo model one way (``arm``) for ``config.steps`` steps and report what happened.

    Syncs with the device every step (the loss is read with ``.item()``); the demo runs on the CPU.
    """
    config = config if config is not None else DemoConfig()
    trainer = _ArmTrainer(arm, config)
    records: list[StepRecord] = []
    start = time.perf_counter()
    stream = batches(config.task, config.seed)
    for index in range(config.steps):
        x, y = next(stream)
        record = trainer.step(index, x, y)
        records.append(record)
        if on_step is not None:
            on_step(record)
    seconds = time.perf_counter() - start
    underflow = None
    if trainer.probe is not None:
        trainer.probe.detach()
        layers = [n for n, m in trainer.model.named_modules() if isinstance(m, nn.Linear)]
        probed = [r.probe for r in records if r.probe is not None]
        underflow = UnderflowStats.of(layers, probed)
    return ArmResult(name=arm.name, records=records, underflow=underflow, seconds=seconds)
