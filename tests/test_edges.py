"""The edges found by trying ampscaler from outside (issue 34): copies mid-iteration, failing
sinks, interrupted iterations, checkpoints loaded mid-iteration, and what errors say."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ampscaler
from ampscaler import GradScaler, StepHistory


def _model_and_opt() -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: torch.nn.Module, value: float = 1.0) -> torch.Tensor:
    return model(torch.full((2, 3), value)).pow(2).sum()


@pytest.mark.parametrize("after", ["scale", "backward"])
def test_deepcopy_mid_iteration_copies_as_torch_does(after: str) -> None:
    """Item 1: a copy taken after scale() (or backward()) steps on as torch's copy does."""
    results = []
    for make in (torch.amp.GradScaler, GradScaler):
        model, opt = _model_and_opt()
        scaler = make("cpu", init_scale=4.0, growth_interval=1)
        scaled = scaler.scale(_loss(model))
        if after == "backward":
            scaled.backward()
        twin = copy.deepcopy(scaler)
        if after == "scale":
            scaled.backward()
        twin.scale(_loss(model)).backward()  # the copy runs an iteration of its own
        twin.step(opt)
        twin.update()
        results.append((twin.get_scale(), twin.state_dict()["_growth_tracker"], model.weight))
    (torch_scale, torch_tracker, torch_weight), (scale, tracker, weight) = results
    assert (scale, tracker) == (torch_scale, torch_tracker)
    assert torch.equal(weight, torch_weight)


class _FullDisk:
    def write(self, record: ampscaler.StepRecord) -> None:
        raise OSError(28, "No space left on device")


