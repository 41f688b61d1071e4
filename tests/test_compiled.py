"""Compiled training: ampscaler under torch.compile, against torch's scaler and the eager run.

- A whole compiled step (scale, backward, unscale_, clip, step, update, zero_grad) makes no
  more graph breaks and no more graphs than the same step with torch's scaler, for plain,
  foreach and fused optimizers, with zero_grad(set_to_none) both ways, and recompiles nothing
  after the first step; its scales and skipped steps are the eager run's.
- ampscaler's own calls trace whole: unscale_ followed by clip_grad_norm_, and update(), each
  compile with fullgraph=True and never recompile as the scale grows, backs off and steps
  are skipped.
- Misuse inside a compiled region raises the eager error; sinks still get every record.

Graph counts do not depend on the backend, so those tests use the eager backend (fast); the
fullgraph tests run inductor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import ampscaler
from scaler_readings import counts, skip_reason

STEPS = 16
POISONED = {5, 12}  # steps whose loss is multiplied by inf


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)


@dataclass
class Run:
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    breaks: int = 0
    graphs: int = 0
    recompiles_after_first_step: int = 0


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def whole_step(factory: type, kind: str, set_to_none: bool, compiled: bool) -> Run:
    """Train a small model STEPS steps with one (compiled or eager) function per step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = _optimizer(kind, model.parameters())
    scaler = factory("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def step(poison: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss * poison).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=set_to_none)

    run = Run()
    fn = torch.compile(step, backend="eager") if compiled else step
    for index in range(STEPS):
        if index == 1:  # everything compiles at the first call
            graphs_after_warmup = counters["stats"]["unique_graphs"]
        before = scaler.get_scale()
        fn(torch.tensor(float("inf") if index in POISONED else 1.0))
        run.scales.append(scaler.get_scale())
        run.skipped.append(run.scales[-1] < before)
    run.params = [p.detach().clone() for p in model.parameters()]
    run.breaks = sum(counters["graph_break"].values())
    run.graphs = counters["stats"]["unique_graphs"]
    run.recompiles_after_first_step = run.graphs - graphs_after_warmup
    return run


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "keep_grads"])
@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_whole_compiled_step_breaks_and_graphs_at_most_torchs(kind: str, set_to_none: bool) -> None:
    theirs = whole_step(torch.amp.GradScaler, kind, set_to_none, compiled=True)
    torch._dynamo.reset()
    counters.clear()
    ours = whole_step(ampscaler.GradScaler, kind, set_to_none, compiled=True)
    assert ours.breaks <= theirs.breaks, (ours.breaks, theirs.breaks)
    assert ours.graphs <= theirs.graphs, (ours.graphs, theirs.graphs)
    assert ours.recompiles_after_first_step == 0
    # And the same training as torch's, compiled or not.
    assert ours.scales == theirs.scales
    assert any(ours.skipped) and max(ours.scales) > 2.0**10  # backoffs and growth happened
    eager = whole_step(ampscaler.GradScaler, kind, set_to_none, compiled=False)
    assert ours.scales == eager.scales
    assert all(torch.equal(a, b) for a, b in zip(ours.params, eager.params, strict=True))


