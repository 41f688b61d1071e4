"""Twin training setups: the same model, data and scaler calls under two scaler classes.

A ``Script`` is a seeded random sequence of iterations (accumulation, injected inf/-inf/NaN,
clipping after ``unscale_``, manual ``new_scale``, checkpoint round trips). ``run_twin`` plays it
against one scaler class and returns a trace; two traces from the same script must be equal.

``make_script`` gives the classic twin: a plain SGD over a sparse embedding and the body, and
an Adam (fused or not) over the head. ``make_fuzz_script`` draws much more (the differential
fuzz, ``tests/test_fuzz_differential.py`` and ``scripts/fuzz.py``): one to three optimizers of
any kind (SGD, Adam, AdamW, Adagrad) and implementation (for-loop, foreach, fused), a sparse or
dense embedding, float32 or float64 parameters, inf/NaN losses, gradients set to ``None``,
``unscale_`` and clipping of any optimizer, optimizers stepped in any order (or not at all),
checkpoints through bytes or pickle, and, for ampscaler, a process group of one and flat
gradient buffers; and three things code written for torch's scaler does through its private
names: it chooses where the run starts (``_init_scale``, ``_init_growth_tracker`` before the
first ``scale()``), it ends iterations with an ``update()`` of its own copied from torch's
(NeMo's scaler does), and it drops a batch after its backward and runs it again (Composer does,
after running out of memory).
"""

from __future__ import annotations

import copy
import io
import pickle
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

POISONS = (float("inf"), float("-inf"), float("nan"))
PARTS = ("embed", "body", "head")


class TwinModel(torch.nn.Module):
    """An embedding (sparse gradients unless ``sparse=False``), a body and a head."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8, sparse=sparse)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens).mean(dim=1))).squeeze(-1)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: the model parts it steps, its kind, implementation and options."""

    parts: tuple[str, ...]
    kind: str  # "sgd", "adam", "adamw", "adagrad"
    impl: str = "for-loop"  # "for-loop", "foreach", "fused"
    options: tuple[tuple[str, Any], ...] = ()

    def build(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for part in self.parts for p in getattr(model, part).parameters()]
        impl = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}}.get(
            self.impl, {"fused": True}
        )
        make = {
            "sgd": lambda: torch.optim.SGD(params, lr=0.05, **impl, **dict(self.options)),
            "adam": lambda: torch.optim.Adam(params, lr=0.01, **impl, **dict(self.options)),
            "adamw": lambda: torch.optim.AdamW(params, lr=0.01, **impl, **dict(self.options)),
            "adagrad": lambda: torch.optim.Adagrad(params, lr=0.05, **impl, **dict(self.options)),
        }
        return make[self.kind]()


@dataclass
class Iteration:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    poison: list[tuple[str, int, float]] = field(default_factory=list)  # (param, flat idx, value)
    clip: float | None = None
    second_loss: bool = False
    new_scale: float | None = None
    new_scale_as_tensor: bool = False
    checkpoint: bool | str = False  # True or "bytes": through torch.save; "pickle": the object
    loss_factor: float = 1.0
    loss_poison: float | None = None  # multiplies the last micro-batch's loss (inf/NaN)
    none_grads: list[str] = field(default_factory=list)  # parameters whose .grad is dropped
    unscale: list[int] | None = None  # optimizers unscaled and clipped (None: the first, if clip)
    order: list[int] | None = None  # optimizers stepped, in order (None: all, in order)
    zero_to_none: bool = True


@dataclass
class Script:
    seed: int
    scaler_kwargs: dict[str, Any]
    fused: bool
    iterations: list[Iteration]
    optimizers: list[OptimizerSpec] | None = None  # None: SGD(embed, body), Adam(head)
    sparse: bool = True
    dtype: torch.dtype = torch.float32
    group: bool = False  # ampscaler with a process group of one (the fuzz's runner makes it)
    flat: bool = False  # ampscaler with flat_grads=True
    start: tuple[float, int] | None = None  # _init_scale, _init_growth_tracker assigned first
    own_update: bool = False  # updates without new_scale run torch's, copied (torch_update)
    dropped: int | None = None  # the iteration whose batch is dropped after a backward, redone

    def specs(self) -> list[OptimizerSpec]:
        """The optimizers, the classic pair when none were drawn."""
        if self.optimizers is not None:
            return self.optimizers
        adam = OptimizerSpec(("head",), "adam", "fused" if self.fused else "for-loop")
        return [OptimizerSpec(("embed", "body"), "sgd", options=(("momentum", 0.0),)), adam]


