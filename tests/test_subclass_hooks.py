"""Subclasses that override torch's private hooks get them called where torch calls them.

Code written against torch's scaler subclasses it and overrides the methods its ``scale()``,
``unscale_()`` and ``step()`` call on ``self``: ``_maybe_opt_step`` (NeMo's model-parallel
scaler, trackers of skipped steps), ``_unscale_grads_`` (optimizers that unscale their own
gradients) and ``_lazy_init_scale_growth_tracker`` (NeMo's hysteresis tracker). The same
subclass body is put on torch's scaler and on ampscaler's, and both are run side by side: the
hooks must be called alike, with the same arguments, and the training must agree bit for bit.
"""

from __future__ import annotations

import pickle
import warnings
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.amp.grad_scaler import _refresh_per_optimizer_state

import ampscaler


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[dist.ProcessGroup]:
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    assert group is not None
    try:
        yield group
    finally:
        if made:
            dist.destroy_process_group()


def _train(
    scaler: Any,
    steps: int = 4,
    inf_at: int = 1,
    fused: bool = False,
) -> tuple[list[torch.Tensor], list[float], list[Any]]:
    """A small model stepped by ``scaler``, with inf in the input at step ``inf_at``; the
    parameters, the scale after each update and what ``step()`` returned."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    if fused:
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, returned = [], []
    for step in range(steps):
        optimizer.zero_grad()
        inputs = torch.full((4, 3), float("inf") if step == inf_at else 0.5)
        loss = model(inputs).pow(2).mean()
        scaler.scale(loss).backward()
        returned.append(scaler.step(optimizer))
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, returned


def _twins(body: dict[str, Any]) -> tuple[Any, Any]:
    """The same subclass body over torch's scaler and over ampscaler's, constructed alike."""
    made = []
    for base in (torch.amp.GradScaler, ampscaler.GradScaler):
        cls = type(f"Over{base.__module__.split('.')[0]}", (base,), dict(body))
        scaler = cls("cpu", init_scale=2.0**8)
        scaler.log = []
        made.append(scaler)
    return made[0], made[1]


def _assert_same_training(torch_run: Any, ampscaler_run: Any) -> None:
    (torch_params, torch_scales, torch_returned) = torch_run
    (params, scales, returned) = ampscaler_run
    assert scales == torch_scales
    assert returned == torch_returned
    for theirs, ours in zip(torch_params, params, strict=True):
        assert torch.equal(theirs, ours)


# ---------------------------------------------------------------------- _maybe_opt_step


def _tracking_step(
    self: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any
) -> Any:
    flags = optimizer_state["found_inf_per_device"]
    self.log.append((optimizer_state["stage"].name, sum(float(f.item()) for f in flags.values())))
    self.skipped_by_me = bool(sum(float(f.item()) for f in flags.values()))
    return super(type(self), self)._maybe_opt_step(optimizer, optimizer_state, *args)


def test_an_overridden_maybe_opt_step_is_called_at_every_plain_step_as_torch_calls_it() -> None:
    theirs, ours = _twins({"_maybe_opt_step": _tracking_step})
    _assert_same_training(_train(theirs), _train(ours))
    assert (
        ours.log
        == theirs.log
        == [
            ("UNSCALED", 0.0),
            ("UNSCALED", 1.0),
            ("UNSCALED", 0.0),
            ("UNSCALED", 0.0),
        ]
    )
    assert ours.skipped_by_me is theirs.skipped_by_me is False


def test_an_overridden_maybe_opt_step_decides_whether_the_optimizer_steps() -> None:
    def never(self: Any, optimizer: Any, optimizer_state: Any, *args: Any) -> Any:
        self.log.append("asked")
        return "held back"

    theirs, ours = _twins({"_maybe_opt_step": never})
    torch_run, run = _train(theirs), _train(ours)
    _assert_same_training(torch_run, run)
    assert run[2] == ["held back"] * 4 and ours.log == ["asked"] * 4
    torch.manual_seed(0)
    untouched = list(torch.nn.Linear(3, 2).parameters())
    assert all(torch.equal(a, b) for a, b in zip(run[0], untouched, strict=True))


def test_maybe_opt_step_itself_steps_unless_the_flags_sum_above_zero() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.weight.grad = torch.ones_like(model.weight)
    before = model.weight.detach().clone()
    scaler = ampscaler.GradScaler("cpu")
    flagged = {"found_inf_per_device": {torch.device("cpu"): torch.tensor(1.0)}}
    assert scaler._maybe_opt_step(optimizer, flagged) is None
    assert torch.equal(model.weight, before)
    clean = {"found_inf_per_device": {torch.device("cpu"): torch.tensor(0.0)}}
    scaler._maybe_opt_step(optimizer, clean)
    assert torch.equal(model.weight, before - 1.0)


def test_a_subclass_made_over_torchs_name_while_patched_is_routed_too() -> None:
    with ampscaler.patch_torch():

        class Tracking(torch.amp.GradScaler):  # what a framework module imported later does
            def _maybe_opt_step(self, optimizer: Any, optimizer_state: Any, *args: Any) -> Any:
                self.seen = optimizer_state["found_inf_per_device"]
                return super()._maybe_opt_step(optimizer, optimizer_state, *args)

        scaler = Tracking("cpu", init_scale=2.0**8)
    assert isinstance(scaler, ampscaler.GradScaler)
    _train(scaler, steps=2, inf_at=-1)
    assert list(scaler.seen) == [torch.device("cpu")]
    assert scaler.seen[torch.device("cpu")].item() == 0.0


# ---------------------------------------------------------------------- unscale_


class AgreeingUnscale:
    """torch's sharded scaler's pattern: unscale, then reduce the flags in place across ranks
    (here the value another rank's overflow would bring, at the steps in ``poisoned``)."""

    calls: int
    poisoned: set[int]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # type: ignore[misc]
        flags = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[attr-defined]
        if self.calls in self.poisoned:
            for flag in flags.values():
                flag.fill_(1.0)
        self.calls += 1


def _train_unscaling(scaler: Any, optimizer_kind: str, explicit: bool) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizers = {
        "SGD": lambda: torch.optim.SGD(model.parameters(), lr=0.1),
        "Adam": lambda: torch.optim.Adam(model.parameters(), lr=0.1, foreach=True),
        "fused Adam": lambda: torch.optim.Adam(model.parameters(), lr=0.1, fused=True),
    }
    optimizer = optimizers[optimizer_kind]()
    scaler.calls, scaler.poisoned = 0, {1}
    scales, returned = [], []
    for _ in range(3):
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(4, 3)).pow(2).mean()).backward()
        if explicit:
            scaler.unscale_(optimizer)
        returned.append(scaler.step(optimizer))
        scaler.update()
        scales.append(scaler.get_scale())
    params = [p.detach().clone() for p in model.parameters()]
    return params, scales, returned, scaler.calls


