"""DeepSpeed ZeRO-1, 2 and 3 train with ampscaler's scaler bit for bit as with their own.

The real engine (deepspeed, installed by CI: scripts/install_engines.sh) on 1 and 2 CPU ranks
with gloo, built by ``deepspeed.initialize`` from an ``"fp16"`` config section, with the CPU
shims of tests/engine_shims.py. Skipped, saying so, where DeepSpeed is not installed.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (bash scripts/install_engines.sh)"
)

import ampscaler
import multirank
from ampscaler.integrations import deepspeed as ds_integration
from deepspeed_ranks import OVERFLOWS, RESUME_AT, STEPS, Run  # imports DeepSpeed; registers
from engine_observed import user_policy_scales


def _same(run: Run, reference: Run) -> None:
    assert run.stepped == reference.stepped
    assert run.scales == reference.scales
    assert all(torch.equal(a, b) for a, b in zip(run.params, reference.params, strict=True))


def _check_twins(results: dict[str, Run]) -> None:
    reference = results["deepspeed"]
    assert reference.scaler == "DynamicLossScaler"
    assert reference.stepped.count(False) >= 6  # the injected overflows skipped steps
    assert len(set(reference.scales)) >= 4  # the scale backed off and grew
    for name in ("ampscaler", "deepspeed_to_ampscaler", "ampscaler_to_deepspeed"):
        _same(results[name], reference)
    # DeepSpeed's own checkpoint loaded while patched comes back as ampscaler's scaler; an
    # ampscaler checkpoint stays ampscaler's in an engine built unpatched.
    assert results["deepspeed_to_ampscaler"].scaler == "DeepSpeedScaler"
    assert results["ampscaler_to_deepspeed"].scaler == "DeepSpeedScaler"


def test_zero_1_and_2_on_one_rank() -> None:
    results = multirank.spawn(1, ["zero1_h1", "zero2_h2"])
    for name in ("zero1_h1", "zero2_h2"):
        _check_twins(results[0][name])


def test_zero_1_2_with_consecutive_hysteresis_and_3_on_two_ranks() -> None:
    names = ["zero1_h1", "zero2_h2_consecutive", "zero3_h3"]
    results = multirank.spawn(2, names)
    for rank in range(2):
        for name in names:
            _check_twins(results[rank][name])
    # an overflow on either rank skipped the step on both
    expected = [step not in OVERFLOWS for step in range(STEPS)]
    assert results[0]["zero3_h3"]["ampscaler"].stepped == expected
    assert results[1]["zero3_h3"]["ampscaler"].stepped == expected


def test_the_torch_autocast_route_disagrees_across_ranks_unless_agreed() -> None:
    """ZeRO-1 with "torch_autocast" fp16 and "compute_grad_norm": false steps each rank's
    partition through its own torch.amp.GradScaler: an overflow in one partition backs off one
    rank's scale only, with torch's scaler and with ampscaler's under patch_torch() alike;
    agree_across_ranks makes every rank skip and back off. With the gradient norm computed
    (DeepSpeed's default), ZeRO skips the step on every rank before the scaler sees it, and no
    scale backs off."""
    names = ["autocast_torch", "autocast_patched", "autocast_agreed", "autocast_torch_norm"]
    results = multirank.spawn(2, [*names, "autocast_patched_norm"])
    for name in ("autocast_torch", "autocast_patched"):
        assert results[0][name] == [2.0**16] * 4
        assert results[1][name] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]  # rank 1 alone
    assert results[0]["autocast_agreed"] == results[1]["autocast_agreed"]
    assert results[0]["autocast_agreed"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    for name in ("autocast_torch_norm", "autocast_patched_norm"):
        assert results[0][name] == results[1][name] == [2.0**16] * 4


def test_at_the_minimum_on_every_rank() -> None:
    results = multirank.spawn(2, ["zero_minimum"])
    for rank in range(2):
        outcome: dict[str, Any] = results[rank]["zero_minimum"]
        deepspeed_steps, kind, message = outcome["deepspeed"]
        assert kind == "Exception" and "already at minimum" in message
        # by default where DeepSpeed raises, as ampscaler's error, which says what to do
        steps, kind, message = outcome["ampscaler"]
        assert (steps, kind) == (deepspeed_steps, "PersistentOverflowError")
        assert "max_consecutive_skips=N" in message
        # with max_consecutive_skips=6: on through the minimum, then ampscaler's error
        steps, kind, message = outcome["ampscaler_limit"]
        assert (steps, kind) == (2 + 5, "PersistentOverflowError")
        assert "6 optimizer steps in a row were skipped" in message
        assert "deepspeed.found_inf" in message


@pytest.fixture
def rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's scaler logs its overflows on rank 0, asking DeepSpeed's communication
    backend for the rank: outside an engine, this process is rank 0."""
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda group=None: 0)


