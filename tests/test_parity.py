"""ampscaler.GradScaler against torch.amp.GradScaler, side by side on twin models.

Each seed is a random sequence of iterations: gradient accumulation, several losses, injected
inf/-inf/NaN, clipping after unscale_, a plain SGD with a sparse embedding plus (fused or not)
Adam, manual new_scale (float and tensor), and checkpoint round trips mid-run. Parameters, scale,
growth tracker and step return values must agree bit for bit after every iteration.
"""

from __future__ import annotations

import pytest
import torch

import ampscaler
from twins import assert_same_trace, make_script, run_twin

SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_randomized_sequences_match_torch_bit_for_bit(seed: int) -> None:
    script = make_script(seed)
    ours = run_twin(script, ampscaler.GradScaler)
    theirs = run_twin(script, torch.amp.GradScaler)
    assert_same_trace(ours, theirs)


def test_scripts_exercise_every_case() -> None:
    """The seeds above really cover overflow, growth, clipping, fused Adam, checkpoints."""
    scripts = [make_script(seed) for seed in SEEDS]
    iterations = [it for s in scripts for it in s.iterations]
    assert any(s.fused for s in scripts) and not all(s.fused for s in scripts)
    assert sum(bool(it.poison) for it in iterations) > 20
    assert sum(it.clip is not None for it in iterations) > 20
    assert sum(len(it.micro_batches) > 1 for it in iterations) > 20
    assert sum(it.second_loss for it in iterations) > 20
    assert sum(it.checkpoint for it in iterations) > 10
    assert sum(it.new_scale is not None and it.new_scale_as_tensor for it in iterations) > 3
    assert sum(it.new_scale is not None and not it.new_scale_as_tensor for it in iterations) > 3
    traces = [run_twin(s, ampscaler.GradScaler) for s in scripts[:8]]
    moves = [(b > a, b < a) for t in traces for a, b in zip(t.scales, t.scales[1:], strict=False)]
    assert any(up for up, _ in moves) and any(down for _, down in moves)
