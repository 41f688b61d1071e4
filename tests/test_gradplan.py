"""Opt-in flat gradient buffers (ampscaler.grads.flat, ``flat_grads=True``) never change results.

Training loops that keep their gradient tensors (``zero_grad(set_to_none=False)``) get a plan:
gradients moved into flat buffers, checked once per buffer. Each test runs the same loop with
ampscaler's and torch's scaler side by side and compares parameters, scale, growth tracker and
step results bit for bit after every step, while the loop changes what the plan remembered:
a new parameter group, gradients set to None and back, a gradient replaced by a new tensor,
``.data`` of a gradient reassigned (same object, new storage, another dtype), parameters
reordered. The trace also records whether a plan was in use, so each test checks that the plan
existed before the change and was dropped by it.
"""

from __future__ import annotations

import copy
import pickle
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import ampscaler
from ampscaler.grads import flat
from ampscaler.grads.flat import GradPlanner
from twins import Trace, assert_same_trace

STEPS = 8


@pytest.fixture(autouse=True)
def flatten_few(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanics are tested on small models: flatten from two gradients on (the tests of
    when flattening pays keep the real thresholds)."""
    if "real_thresholds" not in request.keywords:
        monkeypatch.setattr(flat, "MIN_FLATTENED", 2)


class Net(torch.nn.Module):
    """A body trained from the start and a head that may join the optimizer later."""

    held: list[torch.Tensor]  # gradients or views of them that a test keeps across steps

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh()
        )
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)


Event = Callable[[Net, torch.optim.Optimizer], None]


@dataclass
class PlanTrace(Trace):
    planned: list[bool] = field(default_factory=list)  # a plan was in use after the step


def make_optimizer(params: list[torch.nn.Parameter], kind: str) -> torch.optim.Optimizer:
    if kind == "adam-fused":
        return torch.optim.Adam(params, lr=1e-2, fused=True)
    return torch.optim.SGD(params, lr=5e-2, momentum=0.9)


def run(
    factory: Callable[..., Any],
    kind: str,
    *,
    before_step: dict[int, Event] | None = None,
    after_step: dict[int, Event] | None = None,
    poison_steps: tuple[int, ...] = (3,),
    set_to_none: Callable[[int], bool] = lambda step: False,
    train_head: bool = True,
) -> PlanTrace:
    """Train ``Net`` for STEPS steps; events run after backward / after zero_grad."""
    torch.manual_seed(0)
    model = Net()
    params = [*model.body.parameters(), *(model.head.parameters() if train_head else ())]
    opt = make_optimizer(params, kind)
    flat = {"flat_grads": True} if factory is ampscaler.GradScaler else {}
    scaler = factory("cpu", init_scale=2.0**10, growth_interval=2, **flat)
    gen = torch.Generator().manual_seed(1)
    trace = PlanTrace()
    for step in range(STEPS):
        x = torch.randn(5, 6, generator=gen)
        y = torch.randn(5, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(((out.float() - y) ** 2).mean()).backward()
        if step in poison_steps:
            model.body[0].weight.grad[0, 0] = float("inf")
        if before_step and step in before_step:
            before_step[step](model, opt)
        trace.returns.append(scaler.step(opt))
        scaler.update()
        planner = getattr(scaler, "_planner", None)
        entry = None if planner is None else planner._entries.get(opt)
        trace.planned.append(entry is not None and entry.plan is not None)
        opt.zero_grad(set_to_none=set_to_none(step))
        if after_step and step in after_step:
            after_step[step](model, opt)
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.scales.append(scaler.get_scale())
        trace.trackers.append(scaler._get_growth_tracker())
    return trace


def side_by_side(kind: str, **kwargs: Any) -> PlanTrace:
    ours = run(ampscaler.GradScaler, kind, **kwargs)
    assert_same_trace(ours, run(torch.amp.GradScaler, kind, **kwargs))
    return ours


KINDS = ["sgd", "adam-fused"]


@pytest.mark.parametrize("kind", KINDS)
def test_kept_gradients_get_a_flat_plan_and_match_torch(kind: str) -> None:
    trace = side_by_side(kind)
    assert trace.planned[1:] == [True] * (STEPS - 1)
    assert trace.scales[3] < trace.scales[2]  # the poisoned step was skipped with a plan


def test_planned_gradients_move_into_one_buffer_and_stay_the_same_tensors() -> None:
    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(3)]
    grads = [torch.full((2, 3), float(i)) for i in range(3)]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    first = planner.groups(opt, allow_fp16=False)
    assert first[torch.device("cpu")][torch.float32] == grads  # first sighting: no plan
    (flat,) = planner.groups(opt, allow_fp16=False)[torch.device("cpu")][torch.float32]
    assert flat.shape == (18,)
    for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
        assert param.grad is grad and grad._base is None and grad.shape == (2, 3)
        assert grad.data_ptr() == flat.data_ptr() + index * 6 * flat.element_size()
        assert torch.equal(grad, torch.full((2, 3), float(index)))
    flat.mul_(2.0)  # the buffer is the gradients' memory
    assert torch.equal(params[2].grad, torch.full((2, 3), 4.0))


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_references_held_by_the_loop_stay_valid(kind: str) -> None:
    def hold(model: Net, opt: torch.optim.Optimizer) -> None:
        model.held = [p.grad for p in model.body.parameters()]

    def halve_held(model: Net, opt: torch.optim.Optimizer) -> None:
        for grad in model.held:  # edits through references taken before the plan moved them
            grad.mul_(0.5)

    trace = side_by_side(kind, before_step={0: hold, 5: halve_held, 6: halve_held})
    assert trace.planned[4:] == [True] * (STEPS - 4)


@pytest.mark.parametrize("kind", KINDS)
def test_a_gradient_with_a_view_held_elsewhere_stays_put(kind: str) -> None:
    def take_view(model: Net, opt: torch.optim.Optimizer) -> None:
        model.held = [model.body[2].weight.grad.view(-1)]

    def edit_view(model: Net, opt: torch.optim.Optimizer) -> None:
        model.held[0].add_(1.0)

    trace = side_by_side(kind, before_step={0: take_view, 5: edit_view})
    assert trace.planned[1:] == [True] * (STEPS - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_add_param_group_mid_training(kind: str) -> None:
    def add_head(model: Net, opt: torch.optim.Optimizer) -> None:
        opt.add_param_group({"params": list(model.head.parameters())})

    trace = side_by_side(kind, after_step={4: add_head}, train_head=False)
    assert trace.planned[4] and not trace.planned[5]


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_set_to_none_then_kept_again(kind: str) -> None:
    trace = side_by_side(kind, set_to_none=lambda step: step == 3)
    assert trace.planned[3] and not trace.planned[4]
    assert trace.planned[-1]  # planned again once the gradients were kept for a while


@pytest.mark.parametrize("kind", KINDS)
def test_a_gradient_replaced_by_a_new_tensor(kind: str) -> None:
    def replace(model: Net, opt: torch.optim.Optimizer) -> None:
        model.body[2].weight.grad = model.body[2].weight.grad.clone()

    trace = side_by_side(kind, before_step={4: replace})
    assert trace.planned[3] and not trace.planned[4]


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_data_reassigned_in_place_of_the_same_object(kind: str) -> None:
    def reassign(model: Net, opt: torch.optim.Optimizer) -> None:
        grad = model.body[0].weight.grad
        grad.data = grad.data.clone()

    trace = side_by_side(kind, before_step={4: reassign})
    assert trace.planned[3] and not trace.planned[4]


@pytest.mark.parametrize("kind", KINDS)
def test_moved_gradient_rebound_with_set_(kind: str) -> None:
    """Rebinding a moved gradient's memory lowers the buffer's use count: the plan drops."""

    def rebind(model: Net, opt: torch.optim.Optimizer) -> None:
        grad = model.body[2].bias.grad
        grad.set_(grad.clone())

    trace = side_by_side(kind, before_step={5: rebind})
    assert trace.planned[4] and not trace.planned[5]


@pytest.mark.parametrize("kind", KINDS)
def test_a_view_taken_after_the_plan_drops_it_and_results_still_match(kind: str) -> None:
    def take_view(model: Net, opt: torch.optim.Optimizer) -> None:
        model.held = [model.body[0].weight.grad.view(-1)]

    def edit_view(model: Net, opt: torch.optim.Optimizer) -> None:
        model.held[0].add_(1.0)

    trace = side_by_side(kind, before_step={4: take_view, 6: edit_view})
    assert trace.planned[3] and not trace.planned[4]


def test_a_gradient_that_changes_dtype() -> None:
    def to_double(model: Net, opt: torch.optim.Optimizer) -> None:
        grad = model.body[0].weight.grad
        grad.data = grad.data.double()

    trace = side_by_side("sgd", before_step={4: to_double})
    assert trace.planned[3] and not trace.planned[4]


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_reordered_in_their_group(kind: str) -> None:
    def swap(model: Net, opt: torch.optim.Optimizer) -> None:
        params = opt.param_groups[0]["params"]
        params[0], params[2] = params[2], params[0]

    trace = side_by_side(kind, after_step={4: swap})
    assert trace.planned[4] and not trace.planned[5]


def test_replaced_gradients_every_step_match_torch_and_rarely_plan() -> None:
    builds = []
    original = ampscaler.grads.flat.build_plan

    def counting(*args: Any) -> Any:
        builds.append(1)
        return original(*args)

    ampscaler.grads.flat.build_plan = counting  # type: ignore[assignment]
    try:
        side_by_side("sgd", set_to_none=lambda step: True)
    finally:
        ampscaler.grads.flat.build_plan = original  # type: ignore[assignment]
    # Ids of freed gradients may be reused, which can look like kept gradients; each wrong
    # guess doubles the wait for the next one.
    assert len(builds) <= 3


def test_a_dropped_plan_frees_its_buffer() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    for _ in range(2):
        for param in params:
            param.grad = param.grad if param.grad is not None else torch.ones(4)
        groups = planner.groups(opt, allow_fp16=False)
    buffer = weakref.ref(groups[torch.device("cpu")][torch.float32][0])
    del groups
    opt.zero_grad(set_to_none=True)
    for param in params:
        param.grad = torch.ones(4)
    planner.groups(opt, allow_fp16=False)
    assert buffer() is None


def test_fp16_gradients_planned_on_the_fused_path_still_refuse_unscale() -> None:
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)) for _ in range(2)]
    for param in params:
        param.grad = torch.ones(3, dtype=torch.float16)
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    planner.groups(opt, allow_fp16=True)
    groups = planner.groups(opt, allow_fp16=True)
    assert list(groups[torch.device("cpu")]) == [torch.float16]
    with pytest.raises(ValueError, match="FP16"):
        planner.groups(opt, allow_fp16=False)


def test_shared_gradient_objects_are_not_moved() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    shared = torch.ones(3)
    for param in params:
        param.grad = shared
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    planner.groups(opt, allow_fp16=False)
    groups = planner.groups(opt, allow_fp16=False)
    # Torch unscales a gradient listed twice twice; so does a plan that keeps both entries.
    assert groups[torch.device("cpu")][torch.float32] == [shared, shared]
    assert all(param.grad is shared for param in params)


def test_unhashable_optimizer_is_grouped_every_time() -> None:
    class Unhashable(torch.optim.SGD):
        def __eq__(self, other: object) -> bool:
            return self is other

    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    opt = Unhashable([param], lr=0.1)
    planner = GradPlanner()
    for _ in range(3):
        assert planner.groups(opt, allow_fp16=False)[torch.device("cpu")][torch.float32] == [
            param.grad
        ]


def test_scaler_with_a_plan_copies_and_pickles_without_it() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", flat_grads=True)
    for _ in range(3):
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=False)
    assert scaler._planner is not None and scaler._planner._entries[opt].plan is not None
    for clone in (copy.deepcopy(scaler), pickle.loads(pickle.dumps(scaler))):
        assert clone._planner is not None and len(clone._planner._entries) == 0
        assert clone.get_scale() == scaler.get_scale()


def test_tensor_subclass_gradients_get_no_plan() -> None:
    class Tagged(torch.Tensor):
        pass

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for param in params:
        param.grad = torch.Tensor._make_subclass(Tagged, torch.ones(3))
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    for _ in range(3):
        groups = planner.groups(opt, allow_fp16=False)
    assert planner._entries[opt].plan is None
    assert groups[torch.device("cpu")][torch.float32] == [p.grad for p in params]


def test_after_a_change_the_gradients_move_into_one_new_buffer() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    for param in params:
        param.grad = torch.ones(3)
    opt = torch.optim.SGD(params, lr=0.1)
    planner = GradPlanner()
    planner.groups(opt, allow_fp16=False)
    (old,) = planner.groups(opt, allow_fp16=False)[torch.device("cpu")][torch.float32]
    old_memory = old.untyped_storage().data_ptr()
    del old  # a reference to the buffer held here would keep the other two where they are
    params[1].grad = torch.full((3,), 2.0)  # the other two still lie in the old buffer
    shapes = []
    for _ in range(4):  # dropped once, so re-planned after two unchanged sightings
        groups = planner.groups(opt, allow_fp16=False)[torch.device("cpu")][torch.float32]
        shapes.append([tuple(t.shape) for t in groups])
    assert shapes == [[(3,)] * 3, [(3,)] * 3, [(9,)], [(9,)]]
    (new,) = groups
    assert new.untyped_storage().data_ptr() != old_memory
    assert torch.equal(new, torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0]))


@pytest.mark.parametrize("kind", KINDS)
def test_by_default_no_gradient_moves(kind: str) -> None:
    """Without flat_grads=True the user's gradient memory stays where backward() put it, and
    the check still runs on the gradients themselves."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(list(model.parameters()), kind)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**10)
    pointers: list[int] = []
    for step in range(6):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(5, 6))
        scaler.scale(out.float().pow(2).mean()).backward()
        now = [p.grad.data_ptr() for p in model.parameters() if p.grad is not None]
        assert not pointers or now == pointers, step
        pointers = now
        scaler.step(opt)
        scaler.update()
        assert [p.grad.data_ptr() for p in model.parameters() if p.grad is not None] == pointers
        opt.zero_grad(set_to_none=False)
    assert scaler._planner is None


