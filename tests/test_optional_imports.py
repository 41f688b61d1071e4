"""Importing ampscaler must not import the optional frameworks it integrates with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
OPTIONAL = (
    "lightning",
    "pytorch_lightning",
    "accelerate",
    "transformers",
    "tensorboard",
    "matplotlib",
    "megatron",
    "deepspeed",
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter that imports ampscaler from this checkout."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        check=False,
    )


def test_import_ampscaler_imports_no_optional_framework() -> None:
    code = (
        "import sys, ampscaler, ampscaler.integrations\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r})))"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_engine_adapters_import_no_engine() -> None:
    """The engines are imported when a patch is applied, not when its module is."""
    code = (
        "import sys, ampscaler.integrations.megatron, ampscaler.integrations.deepspeed\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'deepspeed'}))"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_lightning_integration_without_lightning_says_what_to_install() -> None:
    """As TensorBoardSink and the CLI's extras do: the error is the install command."""
    result = _python(
        "import sys\n"
        "sys.modules['lightning'] = None  # as if Lightning were not installed\n"
        "from ampscaler.integrations import lightning\n"
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: ampscaler.integrations.lightning needs Lightning")
    assert last.endswith("pip install 'ampscaler[lightning]'.")
