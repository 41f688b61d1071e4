"""Copying a few values from the device to the host without waiting for it.

On CUDA the copy goes into pinned host memory on the current stream, and an event says when it
has landed; :meth:`HostCopy.landed` polls the event, so nothing blocks. On the CPU the values
are at hand: they are cloned at once (the source may be updated in place afterwards).

Example:
    >>> import torch
    >>> copy = HostCopy(torch.tensor([1.0, 2.0]), at=7)
    >>> copy.landed(), copy.at, copy.tolist()
    (True, 7, [1.0, 2.0])
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """``tensor``'s values as they were at moment ``at`` (a caller's counter), on their way to
    the host.

    Args:
        tensor: what to copy (its values now; later in-place changes are not seen).
        at: the caller's label for when the copy was taken (e.g. an update number).
    """

    def __init__(self, tensor: torch.Tensor, at: int) -> None:
        self.at = at
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self._value = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._value.copy_(tensor, non_blocking=True)  # on the device's current stream
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record(torch.cuda.current_stream(tensor.device))
        else:
            self._value = tensor.detach().to("cpu", copy=True)

    def landed(self) -> bool:
        """Whether the values are on the host (never waits)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def tolist(self) -> Any:
        """The values as Python numbers (a number for a 0-dim tensor); call once landed."""
        return self._value.tolist()
