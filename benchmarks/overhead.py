"""Per-step overhead of ampscaler.GradScaler against torch.amp.GradScaler, side by side.

Overhead is what the scaler adds to a training step: the time of ``scale(loss)``,
``step(optimizer)`` and ``update()`` minus a plain ``optimizer.step()`` on the same gradients.
Every round times the plain step, torch's scaler, ampscaler's with its defaults and ampscaler's
with its opt-in speed-ups (``flat_grads=True, one_pass_fused=True``) once each, in a shuffled
order, after restoring the same gradients (untimed); the table shows medians over rounds of the
per-round differences, so slow drifts of a shared machine cancel, and in brackets the spread of
each ratio: its lowest and highest over ``--blocks`` consecutive blocks of the rounds (a ratio
whose spread crosses its target is not settled by the run). With its defaults ampscaler
must never be slower than torch (ratio <= 1.05, the noise allowance); the opt-in settings (which
move gradients into flat buffers where that pays, and unscale a fused optimizer's gradients in
the check pass) must pay where they are meant to (<= 0.6 for many small kept gradients and for
fused Adam) and cost nothing where they are not (<= 1.05).

As the physical reference every round also times one read+write pass (``mul_(1.0)``) and one
read-only pass (``sum()``) over a flat buffer as large as all the gradients together, each
right after an untimed read+write of the buffer: a scaler's passes find the gradients just
written (by the check pass, or the restoring copy), not left in the caches by a read.

Where the opt-in scaler moved the gradients into one flat buffer, a ``floor`` variant does by
hand the least any scaler does on that route: scale the loss, confirm that the gradients are
still the buffer's (one ``.grad`` read each), one check kernel over the buffer, the optimizer's
own step with the flag, torch's update kernel. What the opt-in column costs beyond it
(``floor ms``, and its ratio to torch's) is ampscaler's own structure.

A further variant, ampscaler's defaults with a :class:`~ampscaler.SpikeGuard` added, gives what
the guard costs on a clean step, in a second table: ``guard ms`` is the median over rounds of
the guarded scaler's time minus the defaults' in the same round, and ``guard passes`` that cost
in read-only passes over the gradients (``guard ms`` over ``sum ms``, the flat ``sum()``; the
target is at most 1.5: the guard's one pass and its few small operations). Two more references,
timed in the same rounds, say where a cost beyond that comes from: ``norm ms``, one
``vector_norm`` over the flat buffer (the least any guard on the gradients' L2 norm does: one
read of every element, squared and summed; on one CPU thread the squares make it cost 1.2 to
1.5 ``sum()``; on a GPU both run at memory bandwidth), and
``foreach ms``, ``torch._foreach_norm`` over the gradients where they lie (torch's one
multi-tensor read of them: one kernel per chunk of tensors on a GPU, one ``vector_norm`` per
tensor on a CPU). ``own ms`` is ``guard ms`` minus ``foreach ms``: what the guard adds beyond
reading the gradients once on its own (its small operations on the window, a few µs each on a
CPU and a launch each on a GPU, whatever the model's size, and what its read costs inside the
step beyond the same read timed alone: data it evicts that the optimizer reads next).

Cases (``--cases``, comma separated):

- ``sgd-few-large``: SGD, 50 tensors of 200k floats.
- ``sgd-many-small``: SGD, 2000 tensors of 5k floats.
- ``adam-fused``: ``Adam(fused=True)``, 500 tensors of 20k floats.
- ``transformer``: the parameters and real fp16-autocast gradients of a small transformer
  encoder, stepped by ``AdamW`` (torch's default foreach implementation): the scaler's calls
  timed as in the synthetic cases, over ``TRANSFORMER_ROUNDS`` times as many rounds (its calls
  take tens of µs, so a round's noise is a larger share of them). Below the tables, as context,
  the same model's whole training step (forward, backward, step, ``zero_grad()``) with each
  scaler against none, over ``E2E_ROUNDS`` times as many rounds, with the spread of each
  overhead over the blocks: a difference of two ~15 ms steps, so within a few percent it is
  noise.

With ``--calls`` a third table splits torch's and ampscaler's overheads into their calls:
``scale``, what ``step`` adds to the plain step, and ``update``, in µs, from the same scalers
timed call by call in further variants of the same rounds.

With ``--fresh-grads`` the synthetic cases give every parameter a new gradient tensor before
each timed call, as ``zero_grad(set_to_none=True)`` followed by ``backward()`` does; by
default the gradient tensors are kept and refilled in place (``set_to_none=False``).

On a machine shared with other work, elapsed time includes the time this process waits for a
core; ``--threads 1 --clock cpu`` measures this thread's CPU time instead, which leaves the
waiting out (memory bandwidth and caches are still shared, so other work still adds time to
some rounds); ``--stat min`` then takes each variant's least time over the rounds, which such
additions cannot lower, in place of the medians.

Run from the repository root so that this checkout's code is measured::

    PYTHONPATH=src python benchmarks/overhead.py                          # full run
    PYTHONPATH=src python benchmarks/overhead.py --quick                  # smoke test
    PYTHONPATH=src python benchmarks/overhead.py --threads 1 --clock cpu  # on a busy machine
    PYTHONPATH=src python benchmarks/overhead.py --threads 1 --clock cpu --stat min  # a loaded one
"""

