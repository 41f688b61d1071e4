"""Batch replay: ``GradScaler.attempts()`` against torch's scaler driven by the same loop by hand.

A batch whose scaled gradients overflow runs again at the backed-off scale; a batch whose loss
was already inf/NaN, or that a guard vetoed, runs once; a batch that overflows at every scale
stops after ``max_attempts``. With the defaults every try is an ordinary iteration, so the run
must equal torch's scaler under a hand-written replay loop, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampscaler
from ampscaler.replay import gallop_scale, retry_scale

INF = float("inf")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(6, 12)
        self.head = torch.nn.Linear(12, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


@dataclass
class Plan:
    """What goes wrong, by (batch, try): ``grads`` poisons a gradient, ``loss`` the loss; and by
    batch: ``ceilings`` poisons a gradient of every try whose scale is above the batch's."""

    grads: set[tuple[int, int]] = field(default_factory=set)
    loss: set[tuple[int, int]] = field(default_factory=set)
    ceilings: dict[int, float] = field(default_factory=dict)
    batches: int = 12
    micro: int = 1  # micro-batches per try (accumulation)


@dataclass
class Result:
    params: list[torch.Tensor]
    scales: list[float]
    tries: list[int]  # per batch


def _micro(batch: int, index: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * batch + index))


def _optimizers(model: Net, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "two":
        return [
            torch.optim.SGD(model.body.parameters(), lr=0.05, momentum=0.9),
            torch.optim.AdamW(model.head.parameters(), lr=1e-2),
        ]
    fused = kind == "fused"
    return [torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)]


def _try(
    scaler: Any, model: Net, opts: list[torch.optim.Optimizer], plan: Plan, batch: int, number: int
) -> bool:
    """One try at ``batch``: the body a user writes. Returns whether torch's scaler skipped the
    step (its gradients held inf/NaN: they overflowed, or the loss was inf)."""
    for opt in opts:
        opt.zero_grad()
    for index in range(plan.micro):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(_micro(batch, index)).float().square().mean()
        if (batch, number) in plan.loss and index == plan.micro - 1:
            loss = loss * INF
        scaler.scale(loss).backward()
    if (batch, number) in plan.grads or scaler.get_scale() > plan.ceilings.get(batch, INF):
        model.head.bias.grad[0] = INF
    found = False
    for opt in opts:
        scaler.step(opt)
        if isinstance(scaler, torch.amp.GradScaler):
            found = found or any(v.item() > 0 for v in scaler._found_inf_per_device(opt).values())
    scaler.update()
    return found


def _by_hand(
    scaler: torch.amp.GradScaler,
    model: Net,
    opts: list[torch.optim.Optimizer],
    plan: Plan,
    batch: int,
    tries: int,
    carried: float | None,
    warm: bool,
) -> tuple[int, float | None, bool]:
    """The replay loop of docs/replay.md written by hand over torch's scaler: retry a batch whose
    scaled gradients overflowed; from the third try on at the scales ``retry_scale`` gives
    where ``search``, else (an outlier: the batch started at ``carried``, the scale the batch
    before stepped at) at those ``gallop_scale`` gives where the run skipped no step before
    (``warm``), else where torch's rule backs off; once a batch took more than one retry, put
    the scale and growth tracker back to where its first overflow left them, and for an
    outlier the scale back to where it started. Returns the tries used, the scale the batch
    stepped at where it got through on its first retry at the latest, and whether any try
    skipped its step."""
    first: tuple[float, int] | None = None
    failed = 0.0
    start = scaler.get_scale()
    search = carried != start
    for number in range(tries):
        if first is not None and number >= 2 and (search or warm):
            failed = retry_scale(failed, tries - number) if search else gallop_scale(failed, number)
            scaler._scale.fill_(failed)  # type: ignore[union-attr]
            scaler._growth_tracker.fill_(first[1])  # type: ignore[union-attr]
        skipped = _try(scaler, model, opts, plan, batch, number)
        overflow = skipped and (batch, number) not in plan.loss  # what a lower scale can help
        if first is None:
            if number + 1 == tries or not overflow:
                return number + 1, None if overflow else start, skipped
            first = (scaler.get_scale(), int(scaler._get_growth_tracker()))
            failed = first[0]
        elif number == 1 and not overflow:
            return 2, first[0], True
        elif number + 1 == tries or not overflow:
            scaler._scale.fill_(first[0] if search else start)  # type: ignore[union-attr]
            scaler._growth_tracker.fill_(first[1])  # type: ignore[union-attr]
            return number + 1, None, True
    raise AssertionError("unreachable: the last try returns")


