"""HeadroomPolicy against torch's reactive loss scaling: the same training runs, side by side.

Two models, each trained three times from the same initial weights on the same batches, with
fp16 autocast on the CPU:

- ``mlp``: the demo's model and task (:mod:`ampscaler.demo`: a tanh MLP imitating a teacher with
  small targets, mean squared error, Adam, cosine learning rate), batch 2048 as in the demo
  (``--mlp-batch``: a smaller batch makes a shorter step and noisier gradients);
- ``lm``: a small causal transformer language model (2 blocks, width 32, 4 heads, context 32)
  trained on tokens from a fixed random Markov chain (32 tokens), cross-entropy, AdamW.

The three scalers: ``torch.amp.GradScaler`` with its defaults (growth every 2000 clean steps),
the same with ``growth_interval=100`` (a short interval: closer to the ceiling, more overflows),
and ``ampscaler.GradScaler(policy=HeadroomPolicy())`` with the model watched. All start from
the same ``--init-scale``. The runs are interleaved in rounds of ``--chunk`` steps (a different
scaler first each round), so a change in the machine's load hits every scaler alike.

Per scaler and model it prints: skipped steps (over the run, and within the first 100), the
share of activation-gradient elements that are non-zero in an fp32 reference pass but zero in
the fp16 run (measured every ``--probe-every`` steps, on the same steps for every scaler, with
:class:`ampscaler.GradientProbe` and its fp32 reference, on the outputs of the linear layers),
the final loss (mean over the last 10% of steps) and its ratio to torch's default, the final
scale, and the time per step with its ratio to torch's default (the median over rounds of the
per-round ratio). Probed steps (which run an extra fp32 pass) are left out of the timing; every
other step is timed, by the thread's CPU time, from the forward pass to ``zero_grad()``,
measuring iterations included.

    PYTHONPATH=src python benchmarks/headroom.py                 # 6000 steps per run
    PYTHONPATH=src python benchmarks/headroom.py --init-scale 4294967296   # DeepSpeed's 2**32
    PYTHONPATH=src python benchmarks/headroom.py --quick         # 300 steps, a smoke test
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ampscaler
from ampscaler import GradientProbe, HeadroomPolicy
from ampscaler.demo.model import TaskSpec, batches, build_student
from ampscaler.demo.train import cosine_lr, tail_mean
from ampscaler.observe.probe import UnderflowCounts

Batch = tuple[Tensor, Tensor]

# ---------------------------------------------------------------------------- the models


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(self.act(self.fc(self.norm2(x))))


class TinyLM(nn.Module):
    """Token and position embeddings, ``depth`` blocks, a final norm and a linear head."""

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class LMSpec:
    """The language model and its generated data."""

    vocab: int = 32
    width: int = 32
    depth: int = 2
    heads: int = 4
    context: int = 32
    batch: int = 4
    lr: float = 3e-3


def markov_tokens(spec: LMSpec, seed: int) -> Iterator[Batch]:
    """Endless ``(inputs, next tokens)`` batches from a fixed random Markov chain: each token
    is followed by a few likely successors, so the loss can fall well below ``log(vocab)``."""
    generator = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(3.0 * torch.randn(spec.vocab, spec.vocab, generator=generator), -1)
    while True:
        idx = torch.empty(spec.batch, spec.context + 1, dtype=torch.long)
        idx[:, 0] = torch.randint(spec.vocab, (spec.batch,), generator=generator)
        for t in range(spec.context):
            row = transitions[idx[:, t]]
            idx[:, t + 1] = torch.multinomial(row, 1, generator=generator).squeeze(-1)
        yield idx[:, :-1], idx[:, 1:]


@dataclass
class Workload:
    """One model and task: how to build it, its data, its loss and its optimizer."""

    name: str
    describe: str
    build: Callable[[int], nn.Module]
    data: Callable[[int], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch, bool], Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    lr: float


def mlp_workload(batch_size: int) -> Workload:
    spec = TaskSpec(batch_size=batch_size)

    def loss(model: nn.Module, batch: Batch, fp16: bool) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            return F.mse_loss(model(batch[0]), batch[1])

    return Workload(
        "mlp",
        f"the demo's tanh MLP and teacher task, batch {batch_size}, MSE, Adam",
        build=lambda seed: build_student(spec, seed),
        data=lambda seed: batches(spec, seed),
        loss=loss,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=3e-3),
        lr=3e-3,
    )


def lm_workload() -> Workload:
    spec = LMSpec()

    def build(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TinyLM(spec.vocab, spec.width, spec.depth, spec.heads, spec.context)

    def loss(model: nn.Module, batch: Batch, fp16: bool) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            logits = model(batch[0])
        return F.cross_entropy(logits.float().reshape(-1, spec.vocab), batch[1].reshape(-1))

    return Workload(
        "lm",
        f"causal transformer LM ({spec.depth} blocks, width {spec.width}, {spec.heads} heads, "
        f"context {spec.context}, vocab {spec.vocab}), Markov-chain tokens, batch {spec.batch}, "
        "AdamW",
        build=build,
        data=lambda seed: markov_tokens(spec, seed),
        loss=loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=spec.lr),
        lr=spec.lr,
    )


# ---------------------------------------------------------------------------- the scalers


@dataclass(frozen=True)
class Policy:
    """One way of scaling: a name and a factory given the initial scale."""

    name: str
    make: Callable[[float], Any]


POLICIES = (
    Policy("torch default", lambda init: torch.amp.GradScaler("cpu", init_scale=init)),
    Policy(
        "torch interval 100",
        lambda init: torch.amp.GradScaler("cpu", init_scale=init, growth_interval=100),
    ),
    Policy(
        "headroom",
        lambda init: ampscaler.GradScaler("cpu", init_scale=init, policy=HeadroomPolicy()),
    ),
)


@dataclass
class Run:
    """One model trained with one scaler, a round of steps at a time."""

    workload: Workload
    policy: Policy
    steps: int
    seed: int
    init_scale: float
    probe_every: int
    clock: Callable[[], float]
    model: nn.Module = field(init=False)
    optimizer: torch.optim.Optimizer = field(init=False)
    scaler: Any = field(init=False)
    data: Iterator[Batch] = field(init=False)
    done: int = 0
    losses: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # the scale each step used
    first: UnderflowCounts = field(default_factory=UnderflowCounts)  # step 0's
    probes: list[UnderflowCounts] = field(default_factory=list)  # the sampled steps', in order
    round_times: list[tuple[float, int]] = field(default_factory=list)  # (seconds, timed steps)

    def __post_init__(self) -> None:
        self.model = self.workload.build(self.seed)
        self.optimizer = self.workload.optimizer(self.model)
        self.scaler = self.policy.make(self.init_scale)
        if isinstance(self.scaler, ampscaler.GradScaler):
            self.scaler.watch(self.model)
        self.data = self.workload.data(self.seed)

    def probed(self, step: int) -> bool:
        """Step 0, and every ``probe_every``-th step from the middle of the first period."""
        return step == 0 or step % self.probe_every == self.probe_every // 2

    def _probe(self, batch: Batch) -> GradientProbe:
        """A probe on the linear layers' outputs, with its fp32 reference for ``batch`` taken."""
        probe = GradientProbe(1, worst_modules=None)
        for name, module in self.model.named_modules():
            if isinstance(module, nn.Linear):
                probe.watch(module, name)
        with probe.reference():  # an fp32, unscaled pass on the same batch
            self.workload.loss(self.model, batch, False).backward()
        self.optimizer.zero_grad(set_to_none=True)
        return probe

    def advance(self, count: int) -> None:
        """Train ``count`` more steps (fewer at the end of the run)."""
        seconds, timed = 0.0, 0
        for _ in range(min(count, self.steps - self.done)):
            batch = next(self.data)
            lr = cosine_lr(self.done, self.steps, self.workload.lr)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            probe = self._probe(batch) if self.probed(self.done) else None
            before = self.scaler.get_scale()
            self.scales.append(before)
            start = self.clock()
            loss = self.workload.loss(self.model, batch, True)
            self.scaler.scale(loss).backward()
            if probe is not None:
                probe.measure(self.optimizer, torch.tensor(before))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            elapsed = self.clock() - start
            if probe is not None:  # probed steps ran an extra pass: left out of the timing
                pending = probe.end_iteration()
                probe.detach()
                assert pending is not None
                counts = sum(pending.read(before).module_counts.values(), UnderflowCounts())
                if self.done == 0:
                    self.first = counts
                else:
                    self.probes.append(counts)
            else:
                seconds, timed = seconds + elapsed, timed + 1
            self.losses.append(float(loss.item()))
            flag = getattr(self.scaler, "last_step_skipped", None)
            skipped = self.scaler.get_scale() < before if flag is None else bool(flag)
            self.skipped.append(skipped)
            self.done += 1
        self.round_times.append((seconds, timed))

    @property
    def flushed(self) -> tuple[float, float]:
        """The sampled steps' share of signal-carrying activation-gradient elements flushed to
        zero, and its standard error over the probes."""
        total = sum(self.probes, UnderflowCounts())
        shares = [counts.flushed_fraction for counts in self.probes]
        spread = statistics.stdev(shares) / math.sqrt(len(shares)) if len(shares) > 1 else 0.0
        return total.flushed_fraction, spread

    def flushed_vs(self, other: Run) -> tuple[float, float]:
        """The mean over the sampled steps of this run's flushed share minus ``other``'s on the
        same step (paired: the two saw the same batch), and its standard error."""
        differences = [
            mine.flushed_fraction - theirs.flushed_fraction
            for mine, theirs in zip(self.probes, other.probes, strict=True)
        ]
        if len(differences) < 2:
            return (differences[0] if differences else 0.0), 0.0
        spread = statistics.stdev(differences) / math.sqrt(len(differences))
        return statistics.mean(differences), spread

    @property
    def step_seconds(self) -> float:
        seconds = sum(s for s, _ in self.round_times)
        return seconds / max(1, sum(n for _, n in self.round_times))


