"""skrl's reinforcement-learning agents driving a scaler, re-created: ampscaler's against
torch's, bit for bit.

skrl is not installed here; this file re-creates, in its own words, what its PyTorch agents
(``skrl/agents/torch/ppo/ppo.py``, ``sac/sac.py``, ``td3/td3.py``) do with their scaler:

- ``self.scaler = torch.amp.GradScaler(device=self._device_type,
  enabled=self._mixed_precision)`` (``torch.cuda.amp.GradScaler(enabled=...)`` before torch
  2.4); ``mixed_precision`` defaults to ``False``: the disabled scaler runs every call;
- PPO's ``_update``: per rollout, several learning epochs over shuffled mini-batches, each one
  ``optimizer.zero_grad()``, ``scaler.scale(policy_loss + entropy_loss + value_loss)
  .backward()``, and when ``grad_norm_clip > 0`` ``scaler.unscale_(optimizer)`` and
  ``clip_grad_norm_`` over the policy's and the value's parameters, then ``scaler.step()`` and
  ``scaler.update()``: many ``update()``s per rollout, and the KL-adaptive learning rate set on
  the optimizer between them;
- SAC's and TD3's gradient step: the critic (``zero_grad``, ``scale(critic_loss).backward()``,
  ``unscale_``, clip, ``step(critic_optimizer)``), then the policy, whose loss goes through the
  critics (so its backward also writes scaled gradients into the critics' ``.grad``, after the
  critic stepped; TD3 only every ``policy_delay`` steps), then SAC's entropy coefficient (a
  single ``log_entropy_coefficient`` tensor, ``step()`` with no ``unscale_``); one
  ``scaler.update()`` after all of them;
- tests of such trainers replace ``scaler.unscale_`` on the instance
  (``monkeypatch.setattr(trainer.scaler, "unscale_", ledger)``) to check that clipping comes
  after unscaling.

Why it matters: one scaler shared by three optimizers whose steps interleave with new scaled
backwards, several ``update()``s per batch of data, and an inf in one optimizer's loss that must
skip that optimizer's step only, then back the scale off once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
GRAD_NORM_CLIP = 0.5


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def mlp(inputs: int, outputs: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, 8), torch.nn.ELU(), torch.nn.Linear(8, outputs)
    )


def step_count(scaler: Any, optimizer: torch.optim.Optimizer, name: str, trace: Trace) -> None:
    """``scaler.step(optimizer)``, then in ``trace.returns`` which optimizer it was and how many
    steps it has taken (Adam's ``step()`` returns ``None`` either way)."""
    scaler.step(optimizer)
    states = [s for s in optimizer.state.values() if "step" in s]
    trace.returns.append((name, int(states[0]["step"]) if states else 0))


def skipped_and_taken(trace: Trace) -> tuple[int, int]:
    """How many ``step()`` calls left their optimizer's step count unchanged, and how many not."""
    last: dict[str, int] = {}
    skipped = taken = 0
    for optimizer, count in trace.returns:
        if last.get(optimizer, 0) == count:
            skipped += 1
        else:
            taken += 1
        last[optimizer] = count
    return skipped, taken


def record(trace: Trace, scaler: Any, *modules: torch.nn.Module) -> None:
    trace.params.append([p.detach().clone() for m in modules for p in m.parameters()])
    trace.scales.append(scaler.get_scale())
    trace.trackers.append(scaler._get_growth_tracker() if scaler.is_enabled() else 0)


def ppo_updates(
    factory: Factory, mixed_precision: bool = True, grad_norm_clip: float = GRAD_NORM_CLIP
) -> Trace:
    """Two rollouts of PPO's ``_update`` (3 epochs x 2 mini-batches); an inf loss in one
    mini-batch and an inf in the value's gradient in another."""
    torch.manual_seed(0)
    policy, value = mlp(3, 2), mlp(3, 1)
    optimizer = torch.optim.Adam(itertools.chain(policy.parameters(), value.parameters()), lr=3e-3)
    scaler = factory(device="cpu", enabled=mixed_precision, growth_interval=3)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for rollout, epoch, batch in itertools.product(range(2), range(3), range(2)):
        states = torch.randn(6, 3, generator=data)
        actions, advantages = torch.randn(6, 2, generator=data), torch.randn(6, generator=data)
        returns = torch.randn(6, 1, generator=data)
        with torch.autocast("cpu", dtype=torch.float16, enabled=mixed_precision):
            mean = policy(states)
            log_prob = -((actions - mean.float()) ** 2).sum(-1)
            ratio = torch.exp(log_prob - log_prob.detach())
            surrogate = torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
            policy_loss = -surrogate.mean()
            value_loss = torch.nn.functional.mse_loss(value(states).float(), returns)
        loss = policy_loss + 0.5 * value_loss
        if (rollout, epoch, batch) == (0, 1, 0):
            loss = loss * float("inf")
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        if (rollout, epoch, batch) == (1, 0, 1):
            value[0].weight.grad[0, 0] = float("nan")
        if grad_norm_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(
                itertools.chain(policy.parameters(), value.parameters()), grad_norm_clip
            )
        step_count(scaler, optimizer, "optimizer", trace)
        scaler.update()
        for group in optimizer.param_groups:  # KLAdaptiveLR: the lr set between updates
            group["lr"] = group["lr"] * (1.5 if batch else 0.75)
        record(trace, scaler, policy, value)
    return trace


def sac_gradient_steps(factory: Factory, policy_delay: int = 1) -> Trace:
    """SAC's (TD3's with ``policy_delay`` > 1) gradient steps: critic, policy, entropy; one
    ``update()``. An inf in the critic's loss at step 2, in the policy's gradient at step 4."""
    torch.manual_seed(0)
    policy, critic_1, critic_2 = mlp(3, 2), mlp(5, 1), mlp(5, 1)
    log_entropy_coefficient = torch.zeros(1, requires_grad=True)
    critic_optimizer = torch.optim.Adam(
        itertools.chain(critic_1.parameters(), critic_2.parameters()), lr=3e-3
    )
    policy_optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    entropy_optimizer = torch.optim.Adam([log_entropy_coefficient], lr=3e-3)
    scaler = factory(device="cpu", enabled=True, growth_interval=2)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for step in range(8):
        states, taken = torch.randn(6, 3, generator=data), torch.randn(6, 2, generator=data)
        targets = torch.randn(6, 1, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            q1 = critic_1(torch.cat([states, taken], -1)).float()
            q2 = critic_2(torch.cat([states, taken], -1)).float()
            critic_loss = (q1 - targets).pow(2).mean() + (q2 - targets).pow(2).mean()
        if step == 2:
            critic_loss = critic_loss * float("inf")
        critic_optimizer.zero_grad()
        scaler.scale(critic_loss).backward()
        scaler.unscale_(critic_optimizer)
        torch.nn.utils.clip_grad_norm_(
            itertools.chain(critic_1.parameters(), critic_2.parameters()), GRAD_NORM_CLIP
        )
        step_count(scaler, critic_optimizer, "critic_optimizer", trace)
        if step % policy_delay == 0:
            with torch.autocast("cpu", dtype=torch.float16):
                actions = torch.tanh(policy(states).float())
                both = torch.cat([states, actions], -1)
                q = torch.min(critic_1(both).float(), critic_2(both).float())
                log_prob = -actions.pow(2).sum(-1, keepdim=True)
                policy_loss = (log_entropy_coefficient.exp().detach() * log_prob - q).mean()
            policy_optimizer.zero_grad()
            scaler.scale(policy_loss).backward()
            if step == 4:
                policy[2].bias.grad[0] = float("inf")
            scaler.unscale_(policy_optimizer)
            torch.nn.utils.clip_grad_norm_(policy.parameters(), GRAD_NORM_CLIP)
            step_count(scaler, policy_optimizer, "policy_optimizer", trace)
            entropy_loss = -(log_entropy_coefficient * (log_prob.detach() - 2.0)).mean()
            entropy_optimizer.zero_grad()
            scaler.scale(entropy_loss).backward()
            step_count(scaler, entropy_optimizer, "entropy_optimizer", trace)
        scaler.update()
        record(trace, scaler, policy, critic_1, critic_2)
        trace.params[-1].append(log_entropy_coefficient.detach().clone())
    return trace


@pytest.mark.parametrize(
    "options",
    [{}, {"grad_norm_clip": 0.0}, {"mixed_precision": False}],
    ids=["clip", "no-clip", "disabled"],
)
def test_ppo_updates_match_torch(options: dict[str, Any]) -> None:
    theirs = ppo_updates(torch.amp.GradScaler, **options)
    ours = ppo_updates(ampscaler.GradScaler, **options)
    assert_same_trace(ours, theirs)
    if options.get("mixed_precision", True):
        # skipped: the first step (fp16 gradients overflow at 2**16), the inf loss, the NaN
        assert skipped_and_taken(ours) == (3, 9)
        assert min(ours.scales) < max(ours.scales[2:]) < 2.0**16  # backed off, grew again


@pytest.mark.parametrize("policy_delay", [1, 2], ids=["sac", "td3-delay"])
def test_sac_gradient_step_matches_torch(policy_delay: int) -> None:
    theirs = sac_gradient_steps(torch.amp.GradScaler, policy_delay)
    ours = sac_gradient_steps(ampscaler.GradScaler, policy_delay)
    assert_same_trace(ours, theirs)
    skipped, taken = skipped_and_taken(ours)
    assert skipped >= 2 and taken > 3 * skipped  # only the overflowing optimizer skipped


def test_sac_under_patch_torch_matches_torch() -> None:
    theirs = sac_gradient_steps(torch.amp.GradScaler)
    with ampscaler.patch_torch():
        ours = sac_gradient_steps(torch.amp.GradScaler)
        assert isinstance(torch.amp.GradScaler("cpu"), ampscaler.GradScaler)
    assert_same_trace(ours, theirs)


@pytest.mark.parametrize("factory", [torch.amp.GradScaler, ampscaler.GradScaler])
def test_unscale_replaced_on_the_instance_sees_each_clip(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer test's ledger: ``unscale_`` replaced on the scaler instance is called, with
    the optimizer, before every clip, and the run is the same as without the ledger."""
    ledger: list[str] = []
    made: list[Any] = []

    def building(**kwargs: Any) -> Any:
        scaler = factory(**kwargs)
        real = scaler.unscale_

        def recording(optimizer: torch.optim.Optimizer) -> None:
            ledger.append("unscale")
            real(optimizer)

        monkeypatch.setattr(scaler, "unscale_", recording)
        made.append(scaler)
        return scaler

    real_clip = torch.nn.utils.clip_grad_norm_

    def clipping(*args: Any, **kwargs: Any) -> Any:
        ledger.append("clip")
        return real_clip(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clipping)
    traced = ppo_updates(building)
    assert ledger == ["unscale", "clip"] * 12
    monkeypatch.undo()
    assert_same_trace(traced, ppo_updates(torch.amp.GradScaler))
