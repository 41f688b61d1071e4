"""Devices without float64 (MPS before torch's fix, Intel Arc): training is torch's, bit for bit.

torch's scaler forms ``1/scale`` as ``scale.double().reciprocal().float()``, which such devices
refuse (pytorch#142397, #147731). For a power-of-two scale float32 gives the same reciprocal, and
nothing else on ampscaler's default path needs float64 on the device. A dispatch mode that fails
every float64 result, as MPS does, stands in for such a device on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ampscaler

POISONED = {2, 3, 9}


class NoFloat64(TorchDispatchMode):
    """Every operation whose result is float64 fails, with MPS's error."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                raise TypeError(
                    "Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't "
                    "support float64. Please use float32 instead."
                )
        return out


def _train(
    make_scaler: Callable[[], Any], steps: int, clip: bool, inside: bool
) -> tuple[list[float], list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scales = []
    with NoFloat64() if inside else contextlib.nullcontext():
        scaler = make_scaler()
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4, generator=gen)).float().square().mean()
            scaler.scale(loss).backward()
            if step in POISONED:
                model[2].bias.grad.fill_(float("inf"))
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        saved = scaler.state_dict()
    return scales, [p.detach().clone() for p in model.parameters()], saved


def test_the_mode_fails_float64_as_mps_does_and_torchs_scaler_with_it() -> None:
    with NoFloat64(), pytest.raises(TypeError, match="float64"):
        torch.zeros(1, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        _train(lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8), 2, False, inside=True)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "unscale-clip"])
def test_training_without_float64_is_torchs_bit_for_bit(clip: bool) -> None:
    kwargs = {"init_scale": 2.0**8, "growth_interval": 3}
    ours = _train(lambda: ampscaler.GradScaler("cpu", **kwargs), 110, clip, inside=True)
    theirs = _train(lambda: torch.amp.GradScaler("cpu", **kwargs), 110, clip, inside=False)
    assert ours[0] == theirs[0] and len(set(ours[0])) > 2  # backoffs and growth
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
    assert {k: ours[2][k] for k in theirs[2]} == theirs[2]


def test_records_hysteresis_and_a_group_of_one_need_no_float64(
    world_of_one: torch.distributed.ProcessGroup,
) -> None:
    def make() -> ampscaler.GradScaler:
        scaler = ampscaler.GradScaler(
            "cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2, process_group=world_of_one
        )
        scaler.add_sink(ampscaler.StepHistory(200))
        return scaler

    scales, params, saved = _train(make, 110, True, inside=True)
    reference = _train(
        lambda: ampscaler.GradScaler("cpu", init_scale=2.0**8, growth_interval=3, hysteresis=2),
        110,
        True,
        inside=False,
    )
    assert scales == reference[0]
    assert all(torch.equal(a, b) for a, b in zip(params, reference[1], strict=True))
    assert saved["stats"] == reference[2]["stats"] and saved["stats"]["skipped"] >= len(POISONED)


def test_a_probed_run_needs_no_float64() -> None:
    """The probe's results travel to the host in their own dtypes (int64 counts, a float32
    maximum), read in the step record's one host sync."""

    def make() -> ampscaler.GradScaler:
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        scaler.attach(ampscaler.GradientProbe(every=2))
        scaler.attach(ampscaler.StepHistory(20))
        return scaler

    scales, _, _ = _train(make, 6, False, inside=True)
    assert (
        scales
        == _train(
            lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3),
            6,
            False,
            False,
        )[0]
    )
