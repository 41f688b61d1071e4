"""Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin, unmodified, builds
``torch.amp.GradScaler`` itself; under ``patch_torch`` that is ampscaler's, and fit, checkpoint
and resume give torch's results bit for bit (the model and data of ``test_lightning``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
from lightning.pytorch.plugins import MixedPrecision

import ampscaler
from ampscaler.integrations import standins
from test_lightning import BATCHES, assert_same_parameters, fit

SETTINGS: dict[str, Any] = {"init_scale": 2.0**14, "growth_interval": 2}


def lightnings_scaler(trainer: Any) -> Any:
    return trainer.precision_plugin.scaler


def test_fit_checkpoint_and_resume_under_patch_torch_are_torchs(tmp_path: Path) -> None:
    theirs = fit(tmp_path / "torch", torch.amp.GradScaler("cpu", **SETTINGS))
    with ampscaler.patch_torch(**SETTINGS, max_consecutive_skips=50):
        assert isinstance(MixedPrecision("16-mixed", "cpu").scaler, ampscaler.GradScaler)
        straight = fit(tmp_path / "straight", None)  # the plugin builds the scaler
        first = fit(tmp_path / "first", None, epochs=1)
        checkpoint = tmp_path / "epoch1.ckpt"
        first.trainer.save_checkpoint(checkpoint)
        resumed = fit(tmp_path / "first", None, ckpt_path=checkpoint)
    scaler = lightnings_scaler(straight.trainer)
    assert type(scaler) is standins.TorchGradScaler and type(scaler).__name__ == "GradScaler"
    assert (
        scaler.metrics("")["skips"] > 0 and scaler.metrics("")["growths"] > 0
    )  # skips and growth both seen
    assert scaler.get_scale() == lightnings_scaler(theirs.trainer).get_scale()
    assert_same_parameters(straight.module, theirs.module)
    assert_same_parameters(resumed.module, straight.module)
    saved = torch.load(checkpoint, weights_only=True)["MixedPrecision"]
    assert saved["stats"]["steps"] == BATCHES and saved["max_consecutive_skips"] == 50
    assert lightnings_scaler(resumed.trainer).state_dict() == scaler.state_dict()
