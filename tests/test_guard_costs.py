"""What a SpikeGuard costs, and that its leaner bookkeeping decides exactly as the rule says.

The guard's cost on a clean step is one read of the gradients (``_foreach_norm``) and a fixed
number of small operations on its windows: counted here with the aten ops the cost table
counts (``benchmarks/dispatch_count.py``), for few and many gradient tensors alike. Its
window keeps unfilled slots at ``+inf`` and writes a value that must not enter into a scratch
column (both so that a step costs fewer operations); a reference model of the rule, in plain
Python, checks every decision, and the checkpoint format stays as it was (zeros where a
window is not filled yet).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ampscaler
from ampscaler.guards import SpikeGuard, StepMeasurements

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "dispatch_count.py"

#: The most aten ops a SpikeGuard may add to a default iteration of one plain optimizer (26
#: before its window kept +inf in unfilled slots and a scratch column, 21 before every loss
#: was kept detached): the norm (3), the values (2), the decision (4), the flag's join (1),
#: whether the step was skipped (1), the append (7), and what the scaler does for a guard (2:
#: the factor the gradients were unscaled by, and the loss's sum).
GUARD_OPS = 20


def _dispatch_count() -> Any:
    sys.path.insert(0, str(BENCHMARK.parent))
    try:
        import dispatch_count
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    return dispatch_count


@pytest.mark.parametrize("layers", [2, 40])
def test_a_guard_adds_a_fixed_number_of_ops_however_many_gradients(layers: int) -> None:
    counts = _dispatch_count()

    def arm(make: Any) -> Any:
        loop = counts.Loop(make, counts.sgd, layers=layers)
        return counts.count_arm(loop.iteration, iterations=10)

    def guarded() -> ampscaler.GradScaler:
        scaler = ampscaler.GradScaler("cpu")
        scaler.attach(SpikeGuard(window=8))
        return scaler

    plain, ours = arm(counts.our_scaler()), arm(guarded)
    assert ours.own - plain.own <= GUARD_OPS
    assert ours.reads == plain.reads == 1  # the plain step's one read: the guard adds none
    assert ours.by_name()["aten._foreach_norm.Scalar"] == 1  # one read of them all


def _reference(
    steps: list[tuple[float, float, bool]], sigma: float, window: int, warmup: int
) -> list[bool]:
    """The rule in plain Python: a step spikes when its norm or loss is above the mean plus
    ``sigma`` sample deviations of the last ``window`` values taken (finite, not skipped),
    once ``max(warmup, 2)`` values were taken; ``skipped_elsewhere`` skips a step for another
    reason (its values are not taken)."""
    ready = max(warmup, 2)
    kept: list[list[float]] = [[], []]
    counts = [0, 0]
    decisions = []
    for norm, loss, skipped_elsewhere in steps:
        values = (norm, loss)
        spike = False
        for row, value in enumerate(values):
            held = kept[row][-window:]
            if counts[row] >= ready and len(held) >= 2 and not math.isnan(value):
                bar = statistics.fmean(held) + sigma * statistics.stdev(held)
                spike = spike or value > bar
        decisions.append(spike)
        if not (spike or skipped_elsewhere):
            for row, value in enumerate(values):
                if math.isfinite(value):
                    kept[row].append(value)
                    counts[row] += 1
    return decisions


def _steps(seed: int, count: int) -> list[tuple[float, float, bool]]:
    """Norms and losses around 1 with spikes, NaN and inf values, and steps skipped by
    something else."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        norm, loss = rng.uniform(0.8, 1.2), rng.uniform(1.5, 2.5)
        draw = rng.random()
        if draw < 0.08:
            norm *= 50
        elif draw < 0.12:
            loss *= 50
        elif draw < 0.15:
            loss = math.nan
        elif draw < 0.17:
            norm = math.inf
        steps.append((norm, loss, rng.random() < 0.1))
    return steps


def _run(
    guard: SpikeGuard, steps: list[tuple[float, float, bool]], optimizer: torch.optim.Optimizer
) -> list[bool]:
    decisions = []
    for norm, loss, skipped_elsewhere in steps:
        measured = StepMeasurements(optimizer, torch.tensor(norm), torch.tensor(loss))
        flag = guard.check(measured)
        assert flag.dtype == torch.float32 and float(flag) in (0.0, 1.0)
        decisions.append(bool(flag))
        guard.end_iteration(torch.tensor(bool(flag) or skipped_elsewhere))
    return decisions


