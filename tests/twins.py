"""Twin training setups: the same model, data and scaler calls under two scaler classes.

A ``Script`` is a seeded random sequence of iterations (accumulation, injected inf/-inf/NaN,
clipping after ``unscale_``, manual ``new_scale``, checkpoint round trips). ``run_twin`` plays it
against one scaler class and returns a trace; two traces from the same script must be equal.
"""

from __future__ import annotations

import copy
import io
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

POISONS = (float("inf"), float("-inf"), float("nan"))


class TwinModel(torch.nn.Module):
    """Dense layers for one optimizer, a sparse embedding and a head for another."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8, sparse=True)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)
        )
        self.head = torch.nn.Linear(16, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens).mean(dim=1))).squeeze(-1)


@dataclass
class Iteration:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    poison: list[tuple[str, int, float]] = field(default_factory=list)  # (param, flat idx, value)
    clip: float | None = None
    second_loss: bool = False
    new_scale: float | None = None
    new_scale_as_tensor: bool = False
    checkpoint: bool = False
    loss_factor: float = 1.0


@dataclass
class Script:
    seed: int
    scaler_kwargs: dict[str, Any]
    fused: bool
    iterations: list[Iteration]


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


@dataclass
class Trace:
    params: list[list[torch.Tensor]] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    trackers: list[int] = field(default_factory=list)
    returns: list[Any] = field(default_factory=list)


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


def _round_trip(scaler: Any, factory: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    fresh = factory("cpu", **kwargs)
    fresh.load_state_dict(torch.load(buffer))
    return copy.deepcopy(fresh)


def run_twin(script: Script, factory: Callable[..., Any]) -> Trace:
    """Play ``script`` with scalers made by ``factory(device, **kwargs)``."""
    torch.manual_seed(script.seed)
    model = TwinModel()
    dense = [*model.embed.parameters(), *model.body.parameters()]
    opt_a = torch.optim.SGD(dense, lr=0.05, momentum=0.0)
    opt_b = torch.optim.Adam(model.head.parameters(), lr=0.01, fused=script.fused)
    scaler = factory("cpu", **script.scaler_kwargs)
    trace = Trace()
    for it in script.iterations:
        for tokens, target in it.micro_batches:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(tokens)
                loss = ((out.float() - target) ** 2).mean() * it.loss_factor
            if it.second_loss:
                penalty = out.float().abs().mean()
                scaled, scaled_penalty = scaler.scale([loss, penalty])
                (scaled + scaled_penalty).backward()
            else:
                scaler.scale(loss).backward()
        _poison(model, it.poison)
        if it.clip is not None:
            scaler.unscale_(opt_a)
            torch.nn.utils.clip_grad_norm_(model.body.parameters(), it.clip)
        trace.returns.append(scaler.step(opt_a))
        trace.returns.append(scaler.step(opt_b))
        if it.new_scale is not None:
            value = torch.tensor(it.new_scale) if it.new_scale_as_tensor else it.new_scale
            scaler.update(value)
        else:
            scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
        if it.checkpoint:
            scaler = _round_trip(scaler, factory, script.scaler_kwargs)
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.scales.append(scaler.get_scale())
        trace.trackers.append(scaler._get_growth_tracker())
    return trace


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


def assert_same_trace(ours: Trace, theirs: Trace) -> None:
    assert ours.scales == theirs.scales
    assert ours.trackers == theirs.trackers
    assert ours.returns == theirs.returns
    for step, (mine, other) in enumerate(zip(ours.params, theirs.params, strict=True)):
        for index, (a, b) in enumerate(zip(mine, other, strict=True)):
            assert nan_equal(a, b), f"step {step} param {index}"


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
