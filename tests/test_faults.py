"""Faults a real run meets, each side by side with torch.amp.GradScaler.

A non-finite loss, NaN made inside the fp16 forward, an optimizer whose parameters have no
gradient, parameters added mid-training, gradients on two devices, and checkpoints of another
configuration.
"""

from __future__ import annotations

import pytest
import torch

import ampscaler

SCALERS = [ampscaler.GradScaler, torch.amp.GradScaler]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run(factory: type, losses: list[str], fused: bool = False) -> tuple[list, list[float]]:
    """Iterations whose loss is finite, inf or NaN (``"ok"``, ``"inf"``, ``"nan"``), or whose
    forward overflows in fp16 and turns into NaN (``"fp16"``)."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = factory("cpu", init_scale=2.0**12, growth_interval=2)
    params, scales = [], []
    for kind in losses:
        x = torch.full((2, 4), 3e4 if kind == "fp16" else 0.5)
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = model[1](model[0](x))
            if kind == "fp16":
                hidden = hidden * hidden  # beyond float16's 65504: inf
                assert torch.isinf(hidden).any()
                hidden = hidden - hidden  # inf - inf: NaN inside the fp16 forward
            out = model[2](hidden)
        loss = out.float().pow(2).mean()
        if kind in ("inf", "nan"):
            loss = loss * float(kind)
        before = _snapshot(model)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if kind != "ok":
            assert getattr(scaler, "last_step_skipped", True)
            assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model), strict=True))
        params.append(_snapshot(model))
        scales.append(scaler.get_scale())
    return params, scales


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_nonfinite_loss_and_nan_in_fp16_forward_are_skipped_as_in_torch(fused: bool) -> None:
    losses = ["ok", "inf", "ok", "nan", "fp16", "ok", "ok", "fp16"]
    ours = _run(ampscaler.GradScaler, losses, fused)
    theirs = _run(torch.amp.GradScaler, losses, fused)
    assert ours[1] == theirs[1] == [4096.0, 2048.0, 2048.0, 1024.0, 512.0, 512.0, 1024.0, 512.0]
    for mine, other in zip(ours[0], theirs[0], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, other, strict=True))


def _gradless_setup(factory: type, fused: bool) -> tuple[object, torch.optim.Optimizer]:
    frozen = torch.nn.Parameter(torch.zeros(3))
    scaler = factory("cpu")
    scaler.scale(torch.ones(()))
    return scaler, torch.optim.Adam([frozen], fused=fused)


@pytest.mark.parametrize("factory", SCALERS)
def test_optimizer_without_gradients_is_refused_at_step(factory: type) -> None:
    scaler, optimizer = _gradless_setup(factory, fused=False)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(optimizer)


@pytest.mark.parametrize("factory", SCALERS)
def test_fused_optimizer_without_gradients_is_refused_at_update(factory: type) -> None:
    """torch lets the fused step through (nothing to update) and refuses the update."""
    scaler, optimizer = _gradless_setup(factory, fused=True)
    scaler.step(optimizer)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


def test_usage_errors_are_runtime_errors_too() -> None:
    scaler, optimizer = _gradless_setup(ampscaler.GradScaler, fused=False)
    with pytest.raises(ampscaler.ScalerUsageError) as raised:
        scaler.step(optimizer)
    assert isinstance(raised.value, RuntimeError)


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_gradless_fused_optimizer_beside_a_working_one_matches_torch(fused: bool) -> None:
    results = []
    for factory in SCALERS:
        model = _model()
        idle = torch.nn.Parameter(torch.ones(2))
        busy = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        lazy = torch.optim.Adam([idle], lr=0.01, fused=True)
        scaler = factory("cpu", growth_interval=1)
        for _ in range(3):
            scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            scaler.step(busy)
            scaler.step(lazy)
            scaler.update()
            busy.zero_grad()
        results.append((scaler.get_scale(), _snapshot(model), idle.detach().clone()))
    (scale_a, params_a, idle_a), (scale_b, params_b, idle_b) = results
    assert scale_a == scale_b == 2.0**19
    assert torch.equal(idle_a, idle_b) and torch.equal(idle_a, torch.ones(2))
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_param_group_added_mid_training_is_checked_and_unscaled(fused: bool) -> None:
    traces = []
    for factory in SCALERS:
        model = _model()
        extra = torch.nn.Linear(4, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        scaler = factory("cpu", init_scale=2.0**10)
        trace = []
        for iteration in range(5):
            if iteration == 2:
                optimizer.add_param_group({"params": list(extra.parameters()), "lr": 0.1})
            x = torch.ones(2, 4)
            loss = model(x).sum() + (extra(x).sum() if iteration >= 2 else 0.0)
            scaler.scale(loss).backward()
            if iteration == 3:
                extra.bias.grad.fill_(float("nan"))  # only the new group overflows
            before = _snapshot(extra)
            scaler.step(optimizer)
            if iteration == 3:
                assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(extra), strict=True))
            scaler.update()
            optimizer.zero_grad()
            trace.append((scaler.get_scale(), _snapshot(model) + _snapshot(extra)))
        traces.append(trace)
    assert [s for s, _ in traces[0]] == [1024.0, 1024.0, 1024.0, 512.0, 512.0]
    for (scale_a, params_a), (scale_b, params_b) in zip(*traces, strict=True):
        assert scale_a == scale_b
        assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device beside the CPU")
def test_gradients_on_two_devices_match_torch() -> None:
    results = []
    for factory in SCALERS:
        torch.manual_seed(0)
        near, far = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1).cuda()
        optimizer = torch.optim.SGD([*near.parameters(), *far.parameters()], lr=0.1)
        scaler = factory("cuda", init_scale=2.0**10, growth_interval=2)
        for iteration in range(6):
            loss = far(near(torch.ones(2, 4)).cuda()).sum()
            scaler.scale(loss).backward()
            if iteration in (1, 4):
                (near.weight if iteration == 1 else far.bias).grad.view(-1)[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        params = [p.detach().cpu() for p in optimizer.param_groups[0]["params"]]
        results.append((scaler.get_scale(), params))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
