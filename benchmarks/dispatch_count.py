"""The aten ops and host reads of one training iteration, ampscaler beside torch, per configuration.

Time depends on the machine; what a scaler asks of the device does not. On a GPU every aten op
the scaler dispatches is a kernel launch (views aside) and every host read waits for the
device, so this table holds where nothing can be timed. A
:class:`~torch.utils._python_dispatch.TorchDispatchMode` counts the ops each call of one
iteration dispatches, in two arms run side by side from the same seed: torch's scaler
(``torch.amp.GradScaler``, or torch's FSDP ``ShardedGradScaler`` where a process group is
involved) and ampscaler's.

What is counted, per arm, on one iteration after warm-up (the third, unless a configuration
says otherwise):

- **scaler ops**: the ops dispatched inside ``scale``, ``unscale_``, ``step`` and ``update``,
  leaving out what runs inside the optimizer's own ``step()`` (the same work in both arms), plus
  what the scaler adds to the backward pass (ampscaler's gradient taps on a measured
  ``HeadroomPolicy`` iteration): the backward's ops beyond torch's arm's;
- **host reads**: ``aten._local_scalar_dense`` (``item()``, ``bool()``, ``float()`` of a
  tensor) and ``Tensor.tolist()`` (which reads without dispatching an op) in the same calls,
  the optimizer's own ``step()`` again left out; each is a device-to-host wait on a GPU (a
  read of a copy ampscaler started earlier without waiting is not counted);
- **optimizer ops**, as context: the ops of the optimizer's own ``step()`` in that iteration
  (a fused optimizer handed ``found_inf`` rolls its step counters back, in both arms).

ampscaler must stay at or below torch in scaler ops and host reads in every configuration
(``tests/test_dispatch_count.py`` runs the table and asserts it).

**Adding a row.** A configuration is a function returning a :class:`Row`, registered with
``@configuration("name")``. Most are a few lines over :func:`compare`, which runs a standard
loop (``scale``, ``backward``, optionally ``unscale_`` and clipping, ``step``, ``update``) in
both arms; a configuration that drives the scaler differently (``scaler.wrap(model,
optimizer)``, say) writes its own arm as a function of a :class:`Counter` and the iteration's
number, using ``counter.phase(name)`` around each call (:func:`count_arm` runs it).

Run from the repository root so that this checkout's code is measured::

    PYTHONPATH=src python benchmarks/dispatch_count.py                 # every configuration
    PYTHONPATH=src python benchmarks/dispatch_count.py --only "plain SGD,process_group"
    PYTHONPATH=src python benchmarks/dispatch_count.py --ops           # ops by name, per arm
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler
from torch.utils._python_dispatch import TorchDispatchMode

import ampscaler
from ampscaler.hostcopy import HostCopy

#: The op that reads a tensor's value on the host (``item()``, ``bool()``, ``float()``).
READ_OP = "aten._local_scalar_dense.default"
#: Phases whose ops are not the scaler's own (the user's backward, the optimizer's step).
NOT_THE_SCALERS = ("backward", "optimizer", "user")

Scaler = Any  # torch's or ampscaler's scaler: the arms are duck-typed


class Counter(TorchDispatchMode):
    """Counts the ops dispatched, and the host reads, by phase, while a phase is open and
    counting is on.

    Use ``with counter.phase("step"): scaler.step(opt)`` around each call; ops outside any
    phase, or in an iteration not counted (``counter.on = False``), are not counted. A nested
    phase (the optimizer's ``step()`` inside the scaler's) takes the ops until it closes.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.on = False
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.reads: collections.Counter[str] = collections.Counter()  # by phase
        self._phases: list[str] = []
        self._landed = 0  # inside HostCopy.tolist(): reading a copy that landed unawaited

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside as phase ``name``."""
        self._phases.append(name)
        try:
            with self, _counting_tolist(self):
                yield
        finally:
            self._phases.pop()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.on and self._phases:
            name = str(func)
            self.ops[self._phases[-1]][name] += 1
            if name == READ_OP:
                self.reads[self._phases[-1]] += 1
        return func(*args, **(kwargs or {}))

    def note_tolist(self) -> None:
        if self.on and self._phases and not self._landed:
            self.reads[self._phases[-1]] += 1


@contextlib.contextmanager
def _counting_tolist(counter: Counter) -> Iterator[None]:
    """``Tensor.tolist()`` reads values without dispatching an op: count it as a host read,
    except where ampscaler reads a :class:`~ampscaler.hostcopy.HostCopy`, a copy started
    earlier without waiting (on a GPU: into pinned memory, read once its event has fired),
    which never waits for the device."""
    original = torch.Tensor.tolist
    if getattr(original, "_counted_by", None) is not None:  # an outer phase counts already
        yield
        return
    landed = HostCopy.tolist

    @functools.wraps(original)
    def tolist(self: torch.Tensor) -> Any:
        counter.note_tolist()
        return original(self)

    @functools.wraps(landed)
    def landed_tolist(self: HostCopy) -> Any:
        counter._landed += 1
        try:
            return landed(self)
        finally:
            counter._landed -= 1

    tolist._counted_by = counter  # type: ignore[attr-defined]
    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    HostCopy.tolist = landed_tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]
        HostCopy.tolist = landed  # type: ignore[method-assign]


@dataclass(frozen=True)
class Counts:
    """One arm's counts for the counted iteration."""

    phases: dict[str, collections.Counter[str]]
    reads_by_phase: dict[str, int]

    @property
    def reads(self) -> int:
        """Host reads in the scaler's own calls (the optimizer's own, such as AdamW's reads
        of its step counts on the CPU, left out)."""
        return sum(n for name, n in self.reads_by_phase.items() if name not in NOT_THE_SCALERS)

    def ops_in(self, *phases: str) -> int:
        return sum(sum(self.phases.get(name, {}).values()) for name in phases)

    @property
    def own(self) -> int:
        """Ops in the scaler's own calls (not the backward, the optimizer or the user's code)."""
        return sum(
            sum(ops.values()) for name, ops in self.phases.items() if name not in NOT_THE_SCALERS
        )

    def by_name(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for name, ops in self.phases.items():
            if name not in NOT_THE_SCALERS:
                total.update(ops)
        return total


@dataclass(frozen=True)
class Row:
    """One configuration: torch's arm and ampscaler's."""

    name: str
    torch_label: str
    theirs: Counts
    ours: Counts
    note: str = ""
    #: Where torch's arm does less than ampscaler's (a feature torch has no counterpart of):
    #: the most scaler ops ampscaler may dispatch (see :func:`compare`'s ``adds``), so that a
    #: regression still fails; host reads stay at or below torch's.
    ceiling: int | None = None

    @property
    def backward_extra(self) -> int:
        """What ampscaler adds to the backward pass, in ops (its gradient taps)."""
        return max(0, self.ours.ops_in("backward") - self.theirs.ops_in("backward"))

    @property
    def torch_ops(self) -> int:
        return self.theirs.own

    @property
    def ours_ops(self) -> int:
        return self.ours.own + self.backward_extra

    @property
    def within(self) -> bool:
        """ampscaler at or below torch in scaler ops (or its :attr:`ceiling`) and in host
        reads."""
        bound = self.torch_ops if self.ceiling is None else self.ceiling
        return self.ours_ops <= bound and self.ours.reads <= self.theirs.reads

    def verdict(self) -> str:
        if self.ceiling is not None:
            return f"{'yes' if self.within else 'NO'}, against a ceiling of {self.ceiling}"
        return "yes" if self.within else "NO"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "torch": self.torch_label,
            "torch_ops": self.torch_ops,
            "ours_ops": self.ours_ops,
            "torch_reads": self.theirs.reads,
            "ours_reads": self.ours.reads,
            "ceiling": self.ceiling,
            "within": self.within,
        }