def test_a_failing_sink_starves_no_other_and_is_reported_once() -> None:
    """Item 2: a sink that raises first; the history and callbacks after it are served."""
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu")
    broken = scaler.add_sink(_FullDisk())
    history = scaler.add_sink(StepHistory(10))
    calls: list[int] = []
    scaler.on("step", lambda record: calls.append(record.step))

    def failing_callback(record: ampscaler.StepRecord) -> None:
        raise KeyError("oops")

    scaler.on("step", failing_callback)
    after: list[int] = []
    scaler.on("step", lambda record: after.append(record.step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            scaler.scale(_loss(model)).backward()
            scaler.step(opt)
            scaler.update()
    assert [record.step for record in history.records] == [0, 1, 2]
    assert calls == after == [0, 1, 2]
    reported = [w for w in caught if issubclass(w.category, ampscaler.SinkWarning)]
    assert len(reported) == 2  # once per failing consumer
    assert repr(broken) in str(reported[0].message) and "No space left" in str(reported[0].message)
    assert "failing_callback" in str(reported[1].message)
    assert reported[0].filename == __file__  # points at the training loop's update()


def test_a_failing_sink_stops_training_when_asked() -> None:
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu")
    scaler.add_sink(_FullDisk())
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampscaler.SinkWarning)
        with pytest.raises(ampscaler.SinkWarning, match="No space left"):
            scaler.update()


def test_scale_after_unscale_is_refused_and_changes_nothing() -> None:
    """Item 4: an iteration interrupted after unscale_(): the next scale() refuses, instead of
    step() applying scaled gradients as if they were unscaled (as torch's scaler does)."""
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    unscaled = model.weight.grad.clone()
    # ... an exception the loop catches happens here; the next iteration begins:
    opt.zero_grad()
    loss = _loss(model)
    with pytest.raises(ampscaler.ScalerUsageError, match="after scaler.unscale_") as raised:
        scaler.scale(loss)
    assert isinstance(raised.value, RuntimeError)
    assert model.weight.grad is None
    # The way out the message names: end the interrupted iteration with update().
    scaler.update()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(model.weight).all() and scaler.get_scale() == 1024.0
    assert unscaled.abs().max() < 1e3  # the first gradients were unscaled (not at 1024x)


def test_scale_after_an_unscale_that_found_no_gradient_goes_on_as_torchs() -> None:
    """An optimizer whose ``unscale_()`` found no gradient unscaled nothing: the next
    ``scale()`` has nothing to mix with and is taken (a loop that caught ``update()``'s "No inf
    checks" for it goes on, as nerfstudio's per-group stepping would); its ``step()`` then
    refuses as torch's does, since no check of it was recorded."""
    for factory in (torch.amp.GradScaler, GradScaler):
        model, opt = _model_and_opt()
        scaler = factory("cpu", init_scale=1024.0)
        scaler.scale(_loss(model).detach().requires_grad_()).backward()  # reaches no parameter
        scaler.unscale_(opt)
        with pytest.raises(AssertionError, match="No inf checks were recorded"):
            scaler.update()
        scaler.scale(_loss(model)).backward()
        with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
            scaler.step(opt)
        assert scaler.get_scale() == 1024.0, factory


def test_torch_applies_stale_unscaled_gradients_after_an_interruption() -> None:
    """What item 4 guards against, in torch's scaler: the next step applies scaled
    gradients (the reason ampscaler is stricter there)."""
    model, opt = _model_and_opt()
    before = model.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(_loss(model)).backward()
    scaler.unscale_(opt)
    opt.zero_grad()
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    honest = before - 0.1 * torch.func.grad(
        lambda w: torch.nn.functional.linear(torch.full((2, 3), 1.0), w, model.bias).pow(2).sum()
    )(before)
    assert not torch.allclose(model.weight, honest, rtol=0.1)  # off by the scale


def test_load_state_dict_mid_iteration_is_refused_and_changes_nothing() -> None:
    """Item 5: a state loaded between backward() and step() would unscale by the loaded
    scale."""
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu", init_scale=1024.0)
    saved = GradScaler("cpu", init_scale=8.0).state_dict()
    scaler.scale(_loss(model)).backward()
    with pytest.raises(ampscaler.ScalerUsageError, match="middle of an iteration"):
        scaler.load_state_dict(saved)
    assert scaler.get_scale() == 1024.0
    twin_model, twin_opt = _model_and_opt()
    twin = torch.amp.GradScaler("cpu", init_scale=1024.0)
    twin.scale(_loss(twin_model)).backward()
    for each, each_opt in ((scaler, opt), (twin, twin_opt)):
        each.step(each_opt)
        each.update()
    assert torch.equal(model.weight, twin_model.weight)
    scaler.load_state_dict(saved)  # after update(): loads
    assert scaler.get_scale() == 8.0


def test_step_history_too_long_is_a_config_error() -> None:
    with pytest.raises(ampscaler.InvalidConfigError, match="maxlen"):
        StepHistory(2**70)


def test_closed_jsonl_sink_names_itself(tmp_path: object) -> None:
    sink = ampscaler.JsonlSink(f"{tmp_path}/steps.jsonl")
    sink.close()
    record = ampscaler.StepRecord(3, 8.0, 8.0, skipped=False, time=0.0)
    with pytest.raises(ValueError, match=r"JsonlSink\(.*steps\.jsonl'\) was closed.*step 3"):
        sink.write(record)


def test_a_scale_that_returns_to_the_floor_warns_once() -> None:
    """Item 8: a run whose scale kept coming back to the floor warned at every return (679
    warnings in one run), where the docs promise one."""
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu", init_scale=2.0**-125, growth_interval=1)
    alerts: list[ampscaler.CollapseAlert] = []
    scaler.on("collapse", alerts.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # To the floor, a skip there, up again, and back: three stays at the floor.
        for value in [float("nan"), float("nan"), 1.0] * 3:
            scaler.scale(_loss(model, value)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    floor = [w for w in caught if issubclass(w.category, ampscaler.ScaleFloorWarning)]
    assert len(floor) == 1
    assert len([a for a in alerts if a.reasons == ("floor",)]) == 3  # every stay is told


def test_a_stats_dict_without_its_counters_is_refused() -> None:
    """Item 8: ``"stats": {}`` silently reset every counter."""
    model, opt = _model_and_opt()
    scaler = GradScaler("cpu")
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)
    scaler.update()
    saved = scaler.state_dict()
    for broken in ({}, {"steps": 1}):
        with pytest.raises(ampscaler.InvalidStateDictError, match="stats lacks"):
            scaler.load_state_dict({**saved, "stats": broken})
    assert scaler.metrics("")["steps"] == 1
    older = {**saved, "stats": {k: v for k, v in saved["stats"].items() if k != "replays"}}
    scaler.load_state_dict(older)  # a counter added later starts at 0
    assert scaler.metrics("")["steps"] == 1


def test_report_on_binary_garbage_says_it_is_not_a_log(tmp_path: object) -> None:
    """Item 8: a file of binary data was reported as "empty"."""
    garbage = f"{tmp_path}/garbage.jsonl"
    with open(garbage, "wb") as file:
        file.write(bytes(range(1, 10)) * 20)
    with pytest.raises(ampscaler.LogFormatError, match="not an ampscaler step log") as raised:
        ampscaler.read_log(garbage)
    assert "empty" not in str(raised.value)


def test_demo_progress_is_plain_lines_when_redirected(tmp_path: object) -> None:
    """Item 16: the progress bars filled a redirected log with carriage-return updates."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ampscaler", "demo", "--steps", "20", "--out", f"{tmp_path}/d"],
        capture_output=True,  # stderr is a pipe, not a terminal
        text=True,
        check=True,
        timeout=120,
    )
    assert "\r" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if ": step " in line]
    assert len(lines) == 3 * 10  # ten lines per arm
    assert lines[-1].startswith("fp16_ampscaler: step 20/20, loss ")


def test_a_skipped_demo_step_says_why() -> None:
    """Item 10: the demo's steps.jsonl had "overflow": null on all 10 skipped steps."""
    from ampscaler.demo.train import Arm, DemoConfig, train_arm

    arm = Arm(
        "fp16_ampscaler", fp16=True, scaler_factory=lambda: GradScaler("cpu", init_scale=2.0**60)
    )
    result = train_arm(arm, DemoConfig(steps=3, probe_every=None))
    skipped = [record for record in result.records if record.skipped]
    assert skipped  # 2**60 overflows fp16 at once
    for record in skipped:
        assert record.overflow is not None and record.overflow.cause == "gradients"
        assert record.overflow.names  # the parameters that held inf/NaN


def test_rl_example_says_it_needs_transformers() -> None:
    """Item 16: without transformers, examples/rl_fp16.py failed with ModuleNotFoundError deep
    inside torchrun's traceback."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "rl_fp16.py"
    hidden = "import sys, runpy; sys.modules['transformers'] = None; sys.argv = ['rl_fp16.py']\n"
    done = subprocess.run(
        [sys.executable, "-c", hidden + f"runpy.run_path({str(example)!r}, run_name='__main__')"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=example.parent,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        'examples/rl_fp16.py needs transformers: pip install -e ".[transformers]"'
    )


class _SqrtBetween(torch.nn.Module):
    """Two watched layers with a plain function between them (issue 34, item 9)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4, bias=False)
        self.fc2 = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sqrt((self.fc1(x) ** 2).sum(-1, keepdim=True)))


