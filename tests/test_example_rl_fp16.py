"""examples/rl_fp16.py on 2 gloo ranks: fp16 policy-gradient fine-tuning on FSDP2, saved with
DCP (model, optimizer and scaler) and resumed in fresh objects to the uninterrupted result, bit
for bit. The ranks run the example's own functions (``build``, ``train_step``, ``save``,
``load``), as its ``main`` does under torchrun."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
import multirank
from scaler_readings import skip_reason

sys.path.insert(0, str(multirank.ROOT / "examples"))
import rl_fp16

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

STEPS, SAVE_AFTER, OVERFLOW_STEP, TARGET = 5, 3, 2, 7


def uninterrupted_and_resumed(rank: int, world: int) -> dict[str, Any]:
    path = os.path.join(multirank.shared_dir(), "rl")
    whole = rl_fp16.build(torch.device("cpu"))
    rewards, scales = [], []
    for step in range(STEPS):
        overflow = step == OVERFLOW_STEP and rank == world - 1
        rewards.append(rl_fp16.train_step(*whole, step, TARGET, overflow))
        scales.append((whole[2].get_scale(), skip_reason(whole[2])))
        if step + 1 == SAVE_AFTER:
            rl_fp16.save(path, *whole)
    resumed = rl_fp16.build(torch.device("cpu"))
    start = rl_fp16.load(path, *resumed)
    again = [rl_fp16.train_step(*resumed, step, TARGET) for step in range(start, STEPS)]

    def params(model: torch.nn.Module) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]

    return {
        "start": start, "rewards": rewards, "again": again, "scales": scales,
        "params": params(whole[0]), "resumed_params": params(resumed[0]),
        "state": whole[2].state_dict(), "resumed_state": resumed[2].state_dict(),
    }  # fmt: skip


multirank.SCENARIOS["rl_example"] = uninterrupted_and_resumed


def test_the_rl_example_resumes_to_the_uninterrupted_result() -> None:
    for results in multirank.spawn(2, ["rl_example"]):
        run = results["rl_example"]
        assert run["start"] == SAVE_AFTER
        assert run["again"] == run["rewards"][SAVE_AFTER:]
        assert run["resumed_state"] == run["state"]  # scale, tracker, hysteresis, counters
        for a, b in zip(run["params"], run["resumed_params"], strict=True):
            assert torch.equal(a, b)
        # the injected overflow is skipped on both ranks; hysteresis=2 keeps the scale
        assert run["scales"][OVERFLOW_STEP] == (2.0**14, "nonfinite")
        assert run["state"]["stats"]["skipped"] == 1
