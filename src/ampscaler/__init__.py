"""ampscaler: dynamic loss scaling for mixed-precision PyTorch training.

A drop-in for ``torch.amp.GradScaler`` (same arguments, same results bit for bit, same
``state_dict``), with hysteresis, scale bounds, skip awareness and overflow diagnostics.

Example:
    >>> from ampscaler import GradScaler
    >>> scaler = GradScaler("cpu")
"""

from typing import TYPE_CHECKING

from .errors import (
    InvalidConfigError,
    InvalidStateDictError,
    LogFormatError,
    PersistentOverflowError,
    ScaleFloorWarning,
    ScalerUsageError,
    SinkError,
)
from .guards import SpikeGuard
from .hooks import Hook
from .iteration import OptState
from .master import MasterWeightOptimizer
from .observe.collapse import CollapseAlert, CollapseWatch
from .observe.localize import NonFiniteTracer, OverflowReport
from .observe.probe import GradientProbe, ProbeResult
from .observe.records import StepRecord, read_log
from .observe.sinks import JsonlSink, LoggingSink, Sink, StepHistory, TensorBoardSink
from .policy import HeadroomPolicy, Policy, ScalePolicy, StaticPolicy
from .scaler import GradScaler
from .sharded import ShardedGradScaler
from .state import ScalerStats

if TYPE_CHECKING:
    from .integrations.patch import patch_torch, unpatch_torch

__all__ = [
    "CollapseAlert",
    "CollapseWatch",
    "GradScaler",
    "GradientProbe",
    "HeadroomPolicy",
    "Hook",
    "InvalidConfigError",
    "InvalidStateDictError",
    "JsonlSink",
    "LogFormatError",
    "LoggingSink",
    "MasterWeightOptimizer",
    "NonFiniteTracer",
    "OptState",
    "OverflowReport",
    "PersistentOverflowError",
    "Policy",
    "ProbeResult",
    "ScaleFloorWarning",
    "ScalePolicy",
    "ScalerStats",
    "ScalerUsageError",
    "ShardedGradScaler",
    "Sink",
    "SinkError",
    "SpikeGuard",
    "StaticPolicy",
    "StepHistory",
    "StepRecord",
    "TensorBoardSink",
    "patch_torch",
    "read_log",
    "unpatch_torch",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # patch_torch's module imports torch's FSDP scaler: it is imported at first use.
    if name in ("patch_torch", "unpatch_torch"):
        from .integrations import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'ampscaler' has no attribute {name!r}")
