"""Replay that does not cost the run its scale (issue 37): a warm-up far above the ceiling loses
no batch, an outlier after a clean batch leaves the run the scale it found, and the search below
a guessed scale is the one ``ampscaler.replay`` documents."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from hypothesis import example, given
from hypothesis import strategies as st

import ampscaler
from ampscaler.hooks import MeterHook
from ampscaler.replay import RETRY_FLOOR, binades_above, gallop_scale, retry_scale

INF = float("inf")


def _train(
    scaler: ampscaler.GradScaler,
    batches: int,
    overflows: Callable[[int, float], bool],
    max_attempts: int = 3,
) -> tuple[list[list[float]], list[bool]]:
    """Train a linear model; ``overflows(batch, scale)`` says whether a try overflows. Returns
    the scales of every try, per batch, and whether each batch was lost (last try skipped)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scales: list[list[float]] = []
    lost: list[bool] = []
    for batch in range(batches):
        tries: list[float] = []
        for _ in scaler.attempts(max_attempts):
            opt.zero_grad()
            tries.append(scaler.get_scale())
            loss = model(torch.ones(4, 3)).square().mean()
            scaler.scale(loss).backward()
            if overflows(batch, tries[-1]):
                model.bias.grad[0] = INF  # type: ignore[index]
            scaler.step(opt)
            scaler.update()
        scales.append(tries)
        lost.append(scaler.last_step_skipped)
    return scales, lost


def test_a_warm_up_from_2_16_to_a_ceiling_of_2_7_loses_no_batch() -> None:
    scaler = ampscaler.GradScaler("cpu")  # torch's defaults: 2**16, growth every 2000

    scales, lost = _train(scaler, 14, lambda batch, scale: scale > 2.0**7)
    assert not any(lost)  # before issue 37: the first three batches were lost
    # The first batch: 2**16 and 2**15 overflow, the search's last try runs at the floor.
    assert scales[0] == [2.0**16, 2.0**15, RETRY_FLOOR]
    # Each batch starts at most one backoff below where the one before started ...
    starts = [tries[0] for tries in scales]
    assert all(b >= a / 2 for a, b in itertools.pairwise(starts))
    # ... down to the ceiling, where one retry suffices and then none is needed.
    assert starts[:10] == [2.0 ** (16 - i) for i in range(10)]
    assert scales[9] == [2.0**7] and scaler.get_scale() == 2.0**7
    assert scaler.metrics()["scaler/replays"] == 2 * 8 + 1


def test_an_outlier_after_a_clean_batch_gives_the_run_its_scale_back() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**11)

    def outlier(batch: int, scale: float) -> bool:
        # Batch 0 finds the ceiling (a growth probe's equal): the warm-up is over. Batch 3 is
        # larger than any scale can hold.
        return (batch == 0 and scale > 2.0**10) or batch == 3

    scales, lost = _train(scaler, 6, outlier)
    assert lost == [False, False, False, True, False, False]
    assert scales[0] == [2.0**11, 2.0**10]
    # The batch before stepped at 2**10: the outlier's tries back off by the policy ...
    assert scales[3] == [2.0**10, 2.0**9, 2.0**8]
    # ... and, skipped after them, it leaves the run the scale it found: 2**10, where torch's
    # scaler goes on at 2**9 after skipping it (before issue 37: 2**7, one backoff per try;
    # before 0.2's outlier rule: 2**9, and torch's rule regrows only after 2000 clean steps).
    assert scales[4] == [2.0**10] and scaler.get_scale() == 2.0**10
    # Its two later tries were replays (batch 0's one more); the overflow still restarted the
    # growth count.
    assert scaler.metrics()["scaler/replays"] == 3
    assert scaler._get_growth_tracker() == 2  # batches 4 and 5