@pytest.mark.parametrize("explicit", [False, True], ids=["by step", "by hand"])
@pytest.mark.parametrize("optimizer_kind", ["SGD", "Adam", "fused Adam"])
def test_an_overridden_unscale_is_called_by_step_and_its_flags_decide(
    optimizer_kind: str, explicit: bool
) -> None:
    theirs = type("Theirs", (AgreeingUnscale, torch.amp.GradScaler), {})("cpu", init_scale=2.0**8)
    ours = type("Ours", (AgreeingUnscale, ampscaler.GradScaler), {})("cpu", init_scale=2.0**8)
    *torch_run, torch_calls = _train_unscaling(theirs, optimizer_kind, explicit)
    *run, calls = _train_unscaling(ours, optimizer_kind, explicit)
    _assert_same_training(tuple(torch_run), tuple(run))
    assert calls == torch_calls == (0 if optimizer_kind == "fused Adam" and not explicit else 3)
    if calls:  # the reduced flag of the second step skipped it and backed the scale off
        assert run[1] == [2.0**8, 2.0**7, 2.0**7] and run[2][1] is None


# ---------------------------------------------------------------------- _unscale_grads_


def _logging_unscale(
    self: Any, optimizer: Any, inv_scale: Any, found_inf: Any, allow_fp16: bool
) -> Any:
    self.log.append((inv_scale.item(), found_inf.item(), allow_fp16))
    return super(type(self), self)._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)


