"""Skip awareness: LR schedulers and weight averages advance only on steps that updated the model.

The documented pattern (GradScaler.last_step_skipped)::

    scaler.step(optimizer)
    scaler.update()
    if not scaler.last_step_skipped:
        scheduler.step()
        ema.update_parameters(model)

A run whose poisoned iterations are skipped must end exactly where a run that never saw those
iterations ends: same parameters, same learning rate, same EMA. Scales are powers of two, so
unscaling is exact and the two runs can be compared bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ampscaler

LR_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
ITERATIONS = 10


def _inputs(iteration: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(iteration))


def _train(
    iterations: list[int], poisoned: set[int], fused: bool, skip_aware: bool = True
) -> tuple[torch.nn.Module, AveragedModel, torch.optim.Optimizer, ampscaler.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if fused:
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    for iteration in iterations:
        loss = model(_inputs(iteration)).pow(2).mean()
        scaler.scale(loss).backward()
        if iteration in poisoned:
            model.weight.grad[0, 0] = float("nan") if iteration % 2 else float("inf")
        scaler.step(optimizer)
        scaler.update()
        if not skip_aware or not scaler.last_step_skipped:
            scheduler.step()
            ema.update_parameters(model)
        optimizer.zero_grad()
    return model, ema, optimizer, scaler


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_skipped_steps_leave_schedule_and_ema_where_they_were(fused: bool) -> None:
    poisoned = {0, 3, 4, 8}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ema, optimizer, scaler = _train(list(range(ITERATIONS)), poisoned, fused)
    clean = [i for i in range(ITERATIONS) if i not in poisoned]
    ref_model, ref_ema, ref_optimizer, _ = _train(clean, set(), fused)

    assert not [w for w in caught if LR_WARNING in str(w.message)]
    assert scaler.metrics("")["skips"] == len(poisoned)
    assert ema.n_averaged.item() == len(clean)
    assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    for mine, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(mine, ref)
    for mine, ref in zip(ema.parameters(), ref_ema.parameters(), strict=True):
        assert torch.equal(mine, ref)
    if fused:
        for mine, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(optimizer.state[mine]["step"], ref_optimizer.state[ref]["step"])


def test_stepping_the_scheduler_on_a_skipped_first_step_warns_as_in_torch() -> None:
    """The control: without the pattern, torch's warning appears and the schedule runs ahead."""
    with pytest.warns(UserWarning, match="Detected call of `lr_scheduler.step"):
        _, ema, optimizer, _ = _train([0, 1], poisoned={0}, fused=False, skip_aware=False)
    assert ema.n_averaged.item() == 2
    assert optimizer.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_last_step_skipped_follows_each_step(fused: bool) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters(), fused=fused)
    scaler = ampscaler.GradScaler("cpu")
    assert scaler.last_step_skipped is False
    for poison in (True, False, True, True, False):
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if poison:
            model.bias.grad.fill_(float("inf"))
        scaler.step(optimizer)
        assert scaler.last_step_skipped is poison
        scaler.update()
        assert scaler.last_step_skipped is poison
        optimizer.zero_grad()


def test_disabled_scaler_never_reports_a_skip() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", enabled=False)
    model(torch.ones(1, 2)).sum().backward()
    model.bias.grad.fill_(float("inf"))
    scaler.step(optimizer)
    scaler.update()
    assert scaler.last_step_skipped is False
