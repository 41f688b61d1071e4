"""The differential fuzz: a random script (``twins.make_fuzz_script``) played by torch's scaler
and by ampscaler's, which must agree bit for bit on every parameter, gradient, optimizer state,
scale, growth tracker and step return after every iteration.

``tests/test_fuzz_differential.py`` runs a fixed set of seeds in CI; ``scripts/fuzz.py --seed S
--count N`` runs as many as you like. A failure names the seed: ``check(seed)`` replays it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import ampscaler
from ampscaler.policy import LOWEST_SCALE
from twins import Script, Trace, first_difference, make_fuzz_script, run_twin


def ours(script: Script, world: dist.ProcessGroup | None) -> Callable[..., Any]:
    """ampscaler's scaler for ``script``: with a process group of one and flat gradient
    buffers where the script asks for them (and ``world`` is given)."""
    extra: dict[str, Any] = {"flat_grads": script.flat}
    if script.group and world is not None:
        extra["process_group"] = world

    def make(device: str, **kwargs: Any) -> ampscaler.GradScaler:
        return ampscaler.GradScaler(device, **kwargs, **extra)

    return make


def check(seed: int, world: dist.ProcessGroup | None = None) -> str | None:
    """Play seed ``seed`` with both scalers; where they first differ (``None``: nowhere).

    Where torch's scale leaves float32's normal range (below ``2**-126``, where ampscaler's
    stops on purpose: docs/migration.md), the traces are compared up to that update, and
    ampscaler's scale must stay at or above ``2**-126`` to the end.
    """
    script = make_fuzz_script(seed)
    theirs = run_twin(script, torch.amp.GradScaler)
    mine = run_twin(script, ours(script, world))
    below = [i for i, scale in enumerate(theirs.scales) if scale < LOWEST_SCALE]
    if below:
        if min(mine.scales) < LOWEST_SCALE:
            return f"seed {seed}: ampscaler's scale went below 2**-126: {mine.scales}"
        mine, theirs = _cut(mine, below[0]), _cut(theirs, below[0])
    difference = first_difference(mine, theirs)
    return None if difference is None else f"seed {seed}: {difference}"


def _cut(trace: Trace, update: int) -> Trace:
    """``trace`` up to the ``update``-th update: the iterations through it (which ran at a
    scale both keep), the scales and trackers before it; no step returns (they are not kept
    per iteration, and are ``None`` for torch's optimizers anyway)."""
    return Trace(
        params=trace.params[: update + 1],
        scales=trace.scales[:update],
        trackers=trace.trackers[:update],
        grads=trace.grads[: update + 1],
        states=trace.states[: update + 1],
    )


def world_of_one() -> dist.ProcessGroup:
    """A gloo process group of this process alone (for scripts with ``group``)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    assert group is not None
    return group
