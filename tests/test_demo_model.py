"""Tests of the demo's model, data, underflow measurement and one-arm training (ampscaler.demo)."""

from __future__ import annotations

import math

import pytest
import torch

from ampscaler import StepRecord
from ampscaler.demo import (
    FP16_AMPSCALER,
    FP16_NO_SCALING,
    FP32,
    Arm,
    ArmResult,
    DemoConfig,
    TaskSpec,
    activation_probe,
    batches,
    build_student,
    compute_loss,
    standard_arms,
    tail_mean,
    train_arm,
)
from ampscaler.observe.probe import count_underflow
from ampscaler.report import parameter_zeros

SHORT = DemoConfig(steps=30, probe_every=5)


@pytest.fixture(scope="module")
def short_runs() -> dict[str, ArmResult]:
    """The three standard arms, 30 steps each with the default task (about a second in all)."""
    return {arm.name: train_arm(arm, SHORT) for arm in standard_arms()}


# --- data and model -------------------------------------------------------------------------


def test_batches_repeat_for_a_seed_and_differ_between_seeds() -> None:
    spec = TaskSpec(batch_size=8)
    first, again, other = batches(spec, 3), batches(spec, 3), batches(spec, 4)
    for _ in range(3):
        (x1, y1), (x2, y2), (x3, _) = next(first), next(again), next(other)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert not torch.equal(x1, x3)
    assert x1.shape == (8, spec.in_features) and y1.shape == (8, spec.out_features)


def test_targets_are_small() -> None:
    _, y = next(batches(TaskSpec(), 0))
    rms = y.pow(2).mean().sqrt().item()
    assert 0.002 < rms < 0.02


def test_student_is_reproducible_and_its_output_layer_starts_at_zero() -> None:
    spec = TaskSpec()
    a, b = build_student(spec, 5), build_student(spec, 5)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert [n for n, m in a.named_children() if isinstance(m, torch.nn.Linear)] == [
        "hidden1",
        "hidden2",
        "hidden3",
        "output",
    ]
    assert not a.output.weight.any() and not a.output.bias.any()
    assert a.hidden1.weight.abs().max() <= 1 / math.sqrt(spec.in_features)


def test_loss_under_autocast_is_fp32_from_fp16_predictions() -> None:
    model = build_student(TaskSpec(batch_size=4), 0)
    x, y = next(batches(TaskSpec(batch_size=4), 0))
    assert compute_loss(model, x, y, fp16=True).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        assert model(x).dtype == torch.float16


def test_invalid_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="steps"):
        DemoConfig(steps=0)
    with pytest.raises(ValueError, match="probe_every"):
        DemoConfig(probe_every=0)
    with pytest.raises(ValueError, match="batch_size"):
        TaskSpec(batch_size=0)
    with pytest.raises(ValueError, match="target_scale"):
        TaskSpec(target_scale=0.0)


# --- underflow counting ---------------------------------------------------------------------


def test_count_underflow_counts_only_elements_with_signal() -> None:
    reference = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    # held in fp16: 5 (no signal in the reference), 0, 1e-6 (subnormal), 1 (normal), 1e-9 (-> 0)
    observed = torch.tensor([5.0, 0.0, 1e-6, 1.0, 1e-9])
    counts = count_underflow(observed, reference)
    assert (counts.carrying_signal, counts.underflowed, counts.flushed) == (4, 3, 2)
    assert counts.fraction == 0.75 and counts.flushed_fraction == 0.5


def test_count_underflow_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        count_underflow(torch.zeros(3), torch.zeros(4))


def test_probe_sees_the_linear_layers_and_its_hooks_are_removed_after_detach() -> None:
    model = build_student(TaskSpec(batch_size=4), 0)
    x, y = next(batches(TaskSpec(batch_size=4), 0))
    probe = activation_probe(model, every=1)
    compute_loss(model, x, y, fp16=False).backward()
    pending = probe.end_iteration()
    assert pending is not None
    grads = pending.read(scale=1.0).module_counts
    probe.detach()
    assert set(grads) == {"hidden1", "hidden2", "hidden3", "output"}
    assert all(not m._backward_hooks for m in model.modules())
    assert all(not m._forward_hooks for m in model.modules())


# --- training one arm -----------------------------------------------------------------------


