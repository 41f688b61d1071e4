"""MosaicML Composer's trainer driving a scaler, re-created: ampscaler's against torch's, bit
for bit.

Composer is not installed here; this file re-creates, in its own words, what its trainer
(``composer/trainer/trainer.py``), its closure scaler (``composer/trainer/_scaler.py``), its
SAM optimizer (``composer/algorithms/sam/sam.py``) and its ``State`` checkpoint
(``composer/core/state.py``) do with the scaler:

- the plain path, ``precision="amp_fp16"``: ``GradScaler()`` built by name (device ``"cuda"``;
  on a machine without CUDA it disables itself, and Composer has already filtered the
  ``.*torch.cuda.amp.GradScaler.*`` warnings away), per batch ``zero_grad(set_to_none=True)``,
  per micro-batch ``scale(loss)``, then an **in-place** ``mul_(microbatch_size / batch_size)``
  on the scaled loss, then ``backward()``; after the last micro-batch ``unscale_()`` of every
  optimizer, then ``step()`` of each, then ``update()``;
- automatic micro-batching: a batch that runs out of memory part-way (after some scaled
  backwards) is dropped by ``zero_grad(set_to_none=True)`` of every optimizer and
  ``scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)``, and run again
  with half the micro-batch size;
- ``ClosureGradScaler``, a subclass of torch's scaler for closures (SAM): its ``step(optimizer,
  closure=...)`` hands the optimizer a closure that, before each forward-backward, writes
  ``self._per_optimizer_states[id(optimizer)]["stage"] = OptState.READY`` (so that the
  optimizer may be unscaled again) and sets every ``.grad`` to ``None``, runs the trainer's
  micro-batches (which end with ``unscale_()``), calls ``self._check_scale_growth_tracker``,
  and sums ``.item()`` of the flags in ``found_inf_per_device`` to return the loss or
  ``None``; its own ``update()`` (torch's, copied) adds the flags in place, moves ``_scale``
  and ``_growth_tracker`` with ``torch._amp_update_scale_`` and assigns
  ``_per_optimizer_states`` afresh;
- ``SAMOptimizer.step(closure)``: closure, climb to ``w + e(w)`` by the unscaled gradient,
  closure again, then back to ``w`` and the base optimizer's ``step()`` (never the scaler's);
  a closure that returned ``None`` (an overflow) stops it there;
- the checkpoint: ``State.state_dict()`` keeps the scaler as
  ``{type(scaler).__qualname__: scaler.state_dict()}``, and ``load_state_dict`` looks the
  scaler up by that same key, warning ``"... is not in the state_dict. Its state will not be
  restored."`` when it is missing.

Why it matters: the SAM step unscales one optimizer twice in one iteration by writing torch's
per-optimizer stage, and steps it outside the scaler; and a checkpoint keyed by the scaler's
class name must resume under the patch the run it was saved from.
"""

from __future__ import annotations

import io
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

import ampscaler
from twins import Trace, assert_same_trace, torch_update

Factory = Callable[..., Any]
BATCHES = 8
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def closure_scaler_class(base: type) -> type:
    """Composer's ``ClosureGradScaler`` over ``base`` (the module docstring)."""

    class ClosureGradScaler(base):  # type: ignore[misc, valid-type]
        def _force_scaler_ready(self, optimizer: torch.optim.Optimizer) -> None:
            entry = self._per_optimizer_states[id(optimizer)]
            entry["stage"] = OptState.READY

        def _empty_all_grads(self, optimizer: torch.optim.Optimizer) -> None:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad = None

        def _unscale_grads_and_continue(self, optimizer: torch.optim.Optimizer) -> bool:
            if not self._enabled:
                return True
            self._check_scale_growth_tracker("step")
            entry = self._per_optimizer_states[id(optimizer)]
            if entry["stage"] is OptState.STEPPED:
                raise RuntimeError("step() has already been called since the last update().")
            if entry["stage"] is OptState.READY:
                self.unscale_(optimizer)
            return not sum(flag.item() for flag in entry["found_inf_per_device"].values())

        def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            closure = kwargs["closure"]

            def amp_closure(**closure_kwargs: Any) -> Any:
                self._force_scaler_ready(optimizer)
                self._empty_all_grads(optimizer)
                loss = closure(**closure_kwargs)
                return loss if self._unscale_grads_and_continue(optimizer) else None

            return optimizer.step(closure=amp_closure)

        def update(self, new_scale: float | None = None) -> None:
            """torch's ``update()``, copied (``twins.torch_update``: the flags added in place,
            ``torch._amp_update_scale_``, ``_per_optimizer_states`` assigned afresh)."""
            if not self._enabled:
                return
            if new_scale is None:
                torch_update(self)
                return
            self._check_scale_growth_tracker("update")
            self._scale.fill_(new_scale)
            self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    return ClosureGradScaler


