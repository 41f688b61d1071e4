"""Importing ampscaler must not import the optional frameworks it integrates with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONAL = (
    "lightning", "pytorch_lightning", "accelerate", "transformers", "tensorboard", "matplotlib",
)


def test_import_ampscaler_imports_no_optional_framework() -> None:
    code = (
        "import sys, ampscaler, ampscaler.integrations\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[]"
