"""Overflow localization, the non-finite tracer and the underflow/headroom probe."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import pytest
import torch

import ampscaler
from ampscaler import GradScaler
from ampscaler.observe import localize
from ampscaler.observe.localize import LOSS_ORIGIN, NonFiniteTracer
from ampscaler.observe.probe import UnderflowCounts
from training_loop import Net, run_loop
from twins import observed

INF, NAN = float("inf"), float("nan")


def _optimizer(model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    if fused:
        return torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_injected_inf_and_nan_are_named_exactly(fused: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = _optimizer(model, fused)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    scaler.watch(model)
    poison = {
        1: {"body.2.weight": INF, "head.bias": NAN},
        3: {"body.0.bias": -INF},
    }
    reports: dict[int, Any] = {}
    scales: dict[int, float] = {}

    def look(i: int) -> None:
        reports[i] = scaler.last_overflow
        scales[i] = scaler.get_scale()

    run_loop(scaler, model, optimizer, steps=5, poison=poison, after_update=look)

    assert [i for i, r in reports.items() if r is not None] == [1, 3]
    first, second = reports[1], reports[3]
    assert first.names == ["body.2.weight", "head.bias"]  # parameter order
    assert first.kinds == {"body.2.weight": "inf", "head.bias": "nan"}
    assert (first.step, first.scale) == (1, 1024.0)
    assert second.names == ["body.0.bias"] and second.kinds == {"body.0.bias": "inf"}
    assert (second.step, second.scale) == (3, 512.0)
    assert "body.2.weight (inf), head.bias (nan)" in str(first)


def test_a_gradient_with_both_inf_and_nan_is_kind_inf_plus_nan() -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.watch(model)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    assert model.weight.grad is not None
    model.weight.grad[0, :2] = torch.tensor([INF, NAN])
    assert scaler.step(optimizer) is None
    report = scaler.last_overflow
    assert report is not None and report.kinds == {"weight": "inf+nan"}


def test_unwatched_parameters_are_named_by_position_and_prefixes_keep_models_apart() -> None:
    encoder, decoder = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(
        [{"params": encoder.parameters()}, {"params": decoder.parameters()}], lr=0.1
    )
    scaler = GradScaler("cpu")
    scaler.scale(decoder(encoder(torch.ones(1, 2))).sum()).backward()
    assert decoder.bias.grad is not None and encoder.weight.grad is not None
    decoder.bias.grad[0] = INF
    encoder.weight.grad[0, 0] = NAN
    scaler.step(optimizer)
    unnamed = scaler.last_overflow
    assert unnamed is not None and unnamed.names == ["group0.param0", "group1.param1"]
    scaler.update()
    renamed = GradScaler("cpu")
    renamed.watch(encoder=encoder, decoder=decoder)
    report = localize.locate_overflow([optimizer], renamed._observers.names, step=0)
    assert report.kinds == {"encoder.weight": "nan", "decoder.bias": "inf"}


def test_sparse_and_empty_gradients_are_localized() -> None:
    embed = torch.nn.Embedding(10, 4, sparse=True)
    empty = torch.nn.Parameter(torch.zeros(0))
    optimizer = torch.optim.SGD([*embed.parameters(), empty], lr=0.1)
    names = localize.ParamNames()
    names.watch(embed, prefix="embed")
    embed(torch.tensor([1, 2])).sum().backward()
    empty.grad = torch.zeros(0)
    assert embed.weight.grad is not None
    embed.weight.grad._values()[1, 3] = -INF
    report = localize.locate_overflow([optimizer], names, step=4, scale=2.0)
    assert report.names == ["embed.weight"] and report.kinds == {"embed.weight": "inf"}
    assert (report.step, report.scale, report.rank) == (4, 2.0, None)


@pytest.fixture
def localizations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every localization pass ("locate") and tracer judgement ("origin"), in order."""
    calls: list[str] = []
    locate, origin = localize.locate_overflow, NonFiniteTracer.origin

    def counting_locate(*args: Any, **kwargs: Any) -> Any:
        calls.append("locate")
        return locate(*args, **kwargs)

    def counting_origin(events: Any) -> Any:
        calls.append("origin")
        return origin(events)

    monkeypatch.setattr(localize, "locate_overflow", counting_locate)
    monkeypatch.setattr(NonFiniteTracer, "origin", staticmethod(counting_origin))
    return calls


