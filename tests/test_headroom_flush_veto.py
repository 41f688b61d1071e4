"""HeadroomPolicy's first step where every gradient flushes to zero (issue 37): before, the step
was decided before the policy's update, so it applied zero gradients; now the meter's hook
vetoes it at the check, the policy jumps on the measurement, and ``attempts()`` runs the batch
again at the new scale."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ampscaler import GradScaler, HeadroomPolicy, StepHistory
from ampscaler.flushed import GradientsFlushedWarning
from ampscaler.hooks import VetoCause
from ampscaler.policy.headroom import FLUSH_JUMP

TINY = 2.0**-24  # at scale 1 every gradient of the MLP below is zero in float16


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batches(count: int) -> Iterator[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    for _ in range(count):
        yield torch.randn(32, 16, generator=generator)


def _loss(model: torch.nn.Module, x: torch.Tensor, factor: float = TINY) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x).float()
    return (out - x[:, :4]).square().mean() * factor


def _train_with_attempts(
    scaler: GradScaler,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batches: int,
    factor: float = TINY,
) -> None:
    """``batches`` batches, each under ``scaler.attempts()``, with the loss times ``factor``."""
    for x in _batches(batches):
        for _ in scaler.attempts():
            opt.zero_grad()
            scaler.scale(_loss(model, x, factor)).backward()
            scaler.step(opt)
            scaler.update()


class _Recording(torch.optim.SGD):
    """SGD that records, at each step it takes, how many gradient elements are nonzero."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.nonzero: list[int] = []

    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.nonzero.append(sum(int((g != 0).sum()) for g in grads if g is not None))
        return super().step(closure)


def test_without_attempts_the_all_flushed_first_step_is_skipped_and_the_scale_jumps() -> None:
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = _Recording(model.parameters(), lr=0.1, weight_decay=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy())  # first_scale 1
    scaler.watch(model)
    x = next(_batches(1))
    scaler.scale(_loss(model, x)).backward()
    scaler.step(opt)
    scaler.update()
    # Before: the step ran on zero gradients (weight decay moved every weight) and the scale
    # only doubled.
    assert opt.nonzero == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.last_step_skipped and scaler.last_overflow is None
    assert scaler.get_scale() == FLUSH_JUMP
    with pytest.warns(GradientsFlushedWarning, match="skipped"):
        metrics = scaler.metrics("")
    # The flush veto has its own counter; spike_skips counts the guards' vetoes only.
    assert metrics["skip_cause"] == 4 and metrics["flush_skips"] == 1
    assert metrics["spike_skips"] == 0
    assert metrics["flushed_measurements"] == 1 and metrics["backoffs"] == 0


@pytest.mark.parametrize("fused", [False, True])
def test_attempts_runs_the_flushed_batch_again_where_its_gradients_show(fused: bool) -> None:
    model = _mlp()
    if fused:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = _Recording(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy())
    scaler.watch(model)
    steps, tries = [], []
    for x in _batches(3):
        for attempt in scaler.attempts():
            tries.append((attempt.number, scaler.get_scale()))
            opt.zero_grad()
            scaler.scale(_loss(model, x)).backward()
            scaler.step(opt)
            scaler.update()
        steps.append(not scaler.last_step_skipped)
    assert steps == [True, True, True]  # no batch lost
    assert tries[:2] == [(0, 1.0), (1, FLUSH_JUMP)]  # batch 0 again, at the jumped scale
    assert [number for number, _ in tries[2:]] == [0, 0]
    with pytest.warns(GradientsFlushedWarning):
        metrics = scaler.metrics("")
    assert metrics["replays"] == 1 and metrics["flush_skips"] == 1 and metrics["backoffs"] == 0
    assert metrics["spike_skips"] == 0
    if isinstance(opt, _Recording):  # every step it took had gradients to apply
        assert len(opt.nonzero) == 3 and min(opt.nonzero) > 0
    else:
        assert int(opt.state[model[0].weight]["step"]) == 3


def test_a_loss_that_shows_at_scale_1_is_not_vetoed() -> None:
    model = _mlp()
    opt = _Recording(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy())
    scaler.watch(model)
    _train_with_attempts(scaler, model, opt, 2, factor=1.0)
    assert len(opt.nonzero) == 2
    metrics = scaler.metrics("")
    assert metrics["spike_skips"] == 0 and metrics["flush_skips"] == 0


def test_gradients_that_stay_zero_at_the_highest_scale_are_not_vetoed_forever() -> None:
    """A loss with no gradient at all (zero advantages, a constant): once the target cannot
    grow, the veto stops, so attempts() cannot loop and a run does not skip for ever."""
    model = _mlp()
    opt = _Recording(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy(max_scale=2.0**16))
    scaler.watch(model)
    _train_with_attempts(scaler, model, opt, 3, factor=0.0)
    # At 1 vetoed; at 2**16 (the highest) the zeros are stepped.
    assert opt.nonzero == [0, 0, 0]
    with pytest.warns(GradientsFlushedWarning):
        metrics = scaler.metrics("")
    assert metrics["flush_skips"] == 1 and metrics["spike_skips"] == 0


def test_an_iteration_that_is_not_measured_gets_no_veto_flag() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy(history_length=1, sample_every=4))
    scaler.watch(model)
    flagged = []
    for x in _batches(3):
        scaler.scale(_loss(model, x, factor=1.0)).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler._finished is not None
        flagged.append(VetoCause.FLUSHED in scaler._finished.vetoes)
        opt.zero_grad()
    # Iteration 0 is measured; 1 and 2 are not: no flag, nothing to read.
    assert flagged == [True, False, False]


def test_with_a_process_group_the_veto_is_agreed_and_the_batch_replayed() -> None:
    """On one gloo rank: the veto's measurement goes through the agreement's max-reduction
    (every rank vetoes alike) and the batch is replayed as without a group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = _mlp()
        opt = _Recording(model.parameters(), lr=0.1)
        policy = HeadroomPolicy()
        scaler = GradScaler("cpu", policy=policy, process_group=dist.group.WORLD)
        scaler.watch(model)
        scales = []
        for x in _batches(2):
            for _ in scaler.attempts():
                scales.append(scaler.get_scale())
                opt.zero_grad()
                scaler.scale(_loss(model, x)).backward()
                scaler.step(opt)
                scaler.update()
        assert scales[:2] == [1.0, FLUSH_JUMP] and len(scales) == 3
        assert len(opt.nonzero) == 2 and min(opt.nonzero) > 0
    finally:
        dist.destroy_process_group()


def test_the_step_record_says_flushed_not_spike() -> None:
    """A flush veto is not a guard's: the record and its JSON line say which one skipped."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy())
    history = StepHistory(16)
    scaler.attach(history)
    scaler.watch(model)
    _train_with_attempts(scaler, model, opt, 2)
    vetoed, replayed = history.records[0], history.records[1]
    assert vetoed.flushed and not vetoed.spike and not vetoed.skipped
    assert "flushed to zero" in str(vetoed) and "spike guard" not in str(vetoed)
    assert vetoed.as_dict()["flushed"] is True and "spike" not in vetoed.as_dict()
    assert replayed.attempt == 1 and not replayed.flushed
    assert "flushed" not in replayed.as_dict()
