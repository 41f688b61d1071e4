"""The second process of the resume tests, started by tests/test_resume.py.

    python resume_worker.py FOLDER

For every case and every checkpoint ``CASE-at-K.pt`` in FOLDER (``torch.save`` of model,
optimizer and scaler state after K iterations, written by the test process), loads it into
fresh objects, trains on to the end of the plan, and writes the records of iterations K on to
``CASE-from-K.pkl``. Prints the path of the ``ampscaler`` it imported, so that the test can
check which code ran.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

import ampscaler
from resume_plan import CASES, CHECKPOINTS, STEPS, play, restore


def resume(folder: Path) -> None:
    for case in CASES:
        for start in CHECKPOINTS:
            saved = torch.load(folder / f"{case.name}-at-{start}.pt")
            records = play(restore(case, saved), range(start, STEPS))
            (folder / f"{case.name}-from-{start}.pkl").write_bytes(pickle.dumps(records))


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors: threads only contend on a shared machine
    resume(Path(sys.argv[1]))
    print(ampscaler.__file__)