def test_tracer_names_the_module_a_nan_between_layers_reached() -> None:
    """Item 9: a NaN made by sqrt at 0 between fc1 and fc2 was blamed on "<loss>", while the
    loss was finite and the report said cause "gradients"."""
    torch.manual_seed(0)
    model = _SqrtBetween()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.attach(ampscaler.NonFiniteTracer())
    scaler.watch(model)
    x = torch.ones(2, 3)
    x[1] = 0.0  # an all-zero row: sqrt's gradient at 0 is inf, times 0 is NaN
    loss = model(x).sum()
    assert torch.isfinite(loss)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    report = scaler.last_overflow
    assert report is not None and report.cause == "gradients"
    assert report.origin == "fc1"


def test_charts_say_99_99_percent_and_list_layers_in_the_models_order() -> None:
    """Item 11: 99.99% printed as "100.0%"; the per-layer charts of two runs listed the same
    layers in different orders (each by its own worst first)."""
    from ampscaler.report import percent, shown_modules

    assert percent(0.9999) == "99.99%" and percent(0.99999) == "99.999%"
    assert percent(0.865) == "86.5%" and percent(1.0) == "100.0%"
    one_run = {"fc1": (0.0, 0.9), "fc2": (0.0, 0.1), "out": (0.0, 0.5)}
    other_run = {"fc1": (0.0, 0.1), "fc2": (0.0, 0.9), "out": (0.0, 0.5)}
    assert shown_modules(one_run) == shown_modules(other_run) == ["fc1", "fc2", "out"]