def test_arm_results_have_one_entry_per_step(short_runs: dict[str, ArmResult]) -> None:
    assert list(short_runs) == [FP32, FP16_NO_SCALING, FP16_AMPSCALER]
    for name, result in short_runs.items():
        assert result.name == name
        assert len(result.losses) == len(result.skipped) == len(result.scales) == SHORT.steps
        assert all(math.isfinite(v) for v in result.losses)
        assert all(isinstance(s, bool) for s in result.skipped)
        assert result.final_loss == tail_mean(result.losses)
        assert result.skipped_steps == 0
        assert result.seconds > 0
        assert result.underflow is not None and result.underflow.probes == 6


def test_scale_is_one_without_a_scaler_and_recorded_with_one(
    short_runs: dict[str, ArmResult],
) -> None:
    for name in (FP32, FP16_NO_SCALING):
        assert short_runs[name].final_scale == 1.0 and set(short_runs[name].scales) == {1.0}
    scaled = short_runs[FP16_AMPSCALER]
    assert scaled.scales[0] == 2.0**16 and scaled.final_scale == 2.0**16


def test_all_arms_start_from_the_same_weights_and_batch(short_runs: dict[str, ArmResult]) -> None:
    # the output layer starts at zero, so the first prediction is exactly 0 in fp32 and fp16 alike
    first = {result.losses[0] for result in short_runs.values()}
    assert len(first) == 1


def test_fp32_arm_learns(short_runs: dict[str, ArmResult]) -> None:
    losses = short_runs[FP32].losses
    assert short_runs[FP32].final_loss < 0.5 * losses[0]


def test_unscaled_arm_loses_most_activation_gradients(short_runs: dict[str, ArmResult]) -> None:
    unscaled = short_runs[FP16_NO_SCALING].underflow
    scaled = short_runs[FP16_AMPSCALER].underflow
    assert unscaled is not None and scaled is not None
    assert unscaled.total().carrying_signal > 0
    assert unscaled.fraction > 0.9
    assert unscaled.flushed_fraction > 0.5
    assert unscaled.layers["hidden1"].flushed_fraction > 0.9
    assert scaled.flushed_fraction < 0.01


def test_the_probe_counts_only_parameters_with_a_gradient_in_fp32(
    short_runs: dict[str, ArmResult],
) -> None:
    """Item 11: at step 0 no gradient reaches the hidden layers, behind the zero-initialised
    output layer, in fp32 either. Counted, they made 86% of every arm's parameter-gradient
    elements "zero in fp16", the scaled arm's at its loss scale too: scaling read as failing."""
    spec = SHORT.task
    output = spec.hidden_features * spec.out_features + spec.out_features
    model = build_student(spec, SHORT.seed)
    everything = sum(p.numel() for p in model.parameters())
    for result in short_runs.values():
        first, later = result.records[0].probe, result.records[SHORT.probe_every or 0].probe
        assert first is not None and later is not None
        assert (first.elements, later.elements) == (output, everything), result.name
    scaled = short_runs[FP16_AMPSCALER].records[0].probe
    assert scaled is not None and parameter_zeros(scaled)[0] == 0.0


def test_on_step_sees_every_step_in_order() -> None:
    seen: list[StepRecord] = []
    result = train_arm(Arm("fp16", fp16=True), DemoConfig(steps=4, probe_every=None), seen.append)
    assert [r.step for r in seen] == [0, 1, 2, 3]
    assert [r.loss for r in seen] == result.losses
    assert seen[0].lr == SHORT.lr and seen[-1].lr < SHORT.lr
    assert result.underflow is None


def test_overflowing_scale_is_seen_as_skipped_steps() -> None:
    def huge() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**40)

    result = train_arm(Arm("huge", fp16=True, scaler_factory=huge), DemoConfig(steps=6))
    assert result.skipped[0] and result.scales[0] == 2.0**40
    assert result.skipped_steps >= 1
    assert result.final_scale < 2.0**40


def test_a_scalers_own_skip_flag_is_used() -> None:
    class AlwaysSkipped(torch.amp.GradScaler):
        last_step_skipped = True

    def factory() -> AlwaysSkipped:
        return AlwaysSkipped("cpu")

    result = train_arm(Arm("flag", fp16=True, scaler_factory=factory), DemoConfig(steps=2))
    assert result.skipped == [True, True]
