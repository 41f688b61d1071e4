"""nerfstudio's trainer driving one scaler over one optimizer per parameter group, re-created:
ampscaler's against torch's, bit for bit.

nerfstudio is not installed here; this file re-creates, in its own words, what
``nerfstudio/engine/trainer.py`` and ``nerfstudio/engine/optimizers.py`` do with the scaler:

- ``self.grad_scaler = GradScaler(enabled=self.use_grad_scaler)``, the name imported with
  ``from torch.cuda.amp.grad_scaler import GradScaler``; mixed precision is turned off on the
  CPU, so a CPU run builds a disabled scaler;
- ``Optimizers``: one optimizer (Adam) and one scheduler per parameter group ("fields",
  "proposal_networks", "camera_opt"), each with an optional ``max_norm``;
- ``train_iteration(step)``: ``zero_grad_some`` for the groups whose accumulation starts
  (``step % gradient_accumulation_steps[group] == 0``), the loss (a ``functools.reduce`` sum of
  a loss dict) under ``torch.autocast``, ``grad_scaler.scale(loss).backward()``, then
  ``optimizer_scaler_step_some`` for the groups whose accumulation ends: ``unscale_`` and
  ``clip_grad_norm_`` where ``max_norm`` is set, and ``step`` only if some parameter of the
  group has a gradient (the camera optimizer's may have none); then ``scale =
  grad_scaler.get_scale()``, ``grad_scaler.update()``, and the schedulers stepped only ``if scale
  <= grad_scaler.get_scale()`` (no step on a backoff); older versions: ``optimizer_scaler_step_all``
  and the schedulers every iteration;
- ``save_checkpoint``: ``{"step", "pipeline", "optimizers", "schedulers" (1.x), "scalers":
  grad_scaler.state_dict()}`` through ``torch.save``; ``_load_checkpoint``: ``torch.load`` (safe
  by default in torch >= 2.6) and ``grad_scaler.load_state_dict(loaded_state["scalers"])`` into
  the trainer's fresh scaler.

Why it matters: ``update()`` runs every iteration, also when accumulation stepped no optimizer
(torch's scaler then fails; ampscaler must fail the same way), groups are unscaled and stepped
independently, the schedules follow the scale read before and after ``update()``, and a
checkpoint from a CPU (disabled) run is an empty dict that an enabled scaler refuses.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
STEPS = 12
INF_AT = {4: "fields", 7: "proposal_networks"}  # an inf in that group's gradient
CAMERA_FROM = 3  # the camera parameters get gradients from this step on
MAX_NORM = {"fields": None, "proposal_networks": 1.0, "camera_opt": 0.5}


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fields = torch.nn.Sequential(
            torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
        )
        self.proposal = torch.nn.Linear(3, 1)
        self.camera = torch.nn.Parameter(torch.zeros(2, 3))

    def param_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        return {
            "fields": list(self.fields.parameters()),
            "proposal_networks": list(self.proposal.parameters()),
            "camera_opt": [self.camera],
        }

    def loss_dict(self, rays: torch.Tensor, target: torch.Tensor, step: int) -> dict[str, Any]:
        if step >= CAMERA_FROM:
            rays = rays + self.camera.sum(0)
        rgb = self.fields(rays)
        density = self.proposal(rays)
        return {
            "rgb_loss": torch.nn.functional.mse_loss(rgb.float(), target),
            "interlevel_loss": (density.float() ** 2).mean() * 0.1,
        }


class Optimizers:
    """nerfstudio's Optimizers: one Adam and one scheduler per parameter group."""

    def __init__(self, groups: dict[str, list[torch.nn.Parameter]]) -> None:
        self.parameters = groups
        self.optimizers = {
            name: torch.optim.Adam(ps, lr=1e-2, eps=1e-15) for name, ps in groups.items()
        }
        self.schedulers = {
            name: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.97**s)
            for name, o in self.optimizers.items()
        }

    def zero_grad_some(self, names: list[str]) -> None:
        for name in names:
            self.optimizers[name].zero_grad()

    def optimizer_scaler_step_some(self, grad_scaler: Any, names: list[str]) -> None:
        for name in names:
            optimizer = self.optimizers[name]
            if MAX_NORM[name] is not None:
                grad_scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(self.parameters[name], MAX_NORM[name])
            if any(any(p.grad is not None for p in g["params"]) for g in optimizer.param_groups):
                grad_scaler.step(optimizer)

    def scheduler_step_all(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.step()


class Trainer:
    def __init__(
        self, factory: Factory, mixed_precision: bool, accumulation: dict[str, int]
    ) -> None:
        torch.manual_seed(0)
        self.model = Model()
        self.optimizers = Optimizers(self.model.param_groups())
        self.grad_scaler = factory(enabled=mixed_precision)
        self.mixed_precision = mixed_precision
        self.accumulation = accumulation
        self.start_step = 0
        self.trace = Trace()

    def train_iteration(self, step: int, rays: torch.Tensor, target: torch.Tensor) -> None:
        groups = list(self.optimizers.parameters)
        self.optimizers.zero_grad_some([g for g in groups if step % self.accumulation[g] == 0])
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.mixed_precision):
            loss_dict = self.model.loss_dict(rays, target, step)
            loss = functools.reduce(torch.add, loss_dict.values())
        self.grad_scaler.scale(loss).backward()
        if step in INF_AT:
            group = self.optimizers.parameters[INF_AT[step]]
            group[0].grad.view(-1)[0] = float("inf")
        needs_step = [g for g in groups if step % self.accumulation[g] == self.accumulation[g] - 1]
        self.optimizers.optimizer_scaler_step_some(self.grad_scaler, needs_step)
        scale = self.grad_scaler.get_scale()
        self.grad_scaler.update()
        stepped_schedule = scale <= self.grad_scaler.get_scale()
        if stepped_schedule:
            self.optimizers.scheduler_step_all()
        self.trace.params.append([p.detach().clone() for p in self.model.parameters()])
        self.trace.scales.append(self.grad_scaler.get_scale())
        enabled = self.grad_scaler.is_enabled()
        self.trace.trackers.append(self.grad_scaler._get_growth_tracker() if enabled else 0)
        counts = [
            len(o.state) and int(next(iter(o.state.values()))["step"])
            for o in self.optimizers.optimizers.values()
        ]
        self.trace.returns.append((stepped_schedule, counts))

    def save_checkpoint(self, step: int) -> bytes:
        buffer = io.BytesIO()
        torch.save(
            {
                "step": step,
                "pipeline": self.model.state_dict(),
                "optimizers": {k: v.state_dict() for k, v in self.optimizers.optimizers.items()},
                "schedulers": {k: v.state_dict() for k, v in self.optimizers.schedulers.items()},
                "scalers": self.grad_scaler.state_dict(),
            },
            buffer,
        )
        return buffer.getvalue()

    def load_checkpoint(self, saved: bytes) -> None:
        loaded_state = torch.load(io.BytesIO(saved), map_location="cpu")  # weights_only
        self.start_step = loaded_state["step"] + 1
        self.model.load_state_dict(loaded_state["pipeline"])
        for key, value in loaded_state["optimizers"].items():
            self.optimizers.optimizers[key].load_state_dict(value)
        for key, value in loaded_state["schedulers"].items():
            self.optimizers.schedulers[key].load_state_dict(value)
        self.grad_scaler.load_state_dict(loaded_state["scalers"])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 3, generator=data), torch.rand(16, 3, generator=data))
        for _ in range(STEPS)
    ]


