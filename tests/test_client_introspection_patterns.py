"""How public training code *inspects* a scaler it was handed, side by side with torch's.

Beside driving a scaler (scale, step, update), code found in public repositories looks at it:
it reads torch's private numbers with a default (``getattr(scaler, "_growth_interval", -1)``),
asks the state dict whether it holds a scale before logging one, peeks at the per-optimizer
flags between ``unscale_()`` and ``step()``, and switches a built scaler off by writing
``_enabled``. Each answer decides a branch of that code, so each must be torch's: here for
``torch.amp.GradScaler("cpu")`` itself, ``ampscaler.GradScaler("cpu")``, and torch's name
built under ``ampscaler.patch_torch()``. (Patterns already covered elsewhere: the truth value
and ``is_enabled()`` in ``test_client_detrex_pattern.py``, ``hasattr(scaler, "_scale")`` in
``test_disabled_getters.py``, ``isinstance`` and the class names in ``test_patch_torch.py``,
pickling and ``copy.deepcopy`` in ``test_client_monai_pattern.py`` and ``test_edges.py``.)
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Make = Callable[..., Any]


@contextlib.contextmanager
def _torchs() -> Iterator[Make]:
    yield lambda **kw: torch.amp.GradScaler("cpu", **kw)


@contextlib.contextmanager
def _ours() -> Iterator[Make]:
    yield lambda **kw: ampscaler.GradScaler("cpu", **kw)


@contextlib.contextmanager
def _patched() -> Iterator[Make]:
    with ampscaler.patch_torch():
        yield lambda **kw: torch.amp.GradScaler("cpu", **kw)


KINDS = {"torch": _torchs, "ampscaler": _ours, "patched": _patched}


def _each(**kw: Any) -> Iterator[tuple[str, Any]]:
    for name, kind in KINDS.items():
        with kind() as make:
            yield name, make(**kw)


def _train(scaler: Any, inf_at: frozenset[int], steps: int = 4) -> dict[str, Any]:
    """A tiny fp16 loop that records what the inspecting code reads each iteration: the
    optimizer's flag taken between ``unscale_()`` and ``step()`` and the logged loss scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flags, logged = [], []
    for i in range(steps):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 3)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if i in inf_at:
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        flags.append(_overflow_detected(scaler, opt))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        logged.append(_logged_scale(scaler))
    return {"flags": flags, "logged": logged, "weight": model.weight.detach().clone()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, a NaN matching a NaN (a disabled scaler steps the inf in)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _overflow_detected(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    # As public training code detects an overflow before the step: the entry with a default,
    # then any flag set.
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
    found_inf = state.get("found_inf_per_device", {})
    return any(bool(value.detach().item()) for value in found_inf.values())


def _logged_scale(scaler: Any) -> float | None:
    # As BEiT/ConvNeXt-style loops log the loss scale: only where the state dict holds one.
    if "scale" in scaler.state_dict().keys():  # noqa: SIM118 (as they write it)
        return float(scaler.state_dict()["scale"])
    return None


def _audit(scaler: Any) -> int:
    # As fine-tuning scripts check the scaler a trainer built for them before training.
    if scaler is None or float(scaler.get_scale()) != 1.0:
        raise RuntimeError(f"unexpected GradScaler: {scaler}")
    growth_interval = int(getattr(scaler, "_growth_interval", -1))
    if growth_interval != 100000:
        raise RuntimeError(f"unexpected GradScaler growth_interval={growth_interval}")
    return growth_interval


def _fingerprint(scaler: Any) -> dict[str, Any]:
    # As resume checks record a scaler's configuration, each number with torch's default.
    return {
        "enabled": bool(scaler.is_enabled()),
        "device": str(getattr(scaler, "_device", "cuda")),
        "init_scale": float(getattr(scaler, "_init_scale", 65536.0)),
        "growth_factor": float(getattr(scaler, "_growth_factor", 2.0)),
        "backoff_factor": float(getattr(scaler, "_backoff_factor", 0.5)),
        "growth_interval": int(getattr(scaler, "_growth_interval", 2000)),
    }


PRIVATE_NUMBERS = (
    "_init_scale",
    "_init_growth_tracker",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_scalers_private_numbers_read_with_a_default_are_torchs(enabled: bool) -> None:
    """Fine-tuning scripts audit the scaler a trainer built (``get_scale()`` 1.0, then
    ``int(getattr(scaler, "_growth_interval", -1))`` must be 100000, else ``RuntimeError``),
    and resume checks fingerprint it (``getattr(scaler, "_init_scale", 65536.0)``,
    ``"_growth_factor", 2.0``, ...). torch's constructor sets none of these numbers when
    disabled, so the defaults answer there: the audit of a disabled scaler fails, and its
    fingerprint holds torch's defaults whatever was passed. Before the fix ampscaler's disabled
    scaler kept them, so the audit passed and the fingerprint held the values passed."""
    kw = {"init_scale": 1.0, "growth_interval": 100000, "growth_factor": 4.0, "enabled": enabled}
    seen = {}
    for name, scaler in _each(**kw):
        audited: object
        try:
            audited = _audit(scaler)
        except RuntimeError as error:
            audited = str(error)
        again = copy.deepcopy(scaler)
        seen[name] = (
            audited,
            _fingerprint(scaler),
            [hasattr(scaler, n) for n in PRIVATE_NUMBERS],
            _fingerprint(again),
        )
    assert seen["ampscaler"] == seen["torch"]
    assert seen["patched"] == seen["torch"]
    if not enabled:
        assert seen["torch"][0] == "unexpected GradScaler growth_interval=-1"
        assert seen["torch"][1]["growth_factor"] == 2.0
        assert seen["torch"][2] == [False] * len(PRIVATE_NUMBERS)
    else:
        assert seen["torch"][0] == 100000 and seen["torch"][1]["growth_factor"] == 4.0


def test_a_disabled_scalers_private_number_assigned_is_kept_as_torchs() -> None:
    """Code that writes one of the numbers (``scaler._growth_interval = 10``) on a scaler that
    turns out disabled: torch's keeps the value as a plain attribute and never uses it; reading
    it back gives what was written, and the scaler stays disabled (scale 1.0, state dict
    ``{}``)."""
    seen = {}
    for name, scaler in _each(enabled=False):
        scaler._growth_interval = 10
        scaler._init_scale = 8.0
        seen[name] = (
            scaler._growth_interval,
            scaler._init_scale,
            hasattr(scaler, "_growth_factor"),
            scaler.get_scale(),
            scaler.state_dict(),
        )
    assert seen["torch"] == (10, 8.0, False, 1.0, {})
    assert seen["ampscaler"] == seen["torch"] and seen["patched"] == seen["torch"]


@pytest.mark.parametrize("enabled", [True, False])
def test_overflow_peeked_between_unscale_and_step_and_the_logged_scale_are_torchs(
    enabled: bool,
) -> None:
    """Training code detects an overflow before ``step()`` through
    ``getattr(scaler, "_per_optimizer_states", {}).get(id(opt), {}).get("found_inf_per_device",
    {})``; BEiT/ConvNeXt-style loops log ``state_dict()["scale"]`` only
    ``if "scale" in scaler.state_dict().keys()`` (a disabled scaler's dict is empty). With inf
    injected at steps 1 and 2: the same flags, the same logged scales (``None`` when
    disabled), the same parameters."""
    runs = {name: _train(scaler, frozenset({1, 2})) for name, scaler in _each(enabled=enabled)}
    torchs = runs["torch"]
    if enabled:
        assert torchs["flags"] == [False, True, True, False]
        assert torchs["logged"] == [65536.0, 32768.0, 16384.0, 16384.0]
    else:
        assert torchs["flags"] == [False] * 4 and torchs["logged"] == [None] * 4
    for name in ("ampscaler", "patched"):
        assert runs[name]["flags"] == torchs["flags"], name
        assert runs[name]["logged"] == torchs["logged"], name
        assert _same(runs[name]["weight"], torchs["weight"]), name


def test_found_inf_per_device_is_a_method_as_torchs() -> None:
    """Debugging hooks guard with ``hasattr(scaler, "_found_inf_per_device")`` and then treat
    it as a dict (``.items()``) inside ``try``: on torch's scaler it is a method, so the
    ``hasattr`` holds and ``.items()`` raises ``AttributeError``, which the hook catches."""
    for name, scaler in _each():
        assert hasattr(scaler, "_found_inf_per_device"), name
        assert callable(scaler._found_inf_per_device), name
        with pytest.raises(AttributeError):
            scaler._found_inf_per_device.items()


def test_enabled_written_false_after_construction_trains_unscaled_as_torchs() -> None:
    """sparseml's ``turn_off_scaler(scaler)`` and trainers that build ``GradScaler(enabled=
    True)`` then set ``scaler._enabled = False`` (and pass ``enabled=scaler._enabled`` to
    autocast): from there ``scale()`` returns the loss itself, ``step()`` steps (an inf is
    applied, no skip), ``get_scale()`` is 1.0 and the state dict ``{}``, as torch's."""
    seen = {}
    for name, scaler in _each():
        scaler._enabled = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = _train(scaler, frozenset({1}), steps=3)
        seen[name] = (run, scaler.get_scale(), scaler.state_dict(), scaler.is_enabled())
    torchs = seen["torch"]
    assert torchs[1:] == (1.0, {}, False)
    assert not torch.isfinite(torchs[0]["weight"]).all()  # the inf was stepped, unscaled
    for name in ("ampscaler", "patched"):
        assert seen[name][1:] == torchs[1:], name
        assert seen[name][0]["logged"] == torchs[0]["logged"] == [None] * 3, name
        assert _same(seen[name][0]["weight"], torchs[0]["weight"]), name