def train_side_by_side(
    workload: Workload,
    steps: int,
    seed: int,
    init_scale: float,
    probe_every: int,
    chunk: int,
    clock: Callable[[], float] = time.thread_time,
) -> list[Run]:
    """Every policy on ``workload``, interleaved in rounds of ``chunk`` steps."""
    runs = [Run(workload, p, steps, seed, init_scale, probe_every, clock) for p in POLICIES]
    rounds = 0
    while runs[0].done < steps:
        for index in range(len(runs)):  # a different scaler goes first each round
            runs[(index + rounds) % len(runs)].advance(chunk)
        rounds += 1
    return runs


def round_ratios(run: Run, reference: Run) -> list[float]:
    """Per round, ``run``'s mean step time over ``reference``'s."""
    return [
        (s / n) / (rs / rn)
        for (s, n), (rs, rn) in zip(run.round_times, reference.round_times, strict=True)
        if n and rn
    ]


def round_ratio(run: Run, reference: Run) -> float:
    """The median over rounds of ``run``'s mean step time over ``reference``'s."""
    ratios = round_ratios(run, reference)
    return statistics.median(ratios) if ratios else math.nan


def table(runs: list[Run], warmup: int) -> str:
    """The side-by-side table, then the targets for the last run against the first."""
    reference = runs[0]
    lines = [
        f"{'policy':<19} {'skipped':>7} {f'in first {warmup}':>12} {'flushed (+-se)':>17} "
        f"{'at step 0':>9} {'final loss':>11} {'vs torch':>8} {'log2 scale':>10} "
        f"{'ms/step':>8} {'time':>7}",
    ]
    for run in runs:
        final = tail_mean(run.losses)
        flushed, spread = run.flushed
        lines.append(
            f"{run.policy.name:<19} {sum(run.skipped):>7d} {sum(run.skipped[:warmup]):>12d} "
            f"{flushed:>9.4%} +-{spread:<6.4%} {run.first.flushed_fraction:>9.3%} "
            f"{final:>11.4e} {final / tail_mean(reference.losses):>7.4f}x "
            f"{statistics.mean(math.log2(s) for s in run.scales):>10.2f} "
            f"{run.step_seconds * 1e3:>8.3f} {round_ratio(run, reference):>6.3f}x"
        )
    ours = runs[-1]
    skipped = (sum(reference.skipped), sum(ours.skipped))
    fewer = skipped[1] == 0 if skipped[0] == 0 else skipped[1] * 10 <= skipped[0]
    difference, spread = ours.flushed_vs(reference)
    loss = tail_mean(ours.losses) / tail_mean(reference.losses)
    time_ratio = round_ratio(ours, reference)
    ratios = round_ratios(ours, reference)
    time_spread = statistics.stdev(ratios) / math.sqrt(len(ratios)) if len(ratios) > 1 else 0.0
    lines += [
        f"{ours.policy.name} against {reference.policy.name}: skipped steps {skipped[0]} -> "
        f"{skipped[1]} (10x fewer or none: {_yes(fewer)}); flushed on the same steps "
        f"{difference:+.4%} +-{spread:.4%} (not higher beyond 2 se: "
        f"{_yes(difference <= 2 * spread)}); final loss {loss:.4f}x; time {time_ratio:.3f}x "
        f"(median of {len(ratios)} rounds; mean {statistics.mean(ratios):.3f} "
        f"+-{time_spread:.3f}; under 1.05: {_yes(time_ratio < 1.05)})",
    ]
    return "\n".join(lines)


