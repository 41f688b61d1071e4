"""Training health: why a step was skipped, spike skipping, collapse warnings, readable logs,
the wrong precision, and skips per optimizer."""

from __future__ import annotations

import copy
import logging
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch

import ampscaler
from ampscaler import CollapseAlert, CollapseWatch, LoggingSink, SpikeGuard, StepHistory
from scaler_readings import counts, skip_reason

# ---------------------------------------------------------------- helpers


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)


def _loss(model: torch.nn.Module, step: int, times: float = 1.0) -> torch.Tensor:
    x, y = _batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y) * times


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    "fused_adam": lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
}


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- why a step was skipped


def test_a_forward_that_overflows_in_fp16_gives_cause_loss() -> None:
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(300.0)  # 4 * 300 * 100 = 120000: beyond float16's 65504
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", init_scale=8.0, max_consecutive_skips=2)
    history = scaler.add_sink(StepHistory(4))
    scaler.watch(model)
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.full((2, 4), 100.0))
        loss = out.float().pow(2).mean()  # its gradient carries the inf back
        assert not torch.isfinite(loss)  # the forward overflowed, before any scaling
        scaler.scale(loss).backward()
        scaler.step(opt)
        if step == 0:
            scaler.update()
            assert skip_reason(scaler) == "nonfinite"
            report = scaler.last_overflow
            assert report is not None and report.cause == "loss"
            assert "cannot help" in str(report)
            assert history.records[-1].overflow is not None
            assert history.records[-1].overflow.cause == "loss"
        else:
            with pytest.raises(ampscaler.PersistentOverflowError) as raised:
                scaler.update()
            assert raised.value.cause == "loss"
            message = str(raised.value)
            assert "cannot help" in message and "65504" in message and "inputs" in message
            assert "min_scale" not in message
        opt.zero_grad()


@pytest.mark.parametrize("name", ["sgd", "fused_adam"])
def test_a_scale_too_large_for_finite_gradients_gives_cause_gradients(name: str) -> None:
    model = _mlp()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**120, max_consecutive_skips=1)
    loss = _loss(model, 0)
    assert torch.isfinite(loss)
    scaler.scale(loss).backward()
    scaler.step(opt)
    with pytest.raises(ampscaler.PersistentOverflowError) as raised:
        scaler.update()
    assert raised.value.cause == "gradients"
    assert "init_scale" in str(raised.value) and "min_scale" in str(raised.value)
    assert skip_reason(scaler) == "nonfinite"
    report = scaler.last_overflow
    assert report is not None and report.cause == "gradients"


def test_any_non_finite_loss_among_several_makes_the_cause_loss() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()  # a finite loss, then a NaN one
    scaler.scale([_loss(model, 1) * float("nan")])[0].backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert report is not None and report.cause == "loss"


