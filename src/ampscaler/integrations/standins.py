"""The classes that stand in for torch's scaler classes while torch is patched
(:func:`~ampscaler.patch_torch`).

Each one takes its torch class's arguments, with its torch class's defaults (bound to the
installed torch's own signature, so a wrong call fails with torch's ``TypeError``, and
``inspect.signature`` of a stand-in gives that signature), fills in
what the call left out from the settings in force, and builds ampscaler's scaler:

==============================================  ==================================  ==========
torch's name                                    stand-in                            device
==============================================  ==================================  ==========
``torch.amp.GradScaler``, ``torch.GradScaler``  :class:`TorchGradScaler`            ``"cuda"``
``torch.cuda.amp.GradScaler`` (deprecated)      :class:`TorchCudaGradScaler`        ``"cuda"``
``torch.cpu.amp.GradScaler`` (deprecated)       :class:`TorchCpuGradScaler`         ``"cpu"``
``...fsdp.sharded_grad_scaler.ShardedGradScaler``  :class:`TorchShardedGradScaler`  ``"cuda"``
==============================================  ==================================  ==========

``isinstance`` and ``issubclass`` against a stand-in accept what they accepted against torch's
class (torch's scalers, made before the patch too) and ampscaler's scalers of the same kind:
any ampscaler scaler is a ``torch.amp.GradScaler`` while patched, an ampscaler
``ShardedGradScaler`` a ``ShardedGradScaler``. The deprecated names warn as torch's do.

Built for ``"cuda"`` on a machine without CUDA, the stand-ins for ``torch.cuda.amp.GradScaler``
and ``ShardedGradScaler`` warn from the line of torch's module that torch's warning comes from
(their ``__init__``'s call of ``torch.amp.GradScaler.__init__``), as torch's do, so that a filter
by that module (``warnings.filterwarnings("ignore", module="torch.cuda.amp.*")``) silences them
too; ``torch.amp.GradScaler``'s warns at the caller's line, as torch's.

A stand-in referenced after :func:`~ampscaler.unpatch_torch` (by code that took it while
patched) still builds ampscaler's scaler, with torch's defaults and no settings.

A stand-in's ``__name__`` and ``__qualname__`` are its torch class's (``"GradScaler"``,
``"ShardedGradScaler"``): code keys things by ``type(scaler).__qualname__`` (Composer saves
the scaler in its checkpoints under it, and loads it back from under the same key), so a run
resumed under the patch finds the entry a run with torch's scaler saved, and the other way
round. Pickle still finds a stand-in by its name in this module.
"""

from __future__ import annotations

import contextlib
import copyreg
import dis
import functools
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from torch.amp.grad_scaler import GradScaler as _TorchAmp
from torch.cpu.amp.grad_scaler import GradScaler as _TorchCpu
from torch.cuda.amp.grad_scaler import GradScaler as _TorchCuda

from ..arguments import no_cuda_warner
from ..scaler import GradScaler
from ..sharded import ShardedGradScaler
from .patch_settings import PatchSettings, merged_arguments

__all__ = [
    "TorchCpuGradScaler",
    "TorchCudaGradScaler",
    "TorchGradScaler",
    "TorchShardedGradScaler",
    "remember_torch_class",
    "set_settings",
]

_settings: PatchSettings | None = None


def set_settings(settings: PatchSettings | None) -> None:
    """The settings every stand-in applies from now on (``None``: none)."""
    global _settings
    _settings = settings


class _StandsIn(type):
    """Metaclass of the stand-ins: ``isinstance``/``issubclass`` against a stand-in itself (not
    against a class derived from it) also accept the classes in its ``_also_accepts``."""

    _also_accepts: tuple[type, ...]

    def __instancecheck__(cls, instance: object) -> bool:
        return type.__instancecheck__(cls, instance) or isinstance(instance, _accepted(cls))

    def __subclasscheck__(cls, subclass: type) -> bool:
        return type.__subclasscheck__(cls, subclass) or issubclass(subclass, _accepted(cls))

    @property
    def __signature__(cls) -> inspect.Signature | None:
        """What ``inspect.signature`` gives for a stand-in itself: its torch class's (code that
        reads it while patched, such as fastai's ``@delegates(GradScaler)`` at import, sees
        torch's arguments, not ``*args, **kwargs``); ``None`` for a class derived from one,
        whose own ``__init__`` then tells."""
        if "_torch_class" in cls.__dict__:
            return inspect.signature(cls.__dict__["_torch_class"])
        if cls.__dict__.get("_torch_name") == _SHARDED:
            return inspect.signature(_torch_sharded())
        return None


