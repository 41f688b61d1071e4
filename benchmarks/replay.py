"""Batch replay against torch's scaler: batches lost, extra passes, time, final loss.

Three workloads, each trained four ways from the same initial weights on the same batches, in
fp16 autocast on the CPU:

- ``mlp``: the demo's tanh MLP and teacher task (:mod:`ampscaler.demo`), batch 256, Adam;
- ``lm``: a small causal transformer language model on Markov-chain tokens (the model of
  ``benchmarks/headroom.py``), AdamW;
- ``rl``: the same model trained by a policy-gradient loss, ``-(advantage * log p(token))``,
  with heavy-tailed advantages (Student's t, 2 degrees of freedom) and, every
  ``--outlier-every`` batches, an outlier batch whose advantages are 10**5 times larger: a
  finite loss whose scaled gradients overflow at any scale near the ceiling.

The four ways: ``torch.amp.GradScaler``; the same scaler under a replay loop written by hand (a
skipped batch whose loss was finite runs again, up to ``--max-attempts`` tries); ampscaler's
``GradScaler`` under ``scaler.attempts(max_attempts)``; and ``attempts()`` with
``HeadroomPolicy`` (the model watched). The first three use torch's rule with
``--growth-interval`` (100 by default: every growth probe that overflows is a batch to lose or
to replay) from ``--init-scale``.

Per workload and way it prints: batches lost (their last try skipped) split into those lost to
the scale (finite loss, ordinary batch) and outlier batches; extra forward/backward passes
(tries beyond one per batch) and the replays ampscaler counted; the time per batch (thread CPU
time, forward to ``update()``, over all tries) and its ratio to torch's; the final loss (mean of
the last 10% of batches; for ``rl`` the surrogate loss, whose level means little) and the
final scale. Then, as a check of the loop's cost, a run with no overflow at all (a low static
scale) with and without ``attempts()``: the time ratio.

    PYTHONPATH=src python benchmarks/replay.py             # 1200 batches per run
    PYTHONPATH=src python benchmarks/replay.py --quick     # 150 batches, a smoke test
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from headroom import Batch, LMSpec, TinyLM, markov_tokens
from torch import Tensor, nn

import ampscaler
from ampscaler.demo.model import TaskSpec, batches, build_student

INF = float("inf")


@dataclass
class Workload:
    """A model, its batches, and the loss of one batch (``outlier``: make it an outlier)."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[], Iterator[Batch]]
    loss: Callable[[nn.Module, Batch, bool], Tensor]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    outliers: bool = False


def mlp() -> Workload:
    spec = TaskSpec(batch_size=256)

    def loss(model: nn.Module, batch: Batch, outlier: bool) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(model(batch[0]).float(), batch[1])

    return Workload(
        "mlp",
        build=lambda: build_student(spec, 0),
        data=lambda: batches(spec, 1),
        loss=loss,
        optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=3e-3),
    )


def _tiny_lm() -> nn.Module:
    spec = LMSpec()
    torch.manual_seed(0)
    return TinyLM(spec.vocab, spec.width, spec.depth, spec.heads, spec.context)


def lm() -> Workload:
    spec = LMSpec()

    def loss(model: nn.Module, batch: Batch, outlier: bool) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(batch[0])
        return F.cross_entropy(logits.float().reshape(-1, spec.vocab), batch[1].reshape(-1))

    return Workload(
        "lm",
        build=_tiny_lm,
        data=lambda: markov_tokens(spec, 1),
        loss=loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=spec.lr),
    )


def rl() -> Workload:
    spec = LMSpec()

    def loss(model: nn.Module, batch: Batch, outlier: bool) -> Tensor:
        tokens, actions = batch
        # Student's t with 2 degrees of freedom, the same for every way: z / sqrt(Exp(1)).
        gen = torch.Generator().manual_seed(int(tokens.sum()))
        normal = torch.randn(tokens.shape[0], 1, generator=gen)
        advantages = normal / torch.empty_like(normal).exponential_(1.0, generator=gen).sqrt()
        advantages = advantages.clamp(-50, 50) * (1e5 if outlier else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(tokens)
        logp = torch.log_softmax(logits.float(), -1).gather(-1, actions.unsqueeze(-1))
        return -(advantages * logp.squeeze(-1)).mean()

    return Workload(
        "rl",
        build=_tiny_lm,
        data=lambda: markov_tokens(spec, 1),
        loss=loss,
        optimizer=lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3),
        outliers=True,
    )


@dataclass
class Way:
    """One way to train: a scaler, and whether (and how) batches are replayed."""

    name: str
    make: Callable[[nn.Module], Any]
    replay: str  # "none", "by hand", "attempts"


@dataclass
class Tally:
    """What one way did over a run."""

    tries: int = 0
    lost_to_scale: int = 0
    lost_outliers: int = 0
    lost_to_loss: int = 0
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    scale: float = 0.0
    replays: int | None = None


def _try(
    work: Workload, scaler: Any, model: nn.Module, opt: Any, batch: Batch, outlier: bool
) -> tuple[float, bool]:
    """One try: its loss, and whether it was skipped for inf/NaN gradients (read from
    torch's scaler before ``update()``, as a hand-written loop must; ampscaler says so)."""
    opt.zero_grad(set_to_none=True)
    loss = work.loss(model, batch, outlier)
    scaler.scale(loss).backward()
    scaler.step(opt)
    if isinstance(scaler, torch.amp.GradScaler):
        found = any(v.item() > 0 for v in scaler._found_inf_per_device(opt).values())
        scaler.update()
    else:
        scaler.update()
        found = scaler.last_step_skipped and scaler.last_overflow is not None  # inf/NaN
    return float(loss.detach()), found