def test_the_cause_travels_through_the_jsonl_log(tmp_path: Any) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    path = tmp_path / "steps.jsonl"
    with scaler.add_sink(ampscaler.JsonlSink(path)):
        scaler.scale(_loss(model, 0) * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
    (record,) = ampscaler.read_log(path)
    assert record.overflow is not None and record.overflow.cause == "loss"


# ---------------------------------------------------------------- the spike guard


def _guarded_run(
    name: str, spike_at: int, steps: int, guard: SpikeGuard | None = None
) -> dict[str, Any]:
    model = _mlp()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(guard or SpikeGuard(sigma=6.0, window=8))
    out: dict[str, Any] = {"reasons": [], "scales": []}
    for step in range(steps):
        scaler.scale(_loss(model, step)).backward()
        if step == spike_at:
            _spike_grads(model)
            out["before"] = _snapshot(model, opt)
            scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["reasons"].append(skip_reason(scaler))
        out["scales"].append(scaler.get_scale())
        if step == spike_at:
            out["after"] = _snapshot(model, opt)
            out["scale_kept"] = scaler.get_scale() == scale_before
    out["stats"] = counts(scaler)
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_finite_gradient_spike_is_skipped_and_leaves_everything_untouched(name: str) -> None:
    run = _guarded_run(name, spike_at=12, steps=14)
    assert run["reasons"] == [None] * 12 + ["spike", None]
    assert _same(run["before"], run["after"])  # parameters and optimizer state untouched
    assert run["scale_kept"]
    stats = run["stats"]
    assert (stats.skipped, stats.spike_skips, stats.backoffs, stats.steps) == (0, 1, 0, 14)


def test_the_guard_waits_for_its_warm_up() -> None:
    run = _guarded_run("sgd", spike_at=5, steps=6, guard=SpikeGuard(sigma=6.0, window=8))
    assert run["reasons"] == [None] * 6  # only 5 steps in the window: not ready yet
    run = _guarded_run("sgd", spike_at=5, steps=6, guard=SpikeGuard(window=8, warmup=4))
    assert run["reasons"][5] == "spike"


def _spike_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad.mul_(1000.0)  # type: ignore[union-attr]  # finite, 1000x the norm


def _reasons(
    scaler: ampscaler.GradScaler,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    after_backward: Callable[[int, torch.Tensor], object],
) -> list[str | None]:
    """Train ``steps`` steps, calling ``after_backward(step, loss)``; the skip reasons."""
    reasons = []
    for step in range(steps):
        loss = _loss(model, step)
        scaler.scale(loss).backward()
        after_backward(step, loss)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        reasons.append(skip_reason(scaler))
    return reasons


def test_a_loss_spike_alone_is_caught() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients stay alike
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaler.attach(SpikeGuard(sigma=3.0, window=8))

    def loss_spikes(step: int, loss: torch.Tensor) -> None:
        if step == 9:  # the same gradients, but the loss passed to scale() spikes
            scaler.scale(loss.detach() * 0 + 1e6)

    assert _reasons(scaler, model, opt, 10, loss_spikes) == [None] * 9 + ["spike"]


def test_a_guard_added_after_training_began_starts_its_warm_up_then() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    assert _reasons(scaler, model, opt, 10, lambda step, loss: None) == [None] * 10
    scaler.attach(SpikeGuard(window=4))

    def spikes(step: int, loss: torch.Tensor) -> None:
        if step in (2, 5):  # 2 steps into its warm-up, then after it
            _spike_grads(model)

    assert _reasons(scaler, model, opt, 6, spikes) == [None] * 5 + ["spike"]


def test_a_spike_step_is_recorded_as_such() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    history = scaler.add_sink(StepHistory(20))
    scaler.attach(SpikeGuard(window=4))
    _reasons(scaler, model, opt, 6, lambda step, loss: step == 5 and _spike_grads(model))
    record = history.records[-1]
    assert record.spike and not record.skipped and record.new_scale == record.scale
    assert "spike guard" in str(record)
    assert ampscaler.StepRecord.from_dict(record.as_dict()) == record
    assert not any(r.spike for r in history.records[:-1])


def test_a_spike_step_counts_as_clean_toward_growth() -> None:
    """docs/diagnostics.md: a spike skip does not back the scale off, and the growth tracker
    counts it as a clean step (its gradients were finite at that scale)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=6)
    scaler.attach(SpikeGuard(window=4))
    reasons = _reasons(scaler, model, opt, 5, lambda step, loss: step == 4 and _spike_grads(model))
    assert reasons == [None] * 4 + ["spike"]
    assert scaler.get_scale() == 2.0**10 and scaler.state_dict()["_growth_tracker"] == 5
    _reasons(scaler, model, opt, 1, lambda step, loss: None)
    assert scaler.get_scale() == 2.0**11  # the sixth step in a row without an overflow


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": -1.0}, "sigma"),
        ({"sigma": float("nan")}, "sigma"),
        ({"window": 1}, "window"),
        ({"window": 2.5}, "window"),
        ({"warmup": -1}, "warmup"),
    ],
)
def test_bad_guard_arguments_are_named(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument} must"):
        SpikeGuard(**kwargs)


def test_guard_arguments_are_taken_as_torch_takes_numbers() -> None:
    """numpy scalars and one-element tensors, validated as the policies' arguments are."""
    guard = SpikeGuard(sigma=torch.tensor(3.0), window=numpy.int64(8), warmup=numpy.int32(4))
    assert (guard.sigma, guard.window, guard.warmup) == (3.0, 8, 4)
    assert type(guard.window) is int and type(guard.warmup) is int


def test_add_guard_refuses_what_is_not_a_guard_and_a_guard_twice() -> None:
    scaler = ampscaler.GradScaler("cpu")
    with pytest.warns(DeprecationWarning, match="add_guard"):  # the deprecated name, still kept
        with pytest.raises(TypeError, match="add_guard"):
            scaler.add_guard(object())  # type: ignore[arg-type]
        guard = scaler.add_guard(SpikeGuard())
        with pytest.raises(ValueError, match="already"):
            scaler.add_guard(guard)


def test_a_scaler_with_a_guard_can_be_copied() -> None:
    run_model = _mlp()
    opt = torch.optim.SGD(run_model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    scaler.attach(SpikeGuard(window=4))
    scaler.scale(_loss(run_model, 0)).backward()
    scaler.step(opt)
    scaler.update()
    for twin in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert twin.last_step_skipped is False and skip_reason(twin) is None
        with pytest.raises(RuntimeError, match="has not stepped"):
            twin.step_skipped(opt)


# ---------------------------------------------------------------- skips per optimizer


@pytest.mark.parametrize("fused", [False, True])
def test_step_skipped_follows_each_optimizer(fused: bool) -> None:
    a, b = _mlp(1), _mlp(2)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-3, fused=fused)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-3, fused=fused)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    with pytest.raises(RuntimeError, match="has not stepped"):
        scaler.step_skipped(opt_a)
    seen = []
    for step in range(4):
        scaler.scale(_loss(a, step) + _loss(b, step)).backward()
        if step == 1:
            b[0].weight.grad[0, 0] = float("inf")  # type: ignore[index]
        if step == 2:
            a[0].weight.grad[0, 0] = float("nan")  # type: ignore[index]
        scaler.step(opt_a)
        scaler.step(opt_b)
        scaler.update()
        seen.append((scaler.step_skipped(opt_a), scaler.step_skipped(opt_b)))
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert seen == [(False, False), (False, True), (True, False), (False, False)]


