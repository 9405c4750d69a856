"""lowbit-compile: 8-bit optimizer states for stock torch.optim.Adam/AdamW, traced and rewritten."""

from .api import is_wrapped, lowbit_compile, restore
from .enable import Scope, enable
from .master import load_master_params, master_params
from .memory import memory_report
from .passes.trace import trace_count
from .state import QuantizedState
from .stats import StateStats, stats

__all__ = ["QuantizedState", "Scope", "StateStats", "enable", "is_wrapped", "load_master_params", "lowbit_compile",
           "master_params", "memory_report", "restore", "stats", "trace_count"]

# `from lowbit_compile import lowbit_compile` gives the function; `@lowbit_compile.enable(...)` works on it too.
lowbit_compile.enable = enable  # type: ignore[attr-defined]
lowbit_compile.stats = stats  # type: ignore[attr-defined]
__version__ = "0.1.0"
