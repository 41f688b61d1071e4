"""PyTorch Ignite's way of driving a GradScaler, re-created: ampscaler's against torch's.

Ignite (pytorch/ignite) is not a dependency here, so this file re-creates, in its own words,
what it does with a scaler, as read in ``ignite/engine/__init__.py`` and
``ignite/handlers/checkpoint.py`` (0.5.x); the sequences were also run once against the real
package, with the same results:

- ``create_supervised_trainer(..., amp_mode="amp", scaler=...)`` validates ``scaler``: a
  truthy one with another ``amp_mode`` is refused; ``scaler=True`` makes
  ``torch.amp.GradScaler(enabled=True)`` (device left at torch's default, ``"cuda"``) and
  keeps it as ``trainer.state.scaler``; an instance is used as given.
- ``supervised_training_step_amp``'s update function zeroes the gradients when
  ``(iteration - 1) % accumulation == 0``, divides the loss by the accumulation, and then
  branches on the scaler's truth value (``if scaler:``): ``scale(loss).backward()``, and on
  ``iteration % accumulation == 0`` ``step(optimizer)`` and ``update()``; a falsy scaler
  trains without scaling at all. So a scaler must be truthy, as torch's is.
- ``Checkpoint`` checks ``hasattr(obj, "state_dict")`` / ``"load_state_dict"``, saves
  ``{name: obj.state_dict()}`` with ``torch.save`` and ``load_objects`` reads the file with
  ``torch.load(path, weights_only=True)``; with a single object to load whose name is not a
  key of the checkpoint, the checkpoint itself is taken as that object's state dict.

Code that runs such a trainer on a machine without CUDA (tests, CI) silences torch's warning
about the disabled scaler by its text (``warnings.filterwarnings("ignore", message="torch.cuda.
amp.GradScaler is enabled, but CUDA is not available")``, common in public code), so under
``patch_torch`` ampscaler's warning must start with the same words.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
ITERATIONS = 12
ACCUMULATION = 2
OVERFLOW_AT = 4  # 1-based iteration whose target overflows the scaled float32 gradients
CHECKPOINT_EVERY = 3  # Events.ITERATION_COMPLETED(every=3): odd, with an accumulation of 2
TORCH_CPU_WARNING = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def check_scaler_argument(amp_mode: str | None, scaler: Any) -> Any:
    """Ignite's validation of ``scaler`` (module docstring): the scaler to train with, or
    ``None``."""
    if scaler:
        if amp_mode != "amp":
            raise ValueError(f"scaler argument is {scaler}, but amp_mode is {amp_mode}.")
        if isinstance(scaler, bool):
            scaler = torch.amp.GradScaler(enabled=True)
    return scaler if scaler and amp_mode == "amp" else None


def train_like_ignite(
    scaler: Any,
) -> tuple[list[float], list[torch.Tensor], list[float], list[dict[str, Any]]]:
    """Ignite's amp update function over ITERATIONS iterations with accumulation; returns the
    scale after each iteration, the parameters, the losses it reported and the scaler's state
    saved by a checkpoint handler every CHECKPOINT_EVERY iterations (odd: some in the middle
    of an accumulation, after a backward and before the step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    scales, losses, saved = [], [], []
    for iteration in range(1, ITERATIONS + 1):
        x, y = torch.randn(3, 4, generator=data), torch.randn(3, 1, generator=data)
        if iteration == OVERFLOW_AT:
            y = y * 1e36  # the scaled float32 gradients overflow: that step is skipped
        if (iteration - 1) % ACCUMULATION == 0:
            optimizer.zero_grad()
        model.train()
        with torch.autocast("cpu", dtype=torch.float16):
            y_pred = model(x)
            loss = torch.nn.functional.mse_loss(y_pred.float(), y) / ACCUMULATION
        if scaler:
            scaler.scale(loss).backward()
            if iteration % ACCUMULATION == 0:
                scaler.step(optimizer)
                scaler.update()
        else:
            loss.backward()
            if iteration % ACCUMULATION == 0:
                optimizer.step()
        losses.append((loss * ACCUMULATION).item())
        scales.append(scaler.get_scale() if scaler else 1.0)
        if iteration % CHECKPOINT_EVERY == 0:
            saved.append(scaler.state_dict())
    return scales, [p.detach().clone() for p in model.parameters()], losses, saved


def make(factory: Factory) -> Any:
    return check_scaler_argument("amp", factory("cpu", init_scale=2.0**14, growth_interval=3))


@pytest.mark.parametrize("patched", [False, True], ids=["direct", "patched"])
def test_ignites_amp_update_function_matches_torch(patched: bool) -> None:
    theirs = train_like_ignite(make(torch.amp.GradScaler))
    if patched:
        ampscaler.patch_torch()
    ours_scaler = make(torch.amp.GradScaler if patched else ampscaler.GradScaler)
    assert isinstance(ours_scaler, ampscaler.GradScaler) and bool(ours_scaler)
    ours = train_like_ignite(ours_scaler)
    assert ours[0] == theirs[0]
    assert theirs[0][OVERFLOW_AT - 1] < theirs[0][OVERFLOW_AT - 2]  # the overflow backed off
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1], strict=True))
    assert ours[2] == theirs[2]
    for our_state, their_state in zip(ours[3], theirs[3], strict=True):
        assert {key: our_state[key] for key in their_state} == their_state