def test_an_optimizer_gone_is_forgotten_and_never_mistaken_for_a_new_one() -> None:
    """The scaler does not keep a stepped optimizer alive, and an optimizer made after one
    that is gone (which may get its ``id``) has not stepped."""
    import gc
    import weakref

    model = _mlp()
    scaler = ampscaler.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler.scale(_loss(model, 0) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.step_skipped(opt)
    other = torch.optim.SGD(model.parameters(), lr=0.01)
    other.zero_grad()
    scaler.scale(_loss(model, 1)).backward()
    scaler.step(other)
    scaler.update()  # the last iteration (kept for its report) no longer holds `opt`
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None
    assert len(scaler._state.outcomes) == 1  # `other`'s only: the entry went with `opt`
    assert not scaler.step_skipped(other)
    for _ in range(20):  # new optimizers of the same size: ids of freed ones come back
        fresh = torch.optim.SGD(model.parameters(), lr=0.01)
        with pytest.raises(RuntimeError, match="has not stepped"):
            scaler.step_skipped(fresh)
        del fresh


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "skipped"])
def test_the_scaler_does_not_keep_a_losss_autograd_graph_alive(fused: bool, overflow: bool) -> None:
    """The losses kept for the skip's cause are let go of at ``update()`` (dropped where the
    iteration was clean, detached otherwise): once the loop drops its loss, the graph behind
    it (here a node holding a marker object) is gone, though the scaler keeps the last
    iteration for its report, which still names the cause."""
    import gc
    import weakref

    class Marker:
        pass

    class Tagged(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, marker: Marker) -> torch.Tensor:
            ctx.marker = marker
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = ampscaler.GradScaler("cpu")
    marker = Marker()
    held = weakref.ref(marker)
    loss = Tagged.apply(_loss(model, 0) * (float("inf") if overflow else 1.0), marker)
    del marker
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    del loss
    gc.collect()
    assert held() is None
    assert scaler.last_step_skipped is overflow
    if overflow:
        report = scaler.last_overflow
        assert report is not None and report.cause == "loss"


def test_a_loss_whose_backward_failed_is_not_kept_alive_and_the_retry_steps_as_torchs() -> None:
    """A trainer that runs out of memory in the backward drops its loss, frees memory and runs
    the batch again (ultralytics, Accelerate's ``find_executable_batch_size``): the scaler must
    not hold the failed graph (the activations its backward did not free) until ``update()``,
    as torch's holds none. The retry then steps and moves the scale as torch's scaler does."""
    import gc
    import weakref

    class Marker:
        pass

    class FailsOnce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, marker: Marker | None) -> torch.Tensor:
            ctx.marker = marker
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            if ctx.marker is not None:
                raise RuntimeError("CUDA out of memory (simulated)")
            return grad, None

    ours, theirs = ampscaler.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    models = [_mlp(), _mlp()]
    for model, scaler in zip(models, (ours, theirs), strict=True):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        marker = Marker()
        held = weakref.ref(marker)
        loss = FailsOnce.apply(_loss(model, 0), marker)
        del marker
        with pytest.raises(RuntimeError, match="out of memory"):
            scaler.scale(loss).backward()
        del loss
        gc.collect()
        assert held() is None, type(scaler)
        opt.zero_grad()
        scaler.scale(FailsOnce.apply(_loss(model, 0), None)).backward()
        scaler.step(opt)
        scaler.update()
    assert ours.get_scale() == theirs.get_scale()
    for mine, torchs in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(mine, torchs)


