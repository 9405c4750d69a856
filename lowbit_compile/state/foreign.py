"""Other libraries' optimizer states (bitsandbytes, torchao) met by ``load_state_dict``: what identifies them in
a saved entry (``peer_state.py``, which reads them), and the refusal that names the library and the conversion.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .peer_state import BNB_KEYS as _BNB_KEYS
from .peer_state import TORCHAO_CLASSES as _TORCHAO_CLASSES

FOREIGN_ADVICE = ("convert it first, which keeps its moments (dequantized with that library's own maps, then stored "
                  "in this optimizer's format) and its step: "
                  "optimizer.load_state_dict(lowbit_compile.checkpoint.from_peer_state_dict(state_dict))")


def foreign_library(entry: Mapping, kept: Mapping[str, Any]) -> str | None:
    """The library whose optimizer saved the state ``entry`` (bitsandbytes, torchao), or None: keys that
    are bitsandbytes' and not states the optimizer keeps (``kept``), or torchao's low-bit tensor
    subclasses, told by class name and module (torchao is never imported here)."""
    if any(isinstance(k, str) and k in _BNB_KEYS and k not in kept for k in entry):
        return "bitsandbytes"
    for value in entry.values():
        cls = type(value)
        if cls.__name__ in _TORCHAO_CLASSES and cls.__module__.split(".")[0] == "torchao":
            return "torchao"
    return None


def refuse_foreign(entry: Mapping, kept: Mapping[str, Any], label: str) -> None:
    """Refuse a saved state of another library's optimizer, naming it and what to do."""
    library = foreign_library(entry, kept)
    if library is not None:
        keys = sorted(map(str, entry))[:6]
        raise ValueError(f"{label}: this optimizer state was saved by a {library} optimizer (its keys: {keys}), "
                         f"not by torch.optim or lowbit_compile; {FOREIGN_ADVICE}")