from __future__ import annotations

import argparse
import operator
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import ampscaler

LOSS_SCALE = 2.0**16
# Ratios asked for: ampscaler's overhead at most this multiple of torch's, with the defaults
# (every case) and with the opt-in speed-ups (paying where they are meant to, free elsewhere).
DEFAULT_TARGET = 1.05
OPT_IN_TARGETS = {
    "sgd-few-large": 1.05,
    "sgd-many-small": 0.6,
    "adam-fused": 0.6,
    "transformer": 1.05,
}
OPT_IN = {"flat_grads": True, "one_pass_fused": True}
GUARD_TARGET = 1.5  # read passes over the gradients a SpikeGuard may cost on a clean step
TRANSFORMER_ROUNDS = 5  # the transformer's calls run this many times --rounds
E2E_ROUNDS = 2  # the transformer's whole step runs this many times --rounds


Spread = tuple[float, float]  # the lowest and highest of a ratio over the blocks of rounds


@dataclass
class Timings:
    """Per-round times in seconds, by variant name, how many blocks the rounds are cut into
    for the spread, and the statistic (``median``: of the paired per-round differences, which
    cancels slow drifts; ``min``: the least time of each variant, which leaves out what other
    work on the machine added to a round, and differences of those)."""

    rounds: dict[str, list[float]]
    blocks: int = 1
    stat: str = "median"

    def median(self, variant: str) -> float:
        """A variant's time: its median, or its least time with ``stat="min"``."""
        if self.stat == "min":
            return min(self.rounds[variant])
        return statistics.median(self.rounds[variant])

    def differences(self, variant: str, baseline: str) -> list[float]:
        """``variant - baseline`` in each round (paired: the same round, the same machine)."""
        pairs = zip(self.rounds[variant], self.rounds[baseline], strict=True)
        return [a - b for a, b in pairs]

    def overhead(self, variant: str, baseline: str = "plain") -> float:
        """Median over rounds of ``variant - baseline`` (paired within each round); with
        ``stat="min"``, the least time of ``variant`` minus the least of ``baseline``."""
        if self.stat == "min":
            return self.median(variant) - self.median(baseline)
        return statistics.median(self.differences(variant, baseline))

    def ratio(self, variant: str, reference: str, baseline: str = "plain") -> float:
        """``variant``'s overhead over ``reference``'s (both against ``baseline``)."""
        return self.overhead(variant, baseline) / self.overhead(reference, baseline)

    def spread(self, per_block: Callable[[Timings], float]) -> Spread:
        """The lowest and highest of ``per_block`` over the consecutive blocks of rounds."""
        count = len(next(iter(self.rounds.values())))
        size = max(count // self.blocks, 1)
        values = [
            per_block(
                Timings({k: v[start : start + size] for k, v in self.rounds.items()}, 1, self.stat)
            )
            for start in range(0, count - size + 1, size)
        ]
        return min(values), max(values)


#: The scalers' calls timed apart with ``--calls``.
CALLS = ("scale", "step", "update")


@dataclass
class Row:
    case: str
    timings: Timings
    tensors: int
    floor: bool
    #: With ``--calls``: per scaler (``torch``, ``ampscaler``), each call's time per round.
    calls: dict[str, dict[str, list[float]]] | None = None

    def call(self, scaler: str, call: str) -> float:
        """``scaler``'s ``call`` in seconds (the statistic of the timings); for ``step``, what
        it adds to the plain step (paired by round, as the overheads are)."""
        assert self.calls is not None
        rounds = {"plain": self.timings.rounds["plain"], call: self.calls[scaler][call]}
        split = Timings(rounds, 1, self.timings.stat)
        return split.overhead("step") if call == "step" else split.median(call)

    def overhead(self, variant: str) -> float:
        return self.timings.overhead(variant)

    def ratio(self, variant: str) -> tuple[float, Spread]:
        """``variant``'s overhead over torch's, and its spread over the blocks."""
        return (
            self.timings.ratio(variant, "torch"),
            self.timings.spread(lambda block: block.ratio(variant, "torch")),
        )

    def guard(self) -> float:
        """What a SpikeGuard adds to the defaults: the median of the paired differences."""
        return self.timings.overhead("guarded", "ampscaler")

    def guard_passes(self, reference: str) -> tuple[float, Spread]:
        """What the guard adds in passes of ``reference`` (a pass's own time, per round), and
        its spread over the blocks."""

        def passes(timings: Timings) -> float:
            return timings.overhead("guarded", "ampscaler") / timings.median(reference)

        return passes(self.timings), self.timings.spread(passes)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_call(fn: Callable[[], object], device: torch.device, clock: str) -> float:
    """Seconds ``fn()`` takes on ``clock``, waiting for the device before and after."""
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    fn()
    synchronize(device)
    return now() - start


def interleave(
    variants: dict[str, Callable[[], object]],
    prepare: Callable[[], object],
    args: argparse.Namespace,
    device: torch.device,
    prepares: dict[str, Callable[[], object]] | None = None,
) -> Timings:
    """Time each variant once per round in a shuffled order; ``prepare()`` runs untimed first
    (``prepares[name]()`` instead, for a variant named there)."""
    order = list(variants)
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {name: [] for name in order}
    own = prepares or {}
    for index in range(args.warmup + args.rounds):
        rng.shuffle(order)
        for name in order:
            own.get(name, prepare)()
            elapsed = time_call(variants[name], device, args.clock)
            if index >= args.warmup:
                times[name].append(elapsed)
    return Timings(times, args.blocks, args.stat)


def more_rounds(args: argparse.Namespace, factor: int) -> argparse.Namespace:
    """``args`` with ``factor`` times as many rounds."""
    return argparse.Namespace(**{**vars(args), "rounds": args.rounds * factor})


FLAT_PASSES = ("r+w pass", "sum pass", "norm pass")


def passes(
    params: list[torch.nn.Parameter], device: torch.device
) -> tuple[dict[str, Callable[[], object]], Callable[[], object]]:
    """The reference passes over as many floats as ``params``' gradients hold, and what runs
    before each of the flat ones. Over one flat buffer: a read+write (``mul_(1.0)``), a read
    (``sum()``) and a read that squares (``vector_norm``), each after a read+write of the
    buffer (untimed), so that it finds the buffer in the caches as a scaler's pass finds the
    gradients that the check pass (or the restoring copy) has just written; and torch's
    multi-tensor norm over the gradients where they lie (``foreach pass``)."""
    flat = torch.randn(sum(p.numel() for p in params), device=device)
    variants: dict[str, Callable[[], object]] = {
        "r+w pass": lambda: flat.mul_(1.0),
        "sum pass": flat.sum,
        "norm pass": lambda: torch.linalg.vector_norm(flat),
        "foreach pass": lambda: torch._foreach_norm(
            [p.grad for p in params if p.grad is not None], 2, dtype=torch.float32
        ),
    }
    return variants, lambda: flat.mul_(1.0)


def scaler_step(
    scaler: ampscaler.GradScaler | torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
) -> None:
    scaler.scale(loss)
    scaler.step(optimizer)
    scaler.update()


def split_step(
    scaler: ampscaler.GradScaler | torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer,
    loss: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    into: dict[str, list[float]],
) -> Callable[[], None]:
    """:func:`scaler_step` timing each call apart, into ``into`` (one entry per round, the
    warm-up's included)."""
    calls: dict[str, Callable[[], object]] = {
        "scale": lambda: scaler.scale(loss),
        "step": lambda: scaler.step(optimizer),
        "update": scaler.update,
    }

    def run() -> None:
        for call in CALLS:
            into[call].append(time_call(calls[call], device, args.clock))

    return run


def synthetic_case(
    name: str,
    count: int,
    size: int,
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    args: argparse.Namespace,
    device: torch.device,
) -> Row:
    gen = torch.Generator().manual_seed(args.seed)
    params = [torch.nn.Parameter(torch.randn(size, generator=gen).to(device)) for _ in range(count)]
    # Scaled gradients, as backward() leaves them: unscaled values around 1e-2.
    saved = [torch.randn(size, generator=gen).mul_(LOSS_SCALE * 1e-2).to(device) for _ in params]
    return calls_case(name, params, saved, make_optimizer(params), args, device)


def calls_case(
    name: str,
    params: list[torch.nn.Parameter],
    saved: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    device: torch.device,
) -> Row:
    """The scalers' calls on ``params`` with the scaled gradients ``saved``, side by side."""
    for param, grad in zip(params, saved, strict=True):
        param.grad = grad.clone()
    loss = torch.ones((), device=device)
    theirs = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
    ours = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE)
    flat = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE, **OPT_IN)
    guarded = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE)
    guarded.attach(ampscaler.SpikeGuard())

    def prepare() -> None:
        if args.fresh_grads:
            for param, grad in zip(params, saved, strict=True):
                param.grad = grad.clone()
        else:
            torch._foreach_copy_([p.grad for p in params], saved)

    variants: dict[str, Callable[[], object]] = {
        "plain": optimizer.step,
        "torch": lambda: scaler_step(theirs, optimizer, loss),
        "ampscaler": lambda: scaler_step(ours, optimizer, loss),
        "flat": lambda: scaler_step(flat, optimizer, loss),
        "guarded": lambda: scaler_step(guarded, optimizer, loss),
    }
    for _ in range(3):  # the opt-in scaler builds its flat buffer on the second step
        prepare()
        scaler_step(flat, optimizer, loss)
    buffer = planned_buffer(flat, optimizer)
    if buffer is not None:
        variants["floor"] = floor_step(buffer, optimizer, loss)
    references, touch = passes(params, device)
    variants.update(references)
    calls: dict[str, dict[str, list[float]]] = {}
    if args.calls:  # the same scalers again, their calls timed apart
        for label, scaler in (("torch", theirs), ("ampscaler", ours)):
            calls[label] = {call: [] for call in CALLS}
            split = split_step(scaler, optimizer, loss, args, device, calls[label])
            variants[f"{label} calls"] = split
    timings = interleave(variants, prepare, args, device, dict.fromkeys(FLAT_PASSES, touch))
    for per_call in calls.values():  # leave out the warm-up rounds, as interleave() does
        for call in CALLS:
            del per_call[call][: args.warmup]
    if not ours.get_scale() == flat.get_scale() == guarded.get_scale() == theirs.get_scale():
        raise AssertionError(f"{name}: the scalers disagree on the scale")
    if guarded.metrics()["scaler/spike_skips"]:
        raise AssertionError(f"{name}: the guard skipped a clean step")
    label = f"{name} (fresh grads)" if args.fresh_grads else name
    return Row(label, timings, len(params), buffer is not None, calls or None)


