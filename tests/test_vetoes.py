"""A hook's veto (issue 36): it carries its cause and whether a replay can help, and the core
handles every veto alike: the step is skipped without backing off, the veto is counted under
its cause, ``metrics()`` reports the cause, and ``attempts()`` replays where every veto that
fired says so. Two gloo ranks agree on a meter's veto."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampscaler
import multirank
from ampscaler import GradScaler, HeadroomPolicy
from ampscaler.flushed import GradientsFlushedWarning
from ampscaler.hooks import Check, Veto, VetoCause
from ampscaler.policy.headroom import FLUSH_JUMP


class VetoFirstTries(ampscaler.Hook):
    """Vetoes the first try of every batch with ``veto`` (a bare flag where ``bare``)."""

    def __init__(self, cause: VetoCause, replay: bool, bare: bool = False) -> None:
        self.cause, self.replay, self.bare = cause, replay, bare

    def after_check(self, check: Check) -> Veto | torch.Tensor:
        flag = torch.tensor(0.0 if check.iteration.attempt else 1.0)
        return flag if self.bare else Veto(flag, self.cause, self.replay)


def _run(*hooks: ampscaler.Hook, batches: int = 2) -> tuple[GradScaler, list[int]]:
    """``batches`` batches under ``attempts()`` with ``hooks`` attached; the tries of each."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    for hook in hooks:
        scaler.attach(hook)
    tries = []
    for _ in range(batches):
        count = 0
        for _attempt in scaler.attempts():
            count += 1
            opt.zero_grad()
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            scaler.step(opt)
            scaler.update()
        tries.append(count)
    return scaler, tries


def test_a_veto_that_says_replay_runs_the_batch_again_without_backing_off() -> None:
    scaler, tries = _run(VetoFirstTries(VetoCause.GUARD, replay=True))
    assert tries == [2, 2]
    metrics = scaler.metrics("")
    assert metrics["replays"] == 2 and metrics["spike_skips"] == 2
    assert metrics["backoffs"] == 0 and metrics["skips"] == 0 and metrics["scale"] == 2.0**8


@pytest.mark.parametrize("bare", [False, True], ids=["veto", "bare-flag"])
def test_a_veto_that_does_not_say_replay_loses_the_batch(bare: bool) -> None:
    scaler, tries = _run(VetoFirstTries(VetoCause.GUARD, replay=False, bare=bare))
    assert tries == [1, 1]
    metrics = scaler.metrics("")
    assert metrics["replays"] == 0 and metrics["spike_skips"] == 2 and metrics["skip_cause"] == 3


def test_no_replay_where_a_veto_that_fired_says_no() -> None:
    replays = VetoFirstTries(VetoCause.FLUSHED, replay=True)
    scaler, tries = _run(replays, VetoFirstTries(VetoCause.GUARD, replay=False))
    assert tries == [1, 1]
    metrics = scaler.metrics("")
    # Each cause counted in its own counter; the cause reported is the highest that fired.
    assert metrics["flush_skips"] == 2 and metrics["spike_skips"] == 2
    assert metrics["skip_cause"] == int(VetoCause.FLUSHED)


def test_each_cause_is_counted_in_its_own_counter() -> None:
    scaler, _ = _run(VetoFirstTries(VetoCause.FLUSHED, replay=True), batches=3)
    metrics = scaler.metrics("")
    assert metrics["flush_skips"] == 3 and metrics["spike_skips"] == 0
    assert metrics["replays"] == 3 and metrics["steps"] == 6
    assert scaler.last_overflow is None  # finite gradients: nothing overflowed


def test_a_checkpoint_without_the_flush_counter_loads() -> None:
    """A state dict of the release before (no ``flush_skips``) loads, the counter at 0."""
    scaler, _ = _run(VetoFirstTries(VetoCause.FLUSHED, replay=True))
    saved = scaler.state_dict()
    assert saved["stats"]["flush_skips"] == 2
    older = {**saved, "stats": {k: v for k, v in saved["stats"].items() if k != "flush_skips"}}
    fresh = GradScaler("cpu")
    fresh.load_state_dict(older)
    metrics = fresh.metrics("")
    assert metrics["flush_skips"] == 0 and metrics["replays"] == 2 and metrics["steps"] == 4


# ------------------------------------------------------------------ two gloo ranks

TINY = 2.0**-24  # at scale 1 every gradient of the MLP below is zero in float16


def _flushing_ranks(rank: int, world: int, tiny_on: tuple[int, ...]) -> dict[str, Any]:
    """Two batches under ``attempts()`` with a HeadroomPolicy agreed over the world; the ranks
    in ``tiny_on`` have a loss every float16 gradient of which flushes at scale 1."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", policy=HeadroomPolicy(), process_group=dist.group.WORLD)
    scaler.watch(model)
    generator = torch.Generator().manual_seed(1 + rank)
    scales, stepped = [], []
    for _ in range(2):
        x = torch.randn(32, 16, generator=generator)
        for _attempt in scaler.attempts():
            scales.append(scaler.get_scale())
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float()
            loss = (out - x[:, :4]).square().mean() * (TINY if rank in tiny_on else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            stepped.append(not scaler.last_step_skipped)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        metrics = scaler.metrics("")
    flushed = [w for w in heard if issubclass(w.category, GradientsFlushedWarning)]
    return {"scales": scales, "stepped": stepped, "metrics": metrics, "warned": len(flushed)}


multirank.SCENARIOS.update(
    {
        "flush_veto_both": lambda r, w: _flushing_ranks(r, w, tiny_on=(0, 1)),
        "flush_veto_one": lambda r, w: _flushing_ranks(r, w, tiny_on=(0,)),
    }
)


def test_two_ranks_veto_count_and_replay_alike() -> None:
    """Both ranks flush at scale 1: both veto the first try, count it as a flush skip (not a
    guard's), and run the batch again at the jumped scale, together (a rank that replayed
    alone would leave the other waiting in its collectives: the group's timeout is short).
    Where only one rank flushes, the measurement is agreed (max-reduced): neither vetoes."""
    both, one = zip(
        *(
            (results["flush_veto_both"], results["flush_veto_one"])
            for results in multirank.spawn(2, ["flush_veto_both", "flush_veto_one"], 20.0)
        ),
        strict=True,
    )
    for seen in both:
        assert seen["scales"][:2] == [1.0, FLUSH_JUMP] and len(seen["scales"]) == 3
        assert seen["stepped"] == [False, True, True]
        metrics = seen["metrics"]
        assert metrics["flush_skips"] == 1 and metrics["spike_skips"] == 0
        assert metrics["replays"] == 1 and metrics["backoffs"] == 0 and seen["warned"] == 1
    assert both[0]["scales"] == both[1]["scales"]
    for seen in one:
        assert seen["stepped"] == [True, True] and seen["metrics"]["flush_skips"] == 0
    assert one[0]["scales"] == one[1]["scales"]