#: The configurations, by name, in the order the table shows them.
CONFIGURATIONS: dict[str, Callable[[], Row]] = {}


def configuration(name: str) -> Callable[[Callable[[], Row]], Callable[[], Row]]:
    """Register a function returning a :class:`Row` as the configuration ``name``."""

    def register(make: Callable[[], Row]) -> Callable[[], Row]:
        CONFIGURATIONS[name] = make
        return make

    return register


def count_arm(
    iteration: Callable[[Counter, int], None], iterations: int = 3, counted: int | None = None
) -> Counts:
    """Run ``iteration(counter, i)`` for ``i`` in ``range(iterations)`` and return the counts
    of iteration ``counted`` (the last, by default)."""
    counter = Counter()
    counted = iterations - 1 if counted is None else counted
    for index in range(iterations):
        counter.on = index == counted
        iteration(counter, index)
    return Counts(dict(counter.ops), dict(counter.reads))


def counted_step(counter: Counter, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.step()`` count as the ``optimizer`` phase (whoever calls it); the
    signature is kept, as torch's scaler inspects it."""
    step = optimizer.step

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        with counter.phase("optimizer"):
            return step(*args, **kwargs)

    optimizer.step = counted  # type: ignore[method-assign]


class MLP(torch.nn.Module):
    """``layers`` linear layers of width ``width`` with ReLUs between (2 tensors each)."""

    def __init__(self, layers: int = 2, width: int = 8) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x) if index == 0 else layer(torch.relu(x))
        return x