class SAMOptimizer(torch.optim.Optimizer):
    """Composer's SAM over a base optimizer (``interval`` 1: SAM on every step)."""

    def __init__(self, base: torch.optim.Optimizer, rho: float = 0.05) -> None:
        self.base_optimizer = base
        self._step_supports_amp_closure = True
        super().__init__(base.param_groups, {"rho": rho, "epsilon": 1.0e-12})

    def _with_grads(self) -> Iterator[torch.nn.Parameter]:
        return (p for g in self.param_groups for p in g["params"] if p.grad is not None)

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in self._with_grads()]), p="fro")
        for group in self.param_groups:
            ratio = group["rho"] / (norm + group["epsilon"])
            for p in group["params"]:
                if p.grad is not None:
                    e_w = p.grad * ratio.to(p)
                    p.add_(e_w)
                    self.state[p]["e_w"] = e_w

    @torch.no_grad()
    def back_to_w(self, with_grads_only: bool) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p] and (p.grad is not None or not with_grads_only):
                    p.sub_(self.state[p]["e_w"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        closure = torch.enable_grad()(closure)
        loss = closure(ddp_sync=False)
        if loss:
            self.first_step()
            if closure(loss_dict={}):
                self.back_to_w(with_grads_only=True)
                self.base_optimizer.step()
            else:
                self.back_to_w(with_grads_only=False)
        return loss


def model_and_data() -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    )
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data))]
    batches += [(torch.randn(8, 4, generator=data), torch.randn(8, 1, generator=data))
                for _ in range(BATCHES - 1)]  # fmt: skip
    return model, batches