def _planned_after_two_steps(count: int, size: int) -> bool:
    params = [torch.nn.Parameter(torch.zeros(size)) for _ in range(count)]
    for param in params:
        param.grad = torch.ones(size)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = ampscaler.GradScaler("cpu", flat_grads=True)
    scaler.scale(torch.tensor(1.0))
    for _ in range(3):
        scaler.step(optimizer)
        scaler.update()
    entry = scaler._planner._entries[optimizer] if scaler._planner else None
    return entry is not None and entry.plan is not None


@pytest.mark.real_thresholds
def test_flattening_happens_only_where_it_pays() -> None:
    """Many small gradients are flattened; a few large ones, or a handful of small ones, are
    checked as they are (what the defaults do), so the option is never slower than them."""
    assert _planned_after_two_steps(64, 1000)
    assert not _planned_after_two_steps(8, 1000)  # too few to save anything
    assert not _planned_after_two_steps(20, 2**17)  # large: the fixed cost per tensor is noise


@pytest.mark.real_thresholds
def test_where_flattening_cannot_pay_the_gradients_are_not_followed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A few large gradients: the planner does not read them step after step looking for a
    plan it would refuse (what made ``flat_grads=True`` dearer than the defaults there). Once
    the parameters change so that it could pay, it looks again, and flattens."""
    built: list[torch.optim.Optimizer] = []

    def counted(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> Any:
        built.append(optimizer)
        return build_plan(optimizer, allow_fp16)

    build_plan = flat.build_plan
    monkeypatch.setattr(flat, "build_plan", counted)
    large = [torch.nn.Parameter(torch.zeros(2**17)) for _ in range(20)]
    optimizer = torch.optim.SGD(large, lr=0.1)
    scaler = ampscaler.GradScaler("cpu", flat_grads=True, growth_interval=100)

    def step(params: list[torch.nn.Parameter]) -> None:
        for param in params:
            param.grad = torch.ones_like(param) if param.grad is None else param.grad.fill_(1.0)
        scaler.scale(torch.tensor(1.0))
        scaler.step(optimizer)
        scaler.update()
        for param in params:  # checked and unscaled, planned or not
            assert torch.equal(param.grad, torch.full_like(param, 2.0**-16))

    for _ in range(8):
        step(large)
    entry = scaler._planner._entries[optimizer] if scaler._planner else None
    assert entry is not None and not entry.could_pay
    assert built == [] and entry.last_ids == [] and entry.plan is None
    small = [torch.nn.Parameter(torch.zeros(100)) for _ in range(32)]
    optimizer.add_param_group({"params": small})
    for _ in range(3):
        step(large + small)
    assert entry.could_pay and built and entry.plan is not None