def make_script(seed: int, steps: int = 12) -> Script:
    """A random but reproducible sequence of iterations."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = {
        "init_scale": rng.choice([2.0**16, 2.0**10, 3.0e4, 1.0]),
        "growth_factor": rng.choice([2.0, 1.37, 3.0]),
        "backoff_factor": rng.choice([0.5, 0.31, 0.25]),
        "growth_interval": rng.choice([1, 2, 3, 5]),
    }
    names = [n for n, _ in TwinModel().named_parameters()]
    iterations = []
    for _ in range(steps):
        micro = [
            (torch.randint(0, 20, (4, 3), generator=gen), torch.randn(4, generator=gen))
            for _ in range(rng.choice([1, 1, 2, 3]))
        ]
        it = Iteration(micro_batches=micro)
        if rng.random() < 0.3:
            for _ in range(rng.choice([1, 2])):
                name = rng.choice(names)
                it.poison.append((name, rng.randrange(8), rng.choice(POISONS)))
        if rng.random() < 0.3:
            it.clip = rng.choice([0.1, 1.0, 10.0])
        it.second_loss = rng.random() < 0.3
        if rng.random() < 0.1:
            it.new_scale = rng.choice([256.0, 1024.0, 3.5])
            it.new_scale_as_tensor = rng.random() < 0.5
        it.checkpoint = rng.random() < 0.15
        it.loss_factor = rng.choice([1.0, 1.0, 1.0, 1e4])  # large losses overflow fp16 grads
        iterations.append(it)
    return Script(seed, kwargs, fused=rng.random() < 0.5, iterations=iterations)


GROUPINGS = (
    (PARTS,),
    (("embed", "body"), ("head",)),
    (("embed",), ("body", "head")),
    (("embed",), ("body",), ("head",)),
    (("embed", "head"), ("body",)),
)


def _fuzz_optimizer(rng: random.Random, parts: tuple[str, ...], sparse: bool) -> OptimizerSpec:
    """Any optimizer torch has for ``parts`` (sparse gradients: SGD or Adagrad, not fused)."""
    if sparse and "embed" in parts:
        kind, impl = rng.choice(["sgd", "adagrad"]), rng.choice(["for-loop", "foreach"])
    else:
        kind = rng.choice(["sgd", "adam", "adamw", "adagrad"])
        impl = rng.choice(["for-loop", "foreach", "fused"])
    options: dict[str, Any] = {}
    if kind == "sgd":
        # A fused SGD with momentum whose first step is skipped keeps an uninitialized
        # momentum buffer, with either scaler (docs/migration.md): not comparable.
        options["momentum"] = 0.0 if impl == "fused" else rng.choice([0.0, 0.9])
    elif kind in ("adam", "adamw"):
        options["amsgrad"] = rng.random() < 0.3
        options["weight_decay"] = rng.choice([0.0, 0.1])
    return OptimizerSpec(parts, kind, impl, tuple(sorted(options.items())))


def _fuzz_iteration(
    rng: random.Random, gen: torch.Generator, names: list[str], optimizers: int
) -> Iteration:
    """One iteration of the differential fuzz: everything ``make_script`` draws, and more."""
    micro = [
        (torch.randint(0, 20, (4, 3), generator=gen), torch.randn(4, generator=gen))
        for _ in range(rng.choice([1, 1, 2, 3]))
    ]
    it = Iteration(micro_batches=micro, second_loss=rng.random() < 0.25)
    if rng.random() < 0.3:
        it.poison = [
            (rng.choice(names), rng.randrange(16), rng.choice(POISONS))
            for _ in range(rng.choice([1, 2]))
        ]
    if rng.random() < 0.08:
        it.loss_poison = rng.choice(POISONS)
    it.loss_factor = rng.choice([1.0, 1.0, 1.0, 1e4])
    if rng.random() < 0.15:  # never the embedding's only parameter: an optimizer keeps one
        it.none_grads = [rng.choice([n for n in names if not n.startswith("embed")])]
    it.unscale = [i for i in range(optimizers) if rng.random() < 0.3]
    it.clip = rng.choice([0.1, 1.0, 10.0]) if it.unscale and rng.random() < 0.8 else None
    order = list(range(optimizers))
    rng.shuffle(order)
    if len(order) > 1 and rng.random() < 0.1:  # an optimizer not stepped this iteration
        order = order[1:]
    it.order = order
    if rng.random() < 0.08:
        it.new_scale = rng.choice([256.0, 1024.0, 3.5, 2.0**-100])
        it.new_scale_as_tensor = rng.random() < 0.5
    it.zero_to_none = rng.random() < 0.7
    if rng.random() < 0.15:
        it.checkpoint = rng.choice(["bytes", "pickle"])
    return it


def make_fuzz_script(seed: int, steps: int = 12) -> Script:
    """A random script of the differential fuzz (module docstring); reproducible by seed."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    kwargs: dict[str, Any] = {
        "init_scale": rng.choice([2.0**16, 2.0**10, 3.0e4, 1.0, 2.0**-120]),
        "growth_factor": rng.choice([2.0, 2.0, 1.37, 3.0]),
        "backoff_factor": rng.choice([0.5, 0.5, 0.31, 0.25]),
        "growth_interval": rng.choice([1, 2, 3, 5]),
    }
    sparse = rng.random() < 0.5
    grouping = rng.choice(GROUPINGS)
    optimizers = [_fuzz_optimizer(rng, parts, sparse) for parts in grouping]
    group = rng.random() < 0.3
    names = [n for n, _ in TwinModel().named_parameters()]
    iterations = [_fuzz_iteration(rng, gen, names, len(optimizers)) for _ in range(steps)]
    if group:  # a scaler with a process group cannot be pickled (process groups cannot)
        for it in iterations:
            it.checkpoint = "bytes" if it.checkpoint else False
    script = Script(
        seed,
        kwargs,
        fused=any(spec.impl == "fused" for spec in optimizers),
        iterations=iterations,
        optimizers=optimizers,
        sparse=sparse,
        dtype=torch.float64 if rng.random() < 0.15 else torch.float32,
        group=group,
        flat=rng.random() < 0.2,
    )
    # Drawn last, so that the draws above (and every seed's script before these) stay as
    # they were.
    if rng.random() < 0.15:
        script.start = (rng.choice([2.0**12, 3.0e3, 8.0]), rng.choice([0, 1, 3]))
    script.own_update = rng.random() < 0.2
    script.dropped = rng.randrange(steps) if rng.random() < 0.2 else None
    return script


