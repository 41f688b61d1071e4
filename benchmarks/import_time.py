"""What ``import ampscaler`` costs beyond ``import torch``, and ``python -m ampscaler --help``.

Each measurement is a fresh interpreter, timed from its start to its exit, runs interleaved
(torch, ampscaler, torch, ...) so that a busy machine slows both alike; the table gives medians.

    python benchmarks/import_time.py [--runs 9]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import ampscaler": [sys.executable, "-c", "import ampscaler"],
    "python -m ampscaler --help": [sys.executable, "-m", "ampscaler", "--help"],
}


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each command (median)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for command in COMMANDS.values():  # warm the file cache once
        _seconds(command)
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            times[name].append(_seconds(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    base = medians["import torch"]
    print(f"{'command':<30} {'median s':>9} {'beyond import torch':>20}")
    for name, median in medians.items():
        extra = "" if name == "import torch" else f"{median - base:+.3f} s"
        print(f"{name:<30} {median:>9.3f} {extra:>20}")
    return medians


if __name__ == "__main__":
    main()
