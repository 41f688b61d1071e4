"""SAM with AMP, the recipe copied from one training repository to the next, re-created:
ampscaler's scaler against torch's, bit for bit.

SAM (sharpness-aware minimization, as in the widely used ``sam.py``) steps twice per batch:
``first_step()`` climbs to ``w + rho * g / ||g||``, a second forward and backward there, then
``second_step()`` goes back to ``w`` and lets the base optimizer step with the new gradients.
``scaler.step(optimizer)`` cannot drive that, so the recipe drives the optimizer itself and
tells the scaler so through torch's private per-optimizer dict:

- the checked form: ``optimizer_state = scaler._per_optimizer_states[id(optimizer)]`` taken
  first, ``scaler.unscale_(optimizer)``, ``first_step(zero_grad=True)`` unless
  ``sum(v.item() for v in optimizer_state["found_inf_per_device"].values())``, then
  ``optimizer_state["stage"] = 2`` and ``scaler.update()``; the second half the same with
  ``second_step``, reading and writing the *first* half's entry again (which torch's
  ``update()`` has left behind: its flag is the first half's, its write goes nowhere);
- the unchecked form: ``unscale_``, ``clip_grad_norm_``, ``first_step(zero_grad=True)``
  whatever the flag, then the entry taken and ``optimizer_state["stage"] =
  OptState.STEPPED`` (torch's enum), ``scaler.update()``; then the second half alike.

Every write into an entry was refused by ampscaler (a ``TypeError``), so the recipe stopped at
its first batch, under ``patch_torch()`` too. Now ``STEPPED`` written after ``unscale_()``
counts the optimizer as stepped, as ``step()`` would have decided (skipped where the flag is
> 0), and a write into an ended iteration's entry changes nothing, as on torch's scaler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState

import ampscaler

Factory = Callable[..., Any]
BATCHES = 8
INF_FIRST = {2}  # batches whose first backward gets an inf
INF_SECOND = {5}  # batches whose second backward gets one


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization over a base SGD, in the shape of the usual ``sam.py``."""

    def __init__(self, params: Any, rho: float = 0.05, lr: float = 0.1) -> None:
        super().__init__(params, {"rho": rho, "lr": lr})
        self.base = torch.optim.SGD(self.param_groups, lr=lr, momentum=0.9)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            factor = group["rho"] / (norm + 1e-12)
            for p in group["params"]:
                self.state[p]["e_w"] = e_w = p.grad * factor
                p.add_(e_w)
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.state[p]["e_w"])
        self.base.step()
        if zero_grad:
            self.zero_grad()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        raise NotImplementedError("SAM steps by first_step() and second_step()")


def model_and_sam() -> tuple[torch.nn.Module, SAM]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, SAM(model.parameters())


def scaled_backward(scaler: Any, model: torch.nn.Module, batch: int, inf: bool) -> None:
    data = torch.Generator().manual_seed(batch)
    x, y = torch.randn(4, 4, generator=data), torch.randn(4, 2, generator=data)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if inf:
        model[0].weight.grad.view(-1)[0] = float("inf")


def flagged(entry: Any) -> bool:
    return bool(sum(v.item() for v in entry["found_inf_per_device"].values()))


def checked_recipe(scaler: Any, model: torch.nn.Module, sam: SAM, batch: int) -> None:
    scaled_backward(scaler, model, batch, batch in INF_FIRST)
    optimizer_state = scaler._per_optimizer_states[id(sam)]
    scaler.unscale_(sam)
    if not flagged(optimizer_state):
        sam.first_step(zero_grad=True)
    optimizer_state["stage"] = 2
    scaler.update()
    scaled_backward(scaler, model, batch, batch in INF_SECOND)
    scaler.unscale_(sam)
    if not flagged(optimizer_state):  # the first half's entry, as the recipe reads it
        sam.second_step(zero_grad=True)
    optimizer_state["stage"] = 2  # into the first half's entry: no effect
    scaler.update()
    sam.zero_grad()