def _run(factory: Callable[[], Any], kind: str, plan: Plan, tries: int = 3) -> Result:
    torch.manual_seed(0)
    model = Net()
    opts = _optimizers(model, kind)
    scaler = factory()
    result = Result([], [], [])
    carried: float | None = None  # the scale the last batch stepped at (first or second try)
    warm = True  # no step skipped yet
    for batch in range(plan.batches):
        used = 0
        if isinstance(scaler, torch.amp.GradScaler):  # the loop a user writes by hand
            used, carried, skipped = _by_hand(
                scaler, model, opts, plan, batch, tries, carried, warm
            )
            warm = warm and not skipped
        else:
            for attempt in scaler.attempts(max_attempts=tries):
                used += 1
                _try(scaler, model, opts, plan, batch, attempt.number)
        result.tries.append(used)
        result.scales.append(scaler.get_scale())
    result.params = [p.detach().clone() for p in model.parameters()]
    return result


PLAN = Plan(grads={(2, 0), (5, 0), (5, 1), (9, 0)}, loss={(7, 0)})


@pytest.mark.parametrize("kind", ["plain", "fused", "two"])
@pytest.mark.parametrize("micro", [1, 3], ids=["one-micro-batch", "accumulation"])
def test_attempts_equal_torchs_scaler_under_a_hand_written_replay_loop(
    kind: str, micro: int
) -> None:
    plan = Plan(PLAN.grads, PLAN.loss, micro=micro)
    kwargs: dict[str, Any] = {"init_scale": 2.0**12, "growth_interval": 3}
    ours = _run(lambda: ampscaler.GradScaler("cpu", **kwargs), kind, plan)
    theirs = _run(lambda: torch.amp.GradScaler("cpu", **kwargs), kind, plan)
    assert ours.tries == theirs.tries
    assert ours.scales == theirs.scales
    assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params, strict=True))
    # Batches 2 and 9 replayed once, 5 twice; the inf loss of batch 7 ran once; growth
    # probes that overflowed (growth_interval 3) replayed too.
    assert ours.tries[2] >= 2 and ours.tries[5] == 3 and ours.tries[7] == 1


@settings(max_examples=40, deadline=None)
@given(
    grads=st.sets(st.tuples(st.integers(0, 9), st.integers(0, 3)), max_size=12),
    loss=st.sets(st.tuples(st.integers(0, 9), st.integers(0, 3)), max_size=2),
    ceilings=st.dictionaries(
        st.integers(0, 9), st.sampled_from([2.0**k for k in range(14)]), max_size=5
    ),
    tries=st.integers(1, 4),
    growth_interval=st.integers(1, 4),
    kind=st.sampled_from(["plain", "fused"]),
)
def test_attempts_equal_the_hand_written_loop_on_any_plan(
    grads: set[tuple[int, int]],
    loss: set[tuple[int, int]],
    ceilings: dict[int, float],
    tries: int,
    growth_interval: int,
    kind: str,
) -> None:
    """Any mix of overflows by try, batches with a ceiling below the scale (warm-ups, outliers,
    gradients that grew), inf losses, growths between batches and ``max_attempts``: the same
    tries, scales and parameters as the rules written by hand over torch's scaler."""
    plan = Plan(grads, loss, ceilings, batches=10)
    kwargs: dict[str, Any] = {"init_scale": 2.0**12, "growth_interval": growth_interval}
    ours = _run(lambda: ampscaler.GradScaler("cpu", **kwargs), kind, plan, tries)
    theirs = _run(lambda: torch.amp.GradScaler("cpu", **kwargs), kind, plan, tries)
    assert ours.tries == theirs.tries
    assert ours.scales == theirs.scales
    assert all(torch.equal(a, b) for a, b in zip(ours.params, theirs.params, strict=True))