def test_an_outlier_in_a_warm_up_gallops_and_still_gives_the_scale_back() -> None:
    """Before the run skipped any step, the outlier's third try gallops two binades below
    its second, and the run still gets the scale it found back."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scales, lost = _train(scaler, 6, lambda batch, scale: batch == 3)
    assert lost == [False, False, False, True, False, False]
    assert scales[3] == [2.0**10, 2.0**9, 2.0**7]
    assert scales[4] == [2.0**10] and scaler.get_scale() == 2.0**10


def test_an_outlier_stepped_at_a_later_try_also_gives_the_scale_back() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**11)

    def overflows(batch: int, scale: float) -> bool:
        return (batch == 0 and scale > 2.0**10) or (batch == 2 and scale > 2.0**8)

    scales, lost = _train(scaler, 5, overflows)
    assert not any(lost)
    assert scales[2] == [2.0**10, 2.0**9, 2.0**8]  # stepped at its third try, 2**8
    assert scales[3] == [2.0**10] and scales[4] == [2.0**10]


def test_an_outlier_s_later_tries_gallop_down_in_doubling_steps_to_the_floor() -> None:
    """In a warm-up, each retry from the second backs off twice as many binades as the one
    before, never below 1 unless the batch overflowed there already: 2**16, then 2**15, 2**13,
    2**9, 2, 1."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**16)
    scales, lost = _train(scaler, 3, lambda batch, scale: batch == 1, max_attempts=7)
    assert scales[1] == [2.0**16, 2.0**15, 2.0**13, 2.0**9, 2.0, 1.0, 0.5] and lost[1]
    assert scales[2] == [2.0**16]  # and the run keeps the scale it found


def test_a_warm_up_drift_after_clean_batches_steps_at_the_third_try() -> None:
    """Issue 37's last lost batch (pg-outliers, seed 6 of 24): three batches stepped at
    2**16, then the first Adam steps grew the gradients three binades past it. The batch is
    taken for an outlier, and, the run having skipped nothing before it, its gallop reaches
    2**13 at the default max_attempts, where a backoff per try stopped at 2**14 and lost it."""
    scaler = ampscaler.GradScaler("cpu")

    def drift(batch: int, scale: float) -> bool:
        return batch >= 3 and scale > 2.0**13

    scales, lost = _train(scaler, 5, drift)
    assert not any(lost)
    assert scales[3] == [2.0**16, 2.0**15, 2.0**13]


def test_a_growth_probe_after_a_clean_batch_still_costs_one_backoff() -> None:
    """One retry is torch's scaler under a loop by hand: the outlier rule is not for it."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scales, lost = _train(scaler, 4, lambda batch, scale: batch == 1 and scale > 2.0**9)
    assert not any(lost) and scales[1] == [2.0**10, 2.0**9]
    assert scales[2] == [2.0**9] and scaler.get_scale() == 2.0**9


def test_a_scale_no_batch_carried_yet_is_searched_below_not_an_outlier() -> None:
    """After a growth, the scale has carried no batch: a batch that overflows there twice is
    not taken for an outlier (it would be lost at 2**9) but searched, and keeps one backoff."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales, lost = _train(scaler, 5, lambda batch, scale: batch == 2 and scale > 2.0**8)
    assert not any(lost)
    assert scales[2] == [2.0**11, 2.0**10, RETRY_FLOOR]  # grown after two clean batches
    assert scales[3] == scales[4] == [2.0**10]  # one backoff below 2**11, then two clean


def test_headroom_s_first_jump_is_searched_below_when_the_next_batch_overflows_twice() -> None:
    """Issue 37's seventh finding: HeadroomPolicy measures at its first scale, jumps, and the
    batch after the jump overflows (the first optimizer steps grew the gradients past the
    margin). No batch carried the jump, so that batch is searched, not lost as an outlier."""
    policy = ampscaler.HeadroomPolicy(first_scale=1.0)
    scaler = ampscaler.GradScaler("cpu", policy=policy)
    scales, lost = _train(scaler, 4, lambda batch, scale: batch == 1 and scale > 2.0**10)
    assert not any(lost)
    jump = scales[1][0]
    assert scales[0] == [1.0] and jump > 2.0**12  # the measured jump, far above the fit
    assert scales[1] == [jump, jump / 2, RETRY_FLOOR]
    assert scales[2][0] == jump / 2  # one backoff below the batch's start, as a search keeps


