"""Megatron-core trains with ampscaler's scaler bit for bit as with its own.

The real engine (megatron-core, installed by CI: scripts/install_engines.sh) on 1 and 2 CPU
ranks with gloo, through its own optimizer factory, with the CPU shims of tests/engine_shims.py.
Skipped, saying so, where megatron-core is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (bash scripts/install_engines.sh)"
)

import ampscaler
import multirank
from ampscaler.integrations import megatron
from engine_observed import user_policy_scales
from megatron_ranks import OVERFLOWS, RESUME_AT, Run  # imports Megatron-core; registers scenarios


def _same(run: Run, reference: Run) -> None:
    assert run.stepped == reference.stepped
    assert run.scales == reference.scales
    assert all(torch.equal(a, b) for a, b in zip(run.params, reference.params, strict=True))


def _check_twins(results: dict[str, Any], hysteresis: int) -> None:
    reference = results["megatron"]
    assert reference.stepped.count(False) >= 6  # the injected overflows skipped steps
    assert len(set(reference.scales)) >= 3  # the scale backed off and grew
    for name in ("ampscaler", "megatron_to_ampscaler", "ampscaler_to_megatron"):
        _same(results[name], reference)
    keys = results["ampscaler"].keys
    assert set(keys) == {"scale", "growth_tracker", "hysteresis_tracker", "ampscaler"}
    mine, theirs = keys, reference.keys
    assert torch.equal(mine["scale"], theirs["scale"]) and mine["scale"].shape == (1,)
    assert mine["growth_tracker"] == theirs["growth_tracker"]
    # Megatron's tracker goes below 0, ampscaler's budget stops at 0 (with hysteresis 1 it is
    # never spent): the same decisions either way.
    budget = max(theirs["hysteresis_tracker"], 0) if hysteresis > 1 else 1
    assert mine["hysteresis_tracker"] == budget


@pytest.mark.parametrize("world", [1, 2])
def test_hysteresis_1_2_3_bit_for_bit_with_checkpoints_both_ways(world: int) -> None:
    results = multirank.spawn(world, ["megatron_h1", "megatron_h2", "megatron_h3"])
    for rank in range(world):
        for hysteresis in (1, 2, 3):
            _check_twins(results[rank][f"megatron_h{hysteresis}"], hysteresis)
    if world == 2:  # an overflow on either rank skipped the step on both
        skipped = [[not s for s in r["megatron_h1"]["ampscaler"].stepped] for r in results]
        assert skipped[0] == skipped[1] == [step in OVERFLOWS for step in range(len(skipped[0]))]


def test_at_the_minimum_max_consecutive_skips_raises_on_every_rank() -> None:
    results = multirank.spawn(2, ["megatron_minimum", "megatron_handed_over"])
    for rank in range(2):
        minimum = results[rank]["megatron_minimum"]
        stepped, scale = minimum["megatron"]
        assert stepped == [True, True] + [False] * 14 and scale == 2.0**5  # silently skipping
        steps_before, message = minimum["error"]
        assert steps_before == 2 + 5  # the 6th skip in a row raised
        assert "6 optimizer steps in a row were skipped" in message
        handed = results[rank]["megatron_handed_over"]
        _same(handed["ampscaler"], handed["megatron"])
        assert handed["kind"] == "MegatronScaler"


def test_patch_is_nesting_safe_and_undone() -> None:
    from megatron.core import optimizer as megatron_optimizer

    original = megatron_optimizer.DynamicGradScaler
    with megatron.patch_megatron(max_consecutive_skips=3) as outer:
        with megatron.patch_megatron(max_scale=2.0**12):
            inner_scaler = megatron_optimizer.DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 2, 2)
        outer_scaler = megatron_optimizer.DynamicGradScaler(2.0**10, 1.0, 2.0, 0.5, 2, 2)
        assert outer.settings.max_consecutive_skips == 3
    assert megatron_optimizer.DynamicGradScaler is original
    assert inner_scaler.scaler.policy.max_scale == 2.0**12
    assert outer_scaler.scaler.policy.max_scale is None
    megatron.patch_megatron()
    megatron.unpatch_megatron()
    assert megatron_optimizer.DynamicGradScaler is original


def test_settings_are_checked_before_anything_is_patched() -> None:
    from megatron.core import optimizer as megatron_optimizer

    original = megatron_optimizer.DynamicGradScaler
    with pytest.raises(ampscaler.InvalidConfigError, match="measured gradients"):
        megatron.patch_megatron(policy=ampscaler.HeadroomPolicy())
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        megatron.patch_megatron(max_consecutive_skips=0)
    assert megatron_optimizer.DynamicGradScaler is original


def test_the_scaler_interface_and_a_megatron_checkpoint() -> None:
    adapter = megatron.MegatronScaler(
        ampscaler.GradScaler("cpu", init_scale=2.0**10, hysteresis=2, min_scale=1.0),
        torch.device("cpu"),
    )
    assert adapter.scale.shape == (1,) and adapter.inv_scale.item() == 2.0**-10
    saved = {"scale": torch.tensor([256.0]), "growth_tracker": 1, "hysteresis_tracker": -3}
    adapter.load_state_dict(saved)
    assert adapter.scale.item() == 256.0 and adapter.scaler.policy.hysteresis == 2
    state = adapter.state_dict()
    assert (state["growth_tracker"], state["hysteresis_tracker"]) == (1, 0)
    adapter.update(True)  # the budget is spent: backs off at once, as Megatron's would
    assert adapter.scale.item() == 128.0
    with pytest.raises(KeyError):
        adapter.load_state_dict({"scale": torch.tensor([2.0])})
    assert adapter.scale.item() == 128.0  # a rejected checkpoint changes nothing


def test_what_ampscaler_adds_inside_megatron() -> None:
    results = multirank.spawn(2, ["megatron_extras"])
    for rank in range(2):
        extras = results[rank]["megatron_extras"]
        user, reference = extras["user_policy"], extras["megatron"]
        assert user.stepped == reference.stepped  # the same overflows were skipped
        skipped = [not stepped for stepped in user.stepped]
        assert user.scales == user_policy_scales(skipped, 2.0**10, interval=2)
        observed = user.observed  # the scaler built after the resume at RESUME_AT
        assert [skip for skip, _ in observed["history"]] == skipped[RESUME_AT:]
        assert [scale for _, scale in observed["history"]] == user.scales[RESUME_AT:]
        metrics = observed["metrics"]  # the counters came through the checkpoint
        assert (metrics["scaler/steps"], metrics["scaler/skips"]) == (len(skipped), sum(skipped))
        assert observed["metrics"]["scaler/scale"] == user.scales[-1]
        # steps 0-9 skipped 6 of 10 (and the resumed scaler saw a window skip half of it)
        assert observed["alerts"] and set(observed["alerts"]) == {("skip_rate",)}
        bounded, unbounded = extras["bounded"], extras["unbounded"]
        assert max(unbounded.scales) > 2.0**5 == max(bounded.scales)  # min_loss_scale too


def test_a_chained_optimizer_shares_one_scale_that_moves_once_per_step() -> None:
    """use_ampscaler on a ChainedOptimizer of two optimizers: both unscale by the scale the
    loss was scaled by, which moves after the second one's verdict, by whether either
    overflowed (Megatron's own scalers would each move by their own)."""

    class Member:
        def __init__(self) -> None:
            self.grad_scaler = megatron.MegatronScaler(
                ampscaler.GradScaler("cpu", init_scale=2.0**10), torch.device("cpu")
            )

    class Chained:
        def __init__(self) -> None:
            self.chained_optimizers = [Member(), Member()]

    chained = Chained()
    scaler = megatron.use_ampscaler(chained)
    first, second = (member.grad_scaler for member in chained.chained_optimizers)
    assert first is second and first.scaler is scaler
    first.update(True)
    assert first.scale.item() == 2.0**10  # the second optimizer has not unscaled yet
    second.update(False)
    assert first.scale.item() == 2.0**9 and scaler.metrics()["scaler/steps"] == 1


def test_a_constant_scale_is_ampscalers_static_policy_while_patched() -> None:
    from megatron.core import optimizer as megatron_optimizer

    with megatron.patch_megatron(max_consecutive_skips=2):
        constant = megatron_optimizer.ConstantGradScaler(128.0)
    assert isinstance(constant.scaler.policy, ampscaler.StaticPolicy)
    constant.update(True)
    assert constant.scale.item() == 128.0 and constant.scaler.metrics()["scaler/skips"] == 1
    with pytest.raises(ampscaler.PersistentOverflowError):
        constant.update(True)  # Megatron's constant scaler would skip forever
    constant.load_state_dict({})  # what Megatron's ConstantGradScaler saves
    assert constant.scale.item() == 128.0
