"""The state a wrapped optimizer keeps per parameter, below the runtime and above the passes: the quantized
state (``quantized.py``), what the stock step keeps (``schema.py``), states of sharded parameters
(``sharding.py``), the wire codec of every stored layout (``codec.py``, ``LAYOUT_VERSION``), the kinds of
per-parameter state behind one protocol (``kind.py``; ``elements.py``, ``master.py``, ``counter.py``,
looped over in ``kinds.py``) and the checkpoint hooks (``hooks.py``; what stock tools see, ``stock.py``;
other libraries' states, ``foreign.py``).
"""

from __future__ import annotations

from .codec import LAYOUT_VERSION
from .quantized import QuantizedState

__all__ = ["LAYOUT_VERSION", "QuantizedState"]
