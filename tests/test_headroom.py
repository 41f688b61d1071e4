"""HeadroomPolicy: the pure transition against a reference model, and the policy in a scaler.

- ``adjust`` equals tests/headroom_reference.py after every update, for any configuration and
  any mix of overflows, measurements, non-finite measurements and unmeasured iterations;
  ``update_`` (in place, with its fast path) equals ``adjust``; neither modifies its input.
- A scripted sequence of measurements gives the scales worked out by hand.
- In a scaler: the first measurement sets the scale whatever ``init_scale`` was (no warm-up
  skip), a real overflow still backs off and is remembered, what is measured (activation and
  float16-computed parameter gradients; nothing before ``scale()``), the sampling schedule,
  the fused one-pass route, ``update(new_scale)``, exact resume, checkpoint interchange with
  torch and with other policies, pickling, and ``torch.compile``.
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import ampscaler
from ampscaler import GradScaler, HeadroomPolicy, ScalePolicy
from ampscaler.hooks import MeterHook
from ampscaler.policy import HeadroomState
from ampscaler.policy.meter import NOT_MEASURED, HeadroomMeter
from headroom_reference import FP16_MAX, HeadroomRef
from reference import f32
from twins import observed

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------- the pure rule

POW2 = st.integers(-126, 127).map(lambda e: 2.0**e)


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    """Any valid HeadroomPolicy configuration (its fields as keyword arguments)."""
    low, first, high = sorted(draw(st.lists(st.integers(-126, 127), min_size=3, max_size=3)))
    return {
        "margin": draw(st.one_of(st.sampled_from([1.0, 2.0, 1.5, 4.0]), st.floats(1.0, 1e6))),
        "first_margin": draw(st.sampled_from([1.0, 2.0, 3.0])),
        "history_length": draw(st.integers(1, 5)),
        "sample_every": draw(st.integers(1, 4)),
        "backoff_factor": draw(st.sampled_from([0.5, 0.25, 2.0**-10])),
        "recovery_interval": draw(st.integers(1, 4)),
        "first_scale": 2.0**first,
        "min_scale": draw(st.sampled_from([None, 2.0**low])),
        "max_scale": draw(st.sampled_from([None, 2.0**high])),
    }


# A measurement: none, a float32 magnitude from far below to beyond float16's range, or a
# non-finite one (what an overflowing backward measures).
MEASURED = st.one_of(
    st.none(),
    st.floats(2.0**-100, 1e5, width=32),
    st.sampled_from([0.0, FP16_MAX, 65536.0, math.inf, math.nan, -1.0]),
)
EVENTS = st.lists(st.tuples(st.booleans(), MEASURED), max_size=40)


def _ref_of(config: dict[str, object]) -> HeadroomRef:
    names = ("margin", "first_margin", "history_length", "backoff_factor", "recovery_interval")
    names = (*names, "first_scale")
    return HeadroomRef(
        **{name: config[name] for name in names},  # type: ignore[arg-type]
        min_scale=config["min_scale"],  # type: ignore[arg-type]
        max_scale=config["max_scale"],  # type: ignore[arg-type]
    )


def _assert_matches(state: HeadroomState, ref: HeadroomRef) -> None:
    assert float(state.scale) == ref.scale
    assert int(state.growth_tracker) == ref.tracker
    assert float(state.target) == ref.target
    assert state.history.tolist() == ref.history
    assert int(state.measured) == ref.stored
    assert int(state.iteration) == ref.iteration
    assert float(state.overflowed_at) == ref.overflowed_at
    assert int(state.flushed) == ref.flushed


def _tensor(measured: float | None) -> torch.Tensor | None:
    return None if measured is None else torch.tensor(measured, dtype=torch.float32)


@settings(max_examples=150, deadline=None)
@given(config=configs(), events=EVENTS)
def test_adjust_and_update_match_the_reference(
    config: dict[str, object], events: list[tuple[bool, float | None]]
) -> None:
    policy = HeadroomPolicy(**config)  # type: ignore[arg-type]
    state = policy.initial_state(policy.first_scale, CPU)
    live = policy.initial_state(policy.first_scale, CPU)
    assert isinstance(state, HeadroomState) and isinstance(live, HeadroomState)
    identities = [id(t) for t in live]
    ref = _ref_of(config)
    for overflow, measured in events:
        before = [t.clone() for t in state]
        found = torch.tensor(float(overflow))
        moved = policy.adjust(state, found, _tensor(measured))
        assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True))  # pure
        policy.update_(live, found, _tensor(measured))
        ref.adjust(overflow, None if measured is None else f32(measured))
        _assert_matches(moved, ref)
        _assert_matches(live, ref)
        assert [id(t) for t in live] == identities  # in place
        low, high = policy.exponents
        exponent = math.frexp(ref.scale)[1] - 1
        assert ref.scale == 2.0**exponent and low <= exponent <= high  # a power of two
        state = moved


def test_a_scripted_sequence_of_measurements_gives_the_expected_scales() -> None:
    policy = HeadroomPolicy(margin=2.0, history_length=2, recovery_interval=3)
    state = policy.initial_state(1.0, CPU)
    clean, overflow = torch.tensor(0.0), torch.tensor(1.0)
    scales = []
    # (found_inf, the largest gradient measured at the scale in force, None: not measured)
    script = [
        (clean, 1e-3),  # at scale 1: 65504 / (1e-3 * 2) = 32.75e6 -> 2**24
        (clean, 2**24 * 1e-3),  # the same gradient at 2**24: the same
        (clean, 2**24 * 3e-3),  # 3x larger (still below 65504 at 2**24): 2**23
        (clean, 2**23 * 1e-3),  # back to 1e-3, but 3e-3 is still in the history: 2**23
        (clean, 2**23 * 1e-3),  # 3e-3 has left the history (length 2): 2**24
        (clean, None),  # not measured: unchanged
        (overflow, None),  # the safety net: back off a binade below the target
        (clean, 2**23 * 1e-3),  # measured 2**24 again: the scale keeps its distance
        (clean, None),
        (clean, None),  # three clean steps: the scale doubles back to the target
        (clean, 2**24 * 3.5e-3),  # larger gradients: 2**23 before they can overflow
        (clean, 2**23 * float("inf")),  # a measurement that overflowed: back off to 2**22
    ]
    for found, measured in script:
        state = policy.adjust(state, found, _tensor(measured))
        scales.append(math.log2(float(state.scale)))
    assert scales == [24, 24, 23, 23, 24, 24, 23, 23, 23, 24, 23, 22]
    assert float(state.target) == 2.0**23


def test_the_first_measurement_sets_the_scale_and_unmeasured_iterations_keep_it() -> None:
    policy = HeadroomPolicy(margin=1.0, first_margin=1.0)  # the young history's margin too
    state = policy.initial_state(1.0, CPU)
    state = policy.adjust(state, torch.tensor(0.0))  # nothing measured yet: first_scale
    assert float(state.scale) == 1.0
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(65504.0 / 2**10))
    assert float(state.scale) == 2.0**10  # 2**10 * 63.97 = 65504: exactly at the limit
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(-1.0))  # measured nothing
    assert float(state.scale) == 2.0**10


def test_bounds_hold_and_a_non_float32_flag_takes_the_general_path() -> None:
    policy = HeadroomPolicy(
        min_scale=2.0**-2, max_scale=2.0**8, first_scale=2.0**4, recovery_interval=3
    )
    state = policy.initial_state(2.0**4, CPU)
    state = policy.adjust(state, torch.tensor(0.0), torch.tensor(1e-9))  # wants ~2**44
    assert float(state.scale) == 2.0**8
    for _ in range(20):
        policy.update_(state, torch.tensor(3.0, dtype=torch.float64))  # overflows, float64 flag
    assert float(state.scale) == 2.0**-2
    assert float(state.target) == 2.0**8
    for _ in range(3):  # 3 clean steps double it once: the overflows did not push it lower
        policy.update_(state, torch.tensor(0.0, dtype=torch.float64))
    assert float(state.scale) == 2.0**-1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"margin": 0.5}, ("margin", ">= 1")),
        ({"margin": float("nan")}, ("margin",)),
        ({"history_length": 0}, ("history_length", ">= 1")),
        ({"sample_every": 1.5}, ("sample_every", "int")),
        ({"recovery_interval": 0}, ("recovery_interval", ">= 1")),
        ({"backoff_factor": 0.3}, ("backoff_factor", "power of two")),
        ({"backoff_factor": 2.0}, ("backoff_factor", "below 1")),
        ({"first_scale": 1000.0}, ("first_scale", "2**e", "2.0**10")),
        ({"first_scale": 2.0**20, "max_scale": 2.0**10}, ("first_scale", "max_scale")),
        ({"min_scale": 2.0**4, "max_scale": 2.0**2}, ("min_scale", "max_scale")),
        ({"min_scale": 2.0**-140}, ("min_scale", "-126")),
        ({"max_scale": "big"}, ("max_scale", "number")),
    ],
)
def test_bad_configurations_are_refused_naming_the_argument(
    kwargs: dict[str, object], words: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError) as raised:
        HeadroomPolicy(**kwargs)  # type: ignore[arg-type]
    assert isinstance(raised.value, ampscaler.InvalidConfigError)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_adjust_refuses_another_policys_state() -> None:
    with pytest.raises(TypeError, match="HeadroomState"):
        HeadroomPolicy().adjust(ScalePolicy().initial_state(1.0, CPU), torch.tensor(0.0))


# ---------------------------------------------------------------------------- in a scaler


class Net(torch.nn.Module):
    """Linear -> tanh -> linear under fp16 autocast; a summed loss makes its gradients large,
    so float16 overflows from a scale of about 2**9."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(16, 16)
        self.act = torch.nn.Tanh()
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(x)))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(step))