def planned_buffer(
    scaler: ampscaler.GradScaler, optimizer: torch.optim.Optimizer
) -> torch.Tensor | None:
    """The flat buffer the opt-in ``scaler`` checks all of ``optimizer``'s gradients in, or
    ``None`` where it keeps some apart (or none). Read from the scaler's private plan
    (``ampscaler.grads.flat``): a new tensor over the buffer's memory would raise its storage's
    use count, which the plan takes as a sign of sharing and drops itself."""
    entry = scaler._planner._entries.get(optimizer) if scaler._planner is not None else None
    plan = None if entry is None else entry.plan
    if plan is None or plan.kept or len(plan.groups) != 1:
        return None
    (per_dtype,) = plan.groups.values()
    if len(per_dtype) != 1:
        return None
    (tensors,) = per_dtype.values()
    return tensors[0] if len(tensors) == 1 else None


def floor_step(
    buffer: torch.Tensor, optimizer: torch.optim.Optimizer, loss: torch.Tensor
) -> Callable[[], object]:
    """The least any scaler does on the flat-buffer route, by hand: scale the loss, confirm
    that every ``.grad`` is still the tensor the buffer holds (one read each), form ``1/scale``,
    run one check kernel over ``buffer`` (which unscales it), step the optimizer with the flag
    (a fused one is handed it; any other has it read first) and move the scale with torch's
    update kernel."""
    scale = torch.full((), LOSS_SCALE, device=buffer.device)
    tracker = torch.zeros((), dtype=torch.int32, device=buffer.device)
    planned = [p.grad for group in optimizer.param_groups for p in group["params"]]
    fused = getattr(optimizer, "_step_supports_amp_scaling", False)

    def step() -> None:
        loss * scale  # what scale(loss) computes
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        if not all(map(operator.is_, grads, planned)):
            raise AssertionError("the gradients left the flat buffer")
        flag = torch.zeros((), device=buffer.device)
        torch._amp_foreach_non_finite_check_and_unscale_([buffer], flag, scale.reciprocal())
        if fused:
            optimizer.found_inf = flag  # type: ignore[attr-defined]
            optimizer.step()
            del optimizer.found_inf  # type: ignore[attr-defined]
        elif not flag.item():
            optimizer.step()
        torch._amp_update_scale_(scale, tracker, flag, 2.0, 0.5, 2000)

    return step


