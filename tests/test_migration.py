"""The migration guide's claim: DeepSpeed's and Megatron's options map onto ampscaler's exactly.

Each function below restates, in plain Python, the update rule the guide describes (DeepSpeed's
``DynamicLossScaler.update_scale`` in the release line that counts ``cur_iter -
last_overflow_iter``, with ``raise_error_at_min_scale`` off; Megatron's
``DynamicGradScaler.update``). ampscaler's policy must produce the same scale sequence for random
overflow sequences.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest
import torch

from ampscaler.policy import ScalePolicy


def deepspeed_scales(
    overflows: list[bool], init: float, window: int, hysteresis: int, min_scale: float
) -> Iterator[float]:
    scale, last_overflow, budget = init, -1, hysteresis
    for iteration, overflow in enumerate(overflows):
        if overflow:
            if hysteresis == 1 or budget == 1:
                scale = max(scale / 2.0, min_scale)
            else:
                budget -= 1
            last_overflow = iteration
        elif (iteration - last_overflow) % window == 0:
            budget = hysteresis
            scale *= 2.0
        yield scale


def megatron_scales(
    overflows: list[bool], init: float, window: int, hysteresis: int, min_scale: float
) -> Iterator[float]:
    scale, growth_tracker, budget = init, 0, hysteresis
    for overflow in overflows:
        if overflow:
            growth_tracker = 0
            budget -= 1
            if budget <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth_tracker += 1
            if growth_tracker == window:
                growth_tracker = 0
                budget = hysteresis
                scale *= 2.0
        yield scale


def ampscaler_scales(
    overflows: list[bool], init: float, window: int, hysteresis: int, min_scale: float
) -> Iterator[float]:
    policy = ScalePolicy(growth_interval=window, hysteresis=hysteresis, min_scale=min_scale)
    state = policy.initial_state(init, torch.device("cpu"))
    for overflow in overflows:
        state = policy.adjust(state, torch.tensor(float(overflow)))
        yield state.scale.item()


@pytest.mark.parametrize("reference", [deepspeed_scales, megatron_scales])
@pytest.mark.parametrize("seed", range(8))
def test_same_scale_sequence_as_deepspeed_and_megatron(
    reference: Callable[..., Iterator[float]], seed: int
) -> None:
    rng = random.Random(seed)
    window, hysteresis = rng.randint(1, 4), rng.randint(1, 3)
    min_scale = 2.0 ** rng.randint(0, 6)
    overflows = [rng.random() < rng.choice((0.2, 0.5, 0.8)) for _ in range(120)]
    args = (overflows, 2.0**8, window, hysteresis, min_scale)
    expected = list(reference(*args))
    assert list(ampscaler_scales(*args)) == expected
    assert len(set(expected)) >= 3  # the scale really moved (seeds also reach the floor)