def _train(
    scaler: GradScaler | torch.amp.GradScaler,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    poison: frozenset[int] = frozenset(),
) -> list[tuple[float, bool]]:
    """Train ``steps``; per step the scale it used and whether it was skipped."""
    seen = []
    for step in steps:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(_batch(step)).float() * 4.0).sum()
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        if step in poison:
            model.out.bias.grad.fill_(float("inf"))  # type: ignore[union-attr,operator]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        seen.append((before, scaler.get_scale() < before))
    return seen


def _rig(
    policy: HeadroomPolicy | None = None, fused: bool = False, **kwargs: object
) -> tuple[GradScaler, Net, torch.optim.Optimizer]:
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    scaler = GradScaler("cpu", policy=policy or HeadroomPolicy(), **kwargs)  # type: ignore[arg-type]
    scaler.watch(model)
    return scaler, model, opt


def test_the_first_measurement_sets_the_scale_whatever_init_scale_so_no_warmup_skips() -> None:
    for init in (2.0**16, 2.0**32, 3.0e4):
        scaler, model, opt = _rig(init_scale=init)
        assert scaler.get_scale() == 1.0  # first_scale: a scale fp16 runs at without scaling
        seen = _train(scaler, model, opt, range(30))
        assert not any(skipped for _, skipped in seen)
        assert 2.0**6 <= seen[1][0] <= 2.0**9  # set by the first measurement, then kept
    reactive, model = torch.amp.GradScaler("cpu", init_scale=2.0**32), Net()
    theirs = _train(reactive, model, torch.optim.Adam(model.parameters()), range(30))
    assert sum(skipped for _, skipped in theirs) >= 20  # torch finds the ceiling by overflowing


