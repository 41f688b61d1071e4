"""A collapsed run (issue #27, item 1): the scale stops at 2**-126, the user hears it before any
step runs there, and whatever state the scaler is in, its own state_dict loads again.

torch's scaler backs off on into subnormal scales and 0 after some 150 inf/NaN iterations in a
row; once ``1/scale`` overflows float32, the next finite step writes inf/NaN into the
parameters without a skip, and its state dict (scale 0.0) is one ampscaler refuses.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import ampscaler
from ampscaler.policy import LOWEST_SCALE
from ampscaler.state import ScalerState
from user_policy import HalveOrDouble

NAN_BATCHES = 170  # more backoffs than 2**16 has binades above 2**-126 (142)
FINITE_BATCHES = 4


def _collapse(scaler: Any, fused: bool = False, save_every: int = 0) -> dict[str, Any]:
    """``NAN_BATCHES`` iterations whose loss is NaN, then finite ones; the parameters, the
    scales, the collapse alerts seen by then, and the state dicts saved every ``save_every``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    alerts: list[ampscaler.CollapseAlert] = []
    if isinstance(scaler, ampscaler.GradScaler):
        scaler.on("collapse", alerts.append)
    saved, first_finite_alerts = [], None
    for step in range(NAN_BATCHES + FINITE_BATCHES):
        if step == NAN_BATCHES:
            first_finite_alerts = list(alerts)  # what was said before a finite step ran
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(3, 4)).float().pow(2).mean()
        if step < NAN_BATCHES:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if save_every and step % save_every == save_every - 1:
            saved.append(scaler.state_dict())
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "scale": scaler.get_scale(),
        "alerts_before_finite": first_finite_alerts,
        "saved": saved,
    }


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_a_collapse_stops_at_the_floor_and_warns_before_a_step_runs_there(fused: bool) -> None:
    with pytest.warns(ampscaler.ScaleFloorWarning) as caught:
        ours = _collapse(ampscaler.GradScaler("cpu"), fused)
    floor = [w for w in caught if issubclass(w.category, ampscaler.ScaleFloorWarning)]
    assert len(floor) == 1  # once per stay at the floor
    message = str(floor[0].message)
    assert "2**-126" in message and "142 step(s) in a row" in message
    assert "the loss itself was already inf/NaN" in message  # the latest, at least
    assert "lowering the scale cannot help" in message
    assert floor[0].filename == __file__  # points at the training loop
    (alert,) = [a for a in ours["alerts_before_finite"] if a.reasons == ("floor",)]
    assert alert.last_step == 141 and alert.in_a_row == 142  # the update that reached it
    assert ours["scale"] == LOWEST_SCALE
    assert all(torch.isfinite(p).all() for p in ours["params"])
    theirs = _collapse(torch.amp.GradScaler("cpu"), fused)  # what the floor prevents
    assert theirs["scale"] == 0.0
    assert not all(torch.isfinite(p).all() for p in theirs["params"])


def test_a_non_fused_step_skipped_at_the_floor_warns_even_without_a_collapse_seen() -> None:
    """Reaching the floor within one window of the collapse watch: the plain step that skips
    there says so (its verdict and scale are read anyway)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**-120)
    with pytest.warns(ampscaler.ScaleFloorWarning, match=r"the last 7 step\(s\) in a row"):
        for _ in range(8):
            scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampscaler.ScaleFloorWarning)  # to stop a run there
        scaler.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
        scaler.step(opt)  # still at the floor: said once already, not again
        scaler.update()


POLICIES = {
    "torch's rule": lambda: ampscaler.GradScaler("cpu"),
    "hysteresis": lambda: ampscaler.GradScaler("cpu", hysteresis=3),
    "headroom": lambda: ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy()),
    "a policy of one's own": lambda: ampscaler.GradScaler("cpu", policy=HalveOrDouble()),
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_state_dict_of_a_collapsing_run_loads_again(policy: str) -> None:
    """Saved every 10 iterations through 170 NaN batches and after: each loads into a fresh
    scaler, and the run's parameters stay finite (a policy of one's own that never stops
    backing off is held at 2**-126 by the scaler)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampscaler.ScaleFloorWarning)
        run = _collapse(POLICIES[policy](), save_every=10)
    assert run["scale"] >= LOWEST_SCALE
    assert all(torch.isfinite(p).all() for p in run["params"])
    for saved in run["saved"]:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        fresh = POLICIES[policy]()
        fresh.load_state_dict(torch.load(buffer))
        assert fresh.state_dict() == saved


