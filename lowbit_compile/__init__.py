"""lowbit-compile: 8-bit optimizer states for stock torch.optim optimizers, traced and rewritten.

Importing the package loads its public names, except under ``python -m lowbit_compile``, whose
command line checks its arguments before torch loads (``cli.main`` loads them then).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import optim
    from .api import is_wrapped, lowbit_compile, restore
    from .health import LowbitHealthWarning, Monitor, monitor
    from .masters import load_master_params, master_params
    from .memory import memory_report
    from .passes.trace import trace_count
    from .scope import Scope, enable
    from .state import QuantizedState
    from .state_stats import StateStats, stats

# public name -> the module that defines it
_PUBLIC = {
    "optim": ".optim", "is_wrapped": ".api", "lowbit_compile": ".api", "restore": ".api", "Scope": ".scope",
    "enable": ".scope", "load_master_params": ".masters", "master_params": ".masters", "memory_report": ".memory",
    "LowbitHealthWarning": ".health", "Monitor": ".health", "monitor": ".health", "trace_count": ".passes.trace",
    "QuantizedState": ".state", "StateStats": ".state_stats", "stats": ".state_stats",
}
__all__ = ["LowbitHealthWarning", "Monitor", "QuantizedState", "Scope", "StateStats", "enable", "is_wrapped",
           "load_master_params", "lowbit_compile", "master_params", "memory_report", "monitor", "optim", "restore",
           "stats", "trace_count"]
__version__ = "0.1.0"
logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless the application configures logging


def _load() -> None:
    """Import every public name (and with them the submodules: ``lowbit_compile.checkpoint``, ...)."""
    for name, module in _PUBLIC.items():
        globals()[name] = importlib.import_module(module, __name__) if name == "optim" else \
            getattr(importlib.import_module(module, __name__), name)
    # `from lowbit_compile import lowbit_compile` gives the function; `@lowbit_compile.enable(...)` works on it too.
    fn = globals()["lowbit_compile"]
    fn.enable, fn.stats, fn.monitor = globals()["enable"], globals()["stats"], globals()["monitor"]
    # a stock optimizer stepping over a low-bit checkpoint's states fails naming the fix (state/stock.py)
    importlib.import_module(".state.stock", __name__).guard_stock_steps()


def _running_the_cli() -> bool:
    """Whether this import is Python locating ``-m lowbit_compile`` (``sys.argv[0]`` is ``"-m"`` meanwhile)."""
    if sys.argv[:1] != ["-m"]:
        return False
    argv = getattr(sys, "orig_argv", [])
    module = next((argv[i + 1] if a == "-m" else a[2:] for i, a in enumerate(argv)
                   if a.startswith("-m") and (a != "-m" or i + 1 < len(argv))), "")
    return module.split(".")[0] == __name__


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    _load()
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    _load()
    return sorted(globals())


if not _running_the_cli():
    _load()
