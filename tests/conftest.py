"""Fixtures shared by the test modules."""

from __future__ import annotations

import gc
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch.distributed as dist
from hypothesis import settings

# Every run of the suite draws the same hypothesis examples, so CI never fails on a draw that no
# run before it made (a random draw that finds a bug makes one CI run fail and the next pass).
# To look for new failures, draw afresh: `python -m pytest --hypothesis-profile=explore`, with
# `--hypothesis-seed=N` to pick the draws; keep what it finds as an `@example`.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
# Longer runs of the state machines that take the profile's count when it is larger
# (tests/test_fuzz_private.py): `--hypothesis-profile=explore-long --hypothesis-seed=N`.
settings.register_profile("explore-long", derandomize=False, max_examples=2000)
settings.load_profile("repeatable")

# DeepSpeed (installed for tests/test_deepspeed.py) warns on stdout when it looks for an
# accelerator and finds none; transformers imports it, and doctests would see the line. Named, it
# is found without a word.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Subprocesses (`python -m ampscaler`, the benchmarks, the examples, ranks) import this
# checkout's code, as the tests do (pyproject's pythonpath), not whatever ampscaler an
# environment has installed: a worktree tested from another checkout's virtual environment
# would otherwise run the other checkout's code in them.
_SRC = str(Path(__file__).resolve().parent.parent / "src")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_SRC, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _SRC)]
)

# The engines' rank workers import their engine at module level (once, before the ranks are
# forked); where an engine is not installed, --doctest-modules must not import them (the engine
# tests themselves skip, saying how to install it).
collect_ignore = [
    worker
    for worker, engine in (("deepspeed_ranks.py", "deepspeed"), ("megatron_ranks.py", "megatron"))
    if importlib.util.find_spec(engine) is None
]

if TYPE_CHECKING:
    from ampscaler.demo.run import DemoOutcome


@pytest.fixture
def world_of_one() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        # Scalers caught in reference cycles (an exception's traceback holds the frame that
        # holds the scaler) hold the group: freed before it is destroyed, or its threads
        # outlive the test and a later forked multirank launch can hang on them.
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons, and every Accelerator (a transformers Trainer
    builds one too) reads them: a test that uses this starts and ends with them reset."""
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield
    reset()


@pytest.fixture(scope="session")
def default_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoOutcome, Path]:
    """The demo with its default settings (about 8 s), run once for the tests that read it: its
    outcome and the folder it wrote. Read-only for them."""
    from ampscaler.demo import DemoConfig
    from ampscaler.demo.run import run_demo

    out = tmp_path_factory.mktemp("default-demo")
    return run_demo(DemoConfig(), out, progress=False), out