def test_a_real_overflow_backs_off_at_once_and_holds_until_recovery() -> None:
    policy = HeadroomPolicy(recovery_interval=4, sample_every=1)
    scaler, model, opt = _rig(policy)
    seen = _train(scaler, model, opt, range(20), poison=frozenset({8}))
    scales = [math.log2(scale) for scale, _ in seen]
    assert [skipped for _, skipped in seen] == [i == 8 for i in range(20)]
    ceiling = scales[8]
    assert scales[9:13] == [ceiling - 1] * 4  # one binade below the measurement for 4 steps
    assert scales[13] == ceiling  # then it doubles back to the target
    assert scaler.stats.skipped == 1 and scaler.last_overflow is None


def test_what_is_measured_activation_and_float16_computed_gradients_only() -> None:
    # The norm runs in float32 (its input is), the head in float16 under autocast.
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        model[1].weight.fill_(100.0)  # the norm's bias gradient: 256 rows x 100, in float32
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taps: list[torch.Tensor] = []

    def tap(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: taps.append(g.abs().max().float()))

    for module in model:
        module.register_forward_hook(tap)
    watched, alone = HeadroomMeter(HeadroomPolicy()), HeadroomMeter(HeadroomPolicy())
    watched.watch(model)
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        (model(x).float() * 1e6).sum().backward()  # before scale(): not at the scale, dropped
    opt.zero_grad(set_to_none=True)
    taps.clear()
    watched.start()  # what the scaler's scale() does
    with torch.autocast("cpu", dtype=torch.float16):
        model(x).float().sum().backward()
    watched.measure(opt)
    alone.measure(opt)
    by_watch, by_params = watched.take(CPU), alone.take(CPU)
    assert by_watch is not None and by_params is not None
    norm_grads = [p.grad.abs().max() for p in model[0].parameters()]  # type: ignore[union-attr]
    head_grad = model[1].weight.grad.abs().max()  # type: ignore[union-attr]
    # The activation gradients and the head's (float16) gradient; not the norm's.
    assert float(by_watch) == float(torch.stack([*taps, head_grad]).max())
    assert float(torch.stack(norm_grads).max()) > 100 * float(by_watch)
    # Unwatched, every parameter gradient counts, and nothing else.
    assert float(by_params) == float(torch.stack([*norm_grads, head_grad]).max())