@pytest.mark.parametrize("fused", [False, True], ids=["SGD", "fused Adam"])
def test_an_overridden_unscale_grads_checks_the_gradients_as_in_torch(fused: bool) -> None:
    theirs, ours = _twins({"_unscale_grads_": _logging_unscale})
    _assert_same_training(_train(theirs, fused=fused), _train(ours, fused=fused))
    assert ours.log == theirs.log
    # plain: unscale by 1/scale, fp16 refused; fused: checked at 1.0, the kernel unscales
    expected = (1.0, 0.0, True) if fused else (2.0**-8, 0.0, False)
    assert ours.log[0] == expected


def test_the_flags_an_overridden_unscale_grads_returns_decide_the_step() -> None:
    def inf_at_the_second(self: Any, optimizer: Any, inv_scale: Any, found_inf: Any, fp16: bool):
        flags = super(type(self), self)._unscale_grads_(optimizer, inv_scale, found_inf, fp16)
        self.log.append(None)
        if len(self.log) == 2:  # an optimizer that knows better than the check
            return {device: torch.ones_like(flag) for device, flag in flags.items()}
        return flags

    theirs, ours = _twins({"_unscale_grads_": inf_at_the_second})
    torch_run, run = _train(theirs, inf_at=-1), _train(ours, inf_at=-1)
    _assert_same_training(torch_run, run)
    assert run[1] == [2.0**8, 2.0**7, 2.0**7, 2.0**7] and run[2][1] is None
    assert ours.last_step_skipped is False and ours.metrics()["scaler/skips"] == 1


def test_a_sharded_scalers_override_is_allowed_fp16_gradients_as_torchs_is(
    world_of_one: dist.ProcessGroup,
) -> None:
    seen = []

    class Mine(ampscaler.ShardedGradScaler):
        def _unscale_grads_(self, optimizer: Any, inv: Any, found: Any, allow_fp16: bool) -> Any:
            seen.append(allow_fp16)
            return super()._unscale_grads_(optimizer, inv, found, allow_fp16)

    model = torch.nn.Linear(2, 1).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = Mine("cpu", init_scale=4.0, process_group=world_of_one)
    scaler.scale(model(torch.ones(1, 2, dtype=torch.float16)).float().sum()).backward()
    scaler.unscale_(optimizer)
    assert seen == [True]  # torch's sharded unscale_() passes True: fp16 gradients are checked
    assert model.weight.grad is not None and model.weight.grad.dtype == torch.float16


# ---------------------------------------------------------------------- lazy init


class LazyInit:
    """NeMo's scaler's override, as a mixin (module level: copies are pickled)."""

    log: list[torch.device]

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        super()._lazy_init_scale_growth_tracker(dev)  # type: ignore[misc]
        self.log.append(torch.device(dev))
        self.hysteresis_tracker = torch.tensor([2], dtype=torch.int32, device=dev)


class TorchLazy(LazyInit, torch.amp.GradScaler):
    pass


class OursLazy(LazyInit, ampscaler.GradScaler):
    pass


class OursLazier(OursLazy):
    """Routed once, however deep: the override is still called once per first scale()."""


@pytest.mark.parametrize("ours_class", [OursLazy, OursLazier])
def test_an_overridden_lazy_init_is_called_once_by_the_first_scale(ours_class: type) -> None:
    theirs, ours = TorchLazy("cpu", init_scale=2.0**8), ours_class("cpu", init_scale=2.0**8)
    theirs.log, ours.log = [], []
    _assert_same_training(_train(theirs), _train(ours))
    assert ours.log == theirs.log == [torch.device("cpu")]
    assert ours.hysteresis_tracker.tolist() == [2]
    for scaler in (theirs, ours):  # a copy starts from the host again: torch's asks again
        copy = pickle.loads(pickle.dumps(scaler))
        copy.scale(torch.ones(()))
        copy.scale(torch.ones(()))
        assert copy.log == [torch.device("cpu")] * 2


# ---------------------------------------------------------------------- the rest


def test_check_scale_growth_tracker_gives_torchs_tensors_and_error() -> None:
    theirs, ours = torch.amp.GradScaler("cpu"), ampscaler.GradScaler("cpu")
    for scaler in (theirs, ours):
        with pytest.raises(AssertionError, match="^Attempted update"):
            scaler._check_scale_growth_tracker("update")
        scaler.scale(torch.ones(()))
    scale, tracker = ours._check_scale_growth_tracker("update")
    assert scale is ours._scale and tracker is ours._growth_tracker
    assert (scale.item(), tracker.item()) == tuple(
        t.item() for t in theirs._check_scale_growth_tracker("update")
    )


