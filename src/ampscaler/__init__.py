"""ampscaler: dynamic loss scaling for mixed-precision PyTorch training.

A drop-in for ``torch.amp.GradScaler`` (same arguments, same results bit for bit, same
``state_dict``), with hysteresis, scale bounds, skip awareness and overflow diagnostics.

Example:
    >>> from ampscaler import GradScaler
    >>> scaler = GradScaler("cpu")
"""

from .counters import ScalerStats
from .diagnostics import OverflowReport
from .errors import (
    InvalidConfigError,
    InvalidStateDictError,
    LogFormatError,
    PersistentOverflowError,
    ScalerUsageError,
    SinkError,
)
from .master import MasterWeightOptimizer
from .policy import ScalePolicy
from .probe import ProbeResult
from .records import StepRecord, read_log
from .scaler import GradScaler, OptState
from .sinks import JsonlSink, LoggingSink, TensorBoardSink
from .telemetry import Sink

__all__ = [
    "GradScaler",
    "InvalidConfigError",
    "InvalidStateDictError",
    "JsonlSink",
    "LogFormatError",
    "LoggingSink",
    "MasterWeightOptimizer",
    "OptState",
    "OverflowReport",
    "PersistentOverflowError",
    "ProbeResult",
    "ScalePolicy",
    "ScalerStats",
    "ScalerUsageError",
    "Sink",
    "SinkError",
    "StepRecord",
    "TensorBoardSink",
    "read_log",
]

__version__ = "0.1.0"
