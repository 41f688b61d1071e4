"""verl's FSDP2 fp16 actor pattern on 2 gloo ranks (``verl_actor``): its verbatim
``ShardedGradScaler(growth_interval=400)`` under ``patch_torch`` builds ampscaler's scaler and
trains bit for bit as torch's ``ShardedGradScaler``, skipped steps included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
import multirank
import verl_actor

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def test_verls_actor_under_patch_torch_matches_torchs_sharded_scaler() -> None:
    results = multirank.spawn(2, ["verl_actor"])
    expected = [step in verl_actor.INJECT for step in range(verl_actor.STEPS)]
    for rank_results in results:
        run = rank_results["verl_actor"]
        theirs, ours = run["torch"], run["ampscaler"]
        assert theirs["class"] == "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
        # built by verl's line, patched: the stand-in, under torch's class name
        assert ours["class"] == "ampscaler.integrations.standins.ShardedGradScaler"
        assert theirs["skipped"] == expected  # an overflow on either rank skips both
        assert ours["skipped"] == ours["reported"] == expected
        assert ours["scales"] == theirs["scales"] and ours["norms"] == theirs["norms"]
        for a, b in zip(ours["params"], theirs["params"], strict=True):
            assert torch.equal(a, b)
    rank0, rank1 = (r["verl_actor"]["ampscaler"]["params"] for r in results)
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))