@dataclass
class Trace:
    params: list[list[torch.Tensor]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    trackers: list[int] = field(default_factory=list)
    returns: list[Any] = field(default_factory=list)
    grads: list[list[torch.Tensor | None]] = field(default_factory=list)  # after update()
    states: list[list[torch.Tensor]] = field(default_factory=list)  # optimizers' tensors


def _poison(model: torch.nn.Module, poison: list[tuple[str, int, float]]) -> None:
    params = dict(model.named_parameters())
    for name, index, value in poison:
        grad = params[name].grad
        if grad is None:
            continue
        if grad.is_sparse:
            values = grad._values()
            if values.numel():
                values.view(-1)[index % values.numel()] = value
        else:
            grad.view(-1)[index % grad.numel()] = value


def _round_trip(
    scaler: Any, factory: Callable[..., Any], kwargs: dict[str, Any], how: bool | str
) -> Any:
    if how == "pickle":  # the object itself, as torch's pickling test does
        return pickle.loads(pickle.dumps(scaler))
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    fresh = factory("cpu", **kwargs)
    fresh.load_state_dict(torch.load(buffer))
    return copy.deepcopy(fresh)


def _losses(model: torch.nn.Module, scaler: Any, it: Iteration) -> None:
    """Forward and backward every micro-batch of ``it``."""
    for number, (tokens, target) in enumerate(it.micro_batches):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(tokens)
            loss = ((out.float() - target) ** 2).mean() * it.loss_factor
        if it.loss_poison is not None and number == len(it.micro_batches) - 1:
            loss = loss * it.loss_poison
        if it.second_loss:
            penalty = out.float().abs().mean()
            scaled, scaled_penalty = scaler.scale([loss, penalty])
            (scaled + scaled_penalty).backward()
        else:
            scaler.scale(loss).backward()


def _unscale_and_clip(scaler: Any, optimizers: list[Any], it: Iteration) -> None:
    unscaled = it.unscale if it.unscale is not None else ([0] if it.clip is not None else [])
    for index in unscaled:
        scaler.unscale_(optimizers[index])
        if it.clip is not None:
            params = [p for g in optimizers[index].param_groups for p in g["params"]]
            dense = [p for p in params if p.grad is not None and not p.grad.is_sparse]
            torch.nn.utils.clip_grad_norm_(dense, it.clip)


def _record(trace: Trace, model: torch.nn.Module, optimizers: list[Any], scaler: Any) -> None:
    trace.params.append([p.detach().clone() for p in model.parameters()])
    trace.grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    trace.states.append(
        [t.clone() for o in optimizers for s in o.state.values() for t in s.values()
         if torch.is_tensor(t)]
    )  # fmt: skip


def run_twin(script: Script, factory: Callable[..., Any]) -> Trace:
    """Play ``script`` with scalers made by ``factory(device, **kwargs)``."""
    torch.manual_seed(script.seed)
    model = TwinModel(script.sparse).to(script.dtype)
    optimizers = [spec.build(model) for spec in script.specs()]
    params = dict(model.named_parameters())
    scaler = factory("cpu", **script.scaler_kwargs)
    if script.start is not None:
        scaler._init_scale, scaler._init_growth_tracker = script.start
    trace = Trace()
    for number, it in enumerate(script.iterations):
        if number == script.dropped:
            _losses(model, scaler, it)
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        _losses(model, scaler, it)
        _poison(model, it.poison)
        for name in it.none_grads:
            params[name].grad = None
        _unscale_and_clip(scaler, optimizers, it)
        for index in it.order if it.order is not None else range(len(optimizers)):
            trace.returns.append(scaler.step(optimizers[index]))
        if it.new_scale is not None:
            value = torch.tensor(it.new_scale) if it.new_scale_as_tensor else it.new_scale
            scaler.update(value)
        elif script.own_update:
            torch_update(scaler)
        else:
            scaler.update()
        _record(trace, model, optimizers, scaler)
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=it.zero_to_none)
        if it.checkpoint:
            scaler = _round_trip(scaler, factory, script.scaler_kwargs, it.checkpoint)
        trace.scales.append(scaler.get_scale())
        trace.trackers.append(scaler._get_growth_tracker())
    return trace


