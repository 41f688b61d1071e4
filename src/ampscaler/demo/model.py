"""The demo's task: a small MLP learns small-valued targets produced by a hidden teacher.

Everything here is generated from a seed, on the CPU, with private random generators (the global
torch RNG is never touched), so every training arm sees the same initial weights and the same
batches in the same order.

The task, in numbers (defaults of :class:`TaskSpec`):

- inputs ``x``: 2048 samples per batch, 32 standard-normal features each, fresh every step;
- targets ``y = 0.01 * tanh(x @ A + c) @ B``: a hidden "teacher" that looks at the 32 inputs only
  along 4 random directions ``A``; the 16 targets have an RMS of about 0.0065;
- student: ``32 -> 32 -> 32 -> 32 -> 16`` with tanh between the linear layers, PyTorch's default
  initialisation for the hidden layers and a zero-initialised output layer;
- loss: mean squared error over all 2048 x 16 = 32,768 predicted numbers.

Why the output layer starts at zero: the targets are about 20 times smaller than what a randomly
initialised output layer predicts, so a random start would spend its first hundreds of steps
unlearning its own noise (in fp32 too). Starting at zero predicts the targets' mean, and is a
common choice for regression heads.

See :mod:`ampscaler.demo` for why this task's gradients underflow in fp16.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TaskSpec:
    """Sizes of the demo task; the defaults are the configuration documented in ampscaler.demo.

    Attributes:
        in_features: input features per sample.
        hidden_features: width of each hidden layer of the student.
        hidden_layers: number of hidden (linear + tanh) layers of the student.
        out_features: targets per sample.
        teacher_features: directions of the input the teacher looks at.
        target_scale: factor on the teacher's output; targets have an RMS of about 0.65 times it.
        batch_size: samples per training step.
    """

    in_features: int = 32
    hidden_features: int = 32
    hidden_layers: int = 3
    out_features: int = 16
    teacher_features: int = 4
    target_scale: float = 0.01
    batch_size: int = 2048

    def __post_init__(self) -> None:
        sizes = {
            "in_features": self.in_features,
            "hidden_features": self.hidden_features,
            "hidden_layers": self.hidden_layers,
            "out_features": self.out_features,
            "teacher_features": self.teacher_features,
            "batch_size": self.batch_size,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"TaskSpec.{name} must be at least 1, got {value}")
        if not self.target_scale > 0:
            raise ValueError(f"TaskSpec.target_scale must be positive, got {self.target_scale}")

    @property
    def loss_elements(self) -> int:
        """How many numbers the loss averages over: each one's gradient is 2 * error / this."""
        return self.batch_size * self.out_features


class Stream(IntEnum):
    """Independent random streams drawn from one seed."""

    STUDENT = 0
    TEACHER = 1
    DATA = 2


def seeded_generator(seed: int, stream: Stream) -> torch.Generator:
    """A CPU generator for one stream of one seed; distinct (seed, stream) pairs never collide."""
    return torch.Generator().manual_seed(seed * len(Stream) + int(stream))


def init_linear_(layer: nn.Linear, generator: torch.Generator, *, zero: bool = False) -> None:
    """Initialise ``layer`` in place: all zeros, or PyTorch's default for ``nn.Linear``.

    That default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias, is written out here so
    that it can draw from ``generator``.
    """
    with torch.no_grad():
        if zero:
            layer.weight.zero_()
            layer.bias.zero_()
            return
        bound = 1.0 / math.sqrt(layer.in_features)
        layer.weight.uniform_(-bound, bound, generator=generator)
        layer.bias.uniform_(-bound, bound, generator=generator)


def build_student(spec: TaskSpec, seed: int) -> nn.Sequential:
    """The model being trained: ``hidden_layers`` x (linear, tanh), then a zero-initialised linear.

    Layers are named ``hidden1``, ``tanh1``, ..., ``output``, which is how reports refer to them.
    """
    generator = seeded_generator(seed, Stream.STUDENT)
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    width = spec.in_features
    for index in range(1, spec.hidden_layers + 1):
        hidden = nn.Linear(width, spec.hidden_features)
        init_linear_(hidden, generator)
        layers[f"hidden{index}"] = hidden
        layers[f"tanh{index}"] = nn.Tanh()
        width = spec.hidden_features
    output = nn.Linear(width, spec.out_features)
    init_linear_(output, generator, zero=True)
    layers["output"] = output
    return nn.Sequential(layers)


@dataclass(frozen=True)
class Teacher:
    """The hidden function to learn: ``scale * tanh(x @ directions + offsets) @ mixing``.

    It depends on the input only along ``directions`` (``in_features x teacher_features``), so the
    student's hidden layers have to find those directions; fixed random features fit it poorly.
    """

    directions: Tensor
    offsets: Tensor
    mixing: Tensor
    scale: float

    @classmethod
    def generate(cls, spec: TaskSpec, seed: int) -> Teacher:
        """Draw a teacher for ``spec`` from ``seed``."""
        generator = seeded_generator(seed, Stream.TEACHER)
        k = spec.teacher_features
        directions = torch.randn(spec.in_features, k, generator=generator)
        offsets = 0.5 * torch.randn(k, generator=generator)
        mixing = torch.randn(k, spec.out_features, generator=generator)
        return cls(
            directions=directions / math.sqrt(spec.in_features),
            offsets=offsets,
            mixing=mixing / math.sqrt(k),
            scale=spec.target_scale,
        )

    def __call__(self, x: Tensor) -> Tensor:
        """Targets for inputs ``x`` of shape ``(batch, in_features)``, in fp32."""
        with torch.no_grad():
            return self.scale * (torch.tanh(x @ self.directions + self.offsets) @ self.mixing)


def batches(spec: TaskSpec, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """An endless stream of ``(inputs, targets)`` batches, the same sequence for the same seed."""
    teacher = Teacher.generate(spec, seed)
    generator = seeded_generator(seed, Stream.DATA)
    while True:
        x = torch.randn(spec.batch_size, spec.in_features, generator=generator)
        yield x, teacher(x)