def unchecked_recipe(scaler: Any, model: torch.nn.Module, sam: SAM, batch: int) -> None:
    for half, inf in ((sam.first_step, INF_FIRST), (sam.second_step, INF_SECOND)):
        scaled_backward(scaler, model, batch, batch in inf)
        scaler.unscale_(sam)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not any(not torch.isfinite(p.grad).all() for p in model.parameters()):
            half(zero_grad=True)
        optimizer_state = scaler._per_optimizer_states[id(sam)]
        optimizer_state["stage"] = OptState.STEPPED
        scaler.update()
        sam.zero_grad()


def train(factory: Factory, recipe: Callable[..., None]) -> tuple[list[float], list[torch.Tensor]]:
    model, sam = model_and_sam()
    scaler = factory("cpu", init_scale=2.0**10, growth_interval=1000)
    scales = []
    for batch in range(BATCHES):
        recipe(scaler, model, sam, batch)
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("recipe", [checked_recipe, unchecked_recipe])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_the_sam_amp_recipe_trains_as_over_torchs(recipe: Callable[..., None], how: str) -> None:
    theirs = train(torch.amp.GradScaler, recipe)
    if how == "patched":
        with ampscaler.patch_torch():
            ours = train(lambda *a, **k: torch.amp.GradScaler(*a, **k), recipe)
    else:
        ours = train(ampscaler.GradScaler, recipe)
    assert ours[0] == theirs[0]
    for mine, other in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(mine, other)
    scales = theirs[0]
    assert scales[2] < scales[1] and scales[5] < scales[4]  # the infs backed the scale off
    finite = all(torch.isfinite(p).all() for p in ours[1])
    # The checked recipe's second half reads the first half's flag, so the inf of batch 5's
    # second backward reaches the parameters, over torch's scaler as over ampscaler's.
    assert finite is (recipe is unchecked_recipe)


def test_a_step_said_by_the_loop_is_counted_as_step_would_have_decided() -> None:
    model, sam = model_and_sam()
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    scaled_backward(scaler, model, 0, inf=False)
    scaler.unscale_(sam)
    scaler._per_optimizer_states[id(sam)]["stage"] = 2
    assert scaler._per_optimizer_states[id(sam)]["stage"] is OptState.STEPPED
    assert scaler.step_skipped(sam) is False
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(sam)  # stepped once: torch's error for a second step
    scaler.update()
    scaled_backward(scaler, model, 1, inf=True)
    scaler.unscale_(sam)
    scaler._per_optimizer_states[id(sam)]["stage"] = OptState.STEPPED
    assert scaler.step_skipped(sam) is True
    scaler.update()
    metrics = scaler.metrics()
    assert (metrics["scaler/steps"], metrics["scaler/skips"]) == (2, 1)


def test_stepped_before_unscale_is_refused_and_changes_nothing() -> None:
    """torch's scaler takes the write and fails at ``update()`` ("No inf checks were recorded
    prior to update"); ampscaler says so where the write is, and nothing changed."""
    model, sam = model_and_sam()
    scaler = ampscaler.GradScaler("cpu")
    scaled_backward(scaler, model, 0, inf=False)
    entry = scaler._per_optimizer_states[id(sam)]
    with pytest.raises(ampscaler.ScalerUsageError, match=r"before scaler\.unscale_"):
        entry["stage"] = OptState.STEPPED
    assert entry["stage"] is OptState.READY
    scaler.unscale_(sam)  # the iteration goes on as before the write
    entry["stage"] = OptState.STEPPED
    scaler.update()


@pytest.mark.parametrize(
    ("key", "value"),
    [("stage", OptState.UNSCALED), ("stage", 1), ("stage", True), ("found_inf_per_device", {})],
)
def test_other_writes_are_still_refused(key: str, value: object) -> None:
    model, sam = model_and_sam()
    scaler = ampscaler.GradScaler("cpu")
    scaled_backward(scaler, model, 0, inf=False)
    scaler.unscale_(sam)
    with pytest.raises(TypeError, match="read-only view"):
        scaler._per_optimizer_states[id(sam)][key] = value
    assert scaler._per_optimizer_states[id(sam)]["stage"] is OptState.UNSCALED
