"""Every kind of per-parameter state, in the order they are read (the master reads the per-element states
converted; the counter comes last), and the loops over them that the runtime runs: bring a parameter's state
to its configuration, and back to stock."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .counter import COUNTER
from .elements import PER_ELEMENT
from .kind import Changes, StateConfig, StateKind, applied
from .master import MASTER

KINDS: tuple[StateKind, ...] = (PER_ELEMENT, MASTER, COUNTER)
# the states of ours beside the stock step's: never traced, never handed to the stock loader
OWN_KEYS = (*MASTER.keys, *COUNTER.keys)


def conformed(param: torch.Tensor, state: Mapping[str, Any], config: StateConfig) -> Changes:
    """What makes every kind of ``param``'s state fit ``config`` (None: an entry goes), each kind reading the
    state as the kinds before it leave it; reads ``state``, changes nothing."""
    changes: Changes = {}
    for kind in KINDS:
        changes.update(kind.conformed(param, applied(state, changes), config))
    return changes


def release(param: torch.Tensor, state: dict[str, Any]) -> None:
    """``restore``: ``state`` as the stock step keeps it, every kind released (in place)."""
    for kind in KINDS:
        kind.release(param, state)
