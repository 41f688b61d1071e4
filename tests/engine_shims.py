"""Shims that let Megatron-core and DeepSpeed train in fp16 on the CPU, for the engine tests only.

Both engines run on a GPU in production; these tests run them on CPU ranks with gloo. Each shim
below replaces the least that stops them here, and is undone after use where it can be:

Megatron-core 0.16 hard-codes CUDA in four places the tests reach:

- ``torch.tensor/zeros/...(..., device='cuda')`` in ``megatron.core.optimizer.grad_scaler``
  (its own ``DynamicGradScaler``: the reference the tests compare against),
  ``megatron.core.optimizer.optimizer`` (the ``found_inf`` buffer), ``...clip_grads`` and
  ``megatron.core.utils`` (the gradient norm a ``ChainedOptimizer`` always computes): those
  modules' ``torch`` becomes a stand-in whose tensor factories map ``device='cuda'`` to the CPU
  (:func:`megatron_on_cpu`);
- ``Float16OptimizerWithFloat16Params`` accepts only parameters whose ``Tensor.type()`` is
  ``torch.cuda.HalfTensor`` (or float/bfloat16): while the optimizer is built,
  ``Tensor.type()`` answers the CUDA name (:func:`cuda_type_names`);
- ``DynamicGradScaler.load_state_dict`` moves the loaded scale with ``.cuda()``: while Megatron's
  own scaler loads, ``.cuda()`` is the identity (:func:`cuda_is_identity`).

Gradient clipping asserts CUDA tensors too: the tests train with ``clip_grad=0``.

DeepSpeed 0.19 refuses fp16 on an accelerator that does not declare it (``is_fp16_supported``;
its CPU accelerator answers ``None``), and compiles a shared-memory collective op at start
(``build_shm_op``): the CPU accelerator says yes, and the op is not built (gloo's collectives
serve instead) (:func:`deepspeed_on_cpu`).
"""

from __future__ import annotations

import contextlib
import importlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_MEGATRON_MODULES = (
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("tensor", "zeros", "ones", "full", "empty")


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def made(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return factory(*args, device="cpu" if device == "cuda" else device, **kwargs)

    return made


class _TorchOnCpu(types.ModuleType):
    """``torch``, except that its tensor factories make ``device='cuda'`` tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def megatron_on_cpu() -> None:
    """Point the ``torch`` of the Megatron modules that hard-code CUDA at :class:`_TorchOnCpu`
    (for the rest of the process: the test ranks are processes of their own)."""
    stand_in = _TorchOnCpu()
    for name in _MEGATRON_MODULES:
        importlib.import_module(name).torch = stand_in  # type: ignore[attr-defined]


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """``Tensor.type()`` answers ``torch.cuda.HalfTensor`` for a CPU half tensor, and so on."""
    original = torch.Tensor.type

    def cuda_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return original(self, *args, **kwargs)
        return original(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_name  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


@contextlib.contextmanager
def cuda_is_identity() -> Iterator[None]:
    """``Tensor.cuda()`` returns the tensor, and ``torch.cuda.current_device()`` 0."""
    cuda, current = torch.Tensor.cuda, torch.cuda.current_device
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: 0
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda  # type: ignore[method-assign]
        torch.cuda.current_device = current


def deepspeed_on_cpu() -> None:
    """DeepSpeed's CPU accelerator supports fp16, and builds no shared-memory op (for the rest
    of the process)."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True
    # By its full name: the package's attribute `deepspeed.comm.torch` is torch itself.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
