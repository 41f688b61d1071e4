"""Random call sequences against torch.amp.GradScaler and the reference model, side by side.

A hypothesis state machine drives twin models (two optimizers: SGD with momentum, and Adam,
fused or not) through any legal order of scale/backward (finite, inf or NaN losses, losses that
overflow float16), inf/-inf/NaN written into gradients, gradients set to None, unscale_,
clipping, step, update, update(new_scale), state_dict round trips, deep copies and
add_param_group mid-training.

Ours runs with any policy; tests/reference.py predicts its scale, trackers, counters and
PersistentOverflowError. torch's scaler runs beside it on a twin model: with torch's options it
runs its own policy and everything must agree; with ampscaler's options it is handed our scale
through update(new_scale), and parameters must still agree bit for bit. Invariants: parameters
never change on a skipped step, a step never makes a parameter non-finite, the scale stays in
[min_scale, max_scale], the counters add up.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import ampscaler
from policy_strategies import Setup, setups
from reference import Reference, f32
from scaler_readings import counts
from twins import nan_equal

READY, UNSCALED, STEPPED = "ready", "unscaled", "stepped"
POISONS = st.sampled_from([float("inf"), float("-inf"), float("nan")])


class FuzzNet(torch.nn.Module):
    """Two layers, one per optimizer, and two heads that join later through add_param_group."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(3, 3)
        self.second = torch.nn.Linear(3, 1)
        self.extras = torch.nn.ModuleList([torch.nn.Linear(3, 1) for _ in range(2)])
        self.active = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x))
        out = self.second(hidden)
        for extra in self.extras[: self.active]:
            out = out + extra(hidden)
        return out


class Side:
    """One scaler with its own twin model and optimizers."""

    def __init__(self, scaler: Any, fused: bool) -> None:
        torch.manual_seed(0)
        self.model = FuzzNet()
        self.optimizers: list[torch.optim.Optimizer] = [
            torch.optim.SGD(self.model.first.parameters(), lr=0.05, momentum=0.9),
            torch.optim.Adam(self.model.second.parameters(), lr=0.01, fused=fused),
        ]
        self.scaler = scaler

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def opt_params(self, index: int) -> list[torch.Tensor]:
        return [p for group in self.optimizers[index].param_groups for p in group["params"]]


def _torch_compatible(setup: Setup) -> bool:
    cfg = setup.config
    return (cfg.hysteresis, cfg.min_scale, cfg.max_scale, cfg.dynamic) == (
        1,
        None,
        None,
        True,
    ) and setup.max_consecutive_skips is None