def test_replays_are_counted_and_recorded() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    history = scaler.add_sink(ampscaler.StepHistory(100))
    result = _run(lambda: scaler, "plain", Plan({(1, 0), (4, 0), (4, 1)}, {(6, 0)}, batches=8))
    assert result.tries == [1, 2, 1, 1, 3, 1, 1, 1]
    stats = scaler.stats
    assert stats.replays == 3 and stats.skipped == 4 and stats.steps == 11
    assert [r.attempt for r in history.records] == [0, 0, 1, 0, 0, 0, 1, 2, 0, 0, 0]
    assert "attempt 2 at its batch" in str(history.records[6])
    assert scaler.last_overflow is None  # the last try of the last batch was clean


def test_a_loss_that_is_already_inf_runs_once_and_a_hopeless_batch_stops_at_the_limit() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12)
    always = {(0, n) for n in range(10)}
    result = _run(lambda: scaler, "plain", Plan(grads=always, loss={(1, 0)}, batches=3), tries=4)
    assert result.tries == [4, 1, 1]
    # Its backoffs are the batch's: one backoff, as a skip without the loop leaves (before
    # issue 37 the loop left four, one per try: 2**12 / 16).
    assert result.scales[0] == 2.0**12 / 2
    assert scaler.stats.replays == 3


def test_a_guards_veto_is_not_replayed() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaler.add_guard(ampscaler.SpikeGuard(sigma=3.0, window=8, warmup=4))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tries = []
    for batch in range(12):
        used = 0
        for _ in scaler.attempts():
            used += 1
            opt.zero_grad()
            loss = model(_micro(batch, 0)).square().mean() * (1e4 if batch == 10 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        tries.append(used)
    assert scaler.stats.spike_skips == 1 and scaler.last_skip_reason is None
    assert tries == [1] * 12


def test_a_held_scale_on_an_inf_loss_is_an_opt_in_of_torchs_rule() -> None:
    plan = Plan(loss={(3, 0)}, batches=5)
    held = ampscaler.GradScaler(
        "cpu", init_scale=2.0**8, policy=ampscaler.ScalePolicy(backoff_on_nonfinite_loss=False)
    )
    result = _run(lambda: held, "plain", plan)
    assert result.scales == [2.0**8] * 5 and held.stats.skipped == 1
    default = _run(lambda: ampscaler.GradScaler("cpu", init_scale=2.0**8), "plain", plan)
    assert default.scales[3] == 2.0**7  # torch's rule backs off, as torch's scaler does
    assert held.state_dict()["backoff_on_nonfinite_loss"] is False


def test_a_compiled_step_in_the_body_replays_as_the_eager_one() -> None:
    def run(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)

        def forward_backward(x: torch.Tensor, poison: torch.Tensor) -> None:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().square().mean() * poison
            scaler.scale(loss).backward()

        fb = torch.compile(forward_backward, backend="eager") if compiled else forward_backward
        scales = []
        for batch in range(6):
            for attempt in scaler.attempts():
                opt.zero_grad()
                big = batch == 3 and not attempt.replay
                fb(_micro(batch, 0), torch.tensor(2.0**30 if big else 1.0))
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
        return scales

    torch._dynamo.reset()
    try:
        assert run(True) == run(False)
    finally:
        torch._dynamo.reset()


def test_a_compiled_step_and_update_judge_an_outlier_as_the_eager_ones() -> None:
    """Under torch.compile update() defers the policy to the next read (the body's own
    get_scale() here): the scale a try ran at must still be the one an outlier is given back."""

    def run(compiled: bool) -> list[float]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12)

        def step_and_update() -> None:
            scaler.step(opt)
            scaler.update()

        finish = torch.compile(step_and_update, backend="eager") if compiled else step_and_update
        scales = []
        for batch in range(6):
            for _ in scaler.attempts():
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(_micro(batch, 0)).float().square().mean()
                scaler.scale(loss * (2.0**40 if batch == 3 else 1.0)).backward()  # an outlier
                finish()
                scales.append(scaler.get_scale())
        return scales

    torch._dynamo.reset()
    try:
        eager, compiled = run(False), run(True)
    finally:
        torch._dynamo.reset()
    assert compiled == eager
    # The scales after the outlier's three tries (run at 2**12, 2**11, then a gallop to 2**9),
    # each overflowed and backed off; skipped ...
    assert eager[3:6] == [2.0**11, 2.0**10, 2.0**8]
    assert eager[6:] == [2.0**12, 2.0**12]  # ... and the run given its scale back


