"""fairseq's ``--amp`` training, re-created: ampscaler's scaler against torch's, bit for bit.

fairseq is not installed here; this file re-creates, in its own words, what its
``AMPOptimizer`` (``fairseq/optim/amp_optimizer.py``), the ``FairseqOptimizer`` it wraps
(``fairseq/optim/fairseq_optimizer.py``, ``utils.clip_grad_norm_``) and its ``Trainer``
(``fairseq/trainer.py``, ``train_step``) do with the scaler:

- ``AMPOptimizer.__init__``: ``torch.cuda.amp.GradScaler(**amp_kwargs)`` built by name, with
  ``init_scale=cfg.common.fp16_init_scale`` (an ``int``, ``2**7``) and, when
  ``--amp-scale-window`` is given, ``growth_interval=cfg.common.amp_init_scale`` (sic: the
  init scale's number, another ``int``); the scaler's state is in no checkpoint (the
  trainer saves the inner optimizer's ``state_dict()`` only);
- ``backward(loss)``: ``scaler.scale(loss).backward()``, once per sample of an accumulation
  (``--update-freq``);
- the trainer then calls ``multiply_grads(1 / sample_size)`` on the still **scaled**
  gradients (a ``torch._foreach_mul_``), then ``clip_grad_norm(clip_norm)``:
  ``scaler.unscale_(self.optimizer)`` -- the **inner** ``torch.optim`` optimizer -- then
  fairseq's own clipping (a float32 norm, ``_foreach_mul_`` by ``(max_norm / (norm +
  1e-6)).clamp_(max=1)``, so an inf norm turns every gradient to 0 or NaN); a non-finite norm
  is compared, as ``get_scale() * get_backoff_factor()``, with ``--min-loss-scale``, and
  ``FloatingPointError("AMP: Minimum loss scale reached ...")`` stops the run there;
- ``step()``: ``scaler.step(self.fp32_optimizer)`` -- the **wrapper** (a ``FairseqOptimizer``,
  not a ``torch.optim.Optimizer``: ``param_groups`` and ``step(closure=None, scale=1.0,
  groups=None)``), a different ``id`` from the one unscaled, so torch's scaler unscales the
  same gradients a second time before stepping -- then ``scaler.update()``;
- on an overflow the trainer still steps (the scaler skips it and backs off), then runs the same
  batch again, up to ``--amp-batch-retries`` (2) times, and logs ``scaler.get_scale()``.

Why it matters: the scaler is told about one optimizer through two objects, so the bit-for-bit
result includes torch's double unscale; the run stops by reading ``get_scale()`` and
``get_backoff_factor()``; ``int`` settings and the deprecated name come in by the constructor.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]
MIN_LOSS_SCALE = 1e-4  # fairseq's default


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class FairseqOptimizer:
    """fairseq's wrapper of a ``torch.optim`` optimizer (the parts the scaler meets)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def params(self) -> Iterator[torch.Tensor]:
        return (p for group in self.param_groups for p in group["params"])

    def multiply_grads(self, c: float) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        torch._foreach_mul_(grads, c)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        grads = [p.grad.detach() for p in self.params if p.grad is not None]
        norm = torch.norm(torch.stack([torch.norm(g, p=2, dtype=torch.float32) for g in grads]))
        if max_norm > 0:
            torch._foreach_mul_(grads, (float(max_norm) / (norm + 1e-6)).clamp_(max=1))
        return norm

    def step(self, closure: Any = None, scale: float = 1.0, groups: Any = None) -> None:
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self.optimizer.step(closure)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()


