"""SpeechBrain's ``Brain`` driving a scaler, re-created: ampscaler's against torch's, bit for bit.

SpeechBrain is not installed here; this file re-creates, in its own words, what it does with a
scaler, as read in its source (``speechbrain/core.py``, ``speechbrain/utils/checkpoints.py``):

- ``Brain.__init__`` builds ``torch.GradScaler(self.device, enabled=...)``: the name torch
  exports at its top level (torch >= 2.4; ``torch.cuda.amp.GradScaler`` before), enabled for
  fp16 on CUDA only, disabled otherwise. An enabled scaler is registered with the checkpointer
  as the recoverable ``"scaler"``.
- The checkpointer's default hooks are a dict keyed by class (``torch.amp.grad_scaler
  .GradScaler``, read when its module is imported), found by walking ``type(obj).__mro__``;
  saving is ``torch.save(obj.state_dict(), path)``, recovering ``torch.load(path,
  map_location="cpu")`` (``weights_only`` by default) then ``obj.load_state_dict(state,
  strict=True)``, and again without ``strict`` when that raises ``TypeError``.
- ``fit_batch``: ``should_step`` every ``grad_accumulation_factor`` batches; the forward under
  autocast; ``scaler.scale(loss / factor)``, whose finiteness is counted (``nonfinite_count``),
  then ``backward()``; on ``should_step``, ``optimizers_step``: ``freeze_optimizers`` picks the
  optimizers of this step, each is unscaled and its ``param_groups[0]["params"]`` clipped;
  with the scaler disabled and ``skip_nonfinite_grads``, a non-finite gradient is set to
  ``None``; each is stepped, then one ``update()``, then each ``zero_grad(set_to_none=True)``.

Why it matters: under ``ampscaler.patch_torch()``, ``torch.GradScaler(...)`` must build
ampscaler's scaler as ``torch.amp.GradScaler(...)`` does, or SpeechBrain (and any code using the
top-level name) silently keeps torch's; and an optimizer that ``freeze_optimizers`` leaves out
keeps gradients from earlier iterations, scaled at other scales, that must not be touched.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ampscaler

Factory = Callable[..., Any]
STEPS = 12
ACCUMULATION = 2
NAN_LOSS_AT = 5  # this batch's loss is NaN: counted by check_loss_isfinite, its step skipped
INF_GRAD_AT = 8  # after this batch's backward a gradient element is inf: its step skipped
FROZEN_UNTIL = 4  # the encoder's optimizer is left out of the optimizer steps before this one


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    yield
    ampscaler.unpatch_torch()


class Brain:
    """The parts of SpeechBrain's ``Brain`` that touch the scaler (module docstring)."""

    def __init__(self, make_scaler: Factory, enabled: bool, skip_nonfinite_grads: bool) -> None:
        torch.manual_seed(0)
        self.encoder = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
        self.decoder = torch.nn.Linear(8, 3)
        self.optimizers_dict = {
            "encoder": torch.optim.SGD(self.encoder.parameters(), lr=0.05, momentum=0.9),
            "decoder": torch.optim.Adam(self.decoder.parameters(), lr=0.01),
        }
        self.scaler = make_scaler("cpu", enabled=enabled)
        self.skip_nonfinite_grads = skip_nonfinite_grads
        self.max_grad_norm = 5.0
        self.step = self.optimizer_step = self.nonfinite_count = 0

    def modules(self) -> list[torch.nn.Module]:
        return [self.encoder, self.decoder]

    def fit_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.step += 1
        should_step = self.step % ACCUMULATION == 0
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.decoder(self.encoder(inputs))
            loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        if self.step == NAN_LOSS_AT:
            loss = loss * float("nan")
        scaled = self.scaler.scale(loss / ACCUMULATION)
        if not torch.isfinite(scaled):
            self.nonfinite_count += 1
        scaled.backward()
        if self.step == INF_GRAD_AT:
            grad = self.decoder.weight.grad
            assert grad is not None
            grad[0, 0] = float("inf")
        if should_step:
            self.optimizers_step()

    def freeze_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        if self.step < FROZEN_UNTIL:
            return {"decoder": self.optimizers_dict["decoder"]}
        return self.optimizers_dict

    def optimizers_step(self) -> None:
        valid = self.freeze_optimizers()
        for optimizer in valid.values():
            self.scaler.unscale_(optimizer)
        for optimizer in valid.values():
            torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], self.max_grad_norm)
        if not self.scaler.is_enabled() and self.skip_nonfinite_grads:
            for module in self.modules():
                for param in module.parameters():
                    if param.grad is not None and not torch.isfinite(param.grad).all():
                        param.grad = None
        for optimizer in valid.values():
            self.scaler.step(optimizer)
        self.scaler.update()
        for optimizer in valid.values():
            optimizer.zero_grad(set_to_none=True)
        self.optimizer_step += 1


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 6, generator=data), torch.randint(0, 3, (5,), generator=data))
        for _ in range(STEPS)
    ]


Trace = dict[str, Any]


def fit(
    make_scaler: Factory,
    enabled: bool = True,
    skip_nonfinite_grads: bool = False,
    checkpoint_after: int | None = None,
    tmp_path: Path | None = None,
) -> Trace:
    """Train a Brain over the batches; with ``checkpoint_after``, the scaler goes through
    SpeechBrain's save and recover hooks into a new Brain's scaler after that batch (the model
    and optimizers carry on, as a recovered checkpoint would give them back)."""
    brain = Brain(make_scaler, enabled, skip_nonfinite_grads)
    scales, params = [], []
    for index, (inputs, targets) in enumerate(batches(), start=1):
        brain.fit_batch(inputs, targets)
        if index == checkpoint_after:
            assert tmp_path is not None
            brain.scaler = recovered(brain.scaler, make_scaler, tmp_path / "scaler.ckpt")
        scales.append(brain.scaler.get_scale())
        params.append([p.detach().clone() for m in brain.modules() for p in m.parameters()])
    grads = [p.grad for m in brain.modules() for p in m.parameters()]
    return {
        "scales": scales,
        "params": params,
        "grads": [None if g is None else g.clone() for g in grads],
        "nonfinite": brain.nonfinite_count,
        "optimizer_steps": brain.optimizer_step,
        "state": brain.scaler.state_dict(),
    }


