"""What the diagnostics cost per training step: records, the underflow probe, the tracer.

One fp16-autocast MLP, one optimizer, the same data, trained side by side under several scaler
configurations in interleaved rounds (each round runs every configuration for ``--steps``
iterations, so load on the machine hits them alike). Each configuration keeps its scaler and
model across rounds, so with 100 steps per round ``probe every 100`` probes once per round and
its time is the amortized cost. Prints, per configuration, the median over rounds of the mean
step time and its ratio to ``off`` (ampscaler with nothing attached), then the time of the
probe's gradient pass alone.

    python benchmarks/probe_cost.py [--steps 100] [--rounds 5] [--width 512] [--depth 4]
                                    [--batch 16] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ampscaler import GradientProbe, GradScaler, NonFiniteTracer, StepHistory


def make_model(width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


@dataclass
class Arm:
    """One configuration: a scaler factory, and its model, optimizer and scaler once built."""

    name: str
    factory: Callable[[], Any]
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None

    def build(self, width: int, depth: int) -> None:
        torch.manual_seed(0)
        self.model = make_model(width, depth)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.scaler = self.factory()
        if isinstance(self.scaler, GradScaler):
            self.scaler.watch(self.model)

    def run(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Train on ``batches``; returns the mean seconds per step."""
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        assert model is not None and optimizer is not None
        start = time.perf_counter()
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) / len(batches)


def _observed(probe_every: int | None = None, history: bool = True) -> GradScaler:
    """A scaler with a history of 1000 records and a probe every ``probe_every`` steps."""
    scaler = GradScaler("cpu")
    if history:
        scaler.add_sink(StepHistory(1000))
    if probe_every is not None:
        scaler.attach(GradientProbe(every=probe_every))
    return scaler


def _traced() -> GradScaler:
    scaler = GradScaler("cpu")
    scaler.attach(NonFiniteTracer())
    return scaler


def arms() -> list[Arm]:
    return [
        Arm("torch.amp.GradScaler", lambda: torch.amp.GradScaler("cpu")),
        Arm("off", lambda: GradScaler("cpu")),
        Arm("history (1 sync/step)", lambda: _observed()),
        Arm("probe every 100", lambda: _observed(probe_every=100)),
        Arm("probe every 1", lambda: _observed(probe_every=1)),
        Arm("NonFiniteTracer", _traced),
    ]


def isolated_probe_ms(arm: Arm, batch: tuple[torch.Tensor, torch.Tensor], repeats: int) -> float:
    """Median time of the probe's gradient pass alone ((a) and (b)), on ``arm``'s gradients."""
    model, optimizer = arm.model, arm.optimizer
    assert model is not None and optimizer is not None
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(batch[0]).float(), batch[1])
    (loss * 1024.0).backward()
    probe, scale = GradientProbe(every=1), torch.tensor(1024.0)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        probe.measure(optimizer, scale)
        pending = probe.end_iteration()
        assert pending is not None
        pending.read(scale=1024.0)
        times.append(time.perf_counter() - start)
    optimizer.zero_grad(set_to_none=True)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="steps per arm per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(args.batch, args.width, generator=generator),
            torch.randn(args.batch, 1, generator=generator),
        )
        for _ in range(args.steps)
    ]
    configurations = arms()
    for arm in configurations:
        arm.build(args.width, args.depth)
        arm.run(batches[:5])  # warm-up, outside the timed rounds
        # Restart the probe's schedule so every round holds the same number of probes.
        arm.build(args.width, args.depth)
    times: dict[str, list[float]] = {arm.name: [] for arm in configurations}
    for _ in range(args.rounds):
        for arm in configurations:
            times[arm.name].append(arm.run(batches))

    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    print(
        f"fp16 autocast MLP: {args.depth} x Linear({args.width}, {args.width}) + GELU, "
        f"{params / 1e6:.2f}M parameters, batch {args.batch}, SGD; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.rounds} rounds x {args.steps} steps"
    )
    off = statistics.median(times["off"])
    print(f"{'configuration':<24} {'ms/step':>9} {'vs off':>8}")
    for arm in configurations:
        median = statistics.median(times[arm.name])
        print(f"{arm.name:<24} {median * 1e3:>9.3f} {median / off:>7.3f}x")
    alone = isolated_probe_ms(configurations[0], batches[0], repeats=20)
    print(
        f"the probe's gradient pass alone ((a) and (b), {params / 1e6:.2f}M elements): "
        f"{alone:.3f} ms, {alone / (off * 1e3):.1%} of an 'off' step"
    )


if __name__ == "__main__":
    main()