class TinyTransformer(torch.nn.Module):
    """Token embedding, a two-layer transformer encoder and a vocabulary head."""

    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        layer = torch.nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer_loss(
    model: TinyTransformer, seed: int, device: torch.device
) -> Callable[[], torch.Tensor]:
    """The model's loss on one fixed batch, under fp16 autocast."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 32), generator=gen).to(device)
    targets = torch.randint(0, 256, (4, 32), generator=gen).to(device)

    def loss_value() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.float16):
            logits = model(tokens)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return loss_value


def transformer_case(args: argparse.Namespace, device: torch.device) -> Row:
    torch.manual_seed(args.seed)
    model = TinyTransformer().to(device)
    (transformer_loss(model, args.seed, device)() * LOSS_SCALE).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.detach().clone() for p in params if p.grad is not None]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    longer = more_rounds(args, TRANSFORMER_ROUNDS)
    return calls_case("transformer", params, saved, optimizer, longer, device)


def whole_step(args: argparse.Namespace, device: torch.device) -> Timings:
    """The transformer's whole training step, without a scaler (``plain``), with torch's and
    with ampscaler's."""
    torch.manual_seed(args.seed)
    model = TinyTransformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_value = transformer_loss(model, args.seed, device)
    theirs = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE)
    ours = ampscaler.GradScaler(device.type, init_scale=LOSS_SCALE)

    def plain() -> None:
        loss_value().backward()
        optimizer.step()
        optimizer.zero_grad()

    def scaled(scaler: ampscaler.GradScaler | torch.amp.GradScaler) -> None:
        scaler.scale(loss_value()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    # The overhead is a small difference between two whole steps: take more rounds, and the
    # median of paired differences (a least time of a ~15 ms step says little).
    return interleave(
        {"plain": plain, "torch": lambda: scaled(theirs), "ampscaler": lambda: scaled(ours)},
        lambda: None,
        argparse.Namespace(**{**vars(more_rounds(args, E2E_ROUNDS)), "stat": "median"}),
        device,
    )


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> Row:
    if name == "sgd-few-large":
        return synthetic_case(
            name, 50, 200_000, lambda ps: torch.optim.SGD(ps, lr=1e-3), args, device
        )
    if name == "sgd-many-small":
        return synthetic_case(
            name, 2000, 5_000, lambda ps: torch.optim.SGD(ps, lr=1e-3), args, device
        )
    if name == "adam-fused":
        return synthetic_case(
            name, 500, 20_000, lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), args, device
        )
    if name == "transformer":
        return transformer_case(args, device)
    raise SystemExit(f"unknown case {name!r}; choose from {', '.join(CASES)}")


