"""What training code does with torch's scaler beyond its public calls, re-created: ampscaler's
scaler (directly, and as torch's class under ``patch_torch()``) against torch's, bit for bit.

Found in public code by the private names it touches (``_per_optimizer_states``,
``found_inf_per_device``, ``_found_inf_per_device``); the patterns earlier rounds took (SAM's
``stage = STEPPED``, Composer's ``stage = READY``, ``_scale`` as a floor, assigned
``_unscale_grads_``, copied ``update()``s) have their own tests. Each test below names who
does what it re-creates:

- **flags changed in place between ``unscale_()`` and ``step()``**, outside any subclass: a
  loop that all-reduces ``scaler._found_inf_per_device(optimizer)``'s flags (``op=MAX``) so
  that every rank skips together, or writes an agreed flag back with ``fill_`` (training
  scripts with sharded parameters; Lightning 1.x's ``ShardedGradScaler`` did it in a
  ``step()`` override). ampscaler's ``unscale_()`` had read the flag already and ``step()``
  decided on that read: the step was taken while ``update()`` (reading the tensor) backed the
  scale off, and the ranks' parameters would part.
- **entries forgotten**: ``_per_optimizer_states.clear()`` or ``.pop(id(optimizer), None)``
  after ``unscale_()`` when a batch is given up (out of memory between ``unscale_()`` and
  ``step()``, an exception in the step, gradients moved aside for a second phase of
  micro-batches), so that the next ``unscale_()`` is not refused; hivemind's ``GradScaler``
  (learning-at-home/hivemind, ``hivemind/optim/grad_scaler.py``) puts
  ``_refresh_per_optimizer_state()`` back under each optimizer it stepped without an
  ``update()``; GPViT's AMP runner (ChenhongyiYang/GPViT, ``mmcls/gpvit_dev/amp/runner.py``)
  sets ``stage = READY`` and ``found_inf_per_device = {}`` and trains the batch in fp32
  instead. ampscaler's dict was a copy, so the clear and the pop were lost and the next
  ``scale()`` raised (gradients unscaled and not stepped), the reset entry was lost and the
  next ``step()`` raised "already been called", and GPViT's second write raised a
  ``TypeError``.

Found by searching public code; the scripts that clear or pop the dict could not be named
through the index (five files clear it, three pop an entry, none of them a library).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

import ampscaler
from test_client_sam_amp_pattern import scaled_backward as backward

Factory = Callable[..., Any]
HOW = ["direct", "patched"]


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


def twins(how: str, run: Callable[[Factory], Any]) -> tuple[Any, Any]:
    """``run`` over torch's scaler, then over ampscaler's (built as torch's class where
    ``how`` is ``"patched"``)."""
    theirs = run(torch.amp.GradScaler)
    if how == "patched":
        with ampscaler.patch_torch():
            return theirs, run(lambda *a, **k: torch.amp.GradScaler(*a, **k))
    return theirs, run(ampscaler.GradScaler)


def model_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def outcome(scaler: Any, model: torch.nn.Module, scales: list[float]) -> tuple[Any, ...]:
    buffer = io.BytesIO()
    torch.save(scaler.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    torch_keys = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
    params = [p.detach().clone() for p in model.parameters()]
    return scales, params, {key: saved[key] for key in torch_keys}


class Run:
    """One twin's run: the model, its SGD, the scaler ``factory`` builds, the scales seen."""

    def __init__(self, factory: Factory, growth_interval: int = 2) -> None:
        self.model, self.sgd = model_and_sgd()
        self.scaler = factory("cpu", init_scale=2.0**10, growth_interval=growth_interval)
        self.scales: list[float] = []

    def unscaled(self, batch: int, inf: bool = False) -> torch.Tensor:
        """Batch ``batch`` scaled, backward, unscaled and clipped: the gradients' norm."""
        self.sgd.zero_grad()
        backward(self.scaler, self.model, batch, inf)
        self.scaler.unscale_(self.sgd)
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def step(self) -> None:
        self.scaler.step(self.sgd)
        self.scaler.update()
        self.scales.append(self.scaler.get_scale())

    def outcome(self) -> tuple[Any, ...]:
        return outcome(self.scaler, self.model, self.scales)


def assert_same(theirs: tuple[Any, ...], ours: tuple[Any, ...]) -> None:
    assert ours[0] == theirs[0]
    for mine, other in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(mine, other)
    assert ours[2] == theirs[2]


# ---------------------------------------------------------------- flags changed in place


def _agree_by_all_reduce(scaler: Any, optimizer: torch.optim.Optimizer, other: bool) -> None:
    """``for v in scaler._found_inf_per_device(optimizer).values(): dist.all_reduce(v,
    op=MAX)``, with the value another rank's overflow brings (``other``)."""
    for flag in scaler._found_inf_per_device(optimizer).values():
        torch.maximum(flag, torch.tensor(float(other)), out=flag)


