"""lowbit-compile: 8-bit optimizer states for stock torch.optim optimizers, traced and rewritten."""

import logging

from . import optim
from .api import is_wrapped, lowbit_compile, restore
from .enable import Scope, enable
from .memory import memory_report
from .monitor import LowbitHealthWarning, Monitor, monitor
from .passes.trace import trace_count
from .state import QuantizedState
from .stats import StateStats, stats

__all__ = ["LowbitHealthWarning", "Monitor", "QuantizedState", "Scope", "StateStats", "enable", "is_wrapped",
           "lowbit_compile", "memory_report", "monitor", "optim", "restore", "stats", "trace_count"]

# `from lowbit_compile import lowbit_compile` gives the function; `@lowbit_compile.enable(...)` works on it too.
lowbit_compile.enable = enable  # type: ignore[attr-defined]
lowbit_compile.stats = stats  # type: ignore[attr-defined]
lowbit_compile.monitor = monitor  # type: ignore[attr-defined]
__version__ = "0.1.0"
logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless the application configures logging