def test_measuring_runs_every_iteration_while_young_then_every_sample_every() -> None:
    policy = HeadroomPolicy(history_length=3, sample_every=4)
    scaler, model, opt = _rig(policy)
    hooked = []
    for step in range(12):
        hooked.append(bool(model.hidden._forward_hooks))
        _train(scaler, model, opt, range(step, step + 1))
    assert hooked == [policy.measures(i) for i in range(12)]
    assert [i for i, on in enumerate(hooked) if on] == [0, 1, 2, 6, 10]


def test_the_fused_one_pass_route_stays_open() -> None:
    scaler, model, opt = _rig(fused=True, one_pass_fused=True)
    handed: list[object] = []
    step = opt.step

    def spy(*args: object, **kwargs: object) -> object:
        handed.append(getattr(opt, "grad_scale", "none"))
        return step(*args, **kwargs)

    opt.step = spy  # type: ignore[method-assign]
    _train(scaler, model, opt, range(24), poison=frozenset({20}))
    assert handed[-1] is None  # the check pass unscaled: the kernel divides nothing
    assert scaler._state.exact_reciprocal


def test_update_with_a_new_scale_holds_it_until_the_next_measurement() -> None:
    # measures iterations 0, 3, 6; one margin for them all (the young history's is the same)
    policy = HeadroomPolicy(history_length=1, sample_every=3, first_margin=2**0.5)
    scaler, model, opt = _rig(policy)
    measured = _train(scaler, model, opt, range(2))[1][0]
    with torch.autocast("cpu", dtype=torch.float16):
        scaler.scale(model(_batch(2)).float().sum()).backward()
    scaler.step(opt)
    scaler.update(2.0**3)  # not the policy's iteration: the schedule stays at iteration 2
    opt.zero_grad()
    later = _train(scaler, model, opt, range(3, 6))
    assert [scale for scale, _ in later] == [2.0**3, 2.0**3, measured]  # 3 measured at 2**3
    with pytest.raises(ValueError, match="power of two"):
        scaler.update(1000.0)


def test_setters_of_torchs_rule_are_refused_and_getters_report_the_recovery_rule() -> None:
    scaler = GradScaler("cpu", policy=HeadroomPolicy(recovery_interval=500, backoff_factor=0.25))
    assert scaler.get_growth_interval() == 500 and scaler.get_backoff_factor() == 0.25
    with pytest.raises(RuntimeError, match="measured gradients"):
        scaler.set_growth_factor(4.0)


# ---------------------------------------------------------------------------- checkpoints

POISON = frozenset({5, 17, 18})


def test_a_resumed_run_measures_and_scales_exactly_as_the_uninterrupted_one(
    tmp_path: object,
) -> None:
    policy = HeadroomPolicy(history_length=3, sample_every=4, recovery_interval=5)
    whole, model, opt = _rig(policy)
    seen = _train(whole, model, opt, range(30), POISON)
    for stop in (2, 7, 13):
        scaler, model, opt = _rig(policy)
        first = _train(scaler, model, opt, range(stop), POISON)
        saved = {"scaler": scaler.state_dict(), "model": model.state_dict(),
                 "opt": opt.state_dict()}  # fmt: skip
        path = f"{tmp_path}/at-{stop}.pt"
        torch.save(saved, path)
        loaded = torch.load(path)
        # Constructed with other settings: the checkpoint's configuration wins.
        again, model, opt = _rig(HeadroomPolicy(margin=8.0))
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["opt"])
        again.load_state_dict(loaded["scaler"])
        assert again.policy == policy
        assert first + _train(again, model, opt, range(stop, 30), POISON) == seen
        assert again.state_dict() == whole.state_dict()  # history, counts, target: all of it