def test_the_scaler_argument_is_validated_as_for_torchs() -> None:
    """A scaler with ``amp_mode`` other than ``"amp"`` is refused by its truth value, so
    ampscaler's must be truthy like torch's, also before its first ``scale()``."""
    scalers = (torch.amp.GradScaler("cpu"), ampscaler.GradScaler("cpu"), ampscaler.GradScaler())
    for scaler in scalers:
        with pytest.raises(ValueError, match="but amp_mode is apex"):
            check_scaler_argument("apex", scaler)
        assert check_scaler_argument("amp", scaler) is scaler
    assert check_scaler_argument(None, None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scaler=True path disables on CPU")
def test_scaler_true_without_cuda_warns_as_torch_so_its_filter_still_silences_it() -> None:
    """``scaler=True`` builds torch's scaler for ``"cuda"``; without CUDA it is disabled with
    torch's warning. Under ``patch_torch`` the scaler is ampscaler's, and the filter that
    silenced torch's warning by its text must silence it too (with warnings as errors, as in a
    test suite, the trainer could otherwise not even be built)."""

    def build() -> tuple[Any, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", category=FutureWarning)
            warnings.filterwarnings("ignore", message=TORCH_CPU_WARNING)
            scaler = check_scaler_argument("amp", True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            check_scaler_argument("amp", True)
        assert caught == []
        return scaler, [f"{w.category.__name__}: {w.message}" for w in seen]

    theirs, their_warnings = build()
    ampscaler.patch_torch()
    ours, our_warnings = build()
    assert isinstance(ours, ampscaler.GradScaler) and not isinstance(theirs, ampscaler.GradScaler)
    assert [s.is_enabled() for s in (ours, theirs)] == [False, False]
    assert [s.get_scale() for s in (ours, theirs)] == [1.0, 1.0]
    assert ours.state_dict() == theirs.state_dict() == {}
    assert len(our_warnings) == len(their_warnings) == 1
    assert our_warnings[0].startswith(f"UserWarning: {TORCH_CPU_WARNING}")
    # A disabled scaler is still truthy: the update function takes its scaling branch, where
    # scale() returns the loss as it is and step() steps unconditionally, as torch's does (the
    # overflowing iteration then writes NaN into the parameters of both).
    (our_scales, our_params, _, _), (their_scales, their_params, _, _) = (
        train_like_ignite(ours),
        train_like_ignite(theirs),
    )
    assert our_scales == their_scales == [1.0] * ITERATIONS
    for a, b in zip(our_params, their_params, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def checkpoint_round_trip(scaler: Any, fresh: Any, single: bool) -> None:
    """Ignite's Checkpoint: save ``{"scaler": state}`` (or the state alone, loaded as a single
    object), read back with ``weights_only=True`` and loaded into ``fresh``."""
    for obj, method in ((scaler, "state_dict"), (fresh, "load_state_dict")):
        assert hasattr(obj, method)
    buffer = io.BytesIO()
    torch.save(scaler.state_dict() if single else {"scaler": scaler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)
    fresh.load_state_dict(checkpoint.get("scaler", checkpoint))


@pytest.mark.parametrize("single", [False, True], ids=["named", "single-object"])
def test_ignites_checkpoint_round_trip_matches_torch_both_ways(single: bool) -> None:
    theirs, ours = make(torch.amp.GradScaler), make(ampscaler.GradScaler)
    train_like_ignite(theirs)
    train_like_ignite(ours)
    expected = theirs.state_dict()
    assert {key: ours.state_dict()[key] for key in expected} == expected
    for source in (theirs, ours):
        for factory in (torch.amp.GradScaler, ampscaler.GradScaler):
            fresh = factory("cpu")
            checkpoint_round_trip(source, fresh, single)
            assert (fresh.get_scale(), fresh._get_growth_tracker()) == (
                expected["scale"],
                expected["_growth_tracker"],
            )
            assert fresh.get_growth_interval() == 3