def torch_update(scaler: Any, new_scale: float | None = None) -> None:
    """torch's ``update()``, as code of one's own copies it (NeMo's and Composer's scalers):
    through torch's private names only, it sets ``new_scale`` into the scale tensor, or reads
    the flags (refusing, as torch does, when none were recorded) and moves the scale, adding the
    flags in place into the first; then it ends the iteration by assigning
    ``_per_optimizer_states`` afresh."""
    if not scaler._enabled:
        return
    scale, tracker = scaler._check_scale_growth_tracker("update")
    if new_scale is not None:
        scale.fill_(new_scale)
    else:
        states = scaler._per_optimizer_states
        flags = [
            f.to(scale.device)
            for state in states.values()
            for f in state["found_inf_per_device"].values()
        ]
        if not flags:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = flags[0]
        for flag in flags[1:]:
            combined += flag
        rule = (scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval)
        torch._amp_update_scale_(scale, tracker, combined, *rule)
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def nan_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether ``a`` and ``b`` are equal element for element, NaN equal to NaN (and to nothing
    else: inf stays inf), dtype and shape included; ``None`` equals only ``None``."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
        return False
    if a.is_sparse:
        a, b = a.coalesce(), b.coalesce()
        return torch.equal(a.indices(), b.indices()) and nan_equal(a.values(), b.values())
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def first_difference(ours: Trace, theirs: Trace) -> str | None:
    """Where two traces first differ (``None``: nowhere): scales, trackers, step returns, and
    per iteration the parameters, the gradients after ``update()`` and the optimizers'
    state, bit for bit (NaN equal to NaN)."""
    for name in ("scales", "trackers", "returns"):
        if getattr(ours, name) != getattr(theirs, name):
            return f"{name}: {getattr(ours, name)} != {getattr(theirs, name)}"
    for name in ("params", "grads", "states"):
        mine, other = getattr(ours, name), getattr(theirs, name)
        if len(mine) != len(other):
            return f"{name}: {len(mine)} iterations != {len(other)}"
        for step, (a_step, b_step) in enumerate(zip(mine, other, strict=True)):
            if len(a_step) != len(b_step):
                return f"{name} at iteration {step}: {len(a_step)} tensors != {len(b_step)}"
            for index, (a, b) in enumerate(zip(a_step, b_step, strict=True)):
                if not nan_equal(a, b):
                    return f"{name} at iteration {step}, tensor {index}: {a} != {b}"
    return None


def assert_same_trace(ours: Trace, theirs: Trace) -> None:
    difference = first_difference(ours, theirs)
    assert difference is None, difference


def observed(
    scaler: Any, history: int = 0, probe_every: int | None = None, trace: bool = False
) -> Any:
    """``scaler`` with a :class:`~ampscaler.StepHistory` of ``history`` records, a
    :class:`~ampscaler.GradientProbe` every ``probe_every`` iterations and a
    :class:`~ampscaler.NonFiniteTracer` attached, as asked; returns it."""
    import ampscaler

    if history:
        scaler.add_sink(ampscaler.StepHistory(history))
    if probe_every is not None:
        scaler.attach(ampscaler.GradientProbe(every=probe_every))
    if trace:
        scaler.attach(ampscaler.NonFiniteTracer())
    return scaler