def test_gradients_that_grow_for_good_take_the_run_down_one_backoff_per_batch() -> None:
    """An 'outlier' that is the new normal: the batch after it searches (the scale it was
    given back was not carried by a batch), and the run comes down to where the batches fit,
    each batch stepped."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scales, lost = _train(scaler, 8, lambda batch, scale: batch >= 2 and scale > 2.0**7)
    assert scales[:2] == [[2.0**10], [2.0**10]]
    # Batch 2 looks like an outlier (the batch before stepped at 2**10): its gallop steps it
    # at 2**7, and the run is given 2**10 back ...
    assert scales[2] == [2.0**10, 2.0**9, 2.0**7] and not lost[2]
    # ... but nothing carried 2**10 since: batch 3 searches (its last try at the floor, 1) and
    # keeps one backoff, as does batch 4; batch 5 is a growth probe's equal, then none retries.
    assert scales[3:] == [
        [2.0**10, 2.0**9, 1.0],
        [2.0**9, 2.0**8, 1.0],
        [2.0**8, 2.0**7],
        [2.0**7],
        [2.0**7],
    ]
    assert not any(lost) and scaler.get_scale() == 2.0**7


def test_a_replayed_headroom_batch_leaves_the_meter_on_the_policys_schedule() -> None:
    scaler = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy(first_scale=2.0**10))
    scales, lost = _train(scaler, 4, lambda batch, scale: batch == 0 and scale > 1.0)
    assert not lost[0] and scales[0] == [2.0**10, 2.0**9, RETRY_FLOOR]
    saved = scaler.state_dict()["headroom"]
    # Batch 0 counts as one iteration of the schedule (its first overflow), the others one each.
    assert saved["iteration"] == 4
    hook = scaler._hooks.find(MeterHook)
    assert hook is not None and hook.meter.iteration == 4  # type: ignore[attr-defined]


def _ceil_log2(value: float) -> int:
    """The least ``k`` with ``2**k >= value``, by exact comparisons (``math.log2`` rounds:
    ``log2(16.000000000000004)`` is ``4.0``)."""
    k = math.ceil(math.log2(value))
    while 2.0**k < value:
        k += 1
    while 2.0 ** (k - 1) >= value:
        k -= 1
    return k


@given(
    exponent=st.integers(-20, 40),
    mantissa=st.floats(1.0, 2.0, exclude_max=True),
    tries_left=st.integers(1, 6),
)
@example(exponent=4, mantissa=1.0000000000000002, tries_left=1)  # just above a power of two
def test_retry_scale_is_the_documented_search(
    exponent: int, mantissa: float, tries_left: int
) -> None:
    failed = math.ldexp(mantissa, exponent)
    got = retry_scale(failed, tries_left)
    steps = math.log2(failed / got)
    assert steps == int(steps) and steps >= 1  # failed * 2**-k, exact, at least one halving
    distance = binades_above(failed, RETRY_FLOOR)
    assert distance == _ceil_log2(failed)
    if distance <= 1:
        assert got == failed / 2
    elif tries_left == 1:
        assert got <= RETRY_FLOOR < got * 2  # the last try: at the floor
    else:
        assert got > RETRY_FLOOR and steps == math.ceil(distance / 2)


@given(
    exponent=st.integers(-20, 40),
    mantissa=st.floats(1.0, 2.0, exclude_max=True),
    retry=st.integers(2, 8),
)
def test_gallop_scale_is_the_documented_gallop(exponent: int, mantissa: float, retry: int) -> None:
    failed = math.ldexp(mantissa, exponent)
    got = gallop_scale(failed, retry)
    steps = math.log2(failed / got)
    assert steps == int(steps) and steps >= 1  # failed * 2**-k, exact, at least one halving
    if failed <= 2 * RETRY_FLOOR:
        assert got == failed / 2  # at the floor (or one halving above it): one more halving
    elif steps < 2 ** (retry - 1):
        assert got <= RETRY_FLOOR < got * 2  # the doubling step would pass the floor: stop there
    else:
        assert steps == 2 ** (retry - 1) and got > RETRY_FLOOR / 2