@dataclass
class Loop:
    """The standard loop of one arm: a model, an optimizer and a scaler, built from a seed."""

    make_scaler: Callable[[], Scaler]
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    layers: int = 2
    unscale: bool = False  # call unscale_() before step()
    clip: bool = False
    watch: bool = False
    keep_grads: bool = False
    parts: dict[str, Any] = field(default_factory=dict)

    def build(self, counter: Counter) -> None:
        torch.manual_seed(0)
        model = MLP(self.layers)
        optimizer = self.make_optimizer(list(model.parameters()))
        counted_step(counter, optimizer)
        scaler = self.make_scaler()
        if self.watch and hasattr(scaler, "watch"):  # ampscaler's arm: measure the model
            scaler.watch(model)
        self.parts = {"model": model, "optimizer": optimizer, "scaler": scaler}

    def iteration(self, counter: Counter, index: int) -> None:
        if not self.parts:
            self.build(counter)
        model, optimizer, scaler = (self.parts[k] for k in ("model", "optimizer", "scaler"))
        gen = torch.Generator().manual_seed(index)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8, generator=gen))
        loss = out.float().pow(2).mean()
        with counter.phase("scale"):
            scaled = scaler.scale(loss)
        with counter.phase("backward"):
            scaled.backward()
        if self.unscale:
            with counter.phase("unscale_"):
                scaler.unscale_(optimizer)
        if self.clip:
            with counter.phase("user"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with counter.phase("step"):
            scaler.step(optimizer)
        with counter.phase("update"):
            scaler.update()
        optimizer.zero_grad(set_to_none=not self.keep_grads)


def compare(
    name: str,
    theirs: Callable[[], Scaler],
    ours: Callable[[], Scaler],
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    *,
    torch_label: str = "GradScaler",
    iterations: int = 3,
    counted: int | None = None,
    note: str = "",
    adds: int | None = None,
    **loop: Any,
) -> Row:
    """A :class:`Row` from the standard loop run in both arms (``loop``: :class:`Loop`'s
    options). ``adds``, for a feature torch has no counterpart of: the most scaler ops it may
    add to ampscaler's defaults on the same loop (run as a third arm), which gives the row's
    ceiling; so a change to the core that every configuration pays moves the ceiling too."""
    counts = [
        count_arm(Loop(make, make_optimizer, **loop).iteration, iterations, counted)
        for make in (theirs, ours)
    ]
    ceiling = None
    if adds is not None:
        plain = Loop(our_scaler(), make_optimizer, **{**loop, "watch": False})
        ceiling = count_arm(plain.iteration, iterations, counted).own + adds
    return Row(name, torch_label, counts[0], counts[1], note, ceiling)


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)


def torch_scaler() -> Scaler:
    return torch.amp.GradScaler("cpu")


def our_scaler(**settings: Any) -> Callable[[], Scaler]:
    return lambda: ampscaler.GradScaler("cpu", **settings)


