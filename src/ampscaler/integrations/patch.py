"""``patch_torch()``: from the call on, code that builds torch's loss scalers builds ampscaler's.

Frameworks construct ``torch.amp.GradScaler`` or torch's ``ShardedGradScaler`` in code you do
not own, often in processes you do not start (Lightning's ``MixedPrecision`` plugin,
Accelerate, verl's FSDP actor inside a Ray worker). :func:`patch_torch` replaces torch's names
with stand-ins (:mod:`ampscaler.integrations.standins`) that build ampscaler's scalers, with
torch's defaults and the settings given (:mod:`ampscaler.integrations.patch_settings`);
:func:`unpatch_torch` puts torch's objects back. The names replaced, where the installed torch
has them:

- ``torch.amp.GradScaler``, ``torch.amp.grad_scaler.GradScaler``, and ``torch.GradScaler``, the
  same class at torch's top level (SpeechBrain's ``Brain`` builds its scaler so);
- ``torch.cuda.amp.GradScaler``, ``torch.cuda.amp.grad_scaler.GradScaler`` (deprecated);
- ``torch.cpu.amp.GradScaler``, ``torch.cpu.amp.grad_scaler.GradScaler`` (deprecated);
- ``torch.distributed.fsdp.ShardedGradScaler`` (older torch) and
  ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``.

Code that reads the name when it builds the scaler (``torch.amp.GradScaler(...)``, or an import
inside a function, as Lightning, Accelerate and verl do) gets ampscaler's. Code that imported
the class *before* the patch (``from torch.amp import GradScaler`` at the top of a module
imported earlier) keeps torch's, for construction and for ``isinstance``: patch before
importing it.

In processes a framework starts, :func:`setup_hook` patches with the settings in the
environment variable ``AMPSCALER_PATCH`` (JSON): Ray's ``worker_process_setup_hook``, a
``multiprocessing`` pool's ``initializer``, or ``python -m ampscaler run`` for torchrun.

Example:
    >>> import torch, ampscaler
    >>> with ampscaler.patch_torch(hysteresis=2):
    ...     scaler = torch.amp.GradScaler("cpu")     # what a framework's code would do
    ...     isinstance(scaler, torch.amp.GradScaler), isinstance(scaler, ampscaler.GradScaler)
    (True, True)
    >>> scaler.policy.hysteresis, torch.amp.GradScaler is torch.amp.grad_scaler.GradScaler
    (2, True)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType, TracebackType
from typing import TYPE_CHECKING, Any

from . import standins
from .patch_settings import PatchSettings, checked, from_json

if TYPE_CHECKING:
    from ..policy import Policy
    from ..scaler import GradScaler

__all__ = ["ENV_VAR", "TorchPatch", "patch_torch", "setup_hook", "unpatch_torch"]

#: The environment variable :func:`setup_hook` reads its settings from (a JSON object).
ENV_VAR = "AMPSCALER_PATCH"

_NAMES: tuple[tuple[str, str, type], ...] = (
    ("torch", "GradScaler", standins.TorchGradScaler),
    ("torch.amp", "GradScaler", standins.TorchGradScaler),
    ("torch.amp.grad_scaler", "GradScaler", standins.TorchGradScaler),
    ("torch.cuda.amp", "GradScaler", standins.TorchCudaGradScaler),
    ("torch.cuda.amp.grad_scaler", "GradScaler", standins.TorchCudaGradScaler),
    ("torch.cpu.amp", "GradScaler", standins.TorchCpuGradScaler),
    ("torch.cpu.amp.grad_scaler", "GradScaler", standins.TorchCpuGradScaler),
    ("torch.distributed.fsdp", "ShardedGradScaler", standins.TorchShardedGradScaler),
    ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler",
     standins.TorchShardedGradScaler),
)  # fmt: skip

#: Modules whose names are replaced only once the program imports them (torch's FSDP).
_LATE = "torch.distributed.fsdp"

# While patched: the object each replaced name held before, by (module, name).
_originals: dict[tuple[str, str], object] = {}
# The patches not yet exited, oldest first: the last one's settings are in force.
_in_force: list[TorchPatch] = []


class TorchPatch:
    """What one :func:`patch_torch` call did. As a context manager it undoes that call on
    exit: the settings of the latest call still in force take over, and when none is left,
    torch is unpatched. Handles may exit in any order (two ``with`` blocks that overlap
    without nesting, a handle exited from another function): torch is restored when the last
    one exits.

    Attributes:
        settings: the settings this call put in force.

    Example:
        >>> import torch, ampscaler
        >>> first, second = ampscaler.patch_torch(hysteresis=2), ampscaler.patch_torch()
        >>> first.__exit__(None, None, None)       # out of order: the second's settings stay
        >>> torch.amp.GradScaler("cpu").policy.hysteresis
        1
        >>> second.__exit__(None, None, None)      # the last one: torch is torch again
        >>> torch.amp.GradScaler.__module__
        'torch.amp.grad_scaler'
    """

    def __init__(self, settings: PatchSettings) -> None:
        self.settings = settings

    def __enter__(self) -> TorchPatch:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not any(patch is self for patch in _in_force):
            return  # exited already, or unpatch_torch() came first
        _in_force[:] = [patch for patch in _in_force if patch is not self]
        if _in_force:
            _activate(_in_force[-1].settings)
        else:
            unpatch_torch()

    def __repr__(self) -> str:
        return f"TorchPatch({self.settings})"


def patch_torch(
    *,
    device: str | None = None,
    init_scale: float | None = None,
    growth_factor: float | None = None,
    backoff_factor: float | None = None,
    growth_interval: int | None = None,
    policy: Policy | str | None = None,
    hysteresis: int | None = None,
    min_scale: float | None = None,
    max_scale: float | None = None,
    max_consecutive_skips: int | None = None,
    flat_grads: bool | None = None,
    guards: Sequence[Callable[[], Any] | str] = (),
    sinks: Sequence[Callable[[], Any] | str] = (),
    configure: Callable[[GradScaler], object] | str | None = None,
) -> TorchPatch:
    """Make torch's scaler names build ampscaler's scalers, with these settings, from now on.

    Each scaler built through torch's names gets torch's arguments as the call gave them,
    torch's defaults for the rest (``torch.amp.GradScaler()`` is for ``"cuda"``, as in torch),
    and the settings. Calling it again replaces the settings until its handle exits (torch's
    names stay patched once; see :class:`TorchPatch`); :func:`unpatch_torch` restores torch's
    own objects. Use it before the framework builds its
    scaler, and before importing a framework that imports torch's class at module level.
    Nothing syncs here; the scalers built sync as documented for
    :class:`~ampscaler.GradScaler`.

    Example:
        >>> import torch, ampscaler
        >>> patch = ampscaler.patch_torch(max_consecutive_skips=50, device="cpu")
        >>> torch.amp.GradScaler().get_scale()          # device from the settings
        65536.0
        >>> ampscaler.unpatch_torch()
        >>> torch.amp.GradScaler.__module__
        'torch.amp.grad_scaler'

    Args:
        device: the device for calls that give none (torch's default is ``"cuda"``).
        init_scale: for calls that give none (torch's default: ``2.0**16``); likewise
            ``growth_factor``, ``backoff_factor`` and ``growth_interval``. A call that gives
            another value than the setting is refused (``InvalidConfigError``).
        policy: the :class:`~ampscaler.ScalePolicy`, :class:`~ampscaler.StaticPolicy` or
            :class:`~ampscaler.HeadroomPolicy` of every scaler (policies hold no state, so
            one is shared), or its import path. A call whose rule arguments the policy
            contradicts is refused; use ``hysteresis``, ``min_scale`` and ``max_scale``, which
            combine with the call's arguments, to keep torch's rule with ampscaler's additions.
        hysteresis: as :class:`~ampscaler.GradScaler`'s; likewise ``min_scale``,
            ``max_scale``, ``max_consecutive_skips`` and ``flat_grads``.
        guards: factories called once per scaler built, each returning a guard for it (for
            example ``[ampscaler.SpikeGuard]`` or ``[lambda: SpikeGuard(sigma=8.0)]``): a
            guard holds the run's history, so scalers never share one.
        sinks: factories of sinks, one per scaler built (for example
            ``[lambda: ampscaler.JsonlSink(f"steps-{os.getpid()}.jsonl")]``).
        configure: a function called with each scaler built, after the rest (to ``watch``,
            ``attach`` or ``on``). Strings in place of ``policy``, the factories and
            ``configure`` are import paths, ``"package.module:name"``.

    Returns:
        A :class:`TorchPatch`; ``with patch_torch(...):`` undoes the call at the end of the
        block.

    Raises:
        InvalidConfigError: a setting out of range, ``policy`` with ``hysteresis``,
            ``min_scale`` or ``max_scale``, an import path that does not import. Torch is
            then left as it was.
        TypeError: an unknown setting; a guard or sink given as an object, not a factory.
    """
    settings = checked(
        PatchSettings(
            device=device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            policy=policy,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            max_consecutive_skips=max_consecutive_skips,
            flat_grads=flat_grads,
            guards=guards,
            sinks=sinks,
            configure=configure,
        )
    )
    return _push(settings)


def _push(settings: PatchSettings) -> TorchPatch:
    """Patch with ``settings``, in force until the handle returned exits."""
    patch = TorchPatch(settings)
    _in_force.append(patch)
    _activate(settings)
    return patch


def _activate(settings: PatchSettings) -> None:
    if not (_originals or _on_import.waiting):
        for module_name, name, stand_in in _NAMES:
            if module_name.startswith(_LATE) and module_name not in sys.modules:
                _on_import.wait_for(module_name, name, stand_in)
            else:
                _replace(importlib.import_module(module_name), name, stand_in)
    standins.set_settings(settings)


def _replace(module: ModuleType, name: str, stand_in: type) -> None:
    if hasattr(module, name):
        original = getattr(module, name)
        _originals[module.__name__, name] = original
        standins.remember_torch_class(f"{module.__name__}.{name}", original)
        setattr(module, name, stand_in)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Replaces names in modules the program imports after the patch, as each is imported.

    torch's FSDP package is some 600 modules; importing it at every patch (for the sharded
    scaler's name) made exit hangs of gloo jobs that never use FSDP several times likelier (a
    race in torch's teardown, between a finished all-reduce's cleanup and the process group's
    destructor; docs/distributed.md). Code that imports FSDP after the patch still gets the
    stand-in, in ``from ... import ShardedGradScaler`` too.
    """

    def __init__(self) -> None:
        self.waiting: dict[str, list[tuple[str, type]]] = {}

    def wait_for(self, module_name: str, name: str, stand_in: type) -> None:
        if not self.waiting and self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        self.waiting.setdefault(module_name, []).append((name, stand_in))

    def stop(self) -> None:
        self.waiting.clear()
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.waiting.pop(fullname))
        if not self.waiting:
            sys.meta_path.remove(self)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """A module's own loader, then the names replaced."""

    def __init__(self, loader: importlib.abc.Loader, names: list[tuple[str, type]]) -> None:
        self._loader = loader
        self._names = names

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _in_force:  # still patched
            for name, stand_in in self._names:
                _replace(module, name, stand_in)


_on_import = _PatchOnImport()


def unpatch_torch() -> None:
    """Put torch's own objects back under every name :func:`patch_torch` replaced (the very
    objects, so ``torch.amp.GradScaler is`` what it was). Does nothing when torch is not
    patched. Scalers already built stay ampscaler's.

    Example:
        >>> import torch, ampscaler
        >>> original = torch.amp.GradScaler
        >>> _ = ampscaler.patch_torch()
        >>> ampscaler.unpatch_torch()
        >>> torch.amp.GradScaler is original
        True
    """
    for (module_name, name), original in _originals.items():
        setattr(importlib.import_module(module_name), name, original)
    _originals.clear()
    _on_import.stop()
    _in_force.clear()
    standins.set_settings(None)


def setup_hook() -> None:
    """Patch torch in this process with the settings in the environment variable
    ``AMPSCALER_PATCH`` (a JSON object of :func:`patch_torch`'s settings; unset: none).

    For processes a framework starts: Ray workers (``runtime_env={"worker_process_setup_hook":
    "ampscaler.integrations.patch.setup_hook", "env_vars": {"AMPSCALER_PATCH": ...}}``), a
    ``multiprocessing`` pool (``Pool(initializer=setup_hook)``), and torchrun's children
    through ``torchrun ... -m ampscaler run train.py`` (see :mod:`ampscaler.cli`).

    Example:
        >>> import os, torch
        >>> os.environ["AMPSCALER_PATCH"] = '{"hysteresis": 2, "device": "cpu"}'
        >>> setup_hook()
        >>> torch.amp.GradScaler().policy.hysteresis
        2
        >>> unpatch_torch(); del os.environ["AMPSCALER_PATCH"]

    Raises:
        InvalidConfigError: naming the variable and its value: not JSON, not an object, an
            unknown setting, or a setting :func:`patch_torch` refuses.
    """
    text = os.environ.get(ENV_VAR)
    _push(PatchSettings() if text is None else from_json(text, ENV_VAR))
