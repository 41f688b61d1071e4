"""What the Megatron-core and DeepSpeed adapters share: an ampscaler scaler driven by an engine's
verdict (:class:`EngineScaler`), the settings a patch gives every scaler it builds
(:class:`EngineSettings`), and the swap of an engine's names that a patch is
(:class:`NameSwap`).

Engines that keep a loss scaler of their own check the gradients themselves, agree on the
result across their ranks, and then tell their scaler one boolean: overflow or not. An
:class:`EngineScaler` hands that boolean to a :class:`~ampscaler.GradScaler` through its public
API, so that everything the scaler does with a check's result follows the engine's verdict: the
policy moves the scale, the counters count, step records reach the sinks,
``max_consecutive_skips`` raises, the collapse watch watches. The scaler checks one gradient of
its own, a 0-dim float32 flag that holds ``inf`` after an overflow and ``0`` otherwise: a few
small device ops and one host read per step (the engine has read its flag already).

What needs a loop the engine owns cannot work there, and is refused or documented as such:
replay (``scaler.attempts()``), the skip's cause (the engine never shows the scaler its loss),
guards (they see gradients), and :class:`~ampscaler.HeadroomPolicy`'s measurements.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch

from ..errors import InvalidConfigError
from ..policy import Policy, require_policy
from ..scaler import GradScaler

__all__ = ["EnginePatch", "EngineScaler", "EngineSettings", "NameSwap", "accelerator_device"]


@dataclass(frozen=True)
class EngineSettings:
    """What a patch gives every scaler it builds, beside the engine's own numbers.

    Attributes:
        policy: replaces the policy made from the engine's configuration (the engine's
            initial scale stays the starting scale); ``None``: the engine's rule.
        max_scale: an upper bound on the scale, added to the engine's rule.
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from the
            engine's step once this many steps in a row were skipped, on every rank (the
            engine has agreed on the overflow across its ranks already).
        configure: called with each :class:`~ampscaler.GradScaler` built (to add sinks,
            ``on("collapse", ...)`` callbacks, ...).
    """

    policy: Policy | None = None
    max_scale: float | None = None
    max_consecutive_skips: int | None = None
    configure: Callable[[GradScaler], object] | None = None

    def checked(self) -> EngineSettings:
        """These settings, each checked as the scaler's constructor checks it.

        Raises:
            InvalidConfigError: a value out of range, ``policy`` with ``max_scale``, a
                measuring policy (it measures gradients the engine never shows the scaler).
            TypeError: a ``configure`` that is not callable.
        """
        if self.policy is not None:
            policy = require_policy(self.policy, "")
            if policy.new_meter(0, agreed=False) is not None:  # it measures gradients
                raise InvalidConfigError(
                    f"policy={policy} sets the scale from measured gradients, which the engine "
                    "never shows the scaler (it checks them itself); use ScalePolicy, "
                    "StaticPolicy or a policy of your own that measures nothing."
                )
            if self.max_scale is not None:
                raise InvalidConfigError(
                    "max_scale adds a bound to the engine's rule; with policy= give the bound "
                    "to the policy instead (ScalePolicy(max_scale=...))."
                )
        if self.configure is not None and not callable(self.configure):
            raise TypeError(
                f"configure must be a function called with each new scaler, got {self.configure!r}."
            )
        # The scaler's own checks, on a throwaway scaler.
        GradScaler(
            "cpu",
            init_scale=2.0**16 if self.max_scale is None else self.max_scale,
            policy=self.policy,
            max_scale=self.max_scale,
            max_consecutive_skips=self.max_consecutive_skips,
        )
        return self

    def scaler(self, device: str, init_scale: float, rule: Policy) -> GradScaler:
        """A scaler on ``device`` starting at ``init_scale``, moved by ``rule`` (the engine's,
        made with ``max_scale``) unless ``policy`` replaces it, and configured."""
        scaler = GradScaler(
            device,
            init_scale=init_scale,
            policy=self.policy or rule,
            max_consecutive_skips=self.max_consecutive_skips,
        )
        if self.configure is not None:
            self.configure(scaler)
        return scaler


def accelerator_device() -> torch.device:
    """The device an engine's loss lives on: the current accelerator's current device (CUDA,
    XPU, MPS, ...), or the CPU where there is none."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


