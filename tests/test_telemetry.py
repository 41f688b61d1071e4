"""Step records, history, events and sinks; and that none of it costs a sync by default."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ampscaler
from ampscaler import GradScaler, InvalidConfigError, JsonlSink, SinkError, StepRecord
from training_loop import Net, run_loop
from twins import assert_same_trace, make_script, observed, run_twin

INF, NAN = float("inf"), float("nan")
POISON = {2: {"head.weight": INF}, 3: {"body.0.bias": NAN}, 7: {"body.2.weight": INF}}


def _train(
    scaler: Any, steps: int = 10, poison: dict[int, dict[str, float]] | None = None, **kwargs: Any
) -> Net:
    torch.manual_seed(0)
    model = Net()
    if isinstance(scaler, GradScaler):
        scaler.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    run_loop(scaler, model, optimizer, steps, POISON if poison is None else poison, **kwargs)
    return model


def test_history_is_bounded_and_agrees_with_torch_side_by_side() -> None:
    ours = observed(GradScaler("cpu", init_scale=1024.0, growth_interval=2), history=6)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scales = [1024.0]
    _train(theirs, after_update=lambda i: scales.append(theirs.get_scale()))
    _train(ours)
    history = ours.history
    assert [r.step for r in history] == [4, 5, 6, 7, 8, 9]
    assert [r.scale for r in history] == scales[4:10]
    assert [r.new_scale for r in history] == scales[5:11]
    assert [r.skipped for r in history] == [i in POISON for i in range(4, 10)]
    assert history[3].overflow is not None and history[3].overflow.names == ["body.2.weight"]
    assert all(r.overflow is None for r in history if not r.skipped)


def test_events_fire_once_per_matching_iteration_and_can_be_removed() -> None:
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    fired: dict[str, list[int]] = {event: [] for event in ("step", "overflow", "backoff", "growth")}
    removers = [
        scaler.on(event, lambda record, event=event: fired[event].append(record.step))
        for event in fired
    ]
    _train(scaler)
    stats = scaler.stats
    assert fired["step"] == list(range(10))
    assert fired["overflow"] == sorted(POISON)
    assert len(fired["backoff"]) == stats.backoffs == 3
    assert len(fired["growth"]) == stats.growths > 0
    for remove in removers:
        remove()
    before = {event: len(steps) for event, steps in fired.items()}
    _train(scaler, steps=2)
    assert {event: len(steps) for event, steps in fired.items()} == before


def test_sinks_are_served_before_callbacks_each_in_the_order_added() -> None:
    """docs/diagnostics.md: sinks in the order they were added, then callbacks in theirs,
    whatever order the two kinds were added in."""
    scaler = GradScaler("cpu")
    served: list[str] = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def write(self, record: StepRecord) -> None:
            served.append(self.name)

    scaler.on("step", lambda record: served.append("callback 1"))
    scaler.attach(Named("sink 1"))
    scaler.on("step", lambda record: served.append("callback 2"))
    scaler.attach(Named("sink 2"))
    _train(scaler, steps=1)
    assert served == ["sink 1", "sink 2", "callback 1", "callback 2"]


def _count_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every Python-level read of a tensor's value (the host syncs of CPU code)."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: Any, _real: Any = real, _name: str = name) -> Any:
            reads.append(_name)
            return _real(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return reads


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_update_reads_nothing_from_the_device_unless_records_are_consumed(
    monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=1e-3)
    )
    scaler = GradScaler("cpu", growth_interval=2)
    scaler.watch(model)
    reads = _count_syncs(monkeypatch)
    per_update: list[int] = []
    real_update = scaler.update

    def counted_update() -> None:
        before = len(reads)
        real_update()
        per_update.append(len(reads) - before)

    monkeypatch.setattr(scaler, "update", counted_update)
    run_loop(scaler, model, optimizer, steps=4, poison={1: {"head.bias": INF}})
    assert per_update == [0, 0, 0, 0]
    scaler.add_sink(ampscaler.LoggingSink("test.syncs"))
    run_loop(scaler, model, optimizer, steps=3)
    assert per_update[4:] == [1, 1, 1]  # one read of the packed outcome per update


def test_jsonl_log_holds_exactly_the_history(tmp_path: Path) -> None:
    scaler = observed(GradScaler("cpu", growth_interval=3), history=100, probe_every=4)
    path = tmp_path / "logs" / "steps.jsonl"
    with scaler.add_sink(JsonlSink(path)):
        _train(scaler)
    lines = path.read_text().splitlines()
    assert len(lines) == 10
    records = ampscaler.read_log(path)
    assert records == scaler.history
    assert [r.probe is not None for r in records] == [i % 4 == 0 for i in range(10)]
    assert records[3].overflow is not None and records[3].overflow.kinds == {"body.0.bias": "nan"}


def test_jsonl_sink_reports_an_unwritable_path_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SinkError, match="a-file") as caught:
        JsonlSink(blocker / "steps.jsonl")
    assert isinstance(caught.value, OSError)


def test_tensorboard_event_file_holds_the_scale_series(tmp_path: Path) -> None:
    scaler = observed(GradScaler("cpu", growth_interval=2), history=100, probe_every=5)
    sink = scaler.add_sink(ampscaler.TensorBoardSink(tmp_path / "tb"))
    _train(scaler)
    sink.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scale = [(e.step, e.value) for e in events.Scalars("ampscaler/scale")]
    assert scale == [(r.step, r.scale) for r in scaler.history]
    skipped = [e.step for e in events.Scalars("ampscaler/skipped") if e.value == 1.0]
    assert skipped == sorted(POISON)
    assert [e.step for e in events.Scalars("ampscaler/probe/underflow_at_one")] == [0, 5]
    assert "ampscaler/overflow/text_summary" in events.Tags()["tensors"]


def test_logging_sink_warns_on_skips_and_informs_on_scale_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scaler = GradScaler("cpu", growth_interval=2)
    scaler.add_sink(ampscaler.LoggingSink("test.scaler"))
    with caplog.at_level(logging.DEBUG, logger="test.scaler"):
        _train(scaler, steps=4)
    levels = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [
        ("DEBUG", "step 0"),
        ("INFO", "step 1"),  # grew
        ("WARNING", "step 2"),
        ("WARNING", "step 3"),
    ]
    assert "head.weight (inf)" in caplog.records[2].getMessage()


@pytest.mark.parametrize("seed", [4, 6])  # fused Adam / plain SGD, both with overflows
def test_records_and_probe_do_not_change_results(seed: int, tmp_path: Path) -> None:
    def watched(device: str, **kwargs: Any) -> GradScaler:
        scaler = observed(GradScaler(device, **kwargs), history=4, probe_every=2)
        scaler.add_sink(JsonlSink(tmp_path / f"{id(scaler)}.jsonl"))
        scaler.on("step", lambda record: None)
        return scaler

    script = make_script(seed)
    assert_same_trace(run_twin(script, watched), run_twin(script, torch.amp.GradScaler))


def test_watched_models_train_bit_for_bit_as_with_torch() -> None:
    ours = observed(GradScaler("cpu", growth_interval=2), probe_every=3, trace=True, history=2)
    theirs = torch.amp.GradScaler("cpu", growth_interval=2)
    trained = [_train(ours), _train(theirs)]
    for mine, other in zip(*(m.parameters() for m in trained), strict=True):
        assert torch.equal(mine, other)
    assert ours.get_scale() == theirs.get_scale()


def test_copies_keep_the_history_but_not_sinks_or_callbacks(tmp_path: Path) -> None:
    scaler = observed(GradScaler("cpu"), history=3, probe_every=2)
    path = tmp_path / "steps.jsonl"
    sink = scaler.add_sink(JsonlSink(path))
    called: list[int] = []
    scaler.on("step", lambda record: called.append(record.step))
    _train(scaler, steps=4)
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert clone.history == scaler.history
        _train(clone, steps=1)
        assert len(clone.history) == 3 and clone.history[-1].step == 4
    sink.close()
    assert len(path.read_text().splitlines()) == 4 and called == [0, 1, 2, 3]


def test_counts_and_rates_take_numpy_and_tensor_numbers_as_torch_does() -> None:
    """Observers read their int options as torch reads numbers: numpy scalars and one-element
    tensors included."""
    import numpy as np

    assert ampscaler.StepHistory(np.int64(3)).maxlen == 3
    probe = ampscaler.GradientProbe(every=np.int64(2), worst_modules=torch.tensor(4))
    assert (probe.every, probe.worst_modules) == (2, 4) and type(probe.every) is int
    sink = ampscaler.LoggingSink(every=np.int32(5), warn_rate=np.float32(0.5))
    assert (sink.every, sink.warn_rate) == (5, 0.5)
    watch = ampscaler.CollapseWatch(scale_drop=np.float32(0.25), window=np.int64(20))
    assert watch.window == 20 and type(watch.window) is int


def test_bad_options_and_calls_are_clear_errors() -> None:
    with pytest.raises(InvalidConfigError, match="maxlen"):
        ampscaler.StepHistory(-1)
    with pytest.raises(InvalidConfigError, match="every"):
        ampscaler.GradientProbe(every=0)
    for removed in ("history_size", "probe_every", "trace_nonfinite", "dynamic"):
        with pytest.raises(TypeError, match=removed):  # replaced by the objects above
            GradScaler("cpu", **{removed: 1})
    scaler = GradScaler("cpu")
    with pytest.raises(ValueError, match="'overflow', 'backoff', 'growth'"):
        scaler.on("explosion", print)
    with pytest.raises(TypeError, match="callable"):
        scaler.on("step", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="write"):
        scaler.add_sink(object())  # type: ignore[type-var]
    with pytest.raises(ValueError, match="not attached"):
        scaler.remove_sink(ampscaler.LoggingSink())


def test_a_disabled_scaler_records_nothing_and_hooks_nothing() -> None:
    scaler = observed(GradScaler("cpu", enabled=False), history=5, probe_every=1, trace=True)
    model = _train(scaler, steps=2, poison={})
    assert scaler.history == [] and scaler.last_overflow is None
    assert not any(m._forward_hooks for m in model.modules())


def test_record_text_and_dict_round_trip() -> None:
    report = ampscaler.OverflowReport(
        step=4, names=["w"], kinds={"w": "nan"}, scale=8.0, origin="fc"
    )
    record = StepRecord(step=4, scale=8.0, new_scale=4.0, skipped=True, time=1.5, overflow=report)
    assert str(record) == (
        "step 4: scale 8, backed off to 4; skipped (step 4: non-finite gradients at scale 8 in "
        "1 parameter(s): w (nan); first non-finite in the backward of fc)"
    )
    assert StepRecord.from_dict(record.as_dict()) == record


def test_record_text_says_how_the_scale_moved() -> None:
    def text(new_scale: float) -> str:
        return str(StepRecord(step=1, scale=4.0, new_scale=new_scale, skipped=False, time=0.0))

    assert text(8.0) == "step 1: scale 4, grew to 8"
    assert text(2.0) == "step 1: scale 4, backed off to 2"
    assert text(4.0) == "step 1: scale 4"


def test_a_step_history_attaches_like_any_sink_and_history_reads_it() -> None:
    scaler = GradScaler("cpu", growth_interval=2)
    history = scaler.add_sink(ampscaler.StepHistory(3))
    _train(scaler, steps=5)
    assert [r.step for r in history.records] == [2, 3, 4]
    assert scaler.history == history.records
    scaler.remove_sink(history)
    assert scaler.history == []
    with pytest.raises(InvalidConfigError, match="maxlen"):
        ampscaler.StepHistory(0)


def test_one_probe_and_one_tracer_attach_and_anything_else_is_refused() -> None:
    scaler = GradScaler("cpu")
    probe = scaler.attach(ampscaler.GradientProbe(every=2))
    tracer = scaler.attach(ampscaler.NonFiniteTracer())
    assert isinstance(probe, ampscaler.GradientProbe) and probe.every == 2
    assert isinstance(tracer, ampscaler.NonFiniteTracer)
    with pytest.raises(InvalidConfigError, match="already"):
        scaler.attach(ampscaler.GradientProbe())
    with pytest.raises(InvalidConfigError, match="already"):
        scaler.attach(ampscaler.NonFiniteTracer())
    sink = scaler.attach(ampscaler.LoggingSink())  # sinks attach too (issue 36: one verb)
    assert isinstance(sink, ampscaler.LoggingSink)
    with pytest.raises(InvalidConfigError, match="every"):
        ampscaler.GradientProbe(every=0)
    with pytest.raises(InvalidConfigError, match="worst_modules"):
        ampscaler.GradientProbe(worst_modules=0)


def test_attached_objects_do_what_the_keyword_shorthands_do() -> None:
    short = observed(GradScaler("cpu", growth_interval=3), history=100, probe_every=4)
    composed = GradScaler("cpu", growth_interval=3)
    composed.add_sink(ampscaler.StepHistory(100))
    composed.attach(ampscaler.GradientProbe(every=4))
    _train(short)
    _train(composed)
    assert [r.probe is not None for r in composed.history] == [i % 4 == 0 for i in range(10)]
    strip = [dataclasses.replace(r, time=0.0) for r in short.history]
    assert strip == [dataclasses.replace(r, time=0.0) for r in composed.history]


def test_logs_without_the_newer_fields_still_read(tmp_path: Path) -> None:
    old = (
        '{"format": "ampscaler.step/1", "step": 0, "time": 1.0, "scale": 8.0, "new_scale": 8.0, '
        '"skipped": false, "overflow": null, "probe": {"scale": 8.0, "elements": 4, '
        '"nonzero": 3, "underflow_at_scale": 0.0, "underflow_at_one": 0.5, '
        '"headroom_log2": "inf", "modules": {"fc": 0.25}}}\n'
    )
    path = tmp_path / "old.jsonl"
    path.write_text(old)
    (record,) = ampscaler.read_log(path)
    assert record.loss is None and record.lr is None
    assert record.probe is not None and record.probe.modules == {"fc": 0.25}
    assert record.probe.module_counts == {}


def test_a_labelled_record_round_trips_and_unknown_keys_are_ignored(tmp_path: Path) -> None:
    record = StepRecord(
        step=2, scale=4.0, new_scale=4.0, skipped=False, time=0.0, loss=0.5, label="fp16"
    )
    line = record.to_json_line()
    assert json.loads(line)["label"] == "fp16" and json.loads(line)["loss"] == 0.5
    path = tmp_path / "steps.jsonl"
    path.write_text(line + "\n" + json.dumps({**json.loads(line), "note": "mine"}) + "\n")
    assert ampscaler.read_log(path) == [record, record]
    unlabelled = StepRecord(step=2, scale=4.0, new_scale=4.0, skipped=False, time=0.0)
    assert "label" not in json.loads(unlabelled.to_json_line())


def test_a_probe_and_a_tracer_are_hooks_that_detach_like_any_other() -> None:
    """The probe and the tracer plug in as hooks of their own (issue 36): ``detach()`` takes
    them out again, and the records stop carrying their results."""
    scaler = GradScaler("cpu", init_scale=1024.0)
    history = scaler.attach(ampscaler.StepHistory(10))
    probe = scaler.attach(ampscaler.GradientProbe(every=1))
    tracer = scaler.attach(ampscaler.NonFiniteTracer())
    assert isinstance(probe, ampscaler.Hook) and isinstance(tracer, ampscaler.Hook)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    scaler.watch(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def iteration(poisoned: bool) -> None:
        with torch.no_grad():
            model[1].weight.fill_(INF if poisoned else 1.0)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    iteration(False)
    iteration(True)
    assert [record.probe is not None for record in history.records] == [True, True]
    assert scaler.last_overflow is not None and scaler.last_overflow.origin == "1"
    scaler.detach(probe)
    scaler.detach(tracer)
    iteration(False)
    iteration(True)
    assert [record.probe is not None for record in history.records] == [True, True, False, False]
    assert scaler.last_overflow is not None and scaler.last_overflow.origin is None


def test_a_hook_attached_after_watch_watches_the_models_watched_so_far() -> None:
    class Watching(ampscaler.Hook):
        def __init__(self) -> None:
            self.seen: list[tuple[torch.nn.Module, str]] = []

        def watch(self, model: torch.nn.Module, prefix: str = "") -> None:
            self.seen.append((model, prefix))

    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    scaler = GradScaler("cpu")
    scaler.watch(first)
    hook = scaler.attach(Watching())
    scaler.watch(head=second)
    assert hook.seen == [(first, ""), (second, "head")]
    disabled = GradScaler("cpu", enabled=False)
    quiet = disabled.attach(Watching())
    disabled.watch(first)
    assert quiet.seen == []  # a disabled scaler taps nothing