def _yes(met: bool) -> str:
    return "yes" if met else "NO"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6000, help="steps per run (6000)")
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="every scaler's (2**16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-every", type=int, default=100, help="underflow probe period")
    parser.add_argument("--chunk", type=int, default=50, help="steps per run per round")
    parser.add_argument(
        "--mlp-batch", type=int, default=2048, help="the demo model's batch (2048, the demo's)"
    )
    parser.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="time steps by this thread's CPU time (default; steadier on a shared machine) "
        "or by the wall clock",
    )
    parser.add_argument("--quick", action="store_true", help="300 steps, rounds of 50")
    args = parser.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.quick:
        args.steps, args.chunk, args.probe_every = 300, 50, 50
    torch.set_num_threads(1)
    workloads = {"mlp": mlp_workload(args.mlp_batch), "lm": lm_workload()}
    print(
        f"torch {torch.__version__}, 1 thread; {args.steps} steps per run, init scale "
        f"2**{math.log2(args.init_scale):g}, seed {args.seed}, probe every {args.probe_every} "
        f"steps, rounds of {args.chunk} steps, {args.clock} clock"
    )
    for name in args.models.split(","):
        workload = workloads[name]
        started = time.perf_counter()
        runs = train_side_by_side(
            workload, args.steps, args.seed, args.init_scale, args.probe_every, args.chunk, clock
        )
        print()
        print(f"{name}: {workload.describe} ({time.perf_counter() - started:.0f} s)")
        print(table(runs, warmup=100))


if __name__ == "__main__":
    main()