def default_hooks() -> dict[type, Any]:
    """SpeechBrain's hook registry, made when its checkpoints module is imported: keyed by the
    class ``torch.amp.grad_scaler.GradScaler`` names at that moment. ampscaler's own class,
    not a subclass of torch's, is registered as a user registers a class of their own."""

    def torch_save(obj: Any, path: Path) -> None:
        torch.save(obj.state_dict(), path)

    def torch_recovery(obj: Any, path: Path) -> None:
        state = torch.load(path, map_location="cpu")
        try:
            obj.load_state_dict(state, strict=True)
        except TypeError:
            obj.load_state_dict(state)

    hooks = (torch_save, torch_recovery)
    return {torch.amp.grad_scaler.GradScaler: hooks, ampscaler.GradScaler: hooks}


def hook_class(scaler: object, hooks: dict[type, Any]) -> type:
    """The class SpeechBrain's ``get_default_hook`` finds ``scaler``'s hooks under: the first
    of ``type(scaler).__mro__`` in the registry."""
    return next(cls for cls in inspect.getmro(type(scaler)) if cls in hooks)


def recovered(scaler: Any, make_scaler: Factory, path: Path) -> Any:
    hooks = default_hooks()
    save, recover = hooks[hook_class(scaler, hooks)]
    save(scaler, path)
    fresh = make_scaler("cpu", enabled=True)
    recover(fresh, path)
    assert fresh.get_scale() == scaler.get_scale()
    assert fresh._get_growth_tracker() == scaler._get_growth_tracker()
    return fresh


def assert_same_fit(ours: Trace, theirs: Trace) -> None:
    assert ours["scales"] == theirs["scales"]
    for step, (a, b) in enumerate(zip(ours["params"], theirs["params"], strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), f"batch {step + 1}"
    for a, b in zip(ours["grads"], theirs["grads"], strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    assert ours["nonfinite"] == theirs["nonfinite"]
    assert ours["optimizer_steps"] == theirs["optimizer_steps"]
    torch_keys = theirs["state"].keys()
    assert {key: ours["state"][key] for key in torch_keys} == theirs["state"]


def top_level_name(*args: Any, **kwargs: Any) -> Any:
    """``torch.GradScaler(...)`` as SpeechBrain writes it, looked up at the call."""
    return torch.GradScaler(*args, **kwargs)


def test_brains_fit_with_a_frozen_optimizer_matches_torch() -> None:
    theirs = fit(torch.amp.GradScaler)
    ours = fit(ampscaler.GradScaler)
    assert_same_fit(ours, theirs)
    assert theirs["nonfinite"] == 1
    # the skipped steps backed the scale off, the clean ones grew nothing (interval 2000)
    assert theirs["scales"][NAN_LOSS_AT] < theirs["scales"][NAN_LOSS_AT - 2]
    assert theirs["scales"][INF_GRAD_AT] < theirs["scales"][INF_GRAD_AT - 2]


def test_under_patch_torch_the_top_level_name_builds_ampscalers_scaler_and_trains_alike() -> None:
    theirs = fit(top_level_name)
    ampscaler.patch_torch()
    scaler = torch.GradScaler("cpu")
    assert isinstance(scaler, ampscaler.GradScaler)
    assert isinstance(scaler, torch.amp.GradScaler) and isinstance(scaler, torch.GradScaler)
    assert_same_fit(fit(top_level_name), theirs)


def test_the_checkpointers_hooks_save_and_recover_the_scaler_mid_run(tmp_path: Path) -> None:
    """The scaler goes through SpeechBrain's save and recover hooks after batch 6 (an odd
    iteration count, after a skipped step): the run continues as it would have without."""
    theirs = fit(torch.amp.GradScaler)
    resumed_torch = fit(torch.amp.GradScaler, checkpoint_after=6, tmp_path=tmp_path)
    assert_same_fit(resumed_torch, theirs)
    assert_same_fit(fit(ampscaler.GradScaler, checkpoint_after=6, tmp_path=tmp_path), theirs)
    ampscaler.patch_torch()  # SpeechBrain imported after the patch: its registry has the name
    scaler, hooks = torch.GradScaler("cpu"), default_hooks()
    assert hook_class(scaler, hooks) is torch.amp.grad_scaler.GradScaler  # the stand-in
    patched = fit(top_level_name, checkpoint_after=6, tmp_path=tmp_path)
    assert_same_fit(patched, theirs)


def test_a_disabled_scaler_with_skip_nonfinite_grads_matches_torch() -> None:
    """SpeechBrain's default off CUDA: the scaler is disabled, non-finite gradients are set to
    None by the Brain itself, and ``step()`` is the optimizer's own."""
    theirs = fit(torch.amp.GradScaler, enabled=False, skip_nonfinite_grads=True)
    ours = fit(ampscaler.GradScaler, enabled=False, skip_nonfinite_grads=True)
    assert_same_fit(ours, theirs)
    assert theirs["state"] == ours["state"] == {}
    assert set(theirs["scales"]) == {1.0}
    ampscaler.patch_torch()
    assert_same_fit(fit(top_level_name, enabled=False, skip_nonfinite_grads=True), theirs)