def train(
    factory: Factory,
    mixed_precision: bool = True,
    accumulation: dict[str, int] | None = None,
    stop_at: int | None = None,
    resume: tuple[Factory, bytes] | None = None,
) -> tuple[Trainer, bytes | None]:
    """Trainer.train(): from scratch, or from a checkpoint; a checkpoint at ``stop_at``."""
    accumulation = accumulation or {"fields": 1, "proposal_networks": 2, "camera_opt": 1}
    trainer = Trainer(resume[0] if resume else factory, mixed_precision, accumulation)
    if resume is not None:
        trainer.load_checkpoint(resume[1])
    saved = None
    for step, (rays, target) in enumerate(batches()):
        if step < trainer.start_step:
            continue
        trainer.train_iteration(step, rays, target)
        if step == stop_at:
            saved = trainer.save_checkpoint(step)
            break
    return trainer, saved


def torch_scaler(**kwargs: Any) -> Any:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, **kwargs)


def our_scaler(**kwargs: Any) -> Any:
    return ampscaler.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, **kwargs)


def patched_scaler(**kwargs: Any) -> Any:
    from torch.cuda.amp.grad_scaler import GradScaler  # nerfstudio's import, made while patched

    return GradScaler(init_scale=2.0**10, growth_interval=2, **kwargs)