class Trainer:
    """The parts of Composer's trainer that touch the scaler (the module docstring)."""

    def __init__(
        self,
        scaler: Any,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        poison: dict[tuple[int, int], float],
        oom_at: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        self.scaler, self.model, self.optimizers = scaler, model, optimizers
        self.poison, self.oom_at = poison, set(oom_at)
        self.microbatch_size, self.batch, self.calls = 4, 0, 0

    def train_microbatches(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(1)
        size = self.microbatch_size
        pieces = list(zip(inputs.split(size), targets.split(size), strict=True))
        for number, (x, y) in enumerate(pieces):
            if number == 1 and self.batch in self.oom_at:
                self.oom_at.discard(self.batch)
                raise RuntimeError(OOM)
            with torch.autocast("cpu", dtype=torch.float16):
                out = self.model(x)
            loss = torch.zeros(1)
            loss.add_(((out.float() - y) ** 2).mean())
            loss = loss * self.poison.get((self.batch, self.calls), 1.0)
            total += loss.detach() * (len(x) / len(inputs))
            scaled = self.scaler.scale(loss)
            scaled.mul_(len(x) / len(inputs))  # in place, on what scale() returned
            scaled.backward()
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        return total

    def train_batch(self, inputs: torch.Tensor, targets: torch.Tensor, closures: bool) -> Any:
        self.calls = 0
        while True:
            try:
                if closures:
                    result = [
                        self.scaler.step(
                            optimizer,
                            closure=lambda **kw: self.train_microbatches(inputs, targets),
                        )
                        for optimizer in self.optimizers
                    ]
                else:
                    self.train_microbatches(inputs, targets)
                    result = [self.scaler.step(optimizer) for optimizer in self.optimizers]
                return result
            except RuntimeError as error:
                if "out of memory" not in str(error):
                    raise
                for optimizer in self.optimizers:  # _clear_incomplete_train_states
                    optimizer.zero_grad(set_to_none=True)
                self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
                self.microbatch_size //= 2

    def fit(self, batches: list[tuple[torch.Tensor, torch.Tensor]], closures: bool) -> Trace:
        trace = Trace()
        for self.batch, (inputs, targets) in enumerate(batches):
            returned = self.train_batch(inputs, targets, closures)
            trace.returns.append([None if r is None else float(r) for r in returned])
            self.scaler.update()
            trace.params.append([p.detach().clone() for p in self.model.parameters()])
            trace.scales.append(self.scaler.get_scale())
            trace.trackers.append(self.scaler._get_growth_tracker())
        return trace


def plain_run(factory: Factory, oom_at: set[int] = frozenset()) -> Trace:  # type: ignore[assignment]
    """The plain path over two optimizers; an inf loss in batch 2, a NaN one in batch 5."""
    model, batches = model_and_data()
    optimizers = [
        torch.optim.SGD(model[:2].parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(model[2:].parameters(), lr=0.01),
    ]
    scaler = factory("cpu", growth_interval=2)
    poison = {(2, 1): float("inf"), (5, 1): float("nan")}
    return Trainer(scaler, model, optimizers, poison, oom_at).fit(batches, closures=False)


def sam_run(factory: Factory, oom_at: set[int] = frozenset()) -> Trace:  # type: ignore[assignment]
    """The SAM path; an inf in batch 2's first closure, in batch 5's second."""
    model, batches = model_and_data()
    optimizer = SAMOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scaler = factory("cpu", growth_interval=2)
    poison = {(2, 1): float("inf"), (5, 2): float("inf")}
    return Trainer(scaler, model, [optimizer], poison, oom_at).fit(batches, closures=True)


def patched_closure_factory(*args: Any, **kwargs: Any) -> Any:
    """Composer's class defined while torch is patched, over torch's name."""
    with ampscaler.patch_torch():
        return closure_scaler_class(torch.amp.grad_scaler.GradScaler)(*args, **kwargs)


def patched_factory(*args: Any, **kwargs: Any) -> Any:
    with ampscaler.patch_torch():
        return torch.amp.GradScaler(*args, **kwargs)


@pytest.mark.parametrize("oom_at", [set(), {3}], ids=["", "oom"])
@pytest.mark.parametrize("ours", [ampscaler.GradScaler, patched_factory], ids=["direct", "patch"])
def test_the_plain_path_with_micro_batches_trains_as_torchs(
    ours: Factory, oom_at: set[int]
) -> None:
    theirs = plain_run(torch.amp.GradScaler, oom_at)
    assert theirs.scales[2] < theirs.scales[1] and theirs.returns[2] == [None, None]
    assert theirs.scales[5] < theirs.scales[4]
    assert_same_trace(plain_run(ours, oom_at), theirs)


@pytest.mark.parametrize("oom_at", [set(), {4}], ids=["", "oom"])
@pytest.mark.parametrize(
    "ours",
    [closure_scaler_class(ampscaler.GradScaler), patched_closure_factory],
    ids=["direct", "patch"],
)
def test_the_sam_closure_scaler_trains_as_over_torchs(ours: Factory, oom_at: set[int]) -> None:
    theirs = sam_run(closure_scaler_class(torch.amp.GradScaler), oom_at)
    assert theirs.returns[2] == [None] and theirs.scales[2] < theirs.scales[1]
    assert theirs.returns[5] != [None] and theirs.scales[5] < theirs.scales[4]
    assert not torch.equal(theirs.params[4][0], theirs.params[3][0])  # a SAM step was taken
    assert_same_trace(sam_run(ours, oom_at), theirs)


def test_the_stage_set_back_to_ready_lets_unscale_run_again_before_step_only() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampscaler.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    scaler._per_optimizer_states[id(optimizer)]["stage"] = OptState.READY
    assert scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
    model.zero_grad(set_to_none=True)
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    scaler.unscale_(optimizer)
    assert torch.equal(model.bias.grad, torch.ones(1))
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="after scaler.step"):
        scaler._per_optimizer_states[id(optimizer)]["stage"] = OptState.READY
    with pytest.raises(TypeError, match="read-only"):
        scaler._per_optimizer_states[id(optimizer)]["stage"] = OptState.UNSCALED


def save(scaler: Any) -> dict[str, Any]:
    """Composer's ``State.state_dict()`` entry for the scaler, through bytes."""
    buffer = io.BytesIO()
    torch.save({"scaler": {type(scaler).__qualname__: scaler.state_dict()}}, buffer)
    buffer.seek(0)
    saved: dict[str, Any] = torch.load(buffer, weights_only=True)
    return saved


def load(scaler: Any, saved: dict[str, Any]) -> None:
    """Composer's ``State.load_state_dict()`` for the scaler."""
    serialized = saved["scaler"]
    if type(scaler).__qualname__ not in serialized:
        warnings.warn(
            f"{type(scaler).__qualname__} is not in the state_dict. Its state will not be "
            "restored.",
            UserWarning,
            stacklevel=2,
        )
        return
    scaler.load_state_dict(serialized[type(scaler).__qualname__])


def trained(scaler: Any, closures: bool = False) -> Any:
    """``scaler`` after a few batches (SAM's, with ``closures``) with an overflow: not at its
    start."""
    model, batches = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if closures:
        optimizer = SAMOptimizer(optimizer)
    Trainer(scaler, model, [optimizer], {(1, 1): float("inf")}).fit(batches[:4], closures)
    return scaler


@pytest.mark.parametrize("direction", ["torch to patched", "patched to torch", "patched"])
def test_a_checkpoint_keyed_by_the_class_name_resumes_across_the_patch(direction: str) -> None:
    reference = trained(torch.amp.GradScaler("cpu", growth_interval=3))
    source: Factory = torch.amp.GradScaler if direction == "torch to patched" else patched_factory
    target: Factory = torch.amp.GradScaler if direction == "patched to torch" else patched_factory
    saved = save(trained(source("cpu", growth_interval=3)))
    resumed = target("cpu", growth_interval=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Composer's "not in the state_dict" warning
        load(resumed, saved)
    assert resumed.get_scale() == reference.get_scale() != 2.0**16
    assert resumed._get_growth_tracker() == reference._get_growth_tracker()


def test_a_closure_scaler_checkpoint_resumes_across_the_patch() -> None:
    saved = save(trained(closure_scaler_class(torch.amp.GradScaler)("cpu"), closures=True))
    resumed = patched_closure_factory("cpu")
    load(resumed, saved)
    assert resumed.get_scale() == 2.0**15 and resumed.state_dict()["_growth_tracker"] == 2


def test_the_default_scaler_without_cuda_is_disabled_under_composers_filter() -> None:
    def build(factory: Callable[[], Any]) -> tuple[bool, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message=".*torch.cuda.amp.GradScaler.*")
            scaler = factory()
        return scaler.is_enabled(), [str(w.message) for w in caught]

    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    theirs = build(torch.amp.GradScaler), build(closure_scaler_class(torch.cuda.amp.GradScaler))
    assert theirs == ((False, []), (False, []))
    with ampscaler.patch_torch():
        ours = build(torch.amp.GradScaler), build(closure_scaler_class(torch.cuda.amp.GradScaler))
    assert ours == theirs