def run(work: Workload, way: Way, steps: int, max_attempts: int, outlier_every: int) -> Tally:
    model = work.build()
    opt = work.optimizer(model)
    scaler = way.make(model)
    data = work.data()
    tally = Tally()
    for step in range(steps):
        batch = next(data)
        outlier = work.outliers and step % outlier_every == outlier_every // 2
        start = time.thread_time()
        tries = (
            scaler.attempts(max_attempts)
            if way.replay == "attempts"
            else range(max_attempts if way.replay == "by hand" else 1)
        )
        for _ in tries:
            tally.tries += 1
            loss, skipped = _try(work, scaler, model, opt, batch, outlier)
            finite = loss == loss and abs(loss) != INF
            if way.replay == "by hand" and not (skipped and finite):
                break
        tally.seconds.append(time.thread_time() - start)
        tally.losses.append(loss)
        if skipped:
            if not finite:
                tally.lost_to_loss += 1
            elif outlier:
                tally.lost_outliers += 1
            else:
                tally.lost_to_scale += 1
    tally.scale = scaler.get_scale()
    if isinstance(scaler, ampscaler.GradScaler):
        tally.replays = int(scaler.metrics("")["replays"])
    return tally


def ways(init_scale: float, growth_interval: int) -> list[Way]:
    rule = {"init_scale": init_scale, "growth_interval": growth_interval}

    def headroom(model: nn.Module) -> ampscaler.GradScaler:
        scaler = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy())
        scaler.watch(model)
        return scaler

    return [
        Way("torch", lambda m: torch.amp.GradScaler("cpu", **rule), "none"),
        Way("torch + replay by hand", lambda m: torch.amp.GradScaler("cpu", **rule), "by hand"),
        Way("ampscaler attempts()", lambda m: ampscaler.GradScaler("cpu", **rule), "attempts"),
        Way("attempts() + Headroom", headroom, "attempts"),
    ]


def _tail(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 10) :]
    finite = [v for v in tail if v == v and abs(v) != INF]
    return statistics.fmean(finite) if finite else float("nan")


def table(work: Workload, results: list[tuple[Way, Tally]], steps: int) -> str:
    base = statistics.fmean(results[0][1].seconds)
    lines = [
        f"{work.name}: {steps} batches",
        f"{'way':<24} {'lost: scale':>11} {'outliers':>8} {'loss':>5} {'extra passes':>12} "
        f"{'replays':>7} {'ms/batch':>8} {'vs torch':>8} {'final loss':>10} {'final scale':>11}",
    ]
    for way, tally in results:
        per_batch = statistics.fmean(tally.seconds)
        replays = "-" if tally.replays is None else str(tally.replays)
        lines.append(
            f"{way.name:<24} {tally.lost_to_scale:>11} {tally.lost_outliers:>8} "
            f"{tally.lost_to_loss:>5} {tally.tries - steps:>12} {replays:>7} "
            f"{1e3 * per_batch:>8.2f} {per_batch / base:>8.2f} {_tail(tally.losses):>10.4g} "
            f"{tally.scale:>11g}"
        )
    return "\n".join(lines)


def clean_run_ratio(steps: int) -> float:
    """Time per batch with ``attempts()`` over without, on a run with no overflow: two copies
    of the run side by side, batch by batch, in alternating order."""
    work = lm()
    runs = []
    for _ in range(2):
        model = work.build()
        scaler = ampscaler.GradScaler("cpu", init_scale=2.0**4, growth_interval=10**9)
        runs.append((model, work.optimizer(model), scaler, work.data()))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        for loop in (False, True) if step % 2 else (True, False):
            model, opt, scaler, data = runs[loop]
            batch = next(data)
            start = time.thread_time()
            for _ in scaler.attempts() if loop else range(1):
                _try(work, scaler, model, opt, batch, False)
            seconds[loop].append(time.thread_time() - start)
    assert all(scaler.metrics("")["skips"] == 0 for _, _, scaler, _ in runs)
    return statistics.median(seconds[True]) / statistics.median(seconds[False])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="batches per run")
    parser.add_argument("--quick", action="store_true", help="150 batches, a smoke test")
    parser.add_argument("--init-scale", type=float, default=2.0**16)
    parser.add_argument("--growth-interval", type=int, default=100)
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--outlier-every", type=int, default=150)
    parser.add_argument("--workloads", default="mlp,lm,rl")
    args = parser.parse_args(argv)
    steps = 150 if args.quick else args.steps
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, one thread; torch's rule from {args.init_scale:g}, growth "
        f"every {args.growth_interval}; at most {args.max_attempts} tries per batch\n"
    )
    builders = {"mlp": mlp, "lm": lm, "rl": rl}
    results: dict[str, Any] = {}
    for name in args.workloads.split(","):
        work = builders[name]()
        rows = [
            (way, run(work, way, steps, args.max_attempts, args.outlier_every))
            for way in ways(args.init_scale, args.growth_interval)
        ]
        print(table(work, rows, steps) + "\n")
        results[name] = rows
    ratio = clean_run_ratio(max(50, steps // 4))
    print(f"a run with no overflow: time per batch with attempts() / without = {ratio:.3f}")
    results["clean_ratio"] = ratio
    return results


if __name__ == "__main__":
    main()
