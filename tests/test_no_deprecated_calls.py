"""What ampscaler runs on a user's behalf, and what it gives users to copy, uses no name it
deprecates: a user who never typed a deprecated name never sees its DeprecationWarning."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import ampscaler

ROOT = Path(__file__).resolve().parent.parent


def test_a_patched_scaler_gets_its_guards_without_a_deprecation_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with ampscaler.patch_torch(device="cpu", guards=[ampscaler.SpikeGuard]):
            scaler = torch.amp.GradScaler("cpu")
    assert isinstance(scaler, ampscaler.GradScaler)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.metrics("")["steps"] == 1


def test_the_minimal_example_runs_without_deprecation_warnings() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error::DeprecationWarning:__main__"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_fp16.py"), "--steps", "3"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "DeprecationWarning" not in done.stderr
    assert "done: {'scale'" in done.stdout
