"""The embedded demo: a small model whose fp16 gradients really underflow, trained three ways.

The same model, from the same initial weights and on the same batches, is trained three ways:
``fp32``; ``fp16_no_scaling`` (fp16 autocast, nothing else); ``fp16_ampscaler`` (fp16 autocast,
with the loss multiplied by a dynamic loss scale before ``backward()``). With the default settings
the unscaled arm ends with a loss several times higher (4x to 13x over seeds 0 to 7) and the scaled
arm ends within 8% of fp32 (within 0.1% with torch's growth interval of 2000; the demo grows the
scale every 10 steps so that it visibly overflows, and its few skipped steps cost a little).
Nothing multiplies or shrinks the loss behind the scenes: the
unscaled arm fails because the model's own gradients are too small for fp16.

The task. A multilayer perceptron (32 inputs, three hidden layers of 32 with tanh, 16 outputs)
learns to imitate a hidden "teacher" function of its 32 inputs. The targets are small numbers, with
an RMS of about 0.0065, as when a network predicts a small correction or a quantity in large units.
The teacher depends on its inputs only along 4 hidden directions, so the network's hidden layers
have to find them: a last layer fitted on top of fixed random hidden layers ends 15 to 20 times
worse than full fp32 training. The loss is the mean squared error over every prediction of the
batch, 2048 samples x 16 outputs = 32,768 numbers. Training uses Adam with a cosine-decayed
learning rate. The output layer starts at zero, a common choice for regression heads; it keeps the
first steps from having to unlearn random predictions 20 times larger than the targets.

Why its gradients underflow in fp16. Averaging over 32,768 numbers makes the gradient of the loss
with respect to each prediction 2 x error / 32,768: about 5e-8 to 1e-7 once the model is roughly
right. That is already the bottom of fp16's range: fp16 numbers below 6.1e-5 are subnormal (fewer
significant bits) and below 6e-8 they round to zero. Going back into the network, the gradient is
multiplied by the output layer's weights, which stay around 0.005 because the targets are small. So
the gradients of the hidden layers' outputs (their *activation gradients*) are 1e-9 to 6e-9 in
fp32: 10 to 60 times below the smallest fp16 number. Under fp16 autocast these activation gradients
are fp16 tensors, and without scaling 90% to 100% of them are flushed to exactly zero; almost all
of the few that survive are exactly +-6e-8 (the smallest fp16 number: a sign without a magnitude).
Adam rescales small gradients, but it cannot rescale zeros, nor recover a magnitude that rounding
threw away. The hidden layers learn only a little, and the loss stalls. Multiplying the loss by
65,536 before ``backward()`` (torch's and ampscaler's initial scale) multiplies every gradient by
the same factor: the hidden layers' activation gradients become 1e-4 or so, next to none is flushed
(about half are still subnormal, but keep 5 to 9 significant bits), the optimizer is given the
unscaled values, and training follows fp32.

This is the failure the Mixed Precision Training paper (Micikevicius et al., 2018) describes for
the SSD detector, many of whose activation gradients fall below fp16's range and become zero. The
library's :class:`~ampscaler.GradientProbe`, held against an fp32 reference pass (see
:func:`~ampscaler.demo.train.activation_probe`), measures it here: about 85% of the activation
gradients that are non-zero in fp32 are exactly zero in the unscaled arm, next to none in the
scaled one.

A fourth arm, ``fp16_headroom`` (``python -m ampscaler demo --policy headroom``), trains the same
way with :class:`~ampscaler.HeadroomPolicy`, which sets the scale from measured gradient
magnitudes instead of growing it until a step overflows: it skips no step, where the scaled
arm's growth every 10 steps skips about ten.

The pieces: :mod:`ampscaler.demo.model` (the task and the model), :mod:`ampscaler.demo.train`
(training one arm, with :class:`~ampscaler.StepRecord` per step and the probe on the linear
layers), :mod:`ampscaler.demo.run` (the arms, the summary and the plots).
"""

from ampscaler.demo.model import TaskSpec, Teacher, batches, build_student
from ampscaler.demo.train import (
    FP16_AMPSCALER,
    FP16_HEADROOM,
    FP16_NO_SCALING,
    FP32,
    Arm,
    ArmResult,
    DemoConfig,
    LossScaler,
    ScalerFactory,
    StepCallback,
    UnderflowStats,
    activation_probe,
    compute_loss,
    standard_arms,
    tail_mean,
    torch_grad_scaler,
    train_arm,
)

__all__ = [
    "FP16_AMPSCALER",
    "FP16_HEADROOM",
    "FP16_NO_SCALING",
    "FP32",
    "Arm",
    "ArmResult",
    "DemoConfig",
    "LossScaler",
    "ScalerFactory",
    "StepCallback",
    "TaskSpec",
    "Teacher",
    "UnderflowStats",
    "activation_probe",
    "batches",
    "build_student",
    "compute_loss",
    "standard_arms",
    "tail_mean",
    "torch_grad_scaler",
    "train_arm",
]