def test_clean_steps_run_no_localization(localizations: list[str]) -> None:
    """Counted: with history, sinks, callbacks, probe and tracer on, on plain and fused
    optimizers, reading last_overflow every iteration; only skipped steps localize."""
    calls = localizations
    torch.manual_seed(0)
    model = Net()
    plain = torch.optim.SGD(model.body.parameters(), lr=1e-3)
    fused = torch.optim.Adam(model.head.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler("cpu", init_scale=256.0)
    history = scaler.add_sink(ampscaler.StepHistory(8))
    observed(scaler, probe_every=2, trace=True)
    scaler.watch(model)
    scaler.add_sink(ampscaler.LoggingSink("test.clean"))
    scaler.on("step", lambda record: None)
    seen = []
    generator = torch.Generator().manual_seed(0)
    for i in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=generator)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i == 5:
            assert model.body[0].bias.grad is not None and model.head.weight.grad is not None
            model.body[0].bias.grad[0] = INF
            model.head.weight.grad[0, 0] = NAN
        scaler.step(plain)
        scaler.step(fused)
        scaler.update()
        seen.append(scaler.last_overflow)
        plain.zero_grad()
        fused.zero_grad()
        if i < 5:
            assert calls == [], f"clean iteration {i} ran {calls}"
    assert seen[:5] == [None] * 5
    assert calls.count("locate") == 2  # the plain optimizer in step(), the fused one at update()
    report = seen[5]
    assert report is not None and report.kinds == {"body.0.bias": "inf", "head.weight": "nan"}
    assert history.records[-1].overflow == report
    assert scaler.last_overflow is report  # cached: no further pass
    assert calls.count("locate") == 2


def test_fused_overflow_is_localized_lazily_when_nothing_consumes_records(
    localizations: list[str],
) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler = GradScaler("cpu")
    scaler.watch(model)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert model.weight.grad is not None
    model.weight.grad[0, 1] = INF
    scaler.step(optimizer)
    scaler.update()
    assert localizations == []  # nothing asked yet
    report = scaler.last_overflow
    assert report is not None and report.names == ["weight"] and report.step == 0
    assert localizations == ["locate"]
    optimizer.zero_grad()
    assert scaler.last_overflow is report


def test_a_report_read_after_zero_grad_says_the_gradients_were_gone() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(1, 2)).sum() * INF).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    report = scaler.last_overflow
    assert report is not None and report.names == []
    assert "no gradient held inf/NaN any more" in str(report)


def _blowup_model() -> torch.nn.Sequential:
    """a -> ReLU(inplace) -> b -> c, weighted so that at scale 1024 only b's backward
    overflows fp16: its input gradient is 512 * 100 * 4 > 65504, while c's weight gradient
    (512 * 40 * 2) and b's own gradients stay finite."""
    model = torch.nn.Sequential(
        OrderedDict(
            a=torch.nn.Linear(4, 4),
            relu=torch.nn.ReLU(inplace=True),
            b=torch.nn.Linear(4, 4),
            c=torch.nn.Linear(4, 1),
        )
    )
    with torch.no_grad():
        settings = ((model.a, 0.0, 0.1), (model.b, 100.0, 0.0), (model.c, 1.0, 0.0))
        for layer, weight, bias in settings:
            layer.weight.fill_(weight)
            layer.bias.fill_(bias)
    return model


@pytest.mark.parametrize("loss_factor", [1.0, INF], ids=["layer", "loss"])
def test_tracer_finds_the_module_whose_backward_overflowed(loss_factor: float) -> None:
    model = _blowup_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = observed(GradScaler("cpu", init_scale=1024.0), trace=True)
    scaler.watch(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(2, 4))
    scaler.scale(out.float().mean() * loss_factor).backward()
    assert scaler.step(optimizer) is None
    report = scaler.last_overflow
    assert report is not None
    if loss_factor == 1.0:
        assert report.names == ["a.weight", "a.bias"]
        assert report.origin == "b"
        assert "first non-finite in the backward of b;" in str(report)
    else:
        assert report.origin == LOSS_ORIGIN


def test_tracer_blames_no_module_for_values_written_after_backward() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = observed(GradScaler("cpu"), trace=True)
    scaler.watch(model)
    run_loop(scaler, model, optimizer, steps=1, poison={0: {"head.weight": INF}})
    report = scaler.last_overflow
    assert report is not None and report.names == ["head.weight"] and report.origin is None


def _hooked_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if m._forward_hooks]


