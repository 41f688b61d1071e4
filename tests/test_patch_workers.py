"""One setting, AMPSCALER_PATCH, reaches scalers built in processes nobody patches by hand: a
spawned multiprocessing pool's workers (``initializer=setup_hook``) and torchrun's ranks
(``-m ampscaler run``), each building torch's classes; and bad settings name the variable."""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Iterator

import pytest
import torch

import ampscaler
import multirank
import patched_worker
from ampscaler.integrations.patch import ENV_VAR, setup_hook

STANDINS = "ampscaler.integrations.standins"


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()
    assert torch.amp.GradScaler.__module__ == "torch.amp.grad_scaler"


def test_spawned_pool_workers_build_ampscalers_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, json.dumps({"hysteresis": 2, "guards": ["ampscaler:SpikeGuard"]}))
    with multiprocessing.get_context("spawn").Pool(1, initializer=setup_hook) as pool:
        built = pool.starmap(patched_worker.build_torch_scaler, [()] * 2)
    assert built == [
        {"class": f"{STANDINS}.GradScaler", "hysteresis": 2, "growth_interval": 400,
         "scale": 65536.0}
    ] * 2  # fmt: skip
    assert torch.amp.GradScaler.__module__ == "torch.amp.grad_scaler"  # this process: untouched


@pytest.mark.slow
def test_torchrun_ranks_build_ampscalers_sharded_scaler() -> None:
    script = str(multirank.ROOT / "tests" / "patched_worker.py")
    settings = json.dumps({"device": "cpu", "hysteresis": 2})
    out = multirank.torchrun("-m", "ampscaler", "run", script, env={ENV_VAR: settings})
    reports = json.loads(next(line for line in out.splitlines() if line.startswith("[")))
    for rank, report in enumerate(reports):
        assert report == {
            "class": f"{STANDINS}.ShardedGradScaler", "hysteresis": 2,
            "growth_interval": 400, "scale": 65536.0, "rank": rank, "skipped": True,
        }  # fmt: skip  # rank 1 overflowed: both skipped; hysteresis kept the scale
    assert len(reports) == 2


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("{hysteresis: 2}", "is not valid JSON"),
        ('["hysteresis"]', "must be a JSON object"),
        ('{"hysterisis": 2}', "did you mean 'hysteresis'"),
        ('{"hysteresis": 0}', "hysteresis"),
        ('{"guards": ["ampscaler:SpikeGuard()"]}', "cannot be imported"),
    ],
)
def test_a_bad_setting_names_the_variable_and_its_value(
    monkeypatch: pytest.MonkeyPatch, value: str, match: str
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ampscaler.InvalidConfigError, match=match) as raised:
        setup_hook()
    assert str(raised.value).startswith(f"{ENV_VAR}={value!r}")
    assert torch.amp.GradScaler.__module__ == "torch.amp.grad_scaler"


def test_the_run_command_refuses_a_bad_setting_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ampscaler.cli import main

    monkeypatch.setenv(ENV_VAR, "{")
    assert main(["run", "train.py"]) == 2
    assert capsys.readouterr().err.startswith(f"ampscaler run: error: {ENV_VAR}='{{'")
    assert main(["run"]) == 2