def test_a_long_accumulation_still_refuses_a_load_in_the_middle() -> None:
    """Past sixteen ``scale()`` calls the kept losses are summed into one (the seventeenth
    call leaves nothing but the sum); the iteration still knows that a loss with a graph was
    scaled, so ``load_state_dict`` in the middle of the accumulation is refused as after one
    micro-batch."""
    scaler = ampscaler.GradScaler("cpu")
    model = _mlp()
    saved = scaler.state_dict()
    for batch in range(17):
        scaler.scale(_loss(model, batch)).backward()
    with pytest.raises(ampscaler.ScalerUsageError, match="middle of an iteration"):
        scaler.load_state_dict(saved)


# ---------------------------------------------------------------- the wrong precision


def test_scale_inside_a_bf16_autocast_region_warns_once() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    with pytest.warns(UserWarning, match="bfloat16 needs no loss scaling") as caught:
        for step in range(3):
            x, y = _batch(step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len([w for w in caught if "bfloat16" in str(w.message)]) == 1
    assert "enabled=False" in str(caught[0].message)


def test_all_bf16_gradients_warn_once_and_fp16_autocast_does_not() -> None:
    model = _mlp().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    with pytest.warns(UserWarning, match="every gradient of this optimizer is bfloat16") as caught:
        for step in range(3):
            x, y = _batch(step)
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len([w for w in caught if "bfloat16" in str(w.message)]) == 1

    fp16 = _mlp()
    opt = torch.optim.SGD(fp16.parameters(), lr=0.01)
    scaler = ampscaler.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = _loss(fp16, step)
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


# ---------------------------------------------------------------- early warning


def _train_for(steps: int, scaler: ampscaler.GradScaler, overflow: Callable[[int], bool]) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler.watch(model)
    for step in range(steps):
        loss = _loss(model, step % 64, times=1e-3)  # small: no overflow of its own at 2^16
        scaler.scale(loss).backward()
        if overflow(step):
            model[2].bias.grad.fill_(float("inf"))  # type: ignore[union-attr, index]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_a_scripted_collapse_fires_the_event_once_and_logs_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scaler = ampscaler.GradScaler("cpu")
    alerts: list[CollapseAlert] = []
    scaler.on("collapse", alerts.append)
    floor = pytest.warns(ampscaler.ScaleFloorWarning, match="at step 582 the scale is 2")
    with caplog.at_level(logging.WARNING, logger="ampscaler"), floor:
        # Healthy for 300 steps, then an overflow every other step, down to the scale's floor.
        _train_for(600, scaler, lambda step: step >= 300 and step % 2 == 0)
    assert [a.reasons for a in alerts[1:]] == [("floor",)]  # reaching the floor is news
    alert = alerts[0]  # the collapse: not again while it goes on
    assert (alert.first_step, alert.last_step) == (300, 399)
    assert alert.reasons == ("scale", "skip_rate") and alert.skip_rate == 0.5
    assert alert.causes == {"gradients": 50}
    assert alert.parameters == [("2.bias", 50)]
    warned = [r for r in caplog.records if r.name == "ampscaler"]
    assert len(warned) == 1
    message = warned[0].getMessage()
    assert "collapsing at steps 300-399" in message
    assert "50 gradients" in message and "2.bias (50)" in message


def test_the_scale_falling_far_below_its_maximum_is_a_collapse() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**-20, growth_interval=1)
    scaler.attach(CollapseWatch(scale_drop=2.0**-6, skip_rate=None, window=10))
    alerts: list[CollapseAlert] = []
    scaler.on("collapse", alerts.append)
    # Clean for 20 steps (the maximum is taken at steps 9 and 19), then 9 overflows in a row:
    # 2^0 -> 2^-9, and one growth.
    _train_for(30, scaler, lambda step: 20 <= step < 29)
    assert len(alerts) == 1
    (alert,) = alerts
    assert alert.reasons == ("scale",)
    assert (alert.max_scale, alert.scale) == (2.0**0, 2.0**-8)


def test_a_normal_run_of_2000_steps_raises_no_alarm(caplog: pytest.LogCaptureFixture) -> None:
    scaler = ampscaler.GradScaler("cpu")  # torch's defaults: growth every 2000 clean steps
    alerts: list[CollapseAlert] = []
    scaler.on("collapse", alerts.append)
    with caplog.at_level(logging.WARNING, logger="ampscaler"):
        # A few overflows, as a healthy run has.
        _train_for(2000, scaler, lambda step: step in (3, 700, 1500))
    assert alerts == []
    assert not [r for r in caplog.records if r.name == "ampscaler"]
    assert scaler.metrics("")["skips"] == 3


