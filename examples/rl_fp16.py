"""fp16 RL fine-tuning on FSDP2: policy-gradient updates of a small decoder, in float16, with
ampscaler's ShardedGradScaler, checkpointed and resumed with the model and the optimizer
through torch.distributed.checkpoint (DCP).

The recipe is verl's fp16 actor (docs/rl.md): FSDP2 with ``MixedPrecisionPolicy(
param_dtype=float16, reduce_dtype=float32)``, the forward under fp16 autocast, a batch of
rollouts split into micro-batches, ``scaler.scale(loss).backward()`` per micro-batch, then
``unscale_``, clipping, ``step``, ``update``. Here the decoder is a tiny Qwen2 built from a
config (no download), each rank samples its own rollouts from the current policy, and the
reward is the share of response tokens equal to ``--target-token``: the policy learns to say
it. The loss is REINFORCE with a group baseline (a response's reward minus its group's mean).
Unlike verl, the scaler is saved in the checkpoint, so a resumed run keeps its scale instead
of recalibrating it from 2**16.

It needs transformers (``pip install -e ".[transformers]"``). Run on CPU (gloo) or GPUs (NCCL);
the second command resumes from the checkpoint the first
one wrote and ends where an uninterrupted run ends::

    torchrun --nproc-per-node 2 examples/rl_fp16.py --steps 8 --save-at 4 --checkpoint /tmp/rl
    torchrun --nproc-per-node 2 examples/rl_fp16.py --steps 8 --resume --checkpoint /tmp/rl

The last line rank 0 prints is a checksum of the parameters and the scaler's state, equal
for both ways of getting there.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _launch import (
    init_distributed,
    outcome,
    parse_resumable,
    print_checksum,
    resumable_run_arguments,
    run,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ampscaler import ShardedGradScaler

VOCAB, PROMPT, RESPONSE = 32, 4, 6
GROUPS, GROUP_SIZE = 2, 4  # per rank: prompts, and responses sampled for each
MICRO_BATCHES = 2


def build(
    device: torch.device,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedGradScaler]:
    """The policy (FSDP2 in fp16, fp32 reductions), AdamW, and the scaler."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The default group agrees on overflow; hysteresis absorbs a lone overflow.
    scaler = ShardedGradScaler(device.type, init_scale=2.0**14, growth_interval=4, hysteresis=2)
    return model, optimizer, scaler


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.autocast(tokens.device.type, dtype=torch.float16):
        out: torch.Tensor = model(input_ids=tokens).logits
    return out.float()


@torch.no_grad()
def rollout(
    model: torch.nn.Module, step: int, rank: int, target: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``GROUP_SIZE`` responses for each of ``GROUPS`` prompts (the same number of
    forward passes on every rank, as FSDP needs); returns the sequences and their rewards, the
    share of response tokens equal to ``target``."""
    device = next(model.parameters()).device
    sampler = torch.Generator().manual_seed(1000 * step + rank)
    prompts = torch.randint(0, VOCAB, (GROUPS, PROMPT), generator=sampler)
    tokens = prompts.repeat_interleave(GROUP_SIZE, dim=0).to(device)
    for _ in range(RESPONSE):
        probs = torch.softmax(logits(model, tokens)[:, -1], dim=-1).cpu()
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=sampler).to(device)], 1)
    return tokens, tokens[:, PROMPT:].eq(target).float().mean(dim=1)


def policy_loss(
    model: torch.nn.Module, tokens: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """REINFORCE: minus the advantage times the log-probability of each sampled response."""
    log_probs = torch.log_softmax(logits(model, tokens)[:, PROMPT - 1 : -1], dim=-1)
    taken = log_probs.gather(-1, tokens[:, PROMPT:, None])[..., 0].sum(dim=1)
    return -(advantages * taken).mean()


def _state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler
) -> dict[str, object]:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "scaler": scaler}


def save(
    path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler
) -> None:
    """Model, optimizer and scaler in one DCP checkpoint (DCP calls the scaler's state_dict)."""
    dcp.save(_state(model, optimizer, scaler), checkpoint_id=path)


def load(
    path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: ShardedGradScaler
) -> int:
    """Load what :func:`save` wrote (the scaler in place); returns the steps already taken."""
    state = _state(model, optimizer, scaler)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    return int(scaler.metrics("")["steps"])


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    step: int,
    target: int,
    overflow: bool = False,
) -> float:
    """One policy-gradient update from this rank's rollouts (``overflow``: put an inf into this
    rank's gradient shard, as a real overflow would); returns the mean reward over the ranks."""
    tokens, rewards = rollout(model, step, dist.get_rank(), target)
    groups = rewards.view(GROUPS, GROUP_SIZE)
    advantages = (groups - groups.mean(dim=1, keepdim=True)).view(-1)
    parts = tokens.chunk(MICRO_BATCHES), advantages.chunk(MICRO_BATCHES)
    for rows, adv in zip(*parts, strict=True):
        loss = policy_loss(model, rows, adv) / MICRO_BATCHES
        scaler.scale(loss).backward()  # FSDP2 accumulates the sharded gradients
    if overflow:
        model.lm_head.weight.grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr,operator]
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    mean_reward = rewards.mean().to(tokens.device)
    dist.all_reduce(mean_reward)
    return mean_reward.item() / dist.get_world_size()


def main() -> None:
    parser = resumable_run_arguments(__doc__.splitlines()[0])
    parser.add_argument("--target-token", type=int, default=7, help="the rewarded token")
    args = parse_resumable(parser)

    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer, scaler = build(device)
    start = 0
    if args.resume:
        start = load(args.checkpoint, model, optimizer, scaler)
        if rank == 0:
            print(f"resumed after {start} steps at scale {scaler.get_scale():g}", flush=True)

    for step in range(start, args.steps):
        overflow = step == args.overflow_at and rank == world - 1
        reward = train_step(model, optimizer, scaler, step, args.target_token, overflow)
        if rank == 0:
            print(f"step {step}: reward {reward:.3f}; {outcome(scaler)}; "
                  f"scale {scaler.get_scale():g}",
                  flush=True)  # fmt: skip
        if args.save_at is not None and step + 1 == args.save_at:
            save(args.checkpoint, model, optimizer, scaler)
            if rank == 0:
                print(f"saved after {step + 1} steps to {args.checkpoint}", flush=True)

    print_checksum(model, scaler)
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        import transformers  # noqa: F401  (the policy is a transformers Qwen2)
    except ModuleNotFoundError:
        sys.exit('examples/rl_fp16.py needs transformers: pip install -e ".[transformers]"')
    run(main)
