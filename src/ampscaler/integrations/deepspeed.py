"""DeepSpeed with ampscaler's loss scaling: :func:`patch_deepspeed` makes ZeRO-1, 2 and 3 build
ampscaler's scaler from the config's ``"fp16"`` section.

DeepSpeed keeps a scaler of its own. ZeRO's optimizers (``zero/stage_1_and_2.py``,
``zero/stage3.py``) build it with ``CreateLossScaler``, which, for dynamic fp16 scaling
(``"loss_scale": 0``, the default), calls ``DynamicLossScaler`` in
``deepspeed.runtime.fp16.loss_scaler`` with the section's numbers. ZeRO scales the loss by the
scaler's ``loss_scale`` (a Python float), checks the gradients itself, max-reduces the overflow
flag over the data-parallel and then the model-parallel group, calls
``update_scale(overflow)``, and zeroes the gradients of a skipped step. The scaler object is
pickled into ZeRO's checkpoint, ``state_dict()["loss_scaler"]``.

:func:`patch_deepspeed` replaces that one name, ``DynamicLossScaler``, with
:class:`DeepSpeedScaler`: DeepSpeed's scaler interface over an ampscaler
:class:`~ampscaler.GradScaler` whose policy is :class:`DeepSpeedPolicy`, DeepSpeed's rule with
the section's numbers. Configured alike, it moves the scale as DeepSpeed's does, bit for bit,
including DeepSpeed's growth window (one clean step longer after every overflow than
``loss_scale_window``) and ``consecutive_hysteresis``. Because ``CreateLossScaler`` and
unpickling both look the name up, the one replacement covers ZeRO-1, 2 and 3 and checkpoints
alike: a checkpoint of DeepSpeed's own scaler loaded while patched comes back as a
:class:`DeepSpeedScaler` with its scale and counters; ampscaler's pickles as ampscaler's (and
loads as ampscaler's, patched or not, wherever ampscaler is installed).

The config maps as DeepSpeed maps it:

=============================  ==============================================================
``"fp16"`` key (default)       ampscaler
=============================  ==============================================================
``initial_scale_power`` (16)   the initial scale, ``2**initial_scale_power``
``loss_scale_window`` (1000)   ``DeepSpeedPolicy(scale_window=...)``
``hysteresis`` (2)             ``DeepSpeedPolicy(hysteresis=...)``
``consecutive_hysteresis``     ``DeepSpeedPolicy(consecutive_hysteresis=...)``
``min_loss_scale`` (1)         ``DeepSpeedPolicy(min_scale=...)``
``loss_scale`` > 0             static: DeepSpeed's own ``LossScaler``, not replaced
=============================  ==============================================================

At the minimum, DeepSpeed raises as soon as an overflow would back the scale off below
``min_loss_scale``; the stand-in does the same (with :class:`~ampscaler.PersistentOverflowError`,
which says what to do), unless ``max_consecutive_skips`` is set: then it trains on at the
minimum and raises after that many skipped steps in a row, on every rank.

Example (a sketch)::

    from ampscaler.integrations.deepspeed import patch_deepspeed

    patch_deepspeed(max_consecutive_skips=50)
    engine, *_ = deepspeed.initialize(model=model, config=config, ...)
    scaler = engine.optimizer.loss_scaler.scaler     # the ampscaler GradScaler
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import InvalidConfigError, PersistentOverflowError
from ..policy import Policy, PolicyState
from ..policy.base import check_scale, float32_value, require_int
from ..scaler import GradScaler
from .engines import EnginePatch, EngineScaler, EngineSettings, NameSwap

__all__ = [
    "DeepSpeedPolicy",
    "DeepSpeedScaler",
    "DeepSpeedState",
    "agree_across_ranks",
    "patch_deepspeed",
    "unpatch_deepspeed",
]

_INT32_MAX = 2**31 - 1


class DeepSpeedState(NamedTuple):
    """:class:`DeepSpeedPolicy`'s moving parts, 0-dim tensors on the scale's device.

    Attributes:
        scale: float32, the loss scale.
        growth_tracker: int32, clean steps in a row since the last growth or overflow.
        hysteresis_left: int32, overflows still absorbed before the next backoff.
        longer_window: int32, 1 until the first growth after the start or an overflow (that
            window is one clean step longer), then 0.
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    hysteresis_left: torch.Tensor
    longer_window: torch.Tensor


