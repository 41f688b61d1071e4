"""transformers' ``Trainer`` before Accelerate took over (4.20), re-created: ampscaler's scaler
against torch's.

The installed transformers is 5.x, whose Trainer hands the scaler to Accelerate
(``test_client_transformers.py``); this file re-creates, in its own words, what
``src/transformers/trainer.py`` of 4.20 did itself, as read in its source:

- with ``fp16=True`` and the ``"amp"`` backend, ``self.scaler = torch.cuda.amp.GradScaler()``
  (torch's deprecated name, default arguments; fairscale's ``ShardedGradScaler()`` for sharded
  DDP, torch's ``ShardedGradScaler()`` for FSDP in float16: see
  ``test_client_fairscale_pattern.py``);
- ``training_step``: the loss divided by ``gradient_accumulation_steps``, then
  ``self.scaler.scale(loss).backward()``;
- at the end of each accumulation: when ``max_grad_norm`` is set (and positive),
  ``self.scaler.unscale_(self.optimizer)`` and ``clip_grad_norm_(model.parameters(), ...)``;
  then ``scale_before = self.scaler.get_scale()``, ``self.scaler.step(self.optimizer)``,
  ``self.scaler.update()``, ``scale_after = self.scaler.get_scale()``, ``optimizer_was_run =
  scale_before <= scale_after``, the learning-rate schedule steps only if it ran, and
  ``model.zero_grad()``;
- ``_save_checkpoint`` writes ``optimizer.pt``, ``scheduler.pt`` and ``scaler.pt``
  (``torch.save(self.scaler.state_dict(), ...)``); a resume reads them back, the scaler with
  ``self.scaler.load_state_dict(torch.load(os.path.join(checkpoint, "scaler.pt")))`` when the
  file is there (``torch.load`` now defaults to ``weights_only=True``).

Why it matters: many pinned 4.x installs and forks of this Trainer still run this loop; its
schedule depends on the scale strictly dropping on a skipped step, and its checkpoints move
between runs with either scaler. ``torch.cuda.amp.GradScaler`` is deprecated in torch and
warns; under ``patch_torch()`` it must warn as torch's does, so that the filters programs set
for torch's warnings silence ampscaler's too.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ampscaler

STEPS, ACCUMULATE = 8, 2
INF_AT = {3, 8, 9}  # micro-batches whose gradients get an inf after backward


@pytest.fixture(autouse=True)
def unpatched(tmp_path: Path) -> Iterator[None]:
    (tmp_path / "torch").mkdir()  # torch's run's checkpoint; tmp_path holds ampscaler's
    yield
    ampscaler.unpatch_torch()


class Trainer:
    """The 4.20 Trainer's loop around its scaler (module docstring)."""

    def __init__(self, make_scaler: Callable[[], Any], optim: str, max_grad_norm: float) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(32, 8), torch.nn.Flatten(), torch.nn.Linear(32, 16),
            torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 32),
        )  # fmt: skip
        self.scaler = make_scaler()
        fused = {"adamw_torch_fused": {"fused": True}}.get(optim, {"foreach": False})
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=5e-3, **fused)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / 3) * max(0.0, 1 - step / 12)
        )
        self.max_grad_norm = max_grad_norm
        self.data = torch.Generator().manual_seed(1)
        self.micro = 0
        self.log: list[tuple[float, bool, float]] = []  # (scale, optimizer_was_run, lr)

    def training_step(self) -> None:
        tokens = torch.randint(0, 32, (4, 4), generator=self.data)
        labels = torch.randint(0, 32, (4,), generator=self.data)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels) / ACCUMULATE
        self.scaler.scale(loss).backward()
        if self.micro in INF_AT:
            self.model[2].weight.grad.view(-1)[self.micro] = float("inf")
        self.micro += 1

    def train(self, steps: int) -> None:
        for _ in range(steps * ACCUMULATE):
            self.training_step()
            if self.micro % ACCUMULATE:
                continue
            if self.max_grad_norm is not None and self.max_grad_norm > 0:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            scale_after = self.scaler.get_scale()
            optimizer_was_run = scale_before <= scale_after
            if optimizer_was_run:
                self.lr_scheduler.step()
            self.model.zero_grad()
            self.log.append((scale_after, optimizer_was_run, self.lr_scheduler.get_last_lr()[0]))

    def save_checkpoint(self, output_dir: Path) -> None:
        torch.save(self.model.state_dict(), output_dir / "pytorch_model.bin")
        torch.save(self.optimizer.state_dict(), output_dir / "optimizer.pt")
        torch.save(self.lr_scheduler.state_dict(), output_dir / "scheduler.pt")
        torch.save(self.scaler.state_dict(), output_dir / "scaler.pt")
        torch.save({"micro": self.micro, "data": self.data.get_state()}, output_dir / "rng.pt")

    def load_checkpoint(self, checkpoint: Path) -> None:
        self.model.load_state_dict(torch.load(checkpoint / "pytorch_model.bin"))
        self.optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt"))
        with warnings.catch_warnings(record=True):
            self.lr_scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt"))
        if os.path.isfile(checkpoint / "scaler.pt"):
            self.scaler.load_state_dict(torch.load(checkpoint / "scaler.pt"))
        state = torch.load(checkpoint / "rng.pt")
        self.micro = state["micro"]
        self.data.set_state(state["data"])


