"""HeadroomPolicy on several gloo ranks: scenarios added to tests/multirank.py's launcher.

Importing this module registers them in ``multirank.SCENARIOS``; the ranks are forked from the
test process (multirank's launch on Linux), so they see the registration.

Each rank trains its own copy of ``multirank.Net`` on its own batches; rank ``r``'s inputs are
``1 + 7 r`` times larger, so the ranks measure different gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import ampscaler
import multirank

STEPS = 12
POISONED = {0: 7}  # rank -> the step at which its gradients overflow


def loss_at(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s loss at ``step``, under fp16 autocast."""
    x, y = multirank.batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x * (1 + 7 * rank))
    return ((out.float() - y) ** 2).sum()


def train(rank: int, group: dist.ProcessGroup | None, policy: ampscaler.HeadroomPolicy) -> Any:
    """The scales each step used, and the skip flags; or the error at the first update."""
    torch.manual_seed(0)
    model = multirank.Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = ampscaler.GradScaler("cpu", policy=policy, process_group=group)
    scaler.watch(model)
    scales, skipped = [], []
    try:
        for step in range(STEPS):
            scales.append(scaler.get_scale())
            scaler.scale(loss_at(model, step, rank)).backward()
            if POISONED.get(rank) == step:
                model.out.weight.grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            skipped.append(scaler.last_step_skipped)
    except ampscaler.InvalidConfigError as error:
        return str(error)
    return scales, skipped


POLICY = ampscaler.HeadroomPolicy(history_length=2, sample_every=3)

multirank.SCENARIOS.update(
    {
        "headroom_agree": lambda r, w: train(r, dist.group.WORLD, POLICY),
        "headroom_alone": lambda r, w: train(r, None, POLICY),
        "headroom_mismatch": lambda r, w: train(
            r, dist.group.WORLD, ampscaler.HeadroomPolicy(margin=4.0 if r else 2.0)
        ),
    }
)
