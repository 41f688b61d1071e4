"""Tapping the gradients that flow through the leaf modules of a model during backward.

A forward hook on each leaf module registers tensor hooks on the module's outputs (and, if
asked, its inputs); parameter hooks tap the gradients of the module's own parameters. Each tap
calls ``callback(module_name, where, grad)`` with ``where`` one of ``"output"`` (the gradient
arriving at the module), ``"input"`` (the gradient its backward passes on) and ``"param"``.
Tensor hooks never change the gradient. Used by the underflow probe and the non-finite tracer;
nothing is registered until :meth:`GradTaps.attach`, and :meth:`GradTaps.detach` removes it all.
:class:`WatchedModels` remembers, weakly, which models to tap when hooks come and go.

Example:
    >>> import torch
    >>> seen = []
    >>> taps = GradTaps(lambda name, where, grad: seen.append((name, where)))
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> taps.attach(model)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> seen
    [('1', 'output'), ('0', 'output')]
    >>> taps.detach()
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["GradTaps", "WatchedModels", "leaf_modules"]

Tap = Callable[[str, str, torch.Tensor], None]


def leaf_modules(model: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """``(name, module)`` for every module of ``model`` that has no children.

    A model without children is its own leaf, named ``prefix`` or its class name.
    """
    lead = f"{prefix}." if prefix else ""
    for name, module in model.named_modules():
        if next(module.children(), None) is None:
            yield (lead + name if name else prefix or type(module).__name__), module


class WatchedModels:
    """``(model, prefix)`` pairs, held through weak references: watching keeps nothing alive.

    Example:
        >>> models = WatchedModels()
        >>> encoder = torch.nn.Linear(1, 1)
        >>> models.add(encoder, "encoder")
        >>> models.add(torch.nn.Linear(1, 1), "dropped")   # nothing else holds this one
        >>> [prefix for _, prefix in models]
        ['encoder']
    """

    def __init__(self) -> None:
        self._models: list[tuple[weakref.ref[torch.nn.Module], str]] = []

    def add(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Remember ``model`` (weakly) with the ``prefix`` of its names."""
        self._models.append((weakref.ref(model), prefix))

    def clear(self) -> None:
        """Forget every model."""
        self._models = []

    def __iter__(self) -> Iterator[tuple[torch.nn.Module, str]]:
        """The models still alive, in the order they were added (dead ones are forgotten)."""
        live = [(model, prefix) for ref, prefix in self._models if (model := ref()) is not None]
        self._models = [(weakref.ref(model), prefix) for model, prefix in live]
        return iter(live)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _inert(*args: object) -> None:
    """What a tap's hook calls in a copied or pickled module: nothing."""


class _Hook:
    """``call(*front, *args)`` as a module or tensor hook. A module that is deep-copied or
    pickled while the hooks are on (``copy.deepcopy(model)`` for an EMA, ``torch.save(model)``)
    gets an inert hook in its place: the copy is not watched, and the taps (which hold their
    callback weakly) need not be copied."""

    def __init__(self, call: Callable[..., None], *front: str) -> None:
        self._call = call
        self._front = front

    def __call__(self, *args: Any) -> None:
        self._call(*self._front, *args)

    def __reduce__(self) -> tuple[type[_Hook], tuple[Callable[..., None]]]:
        return (_Hook, (_inert,))


class GradTaps:
    """Hooks that pass the gradients around leaf modules to ``callback``.

    The hooks hold ``callback`` weakly when it is a bound method, and are removed when its
    object is collected: a model does not keep a dropped scaler's probe or tracer alive.

    Args:
        callback: called as ``callback(module_name, where, grad)`` during backward.
        inputs: also tap the gradients of the modules' floating-point inputs.
        params: also tap the gradients of the modules' own parameters.
    """

    def __init__(self, callback: Tap, *, inputs: bool = False, params: bool = False) -> None:
        owner = getattr(callback, "__self__", None)
        if owner is not None:
            self._callback: Callable[[], Tap | None] = weakref.WeakMethod(callback)
            weakref.finalize(owner, self.detach)
        else:
            self._callback = lambda: callback
        self._inputs = inputs
        self._params = params
        self._handles: list[RemovableHandle] = []

    def attach(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Register the hooks on every leaf module of ``model`` (names prefixed by ``prefix``)."""
        for name, module in leaf_modules(model, prefix):
            self._handles.append(module.register_forward_hook(_Hook(self._forward, name)))
            if self._params:
                for param in module.parameters(recurse=False):
                    if param.requires_grad:
                        hook = _Hook(self._tap, name, "param")
                        handle = param.register_hook(hook)  # type: ignore[no-untyped-call]
                        self._handles.append(handle)

    def detach(self) -> None:
        """Remove every hook this object registered (tensor hooks of a pending backward stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def arm(self, due: bool, models: WatchedModels) -> None:
        """Hooks on ``models`` when ``due`` (registered if missing), none otherwise: what an
        observer that measures some iterations does at the end of each."""
        if due and not self._handles:
            for model, prefix in models:
                self.attach(model, prefix)
        elif self._handles and not due:
            self.detach()

    def _forward(
        self, name: str, module: torch.nn.Module, args: tuple[object, ...], output: object
    ) -> None:
        if self._inputs:
            for tensor in _tensors(args):
                self._hook(name, "input", tensor)
        for tensor in _tensors(output):
            self._hook(name, "output", tensor)

    def _hook(self, name: str, where: str, tensor: torch.Tensor) -> None:
        if tensor.requires_grad and tensor.is_floating_point():
            tensor.register_hook(_Hook(self._tap, name, where))  # type: ignore[no-untyped-call]

    def _tap(self, name: str, where: str, grad: torch.Tensor) -> None:
        callback = self._callback()
        if callback is not None:
            callback(name, where, grad)
