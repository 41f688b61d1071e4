"""MONAI's trainers with ``amp=True``, re-created: ampscaler's scaler against torch's, bit for
bit.

MONAI is not installed here; this file re-creates, in its own words, what its engines
(``monai/engines/trainer.py``, ``monai/engines/workflow.py``) and checkpoint handlers
(``monai/handlers/checkpoint_saver.py``, ``checkpoint_loader.py``, over Ignite's
``Checkpoint``) do with the scaler:

- ``Trainer.run()``: ``self.scaler = torch.cuda.amp.GradScaler() if self.amp else None``, a
  **new** scaler at every ``run()`` (a second ``run()`` continues the epochs from where the
  first stopped, the scale from ``2**16``); on a machine without CUDA it disables itself;
- ``SupervisedTrainer._iteration``: ``optimizer.zero_grad(set_to_none=optim_set_to_none)``
  (``False`` by default: zeros), the forward and ``loss_function(...).mean()`` under
  ``torch.autocast``, ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
  ``scaler.update()``;
- ``GanTrainer``'s successor ``AdversarialTrainer``: two scalers made in ``__init__``,
  ``state.g_scaler`` and ``state.d_scaler``; the generator's loss goes through the
  discriminator (its backward writes gradients at the generator's scale into the
  discriminator's ``.grad``), the generator's scaler steps the generator's optimizer only,
  then ``d_network.zero_grad(set_to_none=...)`` and the discriminator's own scaled backward,
  ``step``, ``update``;
- the checkpoint: ``AdversarialTrainer`` adds ``"g_scaler"`` and ``"d_scaler"`` to Ignite's
  ``_state_dict_user_keys``, so the trainer's ``state_dict()`` holds the scaler **objects**;
  ``CheckpointSaver`` pickles them with ``torch.save`` after an iteration, and
  ``CheckpointLoader`` reads the file with ``torch.load(..., weights_only=False)`` and sets
  them back on the trainer's state. (``SupervisedTrainer`` checkpoints no scaler.)

Why it matters: scaler objects pickled inside a checkpoint must load back and train on as
torch's do, across the patch too; and an overflow in the generator's loss, which also reaches
the discriminator's gradients, must skip the generator's step only.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ampscaler
from twins import Trace, assert_same_trace

Factory = Callable[..., Any]


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def patched(*args: Any, **kwargs: Any) -> Any:
    with ampscaler.patch_torch():
        return torch.amp.GradScaler(*args, **kwargs)


OURS = {"direct": ampscaler.GradScaler, "patch": patched}


def supervised_runs(factory: Factory, set_to_none: bool) -> Trace:
    """Two ``run()``s of 5 iterations, each with a new scaler; an inf loss in the first run's
    iteration 1, a NaN in the second run's iteration 3."""
    torch.manual_seed(0)
    network = torch.nn.Sequential(
        torch.nn.Conv1d(1, 4, 3), torch.nn.ReLU(), torch.nn.Conv1d(4, 1, 3)
    )
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    trace = Trace()
    for run in range(2):
        scaler = factory("cpu", growth_interval=2)  # Trainer.run(): a new one each time
        for iteration in range(5):
            inputs, labels = (
                torch.randn(2, 1, 12, generator=data),
                torch.randn(2, 1, 8, generator=data),
            )
            optimizer.zero_grad(set_to_none=set_to_none)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.l1_loss(network(inputs).float(), labels).mean()
            if (run, iteration) in ((0, 1), (1, 3)):
                loss = loss * (float("inf") if run == 0 else float("nan"))
            scaler.scale(loss).backward()
            trace.returns.append(scaler.step(optimizer))
            scaler.update()
            trace.params.append([p.detach().clone() for p in network.parameters()])
            trace.scales.append(scaler.get_scale())
            trace.trackers.append(scaler._get_growth_tracker())
    return trace


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_supervised_trainer_runs_are_torchs(ours: Factory, set_to_none: bool) -> None:
    theirs = supervised_runs(torch.amp.GradScaler, set_to_none)
    assert theirs.scales[1] == 2.0**15 and theirs.scales[5] == 2.0**16  # run 2: a new scaler
    assert theirs.scales[8] < theirs.scales[7]
    assert_same_trace(supervised_runs(ours, set_to_none), theirs)


