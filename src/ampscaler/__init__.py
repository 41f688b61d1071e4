"""ampscaler: dynamic loss scaling for mixed-precision PyTorch training.

A drop-in for ``torch.amp.GradScaler`` (same arguments, same results bit for bit, same
``state_dict``), with hysteresis, scale bounds, skip awareness and overflow diagnostics.

Example:
    >>> from ampscaler import GradScaler
    >>> scaler = GradScaler("cpu")
"""

from .errors import (
    InvalidConfigError,
    InvalidStateDictError,
    LogFormatError,
    PersistentOverflowError,
    ScalerUsageError,
    SinkError,
)
from .guards import SpikeGuard
from .master import MasterWeightOptimizer
from .observe.collapse import CollapseAlert, CollapseWatch
from .observe.localize import NonFiniteTracer, OverflowReport
from .observe.probe import GradientProbe, ProbeResult
from .observe.records import StepRecord, read_log
from .observe.sinks import JsonlSink, LoggingSink, Sink, StepHistory, TensorBoardSink
from .policy import HeadroomPolicy, Policy, ScalePolicy, StaticPolicy
from .scaler import GradScaler, OptState
from .sharded import ShardedGradScaler
from .state import ScalerStats

__all__ = [
    "CollapseAlert",
    "CollapseWatch",
    "GradScaler",
    "GradientProbe",
    "HeadroomPolicy",
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
    "read_log",
]

__version__ = "0.1.0"
