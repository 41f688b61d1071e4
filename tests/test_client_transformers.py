"""transformers' Trainer with ``fp16=True`` on the CPU: ampscaler's scaler against torch's.

On a CPU Accelerate ignores fp16, so a Trainer built with ``TrainingArguments(fp16=True,
use_cpu=True)`` trains in float32. ``use_scaler_in_trainer`` puts ampscaler's scaler into the
Trainer's accelerator and turns fp16 autocast on. The torch arm puts ``torch.amp.GradScaler``
into the same place by hand (the scaler attribute and Accelerate's native-AMP switch, which is
what Accelerate itself sets up on CUDA), so both arms run the Trainer's own code around the
scaler. A tiny Llama (vocabulary 64, one layer) is built from a config: nothing is downloaded.
A large initial scale overflows the first steps and a growth interval of 2 grows it again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import ampscaler
from ampscaler.integrations.transformers import use_scaler_in_trainer

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

STEPS = 8
SCALER = {"init_scale": 2.0**20, "growth_interval": 2}
_tokens = torch.randint(0, 64, (4 * STEPS, 8), generator=torch.Generator().manual_seed(0))
DATA = [{"input_ids": row, "labels": row} for row in _tokens]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def make_trainer(out: Path, **overrides: Any) -> Trainer:
    arguments: dict[str, Any] = {
        "fp16": True, "use_cpu": True, "per_device_train_batch_size": 4, "max_steps": STEPS,
        "learning_rate": 1e-2, "lr_scheduler_type": "constant", "report_to": [],
        "logging_strategy": "no", "save_strategy": "no", "disable_tqdm": True, "seed": 0,
    }  # fmt: skip
    arguments.update(overrides)
    args = TrainingArguments(output_dir=str(out), **arguments)
    return Trainer(model=tiny_llama(), args=args, train_dataset=DATA)


class Recorder(TrainerCallback):
    """The scale after every optimizer step, and the dtype of the MLP's output in each forward."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.scales: list[float] = []
        self.dtypes: set[torch.dtype] = set()
        mlp = trainer.model.model.layers[0].mlp
        mlp.register_forward_hook(lambda module, args, out: self.dtypes.add(out.dtype))
        trainer.add_callback(self)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        scaler = self.trainer.accelerator.scaler
        if scaler is not None:
            self.scales.append(scaler.get_scale())


def put_torch_scaler(trainer: Trainer) -> torch.amp.GradScaler:
    """Torch's scaler in the place use_scaler_in_trainer puts ampscaler's."""
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    trainer.accelerator.scaler = scaler
    trainer.accelerator.native_amp = True
    return scaler


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_trainer_in_fp16_on_cpu_trains_as_with_torchs_scaler(tmp_path: Path, optim: str) -> None:
    theirs = make_trainer(tmp_path / "torch", optim=optim)
    put_torch_scaler(theirs)
    their_record = Recorder(theirs)
    theirs.train()

    ours = make_trainer(tmp_path / "ours", optim=optim)
    scaler = use_scaler_in_trainer(ours, ampscaler.GradScaler("cpu", **SCALER))
    our_record = Recorder(ours)
    ours.train()

    assert our_record.scales == their_record.scales
    assert all(torch.equal(a, b) for a, b in zip(params(ours), params(theirs), strict=True))
    assert (
        scaler.metrics("")["skips"] > 0 and scaler.metrics("")["growths"] > 0
    )  # both branches were taken
    assert our_record.dtypes == their_record.dtypes == {torch.float16}  # autocast was on
    assert not all(
        torch.equal(a, b) for a, b in zip(params(ours), tiny_llama().parameters(), strict=True)
    )


def test_without_the_helper_the_trainer_trains_in_float32(tmp_path: Path) -> None:
    """The limitation the helper removes: on a CPU fp16=True makes no scaler and no autocast."""
    trainer = make_trainer(tmp_path, max_steps=1)
    record = Recorder(trainer)
    trainer.train()
    assert trainer.accelerator.scaler is None and record.scales == []
    assert record.dtypes == {torch.float32}