class _Verdict(torch.optim.Optimizer):
    """An optimizer of one parameter whose gradient holds an engine's verdict: ``inf`` after an
    overflow, ``0`` otherwise. The scaler checks it like any gradient; its step does nothing.
    The parameter is ``found_inf`` of the module :attr:`named`, so that overflow reports name
    it ``megatron.found_inf`` (or ``deepspeed.found_inf``)."""

    def __init__(self, device: torch.device) -> None:
        self.named = torch.nn.Module()
        flag = torch.nn.Parameter(torch.zeros((), dtype=torch.float32, device=device))
        self.named.register_parameter("found_inf", flag)
        super().__init__([flag], {})
        flag.grad = torch.zeros_like(flag)
        self.flag = flag.grad

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Nothing to step: the engine steps its own optimizer."""


class EngineScaler:
    """An ampscaler :class:`~ampscaler.GradScaler` that follows an engine's overflow verdicts.

    Example:
        >>> from ampscaler import GradScaler
        >>> scaler = GradScaler("cpu", init_scale=1024.0)
        >>> engine = EngineScaler(scaler, torch.device("cpu"), "megatron")
        >>> engine.record(True); engine.scaler.get_scale()
        512.0
        >>> engine.record(False); engine.scaler.metrics()["scaler/skips"]
        1
    """

    def __init__(self, scaler: GradScaler, device: torch.device, engine: str) -> None:
        self.scaler = scaler
        self._verdict = _Verdict(device)
        scaler.watch(**{engine: self._verdict.named})  # reports name `{engine}.found_inf`
        scaler._lazy_init_scale_growth_tracker(device)  # torch's name: the scale on `device`

    @property
    def scale(self) -> torch.Tensor:
        """The live scale: a 0-dim float32 tensor on the device, updated in place. No sync."""
        scale = self.scaler._get_scale_async()
        assert isinstance(scale, torch.Tensor)  # made on the device at construction
        return scale

    def record(self, overflow: bool) -> None:
        """One engine step that overflowed or not: the scaler skips or steps, and updates.
        One host read (the check's flag).

        Raises:
            PersistentOverflowError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        self._verdict.flag.fill_(math.inf if overflow else 0.0)
        self.scaler.step(self._verdict)
        self.scaler.update()


class NameSwap:
    """Names in an engine's modules replaced while a patch is in force, nesting-safe: each
    :meth:`push` puts settings in force (replacing the names once), each :meth:`pop` ends its
    own settings, in any order (as ``patch_torch()``'s handles), so the latest of those still
    open is in force, and the engine's own objects come back when none are left.

    Args:
        names: ``(module, attribute, replacement)`` triples; a module that does not import, or
            lacks the attribute, is left alone.
    """

    def __init__(self, names: Sequence[tuple[str, str, object]]) -> None:
        self._names = names
        self._originals: dict[tuple[str, str], object] = {}
        self._stack: list[EngineSettings] = []

    @property
    def settings(self) -> EngineSettings | None:
        """The settings in force (``None``: not patched)."""
        return self._stack[-1] if self._stack else None

    def push(self, settings: EngineSettings) -> None:
        """Put ``settings`` in force, replacing the names if they are not replaced yet."""
        if not self._stack:
            for module_name, attribute, replacement in self._names:
                module = importlib.import_module(module_name)
                self._originals[module_name, attribute] = getattr(module, attribute)
                setattr(module, attribute, replacement)
        self._stack.append(settings)

    def pop(self, settings: EngineSettings) -> None:
        """End ``settings`` (ended already: nothing); the engine's own names come back when
        none are left."""
        self._stack[:] = [held for held in self._stack if held is not settings]
        if not self._stack:
            self.clear()

    def clear(self) -> None:
        """The engine's own objects back under every replaced name; no settings in force."""
        for (module_name, attribute), original in self._originals.items():
            setattr(importlib.import_module(module_name), attribute, original)
        self._originals.clear()
        self._stack.clear()


class EnginePatch:
    """What one ``patch_megatron()`` or ``patch_deepspeed()`` call did. As a context manager it
    undoes that call on exit: the engine as it was before it (unpatched, or patched with the
    earlier settings).

    Attributes:
        settings: the settings this call put in force.
    """

    def __init__(self, swap: NameSwap, settings: EngineSettings) -> None:
        self.settings = settings
        self._swap = swap
        swap.push(settings)

    def __enter__(self) -> EnginePatch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._swap.pop(self.settings)

    def __repr__(self) -> str:
        return f"EnginePatch({self.settings})"