@pytest.mark.parametrize("name", ampscaler.compat.NOT_CALLED)
def test_an_override_the_scaler_never_calls_warns_once_at_the_class(name: str) -> None:
    with pytest.warns(UserWarning, match=f"overrides {name}\\(\\).*ampscaler's does not") as got:
        overriding = type("Overriding", (ampscaler.GradScaler,), {name: lambda self, *args: None})
    assert got[0].filename == __file__
    mixin = type("Mixin", (), {name: lambda self, *args: None})
    with pytest.warns(UserWarning, match=f"Mixed overrides {name}"):
        type("Mixed", (mixin, ampscaler.GradScaler), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        type("Below", (overriding,), {})  # told at the class that brought it


def test_the_scalers_own_subclasses_warn_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        type("Plain", (ampscaler.GradScaler,), {"update": ampscaler.GradScaler.update})
        type("Sharded", (ampscaler.ShardedGradScaler,), {})


class TorchStyleUpdate:
    """An update() copied from torch's into a subclass, with hysteresis of its own (NeMo's
    scaler does so): it moves the scale itself and ends the iteration by assigning
    _per_optimizer_states afresh."""

    hysteresis = 2

    def update(self, new_scale: Any = None) -> None:
        scale, tracker = self._check_scale_growth_tracker("update")  # type: ignore[attr-defined]
        states = self._per_optimizer_states  # type: ignore[has-type]
        flags = [f for state in states.values() for f in state["found_inf_per_device"].values()]
        found_inf = sum(flags)
        left = getattr(self, "hysteresis_left", self.hysteresis)
        if found_inf.item() > 0 and left > 1:  # held: the scale stays, the tracker restarts
            self.hysteresis_left = left - 1
            tracker.zero_()
        else:
            if found_inf.item() == 0:
                self.hysteresis_left = self.hysteresis
            torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def _overflowing(steps: int, at: tuple[int, ...]) -> Any:
    """A training loop over ``steps`` batches whose gradients overflow at ``at``."""

    def run(scaler: Any, fused: bool = False) -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
        scales = []
        for step in range(steps):
            optimizer.zero_grad()
            loss = model(torch.randn(4, 3)).pow(2).mean()
            scaler.scale(loss * (float("inf") if step in at else 1.0)).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        return [p.detach().clone() for p in model.parameters()], scales

    return run


@pytest.mark.parametrize("fused", [False, True])
def test_an_update_of_ones_own_that_ends_the_iteration_as_torchs_does_trains_alike(
    fused: bool,
) -> None:
    """The subclass's rule moves the scale, bit for bit as over torch's scaler; ampscaler
    counts each iteration from the scale it ran at (growths and backoffs as they happened)
    and its step records and guards hear of it."""
    run = _overflowing(10, at=(3, 4, 7))
    theirs, ours = _twins({"hysteresis": 2, "update": TorchStyleUpdate.update})
    history = ours.attach(ampscaler.StepHistory(100))
    guard = ours.attach(ampscaler.SpikeGuard(warmup=100))
    torch_params, torch_scales = run(theirs, fused)
    params, scales = run(ours, fused)
    assert scales == torch_scales
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params, strict=True))
    metrics = ours.metrics("")
    assert (metrics["steps"], metrics["skips"]) == (10, 3)
    moves = list(zip([2.0**8, *scales[:-1]], scales, strict=True))
    grew, backed_off = sum(new > old for old, new in moves), sum(new < old for old, new in moves)
    assert grew and backed_off  # the hysteresis held the first of two overflows in a row
    assert (metrics["growths"], metrics["backoffs"]) == (grew, backed_off)
    records = history.records
    assert [r.new_scale for r in records] == scales
    assert [r.scale for r in records] == [2.0**8, *scales[:-1]]  # the scale each ran at
    assert [r.skipped for r in records] == [step in (3, 4, 7) for step in range(10)]
    assert guard.state_dict()  # the guard heard of every iteration (its window is kept)


