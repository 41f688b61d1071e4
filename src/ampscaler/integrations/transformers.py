"""transformers: an ampscaler GradScaler in a Hugging Face ``Trainer``, on CUDA and on the CPU.

The ``Trainer`` leaves mixed precision to Accelerate. Its constructor builds
``trainer.accelerator`` from the ``TrainingArguments`` (``create_accelerator_and_postprocess``);
``train()`` prepares the model and the optimizer with it, and from then on the accelerator's
scaler (``accelerator.scaler``) scales the loss in ``accelerator.backward``, unscales before
clipping, steps and updates in the prepared optimizer, and is saved to and loaded from
``scaler.pt`` in every checkpoint. Between the constructor and ``train()`` nothing has been
prepared yet, so the scaler can still be replaced, which :func:`use_scaler_in_trainer` does
through :func:`ampscaler.integrations.accelerate.use_scaler`.

On a CPU ``TrainingArguments(fp16=True, use_cpu=True)`` is accepted but does nothing: Accelerate
makes no scaler and no autocast there, and the Trainer trains in float32 without a word. After
:func:`use_scaler_in_trainer` it trains under ``torch.autocast("cpu", torch.float16)`` with the
scaler, as it does on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError, ScalerUsageError
from ..scaler import GradScaler
from .accelerate import use_scaler

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["use_scaler_in_trainer"]


def use_scaler_in_trainer(trainer: Trainer, scaler: GradScaler | None = None) -> GradScaler:
    """Make a constructed ``Trainer`` scale its fp16 losses with an ampscaler
    :class:`~ampscaler.GradScaler`; call it before ``trainer.train()``.

    The scaler goes into the Trainer's accelerator (see
    :func:`ampscaler.integrations.accelerate.use_scaler`), so everything the Trainer does with
    a scaler goes through it: scaling in ``backward``, unscaling before gradient clipping (and
    before the gradient norm it logs), skipping steps whose gradients hold inf/NaN, and saving
    and loading ``scaler.pt`` with each checkpoint (the full state, counters included). The
    Trainer steps its LR scheduler only when ``accelerator.optimizer_step_was_skipped`` is false;
    with ampscaler's scaler this holds for fused optimizers (``optim="adamw_torch_fused"``) too,
    whose skips torch's scaler hides from Accelerate (accelerate#4242). On a CPU it also turns
    on fp16 autocast, which Accelerate leaves off there.

    Without ``scaler``, one with torch's defaults is built for the Trainer's device. A Trainer
    that makes a new accelerator later (``hyperparameter_search`` does, for every trial) gets
    the same scaler in it, reset to the state it had when this function was called, as each
    trial would get a fresh scaler from Accelerate.

    Example:
        >>> import tempfile, torch, ampscaler
        >>> from transformers import Trainer, TrainingArguments
        >>> from ampscaler.integrations.transformers import use_scaler_in_trainer
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.linear = torch.nn.Linear(4, 1)
        ...     def forward(self, x, labels):
        ...         return {"loss": torch.nn.functional.mse_loss(self.linear(x).float(), labels)}
        >>> data = [{"x": torch.ones(4), "labels": torch.zeros(1)}] * 8
        >>> args = TrainingArguments(tempfile.mkdtemp(), fp16=True, use_cpu=True, max_steps=2,
        ...                          report_to=[], save_strategy="no", disable_tqdm=True)
        >>> trainer = Trainer(model=Tiny(), args=args, train_dataset=data)
        >>> scaler = use_scaler_in_trainer(trainer, ampscaler.GradScaler("cpu"))
        >>> _ = trainer.train()  # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> scaler.metrics("")["steps"], trainer.accelerator.scaler is scaler
        (2, True)

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) built with
            ``TrainingArguments(fp16=True)`` whose ``train()`` has not started.
        scaler: the scaler to use; its device must be the Trainer's device type.

    Returns:
        The scaler, now in ``trainer.accelerator.scaler``.

    Raises:
        TypeError: ``trainer`` is not a ``transformers.Trainer``.
        InvalidConfigError: (a ``ValueError``) the arguments do not ask for fp16 (``fp16=True``),
            DeepSpeed or FSDP is configured (they scale, or shard, in their own way), or the
            scaler was built for another device type.
        ScalerUsageError: (a ``RuntimeError``) training has started, or a model or optimizer
            was already prepared with the Trainer's accelerator.
    """
    from transformers import Trainer

    if not isinstance(trainer, Trainer):
        raise TypeError(
            "use_scaler_in_trainer() takes a transformers.Trainer, got "
            f"{type(trainer).__name__}; for a bare accelerate.Accelerator use "
            "ampscaler.integrations.accelerate.use_scaler."
        )
    _check_arguments(trainer)
    scaler = use_scaler(trainer.accelerator, scaler)
    start = scaler.state_dict()
    create = trainer.create_accelerator_and_postprocess

    def create_with_scaler() -> None:
        create()
        scaler.load_state_dict(start)
        use_scaler(trainer.accelerator, scaler)

    trainer.create_accelerator_and_postprocess = create_with_scaler  # type: ignore[method-assign]
    return scaler


def _check_arguments(trainer: Any) -> None:
    """Refuse a Trainer whose arguments or progress the scaler cannot honour."""
    if not trainer.args.fp16:
        raise InvalidConfigError(
            "use_scaler_in_trainer() needs TrainingArguments(fp16=True); these arguments "
            f"have fp16={trainer.args.fp16!r}, bf16={trainer.args.bf16!r}. bf16 and float32 "
            "training need no loss scaling."
        )
    for enabled, name in (
        (trainer.is_deepspeed_enabled, "DeepSpeed (deepspeed=...), which scales inside its engine"),
        (
            trainer.is_fsdp_enabled,
            "FSDP (fsdp=...): Accelerate builds torch's FSDP scaler when the Trainer is built; "
            "call ampscaler.patch_torch() before building the Trainer to make it ampscaler's",
        ),
    ):
        if enabled:
            raise InvalidConfigError(
                f"use_scaler_in_trainer() does not support {name} (the migration guide maps "
                "DeepSpeed's fp16 options to ampscaler's)."
            )
    accelerator = trainer.accelerator
    if trainer.is_in_train or trainer.state.global_step > 0:
        raise ScalerUsageError(
            "use_scaler_in_trainer() was called after training started: the prepared "
            "optimizer keeps the scaler it was wrapped with. Call it between Trainer(...) "
            "and trainer.train()."
        )
    if accelerator._models or accelerator._optimizers:
        raise ScalerUsageError(
            "use_scaler_in_trainer() was called after the Trainer prepared a model or an "
            "optimizer (evaluate() and predict() prepare the model too): prepared models keep "
            "their autocast and optimizers their scaler. Call it right after Trainer(...)."
        )
