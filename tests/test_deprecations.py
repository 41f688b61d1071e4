"""Names folded into one way of doing each thing (issue 36) keep working for one release, with a
``DeprecationWarning`` that names the replacement."""

from __future__ import annotations

import pytest
import torch

import ampscaler


def _skipped_iteration(scaler: ampscaler.GradScaler) -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
    scaler.step(opt)
    scaler.update()


def test_stats_warns_and_gives_what_metrics_gives() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
    _skipped_iteration(scaler)
    with pytest.warns(DeprecationWarning, match=r"stats .*scaler\.metrics\(\)"):
        stats = scaler.stats
    metrics = scaler.metrics("")
    assert (stats.steps, stats.skipped, stats.backoffs) == (1, 1, 1)
    assert (metrics["steps"], metrics["skips"], metrics["backoffs"]) == (1, 1, 1)


def test_last_skip_reason_warns_and_still_tells_the_reason() -> None:
    scaler = ampscaler.GradScaler("cpu")
    _skipped_iteration(scaler)
    with pytest.warns(DeprecationWarning, match="last_step_skipped and scaler.last_overflow"):
        assert scaler.last_skip_reason == "nonfinite"
    assert scaler.last_step_skipped and scaler.last_overflow is not None


def test_add_guard_warns_and_attaches_the_guard() -> None:
    scaler = ampscaler.GradScaler("cpu")
    with pytest.warns(DeprecationWarning, match=r"scaler\.attach\(guard\)"):
        guard = scaler.add_guard(ampscaler.SpikeGuard(window=4))
    assert "guards" in scaler.state_dict() and scaler.state_dict()["guards"] != "[]"
    with pytest.raises(ValueError, match="already"):
        scaler.attach(guard)


def test_history_warns_and_gives_the_step_historys_records() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
    history = scaler.add_sink(ampscaler.StepHistory(10))
    _skipped_iteration(scaler)
    with pytest.warns(DeprecationWarning, match=r"StepHistory \(history\.records\)"):
        records = scaler.history
    assert records == history.records and records[-1].skipped


def test_attach_and_detach_take_hooks_and_guards() -> None:
    class Counting(ampscaler.Hook):
        def __init__(self) -> None:
            self.updates = 0

        def after_update(self, iteration: object, live: object, compiling: bool) -> None:
            self.updates += 1

    scaler = ampscaler.GradScaler("cpu")
    hook = scaler.attach(Counting())
    guard = scaler.attach(ampscaler.SpikeGuard(window=4))
    _skipped_iteration(scaler)
    scaler.detach(hook)
    scaler.detach(guard)
    _skipped_iteration(scaler)
    assert hook.updates == 1
    assert scaler.state_dict()["guards"] == "[]"
    with pytest.raises(ValueError, match="not attached"):
        scaler.detach(guard)
    with pytest.raises(TypeError, match="add_sink"):
        scaler.attach(object())  # type: ignore[type-var]


def test_add_sink_and_remove_sink_warn_and_still_attach_and_detach() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
    with pytest.warns(DeprecationWarning, match=r"add_sink.*scaler\.attach\(sink\)"):
        history = scaler.add_sink(ampscaler.StepHistory(10))
    _skipped_iteration(scaler)
    assert len(history.records) == 1
    with pytest.warns(DeprecationWarning, match=r"remove_sink.*scaler\.detach\(sink\)"):
        scaler.remove_sink(history)
    _skipped_iteration(scaler)
    assert len(history.records) == 1
    with pytest.raises(TypeError, match="write"), pytest.warns(DeprecationWarning):
        scaler.add_sink(object())  # type: ignore[type-var]


def test_attach_and_detach_take_sinks() -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=256.0)
    history = scaler.attach(ampscaler.StepHistory(10))
    _skipped_iteration(scaler)
    scaler.detach(history)
    _skipped_iteration(scaler)
    assert [record.skipped for record in history.records] == [True]
    with pytest.raises(ValueError, match="not attached"):
        scaler.detach(history)
