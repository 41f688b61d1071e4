"""fp16/bf16 model weights with fp32 master copies: an optimizer wrapper.

A model held in fp16 (``model.half()``) halves the memory of its weights, but an optimizer
that updates fp16 weights directly loses every update smaller than half an fp16 ulp: near
1.0 that is ``2**-11 ≈ 4.9e-4``, so ``w - 1e-5 * g`` rounds straight back to ``w`` and a
small learning rate trains nothing. The cure (Micikevicius et al., *Mixed Precision
Training*, 2018) is to keep an fp32 *master* copy of every low-precision weight, let the
optimizer step on the masters and copy the result back into the model after each step.

:class:`MasterWeightOptimizer` does that around any ``torch.optim.Optimizer``. One step::

    model grads (fp16, scaled) ──copy_grads_to_masters()──▶ master grads (fp32)
    scaler checks/unscales master grads; on overflow the step is skipped
    inner optimizer steps on the masters (fp32 weights, fp32 state)
    masters ──copy back, rounding to nearest──▶ model weights (stay fp16)

Because the scaler only ever sees the fp32 master gradients, ``torch.amp.GradScaler``'s
"Attempting to unscale FP16 gradients." no longer applies.

Costs: per low-precision parameter, 4 bytes of master weight and 4 bytes of master
gradient on top of the model's 2 + 2 (the optimizer state is fp32 either way); two
elementwise copies per step. No method here forces a host-device sync.
"""

from __future__ import annotations

import textwrap
import warnings
import weakref
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar, cast, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["LOW_PRECISION_DTYPES", "MasterWeightOptimizer"]

#: Parameter dtypes that get an fp32 master copy. Everything else is stepped as it is.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)

# Key under which state_dict() stores the master weights, next to torch's "state" and
# "param_groups", so the dict still looks like an ordinary optimizer state dict.
_MASTERS_KEY = "master_weights"

# Attributes a scaler sets on a fused optimizer for one step (torch.amp.GradScaler,
# ampscaler.GradScaler): the fused kernel unscales by grad_scale and skips on found_inf.
_AMP_STEP_ATTRS = ("grad_scale", "found_inf")

# The hook registries torch.optim.Optimizer.__init__ creates.
_HOOK_REGISTRIES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)

_T = TypeVar("_T")

