"""ampscaler inside real Lightning (Trainer and Fabric): parity with torch, checkpoints, schedulers.

Each run trains a tiny model on CPU under fp16 autocast for a few steps. The data holds batches
of large inputs whose gradients overflow fp16, so every run skips, backs off and grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.plugins import MixedPrecision

import ampscaler
from ampscaler.integrations.lightning import SkipAwareLRSchedulers
from scaler_readings import counts

BATCHES = 4  # per epoch, batch size 2
BIG = (1, 2)  # batches whose inputs are scaled by 1e3: their fp16 gradients overflow


def loader(
    none_batch: int | None = None, big: tuple[int, ...] = BIG
) -> torch.utils.data.DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * 2, 4, generator=generator)
    y = torch.randn(BATCHES * 2, 1, generator=generator)
    for batch in big:
        x[batch * 2 : batch * 2 + 2] *= 1e3
    flags = torch.zeros(BATCHES * 2, dtype=torch.bool)
    if none_batch is not None:
        flags[none_batch * 2 : none_batch * 2 + 2] = True
    dataset = torch.utils.data.TensorDataset(x, y, flags)
    return torch.utils.data.DataLoader(dataset, batch_size=2)


class Tiny(pl.LightningModule):
    """Two linear layers; SGD or fused Adam; StepLR stepped every optimizer step."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
        )
        self.fused = fused
        self.scheduler: torch.optim.lr_scheduler.StepLR | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y, skip = batch
        if bool(skip.any()):
            return None
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        optimizer: torch.optim.Optimizer
        if self.fused:
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-2, fused=True)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"},
        }


@dataclass
class Run:
    module: Tiny
    scaler: Any
    trainer: pl.Trainer


def fit(
    tmp_path: Path,
    scaler: Any,
    *,
    epochs: int = 2,
    fused: bool = False,
    callbacks: list[pl.Callback] | None = None,
    ckpt_path: Path | None = None,
    none_batch: int | None = None,
    big: tuple[int, ...] = BIG,
    module: Tiny | None = None,
    **trainer_args: Any,
) -> Run:
    module = module or Tiny(fused=fused)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        max_epochs=epochs,
        callbacks=callbacks or [],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_args,
    )
    trainer.fit(module, loader(none_batch, big), ckpt_path=ckpt_path)
    return Run(module, scaler, trainer)


def scaler_args() -> dict[str, Any]:
    return {"init_scale": 2.0**14, "growth_interval": 2}


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    ("fused", "big", "epochs", "trainer_args"),
    [
        # Accumulating two batches: with one big batch per epoch, every other step skips.
        (False, (1,), 3, {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}),
        (True, BIG, 2, {}),
    ],
    ids=["sgd-clip-accumulate", "fused-adam"],
)
def test_trains_bit_for_bit_like_torch_scaler(
    tmp_path: Path,
    fused: bool,
    big: tuple[int, ...],
    epochs: int,
    trainer_args: dict[str, Any],
) -> None:
    args = {"init_scale": 2.0**14, "growth_interval": 1 if big != BIG else 2}
    ours, theirs = (
        fit(tmp_path, make("cpu", **args), fused=fused, big=big, epochs=epochs, **trainer_args)
        for make in (ampscaler.GradScaler, torch.amp.GradScaler)
    )
    assert_same_parameters(ours.module, theirs.module)
    assert ours.scaler.get_scale() == theirs.scaler.get_scale()
    assert ours.scaler._get_growth_tracker() == theirs.scaler._get_growth_tracker()
    stats = counts(ours.scaler)
    assert stats.skipped > 0 and stats.backoffs > 0 and stats.growths > 0
    # Lightning alone steps the scheduler after skipped steps too.
    assert ours.module.scheduler is not None
    assert ours.module.scheduler.last_epoch == stats.steps


