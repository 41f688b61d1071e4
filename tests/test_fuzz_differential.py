"""The differential fuzz in CI: 600 random scripts, torch's scaler against ampscaler's, bit for
bit (``tests/differential.py``; ``scripts/fuzz.py`` runs more, by seed and count).

Each script draws one to three optimizers of any kind and implementation (for-loop, foreach,
fused), accumulation, clipping after ``unscale_``, inf/NaN in losses and gradients, gradients
set to ``None``, optimizers stepped in any order or not at all, ``update(new_scale)``,
checkpoints through bytes and pickle, float64 parameters, sparse embeddings, and for
ampscaler a process group of one and flat gradient buffers. Every parameter, gradient,
optimizer state, scale and growth tracker must agree after every iteration.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from itertools import product

import pytest
import torch.distributed as dist

import differential
from twins import POISONS, make_fuzz_script

SEEDS = range(600)
CHUNK = 25


@pytest.fixture(scope="module")
def world() -> Iterator[dist.ProcessGroup]:
    group = differential.world_of_one()
    try:
        yield group
    finally:
        gc.collect()  # scalers in reference cycles hold the group: freed before it goes
        dist.destroy_process_group()


@pytest.mark.parametrize("first", range(SEEDS.start, SEEDS.stop, CHUNK))
def test_random_scripts_match_torch_bit_for_bit(world: dist.ProcessGroup, first: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the floor warning, torch's sparse-invariant note
        differences = [differential.check(seed, world) for seed in range(first, first + CHUNK)]
    found = [difference for difference in differences if difference is not None]
    assert not found, "\n".join(found)


def test_the_scripts_cover_what_the_fuzz_claims() -> None:
    """The 600 seeds draw every optimizer in every implementation, skipped fused steps and the
    rest of what the module docstring lists."""
    scripts = [make_fuzz_script(seed) for seed in SEEDS]
    specs = {(spec.kind, spec.impl) for s in scripts for spec in s.specs()}
    kinds, impls = ["sgd", "adam", "adamw", "adagrad"], ["for-loop", "foreach", "fused"]
    assert specs == set(product(kinds, impls))
    assert {len(s.specs()) for s in scripts} == {1, 2, 3}
    iterations = [(s, it) for s in scripts for it in s.iterations]
    fused_poisoned = [
        (s, it) for s, it in iterations
        if (it.poison or it.loss_poison is not None) and s.fused
    ]  # fmt: skip
    assert len(fused_poisoned) > 200  # fused steps skipped for inf/NaN, then compared
    poisons = {str(value) for _, it in iterations for _, _, value in it.poison}
    assert poisons == {str(value) for value in POISONS}  # inf, -inf and NaN
    assert sum(it.loss_poison is not None for _, it in iterations) > 100
    assert sum(bool(it.none_grads) for _, it in iterations) > 200
    assert sum(it.clip is not None for _, it in iterations) > 200
    assert sum(len(it.micro_batches) > 1 for _, it in iterations) > 500
    assert sum(it.order is not None and len(it.order) < len(s.specs()) for s, it in iterations) > 50
    assert sum(it.new_scale is not None for _, it in iterations) > 100
    assert {it.checkpoint for _, it in iterations} == {False, "bytes", "pickle"}
    assert sum(s.group for s in scripts) > 50 and sum(s.flat for s in scripts) > 50
    assert any(s.sparse for s in scripts) and not all(s.sparse for s in scripts)
    assert sum(s.dtype != scripts[0].dtype for s in scripts) > 20  # float32 and float64
    # torch's private idioms: a start chosen before the first scale(), torch's update() copied,
    # a batch dropped after its backward (and its fused-optimizer cases)
    assert sum(s.start is not None for s in scripts) > 50
    assert (
        sum(s.own_update for s in scripts) > 80
        and sum(s.own_update and s.fused for s in scripts) > 30
    )
    assert sum(s.dropped is not None for s in scripts) > 80