@pytest.mark.usefixtures("rank_zero")
def test_policy_matches_deepspeeds_update_scale_for_random_overflows() -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    generator = torch.Generator().manual_seed(0)
    for case in range(24):
        window, hysteresis = 1 + case % 4, 1 + case % 3
        consecutive = case % 2 == 1
        theirs = DynamicLossScaler(2.0**12, window, 2.0, hysteresis, consecutive, False)
        policy = ds_integration.DeepSpeedPolicy(window, hysteresis, consecutive, 2.0)
        state = policy.initial_state(2.0**12, torch.device("cpu"))
        overflows = torch.rand(80, generator=generator) < 0.3 + 0.1 * (case % 3)
        for overflow in overflows.tolist():
            theirs.update_scale(overflow)
            policy.update_(state, torch.tensor(float(overflow)))
            assert state.scale.item() == theirs.cur_scale
            assert max(state.hysteresis_left.item(), 1) == theirs.cur_hysteresis


@pytest.mark.usefixtures("rank_zero")
def test_a_deepspeed_scaler_pickled_midway_resumes_as_the_same_rule() -> None:
    """DeepSpeed's own scaler pickled after every prefix of a run (long clean stretches
    included: counters past a whole window) unpickles, while patched, into ampscaler's, which
    goes on exactly as DeepSpeed's does."""
    from deepspeed.runtime.fp16 import loss_scaler

    generator = torch.Generator().manual_seed(1)
    clean_runs = torch.randint(0, 9, (12,), generator=generator).tolist()
    sequence = [step for run in clean_runs for step in [False] * run + [True]] + [False] * 9
    for consecutive in (False, True):
        for cut in range(0, len(sequence), 3):
            theirs = loss_scaler.DynamicLossScaler(2.0**10, 3, 1.0, 2, consecutive, False)
            for overflow in sequence[:cut]:
                theirs.update_scale(overflow)
            saved = pickle.dumps(theirs)
            with ds_integration.patch_deepspeed():
                mine = pickle.loads(saved)
            assert isinstance(mine, ds_integration.DeepSpeedScaler)
            assert not mine.raise_error_at_min_scale  # as saved
            for overflow in sequence[cut:]:
                theirs.update_scale(overflow)
                mine.update_scale(overflow)
                assert mine.cur_scale == theirs.cur_scale
    assert loss_scaler.DynamicLossScaler is not ds_integration.DeepSpeedScaler  # undone
    again = pickle.loads(pickle.dumps(mine))  # ampscaler's pickles as ampscaler's
    assert again.cur_scale == mine.cur_scale and again.scaler.metrics() == mine.scaler.metrics()


def test_settings_are_checked_and_the_patch_nests() -> None:
    from deepspeed.runtime.fp16 import loss_scaler

    original = loss_scaler.DynamicLossScaler
    with pytest.raises(ampscaler.InvalidConfigError, match="measured gradients"):
        ds_integration.patch_deepspeed(policy=ampscaler.HeadroomPolicy())
    assert loss_scaler.DynamicLossScaler is original
    with ds_integration.patch_deepspeed(max_consecutive_skips=4):
        with ds_integration.patch_deepspeed(max_scale=2.0**11):
            inner = loss_scaler.CreateLossScaler(torch.half, 0, True, {
                "init_scale": 2**10, "scale_window": 1, "min_scale": 1,
                "delayed_shift": 2, "consecutive_hysteresis": False,
            })  # fmt: skip
        outer = loss_scaler.DynamicLossScaler(2**10, 1, 1, 2, False)
    assert loss_scaler.DynamicLossScaler is original
    assert inner.scaler.policy.max_scale == 2.0**11 and inner.raise_error_at_min_scale
    assert outer.scaler.policy.max_scale is None and not outer.raise_error_at_min_scale
    inner.update_scale(False)
    inner.update_scale(False)
    assert inner.cur_scale == 2.0**11  # grew to the bound, one step later than torch's rule


def test_what_ampscaler_adds_inside_deepspeed() -> None:
    results = multirank.spawn(2, ["zero_extras"])
    for rank in range(2):
        extras = results[rank]["zero_extras"]
        user, reference = extras["user_policy"], extras["deepspeed"]
        assert user.stepped == reference.stepped  # the same overflows were skipped
        skipped = [not stepped for stepped in user.stepped]
        assert user.scales == user_policy_scales(skipped, 2.0**10, interval=2)
        # the scaler pickled into DeepSpeed's checkpoint, configured again by the patch when
        # it loaded: its sink saw the steps from there on
        observed = user.observed
        assert [skip for skip, _ in observed["history"]] == skipped[RESUME_AT:]
        assert [scale for _, scale in observed["history"]] == user.scales[RESUME_AT:]
        metrics = observed["metrics"]  # the counters came through the checkpoint
        assert (metrics["scaler/steps"], metrics["scaler/skips"]) == (len(skipped), sum(skipped))
        assert observed["metrics"]["scaler/scale"] == user.scales[-1]
        assert observed["alerts"] and set(observed["alerts"]) == {("skip_rate",)}
        bounded, unbounded = extras["bounded"], extras["unbounded"]
        assert max(unbounded.scales) > 8.0 == max(bounded.scales)
