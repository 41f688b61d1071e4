"""Run the differential fuzz for longer: torch's scaler against ampscaler's on random scripts.

Run from the repository root::

    python scripts/fuzz.py --seed 1000 --count 20000
    python scripts/fuzz.py --seed 1000 --minutes 30     # as many as fit, from seed 1000

Each seed is one random script (``tests/twins.py``, ``make_fuzz_script``: one to three
optimizers of any kind and implementation, accumulation, clipping, inf/NaN in losses and
gradients, ``None`` gradients, checkpoints, float64, sparse embeddings, a process group of one,
flat gradient buffers), played by both scalers, which must agree bit for bit after every
iteration (``tests/differential.py``). CI runs seeds 0-599 (``tests/test_fuzz_differential.py``).
It prints a line per ``--every`` seeds and every difference with its seed; it exits with 1 if
any seed differs. Replay one with ``--seed S --count 1``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import torch  # noqa: E402

import differential  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument(
        "--count",
        type=int,
        default=None,
        help="how many seeds (default 1000; with --minutes, as many as fit)",
    )
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--every", type=int, default=500, help="a progress line every N seeds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the floor warning, torch's sparse-invariant note
    world = differential.world_of_one()
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    start, done, failed = time.monotonic(), 0, []
    count = args.count if args.count is not None else 1000 if args.minutes is None else sys.maxsize
    for seed in range(args.seed, args.seed + count):
        if deadline is not None and time.monotonic() > deadline:
            break
        difference = differential.check(seed, world)
        done += 1
        if difference is not None:
            failed.append(seed)
            print(difference[:2000], flush=True)
        if done % args.every == 0:
            rate = done / (time.monotonic() - start)
            print(f"{done} scripts (seeds {args.seed}-{seed}), {len(failed)} differ, "
                  f"{rate:.1f}/s", flush=True)  # fmt: skip
    print(
        f"done: {done} scripts, seeds {args.seed}-{args.seed + done - 1}, "
        f"{len(failed)} differ{': ' + str(failed) if failed else ''}, "
        f"{time.monotonic() - start:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
