"""Lightning: skip-aware LR scheduling for a Trainer that scales with ampscaler.

Lightning takes the scaler as is; no adapter is needed::

    from lightning.pytorch.plugins import MixedPrecision
    scaler = ampscaler.GradScaler("cuda", hysteresis=2)
    trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cuda", scaler=scaler)])

Lightning's precision plugin calls ``scale``, ``unscale_`` (before gradient clipping, except
for optimizers that unscale inside their fused step), ``step`` and ``update``, and saves
``scaler.state_dict()`` in every checkpoint under the plugin's class name, so the whole policy
state and the counters come back on resume.

What Lightning does not do is notice a skipped step: it steps ``interval="step"`` LR schedulers
after every optimizer step, skipped or not, so the schedule runs ahead of the parameters by one
step per overflow. :class:`SkipAwareLRSchedulers` holds those scheduler steps back.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ModuleNotFoundError as error:
    if (error.name or "").split(".")[0] != "lightning":
        raise  # Lightning is there but something it imports is not: its own error says what
    raise ModuleNotFoundError(
        "ampscaler.integrations.lightning needs Lightning, which is not installed: "
        "pip install 'ampscaler[lightning]'.",
        name=error.name,
    ) from None

from ..errors import InvalidConfigError
from ..scaler import GradScaler

__all__ = ["SkipAwareLRSchedulers"]


def _scaler_of(trainer: pl.Trainer) -> GradScaler:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if not isinstance(scaler, GradScaler):
        raise InvalidConfigError(
            "SkipAwareLRSchedulers needs a Trainer that scales with ampscaler: pass "
            "plugins=[MixedPrecision('16-mixed', device, scaler=ampscaler.GradScaler(device))]; "
            f"this Trainer's precision plugin holds {type(scaler).__name__}."
        )
    return scaler


class SkipAwareLRSchedulers(Callback):
    """Hold back ``interval="step"`` LR scheduler steps after a step the scaler skipped.

    With it, a step-interval scheduler advances once per optimizer step that updated the
    parameters, as in a plain loop that checks :attr:`~ampscaler.GradScaler.last_step_skipped`.
    Epoch-interval schedulers are left alone: an epoch passes whether or not a step was
    skipped. A batch that made no optimizer step at all (``training_step`` returned ``None``)
    is not held back; Lightning's own rule applies to it.

    It works through the LightningModule's ``lr_scheduler_step`` hook, so a module that
    overrides that hook keeps its behaviour for the steps that are not held. The decision reads
    the scaler's counters once per batch that steps a scheduler (a host sync). Only automatic
    optimization steps schedulers through Lightning; with manual optimization, call
    ``scheduler.step()`` yourself when ``not self.trainer.scaler.last_step_skipped``.

    Example:
        >>> import ampscaler
        >>> from lightning.pytorch import Trainer
        >>> from lightning.pytorch.plugins import MixedPrecision
        >>> from ampscaler.integrations.lightning import SkipAwareLRSchedulers
        >>> trainer = Trainer(
        ...     accelerator="cpu",
        ...     plugins=[MixedPrecision("16-mixed", "cpu", scaler=ampscaler.GradScaler("cpu"))],
        ...     callbacks=[SkipAwareLRSchedulers()],
        ...     logger=False, enable_progress_bar=False, enable_model_summary=False,
        ... )

    Raises:
        InvalidConfigError: (a ``ValueError``) at the start of ``fit`` when the Trainer's
            precision plugin does not hold an :class:`ampscaler.GradScaler`.
    """

    def __init__(self) -> None:
        super().__init__()
        self._steps_seen = 0
        # Whether this batch's scheduler steps are held; decided at the first one of the batch.
        self._hold: bool | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        scaler = _scaler_of(trainer)
        inner = pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any) -> None:
            if _interval(trainer, scheduler) == "step" and self._held_back(scaler):
                return
            inner(scheduler, metric)

        pl_module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After a resume the scaler's counters come from the checkpoint: count from there.
        self._steps_seen = int(_scaler_of(trainer).metrics("")["steps"])

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._hold = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("lr_scheduler_step", None)

    def _held_back(self, scaler: GradScaler) -> bool:
        if self._hold is None:
            steps = int(scaler.metrics("")["steps"])
            self._hold = steps > self._steps_seen and scaler.last_step_skipped
            self._steps_seen = steps
        return self._hold


def _interval(trainer: pl.Trainer, scheduler: Any) -> str | None:
    for config in trainer.lr_scheduler_configs:
        if config.scheduler is scheduler:
            return config.interval
    return None
