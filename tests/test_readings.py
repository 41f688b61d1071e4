"""What the scaler reports is right where people read it: ``metrics()`` for any logger, the kind
of an overflow after clipping, and the bfloat16 warning in the README's own loop."""

from __future__ import annotations

import warnings

import pytest
import torch

import ampscaler

KEYS = (
    "scale", "skipped", "skip_cause", "steps", "skips", "replays", "growths", "backoffs",
    "spike_skips", "consecutive_skips", "flush_skips",
)  # fmt: skip


def _iteration(
    scaler: ampscaler.GradScaler, model: torch.nn.Module, opt: torch.optim.Optimizer, what: str
) -> None:
    opt.zero_grad()
    loss = model(torch.ones(4, 3)).square().mean()
    if what == "loss":
        loss = loss * float("inf")
    if what == "spike":
        loss = loss * 1e6
    scaler.scale(loss).backward()
    if what == "gradients":
        model.bias.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()


def test_metrics_are_plain_numbers_that_say_what_happened() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    scaler.attach(ampscaler.SpikeGuard(sigma=3.0, window=4, warmup=3))
    before = scaler.metrics()
    assert tuple(before) == tuple(f"scaler/{key}" for key in KEYS)
    assert before["scaler/scale"] == 256.0 and before["scaler/skipped"] == 0
    causes = []
    for what in ["ok", "ok", "ok", "ok", "gradients", "ok", "loss", "ok", "spike", "ok"]:
        _iteration(scaler, model, opt, what)
        metrics = scaler.metrics(prefix="")
        assert tuple(metrics) == KEYS
        assert type(metrics["scale"]) is float
        assert all(type(metrics[key]) is int for key in KEYS[1:])
        assert metrics["skipped"] == int(metrics["skip_cause"] > 0)
        causes.append(metrics["skip_cause"])
    assert causes == [0, 0, 0, 0, 1, 0, 2, 0, 3, 0]
    with pytest.warns(DeprecationWarning, match="stats"):  # the name metrics() replaces
        stats = scaler.stats
    assert metrics["steps"] == stats.steps == 10
    assert metrics["skips"] == stats.skipped == 2 and metrics["spike_skips"] == 1
    assert metrics["scale"] == scaler.get_scale()
    assert (metrics["growths"], metrics["backoffs"]) == (stats.growths, stats.backoffs)


def test_metrics_count_replays_and_cost_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_syncs import SyncCounter

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8)
    for attempt in scaler.attempts():
        _iteration(scaler, model, opt, "ok" if attempt.replay else "gradients")
    counter = SyncCounter(monkeypatch)
    with counter.counting():
        metrics = scaler.metrics()
    assert counter.count == 1
    assert metrics["scaler/replays"] == 1 and metrics["scaler/skipped"] == 0
    disabled = ampscaler.GradScaler("cpu", enabled=False).metrics(prefix="")
    assert disabled["scale"] == 1.0 and disabled["steps"] == 0


def test_an_inf_gradient_is_reported_as_inf_after_clipping() -> None:
    """The usual loop: unscale_, clip, step. Clipping by an infinite norm multiplies by 0, and
    inf * 0 is NaN: the report takes the kind when the check runs."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu")
    scaler.watch(model)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.bias.grad[0] = float("inf")
    model.weight.grad[1, 1] = float("nan")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert model.bias.grad.isnan().all()  # what the step would have seen
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert report is not None and report.kinds == {"weight": "nan", "bias": "inf"}
    assert scaler.metrics("")["skips"] == 1 and scaler.last_step_skipped


def test_the_bfloat16_warning_fires_once_in_the_readmes_loop() -> None:
    """The README's loop computes the loss under autocast and scales it outside, with float32
    gradients: the warning comes from the loss's graph, once."""
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ampscaler.GradScaler("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(
                    model(torch.randn(32, 16)).float(), torch.randn(32, 1)
                )
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    messages = [str(w.message) for w in caught if "bfloat16" in str(w.message)]
    assert len(messages) == 1 and "the loss was computed in bfloat16" in messages[0]
    assert caught[0].filename == __file__  # points at the user's scale() call


def test_float16_loops_do_not_warn() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscaler.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 16)).float().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
