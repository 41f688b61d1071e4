"""Megatron-core with ampscaler's loss scaling: :func:`patch_megatron` makes Megatron's own
optimizer factory build ampscaler's scaler; :func:`use_ampscaler` hands one to an optimizer
built already.

Megatron-core (Megatron-LM, NeMo, slime, verl's Megatron backend) keeps a scaler of its own: its
optimizer factory (``megatron.core.optimizer.get_megatron_optimizer``) builds a
``DynamicGradScaler`` from the :class:`OptimizerConfig` (``initial_loss_scale``,
``min_loss_scale``, ``loss_scale_window``, ``hysteresis``; factors 2 and 0.5), or a
``ConstantGradScaler`` for ``loss_scale``. Its optimizer scales the loss by
``grad_scaler.scale``, unscales by ``grad_scaler.inv_scale`` while it checks the gradients,
max-reduces the flag over its ranks, and tells the scaler ``update(found_inf)``; a skipped step
returns ``(False, None, None)``.

:func:`patch_megatron` replaces the two names the factory looks up when it runs
(``megatron.core.optimizer.DynamicGradScaler`` and ``ConstantGradScaler``) with builders of a
:class:`MegatronScaler`: Megatron's scaler interface over an ampscaler
:class:`~ampscaler.GradScaler` configured from the same numbers
(``ScalePolicy(growth_interval=loss_scale_window, hysteresis=hysteresis,
min_scale=min_loss_scale)``, or ``StaticPolicy()`` for a constant scale). Configured alike, it
moves the scale as Megatron's does, bit for bit; on top, it counts (``scaler.metrics()``,
``scaler.metrics()``), sends step records to sinks, watches for a collapse, and with
``max_consecutive_skips`` stops a run that skips at the minimum scale with
:class:`~ampscaler.PersistentOverflowError` on every rank (Megatron skips there silently).

Example (a sketch; Megatron runs on a GPU)::

    from ampscaler.integrations.megatron import patch_megatron

    patch_megatron(max_consecutive_skips=50)
    optimizer = get_megatron_optimizer(config, model_chunks)   # Megatron's own factory
    scaler = optimizer.chained_optimizers[0].grad_scaler.scaler  # the ampscaler GradScaler
    ...
    wandb.log(scaler.metrics(), step=iteration)

Checkpoints: ``optimizer.state_dict()["grad_scaler"]`` holds Megatron's three keys
(``scale``, ``growth_tracker``, ``hysteresis_tracker``: Megatron's own scaler loads it) and
ampscaler's state under ``"ampscaler"``; a checkpoint of Megatron's own scaler loads, keeping
the configured rule and its trackers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..policy import Policy, ScalePolicy, StaticPolicy
from ..scaler import GradScaler
from .engines import EnginePatch, EngineScaler, EngineSettings, NameSwap, accelerator_device

__all__ = [
    "MegatronScaler",
    "constant_scaler",
    "dynamic_scaler",
    "patch_megatron",
    "unpatch_megatron",
    "use_ampscaler",
]


class MegatronScaler:
    """Megatron-core's scaler interface (``scale``, ``inv_scale``, ``update(found_inf)``,
    ``state_dict()``, ``load_state_dict()``) over an ampscaler
    :class:`~ampscaler.GradScaler`, on any device.

    Args:
        scaler: the ampscaler scaler that holds the scale and moves it.
        device: where the scale lives (the device of the loss); default: the current
            accelerator's current device, or the CPU.
        shared_by: how many of a ``ChainedOptimizer``'s optimizers call :meth:`update` each
            step (:func:`use_ampscaler` sets it): the scaler moves once per step, after the last
            of them, by whether any overflowed, so all of them unscale by the one scale the loss
            was scaled by.

    Attributes:
        scaler: the :class:`~ampscaler.GradScaler`: ``metrics()``, ``attach()``,
            ``on("collapse", ...)``, ``get_scale()``.

    Example:
        >>> from ampscaler import GradScaler
        >>> megatron = MegatronScaler(GradScaler("cpu", init_scale=2.0**16, hysteresis=2))
        >>> megatron.update(True); megatron.update(True); megatron.scale
        tensor([32768.])
        >>> sorted(megatron.state_dict())
        ['ampscaler', 'growth_tracker', 'hysteresis_tracker', 'scale']
    """

    def __init__(
        self, scaler: GradScaler, device: torch.device | None = None, shared_by: int = 1
    ) -> None:
        self.scaler = scaler
        self._engine = EngineScaler(scaler, device or accelerator_device(), "megatron")
        self._shared_by = shared_by
        self._reported: list[bool] = []

    @property
    def scale(self) -> torch.Tensor:
        """The scale as Megatron holds it: a float32 tensor of shape ``[1]`` on the device (a
        view of the live scale: it follows every update). No sync."""
        return self._engine.scale.view(1)

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` in float32, shape ``[1]``: what Megatron unscales the gradients by.
        float32's division is correctly rounded, so this is Megatron's value (which divides in
        float64 and rounds once) without float64. No sync."""
        return self.scale.reciprocal()

    def update(self, found_inf: bool) -> None:
        """Megatron's verdict for one step (agreed over its ranks already): move the scale.
        One host read.

        Raises:
            PersistentOverflowError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        self._reported.append(bool(found_inf))
        if len(self._reported) < self._shared_by:
            return
        overflow = any(self._reported)
        self._reported.clear()
        self._engine.record(overflow)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's three keys (``scale`` as a ``[1]`` tensor, ``growth_tracker``,
        ``hysteresis_tracker``), so that Megatron's own scaler loads it, and ampscaler's full
        state under ``"ampscaler"``. A host sync."""
        own = self.scaler.state_dict()
        return {
            "scale": self.scale.detach().clone(),
            "growth_tracker": int(own["_growth_tracker"]),
            "hysteresis_tracker": int(own.get("_hysteresis_tracker", 1)),
            "ampscaler": own,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, or a checkpoint of Megatron's own
        ``DynamicGradScaler`` (its three keys): the configured rule stays, the scale and both
        trackers come from the checkpoint (Megatron's hysteresis tracker, which goes below 0,
        as the budget left: 0 there). Validated all or nothing.

        An empty dict, what Megatron's ``ConstantGradScaler`` saves, leaves the scaler as it is.

        Raises:
            KeyError / ValueError: a checkpoint that is neither
                (:class:`~ampscaler.InvalidStateDictError` is both).
        """
        if not state_dict:
            return
        if "ampscaler" in state_dict:
            self.scaler.load_state_dict(state_dict["ampscaler"])
            return
        own = self.scaler.state_dict()
        own["scale"] = float(state_dict["scale"].reshape(()).item())
        own["_growth_tracker"] = int(state_dict["growth_tracker"])
        if "_hysteresis_tracker" in own:
            own["_hysteresis_tracker"] = max(int(state_dict["hysteresis_tracker"]), 0)
        self.scaler.load_state_dict(own)

    def __repr__(self) -> str:
        return f"MegatronScaler({self.scaler!r})"


def _rule(
    min_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: float,
    hysteresis: int,
    max_scale: float | None,
) -> Policy:
    return ScalePolicy(
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=int(growth_interval),  # Megatron-LM parses the window as a float
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )


def dynamic_scaler(
    initial_scale: float,
    min_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: float,
    hysteresis: int,
) -> MegatronScaler:
    """What ``DynamicGradScaler(...)`` builds while Megatron is patched: a
    :class:`MegatronScaler` whose rule is Megatron's numbers, with the patch's settings."""
    settings = _swap.settings or EngineSettings()
    rule = _rule(
        min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, settings.max_scale
    )
    device = accelerator_device()
    return MegatronScaler(settings.scaler(device.type, initial_scale, rule), device)


def constant_scaler(initial_scale: float) -> MegatronScaler:
    """What ``ConstantGradScaler(loss_scale)`` builds while Megatron is patched: a
    :class:`MegatronScaler` whose scale never moves (:class:`~ampscaler.StaticPolicy`), with
    the patch's settings (steps with inf/NaN gradients are still skipped, and counted)."""
    settings = _swap.settings or EngineSettings()
    device = accelerator_device()
    return MegatronScaler(settings.scaler(device.type, initial_scale, StaticPolicy()), device)


_swap = NameSwap(
    (
        ("megatron.core.optimizer", "DynamicGradScaler", dynamic_scaler),
        ("megatron.core.optimizer", "ConstantGradScaler", constant_scaler),
    )
)


def patch_megatron(
    *,
    policy: Policy | None = None,
    max_scale: float | None = None,
    max_consecutive_skips: int | None = None,
    configure: Callable[[GradScaler], object] | None = None,
) -> EnginePatch:
    """Make Megatron-core's optimizer factory build ampscaler's scaler, from now on.

    The factory (``get_megatron_optimizer``) looks ``DynamicGradScaler`` and
    ``ConstantGradScaler`` up in ``megatron.core.optimizer`` when it runs; both names build a
    :class:`MegatronScaler` while patched, from the same numbers Megatron's would get. Patch
    before the factory runs; optimizers built earlier keep their scalers (hand them one with
    :func:`use_ampscaler`). Calling it again puts new settings in force;
    :func:`unpatch_megatron` restores Megatron's names; ``with patch_megatron(...):`` undoes
    this call at the end of the block (nesting-safe). Nothing syncs here.

    Args:
        policy: a policy that replaces Megatron's rule (the initial scale stays Megatron's).
        max_scale: an upper bound added to Megatron's rule.
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from
            ``optimizer.step()`` after this many skipped steps in a row, on every rank.
        configure: called with each :class:`~ampscaler.GradScaler` built.

    Returns:
        An :class:`~ampscaler.integrations.engines.EnginePatch`.

    Raises:
        InvalidConfigError: a setting out of range; ``policy`` with ``max_scale``; a
            measuring policy. Megatron is then left as it was.
        ModuleNotFoundError: megatron-core is not installed.
    """
    settings = EngineSettings(policy, max_scale, max_consecutive_skips, configure).checked()
    return EnginePatch(_swap, settings)


def unpatch_megatron() -> None:
    """Put Megatron-core's own scaler classes back (every patch ends). Scalers built while
    patched stay ampscaler's. Does nothing when Megatron is not patched."""
    _swap.clear()


def use_ampscaler(optimizer: Any, scaler: GradScaler | None = None) -> GradScaler:
    """Hand an ampscaler scaler to a Megatron optimizer built already (a
    ``MixedPrecisionOptimizer`` or a ``ChainedOptimizer`` of them), in place of its own.

    Every optimizer with a scaler gets the one scaler: a ``ChainedOptimizer``'s optimizers then
    scale and unscale by one scale, which moves once per step (Megatron gives each its own).
    Without ``scaler``, one is made from the first optimizer's scaler: its rule when it is
    Megatron's ``DynamicGradScaler`` or ``ConstantGradScaler`` (or a :class:`MegatronScaler`),
    with its current scale and trackers.

    Returns:
        The :class:`~ampscaler.GradScaler` now in use.

    Raises:
        ValueError: an optimizer without a loss scaler (bf16 or fp32 training).
    """
    members = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    holders = [member for member in members if getattr(member, "grad_scaler", None)]
    if not holders:
        raise ValueError(
            f"{type(optimizer).__name__} has no loss scaler (Megatron builds one for fp16 "
            "only): there is nothing to hand ampscaler's scaler to."
        )
    first = holders[0].grad_scaler
    adapter = MegatronScaler(
        scaler or _scaler_like(first), first.scale.device, shared_by=len(holders)
    )
    if scaler is None and hasattr(first, "growth_interval"):  # Megatron's DynamicGradScaler
        adapter.load_state_dict(first.state_dict())  # its scale and trackers
    for member in holders:
        member.grad_scaler = adapter
    return adapter.scaler


def _scaler_like(megatron: Any) -> GradScaler:
    """An ampscaler scaler with the rule and scale of Megatron's scaler ``megatron``."""
    if isinstance(megatron, MegatronScaler):
        return megatron.scaler
    initial = float(megatron.scale.reshape(()).item())
    device = megatron.scale.device
    if not hasattr(megatron, "growth_interval"):  # ConstantGradScaler
        return GradScaler(device.type, init_scale=initial, policy=StaticPolicy())
    rule = _rule(
        float(megatron.min_scale.item()),
        float(megatron.growth_factor.item()),
        float(megatron.backoff_factor.item()),
        megatron.growth_interval,
        megatron.hysteresis,
        None,
    )
    return GradScaler(device.type, init_scale=initial, policy=rule)