def test_state_dict_holds_the_policy_and_its_state_and_loads_into_torch() -> None:
    scaler, model, opt = _rig(HeadroomPolicy(recovery_interval=700))
    _train(scaler, model, opt, range(3))
    saved = scaler.state_dict()
    section = saved["headroom"]
    assert section["iteration"] == 3 and section["measured"] == 3
    assert len(section["history"]) == 64 and section["target"] == scaler.get_scale()
    assert section["margin"] == 2.0**0.5
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(saved)
    assert theirs.get_scale() == scaler.get_scale()
    assert theirs.get_growth_interval() == 700  # the recovery rule
    # Before the first step the state dict already holds a fresh state.
    fresh = GradScaler("cpu", policy=HeadroomPolicy()).state_dict()["headroom"]
    assert fresh["target"] == 1.0 and fresh["measured"] == 0 and fresh["history"] == [0.0] * 64


def test_other_policies_checkpoints_load_as_in_torch() -> None:
    torch_dict = torch.amp.GradScaler("cpu", init_scale=2.0**12).state_dict()
    scaler, model, opt = _rig()
    scaler.load_state_dict(torch_dict)  # torch's: the policy stays, nothing measured yet
    assert isinstance(scaler.policy, HeadroomPolicy)
    assert scaler.state_dict()["headroom"]["target"] == 2.0**12 == scaler.get_scale()
    seen = _train(scaler, model, opt, range(2))
    assert seen[0][0] == 2.0**12 and seen[1][0] != 2.0**12  # then measured
    scaler.load_state_dict(GradScaler("cpu", hysteresis=2).state_dict())  # ampscaler's: replaced
    assert scaler.policy == ScalePolicy(hysteresis=2) and "headroom" not in scaler.state_dict()
    _train(scaler, model, opt, range(2))
    scaler.load_state_dict(GradScaler("cpu", policy=HeadroomPolicy(margin=4.0)).state_dict())
    assert scaler.policy == HeadroomPolicy(margin=4.0) and scaler.get_scale() == 1.0
    assert _train(scaler, model, opt, range(2))[1][0] > 1.0  # measuring again


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"history": [0.0] * 3}, ("headroom['history']", "64")),
        ({"history": [-1.0] * 64}, ("headroom['history']", ">= 0")),
        ({"target": 3.0}, ("headroom['target']", "power of two")),
        ({"target": 2.0**130}, ("headroom['target']", "127")),
        ({"iteration": -1}, ("headroom['iteration']", ">= 0")),
        ({"margin": 0.5}, ("margin", ">= 1")),
    ],
)
def test_a_bad_headroom_section_is_refused_naming_the_key(
    change: dict[str, object], words: tuple[str, ...]
) -> None:
    saved = GradScaler("cpu", policy=HeadroomPolicy()).state_dict()
    bad = {**saved, "headroom": {**saved["headroom"], **change}}
    scaler = GradScaler("cpu", policy=HeadroomPolicy())
    with pytest.raises(ampscaler.InvalidStateDictError) as raised:
        scaler.load_state_dict(bad)
    assert all(word in str(raised.value) for word in words), str(raised.value)
    missing = {**saved, "headroom": {"margin": 2.0}}
    with pytest.raises(ampscaler.InvalidStateDictError, match="lacks"):
        scaler.load_state_dict(missing)


def test_a_pickled_or_copied_scaler_goes_on_alike_once_watched_again() -> None:
    scaler, model, opt = _rig(HeadroomPolicy(history_length=2, sample_every=1))
    _train(scaler, model, opt, range(20))
    twins = []
    for twin in (pickle.loads(pickle.dumps(scaler)), copy.deepcopy(scaler)):
        assert twin.state_dict() == scaler.state_dict()
        twin_model = copy.deepcopy(model)
        twin_opt = torch.optim.Adam(twin_model.parameters(), lr=1e-3)
        twin_opt.load_state_dict(opt.state_dict())
        twin.watch(twin_model)
        twins.append((twin, twin_model, twin_opt))
    seen = _train(scaler, model, opt, range(20, 30))
    for twin, twin_model, twin_opt in twins:
        assert _train(twin, twin_model, twin_opt, range(20, 30)) == seen
        # Measured like the original: the same history, counts and scale.
        assert twin.state_dict() == scaler.state_dict()


def _scales_of_a_step(compiled: bool) -> tuple[list[float], int]:
    """The scales of 10 steps (one overflows) and the graphs compiled after the first step."""
    scaler, model, opt = _rig(HeadroomPolicy(history_length=2, sample_every=3))

    def step(x: torch.Tensor, poison: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x).float() * 4.0).sum() * poison
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    fn = torch.compile(step, backend="eager") if compiled else step
    scales, graphs = [], []
    for index in range(10):  # step 6: a finite loss whose float16 gradients overflow
        fn(_batch(index), torch.tensor(2.0**30 if index == 6 else 1.0))
        scales.append(scaler.get_scale())
        graphs.append(counters["stats"]["unique_graphs"])
    return scales, graphs[-1] - graphs[0]