def recorded(run: Callable[[], Trainer]) -> tuple[Trainer, list[str]]:
    """``run()``'s trainer and the warnings it raised (torch.cuda.amp's deprecation left out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = run()
    return trainer, [f"{w.message}" for w in caught if w.category is not FutureWarning]


@pytest.mark.parametrize("mixed_precision", [True, False], ids=["amp", "cpu-disabled"])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_train_iterations_match_torch(mixed_precision: bool, how: str) -> None:
    theirs, torch_warnings = recorded(lambda: train(torch_scaler, mixed_precision)[0])
    if how == "patched":
        with ampscaler.patch_torch(device="cpu"):
            ours, our_warnings = recorded(lambda: train(patched_scaler, mixed_precision)[0])
        assert isinstance(ours.grad_scaler, ampscaler.GradScaler)
    else:
        ours, our_warnings = recorded(lambda: train(our_scaler, mixed_precision)[0])
    assert_same_trace(ours.trace, theirs.trace)
    # the schedulers of the optimizers not stepped yet warn at their first step(), alike
    assert our_warnings == torch_warnings and len(torch_warnings) == 2
    schedule = [stepped for stepped, _ in theirs.trace.returns]
    if mixed_precision:
        # each inf backed the scale off and held every schedule; growths (every 2nd clean
        # update) did not; the proposal group steps every 2nd iteration, the camera's from 3 on
        assert schedule[4] is False and schedule[7] is False and all(schedule[:4])
        counts = [c for _, c in theirs.trace.returns]
        assert counts[3] == [4, 2, 1] and counts[4] == [4, 2, 2] and counts[7] == [7, 3, 5]
    else:
        assert all(schedule) and set(theirs.trace.scales) == {1.0}


@pytest.mark.parametrize("direction", ["ours", "torch-to-ours", "ours-to-torch"])
def test_a_checkpoint_resumes_as_torchs(direction: str) -> None:
    """Saved at step 5 (after a backoff and a growth), resumed by a new trainer: the rest
    of the run is the uninterrupted one, with the scaler classes mixed either way."""
    first, then = {
        "ours": (our_scaler, our_scaler),
        "torch-to-ours": (torch_scaler, our_scaler),
        "ours-to-torch": (our_scaler, torch_scaler),
    }[direction]
    whole, _ = train(torch_scaler)
    _, saved = train(first, stop_at=5)
    assert saved is not None
    resumed, _ = train(first, resume=(then, saved))
    assert_same_trace(resumed.trace, Trace(
        params=whole.trace.params[6:], scales=whole.trace.scales[6:],
        trackers=whole.trace.trackers[6:], returns=whole.trace.returns[6:],
    ))  # fmt: skip


def test_accumulating_every_group_fails_at_the_first_update_as_torchs() -> None:
    """Every group accumulating two iterations: the first update() follows no step() and
    torch's scaler raises its AssertionError; so does ampscaler's, and the parameters are
    untouched either way."""
    every = {"fields": 2, "proposal_networks": 2, "camera_opt": 2}
    raised = []
    for factory in (torch_scaler, our_scaler):
        with pytest.raises(AssertionError, match="No inf checks were recorded") as error:
            train(factory, accumulation=every)
        raised.append(type(error.value).__name__)
    assert raised[0] == "AssertionError"


def test_a_cpu_checkpoint_is_refused_by_an_enabled_scaler_as_torchs() -> None:
    """A run on the CPU saves its disabled scaler's state, ``{}``; resuming it with mixed
    precision on fails in load_state_dict() with torch's RuntimeError; a disabled scaler loads
    it (nothing to load)."""
    for factory in (torch_scaler, our_scaler):
        _, saved = train(factory, mixed_precision=False, stop_at=2)
        assert saved is not None
        assert torch.load(io.BytesIO(saved))["scalers"] == {}
        with pytest.raises(RuntimeError, match="The source state dict is empty"):
            train(factory, resume=(factory, saved))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the schedulers' order warning
            resumed, _ = train(factory, mixed_precision=False, resume=(factory, saved))
        assert resumed.trace.scales == [1.0] * (STEPS - 3)


def test_a_caught_no_inf_checks_error_then_the_next_iteration_as_torchs() -> None:
    """Only the camera group (max_norm set, no gradients yet) due to step: unscale_() of it,
    no step(), update() raises; a loop that catches that and goes on trains as torch's. (The
    next scale() was refused: ampscaler refuses scale() after an unscale_() not followed by
    step(), and update(), the way its error gave to end such an iteration, raised again. An
    unscale_() that found no gradient unscaled nothing, so that scale() is taken now.)"""
    scales = []
    for factory in (torch_scaler, our_scaler):
        torch.manual_seed(0)
        model = Model()
        optimizers = Optimizers(model.param_groups())
        scaler = factory(enabled=True)
        for step, (rays, target) in enumerate(batches()[:3]):
            optimizers.zero_grad_some(["fields", "proposal_networks"])
            with torch.autocast("cpu", dtype=torch.float16):
                loss = functools.reduce(torch.add, model.loss_dict(rays, target, 0).values())
            scaler.scale(loss).backward()
            due = ["camera_opt"] if step == 0 else ["fields", "proposal_networks"]
            optimizers.optimizer_scaler_step_some(scaler, due)
            with contextlib.suppress(AssertionError):  # "No inf checks were recorded"
                scaler.update()
        scales.append(scaler.get_scale())
    assert scales[1] == scales[0]
