"""Noticing that a scaler runs where it is not needed: a loss that comes from bfloat16.

bfloat16 has float32's range, so its gradients cannot underflow the way float16's do, and a loss
scaler only costs time there. :class:`Bfloat16Watch` looks during the first iteration only, and
warns once, pointing at the user's call:

* ``scale()`` called inside a bfloat16 autocast region;
* the first loss's backward graph holding bfloat16 tensors (the usual loop computes the loss
  under autocast and calls ``scale()`` outside it): looked at in ``scale()``, before
  ``backward()`` frees the graph, and reported at the check;
* every gradient an optimizer holds being bfloat16 (bfloat16 weights), which says more and is
  reported first.

Example:
    >>> import torch, warnings
    >>> watch = Bfloat16Watch()
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     loss = torch.nn.Linear(2, 1)(torch.ones(1, 2)).float().sum()
    >>> watch.look_at_loss(loss, "cpu")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     watch.look_at_gradients({torch.float32})
    >>> "the loss was computed in bfloat16" in str(caught[0].message)
    True
"""

from __future__ import annotations

from collections import deque

import torch

from .errors import warn_at_caller

__all__ = ["BF16_MESSAGE", "Bfloat16Watch"]

BF16_MESSAGE = (
    "ampscaler: {what} bfloat16, whose range is float32's: bfloat16 needs no loss scaling. "
    "Turn the scaler off with GradScaler(enabled=False) (or drop it); it only costs time here."
)

#: How many nodes of the first loss's backward graph are looked at for bfloat16 tensors: autocast
#: casts to it near the loss, so a few suffice; the bound keeps one look at a large model short.
GRAPH_NODES = 256


def bfloat16_in_graph(loss: torch.Tensor) -> bool:
    """Whether the backward graph of ``loss`` saved a bfloat16 tensor within its first
    :data:`GRAPH_NODES` nodes (a loss computed under bfloat16 autocast). No host sync; about a
    millisecond.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     out = torch.nn.Linear(2, 1)(torch.ones(1, 2))
        >>> bfloat16_in_graph(out.float().sum()), bfloat16_in_graph(torch.ones(2).sum())
        (True, False)
    """
    seen: set[object] = set()
    queue = deque([loss.grad_fn])
    while queue and len(seen) < GRAPH_NODES:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    saved = getattr(node, name)
                except RuntimeError:  # freed already (a graph backpropagated through)
                    continue
                if isinstance(saved, torch.Tensor) and saved.dtype == torch.bfloat16:
                    return True
        queue.extend(function for function, _ in node.next_functions)
    return False


class Bfloat16Watch:
    """Looks for bfloat16 during a scaler's first iteration and warns once (module docstring).

    Attributes:
        active: whether it still looks (a plain attribute: read on every call of the scaler).
    """

    def __init__(self) -> None:
        self.active = True
        self._loss: bool | None = None  # whether the first loss came from bfloat16

    def look_at_loss(self, outputs: object, device: str | None) -> None:
        """What ``scale(outputs)`` is given: warn now inside a bfloat16 autocast region, else
        look at the first loss's graph (reported by :meth:`look_at_gradients`)."""
        tensor = outputs if isinstance(outputs, torch.Tensor) else None
        device_type = tensor.device.type if tensor is not None else device or "cuda"
        if (
            device_type in ("cpu", "cuda", "xpu")
            and torch.is_autocast_enabled(device_type)
            and torch.get_autocast_dtype(device_type) == torch.bfloat16
        ):
            self._warn("scale() was called inside an autocast region of")
        elif tensor is not None and self._loss is None:
            self._loss = bfloat16_in_graph(tensor)  # one walk, not one per call

    def look_at_gradients(self, dtypes: set[torch.dtype]) -> None:
        """The dtypes of an optimizer's gradients at the check: warn if all are bfloat16, or
        if the first loss came from bfloat16."""
        if dtypes == {torch.bfloat16}:
            self._warn("every gradient of this optimizer is")
        elif self._loss:
            self._warn("the loss was computed in")

    def stop(self) -> None:
        """The first iteration ended: look no more."""
        self.active = False

    def _warn(self, what: str) -> None:
        self.active = False  # once is enough
        warn_at_caller(BF16_MESSAGE.format(what=what), UserWarning)