# How messages name each of LOW_PRECISION_DTYPES.
_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class _InnerAttribute(Generic[_T]):
    """An attribute of the wrapper that is the inner optimizer's, read and written through it
    (so LR schedulers and ``group["lr"] = ...`` act on the optimizer that steps)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, wrapper: MasterWeightOptimizer | None, owner: type) -> _T:
        # On the class (help(), inspect), the descriptor itself.
        return cast(_T, self if wrapper is None else getattr(wrapper._inner, self._name))

    def __set__(self, wrapper: MasterWeightOptimizer, value: _T) -> None:
        setattr(wrapper._inner, self._name, value)


class MasterWeightOptimizer(Optimizer):
    """Wrap an optimizer built on fp16/bf16 parameters so it steps fp32 master copies.

    At construction every fp16 or bf16 parameter in ``optimizer.param_groups`` gets an fp32
    master copy (a detached leaf tensor with ``requires_grad=True`` on the same device) and
    the inner optimizer's groups are rewired to the masters, so its state (momentum, Adam
    moments) lives in fp32 too. Parameters that are already fp32 (or fp64) are left as they
    are: the inner optimizer steps them directly, nothing is copied.

    The wrapper is a real :class:`torch.optim.Optimizer`: ``param_groups``, ``state`` and
    ``defaults`` are the inner optimizer's (so LR schedulers and ``group["lr"] = ...`` act
    on the optimizer that steps), and step hooks registered on the wrapper run around
    :meth:`step`.

    Example, with ampscaler's scaler (it calls :meth:`copy_grads_to_masters` itself)::

        model = Net().half()                       # convert first, then build the optimizer
        opt = MasterWeightOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        scaler = ampscaler.GradScaler("cuda")
        for x, y in data:
            loss = loss_fn(model(x.half()), y)
            scaler.scale(loss).backward()
            scaler.step(opt)                       # copy grads, unscale+check, step, copy back
            scaler.update()
            opt.zero_grad()

    With ``torch.amp.GradScaler`` (or any scaler that does not know this class) call
    :meth:`copy_grads_to_masters` yourself after ``backward()`` and before
    ``scaler.unscale_(opt)`` / ``scaler.step(opt)``; otherwise the scaler finds no
    gradients on the masters::

        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(loss).backward()
        opt.copy_grads_to_masters()
        scaler.unscale_(opt)                                  # optional, for clipping
        torch.nn.utils.clip_grad_norm_(opt.master_params(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    Without a scaler (bf16 usually needs none) just call ``opt.step()``: it copies the
    gradients first when nobody has.

    Rules worth knowing:

    * Convert the model (``.half()``, ``.to(device)``) *before* building the optimizer.
      A parameter that becomes fp16 after wrapping was never given a master, and
      :meth:`step` raises instead of stepping it in fp16.
    * Clip or otherwise edit the *master* gradients (:meth:`master_params`), after
      :meth:`copy_grads_to_masters`. Editing the model's gradients after the copy that was
      checked (``scaler.unscale_(opt)``'s, or yours with another scaler) has no effect on the
      update, so :meth:`step` raises when it sees that they changed. (An edit before
      ``ampscaler.GradScaler`` checks them is copied again there.)
    * Weights written into the model from outside (``model.load_state_dict``, a
      re-initialisation) are picked up: before stepping, any master whose model parameter
      changed in place since the last copy-back is refreshed from the model.
    * Sparse gradients (``nn.Embedding(sparse=True)``) are not supported on fp16/bf16
      parameters; keep such a parameter in fp32 (it is then stepped directly).

    Args:
        optimizer: a ``torch.optim.Optimizer`` constructed on the model's parameters, at
            least some of them fp16 or bf16. Wrap it before its first step; if it already
            has state for a low-precision parameter, that state is moved to the master and
            cast to fp32.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
        ValueError: it is already a ``MasterWeightOptimizer``, or a parameter is not a leaf
            tensor.

    Warns:
        UserWarning: no parameter is fp16 or bf16. The wrapper then passes everything
            through (it works, at the cost of nothing), but this usually means the model
            was converted after the optimizer was built.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        _check_is_wrappable(optimizer)
        # Optimizer.__init__ is not called: it would build a second set of param_groups and
        # state, while this class shares the inner optimizer's (see the properties below).
        self._init_hook_registries()

        self._inner = optimizer
        # (model param, fp32 master) for every low-precision parameter, in the order the
        # inner optimizer holds them, and the two directions of that mapping.
        self._pairs: list[tuple[Tensor, Tensor]] = []
        self._master_of: dict[Tensor, Tensor] = {}
        self._model_of: dict[Tensor, Tensor] = {}
        # Version counter of each model param right after the last write from a master;
        # a different value means the model was written from outside (see _sync_from_model).
        self._model_versions: list[int] = []
        # Set by copy_grads_to_masters, None after step() and zero_grad(): weak references to
        # the model grads that were copied and their version counters, to tell "same grads,
        # already copied" from "a new backward ran since".
        self._copied_grads: list[tuple[weakref.ref[Tensor] | None, int]] | None = None

        # Make every master before rewiring any group, so that a bad parameter raises
        # with the caller's optimizer still untouched.
        made: dict[Tensor, Tensor] = {}
        wrapped = [self._wrap_params(group["params"], made) for group in optimizer.param_groups]
        for group, params in zip(optimizer.param_groups, wrapped, strict=True):
            # In place: some optimizers keep a reference to the list (LBFGS's _params).
            group["params"][:] = params
        self._adopt(made)
        self._move_state_to_masters()

        if not self._pairs:
            warnings.warn(
                f"MasterWeightOptimizer: the {type(optimizer).__name__} has no fp16 or bf16 "
                "parameters, so there is nothing to keep master copies of and every "
                "parameter is stepped as it is. If the model is meant to train in fp16, "
                "convert it (model.half()) before constructing the optimizer.",
                UserWarning,
                stacklevel=2,
            )

    # --- what the inner optimizer owns, seen through the wrapper -------------------------

    param_groups = _InnerAttribute[list[dict[str, Any]]]("The groups; their params: the masters.")
    state = _InnerAttribute[defaultdict[Tensor, Any]]("The state, keyed by the masters.")
    defaults = _InnerAttribute[dict[str, Any]]("The default hyperparameters.")

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # A scaler reads this to decide whether to hand the step grad_scale/found_inf
        # (fused optimizers unscale and skip inside their kernel). It is the inner's answer.
        return bool(getattr(self._inner, "_step_supports_amp_scaling", False))

    @property
    def inner(self) -> Optimizer:
        """The wrapped optimizer (it steps the masters)."""
        return self._inner

    def master_params(self) -> Iterator[Tensor]:
        """Yield every tensor the inner optimizer steps: the fp32 masters, and the params
        that were fp32 already.

        Clip these, not ``model.parameters()``, after :meth:`copy_grads_to_masters`
        (and after ``scaler.unscale_(opt)``)::

            torch.nn.utils.clip_grad_norm_(opt.master_params(), max_norm=1.0)
        """
        for group in self._inner.param_groups:
            yield from group["params"]

    def master_of(self, param: Tensor) -> Tensor:
        """The tensor the inner optimizer steps for model parameter ``param``: its fp32
        master, or ``param`` itself when it was fp32 already.

        Raises:
            ValueError: ``param`` is not one of this optimizer's parameters.
        """
        if param in self._master_of or any(param is t for t in self.master_params()):
            return self._master_of.get(param, param)
        raise ValueError(
            f"this tensor (shape {tuple(param.shape)}, {param.dtype}) is not a parameter of "
            "this optimizer; add it with add_param_group() first."
        )

    # --- the step -------------------------------------------------------------------------

    def copy_grads_to_masters(self) -> None:
        """Set each master's ``.grad`` to an fp32 copy of its model parameter's ``.grad``.

        A ``None`` model gradient gives a ``None`` master gradient. Parameters that were fp32
        already carry their own gradient and are not touched.

        Idempotent: once called, further calls do nothing until :meth:`step` or
        :meth:`zero_grad`, so a scaler may call it and a user may call it too without the
        second call overwriting gradients the scaler has already unscaled. The exception is
        a new ``backward()`` in between (the model's gradients were replaced or
        accumulated into, as after a skipped step followed by ``model.zero_grad()``): then
        the new gradients are copied.

        ``ampscaler.GradScaler`` calls this before it checks or unscales this optimizer.
        With another scaler, call it after ``backward()`` and before ``scaler.unscale_``
        or ``scaler.step``. No host-device sync.

        Raises:
            RuntimeError: a low-precision parameter has a sparse gradient.
        """
        if self._copied_grads_are_current():
            return
        with torch.no_grad():
            for param, master in self._pairs:
                grad = param.grad
                if grad is None:
                    master.grad = None
                elif grad.layout != torch.strided:
                    raise RuntimeError(
                        f"MasterWeightOptimizer does not support sparse gradients (a "
                        f"{_DTYPE_NAMES[param.dtype]} parameter of shape {tuple(param.shape)} "
                        f"has a {grad.layout} gradient). Use dense gradients (e.g. "
                        "nn.Embedding(sparse=False)) or keep that parameter in fp32, which "
                        "is stepped directly without a master."
                    )
                elif master.grad is None or master.grad.shape != grad.shape:
                    master.grad = grad.to(dtype=torch.float32, copy=True)
                else:
                    master.grad.copy_(grad)
        self._copied_grads = self._grad_marks()

    #: What ``ampscaler.GradScaler`` calls before it reads this optimizer's gradients (the
    #: protocol of optimizer wrappers whose checked gradients live elsewhere).
    prepare_grads_for_scaler = copy_grads_to_masters

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the masters with the inner optimizer, then copy them into the model.

        1. Refresh masters whose model parameter was written from outside since the last
           step (e.g. ``model.load_state_dict``).
        2. Copy the gradients with :meth:`copy_grads_to_masters` unless that was done
           already for these gradients.
        3. ``inner.step()``; if a scaler set ``grad_scale``/``found_inf`` on this wrapper
           (fused optimizers), they are handed to the inner optimizer for this step only.
        4. Copy every master into its model parameter in place, rounding to the
           parameter's dtype (which stays fp16/bf16).

        With a ``closure`` (e.g. ``torch.optim.LBFGS``), each call of it is run against the
        current masters: they are copied into the model, the closure runs its forward and
        backward, and the new gradients are copied to the masters.

        Args:
            closure: re-evaluates the model and returns the loss. Optional.

        Returns:
            What the inner ``step`` returns (the closure's loss, or ``None``).

        Raises:
            RuntimeError: the model's gradients changed after
                :meth:`copy_grads_to_masters` ran (another ``backward()``, or an in-place
                edit such as clipping ``model.parameters()``); a scaler set
                ``grad_scale``/``found_inf`` before the gradients were copied (so it
                checked nothing); or a parameter in ``param_groups`` is fp16/bf16 without
                a master (the model was converted after the optimizer was wrapped).
        """
        self._check_no_unmastered_low_precision()
        forwarded = [name for name in _AMP_STEP_ATTRS if name in self.__dict__]
        if forwarded and self._copied_grads is None:
            raise RuntimeError(
                "A scaler set grad_scale/found_inf for this step, but copy_grads_to_masters() "
                "had not run, so the scaler checked masters that had no gradients yet and "
                "its found_inf says nothing about them. With torch.amp.GradScaler (or any "
                "scaler that does not call it), call opt.copy_grads_to_masters() after "
                "backward() and before scaler.unscale_(opt) / scaler.step(opt)."
            )
        self._sync_from_model()
        inner_closure: Callable[[], float] | None = None
        if closure is not None:
            inner_closure = self._master_closure(closure)
        elif self._copied_grads is None:
            self.copy_grads_to_masters()
        elif not self._copied_grads_are_current():
            raise RuntimeError(
                "The model's gradients changed after copy_grads_to_masters() ran (another "
                "backward(), or an in-place edit such as clipping model.parameters()). The "
                "optimizer steps on the master gradients, which no longer match, and a "
                "scaler may already have unscaled them. Run every backward() first, then "
                "copy_grads_to_masters() / scaler.unscale_(opt), and clip "
                "opt.master_params() rather than the model's parameters."
            )

        for name in forwarded:
            setattr(self._inner, name, self.__dict__[name])
        try:
            loss = self._inner.step() if inner_closure is None else self._inner.step(inner_closure)
        finally:
            for name in forwarded:
                if hasattr(self._inner, name):
                    delattr(self._inner, name)

        self._copy_masters_to_model()
        self._copied_grads = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of the model's parameters and of the masters.

        Args:
            set_to_none: set ``.grad`` to ``None`` (default, frees the memory) instead of
                filling it with zeros.
        """
        self._inner.zero_grad(set_to_none)
        for param, _ in self._pairs:
            _reset_grad(param, set_to_none)
        self._copied_grads = None

    # --- parameter groups -----------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, making fp32 masters for its fp16/bf16 parameters.

        Takes what ``torch.optim.Optimizer.add_param_group`` takes: a dict with
        ``"params"`` (a tensor, or a list of tensors or of ``(name, tensor)`` pairs) and
        optional hyperparameters; missing ones come from ``defaults``. Add groups here,
        not on :attr:`inner`, or their fp16 parameters get no masters.

        Example::

            opt.add_param_group({"params": model.head.parameters(), "lr": 1e-3})

        Raises:
            TypeError: ``param_group`` is not a dict, or its params are a set.
            ValueError: a parameter is already in this optimizer or is not a leaf tensor.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(
                "optimizer parameters need to be an ordered collection (a list), not a set: "
                "the order of a set changes between runs, and checkpoints rely on it."
            )
        # The masters are adopted only once the inner optimizer took the group, so a failed
        # call changes nothing.
        made: dict[Tensor, Tensor] = {}
        group = dict(param_group, params=self._wrap_params(params, made))
        self._inner.add_param_group(group)
        self._adopt(made)
        self._copied_grads = None

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus the fp32 master weights.

        The result is torch's usual ``{"state": ..., "param_groups": ...}`` with one more
        key, ``"master_weights"``: ``{index: fp32 tensor}`` for each fp16/bf16 parameter,
        ``index`` being the parameter's position in ``param_groups`` (the same numbering
        as ``"state"``). The masters carry the bits the fp16 model weights have rounded
        away, so saving them is what makes a resumed run continue exactly. Like torch's,
        the tensors are references, not copies; ``torch.save`` the result right away or
        ``copy.deepcopy`` it.

        Example::

            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._sync_from_model()
        state_dict = self._inner.state_dict()
        state_dict[_MASTERS_KEY] = {i: t.detach() for i, t in self._masters_by_index().items()}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`: optimizer state and master weights.

        The masters are then copied into the model's parameters, so the model ends up with
        the checkpoint's weights whether or not its own state dict was loaded too.

        A state dict of an unwrapped optimizer (no ``"master_weights"``) also loads; the
        masters are then taken from the model's current weights, with a warning, since the
        resumed run cannot be exact.

        Raises:
            ValueError: the checkpoint's master weights do not match this optimizer's
                fp16/bf16 parameters (other positions or shapes).
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner_state_dict = dict(state_dict)
        saved = inner_state_dict.pop(_MASTERS_KEY, None)
        masters = self._masters_by_index()
        if saved is not None:
            _check_saved_masters(saved, masters)
        elif masters:
            warnings.warn(
                "MasterWeightOptimizer.load_state_dict: the state dict has no master "
                "weights (was it saved from the unwrapped optimizer?). The masters are "
                "taken from the model's current weights, so the run will not resume "
                "bit for bit.",
                UserWarning,
                stacklevel=2,
            )
        self._inner.load_state_dict(inner_state_dict)
        with torch.no_grad():
            for index, master in masters.items():
                master.copy_(self._model_of[master] if saved is None else saved[index])
        self._copy_masters_to_model()
        self._copied_grads = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # --- plumbing ---------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Optimizer.__getstate__ keeps only defaults/state/param_groups, which live on the
        # inner optimizer here: keep the inner and the pairing, and drop, as torch does,
        # what is tied to this process: hooks, an LR scheduler's patched `step`, a scaler's
        # per-step attributes, and the weak references to the last copied grads. A copy
        # starts with "grads not copied yet".
        transient = {*_HOOK_REGISTRIES, *_AMP_STEP_ATTRS, "step", "_copied_grads"}
        return {key: value for key, value in self.__dict__.items() if key not in transient}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._copied_grads = None
        self._init_hook_registries()

    def __repr__(self) -> str:
        counts = Counter(_DTYPE_NAMES[param.dtype] for param, _ in self._pairs)
        by_dtype = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
        elements = sum(master.numel() for _, master in self._pairs)
        n_direct = sum(1 for t in self.master_params() if t not in self._model_of)
        inner = textwrap.indent(repr(self._inner), "  ")
        return (
            f"{type(self).__name__}(\n"
            f"  masters: {len(self._pairs)} fp32 copies of {by_dtype} params "
            f"({elements} elements, {4 * elements} bytes)\n"
            f"  stepped directly (already fp32): {n_direct} params\n"
            f"  inner:\n{inner}\n)"
        )

    def _masters_by_index(self) -> dict[int, Tensor]:
        """The fp32 masters (not the params stepped directly) by their position among
        :meth:`master_params`: the numbering of ``"state"`` and of ``"master_weights"``."""
        return {i: t for i, t in enumerate(self.master_params()) if t in self._model_of}

    def _init_hook_registries(self) -> None:
        # What Optimizer.__init__ sets up besides param_groups/state/defaults: the hook
        # registries, and the class-level patch of step() that runs the step hooks.
        for name in _HOOK_REGISTRIES:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    def _wrap_params(self, params: Iterable[Any], made: dict[Tensor, Tensor]) -> list[Any]:
        """Return ``params`` with each fp16/bf16 tensor replaced by a new fp32 master.

        ``(name, tensor)`` pairs keep their name. Adds each (model param, master) pair to
        ``made``, for :meth:`_adopt` once the masters are in the inner optimizer.
        """
        wrapped: list[Any] = []
        for item in params:
            name, param = item if isinstance(item, tuple) else (None, item)
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"optimizer can only optimize Tensors, but one of the params is "
                    f"{type(param).__name__}"
                )
            replacement = param
            if param.dtype in LOW_PRECISION_DTYPES:
                replacement = made[param] = self._make_master(param, made)
            wrapped.append(replacement if name is None else (name, replacement))
        return wrapped

    def _make_master(self, param: Tensor, made: dict[Tensor, Tensor]) -> Tensor:
        if param in self._master_of or param in made:
            raise ValueError(
                "some parameters appear in more than one parameter group (a "
                f"{_DTYPE_NAMES[param.dtype]} tensor of shape {tuple(param.shape)} is "
                "already in this optimizer); give each parameter to one group only."
            )
        if not param.is_leaf:
            raise ValueError(
                f"can't optimize a non-leaf tensor (a {_DTYPE_NAMES[param.dtype]} tensor of "
                f"shape {tuple(param.shape)}, made by {type(param.grad_fn).__name__}). This "
                "happens with e.g. torch.randn(..., requires_grad=True).half(): create the "
                "tensor in its dtype directly, or use t.detach().requires_grad_(), or an "
                "nn.Parameter of a module converted with .half()."
            )
        return param.detach().to(dtype=torch.float32, copy=True).requires_grad_(True)

    def _adopt(self, made: dict[Tensor, Tensor]) -> None:
        """Record the (model param, master) pairs ``made``, in order."""
        self._pairs.extend(made.items())
        self._master_of.update(made)
        self._model_of.update((master, param) for param, master in made.items())
        self._model_versions.extend(param._version for param in made)

    def _move_state_to_masters(self) -> None:
        # An optimizer wrapped after it has stepped (or loaded a state dict) keys its state
        # by the model params and holds it in their dtype: move it to the masters, in fp32.
        state = self._inner.state
        for param, master in self._pairs:
            if param in state:
                state[master] = {
                    key: value.to(torch.float32)
                    if isinstance(value, Tensor) and value.dtype == param.dtype
                    else value
                    for key, value in state.pop(param).items()
                }

    def _grad_marks(self) -> list[tuple[weakref.ref[Tensor] | None, int]]:
        # Each model grad as a weak reference and its version counter. CPython hands out one
        # weak reference per live object, so equal marks mean the very same, unchanged grads.
        return [
            (None, 0) if param.grad is None else (weakref.ref(param.grad), param.grad._version)
            for param, _ in self._pairs
        ]

    def _copied_grads_are_current(self) -> bool:
        copied, now = self._copied_grads, self._grad_marks()
        return (
            copied is not None
            and len(copied) == len(now)
            and all(a[0] is b[0] and a[1] == b[1] for a, b in zip(copied, now, strict=True))
        )

    def _copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for i, (param, master) in enumerate(self._pairs):
                param.copy_(master)
                self._model_versions[i] = param._version

    def _sync_from_model(self) -> None:
        # A model param whose version moved since our last write was written from outside
        # (load_state_dict, re-init, a broadcast): the model is the truth, refresh its master.
        with torch.no_grad():
            for i, (param, master) in enumerate(self._pairs):
                if param._version != self._model_versions[i]:
                    master.copy_(param)
                    self._model_versions[i] = param._version

    def _check_no_unmastered_low_precision(self) -> None:
        for tensor in self.master_params():
            if tensor.dtype in LOW_PRECISION_DTYPES:
                raise RuntimeError(
                    f"a {_DTYPE_NAMES[tensor.dtype]} parameter of shape {tuple(tensor.shape)} "
                    "has no fp32 master and would be stepped in low precision. Either the "
                    "model was converted (e.g. model.half()) after the optimizer was "
                    "wrapped, or the group was added to the inner optimizer directly. "
                    "Convert the model first, then build and wrap the optimizer, and add "
                    "groups with MasterWeightOptimizer.add_param_group()."
                )

    def _master_closure(self, closure: Callable[[], float]) -> Callable[[], float]:
        def evaluate_at_masters() -> float:
            self._copy_masters_to_model()
            with torch.enable_grad():
                loss = closure()
            self._copied_grads = None
            self.copy_grads_to_masters()
            return loss

        return evaluate_at_masters


def _check_is_wrappable(optimizer: object) -> None:
    if isinstance(optimizer, MasterWeightOptimizer):
        raise ValueError(
            "this optimizer is already a MasterWeightOptimizer; wrap the plain optimizer once."
        )
    if isinstance(optimizer, Optimizer):
        return
    hint = ""
    if isinstance(optimizer, torch.nn.Module):
        hint = " You passed a module: build the optimizer on its parameters first."
    elif isinstance(optimizer, Tensor) or hasattr(optimizer, "__iter__"):
        hint = " You passed parameters: build an optimizer on them first."
    raise TypeError(
        f"MasterWeightOptimizer wraps a torch.optim.Optimizer, but got "
        f"{type(optimizer).__name__}.{hint} For example: "
        "MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))"
    )


def _check_saved_masters(saved: Any, masters: dict[int, Tensor]) -> None:
    if not isinstance(saved, dict):
        raise ValueError(
            f"state_dict[{_MASTERS_KEY!r}] should map parameter indices to fp32 tensors, "
            f"got {type(saved).__name__}"
        )
    if set(saved) != set(masters):
        raise ValueError(
            f"the checkpoint has master weights for parameters {sorted(saved)}, but this "
            f"optimizer's fp16/bf16 parameters are at {sorted(masters)}. Load it into an "
            "optimizer over the same parameters, in the same order and dtypes, as the one "
            "that saved it."
        )
    for index, master in masters.items():
        value = saved[index]
        if not isinstance(value, Tensor) or value.shape != master.shape:
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"the checkpoint's master weight {index} has shape {got}, but the "
                f"parameter at that position has shape {tuple(master.shape)}."
            )


def _reset_grad(tensor: Tensor, set_to_none: bool) -> None:
    grad = tensor.grad
    if grad is None:
        return
    if set_to_none:
        tensor.grad = None
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()
