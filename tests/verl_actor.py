"""verl's FSDP fp16 actor, re-created on gloo ranks: the pattern of
``verl/workers/actor/dp_actor.py`` (verl#4036), for the test that puts ampscaler into it with
``patch_torch`` and compares with torch's ``ShardedGradScaler``.

What is verl's: the scaler is built inside the actor, verbatim
``ShardedGradScaler(growth_interval=400)`` from ``torch.distributed.fsdp.sharded_grad_scaler``
(imported where it is built); the model is FSDP2 with ``MixedPrecisionPolicy(
param_dtype=float16, reduce_dtype=float32)`` and the forward also runs under fp16 autocast; a
mini-batch is split into micro-batches, each loss divided by their number and
``scaler.scale(loss).backward()``; then ``unscale_``, clipping of the DTensor gradients,
``step``, ``update``. The loss is PPO's clipped surrogate on per-token log-probabilities.
What is not: a tiny Qwen2 built from a config (no download), random prompts, advantages and
responses instead of rollouts, and overflows injected into one rank's gradient shard.

Importing this module adds the scenario ``verl_actor`` to ``multirank.SCENARIOS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import ampscaler
import multirank

STEPS = 6
MICRO_BATCHES = 2
CLIP = 0.2
# step -> ranks whose gradient shard overflows: either rank alone, then both
INJECT = {1: [0], 3: [1], 4: [0, 1]}


def tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def sharded(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """FSDP2 as verl's fsdp_workers shard the actor: each decoder layer, then the whole."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def verl_scaler() -> Any:
    """The line verl's actor runs when its dtype is float16."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(growth_interval=400)


class Actor:
    """The update half of verl's ``DataParallelPPOActor`` with a float16 ``param_dtype``."""

    def __init__(self, module: torch.nn.Module, make_scaler: Callable[[], Any]) -> None:
        self.actor_module = module
        self.actor_optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        self.scaler = make_scaler()

    def log_probs(self, input_ids: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type="cpu", dtype=torch.float16):
            logits = self.actor_module(input_ids=input_ids).logits
        response_logits = logits[:, -responses.shape[1] - 1 : -1].float()
        return torch.log_softmax(response_logits, -1).gather(-1, responses[..., None])[..., 0]

    def update_policy(self, batch: dict[str, torch.Tensor], inject: bool) -> float:
        self.actor_optimizer.zero_grad()
        for micro in _split(batch, MICRO_BATCHES):
            log_prob = self.log_probs(micro["input_ids"], micro["responses"])
            ratio = torch.exp(log_prob - micro["old_log_probs"])
            advantages = micro["advantages"]
            clipped = torch.clamp(ratio, 1 - CLIP, 1 + CLIP)
            pg_loss = torch.maximum(-advantages * ratio, -advantages * clipped).mean()
            loss = pg_loss / MICRO_BATCHES
            self.scaler.scale(loss).backward()
        if inject:
            grad = next(iter(self.actor_module.parameters())).grad
            grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr]
        return self._optimizer_step()

    def _optimizer_step(self) -> float:
        self.scaler.unscale_(self.actor_optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_module.parameters(), 1.0)
        self.scaler.step(self.actor_optimizer)
        self.scaler.update()
        return float(grad_norm.full_tensor())  # type: ignore[attr-defined]


def _split(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    size = len(batch["input_ids"]) // parts
    return [{k: v[i * size : (i + 1) * size] for k, v in batch.items()} for i in range(parts)]


def rollout(actor: Actor, step: int, rank: int) -> dict[str, torch.Tensor]:
    """A batch as verl hands it to the actor (on-policy: old log-probs from the same weights)."""
    gen = torch.Generator().manual_seed(10 * step + rank)
    prompts = torch.randint(0, 64, (4, 6), generator=gen)
    responses = torch.randint(0, 64, (4, 5), generator=gen)
    input_ids = torch.cat([prompts, responses], dim=1)
    with torch.no_grad():
        old = actor.log_probs(input_ids, responses)
    advantages = torch.randn(4, 1, generator=gen).expand(4, 5)
    return {"input_ids": input_ids, "responses": responses, "old_log_probs": old,
            "advantages": advantages}  # fmt: skip


def train(rank: int, world: int, make_scaler: Callable[[], Any]) -> dict[str, Any]:
    actor = Actor(sharded(tiny_qwen2(), world), make_scaler)
    run: dict[str, Any] = {"scales": [], "skipped": [], "reported": [], "norms": []}
    for step in range(STEPS):
        before = actor.scaler.get_scale()
        batch = rollout(actor, step, rank)
        run["norms"].append(actor.update_policy(batch, rank in INJECT.get(step, ())))
        run["scales"].append(actor.scaler.get_scale())
        run["skipped"].append(run["scales"][-1] < before)
        run["reported"].append(getattr(actor.scaler, "last_step_skipped", None))
    run["params"] = [p.full_tensor().detach().clone() for p in actor.actor_module.parameters()]  # type: ignore[attr-defined]
    run["class"] = f"{type(actor.scaler).__module__}.{type(actor.scaler).__qualname__}"
    return run


def side_by_side(rank: int, world: int) -> dict[str, Any]:
    """torch's ShardedGradScaler (on the CPU, so with device="cpu"), then verl's verbatim line
    under ``patch_torch(device="cpu")``."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    theirs = train(rank, world, lambda: ShardedGradScaler("cpu", growth_interval=400))
    with ampscaler.patch_torch(device="cpu"):
        ours = train(rank, world, verl_scaler)
    return {"torch": theirs, "ampscaler": ours}


multirank.SCENARIOS["verl_actor"] = side_by_side
