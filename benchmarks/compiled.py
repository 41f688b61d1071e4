"""Compiled training: ampscaler against torch.amp.GradScaler, eager and under torch.compile.

Two tables, each measured side by side in one process with shuffled rounds (the timing helpers
of ``overhead.py``):

1. **A whole training step** of a small transformer (forward under fp16 autocast, ``scale``,
   backward, ``unscale_``, ``clip_grad_norm_``, ``step`` with fused AdamW, ``update``,
   ``zero_grad``): per-step time eager and with the step compiled (``torch.compile``, inductor),
   with each scaler and without one; the scaler's overhead is the difference to the same mode
   without a scaler. It also prints the graph breaks and graphs of each compiled step.
2. **The scaler's own calls** on fused Adam (500 × 20k float32 gradients, as ``overhead.py``'s
   ``adam-fused`` case): ``scale`` + ``step`` + ``update`` minus a plain ``optimizer.step()``,
   torch eager, ampscaler eager, and ampscaler with ``scale``/``update`` compiled
   (``step`` calls the fused kernel, which torch runs eagerly under compile in any case), against
   one read-only pass over the gradients, the floor for an exact scaler.

Run from the repository root::

    PYTHONPATH=src python benchmarks/compiled.py            # CPU
    PYTHONPATH=src python benchmarks/compiled.py --quick    # smoke test
    PYTHONPATH=src python benchmarks/compiled.py --device cuda
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo
from overhead import (
    LOSS_SCALE,
    TinyTransformer,
    describe_machine,
    interleave,
    ms,
    scaler_step,
    transformer_loss,
)
from torch._dynamo.utils import counters

import ampscaler

Scaler = ampscaler.GradScaler | torch.amp.GradScaler


def whole_steps(args: argparse.Namespace, device: torch.device) -> None:
    """Table 1: the transformer's whole step, eager and compiled, with each scaler."""
    torch.manual_seed(args.seed)
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loss_value = transformer_loss(model, args.seed, device)
    scalers: dict[str, Scaler | None] = {
        "none": None,
        "torch": torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE),
        "ampscaler": ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE),
    }

    def step_with(scaler: Scaler | None) -> Callable[[], None]:
        def step() -> None:
            loss = loss_value()
            if scaler is None:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()

        return step

    variants: dict[str, Callable[[], None]] = {}
    compile_counts: dict[str, tuple[int, int]] = {}
    for name, scaler in scalers.items():
        variants[f"eager {name}"] = step_with(scaler)
        compiled = torch.compile(step_with(scaler))
        counters.clear()
        for _ in range(3):  # compile (and recompile, if it would) before timing
            compiled()
        compile_counts[name] = (
            sum(counters["graph_break"].values()),
            counters["stats"]["unique_graphs"],
        )
        variants[f"compiled {name}"] = compiled
    timings = interleave(variants, lambda: None, args, device)
    print("A whole training step (small transformer, fused AdamW, fp16 autocast), ms per step")
    header = f"{'mode':<10} {'no scaler':>10} {'torch':>8} {'ampscaler':>10} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for mode in ("eager", "compiled"):
        base = timings.median(f"{mode} none")
        theirs = timings.overhead(f"{mode} torch", f"{mode} none")
        ours = timings.overhead(f"{mode} ampscaler", f"{mode} none")
        ratio = f"{ours / theirs:.2f}" if theirs > 0 else "-"
        print(f"{mode:<10} {ms(base):>10} {'+' + ms(theirs):>8} {'+' + ms(ours):>10} {ratio:>6}")
    for name, (breaks, graphs) in compile_counts.items():
        print(f"compiled step with {name} scaler: {breaks} graph breaks, {graphs} graphs")


def scaler_calls(args: argparse.Namespace, device: torch.device) -> None:
    """Table 2: the scaler's calls alone on fused Adam, eager and compiled."""
    gen = torch.Generator().manual_seed(args.seed)
    params = [torch.nn.Parameter(torch.randn(20_000, generator=gen).to(device)) for _ in range(500)]
    saved = [torch.randn(20_000, generator=gen).mul_(LOSS_SCALE * 1e-2).to(device) for _ in params]
    for param, grad in zip(params, saved, strict=True):
        param.grad = grad.clone()
    optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
    loss = torch.ones((), device=device)
    theirs = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
    ours = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE)
    compiled_ours = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE)
    scale = torch.compile(compiled_ours.scale)
    update = torch.compile(compiled_ours.update, fullgraph=True)

    def compiled_calls() -> Any:
        scale(loss)
        compiled_ours.step(optimizer)
        update()

    def prepare() -> None:
        torch._foreach_copy_([p.grad for p in params], saved)

    prepare()
    compiled_calls()  # compile before timing
    timings = interleave(
        {
            "plain": optimizer.step,
            "torch": lambda: scaler_step(theirs, optimizer, loss),
            "ampscaler": lambda: scaler_step(ours, optimizer, loss),
            "compiled": compiled_calls,
        },
        prepare,
        args,
        device,
    )
    flat = torch.randn(sum(g.numel() for g in saved), device=device)
    read_pass = interleave({"read": flat.sum}, lambda: flat.mul_(1.0), args, device).median("read")
    torch_overhead = timings.overhead("torch")
    print("\nThe scaler's own calls, fused Adam over 500 x 20k float32 gradients, ms per step")
    header = f"{'variant':<36} {'overhead':>9} {'/ torch eager':>14}"
    print(header)
    print("-" * len(header))
    for name, label in (
        ("torch", "torch, eager"),
        ("ampscaler", "ampscaler, eager"),
        ("compiled", "ampscaler, scale/update compiled"),
    ):
        overhead = timings.overhead(name)
        print(f"{label:<36} {ms(overhead):>9} {overhead / torch_overhead:>14.2f}")
    print(
        f"{'one read-only pass (the floor)':<36} {ms(read_pass):>9} "
        f"{read_pass / torch_overhead:>14.2f}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds per table")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--quick", action="store_true", help="3 rounds after 1 warm-up round")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.clock, args.blocks, args.stat = "wall", 1, "median"  # overhead.py's timing settings
    if args.quick:
        args.rounds, args.warmup = 3, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(describe_machine(device))
    print(f"{args.rounds} rounds after {args.warmup} warm-up; medians of per-round values\n")
    whole_steps(args, device)
    scaler_calls(args, device)


if __name__ == "__main__":
    main()