class AMPOptimizer:
    """fairseq's ``AMPOptimizer`` over a scaler made by ``factory(**amp_kwargs)``."""

    def __init__(self, factory: Factory, fp32_optimizer: FairseqOptimizer, window: bool) -> None:
        self.fp32_optimizer = fp32_optimizer
        fp16_init_scale = amp_init_scale = 2**7
        amp_kwargs = {"init_scale": fp16_init_scale}
        if window:  # --amp-scale-window given: fairseq passes amp_init_scale (2**7) here;
            amp_kwargs["growth_interval"] = amp_init_scale // 64  # an int too, kept short
        self.scaler = factory(**amp_kwargs)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.fp32_optimizer.optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def multiply_grads(self, c: float) -> None:
        self.fp32_optimizer.multiply_grads(c)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)  # the inner optimizer
        grad_norm = self.fp32_optimizer.clip_grad_norm(max_norm)
        if not torch.isfinite(grad_norm).all():
            new_loss_scale = self.scaler.get_scale() * self.scaler.get_backoff_factor()
            if new_loss_scale <= MIN_LOSS_SCALE:
                raise FloatingPointError(
                    f"AMP: Minimum loss scale reached ({MIN_LOSS_SCALE}). Your loss is "
                    f"probably exploding. Try restarting training or use fp32. {new_loss_scale}"
                )
        return grad_norm

    def step(self) -> None:
        self.scaler.step(self.fp32_optimizer)  # the wrapper: another id than unscale_()'s
        self.scaler.update()

    def zero_grad(self) -> None:
        self.fp32_optimizer.zero_grad()


class Trainer:
    """fairseq's ``Trainer.train_step`` with ``--amp`` (the module docstring)."""

    def __init__(
        self, optimizer: AMPOptimizer, model: torch.nn.Module, poison: dict[int, float]
    ) -> None:
        self.optimizer, self.model, self.poison = optimizer, model, poison
        self.amp_retries, self.calls = 0, 0

    def train_step(
        self, samples: list[tuple[torch.Tensor, torch.Tensor]], clip_norm: float
    ) -> torch.Tensor | None:
        self.calls += 1
        self.optimizer.zero_grad()
        sample_size = 0
        for inputs, targets in samples:
            with torch.autocast("cpu", dtype=torch.float16):
                out = self.model(inputs)
            loss = ((out.float() - targets) ** 2).sum() * self.poison.get(self.calls, 1.0)
            self.optimizer.backward(loss)
            sample_size += len(inputs)
        self.optimizer.multiply_grads(1.0 / sample_size)
        grad_norm = self.optimizer.clip_grad_norm(clip_norm)
        overflow = not torch.isfinite(grad_norm).all()
        self.optimizer.step()
        if overflow:
            if self.amp_retries == 2:  # --amp-batch-retries
                self.amp_retries = 0
                return None
            self.amp_retries += 1
            return self.train_step(samples, clip_norm)
        return grad_norm


