"""Which layer blew up: the first watched module whose backward produced a non-finite gradient.

Opt-in (``GradScaler(trace_nonfinite=True)``). During every backward each leaf module of the
watched models records, on the device and without a host sync, whether the gradient arriving
at its outputs, the gradient it passes to its inputs and the gradients of its own parameters
are finite. Only when a step is skipped are these flags read (one host sync) and judged:

* a module *produced* a non-finite gradient when its input or parameter gradients are
  non-finite while every gradient that arrived at its outputs was finite;
* the origin is the first such module in backward order;
* when no module produced one but some output gradient was already non-finite, the gradient
  came from the loss (or from code between the watched modules and the loss): ``"<loss>"``.

Cost: one small reduction per tapped tensor per backward, and a Python call per hook; see
docs/diagnostics.md for measurements.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> tracer = NonFiniteTracer()
    >>> tracer.attach(model)
    >>> with torch.no_grad():
    ...     _ = model[1].weight.fill_(float("inf"))
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> NonFiniteTracer.origin(tracer.take())
    '1'
"""

from __future__ import annotations

import torch

from .taps import GradTaps

__all__ = ["LOSS_ORIGIN", "NonFiniteTracer", "TraceEvent"]

LOSS_ORIGIN = "<loss>"

TraceEvent = tuple[str, str, torch.Tensor]  # (module name, "input"/"output"/"param", finite flag)


def _finite_flag(grad: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor: whether ``grad`` is all finite. No host sync.

    A sum is non-finite when an element is, and far cheaper than ``isfinite(grad).all()``;
    half-precision gradients are summed in float32, so finite ones cannot overflow it.
    """
    values = grad._values() if grad.is_sparse else grad
    wide = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else None
    return torch.isfinite(values.sum(dtype=wide))


class NonFiniteTracer:
    """Records finiteness flags of the gradients around watched modules, judged on demand."""

    def __init__(self) -> None:
        self._events: list[TraceEvent] = []
        self._taps = GradTaps(self._record, inputs=True, params=True)

    def attach(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Tap the leaf modules of ``model`` from now on."""
        self._taps.attach(model, prefix)

    def detach(self) -> None:
        """Remove all hooks."""
        self._taps.detach()

    def _record(self, name: str, where: str, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self._events.append((name, where, _finite_flag(grad)))

    @property
    def events(self) -> list[TraceEvent]:
        """The flags recorded since the last :meth:`take`, in backward order."""
        return self._events

    def take(self) -> list[TraceEvent]:
        """Return the recorded flags and start a new list (called once per iteration)."""
        events, self._events = self._events, []
        return events

    @staticmethod
    def origin(events: list[TraceEvent]) -> str | None:
        """The origin of the non-finite gradients among ``events`` (one host sync), or ``None``.

        ``None`` when every recorded gradient was finite (for example when the inf or NaN was
        put into ``.grad`` after backward, or the culprit is not in a watched module).
        """
        if not events:
            return None
        devices = {flag.device for _, _, flag in events}
        target = next(iter(devices))
        finite = torch.stack([flag.to(target) for _, _, flag in events]).tolist()
        received_bad = {
            name for (name, where, _), ok in zip(events, finite, strict=True)
            if where == "output" and not ok
        }
        for (name, where, _), ok in zip(events, finite, strict=True):
            if where != "output" and not ok and name not in received_bad:
                return name
        return LOSS_ORIGIN if received_bad else None
