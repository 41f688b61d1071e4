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
    PersistentOverflowError,
    ScalerUsageError,
)
from .master import MasterWeightOptimizer
from .policy import ScalePolicy
from .scaler import GradScaler, OptState

__all__ = [
    "GradScaler",
    "InvalidConfigError",
    "InvalidStateDictError",
    "MasterWeightOptimizer",
    "OptState",
    "OverflowReport",
    "PersistentOverflowError",
    "ScalePolicy",
    "ScalerStats",
    "ScalerUsageError",
]

__version__ = "0.1.0"
