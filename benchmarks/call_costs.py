"""What each of the scaler's calls costs on the small transformer, side by side with torch's.

``benchmarks/overhead.py`` times ``scale`` + ``step`` + ``update`` together; this splits them,
on its transformer case (27 gradients of a small fp16-autocast encoder, stepped by ``AdamW``),
in the same interleaved, shuffled rounds (the plain step, torch's scaler, ampscaler's defaults,
the opt-in settings, and the defaults with a ``SpikeGuard``; gradients restored untimed before
each). Medians over rounds, in microseconds; ``step - plain`` is the median of per-round
differences of a scaler's ``step()`` and the plain ``optimizer.step()``, so it is what the
scaler's ``step()`` adds.

Between two ``update()`` calls the optimizer's step has evicted the interpreter's data from the
CPU's caches, so every Python frame of a call costs more than it does in a tight loop. With
``--noop`` the optimizer does nothing: the caches stay warm and only the scalers' own work is
timed (then ``step - plain`` is the whole ``step()``).

Run from the repository root so that this checkout's code is measured::

    PYTHONPATH=src python benchmarks/call_costs.py
    PYTHONPATH=src python benchmarks/call_costs.py --noop --rounds 3000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from overhead import LOSS_SCALE, OPT_IN, TinyTransformer, transformer_loss

import ampscaler

CALLS = ("scale", "step", "update")
Scaler = ampscaler.GradScaler | torch.amp.GradScaler


class NoOp(torch.optim.Optimizer):
    """An optimizer whose step does nothing (the scalers' calls alone are timed)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        return None


def scalers() -> dict[str, Scaler]:
    guarded = ampscaler.GradScaler("cpu", init_scale=LOSS_SCALE)
    guarded.attach(ampscaler.SpikeGuard())
    return {
        "torch": torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE),
        "ampscaler": ampscaler.GradScaler("cpu", init_scale=LOSS_SCALE),
        "opt-in": ampscaler.GradScaler("cpu", init_scale=LOSS_SCALE, **OPT_IN),
        "guarded": guarded,
    }


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Per-call times (seconds) by scaler and call, and the plain step's, over the rounds."""
    torch.manual_seed(args.seed)
    model = TinyTransformer()
    (transformer_loss(model, args.seed, torch.device("cpu"))() * LOSS_SCALE).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.detach().clone() for p in params if p.grad is not None]
    optimizer: torch.optim.Optimizer = NoOp(params) if args.noop else torch.optim.AdamW(params)
    loss = torch.ones(())
    variants = scalers()
    times: dict[str, dict[str, list[float]]] = {name: {c: [] for c in CALLS} for name in variants}
    plain: list[float] = []
    order: list[str | None] = [None, *variants]
    rng = random.Random(args.seed)
    now = time.perf_counter
    for index in range(args.warmup + args.rounds):
        rng.shuffle(order)
        for name in order:
            torch._foreach_copy_([p.grad for p in params], saved)
            if name is None:
                start = now()
                optimizer.step()
                elapsed = now() - start
                if index >= args.warmup:
                    plain.append(elapsed)
                continue
            scaler = variants[name]
            start = now()
            scaler.scale(loss)
            scaled = now()
            scaler.step(optimizer)
            stepped = now()
            scaler.update()
            updated = now()
            if index >= args.warmup:
                for call, seconds in zip(
                    CALLS, (scaled - start, stepped - scaled, updated - stepped), strict=True
                ):
                    times[name][call].append(seconds)
    return times, plain


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=400, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--noop", action="store_true", help="a no-op optimizer (warm caches)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    times, plain = measure(args)
    optimizer = "a no-op optimizer" if args.noop else "AdamW"
    print(
        f"transformer case, {optimizer}, {args.threads} threads, {args.rounds} rounds; "
        f"plain step {statistics.median(plain) * 1e6:.1f} us"
    )
    header = f"{'scaler':<10} {'scale us':>9} {'step us':>9} {'step - plain':>13} {'update us':>10}"
    print(header)
    print("-" * len(header))
    for name, calls in times.items():
        added = statistics.median(s - p for s, p in zip(calls["step"], plain, strict=True))
        print(
            f"{name:<10} {statistics.median(calls['scale']) * 1e6:>9.1f} "
            f"{statistics.median(calls['step']) * 1e6:>9.1f} {added * 1e6:>13.1f} "
            f"{statistics.median(calls['update']) * 1e6:>10.1f}"
        )


if __name__ == "__main__":
    main()