def test_skipped_fused_steps_hold_the_trainers_lr_schedule(tmp_path: Path) -> None:
    """The Trainer steps its scheduler unless accelerator.optimizer_step_was_skipped. The
    default optimizer (torch >= 2.8) is fused AdamW, whose skips torch's scaler hides from
    Accelerate (accelerate#4242): its schedule runs ahead by one step per skip."""
    linear = {"optim": "adamw_torch_fused", "lr_scheduler_type": "linear"}
    ours = make_trainer(tmp_path / "ours", **linear)
    scaler = use_scaler_in_trainer(ours, ampscaler.GradScaler("cpu", **SCALER))
    ours.train()
    assert 0 < scaler.metrics("")["skips"] < STEPS
    assert ours.lr_scheduler.last_epoch == STEPS - scaler.metrics("")["skips"]

    theirs = make_trainer(tmp_path / "torch", **linear)
    put_torch_scaler(theirs)
    theirs.train()
    assert theirs.lr_scheduler.last_epoch == STEPS, "accelerate#4242 fixed? update the docs"


def test_resuming_from_a_trainer_checkpoint_continues_exactly(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": STEPS // 2}
    whole = make_trainer(tmp_path / "whole", **saving)
    whole_scaler = use_scaler_in_trainer(whole, ampscaler.GradScaler("cpu", hysteresis=2, **SCALER))
    whole.train()

    resumed = make_trainer(tmp_path / "resumed", **saving)
    resumed_scaler = use_scaler_in_trainer(
        resumed, ampscaler.GradScaler("cpu", hysteresis=2, **SCALER)
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{STEPS // 2}"))

    saved = torch.load(tmp_path / "whole" / f"checkpoint-{STEPS // 2}" / "scaler.pt")
    assert saved["hysteresis"] == 2 and saved["stats"]["steps"] == STEPS // 2
    assert resumed_scaler.state_dict() == whole_scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(whole), strict=True))


def test_a_new_accelerator_gets_the_scaler_as_it_was_given(tmp_path: Path) -> None:
    """hyperparameter_search makes a new accelerator for every trial; each gets the scaler,
    reset to its state when the helper was called, as Accelerate would give a fresh one."""
    trainer = make_trainer(tmp_path, max_steps=3)
    scaler = use_scaler_in_trainer(trainer, ampscaler.GradScaler("cpu", **SCALER))
    trainer.train()
    assert scaler.metrics("")["steps"] == 3 and scaler.get_scale() != SCALER["init_scale"]
    first = trainer.accelerator
    trainer.create_accelerator_and_postprocess()
    assert trainer.accelerator is not first and trainer.accelerator.scaler is scaler
    assert trainer.accelerator.native_amp
    assert scaler.get_scale() == SCALER["init_scale"] and scaler.metrics("")["steps"] == 0


def test_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="transformers.Trainer"):
        use_scaler_in_trainer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fp16=True.*bf16=True"):
        use_scaler_in_trainer(make_trainer(tmp_path, fp16=False, bf16=True))

    for flag, backend in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP")):
        # Neither can be built on one CPU process here (DeepSpeed is not installed, FSDP
        # needs a distributed launch); the check reads the Trainer's own flags.
        trainer = make_trainer(tmp_path)
        setattr(trainer, flag, True)
        with pytest.raises(ampscaler.InvalidConfigError, match=backend):
            use_scaler_in_trainer(trainer)

    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.train()
    with pytest.raises(ampscaler.ScalerUsageError, match="after training started"):
        use_scaler_in_trainer(trainer)

    trainer = make_trainer(tmp_path)
    trainer.evaluate(DATA[:4])
    with pytest.raises(RuntimeError, match="evaluate"):
        use_scaler_in_trainer(trainer)

    with pytest.warns(UserWarning, match="CUDA is not available"):
        cuda_scaler = ampscaler.GradScaler("cuda")
    with pytest.raises(ValueError, match="'cuda'"):
        use_scaler_in_trainer(make_trainer(tmp_path), cuda_scaler)
