"""Checkpoints of wrapped optimizers, the public names: ``stock_state_dict`` (a stock fp32 state dict from a
wrapped optimizer or from a state dict one saved), ``from_peer_state_dict`` (a bitsandbytes or torchao
optimizer's state dict as a stock one, moments kept: ``state/peer_state.py``) and what is said to a
checkpoint of another library's optimizer. ``state_dict()`` and ``load_state_dict()`` of a wrapped optimizer
need nothing from here: its hooks (``state/hooks.py``) pack every state through the wire codec
(``state/codec.py``, whose ``LAYOUT_VERSION`` every packed state carries) and load all or nothing at any
sharding.
"""

from __future__ import annotations

from .state.codec import LAYOUT_VERSION, is_packed
from .state.foreign import FOREIGN_ADVICE, foreign_library
from .state.peer_state import from_peer_state_dict
from .state.stock import STOCK_REFUSAL, stock_state_dict

__all__ = ["FOREIGN_ADVICE", "LAYOUT_VERSION", "STOCK_REFUSAL", "foreign_library", "from_peer_state_dict", "is_packed",
           "stock_state_dict"]
