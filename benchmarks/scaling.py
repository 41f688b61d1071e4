"""Loss scaling on several real workloads: batches lost, skips, scale, underflow, loss, time.

Six workloads, each trained from the same initial weights on the same batches by every arm, in
float16 autocast on the CPU (one thread, fixed seeds):

- ``text-lm``: a character-level causal transformer LM on the text of Python's standard library
  sources (read from this interpreter's ``Lib``: real text, available offline), mean
  cross-entropy, AdamW;
- ``gpt2``: a transformers GPT-2 built from a config (no download) on the text of the standard
  library's packages (``Lib/*/*.py``: other text than ``text-lm``'s, and fixed, where
  ampscaler's own docs, its text before, changed its batches with every edit), mean
  cross-entropy, AdamW (left out, and said so, without transformers);
- ``pg-outliers``: the ``text-lm`` model trained by a policy-gradient loss,
  ``-(advantage * log p(next character))``, with one advantage per sequence, ``1 + t`` for a
  Student's t with 2 degrees of freedom (heavy-tailed: infinite variance), and every 30th
  batch an outlier whose advantages are 1000 times larger;
- ``token-sum``: the ``text-lm`` model with the cross-entropy *summed* over the tokens: the
  scale's ceiling sits some seven binades below torch's start of 2**16, a warm-up to lose
  batches in;
- ``tiny-loss``: a 3-layer tanh MLP whose squared error is multiplied by 2**-24: at scale 1
  every gradient flushes to zero in float16;
- ``mlp``: the same MLP with its plain squared error.

The arms: ``torch`` (``torch.amp.GradScaler``'s defaults), ``ampscaler`` (ampscaler's defaults:
torch's bit for bit, checked here), ``torch+attempts`` (ampscaler's defaults under
``scaler.attempts()`` at its default ``max_attempts``), ``headroom`` (``HeadroomPolicy()``, the
model watched), ``headroom+attempts``, ``hysteresis-2`` (torch's rule with ``hysteresis=2``);
and ``fp32`` (no autocast, no scaler), the reference for the held-out loss. The arms step in
lockstep, batch by batch, in an order that rotates, so a load on the machine falls on all of
them alike.

Per arm: ordinary and outlier batches lost (the batch's last try skipped), skipped tries,
extra passes (tries beyond one per batch), mean log2 of the scale each batch started at, the
measured underflow (every ``--probe-every`` batches, on the arm's model as it was before the
batch: the share of parameter-gradient elements that are nonzero in an fp32 backward but zero
in the arm's float16 backward at the scale of its last try at the batch, the gradients it
stepped on or, where every try was skipped, the last it saw; in ``--json`` also from batch 1
on, without batch 0's probe, which finds ``HeadroomPolicy`` at its ``first_scale`` of 1 where
no veto replays the batch), the held-out loss (fp32, after training, over ``--held-out``
batches) over the fp32 arm's and over torch's, the median thread time of a clean batch (one
try, stepped) over torch's, for the torch-rule arms the largest binades by which the scale
right after an outlier sits below torch's own 20 batches after it, and, for the arms under
``attempts()``, what the loop costs a clean batch (``att.``) with its control (``a/a``).

Seeds. Every arm sees the same batches, so torch against torch reads exactly 1; what moves a
held-out ratio is anything that moves a trajectory. Each seed (``--seeds``) draws other
initial weights and other batches; the counts are summed over seeds, the held-out ratios are
the mean over seeds with its standard error (``+-se``; each seed's, and the held-out set's own
sampling error, in ``--json``). Measured at 64 held-out batches, the held-out set's sampling
error of the ratio is at most 0.22% (``pg-outliers``), and the ratio's spread from seed to
seed is what counts: a standard deviation of 2.5% on ``pg-outliers`` (HeadroomPolicy with
``attempts()`` over torch, 4 seeds: 0.94 to 1.00; torch over fp32 moves more, 6.3%), 0.37%
on ``gpt2`` (8 seeds; 4.4% on ampscaler's docs, its text before), 0.2% or less on the rest.
So ``pg-outliers`` runs 4 seeds and ``gpt2`` 8 by default (:data:`SEEDS`), the rest one, and
the held-out check asks that HeadroomPolicy with ``attempts()`` end at most 1% above torch's
(a lower loss is no cost), on the ratio plus two standard errors where seeds measured them, and
says when those are too wide to tell 1%.

What ``attempts()`` costs a clean batch is timed on one model (:func:`time_attempts`): after
training, a copy of the arm without the loop runs pairs of batches without and with it, and
a control pairs it with itself in the same places (what the method reads where there is
nothing to find); per block of rounds the fastest of each side. Timed between
two arms instead (``attempts_cost_between_arms`` in ``--json``), the ratio also carries
whatever differs between two copies of a model, and read 1.007 to 1.027 on the MLPs where
the loop's own Python is some 0.13% of a batch.

    PYTHONPATH=src python benchmarks/scaling.py            # 300 batches per workload
    PYTHONPATH=src python benchmarks/scaling.py --quick    # 30 batches: a smoke test
    PYTHONPATH=src python benchmarks/scaling.py --json out.json --workloads text-lm,mlp
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from headroom import TinyLM

import ampscaler

VOCAB = 128  # characters as 7-bit codes: the sources and docs are ASCII but for a few
OUTLIER_EVERY = 30
OUTLIER_FACTOR = 1000.0
AFTER_OUTLIER = 20  # batches after an outlier at which torch's own scale is the yardstick
NAMES = ("text-lm", "pg-outliers", "token-sum", "gpt2", "tiny-loss", "mlp")
#: Runs per workload where --seeds does not say (1 for the rest): see the module docstring.
SEEDS = {"gpt2": 8, "pg-outliers": 4}
#: Held-out batches (--held-out).
HELD_OUT = 64


@dataclass
class Batch:
    """What every arm trains on: inputs, targets, per-row weights (advantages) and whether it is
    an outlier."""

    inputs: Tensor
    targets: Tensor
    weights: Tensor | None = None
    outlier: bool = False


@dataclass
class Workload:
    """A model, its batches and its losses (``half``: under float16 autocast)."""

    name: str
    build: Callable[[int], nn.Module]  # the seed of the initial weights -> the model
    batches: list[Batch]
    held_out: list[Batch]
    loss: Callable[[nn.Module, Batch, bool], Tensor]
    held_out_loss: Callable[[nn.Module, Batch], Tensor]
    lr: float
    seed: int = 0


# ---------------------------------------------------------------------------- data


def stdlib_text(size: int, pattern: str = "*.py") -> bytes:
    """The first ``size`` bytes of the standard library's sources matching ``pattern`` (relative
    to its ``Lib``; installed packages left out), in path order: fixed for a Python version."""
    root = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(root.glob(pattern)):
        if "site-packages" in path.relative_to(root).parts:
            continue
        out += path.read_bytes()
        if len(out) >= size:
            break
    return bytes(out[:size])


def text_batches(
    text: bytes, steps: int, batch: int, context: int, seed: int, held_out: int
) -> tuple[list[Batch], list[Batch]]:
    """Random windows of the first 90% of ``text`` for training; ``held_out`` batches of the
    last 10% held out (drawn after the training batches: their number leaves those alone)."""
    codes = torch.tensor(list(text), dtype=torch.long) & (VOCAB - 1)
    split = len(codes) * 9 // 10
    generator = torch.Generator().manual_seed(seed)

    def windows(low: int, high: int) -> Batch:
        starts = torch.randint(low, high - context - 1, (batch,), generator=generator)
        rows = torch.stack([codes[s : s + context + 1] for s in starts.tolist()])
        return Batch(rows[:, :-1], rows[:, 1:])

    train = [windows(0, split) for _ in range(steps)]
    held = [windows(split, len(codes)) for _ in range(held_out)]
    return train, held


def with_advantages(batches: list[Batch], seed: int) -> list[Batch]:
    """Per-row advantages ``1 + t`` (Student's t, 2 degrees of freedom: ``z / sqrt(Exp(1))``),
    1000 times larger on every 30th batch (the outliers)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for number, batch in enumerate(batches):
        rows = batch.inputs.shape[0]
        normal = torch.randn(rows, generator=generator)
        tails = normal / torch.empty(rows).exponential_(1.0, generator=generator).sqrt()
        outlier = number % OUTLIER_EVERY == OUTLIER_EVERY // 2
        weights = (1.0 + tails) * (OUTLIER_FACTOR if outlier else 1.0)
        out.append(Batch(batch.inputs, batch.targets, weights, outlier))
    return out


def teacher_batches(
    steps: int, batch: int, seed: int, held_out: int
) -> tuple[list[Batch], list[Batch]]:
    """Inputs and a fixed random tanh teacher's outputs; ``held_out`` batches held out."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randn(16, 32, generator=generator) / 4
    second = torch.randn(32, 4, generator=generator)

    def one() -> Batch:
        x = torch.randn(batch, 16, generator=generator)
        return Batch(x, torch.tanh(x @ first) @ second)

    return [one() for _ in range(steps)], [one() for _ in range(held_out)]


# ---------------------------------------------------------------------------- models and losses


def tiny_lm(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TinyLM(VOCAB, width=32, depth=2, heads=4, context=32)


class HFCausalLM(nn.Module):
    """A transformers causal LM returning its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx).logits  # type: ignore[no-any-return]


def gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return HFCausalLM(GPT2LMHeadModel(config))


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def logits(model: nn.Module, batch: Batch, half: bool) -> Tensor:
    with torch.autocast("cpu", dtype=torch.float16, enabled=half):
        out: Tensor = model(batch.inputs)
    return out.float()


def mean_ce(model: nn.Module, batch: Batch, half: bool) -> Tensor:
    return F.cross_entropy(logits(model, batch, half).reshape(-1, VOCAB), batch.targets.reshape(-1))


def sum_ce(model: nn.Module, batch: Batch, half: bool) -> Tensor:
    out = logits(model, batch, half).reshape(-1, VOCAB)
    return F.cross_entropy(out, batch.targets.reshape(-1), reduction="sum")


def policy_gradient(model: nn.Module, batch: Batch, half: bool) -> Tensor:
    logp = torch.log_softmax(logits(model, batch, half), -1)
    taken = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    assert batch.weights is not None
    return -(batch.weights.unsqueeze(-1) * taken).mean()


def held_out_ce(model: nn.Module, batch: Batch) -> Tensor:
    return mean_ce(model, batch, half=False)


def squared_error(factor: float) -> Callable[[nn.Module, Batch, bool], Tensor]:
    def loss(model: nn.Module, batch: Batch, half: bool) -> Tensor:
        return F.mse_loss(logits(model, batch, half), batch.targets) * factor

    return loss


