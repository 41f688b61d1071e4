"""The fused-optimizer path: torch's route by default, and the opt-in one-pass route.

By default ampscaler checks a fused optimizer's gradients as torch does (multiplying by 1) and
lets the kernel divide by ``grad_scale``. With ``one_pass_fused=True``, when the scale is known
to be ``2**e`` (``e >= -126``), it multiplies the gradients by ``1/scale`` in the check pass and
hands the optimizer ``grad_scale=None``. Both must give torch's parameters, optimizer state and
(after clean steps) gradients, bit for bit. Every test here also asserts which route was taken,
so a silently disabled fast path fails too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import ampscaler

FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}

Routes = list[str]


def _one_pass(*args: Any, **kwargs: Any) -> ampscaler.GradScaler:
    """A scaler with the opt-in one-pass route."""
    return ampscaler.GradScaler(*args, one_pass_fused=True, **kwargs)


def _record_routes(optimizer: torch.optim.Optimizer, routes: Routes) -> None:
    """Note, at every optimizer step, whether a scaler handed it a grad_scale."""

    def note(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if hasattr(opt, "found_inf"):
            routes.append("kernel" if opt.grad_scale is not None else "check")

    optimizer.register_step_pre_hook(note)


def _train(
    factory: Callable[..., Any],
    make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    dtype: torch.dtype = torch.float32,
    steps: int = 12,
    overflow_at: tuple[int, ...] = (3, 7),
    scaler_kwargs: dict[str, Any] | None = None,
    between: Callable[[Any, int], None] | None = None,
    read_scale: bool = True,
    before: dict[str, Callable[[Any, int], None]] | None = None,
) -> tuple[list[torch.Tensor], Routes]:
    """Train a tiny model; return parameters, optimizer state, gradients (after clean steps)
    and, with ``read_scale``, the scale after each step; and the route of each step.
    ``between(scaler, step)`` runs after each iteration, ``before["step"]`` and
    ``before["update"]`` before those calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model.to(dtype)
    opt = make_opt(list(model.parameters()))
    routes: Routes = []
    _record_routes(opt, routes)
    scaler = factory("cpu", **(scaler_kwargs or {"init_scale": 2.0**10, "growth_interval": 2}))
    gen = torch.Generator().manual_seed(1)
    trace: list[torch.Tensor] = []
    for step in range(steps):
        x = torch.randn(4, 5, generator=gen).to(dtype)
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if step in overflow_at:
            model[0].weight.grad[0, 0] = float("inf")
        (before or {}).get("step", lambda scaler, step: None)(scaler, step)
        scaler.step(opt)
        (before or {}).get("update", lambda scaler, step: None)(scaler, step)
        scaler.update()
        trace += [p.detach().clone() for p in model.parameters()]
        trace += [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        if step not in overflow_at:
            trace += [p.grad.clone() for p in model.parameters()]
        if read_scale:
            trace.append(torch.tensor(scaler.get_scale()))
        if between is not None:
            between(scaler, step)
        opt.zero_grad(set_to_none=False)
    return trace, routes


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.dtype == y.dtype and torch.equal(x.nan_to_num(), y.nan_to_num()), index
        assert torch.equal(x.isnan(), y.isnan()), index


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_unscaling_in_the_check_matches_torch(name: str, dtype: torch.dtype) -> None:
    ours, routes = _train(_one_pass, FUSED[name], dtype=dtype)
    theirs, torch_routes = _train(torch.amp.GradScaler, FUSED[name], dtype=dtype)
    _assert_same(ours, theirs)
    assert routes == ["check"] * 12
    assert torch_routes == ["kernel"] * 12


@pytest.mark.parametrize(
    ("why", "kwargs"),
    [
        ("scale not a power of two", {"init_scale": 3.0e3, "growth_interval": 2}),
        ("growth factor not a power of two", {"init_scale": 2.0**10, "growth_factor": 3.0}),
        ("backoff factor not a power of two", {"init_scale": 2.0**10, "backoff_factor": 0.3}),
        ("max_scale not a power of two", {"init_scale": 2.0**10, "max_scale": 5000.0}),
    ],
)
def test_other_scales_take_torchs_route(why: str, kwargs: dict[str, Any]) -> None:
    ours, routes = _train(_one_pass, FUSED["adam"], scaler_kwargs=kwargs)
    assert routes == ["kernel"] * 12, why
    if "max_scale" not in kwargs:  # an option torch's scaler does not have
        theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"], scaler_kwargs=kwargs)
        _assert_same(ours, theirs)


def test_power_of_two_bounds_keep_the_fast_route() -> None:
    kwargs = {"init_scale": 2.0**10, "min_scale": 2.0**8, "max_scale": 2.0**12}
    _, routes = _train(_one_pass, FUSED["adam"], scaler_kwargs=kwargs)
    assert routes == ["check"] * 12


def test_the_route_follows_scales_set_by_hand() -> None:
    def set_scale(scaler: Any, step: int) -> None:
        if step == 3:
            scaler.update(3000.0)  # not a power of two: torch's route from here
        if step == 7:
            scaler.update(torch.tensor(2.0**9))  # a power of two again
        if step == 9:
            scaler.set_growth_factor(3.0)  # could leave powers of two: torch's route

    ours, routes = _train(_one_pass, FUSED["adam"], between=set_scale)
    theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"], between=set_scale)
    _assert_same(ours, theirs)
    assert routes == ["check"] * 4 + ["kernel"] * 4 + ["check"] * 2 + ["kernel"] * 2


def _write_scale(at: dict[int, float]) -> Callable[[Any, int], None]:
    def write(scaler: Any, step: int) -> None:
        if step in at:
            scaler._scale.fill_(at[step])  # torch's private tensor, written in place

    return write


@pytest.mark.parametrize("when", ["between iterations", "before step", "before update"])
def test_a_scale_written_through_torchs_private_tensor_leaves_the_fast_route(when: str) -> None:
    """A write the scaler did not make is seen without reading the device (the tensor's
    version counter): torch's route until the value is known again (issue #27; before, the
    one-pass route went on with 1/3e4 and the parameters drifted 1.5e-8 from torch's)."""
    write = _write_scale({3: 3.0e4, 7: 2.0**9})
    kwargs: dict[str, Any] = (
        {"between": write} if when == "between iterations" else {"before": {when[7:]: write}}
    )
    ours, routes = _train(_one_pass, FUSED["adam"], read_scale=False, **kwargs)
    theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"], read_scale=False, **kwargs)
    _assert_same(ours, theirs)
    first = {"between iterations": 4, "before step": 3, "before update": 4}[when]
    assert routes[:first] == ["check"] * first and routes[first] == "kernel"
    assert routes[-1] == "check"  # 2**9 seen again (at once: copies land at once on the CPU)


def test_a_loaded_checkpoint_sets_the_route() -> None:
    def reload(scaler: Any, step: int) -> None:
        if step in (2, 6):
            state = scaler.state_dict()
            state["scale"] = 3000.0 if step == 2 else 4096.0
            scaler.load_state_dict(state)

    ours, routes = _train(_one_pass, FUSED["adam"], between=reload)
    theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"], between=reload)
    _assert_same(ours, theirs)
    assert routes == ["check"] * 3 + ["kernel"] * 4 + ["check"] * 5


def test_float16_gradients_are_left_to_the_kernel() -> None:
    ours, routes = _train(_one_pass, FUSED["adam"], dtype=torch.float16)
    theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"], dtype=torch.float16)
    _assert_same(ours, theirs)
    assert routes == ["kernel"] * 12


def test_optimizers_other_than_torchs_own_are_left_to_the_kernel() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    ours, routes = _train(_one_pass, lambda ps: MyAdam(ps, lr=1e-2, fused=True))
    theirs, _ = _train(torch.amp.GradScaler, lambda ps: MyAdam(ps, lr=1e-2, fused=True))
    _assert_same(ours, theirs)
    assert routes == ["kernel"] * 12


def test_a_grad_scale_set_on_the_optimizer_is_multiplied_in_as_torch_does() -> None:
    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(ps, lr=1e-2, fused=True)
        opt.grad_scale = torch.tensor(4.0)  # type: ignore[attr-defined]
        return opt

    ours, routes = _train(_one_pass, make, steps=4)
    theirs, _ = _train(torch.amp.GradScaler, make, steps=4)
    _assert_same(ours, theirs)
    # Both scalers delete the attribute after the first step.
    assert routes == ["kernel"] + ["check"] * 3


def test_master_weights_around_a_fused_optimizer_take_the_fast_route() -> None:
    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return ampscaler.MasterWeightOptimizer(torch.optim.Adam(ps, lr=1e-2, fused=True))

    routes: Routes = []
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    opt = make(list(model.parameters()))
    _record_routes(opt.inner, routes)
    scaler = _one_pass("cpu", init_scale=2.0**8)
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 4, dtype=torch.float16)).float().sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert routes == ["check"] * 3