def test_a_compiled_step_scales_as_the_eager_one_and_never_recompiles() -> None:
    torch._dynamo.reset()
    counters.clear()
    try:
        (eager, _), (compiled, recompiled) = _scales_of_a_step(False), _scales_of_a_step(True)
    finally:
        torch._dynamo.reset()
    assert compiled == eager
    assert min(eager[6:]) < max(eager[:6])  # the overflow backed off
    assert recompiled == 0  # though the measuring hooks come and go (iterations 0, 1, 4, 7)


@pytest.mark.parametrize(
    "kwargs",
    [{"policy": HeadroomPolicy()}, {"probe_every": 10}, {"trace": True}],
    ids=["headroom", "probe", "tracer"],
)
def test_a_watched_model_still_deep_copies_and_saves_and_its_copy_is_not_tapped(
    kwargs: dict[str, object],
) -> None:
    model = Net()
    policy = kwargs.pop("policy", None)
    scaler = observed(GradScaler("cpu", policy=policy), **kwargs)  # type: ignore[arg-type]
    scaler.watch(model)  # the hooks are on from the first iteration
    twin = copy.deepcopy(model)  # what an EMA or SWA wrapper does
    torch.save(model, io.BytesIO())
    hook = scaler._hooks.find(MeterHook)
    meter = None if hook is None else hook.meter
    if meter is not None:
        meter.start()  # as the iteration's scale() does
    with torch.autocast("cpu", dtype=torch.float16):
        (twin(_batch(0)).float() * 1e6).sum().backward()  # the copy's gradients are not seen
    if meter is not None:
        assert meter.take(CPU) == NOT_MEASURED
    _train(scaler, model, torch.optim.SGD(model.parameters(), lr=1e-3), range(2))


def test_isolated_outliers_do_not_ratchet_the_scale_down() -> None:
    """Four outlier batches (finite losses whose scaled gradients overflow, spaced 20 steps
    apart, as with the heavy-tailed advantages of RL): each is skipped, and 50 clean steps after
    the last the scale is back within a factor 2 of what the measurements allow (with torch's
    rule at growth_interval 2000 it would still be 16 times lower)."""
    scaler, model, opt = _rig(HeadroomPolicy())
    _train(scaler, model, opt, range(100))
    target = scaler.state_dict()["headroom"]["target"]
    assert scaler.get_scale() == target
    outliers = frozenset(range(100, 180, 20))
    seen = _train(scaler, model, opt, range(100, 230), poison=outliers)
    steps = range(100, 230)
    skipped_at = [step for step, (_, skipped) in zip(steps, seen, strict=True) if skipped]
    assert skipped_at == sorted(outliers)
    target = scaler.state_dict()["headroom"]["target"]
    assert scaler.get_scale() >= target / 2
    assert scaler.stats.skipped == len(outliers)


def test_an_inf_loss_leaves_the_scale_and_the_measurements_alone() -> None:
    scaler, model, opt = _rig(HeadroomPolicy(sample_every=1))
    _train(scaler, model, opt, range(70))
    before = scaler.state_dict()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(_batch(70)).float() * 4.0).sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    after = scaler.state_dict()
    assert scaler.last_skip_reason == "nonfinite" and scaler.last_overflow.cause == "loss"
    assert after["scale"] == before["scale"]
    assert after["headroom"]["history"] == before["headroom"]["history"]
    assert after["stats"]["skipped"] == before["stats"]["skipped"] + 1


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_loss_whose_step_went_through_moves_the_policy_as_any_step(fused: bool) -> None:
    """The policy holds where a non-finite loss skipped the step (a lower scale cannot help
    it); a step that went through, its gradients finite, is a clean step for the scale, with a
    plain optimizer (whose step the host knows, and whose update then makes no loss flag: 13
    ops, not 42, in benchmarks/dispatch_count.py) and a fused one alike."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused or None)
    scaler = GradScaler("cpu", policy=HeadroomPolicy(history_length=2, sample_every=4))
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    before = scaler.state_dict()["headroom"]["iteration"]
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum() + torch.tensor(float("nan"))  # its gradients finite
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped
    assert scaler.state_dict()["headroom"]["iteration"] == before + 1