def held_out_mse(model: nn.Module, batch: Batch) -> Tensor:
    return F.mse_loss(logits(model, batch, half=False), batch.targets)


def workloads(steps: int, chosen: set[str] | None, seed: int, held_out: int) -> list[Workload]:
    """The chosen workloads for one seed: ``seed`` draws the model's initial weights, and
    ``1000 * seed`` moves every data seed (seed 0: the data of the runs before seeds)."""

    def wanted(name: str) -> bool:
        return chosen is None or name in chosen

    out = []
    context, rows = 32, 8
    size = 400_000
    data = 1000 * seed
    if wanted("text-lm") or wanted("pg-outliers") or wanted("token-sum"):
        text = stdlib_text(size)
        train, held = text_batches(text, steps, rows, context, data + 1, held_out)
        if wanted("text-lm"):
            out.append(Workload("text-lm", tiny_lm, train, held, mean_ce, held_out_ce, 3e-3))
        if wanted("pg-outliers"):
            pg = with_advantages(train, seed=data + 2)
            out.append(
                Workload("pg-outliers", tiny_lm, pg, held, policy_gradient, held_out_ce, 1e-3)
            )
        if wanted("token-sum"):
            out.append(Workload("token-sum", tiny_lm, train, held, sum_ce, held_out_ce, 3e-3))
    if wanted("gpt2"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("gpt2: left out (transformers is not installed)")
        else:
            code = stdlib_text(size, "*/*.py")  # the packages' sources: other text than text-lm's
            train, held = text_batches(code, steps, rows, context, data + 3, held_out)
            out.append(Workload("gpt2", gpt2, train, held, mean_ce, held_out_ce, 3e-3))
    train, held = teacher_batches(steps, 64, data + 4, held_out)
    if wanted("tiny-loss"):
        tiny = squared_error(2.0**-24)
        out.append(Workload("tiny-loss", mlp, train, held, tiny, held_out_mse, 3e-3))
    if wanted("mlp"):
        plain = squared_error(1.0)
        out.append(Workload("mlp", mlp, train, held, plain, held_out_mse, 3e-3))
    for work in out:
        work.seed = seed
    return out


# ---------------------------------------------------------------------------- arms


@dataclass
class Arm:
    """One way to train: a scaler (``None``: fp32, no autocast) and whether ``attempts()``
    drives it."""

    name: str
    make: Callable[[nn.Module], Any] | None
    attempts: bool = False


HEADROOM: dict[str, float] = {}  # HeadroomPolicy's settings (--margin, --first-margin)


def headroom_scaler(model: nn.Module) -> ampscaler.GradScaler:
    scaler = ampscaler.GradScaler("cpu", policy=ampscaler.HeadroomPolicy(**HEADROOM))
    scaler.watch(model)
    return scaler


ARMS = [
    Arm("torch", lambda model: torch.amp.GradScaler("cpu")),
    Arm("ampscaler", lambda model: ampscaler.GradScaler("cpu")),
    Arm("torch+attempts", lambda model: ampscaler.GradScaler("cpu"), attempts=True),
    Arm("headroom", headroom_scaler),
    Arm("headroom+attempts", headroom_scaler, attempts=True),
    Arm("hysteresis-2", lambda model: ampscaler.GradScaler("cpu", hysteresis=2)),
    Arm("fp32", None),
]


@dataclass
class Tally:
    """What one arm did over a run."""

    tries: int = 0
    skips: int = 0
    lost_ordinary: int = 0
    lost_outliers: int = 0
    start_scales: list[float] = field(default_factory=list)
    clean_seconds: list[float] = field(default_factory=list)
    clean_by_batch: dict[int, float] = field(default_factory=dict)  # batch number -> seconds
    underflow: list[int] = field(default_factory=lambda: [0, 0])  # [flushed, carrying signal]
    underflow_later: list[int] = field(default_factory=lambda: [0, 0])  # the same from batch 1
    held_out: float = math.nan
    held_out_batches: list[float] = field(default_factory=list)  # the loss per held-out batch


@dataclass
class Trainer:
    """One arm's model, optimizer and scaler, and its tally."""

    arm: Arm
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    tally: Tally = field(default_factory=Tally)


def skipped(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the try that just ran skipped its step (torch's scaler: read before update)."""
    if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, ampscaler.GradScaler):
        return any(v.item() > 0 for v in scaler._found_inf_per_device(optimizer).values())
    return bool(scaler.last_step_skipped)


def one_try(work: Workload, trainer: Trainer, batch: Batch) -> bool:
    """Forward, backward, step, update; whether the step was skipped."""
    trainer.optimizer.zero_grad(set_to_none=True)
    scaler = trainer.scaler
    loss = work.loss(trainer.model, batch, scaler is not None)
    if scaler is None:
        loss.backward()
        trainer.optimizer.step()
        return False
    scaler.scale(loss).backward()
    scaler.step(trainer.optimizer)
    is_torch = not isinstance(scaler, ampscaler.GradScaler)
    was_skipped = skipped(scaler, trainer.optimizer) if is_torch else False
    scaler.update()
    return was_skipped if is_torch else skipped(scaler, trainer.optimizer)


def train_batch(work: Workload, trainer: Trainer, batch: Batch, number: int) -> float:
    """Train ``batch`` (every try of it); the scale its last try ran at."""
    tally, scaler = trainer.tally, trainer.scaler
    tally.start_scales.append(1.0 if scaler is None else scaler.get_scale())
    tries = scaler.attempts() if trainer.arm.attempts else range(1)
    last_scale = tally.start_scales[-1]
    start = time.thread_time()
    count, last = 0, False
    for _ in tries:
        if count:  # a replay (never a clean batch's time): the scale it runs at
            last_scale = scaler.get_scale()
        count += 1
        last = one_try(work, trainer, batch)
        tally.skips += last
    seconds = time.thread_time() - start
    tally.tries += count
    if count == 1 and not last:
        tally.clean_seconds.append(seconds)
        tally.clean_by_batch[number] = seconds
    if last:
        if batch.outlier:
            tally.lost_outliers += 1
        else:
            tally.lost_ordinary += 1
    return last_scale


def param_grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def probe_underflow(
    work: Workload, trainer: Trainer, model: nn.Module, batch: Batch, number: int, scale: float
) -> None:
    """Count the gradient elements nonzero in fp32 but zero in float16 at ``scale``, the scale
    the arm's last try at the batch ran at, on ``model``, the arm's model before the batch."""
    model.zero_grad(set_to_none=True)
    work.loss(model, batch, False).backward()
    exact = param_grads(model)
    model.zero_grad(set_to_none=True)
    (work.loss(model, batch, True) * scale).backward()
    half = param_grads(model)
    model.zero_grad(set_to_none=True)
    if not all(torch.isfinite(g).all() for g in half):
        return  # an overflow at this scale: nothing to say about underflow
    for ref, got in zip(exact, half, strict=True):
        signal = ref != 0
        counts = int((signal & (got == 0)).sum()), int(signal.sum())
        for tally in (trainer.tally.underflow, trainer.tally.underflow_later)[: 1 + (number > 0)]:
            tally[0] += counts[0]
            tally[1] += counts[1]


def run_workload(work: Workload, probe_every: int) -> dict[str, Trainer]:
    """Train every arm on ``work``'s batches, in lockstep; the trained arms by name."""
    initial = work.build(work.seed)
    trainers = []
    for arm in ARMS:
        model = copy.deepcopy(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=work.lr)
        scaler = None if arm.make is None else arm.make(model)
        trainers.append(Trainer(arm, model, optimizer, scaler))
    for number, batch in enumerate(work.batches):
        order = trainers[number % len(trainers) :] + trainers[: number % len(trainers)]
        if number % 2:  # every arm runs before and after each other arm, as often
            order.reverse()
        for trainer in order:
            probed = number % probe_every == 0 and trainer.scaler is not None
            before = copy.deepcopy(trainer.model) if probed else None
            scale = train_batch(work, trainer, batch, number)
            if before is not None:
                probe_underflow(work, trainer, before, batch, number, scale)
    for trainer in trainers:
        with torch.no_grad():
            losses = [float(work.held_out_loss(trainer.model, b)) for b in work.held_out]
        trainer.tally.held_out = statistics.fmean(losses)
        trainer.tally.held_out_batches = losses
    check_bitwise(trainers)
    return {trainer.arm.name: trainer for trainer in trainers}


def check_bitwise(trainers: list[Trainer]) -> None:
    """ampscaler's defaults must end with torch's parameters, bit for bit."""
    by_name = {trainer.arm.name: trainer for trainer in trainers}
    ours, theirs = by_name["ampscaler"].model, by_name["torch"].model
    pairs = zip(ours.parameters(), theirs.parameters(), strict=True)
    same = all(torch.equal(a, b) for a, b in pairs)
    if not same:
        raise SystemExit("ampscaler's defaults did not end with torch's parameters bit for bit")


# ---------------------------------------------------------------------------- what attempts() costs


#: The same-model timing (:func:`time_attempts`): rounds of eight clean batches, at most this
#: many ...
ROUNDS = 1000
#: ... or until the timed batches took this many seconds of thread time (--timing-seconds).
TIMING_SECONDS = 25.0
#: Rounds per block: a block's ratio is of its fastest batches, one side's over the other's.
ROUND_BLOCK = 24


@dataclass
class Paired:
    """What ``attempts()`` costs a clean batch, timed on one model (:func:`time_attempts`),
    each as the median and quartiles over blocks: ``cost``, the time with the loop over the
    time without it; ``control``, without over without in the same places (what the method
    reads where there is nothing to find: its noise)."""

    cost: tuple[float, float, float]
    control: tuple[float, float, float]
    rounds: int  # the rounds kept: every try clean and none measured
    blocks: int


def timed_try(work: Workload, trainer: Trainer, batch: Batch, loop: bool) -> tuple[float, bool]:
    """One batch with or without ``attempts()``: its thread time, and whether it was clean
    (one try, stepped)."""
    start = time.thread_time()
    tries, last = 0, False
    for _ in trainer.scaler.attempts() if loop else range(1):
        tries += 1
        last = one_try(work, trainer, batch)
    return time.thread_time() - start, tries == 1 and not last


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """The median and the quartiles, as (median, lower, upper)."""
    low, middle, high = statistics.quantiles(values, n=4, method="inclusive")
    return middle, low, high


def block_ratios(ours: list[float], theirs: list[float], block: int) -> list[float]:
    """Per block of ``block`` consecutive entries, the fastest of ``ours`` over the fastest of
    ``theirs`` (a load on the machine only slows a batch down: a block's fastest is its least
    disturbed)."""
    return [
        min(ours[start : start + block]) / min(theirs[start : start + block])
        for start in range(0, len(ours) - block + 1, block)
    ]


def time_attempts(
    work: Workload, twin: Trainer, arm: Arm, rounds: int, seconds: float
) -> Paired | None:
    """Time what ``attempts()`` costs a clean batch on one model: a copy of ``twin`` (the
    trained arm without the loop: its weights, its optimizer's state, its scaler's state in a
    new scaler of ``arm``'s kind) runs up to ``rounds`` rounds (or ``seconds`` of timed thread
    time) of eight batches, in pairs on one of ``work``'s ordinary batches each: without the
    loop (A) and with it (B) as ``A B``, ``B A``, and the control, twice without (X, Y), as
    ``X Y``, ``Y X``; from round to round the halves and the pairs within them swap places, so
    that over four rounds every side runs in every place once: what the batch before leaves in
    the caches, a new batch's first pass, and a drift in the machine's speed fall on both sides
    alike (with ``A B B A`` on one batch, the control read 0.993 to 0.995 on the MLP: the
    middle places ran warm); and one model, optimizer and scaler run both sides, so nothing
    that differs between two arms' copies (where their memory lies) enters the ratio. Per
    block of :data:`ROUND_BLOCK` rounds, the fastest B over the fastest A and the fastest Y
    over the fastest X; the median and quartiles over blocks. A round with a try that was
    skipped or replayed, or that a measuring policy measured (``policy.measures``: about sixty
    more ops), is left out: that is not a clean batch. ``None``: fewer than two blocks."""
    model = copy.deepcopy(twin.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=work.lr)
    optimizer.load_state_dict(twin.optimizer.state_dict())
    assert arm.make is not None
    scaler = arm.make(model)
    saved = twin.scaler.state_dict()
    scaler.load_state_dict(saved)
    trainer = Trainer(arm, model, optimizer, scaler)
    measures = getattr(scaler.policy, "measures", None)
    iteration = int(saved.get("headroom", {}).get("iteration", 0))
    ordinary = [batch for batch in work.batches if not batch.outlier]
    sides: dict[str, list[float]] = {"A": [], "B": [], "X": [], "Y": []}
    plans = (
        ("AB", "BA", "XY", "YX"),
        ("XY", "YX", "AB", "BA"),
        ("BA", "AB", "YX", "XY"),
        ("YX", "XY", "BA", "AB"),
    )  # every side in every place of a round, once per four rounds
    spent, kept, batch_number = 0.0, 0, 0
    for number in range(rounds):
        if spent >= seconds:
            break
        times: dict[str, float] = dict.fromkeys(sides, 0.0)
        clean = True
        for pair in plans[number % len(plans)]:
            batch = ordinary[batch_number % len(ordinary)]
            batch_number += 1
            for side in pair:
                took, was_clean = timed_try(work, trainer, batch, side == "B")
                clean &= was_clean and not (measures is not None and measures(iteration))
                iteration += 1
                times[side] += took
                spent += took
        if clean:
            kept += 1
            for side, total in times.items():
                sides[side].append(total)
    cost = block_ratios(sides["B"], sides["A"], ROUND_BLOCK)
    control = block_ratios(sides["Y"], sides["X"], ROUND_BLOCK)
    if len(cost) < 2:
        return None
    return Paired(quartiles(cost), quartiles(control), kept, len(cost))


# ---------------------------------------------------------------------------- the table


#: Clean batches per block of the between-arms timing (:func:`attempts_cost`).
BLOCK = 10
#: Each arm under attempts() and the same arm without: the pair whose clean batches are timed.
TWINS = {"torch+attempts": "ampscaler", "headroom+attempts": "headroom"}


def attempts_cost(tally: Tally, twin: Tally) -> tuple[float, float, float] | None:
    """What ``attempts()`` costs a clean batch, read between two arms: the thread time of an
    arm under it over its twin without it, on the batches both ran clean in one try (the arms
    run interleaved, batch by batch, in a rotating order). Per block of :data:`BLOCK` such
    batches, the ratio of the two blocks' fastest batches (a load on the machine only slows a
    batch down, so a block's minimum is its least disturbed); returned as the median and the
    quartiles over blocks (``None``: fewer than two blocks). Two arms are two copies of the
    model in memory: :func:`time_attempts` times both sides on one."""
    both = sorted(set(tally.clean_by_batch) & set(twin.clean_by_batch))
    ratios = []
    for start in range(0, len(both) - BLOCK + 1, BLOCK):
        block = both[start : start + BLOCK]
        ours = min(tally.clean_by_batch[b] for b in block)
        theirs = min(twin.clean_by_batch[b] for b in block)
        ratios.append(ours / theirs)
    if len(ratios) < 2:
        return None
    return quartiles(ratios)


def outlier_gap(tally: Tally, torch_tally: Tally, outliers: list[int]) -> float | None:
    """The most binades by which the scale right after an outlier sits below torch's own
    scale 20 batches after it (``None``: no outlier with 20 batches after it)."""
    gaps = [
        math.log2(torch_tally.start_scales[o + AFTER_OUTLIER] / tally.start_scales[o + 1])
        for o in outliers
        if o + AFTER_OUTLIER < len(tally.start_scales)
    ]
    return max(gaps) if gaps else None


def held_out_error(ours: list[float], theirs: list[float]) -> float:
    """The standard error of ``mean(ours) / mean(theirs)`` from the held-out set's sampling
    alone (two models on the same batches; the delta method: the spread of
    ``ours - ratio * theirs`` over the batches, over ``sqrt(n) * mean(theirs)``)."""
    ratio = statistics.fmean(ours) / statistics.fmean(theirs)
    spread = statistics.stdev(a - ratio * b for a, b in zip(ours, theirs, strict=True))
    return spread / (math.sqrt(len(ours)) * statistics.fmean(theirs))


def over_seeds(values: list[float]) -> tuple[float, float | None]:
    """The mean over seeds and its standard error (``None``: one seed)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def summarize(
    runs: list[tuple[Workload, dict[str, Trainer]]], timing: dict[str, Paired | None]
) -> dict[str, dict[str, Any]]:
    """The table's rows, over every seed's run of one workload: counts summed, the scale's
    mean and the measured underflow pooled, held-out ratios averaged over seeds (each seed's
    in ``*_seeds``), times as medians; ``timing``: the same-model timing per arm under
    ``attempts()``."""
    names = [name for name in runs[0][1] if name != "fp32"]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        tallies = [trainers[name].tally for _, trainers in runs]
        bases = [trainers["torch"].tally for _, trainers in runs]
        fp32 = [trainers["fp32"].tally for _, trainers in runs]
        flushed = [sum(t.underflow[i] for t in tallies) for i in (0, 1)]
        later = [sum(t.underflow_later[i] for t in tallies) for i in (0, 1)]
        vs_torch = [t.held_out / b.held_out for t, b in zip(tallies, bases, strict=True)]
        vs_fp32 = [t.held_out / f.held_out for t, f in zip(tallies, fp32, strict=True)]
        mean_vs_torch, se_seeds = over_seeds(vs_torch)
        sampling = [
            held_out_error(t.held_out_batches, b.held_out_batches)
            for t, b in zip(tallies, bases, strict=True)
            if len(t.held_out_batches) > 1 and t is not b
        ]
        clean = [s for t in tallies for s in t.clean_seconds]
        torch_clean = [s for b in bases for s in b.clean_seconds]
        gaps = [
            outlier_gap(t, b, [i for i, batch in enumerate(work.batches) if batch.outlier])
            for (work, _), t, b in zip(runs, tallies, bases, strict=True)
        ]
        known_gaps = [gap for gap in gaps if gap is not None]
        scales = [math.log2(s) for t in tallies for s in t.start_scales]
        rows[name] = {
            "lost": sum(t.lost_ordinary for t in tallies),
            "lost_outliers": sum(t.lost_outliers for t in tallies),
            "skips": sum(t.skips for t in tallies),
            "extra_passes": sum(
                t.tries - len(w.batches) for (w, _), t in zip(runs, tallies, strict=True)
            ),
            "mean_log2_scale": statistics.fmean(scales),
            "final_scale": [t.start_scales[-1] for t in tallies],
            "flushed": flushed[0] / flushed[1] if flushed[1] else 0.0,
            "flushed_from_batch_1": later[0] / later[1] if later[1] else 0.0,
            "held_out_vs_fp32": statistics.fmean(vs_fp32),
            "held_out_vs_fp32_se": over_seeds(vs_fp32)[1],
            "held_out_vs_fp32_seeds": vs_fp32,
            "held_out_vs_torch": mean_vs_torch,
            "held_out_vs_torch_se": se_seeds,
            "held_out_vs_torch_seeds": vs_torch,
            "held_out_sampling_se": statistics.fmean(sampling) if sampling else None,
            "clean_time_vs_torch": statistics.median(clean) / statistics.median(torch_clean)
            if clean and torch_clean
            else math.nan,
            "clean_ms": statistics.median(clean) * 1e3 if clean else math.nan,
            "outlier_gap": max(known_gaps) if known_gaps else None,
        }
        between = None
        if name in TWINS:
            first = runs[0][1]
            between = attempts_cost(first[name].tally, first[TWINS[name]].tally)
        rows[name]["attempts_cost_between_arms"] = None if between is None else between[0]
        paired = timing.get(name)
        rows[name]["attempts_cost"] = None if paired is None else paired.cost[0]
        rows[name]["attempts_cost_quartiles"] = None if paired is None else list(paired.cost[1:])
        rows[name]["control"] = None if paired is None else paired.control[0]
        rows[name]["control_quartiles"] = None if paired is None else list(paired.control[1:])
        rows[name]["timed_rounds"] = None if paired is None else paired.rounds
        rows[name]["timed_blocks"] = None if paired is None else paired.blocks
    return rows


COLUMNS = [
    ("lost", "lost", "{:d}"),
    ("lost_outliers", "outl.", "{:d}"),
    ("skips", "skips", "{:d}"),
    ("extra_passes", "extra", "{:d}"),
    ("mean_log2_scale", "log2 S", "{:.2f}"),
    ("flushed", "flushed", "{:.3%}"),
    ("held_out_vs_fp32", "vs fp32", "{:.4f}"),
    ("held_out_vs_torch", "vs torch", "{:.4f}"),
    ("held_out_vs_torch_se", "+-se", "{:.4f}"),
    ("clean_time_vs_torch", "time", "{:.3f}"),
    ("outlier_gap", "gap", "{:.0f}"),
    ("attempts_cost", "att.", "{:.4f}"),
    ("control", "a/a", "{:.4f}"),
]


def table(name: str, heading: str, rows: dict[str, dict[str, Any]]) -> str:
    head = f"{'':18}" + "".join(f"{title:>10}" for _, title, _ in COLUMNS)
    lines = [f"{name}: {heading}", head]
    for arm, row in rows.items():
        cells = "".join(
            f"{'-' if row[key] is None else fmt.format(row[key]):>10}" for key, _, fmt in COLUMNS
        )
        lines.append(f"{arm:18}{cells}")
    return "\n".join(lines)


def held_out_claim(ratio: float, error: float | None, seeds: int) -> tuple[str, bool]:
    """The held-out bar: HeadroomPolicy + attempts() ends at most 1% above torch's held-out
    loss (a lower loss is not a cost), judged on the ratio's upper bound ``ratio + 2 * error``
    where seeds measured its error (``error`` ``None``: one seed, the ratio itself)."""
    if error is None:
        upper, spread = ratio, " (1 seed: its noise not measured)"
    else:
        upper, spread = ratio + 2 * error, f" +- {2 * error:.4f} (2 se over {seeds} seeds)"
    if upper > 1.01 >= ratio:
        spread += ": too wide to tell 1%"
    elif ratio < 0.99:
        spread += f": {1 - ratio:.1%} lower than torch's"
    return (
        f"headroom+attempts held-out at most 1% above torch's: {ratio:.4f}{spread}",
        upper <= 1.01,
    )


#: How a check line reads: met, not met, not measured in this run.
VERDICTS = {True: "yes", False: "NO", None: "--"}


def checks(rows: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None]]:
    """The issue's bar, per workload: which claims hold (the held-out loss and the loop's cost
    with the numbers they are judged on); ``None`` for one the run did not measure (the loop's
    cost under ``--timing-seconds`` too short to time it)."""
    torch_row, ours, rule = rows["torch"], rows["headroom+attempts"], rows["torch+attempts"]
    gap = rule["outlier_gap"]
    return [
        ("headroom+attempts loses no ordinary batch", ours["lost"] == 0),
        (
            "headroom+attempts mean log2 scale >= torch's - 0.5",
            ours["mean_log2_scale"] >= torch_row["mean_log2_scale"] - 0.5,
        ),
        (
            "headroom+attempts flushes no more than torch (+0.1 point)",
            ours["flushed"] <= torch_row["flushed"] + 0.001,
        ),
        (
            "  the same without batch 0's probe (HeadroomPolicy's first step runs at scale 1)",
            ours["flushed_from_batch_1"] <= torch_row["flushed_from_batch_1"] + 0.001,
        ),
        held_out_claim(
            ours["held_out_vs_torch"],
            ours["held_out_vs_torch_se"],
            len(ours["held_out_vs_torch_seeds"]),
        ),
        ("torch+attempts loses no ordinary batch", rule["lost"] == 0),
        (
            "torch+attempts after an outlier <= 1 binade below torch 20 later",
            gap is None or gap <= 1,
        ),
        *(
            (
                f"{arm} clean batch within 1% of without the loop, on one model: "
                + (
                    "not timed"
                    if rows[arm]["attempts_cost"] is None
                    else "{:.4f} (quartiles {:.4f} {:.4f}; control {:.4f}, {:.4f}-{:.4f})".format(
                        rows[arm]["attempts_cost"],
                        *rows[arm]["attempts_cost_quartiles"],
                        rows[arm]["control"],
                        *rows[arm]["control_quartiles"],
                    )
                ),
                None if rows[arm]["attempts_cost"] is None else rows[arm]["attempts_cost"] <= 1.01,
            )
            for arm in TWINS
        ),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--probe-every", type=int, default=10)
    parser.add_argument(
        "--quick", action="store_true", help="30 batches per workload, 100 timing rounds"
    )
    parser.add_argument("--workloads", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--seeds", type=int, default=None, help="runs per workload")
    parser.add_argument("--held-out", type=int, default=HELD_OUT, help="held-out batches")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="same-model timing rounds")
    parser.add_argument(
        "--timing-seconds", type=float, default=TIMING_SECONDS, help="and at most this long"
    )
    parser.add_argument("--json", default=None, help="write the numbers here")
    parser.add_argument("--margin", type=float, default=None, help="HeadroomPolicy's margin")
    parser.add_argument("--first-margin", type=float, default=None, help="and first_margin")
    args = parser.parse_args(argv)
    HEADROOM.clear()
    for name in ("margin", "first_margin"):
        if getattr(args, name) is not None:
            HEADROOM[name] = getattr(args, name)
    torch.set_num_threads(1)
    steps = 30 if args.quick else args.steps
    rounds = min(args.rounds, 100) if args.quick else args.rounds
    chosen = set(args.workloads.split(",")) if args.workloads else None
    results: dict[str, Any] = {}
    for name in NAMES if chosen is None else [name for name in NAMES if name in chosen]:
        count = SEEDS.get(name, 1) if args.seeds is None else args.seeds
        start = time.perf_counter()
        group = [w for seed in range(count) for w in workloads(steps, {name}, seed, args.held_out)]
        if not group:
            continue  # gpt2 without transformers
        runs = [(work, run_workload(work, args.probe_every)) for work in group]
        work, trainers = runs[0]
        arms = {arm.name: arm for arm in ARMS}
        timing = {
            name: time_attempts(work, trainers[twin], arms[name], rounds, args.timing_seconds)
            for name, twin in TWINS.items()
        }
        rows = summarize(runs, timing)
        seconds = time.perf_counter() - start
        heading = f"{steps} batches x {len(runs)} seeds, {len(work.held_out)} held out"
        print(table(work.name, heading, rows))
        for claim, met in checks(rows):
            print(f"  {VERDICTS[met]:3} {claim}")
        print(f"  ({seconds:.0f} s)\n", flush=True)
        results[work.name] = {"rows": rows, "checks": dict(checks(rows))}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
