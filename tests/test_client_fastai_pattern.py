"""fastai's ``MixedPrecision`` callback, re-created: ampscaler's scaler against torch's.

fastai is not a dependency here (it needs torchvision, pandas, scikit-learn, ...), so this
file re-creates, in its own words, what it does with a scaler, as read in
``fastai/callback/fp16.py``, ``fastai/learner.py``, ``fastai/optimizer.py`` and fastcore's
``GetAttr`` (fastai 2.8):

- ``before_fit`` builds a new ``GradScaler(device, **kwargs)`` for every ``fit`` (with
  ``enabled=False`` for bfloat16), so ``fine_tune`` (a frozen fit, then an unfrozen one) starts
  its second fit from a fresh scaler;
- ``before_backward`` replaces the loss by ``scaler.scale(loss)``; the learner runs
  ``backward()``;
- ``before_step`` sets ``self.skipped = True`` and calls ``scaler.step(self)``: the callback
  itself stands in for the optimizer. It is no ``torch.optim.Optimizer``: a ``param_groups``
  property that returns the learner's optimizer's groups, and a ``step()`` that only sets
  ``skipped = False``. Still skipped afterwards, it raises ``CancelStepException`` and the
  learner does not step; otherwise it records ``scaler.get_scale()`` and the learner then runs
  its own optimizer's ``step()`` on the gradients the scaler unscaled in place;
- fastai's ``GradientClip`` callback, ordered after it, clips the gradients between
  ``scaler.step(cb)`` and the learner's step: it relies on ``step(cb)`` unscaling them in
  place;
- ``after_step`` (run whether the step was cancelled or not) calls ``scaler.update()``; the
  learner then zeroes the gradients;
- fastai's optimizer is not torch's either: its ``param_groups`` are built afresh on every
  access (``[{"params": L(params), **hypers}, ...]``), with fastcore's list-like ``L`` (not a
  ``list``) holding the parameters; frozen parameters have ``requires_grad=False`` and no
  gradient;
- the callback, like every fastai callback, delegates unknown attributes (single-underscore
  ones included) to the learner, which delegates them to the model, so ``getattr(cb, name,
  default)`` ends in the model's ``AttributeError``.

So the scaler must take any object with ``param_groups`` and ``step``, unscale the gradients
it lists, call its ``step()`` exactly when torch's would, and leave it unchanged otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
OVERFLOW_AT = {(0, 2), (1, 1), (1, 2)}  # (fit, batch) whose gradients get an inf / NaN


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class CancelStepException(Exception):
    pass


class Delegating:
    """fastcore's ``GetAttr``: names not found are looked up on ``self.<_default>`` (all but
    dunder names and the default's own name)."""

    _default = "default"

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and name != self._default:
            target = self.__dict__.get(self._default)
            if target is not None:
                return getattr(target, name)
        raise AttributeError(name)