def run(
    make_scaler: Callable[[], Any],
    tmp_path: Path,
    resume_with: Callable[[], Any] | None = None,
    optim: str = "adamw_torch",
    max_grad_norm: float = 1.0,
) -> tuple[Trainer, list[tuple[float, bool, float]]]:
    """Train half the steps, checkpoint, resume in a new Trainer and train the rest."""
    first = Trainer(make_scaler, optim, max_grad_norm)
    first.train(STEPS // 2)
    first.save_checkpoint(tmp_path)
    second = Trainer(resume_with or make_scaler, optim, max_grad_norm)
    second.load_checkpoint(tmp_path)
    second.train(STEPS - STEPS // 2)
    return second, first.log + second.log


def assert_same(ours: tuple[Trainer, list[Any]], theirs: tuple[Trainer, list[Any]]) -> None:
    assert ours[1] == theirs[1]
    for a, b in zip(ours[0].model.parameters(), theirs[0].model.parameters(), strict=True):
        assert torch.equal(a, b)
    for key, state in theirs[0].optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(ours[0].optimizer.state_dict()["state"][key][name], value)


def torch_scaler() -> Any:
    return torch.amp.GradScaler("cpu", growth_interval=2)


def our_scaler() -> Any:
    return ampscaler.GradScaler("cpu", growth_interval=2)


def trainers_line() -> Any:
    return torch.cuda.amp.GradScaler(growth_interval=2)  # the Trainer's own line, on a GPU


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
@pytest.mark.parametrize("how", ["direct", "patched"])
def test_trainer_with_checkpoint_resume_matches_torch(tmp_path: Path, how: str, optim: str) -> None:
    theirs = run(torch_scaler, tmp_path / "torch", optim=optim)
    if how == "direct":
        ours = run(our_scaler, tmp_path, optim=optim)
    else:
        with ampscaler.patch_torch(device="cpu"), pytest.warns(FutureWarning, match="deprecated"):
            ours = run(trainers_line, tmp_path, optim=optim)
        assert isinstance(ours[0].scaler, ampscaler.GradScaler)
    assert_same(ours, theirs)
    was_run = [ran for _, ran, _ in theirs[1]]
    # the accumulations holding micro-batches 3, 8 and 9 (steps 1 and 4) were skipped and
    # held the schedule; the growths in between did not
    assert was_run == [True, False, True, True, False, True, True, True]
    assert theirs[1][3][0] > theirs[1][2][0]


@pytest.mark.parametrize("direction", ["torch-to-ours", "ours-to-torch"])
def test_scaler_pt_resumes_across_the_two_classes(tmp_path: Path, direction: str) -> None:
    theirs = run(torch_scaler, tmp_path / "torch")
    if direction == "torch-to-ours":
        ours = run(torch_scaler, tmp_path, resume_with=our_scaler)
    else:
        ours = run(our_scaler, tmp_path, resume_with=torch_scaler)
    assert_same(ours, theirs)


def test_without_max_grad_norm_no_unscale_and_the_same_training(tmp_path: Path) -> None:
    theirs = run(torch_scaler, tmp_path / "torch", max_grad_norm=0)
    ours = run(our_scaler, tmp_path, max_grad_norm=0)
    assert_same(ours, theirs)


def build_warnings(make: Callable[[], Any]) -> list[tuple[str, str, str, int]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]


def test_the_deprecated_name_warns_as_torchs_does() -> None:
    """``torch.cuda.amp.GradScaler()`` warns a ``FutureWarning`` at the line that calls it and,
    without CUDA, a ``UserWarning`` attributed to torch's ``torch/cuda/amp/grad_scaler.py``
    (whose ``__init__`` calls ``torch.amp.GradScaler.__init__``, which warns one level up).
    Under ``patch_torch()`` both come from the same places, with torch's words first."""

    def build() -> Any:
        return torch.cuda.amp.GradScaler()  # one line, for both: torch's warns at it

    theirs = build_warnings(build)
    with ampscaler.patch_torch():
        ours = build_warnings(build)
    assert [w[0] for w in ours] == [w[0] for w in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine[1].startswith(other[1])
        assert mine[2:] == other[2:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
@pytest.mark.parametrize("name", ["torch.cuda.amp", "torch.distributed.fsdp"])
def test_a_filter_by_torchs_module_silences_the_no_cuda_warning_as_torchs(name: str) -> None:
    """Programs silence torch's warnings by module (``warnings.filterwarnings("ignore",
    module="torch.cuda.amp.*")``): torch attributes its no-CUDA warning for the deprecated
    name, and for its sharded scaler, to its own modules, so the filter silences it."""
    from torch.distributed.fsdp import sharded_grad_scaler

    def build() -> Any:
        if name == "torch.cuda.amp":
            return torch.cuda.amp.GradScaler()
        return sharded_grad_scaler.ShardedGradScaler()

    def left(make: Callable[[], Any]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", category=UserWarning, module=f"{name}.*")
            make()
        return [f"{w.category.__name__}: {str(w.message)[:40]}" for w in caught]

    theirs = left(build)
    with ampscaler.patch_torch():
        ours = left(build)
    assert not any("CUDA is not available" in w for w in theirs)
    assert ours == theirs