def test_a_deferred_update_of_a_policy_of_ones_own_is_held_at_the_floor_too() -> None:
    """The masked transition a compiled ``scale()`` applies clamps as the eager one does."""
    state = ScalerState(HalveOrDouble(), LOWEST_SCALE)
    state.on(torch.device("cpu"))
    state.defer([torch.tensor(1.0)])
    assert state.scale_value() == LOWEST_SCALE


@pytest.mark.parametrize("scale", [0.0, 1e-40, 2.0**-127])
def test_a_torch_state_dict_with_a_collapsed_scale_is_refused_with_what_to_do(
    scale: float,
) -> None:
    saved = {**torch.amp.GradScaler("cpu").state_dict(), "scale": scale}
    scaler = ampscaler.GradScaler("cpu", init_scale=8.0)
    with pytest.raises(ampscaler.InvalidStateDictError) as caught:
        scaler.load_state_dict(saved)
    message = str(caught.value)
    assert "at least 2**-126" in message and "collapsed run" in message
    assert "state_dict['scale'] = 65536.0" in message
    assert scaler.get_scale() == 8.0
    torch.amp.GradScaler("cpu").load_state_dict(saved)  # torch takes it (stricter: migration.md)


def _clamps(fn: Callable[[], object]) -> int:
    """How many clamp ops ``fn()`` runs."""
    count = 0

    class CountClamps(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            nonlocal count
            count += "clamp" in func.__name__
            return func(*args, **(kwargs or {}))

    with CountClamps():
        fn()
    return count


def _clamps_in_update(scaler: ampscaler.GradScaler, loss_factor: float, fused: bool = False) -> int:
    """One iteration of a tiny model with its loss times ``loss_factor``; how many clamp ops
    its ``update()`` ran."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    scaler.scale(model(torch.ones(1, 2)).sum() * loss_factor).backward()
    scaler.step(opt)
    return _clamps(scaler.update)


def test_the_floor_is_one_clamp_in_every_update() -> None:
    """One plain rule (issue 36): every update holds the scale at 2**-126 with one clamp, the
    same op wherever the scale is, with nothing followed on the host. (It replaced a lower
    bound the host followed to skip the clamp far above the floor, and renewed from copies of
    the scale where it never learned the outcome.)"""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**16)
    assert _clamps_in_update(scaler, 1.0) == 1  # clean, far above the floor
    assert _clamps_in_update(scaler, float("inf")) == 1  # one backoff: still far above
    scaler.update(2.0**-125)  # one backoff from the floor
    assert _clamps_in_update(scaler, float("inf")) == 1
    assert scaler.get_scale() == LOWEST_SCALE


def test_a_write_to_the_scale_from_outside_the_scaler_still_stops_at_the_floor() -> None:
    """torch's private ``_scale`` written by hand (as some loops do): the backoffs still stop
    at the floor."""
    torch.manual_seed(0)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**16)
    assert _clamps_in_update(scaler, 1.0) == 1
    scaler._scale.fill_(2.0**-125)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampscaler.ScaleFloorWarning)  # said at the floor
        for _ in range(3):
            _clamps_in_update(scaler, float("inf"))
    assert scaler.get_scale() == LOWEST_SCALE


def test_an_optimizer_unscaled_and_not_stepped_counts_for_the_bound() -> None:
    """``unscale_()`` read its overflow and no ``step()`` followed: the update still backs off
    (as torch's does), and the host's bound knows it, so the second backoff stops at the floor."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**-125)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**-125)

    def two_overflows(scaler_: Any) -> float:
        for _ in range(2):
            scaler_.scale(model(torch.ones(1, 2)).sum() * float("inf")).backward()
            scaler_.unscale_(opt)
            scaler_.update()
            opt.zero_grad()
        return float(scaler_.get_scale())

    assert two_overflows(theirs) == 2.0**-127  # what the floor prevents
    with pytest.warns(ampscaler.ScaleFloorWarning, match="at step 1 the scale is 2"):
        assert two_overflows(scaler) == LOWEST_SCALE


def test_the_floor_costs_the_same_where_the_host_never_learns_the_outcome() -> None:
    """A fused optimizer's skip flag stays on the device: the floor is still the one clamp per
    update, at update 150 and on as at the first (nothing on the host runs low)."""
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**16)
    clamps = [_clamps_in_update(scaler, 1.0, fused=True) for _ in range(160)]
    assert clamps == [1] * 160


@dataclasses.dataclass(frozen=True)
class _AlwaysClamped(ampscaler.ScalePolicy):
    """torch's rule in a policy class of the user's own: the floor is the update's, the same
    for every policy."""


_FLOOR_STEP = st.tuples(
    st.sampled_from([True, True, False]),  # the gradients overflow (mostly: to the floor)
    st.sampled_from(["", "", "", "read", "set", "write"]),  # what the loop does besides
    st.sampled_from([2.0**-125, 2.0**-120, 3.0e-38, 1.0, 65536.0]),  # the value it sets
)


@settings(max_examples=60, deadline=None)
@given(
    fused=st.booleans(),
    backoff=st.sampled_from([0.5, 0.25, 0.1, 0.999]),
    hysteresis=st.sampled_from([1, 2]),
    start=st.sampled_from([2.0**-124, 2.0**-110, 1.0, 65536.0]),
    steps=st.lists(_FLOOR_STEP, min_size=1, max_size=40),
)
@example(  # a copy of the scale taken before update(new_scale) must not renew the bound
    fused=False,
    backoff=0.25,
    hysteresis=1,
    start=2.0**-110,
    steps=[(True, "", 1.0), (True, "set", 2.0**-125), (True, "", 1.0)],
)
def test_skipping_the_clamp_never_changes_a_scale(
    fused: bool, backoff: float, hysteresis: int, start: float, steps: list[Any]
) -> None:
    """Side by side with a scaler that clamps after every update, through overflows, reads,
    update(new_scale) and writes to ``_scale`` from outside: the same scale after every update,
    never below the floor."""
    rule = {"backoff_factor": backoff, "hysteresis": hysteresis, "growth_interval": 2}
    ours = ampscaler.GradScaler("cpu", init_scale=start, policy=ampscaler.ScalePolicy(**rule))
    twin = ampscaler.GradScaler("cpu", init_scale=start, policy=_AlwaysClamped(**rule))
    loops = []
    for scaler in (ours, twin):
        model = torch.nn.Linear(2, 1)
        loops.append((scaler, model, torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampscaler.ScaleFloorWarning)
        for overflow, besides, value in steps:
            scales = []
            for scaler, model, opt in loops:
                opt.zero_grad()
                loss = model(torch.ones(1, 2)).sum() * (float("inf") if overflow else 1.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
                if besides == "set":
                    scaler.update(value)
                else:
                    scaler.update()
                if besides == "read":
                    scaler.get_scale()
                if besides == "write":
                    scaler._scale.fill_(value)
                scales.append(scaler._scale.item())
            assert scales[0] == scales[1]
            assert scales[0] >= LOWEST_SCALE


@pytest.mark.parametrize(
    ("in_a_row", "loss_in_a_row", "said"),
    [
        (3, 3, " In all of them the loss itself"),
        (3, 1, " In the latest of them the loss itself"),
        (3, 2, " In the last 2 of them the loss itself"),
        (3, 0, " Overflow causes so far: 3 gradients."),
    ],
)
def test_the_floor_alert_says_how_many_of_the_skips_had_a_nonfinite_loss(
    in_a_row: int, loss_in_a_row: int, said: str
) -> None:
    alert = ampscaler.CollapseAlert(
        first_step=8,
        last_step=10,
        scale=LOWEST_SCALE,
        max_scale=LOWEST_SCALE,
        skip_rate=1.0,
        reasons=("floor",),
        causes={"gradients": 3},
        in_a_row=in_a_row,
        loss_in_a_row=loss_in_a_row,
    )
    assert "were skipped for inf/NaN." + said in str(alert)
    if loss_in_a_row:
        assert str(alert).count("lowering the scale cannot help.") == 1
