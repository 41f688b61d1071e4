"""The version is one number everywhere: pyproject.toml, ``ampscaler.__version__``,
``--version``, and the CHANGELOG's newest released section, under an ``Unreleased`` one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import ampscaler

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_the_same_everywhere() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    found = re.search(r'^version = "(.+)"$', pyproject, re.MULTILINE)
    assert found is not None
    declared = found.group(1)
    assert declared == ampscaler.__version__ == "0.2.0"
    printed = subprocess.run(
        [sys.executable, "-m", "ampscaler", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert printed.startswith(f"ampscaler {declared} (torch ")
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings[0] == "Unreleased"
    assert re.fullmatch(rf"{re.escape(declared)} \(\d{{4}}-\d\d-\d\d\)", headings[1])