def _write_back_agreed(scaler: Any, optimizer: torch.optim.Optimizer, other: bool) -> None:
    """The agreed flag summed from the entry, reduced, and written back with ``fill_``."""
    entry = scaler._per_optimizer_states[id(optimizer)]
    mine = sum(v.item() for v in entry["found_inf_per_device"].values())
    agreed = max(mine, float(other))
    for device in entry["found_inf_per_device"]:
        entry["found_inf_per_device"][device].fill_(agreed)


@pytest.mark.parametrize("agree", [_agree_by_all_reduce, _write_back_agreed])
@pytest.mark.parametrize("how", HOW)
def test_flags_agreed_in_place_before_step_decide_the_step(
    agree: Callable[..., None], how: str
) -> None:
    """Batch 2 overflows here, batch 4 on "another rank" only: both are skipped."""

    def run(factory: Factory) -> tuple[Any, ...]:
        model, sgd = model_and_sgd()
        scaler = factory("cpu", init_scale=2.0**10, growth_interval=2)
        scales, skipped = [], []
        for batch in range(6):
            sgd.zero_grad()
            backward(scaler, model, batch, inf=batch == 2)
            scaler.unscale_(sgd)
            agree(scaler, sgd, other=batch == 4)
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(sgd)
            skipped.append(
                all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
            )
            scaler.update()
            scales.append(scaler.get_scale())
        assert skipped == [b in (2, 4) for b in range(6)]
        return outcome(scaler, model, scales)

    assert_same(*twins(how, run))


def test_a_step_override_reducing_the_flags_before_super_step_decides_as_torchs() -> None:
    """Lightning 1.x's ``ShardedGradScaler`` (``pytorch_lightning/overrides/pytorch.py``):
    ``step()`` all-reduces ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``
    in place, then ``super().step()``; with ``unscale_()`` called by hand before it (to clip),
    the reduced flags decide."""

    def subclass(base: type) -> type:
        class Reducing(base):  # type: ignore[valid-type, misc]
            calls = 0

            def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                other = float(self.calls == 3)  # another rank's overflow at batch 3
                for flag in self._per_optimizer_states[id(optimizer)][
                    "found_inf_per_device"
                ].values():
                    torch.maximum(flag, torch.tensor(other), out=flag)
                self.calls += 1
                return super().step(optimizer, *args, **kwargs)

        return Reducing

    def run(base: type) -> tuple[Any, ...]:
        model, sgd = model_and_sgd()
        scaler = subclass(base)("cpu", init_scale=2.0**10, growth_interval=2)
        scales = []
        for batch in range(5):
            sgd.zero_grad()
            backward(scaler, model, batch, False)
            scaler.unscale_(sgd)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(sgd)
            scaler.update()
            scales.append(scaler.get_scale())
        return outcome(scaler, model, scales)

    theirs = run(torch.amp.GradScaler)
    assert_same(theirs, run(ampscaler.GradScaler))
    assert theirs[0][3] < theirs[0][2]  # the other rank's overflow backed the scale off


# ---------------------------------------------------------------- entries forgotten


