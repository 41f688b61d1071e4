"""The name swap both engine patches stand on (no engine needed): handles end in any order."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from ampscaler.integrations.engines import EngineSettings, NameSwap


@pytest.fixture
def engine() -> Iterator[types.ModuleType]:
    module = types.ModuleType("fake_engine")
    module.Scaler = "the engine's own"  # type: ignore[attr-defined]
    sys.modules["fake_engine"] = module
    yield module
    del sys.modules["fake_engine"]


def test_handles_exited_out_of_order_keep_the_open_ones_in_force(
    engine: types.ModuleType,
) -> None:
    swap = NameSwap([("fake_engine", "Scaler", "ampscaler's")])
    outer, inner = EngineSettings(max_scale=2.0**12), EngineSettings(max_scale=2.0**8)
    swap.push(outer)
    swap.push(inner)
    swap.pop(outer)  # the outer block ends first
    assert engine.Scaler == "ampscaler's" and swap.settings is inner
    swap.pop(outer)  # twice: nothing more
    assert swap.settings is inner
    swap.pop(inner)
    assert engine.Scaler == "the engine's own" and swap.settings is None
