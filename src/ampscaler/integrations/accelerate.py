"""Accelerate: put an ampscaler GradScaler into an ``accelerate.Accelerator``.

Accelerate builds ``torch.amp.GradScaler`` itself and offers no argument to pass another
scaler; ``GradScalerKwargs`` only forwards torch's five arguments. It reads the scaler from one
attribute, ``accelerator.scaler``, in ``backward`` (``scaler.scale(loss).backward()``), in
``clip_grad_norm_``/``unscale_gradients`` (``scaler.unscale_``), in ``save_state``/``load_state``
(``scaler.state_dict()`` to ``scaler.pt`` and back), and hands it to every optimizer that
``prepare`` wraps, whose ``step`` calls ``scaler.step`` and ``scaler.update``. Replacing that
attribute before ``prepare`` is therefore enough, and :func:`use_scaler` does that.

On CPU Accelerate accepts ``mixed_precision="fp16"`` but ignores it: it creates no scaler and no
autocast, and trains in float32. :func:`use_scaler` also turns on Accelerate's native-AMP switch
(``accelerator.native_amp``), which makes ``prepare`` run the model's forward under
``torch.autocast(device, torch.float16)`` and makes ``unscale_gradients`` unscale, as on CUDA.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError, ScalerUsageError
from ..scaler import GradScaler
from ..sharded import ShardedGradScaler

if TYPE_CHECKING:
    from accelerate import Accelerator

__all__ = ["use_scaler"]

# Backends for which Accelerate does not use a GradScaler of this kind, and why.
_UNSUPPORTED = {
    "DEEPSPEED": "DeepSpeed scales the loss inside its own engine",
    "MEGATRON_LM": "Megatron-LM scales the loss inside its own optimizer",
}


def use_scaler(accelerator: Accelerator, scaler: GradScaler | None = None) -> GradScaler:
    """Make ``accelerator`` scale fp16 losses with an ampscaler :class:`~ampscaler.GradScaler`.

    Call it right after constructing the ``Accelerator`` and before ``accelerator.prepare``:
    prepared optimizers keep the scaler they were wrapped with. Without ``scaler`` one is built
    for the accelerator's device from the ``GradScalerKwargs`` handler, if one was given.

    Everything Accelerate does with its scaler then goes through ampscaler's, including
    ``save_state``/``load_state`` (the full state, counters included) and
    ``AcceleratedScheduler``'s rule of not stepping after a skipped optimizer step. That rule
    reads ``optimizer.step_was_skipped``, which Accelerate computes by watching whether
    ``optimizer.step`` ran. Optimizers that skip inside their fused kernel (``fused=True``)
    always run it, so with torch's scaler Accelerate never sees their skips and the schedule
    advances anyway (accelerate#4242). Optimizers prepared after :func:`use_scaler` report them:
    after each step of a fused optimizer, ``step_was_skipped`` is the scaler's
    :attr:`~ampscaler.GradScaler.last_step_skipped` (reading it is one host sync per step).

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from ampscaler.integrations.accelerate import use_scaler
        >>> accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        >>> scaler = use_scaler(accelerator)
        >>> model = torch.nn.Linear(4, 1)
        >>> model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters()))
        >>> accelerator.backward(model(torch.ones(2, 4)).float().sum())
        >>> optimizer.step()
        >>> scaler.metrics("")["steps"]
        1

    With FSDP, Accelerate builds torch's ``ShardedGradScaler`` for FSDP1 (flat shards) and a
    plain ``GradScaler`` for FSDP2 (DTensor shards). Without ``scaler``, ``use_scaler`` builds
    their ampscaler counterparts: a :class:`~ampscaler.ShardedGradScaler` for FSDP1, and for
    FSDP2 a :class:`~ampscaler.GradScaler` whose ``process_group`` is the default group (the
    ranks agree on overflow as torch's DTensor check makes them, and the overflow report names
    the ranks). A scaler given for FSDP1 must be a :class:`~ampscaler.ShardedGradScaler`.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``.
        scaler: the scaler to use; its device must be the accelerator's device type.

    Returns:
        The scaler now in ``accelerator.scaler``.

    Raises:
        InvalidConfigError: (a ``ValueError``) mixed precision other than fp16, a DeepSpeed or
            Megatron-LM backend, a scaler for another device type, or for FSDP1 one that is
            not a :class:`~ampscaler.ShardedGradScaler`.
        ScalerUsageError: (a ``RuntimeError``) a model or optimizer was already prepared.
    """
    if accelerator.mixed_precision != "fp16":
        raise InvalidConfigError(
            f"use_scaler() needs Accelerator(mixed_precision='fp16'), got "
            f"mixed_precision={accelerator.mixed_precision!r}; bfloat16 and float32 training "
            "need no loss scaling."
        )
    backend = accelerator.distributed_type.name
    if backend in _UNSUPPORTED:
        raise InvalidConfigError(
            f"use_scaler() does not support Accelerate's {backend} backend: "
            f"{_UNSUPPORTED[backend]}. Keep that backend's own loss scaling (the migration "
            "guide maps DeepSpeed's and Megatron's options to ampscaler's)."
        )
    if accelerator._models or accelerator._optimizers:
        raise ScalerUsageError(
            "use_scaler() was called after accelerator.prepare(): prepared optimizers keep the "
            "scaler they were wrapped with and prepared models their autocast. Call "
            "use_scaler(accelerator) right after Accelerator(...)."
        )
    device = accelerator.device.type
    flat_shards = backend == "FSDP" and not accelerator.is_fsdp2
    if scaler is None:
        scaler = _scaler_for(accelerator, device, backend == "FSDP", flat_shards)
    elif flat_shards and not isinstance(scaler, ShardedGradScaler):
        raise InvalidConfigError(
            "Accelerate's FSDP backend (version 1) keeps each rank's flat shard of the "
            "gradients, as plain tensors, so the ranks must agree on overflow, where torch's "
            "ShardedGradScaler is used: pass ampscaler.ShardedGradScaler(...), or no scaler "
            "and use_scaler builds one."
        )
    elif scaler._device not in (None, device):
        raise InvalidConfigError(
            f"The scaler was built for {scaler._device!r} but the accelerator runs on "
            f"{device!r}; construct it as GradScaler({device!r}, ...)."
        )
    accelerator.scaler = scaler
    accelerator.native_amp = True
    prepare_optimizer = accelerator.prepare_optimizer

    def prepare_reporting_kernel_skips(optimizer: Any, device_placement: Any = None) -> Any:
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            _report_kernel_skips(prepared, scaler)
        return prepared

    accelerator.prepare_optimizer = prepare_reporting_kernel_skips
    return scaler


def _scaler_for(accelerator: Accelerator, device: str, fsdp: bool, flat_shards: bool) -> GradScaler:
    """The ampscaler counterpart of the scaler Accelerate builds for ``accelerator``, from its
    ``GradScalerKwargs`` handler (if any)."""
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    if flat_shards:  # FSDP1: torch's ShardedGradScaler
        return ShardedGradScaler(device, **kwargs)
    if fsdp:  # FSDP2: a plain GradScaler; the ranks agree over the default group
        import torch.distributed as dist

        return GradScaler(device, **kwargs, process_group=dist.group.WORLD)
    return GradScaler(device, **kwargs)


def _report_kernel_skips(prepared: Any, scaler: GradScaler) -> None:
    """Make an ``AcceleratedOptimizer`` of a fused optimizer report the skips its kernel makes
    (Accelerate infers ``step_was_skipped`` from whether ``optimizer.step`` ran, which a fused
    optimizer always does)."""
    step = prepared.step

    def step_and_report(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        if self.gradient_state.sync_gradients:  # a real step, not an accumulation one
            self._is_overflow = scaler.last_step_skipped
        return result

    # A bound method, as the one it replaces: an LR scheduler built after prepare (the
    # Trainer builds its own then) wraps ``optimizer.step`` through its ``__func__``.
    prepared.step = types.MethodType(step_and_report, prepared)
