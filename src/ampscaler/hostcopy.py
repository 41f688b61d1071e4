"""Copying a few values from the device to the host: without waiting for it, or in one read.

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

import struct
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["HostCopy", "read_values"]


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
            held = tensor.detach() if tensor.requires_grad else tensor  # one op fewer
            self._value = held.to("cpu", copy=True)

    def landed(self) -> bool:
        """Whether the values are on the host (never waits)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> Any:
        """The values as Python numbers, blocking until they are on the host: on CUDA until the
        copy's event has fired (the work queued before the copy, not everything queued since);
        at once on the CPU."""
        if self._event is not None:
            self._event.synchronize()
        return self.tolist()

    def tolist(self) -> Any:
        """The values as Python numbers (a number for a 0-dim tensor); call once landed."""
        return self._value.tolist()


#: struct's format character for each dtype a scaler's state holds.
_FORMATS = {
    torch.float32: "f",
    torch.float64: "d",
    torch.float16: "e",
    torch.int32: "i",
    torch.int64: "q",
    torch.int16: "h",
    torch.int8: "b",
    torch.uint8: "B",
    torch.bool: "?",
}


def read_values(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """The values of ``tensors`` (0-dim: a number; 1-dim: a list) as Python numbers, read from
    their device in one copy (one host sync for all of them).

    Their bytes travel together and are decoded on the host by each tensor's dtype, so nothing
    is converted on the device (devices without float64 included). All must be on one device.

    Example:
        >>> read_values([torch.tensor(3, dtype=torch.int32), torch.tensor([0.5, 1.0])])
        [3, [0.5, 1.0]]
    """
    if not tensors:
        return []
    flat = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]
    raw = bytes(torch.cat(flat).cpu().tolist())
    values: list[Any] = []
    at = 0
    for tensor, part in zip(tensors, flat, strict=True):
        if tensor.dim() > 1:
            raise ValueError(f"read_values() reads 0-dim and 1-dim tensors, got {tensor.shape}.")
        count = tensor.numel()
        read = list(struct.unpack_from(f"<{count}{_FORMATS[tensor.dtype]}", raw, at))
        values.append(read if tensor.dim() else read[0])
        at += part.numel()
    return values
