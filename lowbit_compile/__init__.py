"""lowbit-compile: 8-bit optimizer states for stock torch.optim.Adam/AdamW, traced and rewritten."""

from .api import is_wrapped, lowbit_compile, restore
from .memory import memory_report
from .passes.trace import trace_count
from .state import QuantizedState

__all__ = ["QuantizedState", "is_wrapped", "lowbit_compile", "memory_report", "restore", "trace_count"]
__version__ = "0.1.0"