def test_a_batch_dropped_mid_iteration_by_a_fresh_per_optimizer_state_runs_again_alike() -> None:
    """A trainer that runs a batch again after running out of memory (Composer's automatic
    micro-batching) zeroes the gradients and assigns _per_optimizer_states afresh: the
    iteration is dropped, as over torch's scaler, and not counted."""

    def run(scaler: Any) -> tuple[list[torch.Tensor], float]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            inputs = torch.randn(4, 3)
            if step == 2:  # the first try at this batch is given up after its backward
                scaler.scale(model(inputs).sum()).backward()
                optimizer.zero_grad(set_to_none=True)
                scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            optimizer.zero_grad()
            scaler.scale(model(inputs).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    torch_params, torch_scale = run(torch.amp.GradScaler("cpu", growth_interval=2))
    ours = ampscaler.GradScaler("cpu", growth_interval=2)
    params, scale = run(ours)
    assert scale == torch_scale == 2.0**16 * 4
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params, strict=True))
    assert ours.metrics("")["steps"] == 5


def test_a_subclass_that_starts_its_per_optimizer_state_in_init_trains() -> None:
    """torch's sharded scaler, and copies of it, assign _per_optimizer_states in __init__."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        super(type(self), self).__init__(*args, **kwargs)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    theirs, ours = _twins({"__init__": init})
    _assert_same_training(_train(theirs), _train(ours))


def test_assigning_per_optimizer_entries_is_refused_and_changes_nothing() -> None:
    scaler = ampscaler.GradScaler("cpu")
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    entries = {id(optimizer): _refresh_per_optimizer_state()}
    for value in (entries, None):
        with pytest.raises(AttributeError, match=r"fresh, empty mapping.*super\(\)\.unscale_"):
            scaler._per_optimizer_states = value
    assert scaler._per_optimizer_states[id(optimizer)]["stage"].name == "STEPPED"
    scaler.update()  # the iteration goes on and ends as usual
    assert scaler.metrics("")["steps"] == 1


def _refused_where_torchs_runs(mixin: type, error: type[Exception], says: str) -> None:
    """``mixin`` over torch's scaler trains; over ampscaler's it raises ``error`` saying what
    to do instead."""
    _train(type("Theirs", (mixin, torch.amp.GradScaler), {})("cpu"), steps=2, inf_at=-1)
    ours = type("Ours", (mixin, ampscaler.GradScaler), {})("cpu")
    with pytest.raises(error, match=says):
        _train(ours, steps=1, inf_at=-1)


class CopiedShardedUnscale:
    """An unscale_() copied from torch's sharded scaler: it writes the per-optimizer state."""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        state = self._per_optimizer_states[id(optimizer)]  # type: ignore[attr-defined]
        scale = self._scale  # type: ignore[attr-defined]
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(  # type: ignore[attr-defined]
            optimizer, inv_scale, found_inf, True
        )
        state["stage"] = torch.amp.grad_scaler.OptState.UNSCALED


def test_writing_the_per_optimizer_state_says_what_to_do_instead() -> None:
    says = r"read-only view.*super\(\)\.unscale_\(optimizer\)"
    _refused_where_torchs_runs(CopiedShardedUnscale, TypeError, says)
    scaler = ampscaler.GradScaler("cpu")
    with pytest.raises(TypeError, match="'stage'"):
        scaler._per_optimizer_states[12345]["stage"] = torch.amp.grad_scaler.OptState.UNSCALED