def amp_run(factory: Factory, clip_norm: float, window: bool = True, steps: int = 8) -> Trace:
    """``steps`` updates of two accumulated samples; inf and NaN losses: one retried once, one
    retried until fairseq gives the batch up."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
    optimizer = AMPOptimizer(factory, FairseqOptimizer(inner), window)
    poison = {3: float("inf"), 7: float("nan"), 8: float("inf"), 9: float("inf")}
    trainer = Trainer(optimizer, model, poison)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for _ in range(steps):
        samples = [(torch.randn(3, 4, generator=data), torch.randn(3, 2, generator=data))
                   for _ in range(2)]  # fmt: skip
        norm = trainer.train_step(samples, clip_norm)
        trace.returns.append((trainer.calls, None if norm is None else float(norm)))
        trace.params.append([p.detach().clone() for p in model.parameters()])
        trace.scales.append(optimizer.scaler.get_scale())
        trace.trackers.append(optimizer.scaler._get_growth_tracker())
    return trace


def patched(name: str) -> Factory:
    """A factory that builds ``torch.<name>.GradScaler`` while torch is patched."""

    def build(*args: Any, **kwargs: Any) -> Any:
        with ampscaler.patch_torch():
            return operator.attrgetter(f"{name}.GradScaler")(torch)(*args, **kwargs)

    return build


def on_cpu(factory: Factory) -> Factory:
    return lambda **kwargs: factory("cpu", **kwargs)


OURS = {
    "direct": on_cpu(ampscaler.GradScaler),
    "patch": on_cpu(patched("amp")),
}


@pytest.mark.parametrize("clip_norm", [0.0, 0.5], ids=["no clip", "clip"])
@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_amp_training_with_retries_and_the_double_unscale_is_torchs(
    ours: Factory, clip_norm: float
) -> None:
    theirs = amp_run(on_cpu(torch.amp.GradScaler), clip_norm)
    calls = [calls for calls, _ in theirs.returns]
    assert calls[:6] == [1, 2, 4, 5, 6, 8] and theirs.returns[5][1] is None  # retried, given up
    assert theirs.scales[:3] == [128.0, 256.0, 128.0]  # grown, backed off (and grown again)
    assert_same_trace(amp_run(ours, clip_norm), theirs)


def test_the_gradients_are_unscaled_twice_as_by_torchs() -> None:
    """The step's second unscale divides by the scale again: what the step applies is
    ``1/scale`` of the clipped gradient, with either scaler."""
    for factory in (torch.amp.GradScaler, ampscaler.GradScaler, patched("amp")):
        model = torch.nn.Linear(2, 1, bias=False)
        wrapper = FairseqOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
        optimizer = AMPOptimizer(on_cpu(factory), wrapper, window=False)
        optimizer.backward(model(torch.ones(1, 2)).sum())
        optimizer.clip_grad_norm(0.0)
        assert torch.equal(model.weight.grad, torch.ones(1, 2))
        before = model.weight.detach().clone()
        optimizer.step()
        assert torch.equal(before - model.weight.detach(), torch.full((1, 2), 2.0**-7))


@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_an_exploding_loss_stops_at_the_minimum_scale_as_with_torchs(ours: Factory) -> None:
    def explode(factory: Factory) -> tuple[int, str]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        inner = FairseqOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        trainer = Trainer(AMPOptimizer(factory, inner, window=False), model, {})
        trainer.poison = dict.fromkeys(range(1, 100), float("inf"))
        sample = [(torch.ones(2, 4), torch.zeros(2, 1))]
        with pytest.raises(FloatingPointError, match="Minimum loss scale reached") as raised:
            while True:
                trainer.train_step(sample, 0.0)
        return trainer.calls, str(raised.value)

    theirs = explode(on_cpu(torch.amp.GradScaler))
    assert theirs[0] == 21  # 2**7 halved 20 times: 2**-13 * 0.5 <= 1e-4
    assert explode(ours) == theirs


def test_the_deprecated_cuda_name_without_cuda_is_disabled_as_torchs() -> None:
    """On a machine without CUDA, ``torch.cuda.amp.GradScaler(init_scale=128)`` warns twice and
    disables itself; fairseq then trains unscaled, and an inf gradient norm asks the disabled
    scaler for its backoff factor, which it has not: ``AttributeError``, from either."""

    def built(factory: Factory) -> tuple[list[tuple[type, str]], type]:
        model = torch.nn.Linear(2, 1)
        inner = FairseqOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = AMPOptimizer(factory, inner, window=True)
        assert not optimizer.scaler.is_enabled() and optimizer.scaler.get_scale() == 1.0
        optimizer.backward(model(torch.ones(1, 2)).sum() * float("inf"))
        with pytest.raises(AttributeError) as raised:
            optimizer.clip_grad_norm(0.0)
        said = [(w.category, str(w.message).split(".  ")[0]) for w in caught]
        return said, raised.type

    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    theirs = built(lambda **kwargs: torch.cuda.amp.GradScaler(**kwargs))
    assert [category for category, _ in theirs[0]] == [FutureWarning, UserWarning]
    assert built(patched("cuda.amp")) == theirs