def _accepted(cls: type) -> tuple[type, ...]:
    also: tuple[type, ...] = cls.__dict__.get("_also_accepts", ())
    if cls.__dict__.get("_torch_name") == _SHARDED and _SHARDED in _torch_classes:
        also += (_torch_classes[_SHARDED],)  # known once its module was imported
    return also


#: torch's sharded scaler's module: torch.distributed.fsdp, 600 modules that patch_torch()
#: imports only when the program does (see ampscaler.integrations.patch).
_SHARDED = "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
# torch's classes that a patch replaced, by qualified name, kept after unpatching.
_torch_classes: dict[str, type] = {}


def remember_torch_class(qualified_name: str, torch_class: type) -> None:
    """Keep torch's class that a patch is replacing (the sharded stand-in builds from its
    signature, and accepts its instances)."""
    _torch_classes.setdefault(qualified_name, torch_class)


def _torch_sharded() -> type:
    """torch's ``ShardedGradScaler`` (importing its module when no patch has met it)."""
    if _SHARDED not in _torch_classes:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as torchs

        remember_torch_class(_SHARDED, torchs)
    return _torch_classes[_SHARDED]


@dataclass(frozen=True)
class WarningSite:
    """A line of one of torch's modules, to which a warning is attributed as if that line had
    raised it: its file and line, and its module (what ``warnings.filterwarnings(...,
    module=...)`` matches, and whose ``__warningregistry__`` remembers it)."""

    filename: str
    lineno: int
    module: str

    def warn(self, message: str, category: type[Warning]) -> None:
        """Warn ``message`` from this line."""
        namespace = vars(sys.modules[self.module])
        warnings.warn_explicit(
            message,
            category,
            self.filename,
            self.lineno,
            module=self.module,
            registry=namespace.setdefault("__warningregistry__", {}),
            module_globals=namespace,
        )


@contextlib.contextmanager
def no_cuda_warning_at(site: WarningSite) -> Iterator[None]:
    """Within the block, a scaler built for ``"cuda"`` without CUDA warns from ``site``, not
    from the caller's line: torch's ``torch.cuda.amp.GradScaler`` and ``ShardedGradScaler``
    call ``torch.amp.GradScaler.__init__``, which warns one level up, so torch's warning for
    them comes from their own module (and a filter by that module silences it)."""
    token = no_cuda_warner.set(site.warn)
    try:
        yield
    finally:
        no_cuda_warner.reset(token)


@functools.cache
def _super_init_site(torch_class: type) -> WarningSite:
    """The line of ``torch_class.__init__`` (torch's own subclass of ``torch.amp.GradScaler``)
    that calls its base's ``__init__``: where torch's no-CUDA warning for it comes from. The
    ``def`` line where no such call is found."""
    code = inspect.unwrap(torch_class.__init__).__code__  # type: ignore[misc]
    line = code.co_firstlineno
    starts = sorted((offset, start) for offset, start in dis.findlinestarts(code) if start)
    for instruction in dis.get_instructions(code):
        if instruction.argval == "__init__":
            line = next((s for o, s in reversed(starts) if o <= instruction.offset), line)
            break
    return WarningSite(code.co_filename, line, torch_class.__module__)


def _build(
    scaler: GradScaler,
    torch_class: type,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    init: Callable[..., None],
    *,
    named: Mapping[str, Any] = MappingProxyType({}),
    default: Mapping[str, Any] = MappingProxyType({}),
) -> None:
    """Build ``scaler`` with ``init`` for a call of ``torch_class``. For torch's deprecated
    names, what the name says of the device: ``named`` as if the call had passed it
    (``torch.cpu.amp``), ``default`` as torch's default, which the ``device`` setting
    overrides (``torch.cuda.amp.GradScaler()`` is ``torch.amp.GradScaler()``, whose device
    defaults to ``"cuda"``)."""
    signature = inspect.signature(torch_class)
    given = {**named, **signature.bind(*args, **kwargs).arguments}  # torch's TypeError
    defaults = {
        name: p.default for name, p in signature.parameters.items() if p.default is not p.empty
    }
    defaults.update(default)
    settings = _settings or PatchSettings()
    call = f"{torch_class.__module__}.{torch_class.__qualname__}"
    init(scaler, **merged_arguments(settings, call, given, defaults))
    settings.apply(scaler)


#: A key of torch's scaler's pickled ``__dict__`` that ampscaler's never holds.
_TORCH_ONLY = "_per_optimizer_states"


