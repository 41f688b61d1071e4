"""patch_torch() tried from outside (issue 34): pickles from before the patch, handles exited
out of order, settings that only fail later, the deprecated names' device and warning."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch

import ampscaler
from ampscaler.integrations.patch import ENV_VAR, setup_hook


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def _one_step(scaler: torch.amp.GradScaler, weight: torch.nn.Parameter) -> None:
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler.scale((weight * 3.0).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_torch_scaler_pickled_before_the_patch_loads_as_a_working_scaler() -> None:
    """Item 6: it was ampscaler's class with torch's __dict__, failing later on '_bf16'."""
    original = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=2)
    _one_step(original, torch.nn.Parameter(torch.ones(2)))
    saved = pickle.dumps(original)
    disabled = pickle.dumps(torch.amp.GradScaler("cpu", enabled=False))
    twin = pickle.loads(saved)  # torch's, unpatched: the reference
    with ampscaler.patch_torch(hysteresis=2):
        loaded = pickle.loads(saved)
        assert isinstance(loaded, ampscaler.GradScaler)
        assert loaded.policy.hysteresis == 2
        assert not pickle.loads(disabled).is_enabled()
    weights = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
    for scaler, weight in zip((twin, loaded), weights, strict=True):
        assert scaler.get_scale() == 512.0 and scaler._get_growth_tracker() == 1
        _one_step(scaler, weight)  # the second clean step in a row: the scale grows
    assert loaded.get_scale() == twin.get_scale() == 1024.0
    assert torch.equal(weights[0], weights[1])


def test_handles_exited_out_of_order_restore_torch_at_the_last() -> None:
    """Item 7: the first handle exited first left torch patched with its settings."""
    original = torch.amp.GradScaler
    first = ampscaler.patch_torch(hysteresis=2)
    second = ampscaler.patch_torch(hysteresis=3)
    first.__exit__(None, None, None)
    assert torch.amp.GradScaler("cpu").policy.hysteresis == 3  # the second is in force
    second.__exit__(None, None, None)
    assert torch.amp.GradScaler is original
    first.__exit__(None, None, None)  # exiting again changes nothing
    assert torch.amp.GradScaler is original


def test_handles_exited_in_order_restore_each_earlier_setting() -> None:
    with ampscaler.patch_torch(hysteresis=2):
        with ampscaler.patch_torch(hysteresis=3):
            assert torch.amp.GradScaler("cpu").policy.hysteresis == 3
        assert torch.amp.GradScaler("cpu").policy.hysteresis == 2
    assert not isinstance(torch.amp.GradScaler("cpu"), ampscaler.GradScaler)


def test_a_sink_that_needs_arguments_is_refused_at_patch_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Item 8: accepted at patch time, every construction then failed with a bare TypeError."""
    monkeypatch.setenv(ENV_VAR, '{"sinks": ["ampscaler:JsonlSink"], "device": "cpu"}')
    with pytest.raises(ampscaler.InvalidConfigError, match="no argument.*path"):
        setup_hook()
    assert not isinstance(torch.amp.GradScaler("cpu"), ampscaler.GradScaler)
    with pytest.raises(TypeError, match="StepHistory needs one"):
        ampscaler.patch_torch(sinks=[ampscaler.StepHistory])


def test_repeated_json_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 8: the last of two "hysteresis" keys was taken silently."""
    monkeypatch.setenv(ENV_VAR, '{"hysteresis": 2, "hysteresis": 3}')
    with pytest.raises(ampscaler.InvalidConfigError, match="'hysteresis' more than once"):
        setup_hook()


def test_deprecated_cuda_name_takes_the_device_setting() -> None:
    """Item 13: nanoGPT's torch.cuda.amp.GradScaler(enabled=...) under device="cpu" passed no
    device, and was refused as if it had passed "cuda"."""
    with ampscaler.patch_torch(device="cpu"), pytest.warns(FutureWarning) as caught:
        scaler = torch.cuda.amp.GradScaler(enabled=True)  # the line the warning names
    assert scaler.is_enabled() and scaler._device == "cpu"
    assert caught[0].filename == __file__


def test_deprecated_name_warns_at_the_line_torch_warns_at() -> None:
    """Item 13: the stand-in's warning pointed at the caller's caller."""
    lines = []
    for patched in (False, True):
        patch = ampscaler.patch_torch() if patched else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cpu.amp.GradScaler()
        if patch is not None:
            patch.__exit__(None, None, None)
        (warning,) = [w for w in caught if issubclass(w.category, FutureWarning)]
        lines.append((warning.filename, warning.lineno))
    assert lines[0] == lines[1]
    assert lines[0][0] == __file__
