"""Host syncs per training step: none on the fused-optimizer path, one on the plain path.

(A skipped step on the plain path reads more: it names the parameters that overflowed.)

On the CPU a sync is counted through test doubles of the ``torch.Tensor`` methods that read a
value back to Python (``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``); calls made
inside ``optimizer.step`` itself are not the scaler's and are not counted. Torch's scaler, run
the same way, gives the same counts. On a GPU, CUDA's sync debug mode must stay silent.

Long runs on the fused path read the scale once every 80 or so updates, to renew what the
scaler knows about it (``ampscaler.pow2``), and the counters once every 100, to watch for a
collapse (``ampscaler.observe.collapse``): on the CPU a plain read of host memory, on CUDA a
non-blocking copy polled with an event, so still no sync.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import ampscaler

READS = ("item", "tolist", "__bool__", "__float__", "__int__")


class SyncCounter:
    """Counts value reads while active; ``paused()`` stops counting for a while."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.active = False
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                self.count += 1
            return original(tensor, *args, **kwargs)

        return read

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def not_counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            was, self.active = self.active, False
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = was

        return call


def syncs_per_step(
    factory: Callable[..., Any],
    fused: bool,
    set_to_none: bool,
    monkeypatch: pytest.MonkeyPatch,
    overflow_at: int | None = 3,
    device: str = "cpu",
) -> list[int]:
    counter = SyncCounter(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)).to(device)
    if fused:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt.step = counter.not_counting(opt.step)  # type: ignore[method-assign]
    scaler = factory(device, growth_interval=2)
    counts = []
    for step in range(6):
        loss = model(torch.ones(2, 4, device=device)).float().sum()
        if step == overflow_at:
            loss = loss * float("inf")
        with counter.counting():
            scaled = scaler.scale(loss)
        scaled.backward()
        before = counter.count
        with counter.counting():
            scaler.step(opt)
            scaler.update()
        counts.append(counter.count - before)
        opt.zero_grad(set_to_none=set_to_none)
    return counts


@pytest.mark.parametrize("flat", [False, True], ids=["defaults", "flat_grads"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_fused_path_never_syncs(
    set_to_none: bool, flat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ampscaler_factory = functools.partial(ampscaler.GradScaler, flat_grads=flat)
    ours = syncs_per_step(ampscaler_factory, True, set_to_none, monkeypatch)
    assert ours == [0] * 6
    assert ours == syncs_per_step(torch.amp.GradScaler, True, set_to_none, monkeypatch)


def _guarded(*args: Any, **kwargs: Any) -> ampscaler.GradScaler:
    scaler = ampscaler.GradScaler(*args, **kwargs)
    scaler.attach(ampscaler.SpikeGuard(window=2, warmup=2))  # deciding from the third step
    return scaler


def test_fused_path_with_a_spike_guard_never_syncs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert syncs_per_step(_guarded, True, True, monkeypatch) == [0] * 6


def test_plain_path_with_a_spike_guard_still_syncs_once_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert syncs_per_step(_guarded, False, True, monkeypatch, None) == [1] * 6


@pytest.mark.parametrize("flat", [False, True], ids=["defaults", "flat_grads"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_plain_path_syncs_once_per_step(
    set_to_none: bool, flat: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ampscaler_factory = functools.partial(ampscaler.GradScaler, flat_grads=flat)
    ours = syncs_per_step(ampscaler_factory, False, set_to_none, monkeypatch, None)
    assert ours == [1] * 6
    assert ours == syncs_per_step(torch.amp.GradScaler, False, set_to_none, monkeypatch, None)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_unscale_takes_the_read_step_would_make(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's table: ``unscale_`` of a plain optimizer reads its flag (the one read its
    ``step()`` makes otherwise), and that ``step()`` then reads nothing; fused: neither reads."""
    counter = SyncCounter(monkeypatch)
    model = torch.nn.Linear(4, 1)
    if fused:
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt.step = counter.not_counting(opt.step)  # type: ignore[method-assign]
    scaler = ampscaler.GradScaler("cpu")
    counts = []
    for _ in range(3):
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        for call in (scaler.unscale_, scaler.step):
            counter.count = 0
            with counter.counting():
                call(opt)
            counts.append(counter.count)
        scaler.update()
        opt.zero_grad()
    assert counts == ([0, 0] if fused else [1, 0]) * 3


def test_long_fused_runs_read_the_scale_only_for_the_collapse_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one-pass route knows the scale is an exact power of two without reading it: every
    update holds it at the floor (it read the scale every 80 or so updates while it kept a
    lower bound on it)."""
    counter = SyncCounter(monkeypatch)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    opt.step = counter.not_counting(opt.step)  # type: ignore[method-assign]
    scaler = ampscaler.GradScaler("cpu", growth_interval=1, one_pass_fused=True)
    steps = 400

    def reads_in_a_run() -> int:
        counter.count = 0
        with counter.counting():
            for step in range(steps):
                loss = model(torch.ones(2, 4)).sum() * (float("inf") if step % 2 else 1.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=False)
        return counter.count

    # The collapse watch's look at the counters every window, and nothing else.
    assert 1 <= reads_in_a_run() <= steps // ampscaler.CollapseWatch().window
    scaler.attach(ampscaler.CollapseWatch(scale_drop=None, skip_rate=None))  # watches nothing
    assert reads_in_a_run() == 0


def test_the_counter_sees_a_sync() -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        counter = SyncCounter(monkeypatch)
        with counter.counting():
            bool(torch.tensor(1.0) > 0)
            torch.tensor([1.0]).tolist()
        assert counter.count == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("steps", "overflow_every"), [(4, None), (400, 2)])
def test_fused_path_never_syncs_on_cuda(steps: int, overflow_every: int | None) -> None:
    """The long run overflows on every other step: the bound on the scale's exponent runs low
    and is renewed from non-blocking copies, and the one-pass route (opt-in since the defaults
    became torch's route) stays on throughout."""
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    routes: list[bool] = []
    opt.register_step_pre_hook(lambda o, a, k: routes.append(o.grad_scale is None))
    scaler = ampscaler.GradScaler("cuda", growth_interval=1, flat_grads=True, one_pass_fused=True)
    for step in range(steps):
        loss = model(torch.ones(8, 64, device="cuda")).float().sum()
        if overflow_every and step % overflow_every:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if step >= 2:  # after the first steps created the scale, counters and the plan
            torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad(set_to_none=False)
    assert routes == [True] * steps