def _minimal_loop_counts(factory: type) -> tuple[int, int, int]:
    """(breaks, graphs, graphs added after the first call) of the shortest compiled loop:
    scale, backward, step, update, zero_grad, with no argument to the compiled function."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = factory("cpu")
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    @torch.compile(backend="eager")
    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    step()
    first = counters["stats"]["unique_graphs"]
    for _ in range(4):
        step()
    graphs = counters["stats"]["unique_graphs"]
    return sum(counters["graph_break"].values()), graphs, graphs - first


def test_the_shortest_compiled_loop_compiles_once() -> None:
    theirs = _minimal_loop_counts(torch.amp.GradScaler)
    breaks, graphs, recompiled = _minimal_loop_counts(ampscaler.GradScaler)
    assert breaks <= theirs[0] and graphs <= theirs[1], ((breaks, graphs), theirs)
    assert recompiled == 0


def _trained_with_compiled_calls(
    compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]], steps: int = 32
) -> tuple[list[float], list[bool], list[torch.Tensor]]:
    """Train with scaler.unscale_ + clip and scaler.update each wrapped by ``compile_fn``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)

    def unscale_and_clip() -> torch.Tensor:
        scaler.unscale_(opt)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    clip = compile_fn(unscale_and_clip)
    update = compile_fn(scaler.update)
    scales, skipped = [], []
    x = torch.randn(2, 6)
    for index in range(steps):
        loss = model(x).pow(2).mean() * (float("inf") if index % 5 == 3 else 1.0)
        scaler.scale(loss).backward()
        clip()
        scaler.step(opt)
        skipped.append(scaler.last_step_skipped)
        update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return scales, skipped, [p.detach().clone() for p in model.parameters()]


def test_unscale_clip_and_update_compile_fullgraph_and_match_eager() -> None:
    def fullgraph(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, fullgraph=True, backend="inductor")

    scales, skipped, params = _trained_with_compiled_calls(fullgraph)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] <= 2  # one each, never recompiled
    eager_scales, eager_skipped, eager_params = _trained_with_compiled_calls(lambda fn: fn)
    assert scales == eager_scales and skipped == eager_skipped
    assert any(skipped) and len(set(scales)) > 3  # backoffs, growth and skips happened
    for mine, reference in zip(params, eager_params, strict=True):
        torch.testing.assert_close(mine, reference)


def test_a_misuse_inside_a_compiled_region_raises_the_eager_error() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu")

    @torch.compile(backend="eager")
    def twice() -> None:
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    with pytest.raises(RuntimeError, match="already been called on this optimizer"):
        twice()

    fresh = ampscaler.GradScaler("cpu")

    @torch.compile(backend="eager")
    def before_scale() -> None:
        fresh.update()

    with pytest.raises(RuntimeError, match="the scale was never used"):
        before_scale()


def test_sinks_and_diagnostics_still_work_in_a_compiled_step() -> None:
    def records(compiled: bool) -> list[tuple[int, float, float, bool]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        scaler = ampscaler.GradScaler("cpu", init_scale=8.0, growth_interval=2)
        history = scaler.add_sink(ampscaler.StepHistory(20))
        scaler.watch(model)

        def step(poison: torch.Tensor) -> None:
            scaler.scale(model(torch.ones(2, 4)).sum() * poison).backward()
            scaler.step(opt)
            scaler.update()

        fn = torch.compile(step, backend="eager") if compiled else step
        for index in range(7):
            fn(torch.tensor(float("inf") if index == 3 else 1.0))
            if index == 3:
                assert scaler.last_overflow is not None
                assert scaler.last_overflow.names == ["weight", "bias"]
            opt.zero_grad()
        return [(r.step, r.scale, r.new_scale, r.skipped) for r in history.records]

    assert records(compiled=True) == records(compiled=False)


def test_a_spike_guard_decides_alike_in_a_compiled_step() -> None:
    """Inside torch.compile the guard sees the gradient norm (the loss is not kept there) and
    skips the same step as eagerly, on the device, with the scale kept."""

    def run(compiled: bool) -> tuple[list[str | None], ampscaler.ScalerStats]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        scaler = ampscaler.GradScaler("cpu", init_scale=1.0)
        scaler.attach(ampscaler.SpikeGuard(window=4))

        def step(x: torch.Tensor, y: torch.Tensor, spike: torch.Tensor) -> None:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y) * spike).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        call = torch.compile(step) if compiled else step
        reasons = []
        for i in range(8):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            call(x, y, torch.tensor(1000.0 if i == 6 else 1.0))
            reasons.append(skip_reason(scaler))
        return reasons, counts(scaler)

    eager, compiled = run(False), run(True)
    assert eager == compiled
    assert eager[0] == [None] * 6 + ["spike", None]
    assert (eager[1].spike_skips, eager[1].backoffs) == (1, 0)