def test_without_probe_or_tracer_nothing_is_hooked() -> None:
    model = Net()
    scaler = observed(GradScaler("cpu"), history=4)
    scaler.watch(model)
    run_loop(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    assert _hooked_modules(model) == []
    assert all(not p._backward_hooks for p in model.parameters())


def test_probe_hooks_exist_only_during_probed_iterations() -> None:
    model = Net()
    scaler = GradScaler("cpu")
    history = scaler.add_sink(ampscaler.StepHistory(10))
    observed(scaler, probe_every=3)
    scaler.watch(model)
    hooked: dict[int, list[str]] = {}
    run_loop(
        scaler,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        steps=7,
        after_update=lambda i: hooked.__setitem__(i + 1, _hooked_modules(model)),
    )
    assert [r.step for r in history.records if r.probe is not None] == [0, 3, 6]
    leaves = ["body.0", "body.1", "body.2", "head"]
    assert {i: h for i, h in hooked.items() if h} == {3: leaves, 6: leaves}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_probe_measures_underflow_and_headroom(fused: bool) -> None:
    model = torch.nn.Linear(4, 1, bias=False)
    optimizer = _optimizer(model, fused)
    scaler = GradScaler("cpu", init_scale=1024.0)
    history = scaler.add_sink(ampscaler.StepHistory(1))
    observed(scaler, probe_every=1)
    scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    # At scale 1024: 1e-9 flushes to zero in fp16 (<= 2**-25); divided by 1024, 1e-5 does too.
    model.weight.grad = torch.tensor([[0.0, 1e-9, 1e-5, 1.0]])
    scaler.step(optimizer)
    scaler.update()
    probe = history.records[-1].probe
    assert probe is not None
    assert (probe.elements, probe.nonzero, probe.scale) == (4, 3, 1024.0)
    assert probe.underflow_at_scale == pytest.approx(1 / 3)
    assert probe.underflow_at_one == pytest.approx(2 / 3)
    assert probe.headroom_log2 == pytest.approx(math.log2(65504.0))


def test_probe_reports_the_share_of_zero_and_subnormal_fp16_gradients_per_module() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=1.0)
    history = scaler.add_sink(ampscaler.StepHistory(1))
    observed(scaler, probe_every=1)
    scaler.watch(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(1, 4))
    # The gradient arriving at the last layer's fp16 output: 0, a subnormal, 1, 2.
    weights = torch.tensor([[0.0, 1e-6, 1.0, 2.0]])
    scaler.scale((out.float() * weights).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    probe = history.records[-1].probe
    assert probe is not None and probe.modules["1"] == 0.5
    assert set(probe.modules) == {"0", "1"}
    assert list(probe.modules.values()) == sorted(probe.modules.values(), reverse=True)


def test_probe_headroom_is_negative_infinity_on_overflow_and_results_round_trip() -> None:
    model = torch.nn.Linear(2, 1)
    scaler = GradScaler("cpu")
    history = scaler.add_sink(ampscaler.StepHistory(1))
    observed(scaler, probe_every=1)
    scaler.scale(model(torch.ones(1, 2)).sum() * INF).backward()
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler.update()
    record = history.records[-1]
    assert record.skipped and record.probe is not None
    assert record.probe.headroom_log2 == -INF
    assert ampscaler.StepRecord.from_dict(record.as_dict()) == record


def test_probe_held_against_an_fp32_reference_leaves_out_elements_without_signal() -> None:
    """Behind a ReLU, half of the first layer's output gradient is exactly zero in fp32 too:
    with a reference those elements carry no signal; without one they look flushed."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]))
        model[0].bias.zero_()
        model[2].weight.fill_(1e-3)  # a normal fp16 number
    probe = ampscaler.GradientProbe(every=1, worst_modules=None)
    probe.watch(model)

    def backward(fp16: bool) -> None:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            out = model(torch.ones(1, 2))
        out.float().sum().backward()

    with probe.reference():
        backward(fp16=False)
    backward(fp16=True)
    first = probe.end_iteration()
    backward(fp16=True)
    second = probe.end_iteration()
    assert first is not None and second is not None
    assert first.read(1.0).module_counts["0"] == UnderflowCounts(2, underflowed=0, flushed=0)
    assert second.read(1.0).module_counts["0"] == UnderflowCounts(4, underflowed=2, flushed=2)
    model(torch.ones(1, 2)).sum().backward()
    fp32 = probe.end_iteration()  # an fp32 gradient is its own reference
    assert fp32 is not None and fp32.read(1.0).module_counts["0"].carrying_signal == 2
    probe.detach()
    assert _hooked_modules(model) == []


def test_a_disabled_scaler_takes_a_probe_and_tracer_but_hooks_nothing() -> None:
    model = Net()
    scaler = GradScaler("cpu", enabled=False)
    scaler.watch(model)
    scaler.attach(ampscaler.GradientProbe())
    scaler.attach(ampscaler.NonFiniteTracer())
    scaler.watch(head=model.head)
    assert _hooked_modules(model) == []
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_probe_attached_after_watch_taps_the_watched_models() -> None:
    model = Net()
    scaler = GradScaler("cpu")
    history = scaler.add_sink(ampscaler.StepHistory(3))
    scaler.watch(model)
    scaler.attach(ampscaler.GradientProbe(every=2))
    assert _hooked_modules(model) == ["body.0", "body.1", "body.2", "head"]
    run_loop(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    assert [r.probe is not None and bool(r.probe.modules) for r in history.records] == [
        True,
        False,
        True,
    ]
