"""Other libraries' optimizer states (bitsandbytes, torchao): what identifies them in a saved entry, and
the refusal that names the library and what to do instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Their moments are not read yet (an importer would dequantize them with their own maps); the advice is
# written here only.
_BNB_KEYS = frozenset({"__bnb_optimizer_quant_state__", "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2",
                       "max1", "max2", "new_max1", "new_max2", "unorm_vec", "gnorm_vec"})
_TORCHAO_CLASSES = frozenset({"OptimState8bit", "OptimStateFp8", "OptimState4bit"})
FOREIGN_ADVICE = ("lowbit_compile cannot read their moments yet: load only the model's state dict, build this "
                  "optimizer afresh (its moments restart from zero, as when switching optimizers mid-run), and "
                  "skip optimizer.load_state_dict for this checkpoint")


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