def _through_bytes(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


class ScalerMachine(RuleBasedStateMachine):
    @initialize(
        setup=st.one_of(setups(torch_compatible=True), setups()),
        fused=st.booleans(),
    )
    def start(self, setup: Setup, fused: bool) -> None:
        self.setup = setup
        self.fused = fused
        self.twin_policy = _torch_compatible(setup)
        self.ref = Reference(setup.config, setup.init_scale)
        self.ours = Side(ampscaler.GradScaler("cpu", **setup.scaler_kwargs()), fused)
        torch_kwargs: dict[str, Any] = {"init_scale": setup.init_scale}
        if self.twin_policy:
            cfg = setup.config
            torch_kwargs.update(
                growth_factor=cfg.growth_factor,
                backoff_factor=cfg.backoff_factor,
                growth_interval=cfg.growth_interval,
            )
        self.theirs = Side(torch.amp.GradScaler("cpu", **torch_kwargs), fused)
        self.sides = (self.ours, self.theirs)
        self.stages = [READY, READY]
        self.flagged = [False, False]  # inf/NaN seen when each optimizer was checked
        self.batches = 0
        self.mid_iteration = False  # a backward() since the last update()

    # ------------------------------------------------------------------ helpers

    def _all_ready(self) -> bool:
        return self.stages == [READY, READY]

    def _has_grads(self, index: int) -> bool:
        return any(p.grad is not None for p in self.ours.opt_params(index))

    def _nonfinite(self, index: int) -> bool:
        return any(
            not torch.isfinite(p.grad).all()
            for p in self.ours.opt_params(index)
            if p.grad is not None
        )

    def _assert_twins_equal(self) -> None:
        """Parameters and gradients equal bit for bit, NaN where torch has NaN (a gradient may
        hold NaN beside finite values), after skipped fused steps too: by default the fused
        route is torch's."""
        for index, (mine, other) in enumerate(
            zip(self.ours.params(), self.theirs.params(), strict=True)
        ):
            assert nan_equal(mine.detach(), other.detach()), f"parameter {index}"
            assert nan_equal(mine.grad, other.grad), f"gradient of parameter {index}"

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: self._all_ready())
    @rule(loss=st.sampled_from(["plain", "plain", "inf", "nan", "fp16-overflow"]))
    def backward(self, loss: str) -> None:
        data = torch.Generator().manual_seed(self.batches)
        self.batches += 1
        self.mid_iteration = True
        inputs, target = torch.randn(4, 3, generator=data), torch.randn(4, 1, generator=data)
        for side in self.sides:
            out = side.model(inputs).half().float()  # the gradient passes through float16
            value = (out - target).pow(2).mean()
            if loss == "fp16-overflow":
                value = value * 1e30
            elif loss in ("inf", "nan"):
                value = value * float(loss)
            side.scaler.scale(value).backward()

    @precondition(lambda self: self._all_ready())
    @rule(index=st.integers(0, 7), element=st.integers(0, 8), value=POISONS)
    def poison_grad(self, index: int, element: int, value: float) -> None:
        for side in self.sides:
            params = side.params()
            grad = params[index % len(params)].grad
            if grad is not None:
                grad.view(-1)[element % grad.numel()] = value

    @precondition(lambda self: self._all_ready())
    @rule(index=st.integers(0, 7))
    def grad_to_none(self, index: int) -> None:
        for side in self.sides:
            params = side.params()
            params[index % len(params)].grad = None

    @precondition(lambda self: self._all_ready() and self.ours.model.active < 2)
    @rule(index=st.integers(0, 1), lr=st.sampled_from([0.1, 0.001]))
    def add_param_group(self, index: int, lr: float) -> None:
        for side in self.sides:
            extra = side.model.extras[side.model.active]
            side.optimizers[index].add_param_group({"params": list(extra.parameters()), "lr": lr})
            side.model.active += 1

    @rule(index=st.integers(0, 1))
    def unscale(self, index: int) -> None:
        if not self.mid_iteration or self.stages[index] != READY or not self._has_grads(index):
            return
        self.flagged[index] = self._nonfinite(index)
        for side in self.sides:
            side.scaler.unscale_(side.optimizers[index])
        self.stages[index] = UNSCALED
        self._assert_twins_equal()

    @rule(index=st.integers(0, 1), max_norm=st.sampled_from([0.01, 1.0, 100.0]))
    def clip(self, index: int, max_norm: float) -> None:
        if self.stages[index] != UNSCALED:
            return
        for side in self.sides:
            torch.nn.utils.clip_grad_norm_(side.opt_params(index), max_norm)

    @rule(index=st.integers(0, 1))
    def step(self, index: int) -> None:
        if not self.mid_iteration or self.stages[index] == STEPPED or not self._has_grads(index):
            return
        if self.stages[index] == READY:
            self.flagged[index] = self._nonfinite(index)
        before = [p.detach().clone() for p in self.ours.params()]
        finite_before = [bool(torch.isfinite(p).all()) for p in before]
        for side in self.sides:
            side.scaler.step(side.optimizers[index])
        self.stages[index] = STEPPED
        assert self.ours.scaler.last_step_skipped is self.flagged[index]
        after = self.ours.params()
        if self.flagged[index]:
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        for was_finite, param in zip(finite_before, after, strict=True):
            assert not was_finite or torch.isfinite(param).all()
        self._assert_twins_equal()

    @precondition(lambda self: UNSCALED in self.stages or STEPPED in self.stages)
    @rule(
        new_scale=st.one_of(st.none(), st.sampled_from([1.0, 3.5, 256.0, 2.0**40])),
        as_tensor=st.booleans(),
    )
    def update(self, new_scale: float | None, as_tensor: bool) -> None:
        overflow = any(f for f, s in zip(self.flagged, self.stages, strict=True) if s != READY)
        if new_scale is not None:
            low, high = self.ref.bounds()
            new_scale = min(max(new_scale, low), high)
        self.ref.update(overflow, new_scale)
        limit = self.setup.max_consecutive_skips
        expect_error = limit is not None and self.ref.stats["consecutive_skips"] >= limit
        argument: Any = new_scale
        if new_scale is not None and as_tensor:
            argument = torch.tensor(new_scale)
        try:
            self.ours.scaler.update(argument)
            assert not expect_error
        except ampscaler.PersistentOverflowError:
            assert expect_error
        if self.twin_policy or new_scale is not None:
            self.theirs.scaler.update(argument)
        else:
            self.theirs.scaler.update(self.ours.scaler.get_scale())
        self.stages = [READY, READY]
        self.flagged = [False, False]
        self.mid_iteration = False

    @precondition(lambda self: self._all_ready())
    @rule(set_to_none=st.booleans())
    def zero_grad(self, set_to_none: bool) -> None:
        for side in self.sides:
            for optimizer in side.optimizers:
                optimizer.zero_grad(set_to_none=set_to_none)

    @precondition(lambda self: self._all_ready() and not self.mid_iteration)
    @rule(deep_copy=st.booleans())
    def round_trip(self, deep_copy: bool) -> None:
        if deep_copy:
            for side in self.sides:
                side.scaler = copy.deepcopy(side.scaler)
            return
        # Built with torch's defaults: the checkpoint's configuration must win.
        fresh = ampscaler.GradScaler("cpu")
        fresh.load_state_dict(_through_bytes(self.ours.scaler.state_dict()))
        self.ours.scaler = fresh
        theirs = torch.amp.GradScaler("cpu")
        theirs.load_state_dict(_through_bytes(self.theirs.scaler.state_dict()))
        self.theirs.scaler = theirs

    # ------------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_reference_and_twin(self) -> None:
        if not hasattr(self, "ref"):
            return
        self._assert_twins_equal()  # after every rule, not only after unscale_ and step
        scaler = self.ours.scaler
        assert scaler.get_scale() == self.theirs.scaler.get_scale()
        # Before the first scale() both report init_scale as given, not yet rounded to float32.
        assert f32(scaler.get_scale()) == self.ref.scale
        stats = counts(scaler)
        assert stats.as_dict() == self.ref.stats
        assert stats.skipped <= stats.steps and stats.growths + stats.backoffs <= stats.steps
        assert stats.consecutive_skips <= stats.skipped
        low, high = self.ref.bounds()
        assert low <= f32(scaler.get_scale()) <= high
        if self._all_ready():
            saved = scaler.state_dict()
            assert saved["_growth_tracker"] == self.ref.tracker
            if self.setup.config.hysteresis > 1:
                assert saved["_hysteresis_tracker"] == self.ref.budget
            if self.twin_policy:
                assert self.theirs.scaler.state_dict() == {
                    key: saved[key] for key in self.theirs.scaler.state_dict()
                }


ScalerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow],
)
TestScalerMachine = ScalerMachine.TestCase
