"""Loop-free scaling: fp16 for a loop that never calls a scaler (``scaler.wrap(model, optimizer)``).

A loop written for fp32 (``loss.backward(); clip_grad_norm_(...); optimizer.step()``) trains in
fp16 with the scaler's own state, policy, counters, sinks and checkpoints, bit for bit as the
same loop with ``scale()``/``unscale_()``/``step()``/``update()`` written in, for a power-of-two
scale (the default policy keeps one)::

    forward     a forward hook passes each model output that requires grad through an identity
                whose backward multiplies the gradient by S (a copy: fp16/bf16 outputs come back
                fp32, so the x S happens before the gradient enters half precision)
    backward    at its first scaled output: the .grad that earlier backwards left true is
                multiplied by S, so this backward accumulates onto S x (what torch's loop holds);
                at its end (after DDP's and FSDP's own end-of-backward work): .grad x 1/S, one
                foreach op per device and dtype, so clipping and inspection see true gradients
    step        .grad x S, then the scaler's unscale_(), step() and, once every wrapped
                optimizer stepped, update(): exactly what the written-in loop runs
    zero_grad   an optimizer whose step() the loop skipped after a backward (an engine that
                skips on a non-finite gradient norm) is unscaled by the scaler there, so the
                iteration still counts and the scale backs off

Multiplying by a power of two and by its reciprocal is exact in floating point unless a value
leaves the normal range, so the gradients every step sees are torch's; where the bits can
differ: an unscaled gradient that is an fp32 (or fp16) subnormal *with accumulation* (rounded
between micro-batches), and a scaled sum that overflows where its parts did not.

Ops added per iteration do not grow with the parameters or the micro-batches beyond a constant
per device and dtype: per backward two foreach multiplies (the first backward of an iteration,
whose gradients start empty, one); per step one; per output one copy (the float32 copy
a loss computed from ``.float()`` outputs makes anyway) and one multiply.

``torch.autograd.Variable._execution_engine.queue_callback`` is the one private name here: it
is how DDP and FSDP themselves run code at the end of a backward, and torch has no public hook
for that moment.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .errors import ScalerUsageError
from .grads.collect import GradGroups, collect

if TYPE_CHECKING:
    from .scaler import GradScaler

__all__ = ["HalfLossError", "LoopFree", "unwrap", "wrap"]

_HALF = (torch.float16, torch.bfloat16)


class HalfLossError(ScalerUsageError):
    """A wrapped model returned a 0-dim float16 tensor that requires grad: a loss computed in
    float16, whose backward runs unscaled in float16 (small gradients flush to zero before any
    scale could help). Compute the loss in float32 (outside ``torch.autocast``, or from
    ``.float()`` outputs)."""


class _ScaleGrad(torch.autograd.Function):
    """Forward: a copy of the output, in float32 if it was half precision (a new tensor, not a
    view, so the loop may modify it in place, as verl does with ``logits.div_(temperature)``);
    backward: the gradient x the scale, cast back to the output's dtype."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, loop: LoopFree) -> torch.Tensor:
        ctx.loop, ctx.dtype = loop, output.dtype
        return output.to(torch.float32 if output.dtype in _HALF else output.dtype, copy=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.loop.scaled_gradient(grad).to(ctx.dtype), None


def _map_tensors(value: Any, change: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``change`` applied to every tensor in nested lists, tuples (named ones too)
    and dicts; other containers are left as they are. A dict subclass (transformers'
    ``ModelOutput``) is changed in place, a plain dict rebuilt."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, (list, tuple)):
        items = [_map_tensors(item, change) for item in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    if type(value) is dict:
        return {key: _map_tensors(item, change) for key, item in value.items()}
    if isinstance(value, dict):
        for key, item in list(value.items()):
            value[key] = _map_tensors(item, change)
    return value


class LoopFree:
    """What ``scaler.wrap(model, *optimizers)`` installs; ``remove()`` takes it out again.

    Not built directly: see :meth:`ampscaler.GradScaler.wrap`.
    """

    def __init__(
        self,
        scaler: GradScaler,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
    ) -> None:
        self._scaler = scaler
        self._optimizers = list(optimizers)
        self._in_backward = False  # between a backward's first scaled output and its end
        self._backward_seen = False  # a scaled backward ended since the last update()
        self._unscaled: set[int] = set()  # the scaler's unscale_() ran (this iteration)
        self._done: set[int] = set()  # stepped, or zeroed without a step (this iteration)
        self._inside_step = False
        self._removers: list[Callable[[], None]] = [
            model.register_forward_hook(self._on_output).remove
        ]
        for optimizer in self._optimizers:
            self._patch(optimizer, "step", self._step)
            self._patch(optimizer, "zero_grad", self._zero_grad)

    def _patch(
        self,
        optimizer: torch.optim.Optimizer,
        name: str,
        method: Callable[..., Any],
    ) -> None:
        """Put ``method`` in front of ``optimizer.<name>`` as an instance attribute (as torch's
        LR schedulers do with ``step``: an optimizer has no public hook that can skip a step).
        Removed, it restores what it replaced if nothing wrapped it since, and otherwise stays
        as a pass-through."""
        had_own = name in vars(optimizer)
        original = getattr(optimizer, name)
        active = [True]

        def call(bound_to: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            if not active[0]:
                return original(*args, **kwargs)
            return method(bound_to, original, *args, **kwargs)

        if hasattr(original, "_wrapped_by_lr_sched"):
            # An LR scheduler built before wrap() wrapped step() and checks at its first step
            # that step() is still its wrapper (else it warns that step() was overridden): its
            # wrapper runs all the same, inside this one, so the mark carries over.
            vars(call)["_wrapped_by_lr_sched"] = True
        patched = types.MethodType(call, optimizer)  # a bound method, as schedulers expect
        setattr(optimizer, name, patched)

        def remove() -> None:
            active[0] = False
            if vars(optimizer).get(name) is patched:
                if had_own:
                    setattr(optimizer, name, original)
                else:
                    delattr(optimizer, name)

        self._removers.append(remove)

    def remove(self) -> None:
        """Take the hooks out; the gradients are left true (unscaled), as between backwards."""
        for remover in self._removers:
            remover()
        self._removers = []

    # ------------------------------------------------------------------ forward and backward

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        return _map_tensors(output, self._scaled_output)

    def _scaled_output(self, output: torch.Tensor) -> torch.Tensor:
        if not (output.requires_grad and output.is_floating_point()):
            return output
        if output.dtype is torch.float16 and output.dim() == 0:  # bfloat16 has float32's range
            raise HalfLossError(
                f"The wrapped model returned a 0-dim {output.dtype} tensor that requires grad: "
                "a loss computed in float16, whose backward would run unscaled in float16. "
                "Compute the loss in float32: outside torch.autocast, or from outputs cast "
                "with .float()."
            )
        return _ScaleGrad.apply(output, self)  # type: ignore[no-untyped-call,no-any-return]

    def scaled_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` x the scale; the first call of a backward starts the backward's bookkeeping."""
        if not self._in_backward:
            self._in_backward = True
            scaler = self._scaler
            # The moment scale() would have come (a measuring policy's meter starts there);
            # no loss is kept: the loop never hands it over.
            for hook in scaler._hooks.at_scale:
                hook.at_scale(scaler._iteration)
            self._multiply_all(lambda scale: scale)
            engine = torch.autograd.Variable._execution_engine
            # Queued from the end-of-backward phase, it runs after the callbacks DDP's reducer
            # and FSDP queue during the backward (they write the reduced .grad).
            engine.queue_callback(lambda: engine.queue_callback(self._end_backward))
        return grad * self._scaler._scale_on(grad.device)

    def _end_backward(self) -> None:
        self._multiply_all(torch.reciprocal)
        self._in_backward = False
        self._backward_seen = True

    def _multiply_all(self, factor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every wrapped optimizer's gradients x ``factor(scale)``: one foreach op per device
        and dtype. No host sync."""
        groups: GradGroups = {}
        for optimizer in self._optimizers:
            for device, per_dtype in collect(optimizer, allow_fp16=True, local=True).items():
                for dtype, grads in per_dtype.items():
                    groups.setdefault(device, {}).setdefault(dtype, []).extend(grads)
        _multiply(groups, lambda device: factor(self._scaler._scale_on(device)))

    # ------------------------------------------------------------------ step and zero_grad

    def _step(
        self,
        optimizer: torch.optim.Optimizer,
        original: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if self._inside_step:  # the scaler's own call of optimizer.step()
            return original(*args, **kwargs)
        self._unscale(optimizer)
        self._inside_step = True
        try:
            result = self._scaler.step(optimizer, *args, **kwargs)
        finally:
            self._inside_step = False
        self._finish(optimizer)
        return result

    def _zero_grad(
        self,
        optimizer: torch.optim.Optimizer,
        original: Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if self._backward_seen and id(optimizer) not in self._done:
            self._unscale(optimizer)  # the loop skipped this step: the iteration still counts
            self._finish(optimizer)
        return original(*args, **kwargs)

    def _unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand ``optimizer``'s gradients to the scaler's ``unscale_()`` as the written-in loop
        would: scaled (x S, exact for a power-of-two scale). Once per iteration."""
        if id(optimizer) in self._unscaled:
            return
        scaler = self._scaler
        groups = collect(optimizer, allow_fp16=scaler._unscale_allows_fp16, local=True)
        if not groups:
            return
        if not self._backward_seen:
            raise ScalerUsageError(
                "optimizer.step() found gradients that no backward through the wrapped model's "
                "outputs produced: they were never scaled, and the scaler would divide them by "
                "the scale. Compute the loss from the wrapped model's outputs (a model called "
                "inside another module: wrap the outer one), or unwrap() for this loop."
            )
        _multiply(groups, scaler._scale_on)
        scaler.unscale_(optimizer)
        self._unscaled.add(id(optimizer))

    def _finish(self, optimizer: torch.optim.Optimizer) -> None:
        """Note ``optimizer`` done; after the last one, the scaler's ``update()``."""
        self._done.add(id(optimizer))
        if len(self._done) < len(self._optimizers):
            return
        checked = bool(self._unscaled)
        self._done, self._unscaled, self._backward_seen = set(), set(), False
        if checked:
            self._scaler.update()


def _multiply(groups: GradGroups, factor_on: Callable[[torch.device], torch.Tensor]) -> None:
    with torch.no_grad():
        for device, per_dtype in groups.items():
            factor = factor_on(device)
            for grads in per_dtype.values():
                torch._foreach_mul_(grads, factor)


_WRAPPED: weakref.WeakKeyDictionary[GradScaler, LoopFree] = weakref.WeakKeyDictionary()


def wrap(
    scaler: GradScaler, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """:meth:`ampscaler.GradScaler.wrap`'s work (see there)."""
    if scaler in _WRAPPED:
        raise ScalerUsageError(
            "This scaler already wraps a model: call scaler.unwrap() first, or use one scaler "
            "per wrapped model."
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap() takes a torch.nn.Module, not a {type(model).__name__}.")
    if not optimizers:
        raise TypeError("wrap() takes the model and at least one optimizer.")
    owned = {id(param) for param in model.parameters()}
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"wrap() takes torch.optim.Optimizer instances, not a {type(optimizer).__name__}."
            )
        strays = [
            param for group in optimizer.param_groups for param in group["params"]
            if id(param) not in owned
        ]  # fmt: skip
        if strays:
            raise ValueError(
                f"The optimizer holds {len(strays)} parameter(s) that the wrapped model does not "
                "own: their gradients would never pass through a scaled output and would be "
                "divided by the scale. Wrap the module that owns every parameter the optimizer "
                "steps."
            )
    if scaler.is_enabled():
        _WRAPPED[scaler] = LoopFree(scaler, model, optimizers)


def unwrap(scaler: GradScaler) -> None:
    """:meth:`ampscaler.GradScaler.unwrap`'s work (see there)."""
    loop = _WRAPPED.pop(scaler, None)
    if loop is not None:
        loop.remove()