def world() -> dist.ProcessGroup:
    """The default process group; a one-rank gloo group in this process if there is none."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),  # type: ignore[attr-defined]
            rank=0,
            world_size=1,
        )
    group = dist.group.WORLD
    assert group is not None
    return group


@configuration("plain SGD")
def plain_sgd() -> Row:
    return compare("plain SGD", torch_scaler, our_scaler(), sgd)


@configuration("many small gradients")
def many_small() -> Row:
    return compare(
        "many small gradients", torch_scaler, our_scaler(), sgd, layers=50,
        note="100 gradient tensors",
    )  # fmt: skip


@configuration("fused Adam")
def fused_adam() -> Row:
    return compare(
        "fused Adam",
        torch_scaler,
        our_scaler(),
        lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    )


@configuration("AdamW")
def adamw() -> Row:
    return compare(
        "AdamW", torch_scaler, our_scaler(), lambda params: torch.optim.AdamW(params, lr=1e-3)
    )


@configuration("unscale_ + clipping")
def unscale_and_clip() -> Row:
    return compare(
        "unscale_ + clipping", torch_scaler, our_scaler(), sgd, unscale=True, clip=True,
        note="the clipping itself is the user's, not counted",
    )  # fmt: skip


@configuration("process_group")
def process_group() -> Row:
    group = world()
    return compare(
        "process_group",
        lambda: TorchShardedGradScaler("cpu", process_group=group),
        our_scaler(process_group=group),
        sgd,
        torch_label="ShardedGradScaler",
        note=f"a {dist.get_world_size(group)}-rank gloo group",
    )


@configuration("process_group + fused Adam")
def process_group_fused() -> Row:
    group = world()
    return compare(
        "process_group + fused Adam",
        lambda: TorchShardedGradScaler("cpu", process_group=group),
        our_scaler(process_group=group),
        lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
        torch_label="ShardedGradScaler",
        note="torch's ShardedGradScaler makes no collective for a fused optimizer (its ranks "
        "may step apart), ampscaler's agrees: not a like-for-like pair",
        adds=10,
    )


@configuration("ShardedGradScaler")
def sharded() -> Row:
    world()
    return compare(
        "ShardedGradScaler",
        lambda: TorchShardedGradScaler("cpu"),
        lambda: ampscaler.ShardedGradScaler("cpu"),
        sgd,
        torch_label="ShardedGradScaler",
        note="the default group",
    )


#: A HeadroomPolicy that measures iterations 0, 1, 5, 9, ...: the third (2) is not measured.
HEADROOM = {"history_length": 2, "sample_every": 4}


@configuration("HeadroomPolicy unmeasured")
def headroom_unmeasured() -> Row:
    policy = ampscaler.HeadroomPolicy(**HEADROOM)
    assert not policy.measures(2)
    return compare(
        "HeadroomPolicy unmeasured", torch_scaler,
        our_scaler(policy=policy), sgd, watch=True, counted=2,
        note="torch has no measuring policy", adds=4,
    )  # fmt: skip


@configuration("HeadroomPolicy measured")
def headroom_measured() -> Row:
    policy = ampscaler.HeadroomPolicy(**HEADROOM)
    assert policy.measures(5)
    return compare(
        "HeadroomPolicy measured", torch_scaler,
        our_scaler(policy=policy), sgd, watch=True, iterations=6,
        note="torch has no measuring policy; scaler.watch(model): taps in the backward",
        adds=76,
    )  # fmt: skip


def guarded() -> Scaler:
    scaler = ampscaler.GradScaler("cpu")
    scaler.attach(ampscaler.SpikeGuard(window=8))
    return scaler


@configuration("SpikeGuard")
def spike_guard() -> Row:
    return compare(
        "SpikeGuard",
        torch_scaler,
        guarded,
        sgd,
        iterations=10,
        note="torch has no spike guard",
        adds=20,
    )


@configuration("flat_grads=True")
def flat_grads() -> Row:
    return compare(
        "flat_grads=True", torch_scaler, our_scaler(flat_grads=True), sgd, layers=50,
        keep_grads=True, iterations=4,
        note="100 gradient tensors, kept (zero_grad(set_to_none=False)) as flat_grads needs",
    )  # fmt: skip


@configuration("one_pass_fused=True + fused Adam")
def one_pass_fused() -> Row:
    return compare(
        "one_pass_fused=True + fused Adam",
        torch_scaler,
        our_scaler(one_pass_fused=True),
        lambda params: torch.optim.Adam(params, lr=1e-3, fused=True),
    )


#: micro-batches per iteration in the wrap rows
WRAP_MICRO_BATCHES = 3


def wrap_arm(layers: int, wrapped: bool) -> Callable[[Counter, int], None]:
    """An iteration of the fp32-style loop (``WRAP_MICRO_BATCHES`` backwards, clipping,
    ``optimizer.step()``) under ``scaler.wrap(model, optimizer)`` (``wrapped``), or the same
    loop with torch's ``scale``/``unscale_``/``step``/``update`` written in. The forward, the
    loss and the backward count as the ``backward`` phase in both arms, so the row charges
    ampscaler with what its output hooks and end-of-backward multiplies add."""
    parts: dict[str, Any] = {}

    def iteration(counter: Counter, index: int) -> None:
        if not parts:
            torch.manual_seed(0)
            model = MLP(layers)
            optimizer = sgd(list(model.parameters()))
            counted_step(counter, optimizer)
            scaler = ampscaler.GradScaler("cpu") if wrapped else torch_scaler()
            if wrapped:
                scaler.wrap(model, optimizer)
            parts.update(model=model, optimizer=optimizer, scaler=scaler)
        model, optimizer, scaler = parts["model"], parts["optimizer"], parts["scaler"]
        gen = torch.Generator().manual_seed(index)
        for _ in range(WRAP_MICRO_BATCHES):
            with counter.phase("backward"):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(torch.randn(4, 8, generator=gen))
                loss = out.float().pow(2).mean() / WRAP_MICRO_BATCHES
            if not wrapped:
                with counter.phase("scale"):
                    loss = scaler.scale(loss)
            with counter.phase("backward"):
                loss.backward()
        if not wrapped:
            with counter.phase("unscale_"):
                scaler.unscale_(optimizer)
        with counter.phase("user"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with counter.phase("step"):
            if wrapped:
                optimizer.step()  # the scaler's unscale_, step and update
            else:
                scaler.step(optimizer)
                scaler.update()
        optimizer.zero_grad()

    return iteration


def wrapped_loop(layers: int) -> Row:
    counts = [count_arm(wrap_arm(layers, wrapped)) for wrapped in (False, True)]
    # Per micro-batch 1/S and the gradients x 1/S, and from the second on the gradients x S;
    # at the step the gradients x S (the multiplies: per device and dtype). The output's
    # float32 copy replaces the loop's .float(), its gradient x S torch's backward through
    # loss x S; an output already float32 would cost one copy more per micro-batch.
    allowance = 3 * WRAP_MICRO_BATCHES
    return Row(
        f"wrap: {2 * layers} tensors", "GradScaler", counts[0], counts[1],
        f"scaler.wrap(model, optimizer), {WRAP_MICRO_BATCHES} micro-batches, clipping; torch's "
        f"arm writes scale/unscale_/step/update in; the ceiling is torch's + {allowance}",
        ceiling=counts[0].own + allowance,
    )  # fmt: skip


for _layers in (3, 15, 150):
    configuration(f"wrap: {2 * _layers} tensors")(functools.partial(wrapped_loop, _layers))


def run(names: list[str] | None = None) -> list[Row]:
    """The rows of the configurations ``names`` (all, by default), in the registry's order."""
    chosen = list(CONFIGURATIONS) if names is None else names
    unknown = [name for name in chosen if name not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    return [CONFIGURATIONS[name]() for name in chosen]


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'configuration':<38} {'torch arm':<18} {'scaler ops':>10} {'ours':>5} "
        f"{'host reads':>10} {'ours':>5} {'optimizer ops':>13} {'ours':>5}  within"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row.name:<38} {row.torch_label:<18} {row.torch_ops:>10} {row.ours_ops:>5} "
            f"{row.theirs.reads:>10} {row.ours.reads:>5} "
            f"{row.theirs.ops_in('optimizer'):>13} {row.ours.ops_in('optimizer'):>5}  "
            f"{row.verdict()}"
        )
    notes = [f"{row.name}: {row.note}" for row in rows if row.note]
    if notes:
        print("\n" + "\n".join(notes))


def print_ops(rows: list[Row]) -> None:
    for row in rows:
        print(f"\n{row.name}")
        for label, counts in ((row.torch_label, row.theirs), ("ampscaler", row.ours)):
            ops = ", ".join(f"{name} {n}" for name, n in sorted(counts.by_name().items()))
            print(f"  {label}: {ops}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated configuration names")
    parser.add_argument("--ops", action="store_true", help="list each arm's ops by name")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    args = parser.parse_args(argv)
    names = None if args.only is None else [name.strip() for name in args.only.split(",")]
    rows = run(names)
    if args.json:
        print(json.dumps([row.as_dict() for row in rows]))
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    print(
        f"torch {torch.__version__}, CPU; aten ops and host reads of one iteration after "
        "warm-up (scale, unscale_, step, update; the optimizer's own step apart)\n"
    )
    print_table(rows)
    if args.ops:
        print_ops(rows)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
