"""Regenerate the README's demo table and its two images from one run of the demo.

Run from the repository root::

    PYTHONPATH=src python scripts/update_readme_demo.py

It runs the demo with its defaults (what ``python -m ampscaler demo`` runs: seed 0, 300 steps,
one CPU thread) into a temporary folder, copies its ``loss.png`` and ``scale.png`` to
``docs/images/demo-loss.png`` and ``docs/images/demo-scale.png``, and replaces the table in
README.md with the one it printed. ``tests/test_readme.py`` checks that the README still
matches a fresh run.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from ampscaler.demo import DemoConfig
from ampscaler.demo.run import run_demo, summary_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
IMAGES = {"loss.png": "demo-loss.png", "scale.png": "demo-scale.png"}
TABLE = re.compile(r"(```\n)(arm +final loss.*?\n)(```)", re.S)


def readme_table(text: str) -> str:
    """The demo table as the README shows it (between its code fences)."""
    found = TABLE.search(text)
    if found is None:
        raise SystemExit("README.md has no demo table (a code block starting with 'arm').")
    return found.group(2)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        outcome = run_demo(DemoConfig(), out, progress=False)
        for written, shown in IMAGES.items():
            shutil.copyfile(out / written, ROOT / "docs" / "images" / shown)
    text = README.read_text(encoding="utf-8")
    readme_table(text)  # fails clearly if the table is gone
    table = summary_table(outcome) + "\n"
    README.write_text(TABLE.sub(lambda m: m.group(1) + table + m.group(3), text), encoding="utf-8")
    print(table, end="")
    print(f"updated {README.name} and docs/images/{', docs/images/'.join(IMAGES.values())}")


if __name__ == "__main__":
    main()
