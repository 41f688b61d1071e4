"""The checkpoint format, kept in one place (``ampscaler.checkpoint``, issue 36): policies are
known there by the name the ``policy`` key saves, never by type, so a subclass of a built-in
policy is a policy of its own, and torch's own state dict sets torch's rule numbers in any
policy with fields of those names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ampscaler
from ampscaler.checkpoint import policy_entries


@dataclass(frozen=True)
class CappedScalePolicy(ampscaler.ScalePolicy):
    """torch's rule, subclassed by a user (a tweak of their own would go here)."""


@dataclass(frozen=True)
class TorchLike(ampscaler.StaticPolicy):
    """A user's policy with fields named as torch's rule's."""

    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000


def _one_step(scaler: ampscaler.GradScaler) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()


def test_a_subclass_of_a_built_in_policy_resumes_as_itself() -> None:
    scaler = ampscaler.GradScaler("cpu", policy=CappedScalePolicy(growth_interval=5))
    _one_step(scaler)
    saved = scaler.state_dict()
    assert saved["policy"] == "CappedScalePolicy"
    assert saved["policy_state"]["growth_interval"] == 5
    resumed = ampscaler.GradScaler("cpu", policy=CappedScalePolicy())
    resumed.load_state_dict(saved)
    assert resumed.policy == CappedScalePolicy(growth_interval=5)
    assert resumed.state_dict() == saved


def test_torch_state_dict_sets_the_rule_of_any_policy_with_its_fields() -> None:
    theirs = torch.amp.GradScaler("cpu", growth_factor=4.0, growth_interval=7)
    ours = ampscaler.GradScaler("cpu", policy=TorchLike())
    ours.load_state_dict(theirs.state_dict())
    assert ours.policy == TorchLike(growth_factor=4.0, growth_interval=7)
    headroom = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy(backoff_factor=0.25))
    headroom.load_state_dict(theirs.state_dict())  # no growth rule: stays as constructed
    assert headroom.policy == ampscaler.HeadroomPolicy(backoff_factor=0.25)


def test_the_built_in_policies_keep_the_0_1_layout() -> None:
    assert policy_entries(ampscaler.StaticPolicy(), {}) == {
        "hysteresis": 1,
        "min_scale": None,
        "max_scale": None,
        "dynamic": False,
        "backoff_on_nonfinite_loss": True,
        "_hysteresis_tracker": 1,
    }
    entries = policy_entries(ampscaler.HeadroomPolicy(), {"target": 8.0})
    assert entries["dynamic"] and entries["headroom"]["target"] == 8.0
    assert entries["headroom"]["margin"] == ampscaler.HeadroomPolicy().margin