@dataclass(frozen=True)
class DeepSpeedPolicy(Policy):
    """DeepSpeed's dynamic rule (``DynamicLossScaler.update_scale``), factors 2 and 1/2.

    One :meth:`update_` with ``overflow = found_inf > 0``::

        if overflow:
            growth_tracker, longer_window = 0, 1
            hysteresis_left = max(hysteresis_left - 1, 0)
            if hysteresis_left == 0:
                scale = max(scale / 2, min_scale)
        else:
            growth_tracker += 1
            if consecutive_hysteresis:
                hysteresis_left = hysteresis
            if growth_tracker == scale_window + longer_window:
                growth_tracker, longer_window = 0, 0
                hysteresis_left = hysteresis
                scale = min(scale * 2, max_scale)   # unless that is not finite

    DeepSpeed grows when ``(cur_iter - last_overflow_iter - 1) % scale_window == 0`` (and
    that count is positive): the first growth after the start or an overflow comes after
    ``scale_window + 1`` clean steps, later ones every ``scale_window``, which
    ``longer_window`` counts. Its hysteresis budget ``cur_hysteresis`` is
    ``max(hysteresis_left, 1)``. Written with ``torch.where``: no host sync.

    Args:
        scale_window: ``"loss_scale_window"``; in [1, 2**31 - 1].
        hysteresis: ``"hysteresis"`` (DeepSpeed's ``delayed_shift``): overflows until a
            backoff; in [1, 2**31 - 1].
        consecutive_hysteresis: ``"consecutive_hysteresis"``: every clean step refills the
            budget (else only a growth does).
        min_scale: ``"min_loss_scale"``: the scale never backs off below it.
        max_scale: an upper bound DeepSpeed does not have (``None``: none).

    Example:
        >>> policy = DeepSpeedPolicy(scale_window=2, hysteresis=1)
        >>> state = policy.initial_state(8.0, torch.device("cpu"))
        >>> scales = []
        >>> for overflow in (0.0, 0.0, 0.0, 1.0):
        ...     policy.update_(state, torch.tensor(overflow))
        ...     scales.append(state.scale.item())
        >>> scales
        [8.0, 8.0, 16.0, 8.0]
    """

    scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    max_scale: float | None = None

    def __post_init__(self) -> None:
        window = require_int("scale_window", self.scale_window, 1, _INT32_MAX)
        hysteresis = require_int("hysteresis", self.hysteresis, 1, _INT32_MAX)
        if not isinstance(self.consecutive_hysteresis, bool):
            raise InvalidConfigError(
                "consecutive_hysteresis must be True or False, got "
                f"{self.consecutive_hysteresis!r}."
            )
        low = check_scale("min_scale", self.min_scale)
        high = None if self.max_scale is None else check_scale("max_scale", self.max_scale)
        if high is not None and float32_value(high) < float32_value(low):
            raise InvalidConfigError(
                f"min_scale ({self.min_scale}) must not exceed max_scale ({self.max_scale})."
            )
        values = (window, hysteresis, self.consecutive_hysteresis, low, high)
        for field, value in zip(dataclasses.fields(self), values, strict=True):
            object.__setattr__(self, field.name, value)  # plain Python numbers from here on

    def initial_state(
        self, scale: float, device: torch.device, values: Mapping[str, Any] | None = None
    ) -> DeepSpeedState:
        """Fresh state on ``device`` (a full budget, the longer first window), or ``values``."""
        values = values or {}

        def made(value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((), value, dtype=dtype, device=device)

        return DeepSpeedState(
            made(scale, torch.float32),
            made(int(values.get("growth_tracker", 0)), torch.int32),
            made(int(values.get("hysteresis_left", self.hysteresis)), torch.int32),
            made(int(values.get("longer_window", 1)), torch.int32),
        )

    def own_values(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The budget and the window flag from a checkpoint's section, validated."""
        return {
            "hysteresis_left": require_int(
                "hysteresis_left", saved.get("hysteresis_left"), 0, self.hysteresis
            ),
            "longer_window": require_int("longer_window", saved.get("longer_window"), 0, 1),
        }

    def update_(
        self, state: PolicyState, found_inf: torch.Tensor, measured: torch.Tensor | None = None
    ) -> None:
        """DeepSpeed's rule, in place (the pseudo-code above)."""
        if not isinstance(state, DeepSpeedState):
            raise TypeError(
                f"DeepSpeedPolicy needs a DeepSpeedState (policy.initial_state(...) makes one), "
                f"got {type(state).__name__}."
            )
        overflow = found_inf > 0
        zero = torch.zeros_like(state.growth_tracker)
        one = torch.ones_like(state.growth_tracker)
        counted = torch.where(overflow, zero, state.growth_tracker + 1)
        grow = counted == state.longer_window + self.scale_window
        refill = ~overflow if self.consecutive_hysteresis else grow
        left = torch.where(
            overflow,
            torch.clamp_min(state.hysteresis_left - 1, 0),
            torch.where(refill, torch.full_like(zero, self.hysteresis), state.hysteresis_left),
        )
        grown = state.scale * 2.0
        if self.max_scale is not None:
            grown = torch.clamp_max(grown, self.max_scale)
        shrunk = torch.clamp_min(state.scale * 0.5, self.min_scale)
        scale = torch.where(grow & torch.isfinite(grown), grown, state.scale)
        scale = torch.where(overflow & (left == 0), shrunk, scale)
        state.longer_window.copy_(
            torch.where(overflow, one, torch.where(grow, zero, state.longer_window))
        )
        state.growth_tracker.copy_(torch.where(grow, zero, counted))
        state.hysteresis_left.copy_(left)
        state.scale.copy_(scale)


class DeepSpeedScaler:
    """DeepSpeed's dynamic scaler interface over an ampscaler :class:`~ampscaler.GradScaler`:
    what ``DynamicLossScaler(...)`` builds while DeepSpeed is patched.

    Takes ``DynamicLossScaler``'s arguments. The scale lives on the CPU: DeepSpeed multiplies
    by a Python float, so the device never waits for it.

    Attributes:
        scaler: the :class:`~ampscaler.GradScaler` (``metrics()``, sinks, ...).
        dynamic: ``True``, as DeepSpeed's.
        raise_error_at_min_scale: raise when an overflow would back off below
            ``min_scale`` (DeepSpeed's default; off when ``max_consecutive_skips`` is set).

    Example:
        >>> ds = DeepSpeedScaler(init_scale=2**8, scale_window=2, min_scale=1,
        ...                      delayed_shift=1, consecutive_hysteresis=False)
        >>> ds.update_scale(True); ds.cur_scale
        128.0
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        raise_error_at_min_scale: bool = True,
        dtype: torch.dtype = torch.half,
    ) -> None:
        settings = _swap.settings or EngineSettings()
        rule = DeepSpeedPolicy(
            scale_window, delayed_shift, consecutive_hysteresis, min_scale, settings.max_scale
        )
        self.raise_error_at_min_scale = (
            raise_error_at_min_scale and settings.max_consecutive_skips is None
        )
        self.dtype = dtype
        self._start(settings.scaler("cpu", init_scale, rule))

    def _start(self, scaler: GradScaler) -> None:
        self.scaler = scaler
        self._engine = EngineScaler(scaler, torch.device("cpu"), "deepspeed")
        self._scale = scaler.get_scale()

    # ------------------------------------------------------------------ DeepSpeed's interface

    @property
    def cur_scale(self) -> float:
        """The scale as a Python float (read when it last moved: no sync)."""
        return self._scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scaler.update(value)
        self._scale = self.scaler.get_scale()

    @property
    def loss_scale(self) -> float:
        """The scale ZeRO multiplies the loss by."""
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, as DeepSpeed's."""
        return loss * self._scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``scale_loss(loss).backward()``, as DeepSpeed's."""
        torch.autograd.backward(self.scale_loss(loss), retain_graph=retain_graph)

    def scale_gradient(
        self, module: torch.nn.Module, grad_in: tuple[torch.Tensor, ...], grad_out: Any
    ) -> tuple[torch.Tensor, ...]:
        """A backward hook that scales ``grad_in``, as DeepSpeed's."""
        return tuple(self._scale * grad for grad in grad_in)

    def update_scale(self, overflow: bool) -> None:
        """ZeRO's verdict for one step (agreed over its groups already): move the scale.

        Raises:
            PersistentOverflowError: an overflow at the minimum scale that would back off
                (``raise_error_at_min_scale``), or ``max_consecutive_skips`` skips in a row.
        """
        if overflow and self.raise_error_at_min_scale:
            self._refuse_below_minimum()
        self._engine.record(bool(overflow))
        self._scale = self.scaler.get_scale()

    def _refuse_below_minimum(self) -> None:
        policy = self.scaler.policy
        if not isinstance(policy, DeepSpeedPolicy) or self._scale != policy.min_scale:
            return
        budget = self.scaler.state_dict()["policy_state"]["hysteresis_left"]
        if budget <= 1:
            raise PersistentOverflowError(
                f"The gradients overflowed at DeepSpeed's min_loss_scale ({policy.min_scale:g}), "
                "where the scale cannot back off further; DeepSpeed ends the run here "
                "(raise_error_at_min_scale), and so does ampscaler in its place. To train on "
                "through overflows at the minimum and stop only after N skipped steps in a "
                "row, patch with ampscaler.integrations.deepspeed.patch_deepspeed("
                "max_consecutive_skips=N); a lower min_loss_scale, a lower learning rate, "
                "gradient clipping or bfloat16 address the overflows themselves."
            )

    # ------------------------------------------------------------------ pickling

    def __getstate__(self) -> dict[str, Any]:
        return {
            "scaler": self.scaler,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
            "dtype": self.dtype,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled :class:`DeepSpeedScaler` (while patched, the patch's
        ``configure`` is called with it: sinks and callbacks do not travel in a pickle), or
        DeepSpeed's own ``DynamicLossScaler`` unpickled while patched (its name resolves to
        this class then): its rule, scale, counters and hysteresis, with the patch's settings."""
        if "scaler" in state:
            self.raise_error_at_min_scale = state["raise_error_at_min_scale"]
            self.dtype = state["dtype"]
            self._start(state["scaler"])
            settings = _swap.settings
            if settings is not None and settings.configure is not None:
                settings.configure(self.scaler)  # sinks and callbacks do not travel in a pickle
            return
        self.__init__(  # type: ignore[misc]
            state["cur_scale"],
            state["scale_window"],
            state["min_scale"],
            state["delayed_shift"],
            state["consecutive_hysteresis"],
            state.get("raise_error_at_min_scale", True),
            state.get("dtype", torch.half),
        )
        own = self.scaler.state_dict()
        window = state["scale_window"]
        clean = state["cur_iter"] - state["last_overflow_iter"] - 1  # since the last overflow
        longer = clean <= window
        own["_growth_tracker"] = clean if longer else (clean - window - 1) % window
        own["policy_state"] = {
            **own["policy_state"],
            "hysteresis_left": state["cur_hysteresis"],
            "longer_window": int(longer),
        }
        self.scaler.load_state_dict(own)

    def __repr__(self) -> str:
        return f"DeepSpeedScaler({self.scaler!r})"


_swap = NameSwap((("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", DeepSpeedScaler),))


def patch_deepspeed(
    *,
    policy: Policy | None = None,
    max_scale: float | None = None,
    max_consecutive_skips: int | None = None,
    configure: Callable[[GradScaler], object] | None = None,
) -> EnginePatch:
    """Make DeepSpeed's ZeRO-1, 2 and 3 build ampscaler's scaler for dynamic fp16 scaling, from
    now on (the module docstring says how, and how the config maps).

    Patch before ``deepspeed.initialize``; engines built earlier keep their scalers. Calling it
    again puts new settings in force; :func:`unpatch_deepspeed` restores DeepSpeed's class;
    ``with patch_deepspeed(...):`` undoes this call at the end of the block (nesting-safe).
    Nothing syncs here.

    Args:
        policy: a policy that replaces DeepSpeed's rule (the initial scale stays DeepSpeed's).
        max_scale: an upper bound added to DeepSpeed's rule.
        max_consecutive_skips: raise :class:`~ampscaler.PersistentOverflowError` from
            ``engine.step()`` after this many skipped steps in a row, on every rank, instead of
            DeepSpeed's raise at the minimum scale.
        configure: called with each :class:`~ampscaler.GradScaler` built.

    Returns:
        An :class:`~ampscaler.integrations.engines.EnginePatch`.

    Raises:
        InvalidConfigError: a setting out of range; ``policy`` with ``max_scale``; a
            measuring policy. DeepSpeed is then left as it was.
        ModuleNotFoundError: DeepSpeed is not installed.
    """
    settings = EngineSettings(policy, max_scale, max_consecutive_skips, configure).checked()
    return EnginePatch(_swap, settings)


def agree_across_ranks(optimizer: Any) -> GradScaler:
    """DeepSpeed's ``"torch_autocast"`` route (fp16): give ZeRO's optimizer an ampscaler
    :class:`~ampscaler.GradScaler` that agrees on overflow over ZeRO's data-parallel group (and
    its model-parallel group, if any), in place of the ``torch.amp.GradScaler`` it built.

    On that route ZeRO-1 and 2 build ``torch.amp.GradScaler`` (ampscaler's under
    :func:`~ampscaler.patch_torch`) and step each rank's partition of the parameters through
    it; nothing agrees on its flag, so with ``"compute_grad_norm": false`` an overflow in one
    rank's partition skips the step there and backs the scale off there only (verified on 2
    ranks, tests/test_deepspeed.py). Call this after ``deepspeed.initialize``; the scale, rule
    and counters of the scaler it replaces carry over (its sinks do not: add them to the one
    returned). One all_reduce per step and group, as ZeRO makes for its own flag.

    Args:
        optimizer: ``engine.optimizer``, a ZeRO optimizer built with ``"torch_autocast"``.

    Returns:
        The scaler now in use.

    Raises:
        ValueError: ``optimizer`` has no ``torch_autocast`` scaler (fp16 scaling through the
            ``"fp16"`` section agrees already; bf16 needs no scaler).
    """
    built = getattr(optimizer, "torch_autocast_gradscaler", None)
    if built is None:
        raise ValueError(
            f"{type(optimizer).__name__} has no torch_autocast scaler: only a ZeRO optimizer "
            'built with "torch_autocast": {"enabled": true, "dtype": "float16"} has one.'
        )
    groups = [optimizer.dp_process_group]
    if getattr(optimizer, "model_parallel_group", None) is not None:
        groups.append(optimizer.model_parallel_group)
    device = optimizer.optimizer.param_groups[0]["params"][0].device.type
    policy = built.policy if isinstance(built, GradScaler) else None
    scaler = GradScaler(device, policy=policy, process_group=groups)
    scaler.load_state_dict(built.state_dict())
    optimizer.torch_autocast_gradscaler = scaler
    return scaler


def unpatch_deepspeed() -> None:
    """Put DeepSpeed's own ``DynamicLossScaler`` back (every patch ends). Scalers built while
    patched stay ampscaler's. Does nothing when DeepSpeed is not patched."""
    _swap.clear()
