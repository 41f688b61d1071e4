"""A nanoGPT-style training loop, once with torch's scaler and once with ampscaler's.

The loop is shaped like nanoGPT's train.py: a small causal transformer language model, fused
AdamW with weight decay on the matrices only, micro-steps of gradient accumulation with the
loss divided by their number, ``unscale_`` and ``clip_grad_norm_`` before the step, and
``zero_grad(set_to_none=True)``. The initial scale is high enough that the first steps overflow
and are skipped. Switching one import must change nothing: parameters, scales and the loss
curve are compared bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampscaler

VOCAB, BLOCK, WIDTH, HEADS = 64, 16, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(WIDTH, dim=2)
        q, k, v = (t.view(batch, time, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, time, WIDTH))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(self.blocks(x)))
        return nn.functional.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def train(factory: Any, steps: int = 12, micro_steps: int = 2) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        fused=True,
    )
    scaler = factory("cpu", init_scale=2.0**24)  # overflows at first, as a big init would
    data = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for _ in range(steps):
        for _ in range(micro_steps):
            idx = torch.randint(0, VOCAB, (4, BLOCK), generator=data)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(idx, idx.roll(-1, dims=1)) / micro_steps
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    state = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "scales": scales, "state": state}


@pytest.mark.slow
def test_nanogpt_loop_is_the_same_with_either_scaler() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # identical reductions in both runs
    try:
        theirs = train(torch.amp.GradScaler)
        ours = train(ampscaler.GradScaler)
    finally:
        torch.set_num_threads(threads)
    assert ours["scales"] == theirs["scales"]
    assert min(theirs["scales"]) < 2.0**24  # steps were skipped and the scale backed off
    assert ours["losses"] == theirs["losses"]
    assert all(torch.equal(a, b) for a, b in zip(ours["state"], theirs["state"], strict=True))