def _clear(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    if hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states.clear()


def _pop(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    scaler._per_optimizer_states.pop(id(optimizer), None)


def _delete(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    del scaler._per_optimizer_states[id(optimizer)]


@pytest.mark.parametrize("forget", [_clear, _pop, _delete])
@pytest.mark.parametrize("how", HOW)
def test_a_batch_given_up_after_unscale_is_forgotten_as_by_torchs(
    forget: Callable[..., None], how: str
) -> None:
    """Out of memory after ``unscale_()`` (and clipping), before ``step()``: the loop zeroes
    the gradients, forgets the entry, and goes on with the next batch, without ``update()``.
    Batch 2 is given up with an inf in its gradients (forgotten: no backoff), batch 4 clean;
    batch 5 overflows and is skipped as usual."""

    def run(factory: Factory) -> tuple[Any, ...]:
        twin = Run(factory)
        for batch in range(7):
            twin.unscaled(batch, inf=batch in (2, 5))
            if batch in (2, 4):  # "CUDA out of memory" here
                twin.sgd.zero_grad()
                forget(twin.scaler, twin.sgd)
                continue
            twin.step()
        return twin.outcome()

    theirs, ours = twins(how, run)
    assert_same(theirs, ours)
    assert theirs[0] == [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10]


@pytest.mark.parametrize("how", HOW)
def test_gradients_moved_aside_between_two_phases_of_micro_batches(how: str) -> None:
    """Two phases per optimizer step: the first phase's gradients are unscaled, clipped and
    taken off the parameters, its entry popped; the second phase is scaled, unscaled and
    clipped alike, the first phase's gradients added back, and one ``step()`` and
    ``update()`` follow (the second phase's check decides). Batch 3's second phase
    overflows."""

    def run(factory: Factory) -> tuple[Any, ...]:
        model, sgd = model_and_sgd()
        scaler = factory("cpu", init_scale=2.0**10, growth_interval=2)
        scales = []
        for batch in range(5):
            sgd.zero_grad()
            backward(scaler, model, 2 * batch, False)
            scaler.unscale_(sgd)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            aside = [p.grad for p in model.parameters()]
            for p in model.parameters():
                p.grad = None
            scaler._per_optimizer_states.pop(id(sgd), None)
            backward(scaler, model, 2 * batch + 1, inf=batch == 3)
            scaler.unscale_(sgd)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for p, grad in zip(model.parameters(), aside, strict=True):
                p.grad.add_(grad)
            scaler.step(sgd)
            scaler.update()
            scales.append(scaler.get_scale())
        return outcome(scaler, model, scales)

    theirs, ours = twins(how, run)
    assert_same(theirs, ours)
    assert theirs[0][3] < theirs[0][2]


@pytest.mark.parametrize("how", HOW)
def test_gpvit_gives_an_overflowing_batch_to_fp32(how: str) -> None:
    """GPViT's ``AutoAmpEpochBasedRunner``: unscale, clip; where the norm is inf/NaN the entry
    is set back (``stage = READY``, ``found_inf_per_device = {}``) and the batch is trained
    in fp32 by the optimizer itself, with no ``update()``: the scale stays."""

    def run(factory: Factory) -> tuple[Any, ...]:
        twin = Run(factory)
        for batch in range(6):
            norm = twin.unscaled(batch, inf=batch in (1, 4))
            if torch.isfinite(norm):
                twin.step()
                continue
            entry = twin.scaler._per_optimizer_states[id(twin.sgd)]
            entry["stage"] = OptState.READY
            entry["found_inf_per_device"] = {}
            twin.sgd.zero_grad()
            data = torch.Generator().manual_seed(batch)
            x, y = torch.randn(4, 4, generator=data), torch.randn(4, 2, generator=data)
            torch.nn.functional.mse_loss(twin.model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(twin.model.parameters(), 1.0)
            twin.sgd.step()
            twin.scales.append(twin.scaler.get_scale())
        return twin.outcome()

    theirs, ours = twins(how, run)
    assert_same(theirs, ours)
    assert theirs[0] == [2.0**10, 2.0**10, 2.0**11, 2.0**11, 2.0**11, 2.0**12]  # fp32: no update


def test_hivemind_resets_the_entries_of_steps_it_does_not_update_on() -> None:
    """hivemind's ``GradScaler.update()`` between global steps: the inf flags of every entry
    summed; with none (and no global step) no ``update()``, each stepped optimizer's entry set
    to ``_refresh_per_optimizer_state()`` instead, so that the next ``step()`` is taken. Every
    third batch is a global step; batch 4 overflows between them and is updated on (backoff)."""

    def update_like_hivemind(scaler: Any, stepped: list[int], global_step: bool) -> None:
        infs = sum(
            v.item()
            for state in scaler._per_optimizer_states.values()
            for v in state["found_inf_per_device"].values()
        )
        if global_step or infs:
            scaler.update()
        else:
            for key in stepped:
                scaler._per_optimizer_states[key] = _refresh_per_optimizer_state()

    def run(factory: Factory) -> tuple[Any, ...]:
        model, sgd = model_and_sgd()
        scaler = factory("cpu", init_scale=2.0**10, growth_interval=1)
        scales = []
        for batch in range(8):
            sgd.zero_grad()
            backward(scaler, model, batch, inf=batch == 4)
            scaler.step(sgd)
            update_like_hivemind(scaler, [id(sgd)], global_step=batch % 3 == 2)
            scales.append(scaler.get_scale())
        return outcome(scaler, model, scales)

    theirs = run(torch.amp.GradScaler)
    assert_same(theirs, run(ampscaler.GradScaler))
    assert theirs[0] == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0, 2048.0, 2048.0, 2048.0]


def test_a_stale_write_into_the_dict_is_refused_not_lost() -> None:
    """Anything but torch's fresh entry put into the dict would be a write into a copy."""
    model, sgd = model_and_sgd()
    scaler = ampscaler.GradScaler("cpu")
    backward(scaler, model, 0, False)
    scaler.unscale_(sgd)
    with pytest.raises(TypeError, match="fresh entry"):
        scaler._per_optimizer_states[id(sgd)] = {"stage": OptState.UNSCALED}
    assert scaler._per_optimizer_states[id(sgd)]["stage"] is OptState.UNSCALED