class StateAtTrainStart(pl.Callback):
    """Records the scaler's state when training (re)starts, after any checkpoint was restored."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = trainer.scaler.state_dict()


def test_checkpoint_restores_policy_state_and_counters(tmp_path: Path) -> None:
    def scaler() -> ampscaler.GradScaler:
        return ampscaler.GradScaler(
            "cpu",
            init_scale=2.0**14,
            growth_interval=3,
            hysteresis=2,
            min_scale=2.0**10,
            max_consecutive_skips=50,
        )

    straight = fit(tmp_path / "a", scaler(), callbacks=[SkipAwareLRSchedulers()])

    first = fit(tmp_path / "b", scaler(), epochs=1, callbacks=[SkipAwareLRSchedulers()])
    checkpoint = tmp_path / "epoch1.ckpt"
    first.trainer.save_checkpoint(checkpoint)
    saved = first.scaler.state_dict()
    # The checkpoint holds state that differs from a fresh scaler's.
    assert saved["_hysteresis_tracker"] < saved["hysteresis"]
    assert saved["stats"]["skipped"] > 0 and saved["stats"]["backoffs"] > 0
    assert torch.load(checkpoint, weights_only=True)["MixedPrecision"] == saved

    recorder = StateAtTrainStart()
    # A scaler constructed with other settings: the checkpoint's replace them.
    resumed = fit(
        tmp_path / "b",
        ampscaler.GradScaler("cpu"),
        callbacks=[SkipAwareLRSchedulers(), recorder],
        ckpt_path=checkpoint,
    )
    assert recorder.state == saved
    assert resumed.scaler.state_dict() == straight.scaler.state_dict()
    assert resumed.scaler.metrics("")["steps"] == 2 * BATCHES
    assert_same_parameters(resumed.module, straight.module)
    assert resumed.module.scheduler is not None and straight.module.scheduler is not None
    assert resumed.module.scheduler.state_dict() == straight.module.scheduler.state_dict()


def test_torch_scaler_checkpoint_resumes_into_ampscaler(tmp_path: Path) -> None:
    first = fit(tmp_path, torch.amp.GradScaler("cpu", **scaler_args()), epochs=1)
    checkpoint = tmp_path / "torch.ckpt"
    first.trainer.save_checkpoint(checkpoint)
    recorder = StateAtTrainStart()
    fit(tmp_path, ampscaler.GradScaler("cpu"), callbacks=[recorder], ckpt_path=checkpoint)
    assert recorder.state is not None
    assert recorder.state["scale"] == first.scaler.get_scale()
    assert recorder.state["_growth_tracker"] == first.scaler._get_growth_tracker()
    assert recorder.state["growth_interval"] == scaler_args()["growth_interval"]


@pytest.mark.parametrize("none_batch", [None, 3], ids=["every-batch-steps", "batch-3-no-step"])
def test_skip_aware_schedulers_hold_only_after_skipped_steps(
    tmp_path: Path, none_batch: int | None
) -> None:
    run = fit(
        tmp_path,
        ampscaler.GradScaler("cpu", **scaler_args()),
        callbacks=[SkipAwareLRSchedulers()],
        none_batch=none_batch,
    )
    stats = counts(run.scaler)
    assert stats.skipped > 0
    no_step_batches = 0 if none_batch is None else 2  # once per epoch; follows a skipped batch
    assert stats.steps == 2 * BATCHES - no_step_batches
    scheduler = run.module.scheduler
    assert scheduler is not None
    # One scheduler step per parameter update, plus Lightning's own for batches without a step.
    assert scheduler.last_epoch == stats.steps - stats.skipped + no_step_batches
    assert scheduler.get_last_lr() == pytest.approx([1e-2 * 0.9**scheduler.last_epoch])
    assert "lr_scheduler_step" not in run.module.__dict__  # the hook is put back after fit


def test_skip_aware_schedulers_refuse_torch_scaler(tmp_path: Path) -> None:
    with pytest.raises(ampscaler.InvalidConfigError, match=r"ampscaler\.GradScaler"):
        fit(
            tmp_path,
            torch.amp.GradScaler("cpu"),
            epochs=1,
            callbacks=[SkipAwareLRSchedulers()],
        )


def test_epoch_interval_schedulers_are_not_held(tmp_path: Path) -> None:
    class EpochTiny(Tiny):
        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            config["lr_scheduler"]["interval"] = "epoch"
            return config

    # The last batch of each epoch overflows, right before the epoch scheduler steps.
    run = fit(
        tmp_path,
        ampscaler.GradScaler("cpu", **scaler_args()),
        callbacks=[SkipAwareLRSchedulers()],
        big=(BATCHES - 1,),
        module=EpochTiny(),
    )
    assert run.scaler.metrics("")["skips"] >= 2
    assert run.module.scheduler is not None and run.module.scheduler.last_epoch == 2


def fabric_run(scaler: Any, checkpoint: Path) -> torch.nn.Module:
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler)]
    )
    model, optimizer = fabric.setup(*_model_and_sgd())
    generator = torch.Generator().manual_seed(0)
    for i in range(6):
        x = torch.randn(2, 4, generator=generator) * (1e3 if i in BIG else 1.0)
        y = torch.randn(2, 1, generator=generator)
        optimizer.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        # Overflowing steps have a non-finite norm; the scaler skips them.
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer, "scaler": scaler})
    return model


def _model_and_sgd() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    module = Tiny()
    return module.net, torch.optim.SGD(module.net.parameters(), lr=1e-2)


def test_fabric_trains_like_torch_scaler_and_saves_the_scaler(tmp_path: Path) -> None:
    scaler = ampscaler.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
    ours = fabric_run(scaler, tmp_path / "ours.ckpt")
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=2)
    theirs = fabric_run(torch_scaler, tmp_path / "torch.ckpt")
    assert_same_parameters(ours, theirs)
    assert scaler.get_scale() == torch_scaler.get_scale()
    assert scaler.metrics("")["skips"] == len(BIG) and scaler.metrics("")["growths"] > 0

    restored = ampscaler.GradScaler("cpu")
    Fabric(accelerator="cpu", devices=1).load(tmp_path / "ours.ckpt", {"scaler": restored})
    assert restored.state_dict() == scaler.state_dict()