CASES = ("sgd-few-large", "sgd-many-small", "adam-fused", "transformer")


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine(device: torch.device) -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{cpu_name()}, {os.cpu_count()} cores"
    )
    return (
        f"device: {device} ({where}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; python {platform.python_version()}\n"
        f"load average (1/5/15 min): {load}\n"
        f"ampscaler from {os.path.dirname(ampscaler.__file__)}"
    )


def verdict(value: float, spread: Spread, target: float | None) -> str:
    """``value [lowest-highest] yes|NO`` against ``target``."""
    met = "" if target is None else (" yes" if value <= target else " NO")
    return f"{value:.2f} [{spread[0]:.2f}-{spread[1]:.2f}]{met}"


def print_table(rows: list[Row]) -> None:
    """The scalers' overheads, their ratios to torch's (with the spread and whether the
    target is met) and the reference passes."""
    header = (
        f"{'case':<26} {'torch ms':>9} {'defaults ms':>12} {'ratio [spread] (<=1.05)':>24} "
        f"{'opt-in ms':>10} {'ratio [spread] (target)':>24} {'floor ms':>9} {'ratio':>6} "
        f"{'r+w ms':>7} {'sum ms':>7} {'plain ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        timings = row.timings
        flat_target = OPT_IN_TARGETS.get(row.case.split(" ")[0])
        floor = row.overhead("floor") if row.floor else None
        floor_ratio = "-" if floor is None else f"{floor / row.overhead('torch'):.2f}"
        flat_ratio = verdict(*row.ratio("flat"), flat_target)
        print(
            f"{row.case:<26} {ms(row.overhead('torch')):>9} {ms(row.overhead('ampscaler')):>12} "
            f"{verdict(*row.ratio('ampscaler'), DEFAULT_TARGET):>24} "
            f"{ms(row.overhead('flat')):>10} {flat_ratio + f' (<={flat_target:g})':>24} "
            f"{ms(floor):>9} {floor_ratio:>6} {ms(timings.median('r+w pass')):>7} "
            f"{ms(timings.median('sum pass')):>7} {ms(timings.median('plain')):>9}"
        )


def print_guard_table(rows: list[Row]) -> None:
    """What a SpikeGuard adds on a clean step, against the reference passes."""
    header = (
        f"{'case':<26} {'tensors':>7} {'sum ms':>7} {'norm ms':>8} {'foreach ms':>10} "
        f"{'guard ms':>9} {'guard passes [spread] (<=1.5)':>30} {'in norm passes':>15} "
        f"{'own ms':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        timings = row.timings
        foreach = timings.median("foreach pass")
        print(
            f"{row.case:<26} {row.tensors:>7} {ms(timings.median('sum pass')):>7} "
            f"{ms(timings.median('norm pass')):>8} {ms(foreach):>10} {ms(row.guard()):>9} "
            f"{verdict(*row.guard_passes('sum pass'), GUARD_TARGET):>30} "
            f"{verdict(*row.guard_passes('norm pass'), None):>15} {ms(row.guard() - foreach):>7}"
        )


def print_calls_table(rows: list[Row]) -> None:
    """Each call of torch's scaler and ampscaler's defaults, in µs (``step``: what it adds to
    the plain step)."""
    header = f"{'case':<26} " + " ".join(
        f"{f'{call} torch':>13} {'ampscaler':>10}" for call in ("scale", "step-plain", "update")
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.calls is None:
            continue
        cells = " ".join(
            f"{row.call('torch', call) * 1e6:>13.1f} {row.call('ampscaler', call) * 1e6:>10.1f}"
            for call in CALLS
        )
        print(f"{row.case:<26} {cells}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--rounds", type=int, default=100, help="timed rounds per case")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="median: of paired per-round differences; min: least times, on a loaded machine",
    )
    parser.add_argument(
        "--blocks", type=int, default=5, help="blocks of rounds the spread of a ratio is taken over"
    )
    parser.add_argument("--quick", action="store_true", help="5 rounds after 1 warm-up round")
    parser.add_argument("--fresh-grads", action="store_true", help="new gradient tensors per call")
    parser.add_argument(
        "--calls", action="store_true", help="also time each call of torch's and ampscaler's apart"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: this thread's CPU time, which leaves out time spent "
        "descheduled on a busy machine (CPU device with --threads 1 only)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = 5, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu measures one thread: use it with --device cpu --threads 1")
    print(describe_machine(device))
    print(
        f"{args.rounds} rounds after {args.warmup} warm-up (the transformer's calls "
        f"{TRANSFORMER_ROUNDS} times as many), {args.clock} clock; overheads are "
        + (
            "least times minus the plain step's least time"
            if args.stat == "min"
            else "medians of per-round differences against the plain step"
        )
        + f", in ms; [spread]: the lowest and highest over {args.blocks} blocks of the rounds\n"
    )
    names = [name.strip() for name in args.cases.split(",")]
    rows = [run_case(name, args, device) for name in names]
    print_table(rows)
    print("\nSpikeGuard on a clean step, beyond the defaults:\n")
    print_guard_table(rows)
    if args.calls:
        print("\nEach call apart, µs (torch's scaler and ampscaler's defaults):\n")
        print_calls_table(rows)
    if "transformer" in names:
        whole = whole_step(args, device)

        def added(variant: str) -> str:
            low, high = whole.spread(lambda block: block.overhead(variant))
            return f"{ms(whole.overhead(variant))} [{ms(low)}-{ms(high)}] ms"

        print(
            f"\ncontext, the transformer's whole training step ({whole.median('plain') * 1e3:.2f}"
            f" ms without a scaler, {args.rounds * E2E_ROUNDS} rounds): torch's scaler adds "
            f"{added('torch')}, ampscaler's {added('ampscaler')}"
        )
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end: {load}")


if __name__ == "__main__":
    main()