def _skipped_fused_step(scaler: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One skipped step of fused Adam: the weight's gradient before and after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    model.bias.grad.fill_(float("nan"))
    scaled = model.weight.grad.clone()
    scaler.step(opt)
    assert scaler.get_scale() == 2.0**6
    return scaled, model.weight.grad


def test_skipped_steps_leave_the_gradients_unscaled_on_the_one_pass_route() -> None:
    """The one visible difference of the opt-in route: on a skipped step torch's fused route
    leaves the gradients scaled (its kernel returns before dividing); the one-pass route's are
    unscaled, as on the plain route of both."""
    scaler = _one_pass("cpu", init_scale=2.0**6)
    scaled, after = _skipped_fused_step(scaler)
    assert torch.equal(after, scaled / 2.0**6)
    assert scaler.last_step_skipped


def test_by_default_the_kernel_unscales_and_skipped_steps_leave_torchs_gradients() -> None:
    ours, routes = _train(ampscaler.GradScaler, FUSED["adam"])
    theirs, _ = _train(torch.amp.GradScaler, FUSED["adam"])
    _assert_same(ours, theirs)
    assert routes == ["kernel"] * 12
    scaled, after = _skipped_fused_step(ampscaler.GradScaler("cpu", init_scale=2.0**6))
    _, torch_after = _skipped_fused_step(torch.amp.GradScaler("cpu", init_scale=2.0**6))
    assert torch.equal(after, scaled) and torch.equal(after, torch_after)


def test_the_route_survives_long_runs_without_reading_the_scale() -> None:
    """At a bound of 2**-64 the watch renews itself from the scale, so a long run whose scale
    goes up and down never falls back to torch's route."""
    steps = 400
    # Grow, back off, grow, ... (not from step 0: torch's fused SGD leaves its momentum
    # buffer uninitialized when its first step is skipped, with either scaler.)
    overflow_at = tuple(range(1, steps, 2))

    kwargs = {"init_scale": 2.0**16, "growth_interval": 1}
    _, routes = _train(
        _one_pass,
        FUSED["sgd"],
        steps=steps,
        overflow_at=overflow_at,
        scaler_kwargs=kwargs,
        read_scale=False,
    )
    assert routes == ["check"] * steps


def test_a_scale_backed_off_150_times_stops_at_two_to_the_minus_126_on_the_fast_route() -> None:
    """Backing off 150 times in a row would take the scale to 2**-134, whose reciprocal float32
    cannot hold (torch's scaler goes there); ampscaler's stops at 2**-126, where unscaling is
    still exact, so the one-pass route stays open and matches the default route's results."""
    kwargs = {"init_scale": 2.0**16, "growth_interval": 1}
    overflow_at = tuple(range(150))
    with pytest.warns(ampscaler.ScaleFloorWarning, match="at step 141 the scale is 2"):
        ours, routes = _train(
            _one_pass,
            FUSED["adam"],
            steps=162,
            overflow_at=overflow_at,
            scaler_kwargs=kwargs,
            read_scale=False,
        )
    with pytest.warns(ampscaler.ScaleFloorWarning, match="at step 141 the scale is 2"):
        default, default_routes = _train(
            ampscaler.GradScaler,
            FUSED["adam"],
            steps=162,
            overflow_at=overflow_at,
            scaler_kwargs=kwargs,
            read_scale=False,
        )
    _assert_same(ours, default)
    assert routes == ["check"] * 162 and default_routes == ["kernel"] * 162


def test_the_watch_starts_at_the_first_fused_step_and_costs_plain_steps_nothing() -> None:
    """The power-of-two watch serves fused optimizers only: a scaler that steps plain ones
    keeps none (its updates run no watch). A fused optimizer that joins after some updates
    takes the one-pass route from its first step (the scale's value, not known on the host
    after those updates, is copied without waiting), bit for bit as with torch's scaler."""

    def run(factory: Callable[..., Any]) -> tuple[list[torch.Tensor], Routes, Any]:
        torch.manual_seed(0)
        plain, fused = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
        sgd = torch.optim.SGD(plain.parameters(), lr=1e-2, momentum=0.9)
        adam = FUSED["adam"](list(fused.parameters()))
        routes: Routes = []
        _record_routes(adam, routes)
        scaler = factory("cpu", init_scale=2.0**10, growth_interval=2)
        trace: list[torch.Tensor] = []
        gen = torch.Generator().manual_seed(1)
        for step in range(10):
            x = torch.randn(4, 5, generator=gen)
            models = [plain] if step < 5 else [plain, fused]
            scaler.scale(sum(model(x).square().mean() for model in models)).backward()
            if step in (2, 7):
                plain.weight.grad[0, 0] = float("inf")
            for opt in [sgd] if step < 5 else [sgd, adam]:
                scaler.step(opt)
            scaler.update()
            if step == 4 and isinstance(scaler, ampscaler.GradScaler):
                assert scaler._state._watch is None
            trace += [p.detach().clone() for m in models for p in m.parameters()]
            trace.append(scaler._scale.clone())  # not get_scale(): the host must not learn it
            sgd.zero_grad()
            adam.zero_grad()
        return trace, routes, scaler

    ours, routes, scaler = run(_one_pass)
    theirs, torch_routes, _ = run(torch.amp.GradScaler)
    _assert_same(ours, theirs)
    assert routes == ["check"] * 5 and torch_routes == ["kernel"] * 5
    assert scaler._state._watch is not None
    scales = [float(t) for t in ours if t.dim() == 0]
    assert len(set(scales[:5])) > 1  # the scale moved before the first fused step
