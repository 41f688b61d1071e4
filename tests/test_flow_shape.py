"""The shape of one step, as a reader follows it: each arrow of the flow in one module.

Following an optimizer through ``scaler.step()`` (and ``update()``), every call from one
ampscaler module into another is a visit to the callee's module, wherever the caller is (the
front, ``scaler.py``, or any module it called). The design asks that no module be visited more
than twice per call: the flow reads loss -> collect -> check -> agree -> decide, not back and
forth. A profiler records the calls.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ampscaler
import core_shape

PACKAGE = Path(ampscaler.__file__).resolve().parent
FRONT = PACKAGE / "scaler.py"


def _module(frame: FrameType | None) -> Path | None:
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    return path if PACKAGE in path.parents else None


def visits(call: Callable[[], object]) -> Counter[str]:
    """How often ``call()`` enters each ampscaler module from another ampscaler module (a
    generator resumed is the same entry: one frame)."""
    seen: Counter[str] = Counter()
    entered: dict[int, FrameType] = {}  # kept alive, so that no other frame reuses the id

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or entered.get(id(frame)) is frame:
            return
        callee, caller = _module(frame), _module(frame.f_back)
        if callee is not None and caller is not None and callee != caller:
            entered[id(frame)] = frame
            seen[str(callee.relative_to(PACKAGE))] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


def _steps(fused: bool, group: dist.ProcessGroup | None) -> list[Counter[str]]:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    # Without a group, none is passed: an explicit None given before init_process_group()
    # makes the first step look once whether the process turned out to be one of several.
    scaler = ampscaler.GradScaler("cpu", **({} if group is None else {"process_group": group}))
    counted = []
    for poison in (False, True, False):
        scaler.scale(model(torch.ones(1, 4)).sum()).backward()
        if poison:
            model.bias.grad.fill_(float("inf"))
        counted.append(visits(lambda: scaler.step(opt)))
        counted.append(visits(scaler.update))
        opt.zero_grad()
    return counted


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("agree", [False, True], ids=["one-rank", "process-group"])
def test_step_and_update_visit_each_module_at_most_twice(
    fused: bool, agree: bool, request: pytest.FixtureRequest
) -> None:
    group = request.getfixturevalue("world_of_one") if agree else None
    counted = _steps(fused, group)
    step = counted[0]
    # The arrows of the flow, each in its own module.
    assert step["grads/collect.py"] == 1
    assert step["grads/fused.py"] == (2 if fused else 0)  # the route, then the handover
    assert step["grads/check.py"] == 1
    assert step["distributed.py"] == (2 if agree else 0)  # start agreeing, then settle
    for calls in counted:
        assert max(calls.values(), default=0) <= 2, calls


def test_a_default_iteration_enters_six_modules_and_jumps_sixteen_times_at_most() -> None:
    """Traced as a new maintainer would follow it (tests/core_shape.py): scale, backward,
    unscale_, step, update with nothing attached, the third iteration. No observer runs: a
    hook that is not due costs nothing."""
    trace = core_shape.trace_default_iteration()
    assert trace.observers == [], trace.modules
    assert len(trace.modules) <= 6, trace.modules
    assert len(trace.jumps) <= 16, trace.jumps