def test_bad_collapse_watch_arguments_are_named() -> None:
    for kwargs, argument in [
        ({"scale_drop": 1.5}, "scale_drop"),
        ({"skip_rate": 0.0}, "skip_rate"),
        ({"window": 5}, "window"),
        ({"log": "yes"}, "log"),
    ]:
        with pytest.raises(ValueError, match=f"^{argument} must"):
            CollapseWatch(**kwargs)


def test_collapse_callbacks_cost_no_sync_per_step() -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.on("collapse", lambda alert: None)
    assert not scaler._observers.consuming  # update() reads nothing on its account


# ---------------------------------------------------------------- readable logs


def test_the_summary_mode_logs_one_line_per_period(caplog: pytest.LogCaptureFixture) -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**15, growth_interval=100)
    sink = scaler.add_sink(LoggingSink("train.scaler", every=100))
    with caplog.at_level(logging.DEBUG, logger="train.scaler"):
        _train_for(250, scaler, lambda step: step == 120)
        sink.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "train.scaler"]
    assert lines == [
        "steps 0-99: 0 skipped (0.0%), scale 2^15 -> 2^16, normal",
        "steps 100-199: 1 skipped (1.0%), scale 2^16 -> 2^15, normal",
        "steps 200-249: 0 skipped (0.0%), scale 2^15 -> 2^16, normal",
    ]


def test_the_summary_mode_warns_on_frequent_skips_and_stays_quiet_off_rank_zero(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.add_sink(LoggingSink("train.scaler", every=20))
    with caplog.at_level(logging.DEBUG, logger="train.scaler"):
        _train_for(20, scaler, lambda step: step % 4 == 0)
    (record,) = [r for r in caplog.records if r.name == "train.scaler"]
    assert record.levelno == logging.WARNING and record.getMessage().endswith("frequent skips")

    caplog.clear()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    scaler = ampscaler.GradScaler("cpu")
    scaler.add_sink(LoggingSink("train.scaler", every=5))
    everywhere = scaler.add_sink(LoggingSink("train.all", every=5, all_ranks=True))
    with caplog.at_level(logging.DEBUG):
        _train_for(5, scaler, lambda step: False)
    assert [r.name for r in caplog.records if r.name.startswith("train.")] == ["train.all"]
    assert everywhere.every == 5


def test_bad_summary_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="^every must"):
        LoggingSink(every=0)
    with pytest.raises(ValueError, match="^warn_rate must"):
        LoggingSink(every=10, warn_rate=0.0)


def test_history_is_unaffected_by_guards_and_watches() -> None:
    scaler = ampscaler.GradScaler("cpu")
    history = scaler.add_sink(StepHistory(10))
    _train_for(3, scaler, lambda step: step == 1)
    assert [r.skipped for r in history.records] == [False, True, False]


# ---------------------------------------------------------------- guards in checkpoints


def test_a_resumed_guard_decides_as_the_uninterrupted_one() -> None:
    def run(resume_at: int | None) -> tuple[list[str | None], list[torch.Tensor]]:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
        scaler.attach(SpikeGuard(sigma=6.0, window=8))
        reasons = []
        for step in range(14):
            if step == resume_at:  # a new process: everything from the checkpoint
                saved = copy.deepcopy(
                    {"model": model.state_dict(), "opt": opt.state_dict(),
                     "scaler": scaler.state_dict()}
                )  # fmt: skip
                model = _mlp(seed=99)
                opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
                scaler = ampscaler.GradScaler("cpu")
                scaler.attach(SpikeGuard())
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                scaler.load_state_dict(saved["scaler"])
            scaler.scale(_loss(model, step)).backward()
            if step == 12:
                _spike_grads(model)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            reasons.append(skip_reason(scaler))
        return reasons, [p.detach().clone() for p in model.parameters()]

    whole, resumed = run(None), run(10)
    # Without its windows the resumed guard would still be warming up at step 12.
    assert whole[0] == resumed[0] == [None] * 12 + ["spike", None]
    assert _same(whole[1], resumed[1])


def test_guard_state_mismatches_are_reported() -> None:
    scaler = ampscaler.GradScaler("cpu")
    scaler.attach(SpikeGuard())
    saved = scaler.state_dict()
    bare = ampscaler.GradScaler("cpu")
    with pytest.warns(UserWarning, match="state of 1 guard"):
        bare.load_state_dict(saved)
    other = ampscaler.GradScaler("cpu")
    with pytest.raises(ampscaler.InvalidStateDictError, match="guards must be"):
        other.load_state_dict({**saved, "guards": "not json"})
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(saved)  # torch ignores the key
    assert torch_scaler.get_scale() == scaler.get_scale()
