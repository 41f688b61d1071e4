"""A disabled scaler's rule getters raise ``AttributeError``, as torch's do (#34 item 13).

torch's disabled ``GradScaler`` and ``ShardedGradScaler`` never set ``_growth_factor`` and
friends, so ``get_growth_factor()``, ``get_backoff_factor()`` and ``get_growth_interval()`` raise
``AttributeError``; ampscaler's answered with the configured values, so code that tells a
disabled scaler by that error (``hasattr``, ``except AttributeError``) took another branch.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

import ampscaler

GETTERS = ("get_growth_factor", "get_backoff_factor", "get_growth_interval")
PAIRS = (
    (torch.amp.GradScaler, ampscaler.GradScaler),
    (TorchSharded, ampscaler.ShardedGradScaler),
)


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=["GradScaler", "ShardedGradScaler"])
@pytest.mark.parametrize("getter", GETTERS)
def test_a_disabled_scalers_getters_raise_attribute_error_as_torchs(
    theirs: type[torch.amp.GradScaler], ours: type[ampscaler.GradScaler], getter: str
) -> None:
    with pytest.raises(AttributeError):
        getattr(theirs("cpu", enabled=False, growth_interval=7), getter)()
    scaler = ours("cpu", enabled=False, growth_interval=7)
    with pytest.raises(AttributeError) as raised:
        getattr(scaler, getter)()
    message = str(raised.value)
    assert f"{ours.__name__}.{getter}(): this scaler is disabled" in message
    assert "keeps no growth settings" in message and "torch's raises AttributeError" in message
    assert "scaler.policy" in message and "growth_interval=7" in message  # where the value is
    assert scaler.get_scale() == theirs("cpu", enabled=False).get_scale() == 1.0
    assert scaler.policy.growth_interval == 7  # type: ignore[attr-defined]


def test_a_scaler_disabled_for_lack_of_its_device_raises_too() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: there a 'cuda' scaler disables itself")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        scaler = ampscaler.GradScaler("cuda", growth_factor=4.0)
    assert not scaler.is_enabled()
    with pytest.raises(AttributeError, match="growth_factor=4.0"):
        scaler.get_growth_factor()


def test_an_enabled_scalers_getters_answer() -> None:
    scaler = ampscaler.GradScaler("cpu", growth_factor=3.0, backoff_factor=0.25, growth_interval=7)
    got = tuple(getattr(scaler, getter)() for getter in GETTERS)
    assert got == (3.0, 0.25, 7)


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=["GradScaler", "ShardedGradScaler"])
def test_a_disabled_scaler_has_no_scale_tensors_as_torchs(
    theirs: type[torch.amp.GradScaler], ours: type[ampscaler.GradScaler]
) -> None:
    """torch's disabled scaler never sets ``_scale`` or ``_growth_tracker``, so code tells it
    by ``hasattr``; read in public training code, each on a scaler that may be disabled
    (``GradScaler(enabled=use_amp)``, or ``"cuda"`` on a machine without it):

    - a floor for ROCm: ``if hasattr(scaler, "_scale") and scaler._scale < 128:``;
    - autocast's dtype: ``scaler._scale.dtype if hasattr(scaler, "_scale") else float16``;
    - a log: ``scaler._scale if hasattr(scaler, "_scale") else 0.0``;
    - stable-dreamfusion's gradient hook: ``grad_scale = scaler._get_scale_async()``.

    Where ampscaler answered ``None``, the first two failed with a ``TypeError`` and an
    ``AttributeError`` on ``None`` and the log got ``None``. An assignment is kept and read
    back, never used, as on torch's."""
    for factory in (theirs, ours):
        scaler = factory("cpu", enabled=False)
        for name in ("_scale", "_growth_tracker"):
            assert not hasattr(scaler, name)
        with pytest.raises(AttributeError, match="_scale"):
            scaler._get_scale_async()
        assert scaler._get_growth_tracker() == 0
        if hasattr(scaler, "_scale") and scaler._scale < 128:
            raise AssertionError("unreachable: the floor is not applied to a disabled scaler")
        logged = scaler._scale if hasattr(scaler, "_scale") else 0.0
        assert logged == 0.0
        floor = torch.tensor(128.0)
        scaler._scale = floor
        scaler._growth_tracker = torch.tensor(3)
        assert scaler._scale is floor and scaler._get_scale_async() is floor
        assert scaler._growth_tracker.item() == 3 and scaler._get_growth_tracker() == 0
        assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
        loss = torch.ones((), requires_grad=True)
        assert scaler.scale(loss) is loss  # never used