class ListLike:
    """fastcore's ``L``: iterable, sized and indexable, but no ``list``."""

    def __init__(self, items: Any) -> None:
        self.items = list(items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


class FastaiStyleOptimizer:
    """fastai's ``Optimizer`` as the scaler sees it: groups rebuilt on every access; a momentum
    SGD written out, so that both runs do exactly the same arithmetic."""

    def __init__(self, splits: list[list[torch.nn.Parameter]], lr: float) -> None:
        self.param_lists = [ListLike(split) for split in splits]
        self.hypers = [{"lr": lr, "mom": 0.9, "wd": 0.01} for _ in splits]
        self.state: dict[torch.nn.Parameter, torch.Tensor] = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [{"params": ps, **hp} for ps, hp in zip(self.param_lists, self.hypers, strict=True)]

    def step(self) -> None:
        for params, hyper in zip(self.param_lists, self.hypers, strict=True):
            for p in params:
                if p.grad is None:
                    continue
                grad = p.grad + hyper["wd"] * p.detach()
                buf = self.state.setdefault(p, torch.zeros_like(p)).mul_(hyper["mom"]).add_(grad)
                p.data.add_(buf, alpha=-hyper["lr"])

    def zero_grad(self) -> None:
        for params in self.param_lists:
            for p in params:
                p.grad = None


class Learner(Delegating):
    _default = "model"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.opt = FastaiStyleOptimizer(
            [list(model[0].parameters()), list(model[2].parameters())], 0.05
        )


class MixedPrecisionCallback(Delegating):
    """fastai's ``MixedPrecision``, the parts that touch the scaler."""

    _default = "learn"

    def __init__(self, learn: Learner, factory: Factory, **kwargs: Any) -> None:
        self.learn, self.factory, self.kwargs = learn, factory, kwargs

    def before_fit(self) -> None:
        self.learn.scaler = self.factory("cpu", **self.kwargs)
        self.scales: list[float] = []

    def before_backward(self, loss: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.learn.scaler.scale(loss)
        return scaled

    def before_step(self) -> None:
        self.skipped = True
        self.learn.scaler.step(self)
        if self.skipped:
            raise CancelStepException()
        self.scales.append(self.learn.scaler.get_scale())

    def after_step(self) -> None:
        self.learn.scaler.update()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.opt.param_groups

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.skipped = False


def fine_tune_like_fastai(
    factory: Factory, batches: int = 5, **kwargs: Any
) -> tuple[list[list[bool]], list[list[float]], list[torch.Tensor], set[str]]:
    """Two fits (the body frozen, then unfrozen) as fastai's ``fine_tune`` runs them; returns
    per fit which steps were skipped and the scales recorded, the parameters, and the
    callback's attributes at the end."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    learn = Learner(model)
    cb = MixedPrecisionCallback(learn, factory, **kwargs)
    data = torch.Generator().manual_seed(1)
    skipped, scales = [], []
    for fit, frozen in enumerate((True, False)):
        for p in model[0].parameters():
            p.requires_grad_(not frozen)
        cb.before_fit()
        skipped.append([])
        for batch in range(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                pred = model(torch.randn(4, 6, generator=data))
            loss = torch.nn.functional.cross_entropy(
                pred.float(), torch.randint(0, 2, (4,), generator=data)
            )
            cb.before_backward(loss).backward()
            if (fit, batch) in OVERFLOW_AT:
                model[2].weight.grad.view(-1)[batch] = float("inf") if fit else float("nan")
            try:
                cb.before_step()
                # fastai's GradientClip (ordered after MixedPrecision) clips what step(cb)
                # left: the gradients it unscaled in place
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                learn.opt.step()
            except CancelStepException:
                pass
            cb.after_step()
            learn.opt.zero_grad()
            skipped[-1].append(cb.skipped)
        scales.append(cb.scales)
    params = [p.detach().clone() for p in model.parameters()]
    return skipped, scales, params, set(vars(cb))


@pytest.mark.parametrize("how", ["direct", "patched"])
def test_fastai_style_fine_tune_matches_torch(how: str) -> None:
    options = {"init_scale": 2.0**12, "growth_interval": 2}
    theirs = fine_tune_like_fastai(torch.amp.GradScaler, **options)
    if how == "patched":
        ampscaler.patch_torch()
        ours = fine_tune_like_fastai(lambda *a, **k: torch.amp.GradScaler(*a, **k), **options)
    else:
        ours = fine_tune_like_fastai(ampscaler.GradScaler, **options)
    assert ours[0] == theirs[0] == [[b == 2 for b in range(5)], [b in (1, 2) for b in range(5)]]
    assert ours[1] == theirs[1]
    assert theirs[1][1][0] == 2.0**12  # the second fit started from a fresh scaler
    assert all(torch.equal(a, b) for a, b in zip(ours[2], theirs[2], strict=True))
    assert ours[3] == theirs[3]  # the scaler wrote nothing onto the stand-in optimizer


def test_bfloat16_mode_builds_a_disabled_scaler_that_steps_every_batch_as_torchs() -> None:
    """``to_bf16()``: ``enabled=False``; ``step(cb)`` calls the stand-in's ``step()`` every
    time, so nothing is cancelled, whatever the gradients hold."""
    theirs = fine_tune_like_fastai(torch.amp.GradScaler, enabled=False)
    ours = fine_tune_like_fastai(ampscaler.GradScaler, enabled=False)
    assert ours[0] == theirs[0] == [[False] * 5, [False] * 5]
    assert ours[1] == theirs[1] == [[1.0] * 5, [1.0] * 5]
    for a, b in zip(ours[2], theirs[2], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def delegated_signature(target: Any) -> list[str]:
    """fastcore's ``@delegates(GradScaler)`` on ``Learner.to_fp16(self, **kwargs)``: the
    keyword parameters ``to_fp16`` shows (help, completion) are read from ``target``'s
    signature when fastai is imported."""
    return [
        name
        for name, p in inspect.signature(target).parameters.items()
        if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def test_to_fp16_delegates_to_torchs_signature_when_fastai_is_imported_under_the_patch() -> None:
    """Imported while ``patch_torch`` is in force (``AMPSCALER_PATCH`` at start-up), fastai
    reads the signature of the stand-in: it must be torch's, so ``to_fp16`` keeps listing
    ``init_scale``, ``growth_interval``, ... A class derived from a stand-in keeps its own."""
    from torch.distributed.fsdp import sharded_grad_scaler

    names = {
        "amp": (torch.amp, "GradScaler"),
        "cuda": (torch.cuda.amp, "GradScaler"),
        "cpu": (torch.cpu.amp, "GradScaler"),
        "sharded": (sharded_grad_scaler, "ShardedGradScaler"),
    }
    theirs = {key: inspect.signature(getattr(*where)) for key, where in names.items()}
    ampscaler.patch_torch()
    ours = {key: inspect.signature(getattr(*where)) for key, where in names.items()}
    assert ours == theirs
    assert "growth_interval" in delegated_signature(torch.amp.GradScaler)

    class FrameworkScaler(torch.amp.GradScaler):
        def __init__(self, device: str = "cpu", *, window: int = 8) -> None:
            super().__init__(device)
            self.window = window

    assert list(inspect.signature(FrameworkScaler).parameters) == ["device", "window"]
    assert FrameworkScaler(window=4).window == 4
