"""A collapsed run (issue #27, item 1): the scale stops at 2**-126, the user hears it before any
step runs there, and whatever state the scaler is in, its own state_dict loads again.

torch's scaler backs off on into subnormal scales and 0 after some 150 inf/NaN iterations in a
row; once ``1/scale`` overflows float32, the next finite step writes inf/NaN into the
parameters without a skip, and its state dict (scale 0.0) is one ampscaler refuses.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch

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