def test_a_checkpoint_between_batches_resumes_the_replays_exactly() -> None:
    plan = Plan(grads={(1, 0), (6, 0), (6, 1)}, batches=9)
    whole = ampscaler.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    expected = _run(lambda: whole, "plain", plan)

    torch.manual_seed(0)
    model = Net()
    opts = _optimizers(model, "plain")
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    for batch in range(9):
        if batch == 4:  # save, and go on in a new scaler
            saved = copy.deepcopy(scaler.state_dict())
            scaler = ampscaler.GradScaler("cpu")
            scaler.load_state_dict(saved)
        for attempt in scaler.attempts():
            _try(scaler, model, opts, plan, batch, attempt.number)
    assert scaler.state_dict() == whole.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), expected.params, strict=True))


def test_a_body_that_does_not_update_once_is_a_clear_error() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu")
    with pytest.raises(ampscaler.ScalerUsageError, match="did not call update"):
        for _ in scaler.attempts():
            scaler.scale(model(_micro(0, 0)).sum()).backward()
            scaler.step(opt)
    scaler.update()
    with pytest.raises(ampscaler.ScalerUsageError, match="more than once"):
        for _ in scaler.attempts():
            for _ in range(2):
                scaler.scale(model(_micro(0, 0)).sum()).backward()
                scaler.step(opt)
                scaler.update()
    with pytest.raises(ampscaler.ScalerUsageError, match="No inf checks"):
        for _ in scaler.attempts():
            scaler.scale(model(_micro(0, 0)).sum()).backward()
            scaler.update()  # no step(): nothing was checked
    with pytest.raises(ampscaler.InvalidConfigError, match="max_attempts"):
        next(iter(scaler.attempts(max_attempts=0)))


def test_a_disabled_scaler_runs_each_batch_once() -> None:
    scaler = ampscaler.GradScaler("cpu", enabled=False)
    assert [attempt.number for attempt in scaler.attempts()] == [0]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    import multirank

    return multirank.spawn(2, ["replay", "replay_without_group"])


def test_two_ranks_agree_on_the_cause_the_origin_and_the_replay(
    two_ranks: list[dict[str, Any]],
) -> None:
    """An inf loss on rank 1 (its second micro-batch): both ranks report cause ``loss`` from
    rank 1, micro-batch 1, and neither replays, although the NaN reached rank 0's gradients
    only through the rank's own shard. An overflow in rank 0's shard: both report cause
    ``gradients`` from rank 0 and both replay."""
    runs = [two_ranks[rank]["replay"] for rank in (0, 1)]
    assert runs[0] == runs[1]
    batches = runs[0][:-1]
    assert batches[1] == [("loss", (1,), 1)]
    assert batches[3] == [("gradients", (0,), None), None]
    assert all(tries == [None] for index, tries in enumerate(batches) if index not in (1, 3))
    assert runs[0][-1].replays == 1


def test_several_ranks_without_a_process_group_are_refused(
    two_ranks: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        message = two_ranks[rank]["replay_without_group"]
        assert "attempts() decides on each rank" in message and "process_group=" in message


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_clean_run_reads_the_device_no_more_than_without_the_loop(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain optimizers: the step's own read, and nothing more; a fused optimizer: the one read
    of the iteration's flags the loop needs (its kernel decided without a read)."""
    from test_syncs import SyncCounter

    counter = SyncCounter(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    opt.step = counter.not_counting(opt.step)  # type: ignore[method-assign]
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8)

    def one_batch(batch: int, loop: bool) -> int:
        with counter.counting():
            before = counter.count
            tries = scaler.attempts() if loop else iter([None])
            for _ in tries:
                opt.zero_grad()
                scaler.scale(model(_micro(batch, 0)).square().mean()).backward()
                scaler.step(opt)
                scaler.update()
            return counter.count - before

    without = [one_batch(batch, loop=False) for batch in range(4)]
    within = [one_batch(batch, loop=True) for batch in range(4, 8)]
    assert without == [0 if fused else 1] * 4
    assert within == [1] * 4
