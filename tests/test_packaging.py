"""``python -m build`` makes a wheel (from the sdist) that installs into a fresh venv and scales.

The venv gets the wheel with ``--no-deps`` and sees this environment's torch through a ``.pth``
line, so nothing is downloaded; the smoke test checks that ``ampscaler`` is imported from the
venv, not from this checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest
import torch

import ampscaler

ROOT = Path(__file__).resolve().parent.parent

SMOKE = """
import pathlib, sys
import torch
import ampscaler

assert pathlib.Path(ampscaler.__file__).is_relative_to(sys.prefix), ampscaler.__file__
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = ampscaler.GradScaler("cpu", init_scale=1024.0)
with torch.autocast("cpu", dtype=torch.float16):
    loss = model(torch.ones(2, 4)).float().sum()
scaler.scale(loss).backward()
scaler.step(optimizer)
scaler.update()
print(ampscaler.__version__, scaler.get_scale(), scaler.last_step_skipped)
"""


def _run(*command: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_the_built_wheel_installs_into_a_fresh_venv_and_scales(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT, cwd=tmp_path)
    version = ampscaler.__version__
    wheel = dist / f"ampscaler-{version}-py3-none-any.whl"
    sdist = dist / f"ampscaler-{version}.tar.gz"
    assert wheel.exists() and sdist.exists(), sorted(p.name for p in dist.iterdir())
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "src/ampscaler/py.typed"} <= names
    assert not any(name.startswith("tests/") for name in names)  # helpers would be missing

    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path
        ).strip()
    )
    (site / "torch-from-the-test-env.pth").write_text(str(Path(torch.__file__).parents[1]))
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "--quiet",
        wheel,
        cwd=tmp_path,
    )
    printed = _run(python, "-c", SMOKE, cwd=tmp_path).split()
    assert printed == [version, "1024.0", "False"]
    script = (fresh / "bin" / "ampscaler").read_text()  # the console script pip wrote
    assert "from ampscaler.cli import main" in script and script.startswith(f"#!{python}")