class AdversarialState:
    """The parts of ``AdversarialTrainer``'s state that a checkpoint carries."""

    def __init__(self, factory: Factory) -> None:
        torch.manual_seed(0)
        self.g_network = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6)
        )
        self.d_network = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.LeakyReLU(), torch.nn.Linear(8, 1)
        )
        self.g_optimizer = torch.optim.Adam(self.g_network.parameters(), lr=1e-3)
        self.d_optimizer = torch.optim.SGD(self.d_network.parameters(), lr=1e-2, momentum=0.9)
        self.g_scaler = factory("cpu", growth_interval=3)
        self.d_scaler = factory("cpu", growth_interval=3)

    def state_dict(self) -> dict[str, Any]:
        """Ignite's ``Engine.state_dict()`` with MONAI's user keys: the scalers themselves."""
        return {
            "g_network": self.g_network.state_dict(),
            "d_network": self.d_network.state_dict(),
            "g_optimizer": self.g_optimizer.state_dict(),
            "d_optimizer": self.d_optimizer.state_dict(),
            "g_scaler": self.g_scaler,
            "d_scaler": self.d_scaler,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for name in ("g_network", "d_network", "g_optimizer", "d_optimizer"):
            getattr(self, name).load_state_dict(saved[name])
        self.g_scaler, self.d_scaler = saved["g_scaler"], saved["d_scaler"]


def moved(before: list[torch.Tensor], network: torch.nn.Module) -> bool:
    """Whether ``network``'s parameters changed from ``before`` (its step was taken)."""
    return not all(torch.equal(a, p) for a, p in zip(before, network.parameters(), strict=True))


def adversarial_iteration(state: AdversarialState, reals: torch.Tensor, poison: str) -> list[bool]:
    """``AdversarialTrainer._iteration``; ``poison`` puts an inf into the generator's loss
    (``"g"``) or the discriminator's (``"d"``)."""
    noise = reals[:, :4]
    state.g_optimizer.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.float16):
        fakes = state.g_network(noise)
        fake_logits = state.d_network(fakes.float().contiguous())
        reconstruction = torch.nn.functional.mse_loss(fakes.float(), reals).mean()
        generator = torch.nn.functional.softplus(-fake_logits.float()).mean()
    loss = (reconstruction + generator) * (float("inf") if poison == "g" else 1.0)
    state.g_scaler.scale(loss).backward()
    before = [p.detach().clone() for p in state.g_network.parameters()]
    state.g_scaler.step(state.g_optimizer)
    stepped = [moved(before, state.g_network)]
    state.g_scaler.update()
    state.d_network.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.float16):
        real_logits = state.d_network(reals.contiguous().detach())
        fake_logits = state.d_network(fakes.contiguous().detach())
        d_loss = (
            torch.nn.functional.softplus(-real_logits.float())
            + torch.nn.functional.softplus(fake_logits.float())
        ).mean()
    state.d_scaler.scale(d_loss * (float("inf") if poison == "d" else 1.0)).backward()
    before = [p.detach().clone() for p in state.d_network.parameters()]
    state.d_scaler.step(state.d_optimizer)
    stepped.append(moved(before, state.d_network))
    state.d_scaler.update()
    return stepped


def saved_bytes(state: AdversarialState) -> io.BytesIO:
    """``CheckpointSaver``: the trainer's state dict, scaler objects and all, ``torch.save``d."""
    buffer = io.BytesIO()
    torch.save({"trainer": state.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


def adversarial_run(first: Factory, resumed: Factory | None = None) -> Trace:
    """8 iterations with scalers from ``first``; with ``resumed``, a checkpoint after
    iteration 3 loaded by ``CheckpointLoader`` (``torch.load(..., weights_only=False)``)
    into a fresh trainer, under the patch when ``resumed`` is ``patched``."""
    state = AdversarialState(first)
    data = torch.Generator().manual_seed(2)
    trace = Trace()
    for iteration in range(8):
        reals = torch.randn(4, 6, generator=data)
        poison = {1: "g", 5: "d", 6: "g"}.get(iteration, "")
        trace.returns.append(adversarial_iteration(state, reals, poison))
        networks = (state.g_network, state.d_network)
        trace.params.append([p.detach().clone() for n in networks for p in n.parameters()])
        scalers = (state.g_scaler, state.d_scaler)
        trace.scales.append(tuple(s.get_scale() for s in scalers))  # type: ignore[arg-type]
        trace.trackers.append(tuple(s._get_growth_tracker() for s in scalers))  # type: ignore[arg-type]
        if iteration == 3 and resumed is not None:
            buffer = saved_bytes(state)
            patch = ampscaler.patch_torch() if resumed is patched else contextlib.nullcontext()
            with patch:
                saved = torch.load(buffer, weights_only=False)["trainer"]
                state = AdversarialState(resumed)
                state.load_state_dict(saved)
    return trace


@pytest.mark.parametrize("ours", OURS.values(), ids=OURS.keys())
def test_adversarial_training_with_pickled_scalers_in_the_checkpoint_is_torchs(
    ours: Factory,
) -> None:
    theirs = adversarial_run(torch.amp.GradScaler)
    assert theirs.returns[1] == [False, True] and theirs.returns[0] == [True, True]  # g skipped
    assert theirs.scales[1] == (2.0**15, 2.0**16) and theirs.scales[5] == (2.0**16, 2.0**15)
    assert_same_trace(adversarial_run(torch.amp.GradScaler, torch.amp.GradScaler), theirs)
    assert_same_trace(adversarial_run(ours), theirs)
    assert_same_trace(adversarial_run(ours, ours), theirs)


def test_torchs_pickled_scalers_resume_under_the_patch_and_back() -> None:
    buffer = saved_bytes(AdversarialState(torch.amp.GradScaler))
    with ampscaler.patch_torch():
        loaded = torch.load(buffer, weights_only=False)["trainer"]["g_scaler"]
    assert isinstance(loaded, ampscaler.GradScaler) and loaded.get_scale() == 2.0**16
    theirs = adversarial_run(torch.amp.GradScaler)
    assert_same_trace(adversarial_run(torch.amp.GradScaler, patched), theirs)
    ours = adversarial_run(patched, torch.amp.GradScaler)  # an ampscaler object, unpatched
    assert_same_trace(ours, theirs)


def test_the_scaler_each_run_builds_without_cuda_is_disabled_as_torchs() -> None:
    """``torch.cuda.amp.GradScaler()`` on a machine without CUDA: torch's deprecation and
    CUDA warnings, a disabled scaler, and MONAI's iteration runs through it unscaled."""

    def build() -> tuple[bool, list[type[Warning]], float]:
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = torch.cuda.amp.GradScaler()
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        return scaler.is_enabled(), [w.category for w in caught], float(model.bias.detach())

    if torch.cuda.is_available():
        pytest.skip("a machine without CUDA")
    theirs = build()
    assert theirs[:2] == (False, [FutureWarning, UserWarning])
    with ampscaler.patch_torch():
        assert build() == theirs