@pytest.mark.parametrize(
    ("window", "warmup"), [(8, None), (8, 3), (4, 12), (2, 0), (16, None), (5, 5)]
)
@pytest.mark.parametrize("seed", range(4))
def test_the_guard_decides_as_the_rule_says(window: int, warmup: int | None, seed: int) -> None:
    """Every warm-up (ready once full, before, after), spikes, NaN and inf values, steps
    skipped for other reasons: the guard's decisions are the reference model's."""
    steps = _steps(seed, 120)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    guard = SpikeGuard(sigma=3.0, window=window, warmup=warmup)
    decisions = _run(guard, steps, optimizer)
    expected = _reference(steps, 3.0, window, window if warmup is None else warmup)
    assert decisions == expected
    assert sum(decisions) >= 3  # the spikes were there to be caught


@pytest.mark.parametrize("cut", [3, 8, 50])
def test_a_window_saved_part_filled_reads_as_before_and_resumes_alike(cut: int) -> None:
    """The checkpoint holds zeros where a window is not filled yet (the format before the
    ``+inf`` slots), and a guard loaded from it, or from one written by the version before,
    decides as the uninterrupted one."""
    steps = _steps(7, 80)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    whole = _run(SpikeGuard(sigma=3.0, window=16), steps, optimizer)

    first = SpikeGuard(sigma=3.0, window=16)
    head = _run(first, steps[:cut], optimizer)
    state = first.state_dict()
    for window in state["windows"]:
        for row, count in zip(window["values"], window["count"], strict=True):
            assert all(math.isfinite(v) for v in row)
            assert row[min(count, 16) :] == [0.0] * (16 - min(count, 16))
    resumed = SpikeGuard()
    resumed.load_state_dict(state)
    assert head + _run(resumed, steps[cut:], optimizer) == whole


def test_a_single_flat_gradient_is_normed_in_one_op() -> None:
    """Where a device and dtype hold one tensor (a flat buffer), the norm is one
    ``vector_norm`` (not a multi-tensor norm, a stack and a norm of norms), the same value as
    the multi-tensor route's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ampscaler.guards import _grad_norm

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.names: list[str] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    flat = torch.randn(1000)
    pieces = list(flat.split(100))
    with Ops() as ops:
        one = _grad_norm({flat.device: {flat.dtype: [flat]}}, flat.device)
    assert ops.names == ["aten.linalg_vector_norm.default"]
    many = _grad_norm({flat.device: {flat.dtype: pieces}}, flat.device)
    torch.testing.assert_close(one, many)
    torch.testing.assert_close(one, torch.linalg.vector_norm(flat))


def test_a_copied_guard_decides_as_the_original() -> None:
    """The window's ring is a view of its buffer: a deep copy (``copy.deepcopy(scaler)``)
    keeps it one, so the copy's appends reach the values it decides from."""
    import copy

    steps = _steps(3, 60)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    guard = SpikeGuard(sigma=3.0, window=8)
    _run(guard, steps[:5], optimizer)
    twin = copy.deepcopy(guard)
    assert _run(twin, steps[5:], optimizer) == _run(guard, steps[5:], optimizer)


@pytest.mark.parametrize("count", [-1, 2.5, True])
def test_a_window_count_that_is_no_count_is_refused_at_load(count: object) -> None:
    """The counts say which slots are filled: one that is not a whole number >= 0 is refused
    when the state is loaded, not at the first step after it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    guard = SpikeGuard(window=4)
    _run(guard, _steps(1, 3), optimizer)
    state = guard.state_dict()
    state["windows"][0]["count"][0] = count
    with pytest.raises(ampscaler.InvalidStateDictError, match="whole numbers"):
        SpikeGuard().load_state_dict(state)


def test_the_flat_route_guards_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``flat_grads=True`` the guard norms the one flat buffer (one op); a spike is
    caught at the same step as on the default route, and clean steps pass alike."""
    from ampscaler import guards

    seen: list[list[int]] = []
    norm = guards._grad_norm

    def spy(groups: Any, device: torch.device) -> torch.Tensor:
        seen.append([len(grads) for per in groups.values() for grads in per.values()])
        return norm(groups, device)

    monkeypatch.setattr(guards, "_grad_norm", spy)

    def run(**settings: Any) -> list[bool]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(10)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = ampscaler.GradScaler("cpu", init_scale=256.0, **settings)
        scaler.attach(SpikeGuard(sigma=6.0, window=8))
        skipped = []
        for step in range(14):
            loss = model(torch.randn(4, 8)).pow(2).mean() * (1000.0 if step == 11 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=False)
            skipped.append(scaler.last_step_skipped)
        return skipped

    flat = run(flat_grads=True)
    assert seen[1:] == [[1]] * 13  # the buffer, from the second step on
    assert flat == run() == [False] * 11 + [True, False, False]
