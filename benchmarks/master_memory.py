"""Memory and step time: fp32 model + fp16 autocast vs fp16 model + fp32 master weights.

Two ways to train a small MLP with fp16 compute and a loss scaler, same model, same data,
same Adam, torch.amp.GradScaler in both (it stands in for ampscaler's scaler, so the only
difference is where the weights live):

  (a) autocast   fp32 model, torch.autocast(dtype=float16), GradScaler
  (b) masters    fp16 model (model.half()), MasterWeightOptimizer(Adam), GradScaler

Memory, two measurements, because torch has no allocator statistics for CPU memory
(torch.cuda.memory_stats has no CPU counterpart):

  * summed: bytes of the tensors that make up training state, counted by walking them:
    model params, model grads, fp32 masters and their grads, optimizer state, and the
    tensors autograd saves for backward (counted with saved_tensors_hooks, one count per
    storage, parameters excluded; autocast's fp16 weight copies show up here). The sum is
    an upper bound on the peak: grads and saved activations do not all live at once.
  * measured: growth of the process's peak resident set (VmHWM, reset through
    /proc/self/clear_refs before the model is built), each configuration in its own
    process. It includes allocator slack and is coarse (pages, not bytes).

Step time is the median over timed steps after warm-up, on CPU, one intra-op thread by
default. fp16 matmuls on a CPU without fp16 units are slow, so absolute times say little
about a GPU; the ratio column compares the two configurations measured in one run.

Run from the repository root:

    python benchmarks/master_memory.py            # defaults: width 1024, depth 4, batch 8
    python benchmarks/master_memory.py --width 512 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

CONFIGS = {
    "autocast": "(a) fp32 model + fp16 autocast + GradScaler",
    "masters": "(b) fp16 model + MasterWeightOptimizer + GradScaler",
}
MIB = 2.0**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="number of hidden layers")
    parser.add_argument("--batch", type=int, default=8, help="batch size")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return

    results = {name: run_in_child(name, sys.argv[1:]) for name in CONFIGS}
    print_table(results, args)


def run_in_child(name: str, argv: list[str]) -> dict[str, Any]:
    # One process per configuration: the peak-RSS measurement cannot be shared, and
    # freed memory the allocator keeps would otherwise carry over from one to the other.
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--child", name],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"configuration {name!r} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


class Setup(NamedTuple):
    model: Any
    opt: Any
    forward: Callable[[], Any]
    before_step: Callable[[], None]
    train_step: Callable[[], None]


def build(name: str, width: int, depth: int, batch: int) -> Setup:
    """The model, optimizer, scaler and one training step of configuration ``name``."""
    import torch
    from torch import nn

    from ampscaler.master import MasterWeightOptimizer

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=generator)
    y = torch.randn(batch, 1, generator=generator)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    if name == "autocast":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def forward() -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            return ((out.float() - y) ** 2).mean()

        def before_step() -> None:
            pass

    else:
        model.half()
        x16 = x.half()
        wrapped = MasterWeightOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
        opt = wrapped

        def forward() -> torch.Tensor:
            return ((model(x16).float() - y) ** 2).mean()

        def before_step() -> None:
            wrapped.copy_grads_to_masters()  # torch's scaler does not know about masters

    def train_step() -> None:
        scaler.scale(forward()).backward()
        before_step()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    return Setup(model, opt, forward, before_step, train_step)


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    # Two steps of a tiny copy first, so that what torch loads lazily on a first step
    # (torch._dynamo for the optimizers, autocast kernels) is in the baseline, not the peak.
    primer = build(name, width=8, depth=1, batch=2)
    for _ in range(2):
        primer.train_step()
    del primer
    gc.collect()

    baseline = rss_bytes("VmRSS")
    can_reset_peak = reset_peak_rss()
    setup = build(name, args.width, args.depth, args.batch)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        setup.train_step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    summed = count_state_bytes(setup.model, setup.opt, setup.forward, setup.before_step)
    peak = rss_bytes("VmHWM") - baseline if can_reset_peak else None
    return {"step_s": statistics.median(times), "summed": summed, "peak_rss": peak}


def count_state_bytes(model: Any, opt: Any, forward: Any, before_step: Any) -> dict[str, int]:
    """Bytes of each part of the training state, measured on one extra step."""
    import torch

    from ampscaler.master import MasterWeightOptimizer

    def nbytes(tensors: Any) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    params = list(model.parameters())
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward()
    loss.backward()
    before_step()

    masters: list[torch.Tensor] = []
    if isinstance(opt, MasterWeightOptimizer):
        param_ids = {id(p) for p in params}
        masters = [m for m in opt.master_params() if id(m) not in param_ids]
    state = [
        value
        for per_param in opt.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    counts = {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params),
        "masters": nbytes(masters),
        "master_grads": nbytes(m.grad for m in masters),
        "opt_state": nbytes(state),
        "saved_for_backward": sum(saved.values()),
    }
    opt.zero_grad()
    counts["total"] = sum(counts.values())
    return counts


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        return False
    return True


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    a, b = results["autocast"], results["masters"]
    n_params = args.depth * (args.width * args.width + args.width) + args.width + 1
    print(
        f"MLP width {args.width}, depth {args.depth} ({n_params / 1e6:.2f}M params), batch "
        f"{args.batch}, Adam, torch.amp.GradScaler, CPU, {args.threads} thread(s); "
        f"median of {args.steps} steps after {args.warmup} warm-up"
    )
    for label in CONFIGS.values():
        print(f"  {label}")
    print()
    rows = [
        ("step time (ms)", a["step_s"] * 1e3, b["step_s"] * 1e3),
        *[
            (f"summed: {part} (MiB)", a["summed"][part] / MIB, b["summed"][part] / MIB)
            for part in a["summed"]
        ],
    ]
    if a["peak_rss"] is not None and b["peak_rss"] is not None:
        rows.append(("measured: peak RSS growth (MiB)", a["peak_rss"] / MIB, b["peak_rss"] / MIB))
    else:
        rows.append(("measured: peak RSS growth", float("nan"), float("nan")))
    print(f"{'':34} {'(a) autocast':>13} {'(b) masters':>13} {'b / a':>7}")
    for label, value_a, value_b in rows:
        ratio = f"{value_b / value_a:7.2f}" if value_a else f"{'-':>7}"
        print(f"{label:34} {value_a:13.2f} {value_b:13.2f} {ratio}")
    print(
        "\nsummed = bytes of the listed tensors (no CPU allocator stats in torch); "
        "the total bounds the peak from above.\nmeasured = VmHWM growth of a fresh process "
        "per configuration, from before the model is built."
    )


if __name__ == "__main__":
    main()
