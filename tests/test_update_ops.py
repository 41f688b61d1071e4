"""update()'s device work: the fused policy transition and the batched step counters.

``policy.adjust`` runs torch's ``_amp_update_scale_`` for torch's rule; it must give the same
state as the general branch-free transition (taken for a float64 ``found_inf``) and must not
modify its input. ``StepCounters`` keeps the iterations and folds them in batches; it must agree
with a plain count whenever it is read, after every step or after runs longer than a batch.
"""

from __future__ import annotations

import random

import pytest
import torch

import ampscaler
from ampscaler.policy import ScalePolicy, ScaleState
from ampscaler.state import FOLD_EVERY, ScalerStats, StepCounters
from scaler_readings import counts

SCALES = [2.0**16, 3.0e4, 1.0, 2.0**-149, 2.0**127, 3.0e38, 1.7e-38]


@pytest.mark.parametrize("seed", range(6))
def test_fused_transition_equals_the_branch_free_one(seed: int) -> None:
    rng = random.Random(seed)
    policy = ScalePolicy(
        growth_factor=rng.choice([2.0, 1.37, 3.0, 65536.0]),
        backoff_factor=rng.choice([0.5, 0.31, 0.999]),
        growth_interval=rng.choice([1, 2, 5]),
    )
    for _ in range(40):
        state = ScaleState(
            torch.tensor(rng.choice(SCALES) * rng.choice([1.0, 0.7, 1.3])),
            torch.tensor(rng.randrange(policy.growth_interval), dtype=torch.int32),
            torch.tensor(1, dtype=torch.int32),
        )
        found = rng.choice([0.0, 0.0, 1.0, 2.0])
        before = [t.clone() for t in state]
        fused = policy.adjust(state, torch.tensor(found, dtype=torch.float32))
        general = policy.adjust(state, torch.tensor(found, dtype=torch.float64))
        for a, b in zip(fused, general, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (state, found)
        for a, b in zip(state, before, strict=True):
            assert torch.equal(a, b)  # pure: the input state is untouched


def reference(flags: list[bool], moves: list[int], start: ScalerStats) -> ScalerStats:
    steps, skipped, growths, backoffs, in_a_row = (
        start.steps,
        start.skipped,
        start.growths,
        start.backoffs,
        start.consecutive_skips,
    )
    for overflow, move in zip(flags, moves, strict=True):
        steps += 1
        skipped += overflow
        growths += move > 0
        backoffs += move < 0
        in_a_row = in_a_row + 1 if overflow else 0
    return ScalerStats(steps, skipped, growths, backoffs, in_a_row)


@pytest.mark.parametrize("seed", range(8))
def test_counters_match_a_plain_count_whenever_read(seed: int) -> None:
    rng = random.Random(seed)
    start = ScalerStats(7, 3, 1, 2, rng.choice([0, 4]))
    live = torch.tensor(1024.0)  # the scale, updated in place as the scaler does
    counters = StepCounters(live, start)
    # Odd seeds read after every step; even ones rarely, across several batches.
    read_every = 1 if seed % 2 else rng.choice([FOLD_EVERY - 1, FOLD_EVERY, 2 * FOLD_EVERY + 5])
    overflow_rate = rng.choice([0.0, 0.4, 0.97, 1.0])  # runs of skips longer than a batch
    flags: list[bool] = []
    moves: list[int] = []
    for step in range(3 * FOLD_EVERY + 7):
        overflow = rng.random() < overflow_rate
        move = rng.choice([-1, 0, 0, 1])
        old = live.clone()
        live.mul_({-1: 0.5, 0: 1.0, 1: 2.0}[move])
        counters.record(torch.tensor(float(overflow) * rng.choice([1, 2])), old)
        flags.append(overflow)
        moves.append(move)
        if (step + 1) % read_every == 0:
            assert counters.stats() == reference(flags, moves, start), step
    assert counters.stats() == reference(flags, moves, start)


def test_scaler_stats_count_skips_growths_and_backoffs() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = ampscaler.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    pattern = [False, False, True, True, False, True, False, False]
    for overflow in pattern:
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if overflow:
            model.bias.grad.fill_(float("nan"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    # Scale: 8 -> 8 -> 16 (grow) -> 8 -> 4 -> 4 -> 2 -> 2 -> 4 (grow).
    assert counts(scaler) == ScalerStats(
        steps=8, skipped=3, growths=2, backoffs=3, consecutive_skips=0
    )
    assert scaler.get_scale() == 4.0