def _torch_arguments(state: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of the torch scaler whose pickled ``__dict__`` is ``state``."""
    return {
        "device": state["_device"],
        "enabled": state["_enabled"],
        **(
            {
                "init_scale": state["_init_scale"],
                "growth_factor": state["_growth_factor"],
                "backoff_factor": state["_backoff_factor"],
                "growth_interval": state["_growth_interval"],
            }
            if state["_enabled"]
            else {}
        ),
    }


def _deprecated(device: str) -> None:
    warnings.warn(
        f"`torch.{device}.amp.GradScaler(args...)` is deprecated. Please use "
        f"`torch.amp.GradScaler('{device}', args...)` instead.",
        FutureWarning,
        stacklevel=3,  # the line that called torch's name, as torch's warning points
    )


class TorchGradScaler(GradScaler, metaclass=_StandsIn):
    """``torch.amp.GradScaler`` while torch is patched: ampscaler's
    :class:`~ampscaler.GradScaler`, built with torch's arguments and defaults (``device``
    defaults to ``"cuda"``, as in torch) and the settings of :func:`~ampscaler.patch_torch`."""

    _also_accepts: ClassVar[tuple[type, ...]] = (GradScaler, _TorchAmp)
    _torch_class: ClassVar[type] = _TorchAmp  # whose signature it shows

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _build(self, _TorchAmp, args, kwargs, GradScaler.__init__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle: a scaler of this class, or one of torch's pickled before the patch (its
        class's name now names this one), built with torch's arguments and values."""
        if _TORCH_ONLY not in state:
            super().__setstate__(state)
            return
        _build(self, _TorchAmp, (), _torch_arguments(state), GradScaler.__init__)
        if self.is_enabled():  # torch's pickle holds its scale and tracker as numbers
            self.load_state_dict(
                {
                    "scale": state["_init_scale"],
                    "growth_factor": state["_growth_factor"],
                    "backoff_factor": state["_backoff_factor"],
                    "growth_interval": state["_growth_interval"],
                    "_growth_tracker": state["_init_growth_tracker"],
                }
            )


class TorchCudaGradScaler(TorchGradScaler):
    """``torch.cuda.amp.GradScaler`` while torch is patched (deprecated in torch, with its
    warning): ``torch.amp.GradScaler("cuda", ...)``."""

    _also_accepts: ClassVar[tuple[type, ...]] = (_TorchCuda,)
    _torch_class: ClassVar[type] = _TorchCuda  # whose signature it shows

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _deprecated("cuda")
        with no_cuda_warning_at(_super_init_site(_TorchCuda)):
            _build(self, _TorchCuda, args, kwargs, GradScaler.__init__, default={"device": "cuda"})


class TorchCpuGradScaler(TorchGradScaler):
    """``torch.cpu.amp.GradScaler`` while torch is patched (deprecated in torch, with its
    warning): ``torch.amp.GradScaler("cpu", ...)``."""

    _also_accepts: ClassVar[tuple[type, ...]] = (_TorchCpu,)
    _torch_class: ClassVar[type] = _TorchCpu  # whose signature it shows

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _deprecated("cpu")
        _build(self, _TorchCpu, args, kwargs, GradScaler.__init__, named={"device": "cpu"})


class TorchShardedGradScaler(ShardedGradScaler, metaclass=_StandsIn):
    """``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` while torch is patched:
    ampscaler's :class:`~ampscaler.ShardedGradScaler` with torch's arguments and defaults
    (``device="cuda"``; ``process_group``: the default group) and the settings of
    :func:`~ampscaler.patch_torch`."""

    _also_accepts: ClassVar[tuple[type, ...]] = (ShardedGradScaler,)
    _torch_name: ClassVar[str] = _SHARDED  # torch's class is accepted too, once known

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torchs = _torch_sharded()
        with no_cuda_warning_at(_super_init_site(torchs)):
            _build(self, torchs, args, kwargs, ShardedGradScaler.__init__)


def _named_as_torchs(stand_in: type, name: str) -> None:
    """Give ``stand_in`` its torch class's ``name``; pickle finds it by the name it has in this
    module (``_pickled_as``), kept for classes derived from it, which keep their own."""
    stand_in._pickled_as = stand_in.__qualname__  # type: ignore[attr-defined]
    stand_in.__name__ = stand_in.__qualname__ = name


def _pickled_name(cls: _StandsIn) -> str:
    """How pickle names a class made by :class:`_StandsIn`: a global of its module."""
    named: str = cls.__dict__.get("_pickled_as", cls.__qualname__)
    return named


for _stand_in in (TorchGradScaler, TorchCudaGradScaler, TorchCpuGradScaler):
    _named_as_torchs(_stand_in, "GradScaler")
_named_as_torchs(TorchShardedGradScaler, "ShardedGradScaler")
copyreg.pickle(_StandsIn, _pickled_name)