class TorchStyleLoad:
    """A load_state_dict() copied from torch's into a subclass (NeMo's scaler does, to load its
    hysteresis beside): it assigns torch's names and fills the live tensors."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_scale = state_dict["scale"]
        if self._scale is not None:  # type: ignore[has-type]
            self._scale.fill_(state_dict["scale"])  # type: ignore[has-type]
        self._growth_factor = state_dict["growth_factor"]
        self._backoff_factor = state_dict["backoff_factor"]
        self._growth_interval = state_dict["growth_interval"]
        self._init_growth_tracker = state_dict["_growth_tracker"]
        if self._growth_tracker is not None:  # type: ignore[has-type]
            self._growth_tracker.fill_(state_dict["_growth_tracker"])  # type: ignore[has-type]


@pytest.mark.parametrize("trained_first", [False, True])
def test_a_load_state_dict_copied_from_torchs_loads_alike(trained_first: bool) -> None:
    saved = {
        "scale": 128.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 2,
        "_growth_tracker": 1,
    }
    runs = []
    for scaler in _twins({"load_state_dict": TorchStyleLoad.load_state_dict}):
        if trained_first:
            _train(scaler, steps=2, inf_at=-1)
        scaler.load_state_dict(saved)
        runs.append(_train(scaler, steps=4, inf_at=2))
    (torch_params, torch_scales, _), (params, scales, _) = runs
    assert scales == torch_scales == [512.0, 512.0, 128.0, 128.0]
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params, strict=True))


def test_an_update_that_adds_the_flags_in_place_leaves_each_fused_steps_verdict() -> None:
    """torch's update() adds the optimizers' flags into the first one's, in place; copied into
    code of one's own, that must not make the first fused optimizer's step read as skipped
    (ampscaler reads a fused step's verdict from its flag when asked)."""
    models = [torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)]
    clean, poisoned = (torch.optim.Adam(m.parameters(), fused=True) for m in models)
    scaler = ampscaler.GradScaler("cpu")
    scaler.scale(sum(m(torch.ones(1, 2)).sum() for m in models)).backward()
    models[1].bias.grad.fill_(float("inf"))
    scaler.step(clean)
    scaler.step(poisoned)
    states = scaler._per_optimizer_states
    flags = [f for state in states.values() for f in state["found_inf_per_device"].values()]
    for flag in flags[1:]:
        flags[0] += flag  # as torch's update() combines them
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    assert (scaler.step_skipped(clean), scaler.step_skipped(poisoned)) == (False, True)
    assert scaler.metrics("")["skips"] == 1


def test_an_update_of_ones_own_is_held_at_the_floor() -> None:
    """Whatever moved the scale, an iteration ends with it at or above 2**-126, as after
    ampscaler's own update(); torch's goes below, where unscaling is no longer exact."""
    theirs, ours = _twins({"hysteresis": 1, "update": TorchStyleUpdate.update})
    after = []
    for scaler in (theirs, ours):
        scaler._init_scale = 2.0**-125  # one backoff above the floor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ampscaler says when the scale reaches the floor
            first = _train(scaler, steps=2, inf_at=0)[1]  # a backoff, then a clean step
            after.append(first + _train(scaler, steps=1, inf_at=0)[1])  # and one more
    assert after[0] == [2.0**-126, 2.0**-126, 2.0**-127]  # torch's
    assert after[1] == [2.0**-126, 2.0**-126, 2.0**-126]  # ampscaler's: held at the floor


# ---------------------------------------------------------------------- assigned to one scaler


def _assign_logging(scaler: Any, name: str) -> Any:
    """Assign ``name`` to ``scaler`` as code does to one scaler (kohya-ss's sd-scripts assign
    ``_unscale_grads_``): the function assigned logs its call and calls the method it
    replaces. Returns ``scaler``."""
    original = getattr(scaler, name)
    scaler.log = []

    def assigned(*args: Any) -> Any:
        scaler.log.append((name, len(args)))
        return original(*args)

    setattr(scaler, name, assigned)
    return scaler


@pytest.mark.parametrize("fused", [False, True], ids=["SGD", "fused Adam"])
@pytest.mark.parametrize("name", ["_unscale_grads_", "_maybe_opt_step"])
def test_a_method_assigned_to_one_scaler_is_called_where_torch_calls_it(
    name: str, fused: bool
) -> None:
    theirs = _assign_logging(torch.amp.GradScaler("cpu", init_scale=2.0**8), name)
    ours = _assign_logging(ampscaler.GradScaler("cpu", init_scale=2.0**8), name)
    _assert_same_training(_train(theirs, fused=fused), _train(ours, fused=fused))
    assert ours.log == theirs.log
    assert len(theirs.log) == (0 if fused and name == "_maybe_opt_step" else 4)
    other = ampscaler.GradScaler("cpu", init_scale=2.0**8)  # the class is left as it was
    other.log = []
    _train(other, fused=fused)
    assert other._unscale_and_check.__func__ is ampscaler.GradScaler._unscale_and_check
