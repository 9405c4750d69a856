"""One protocol for the kinds of per-parameter state the wrapper keeps (the quantized per-element states, the
master residual, the rounding counter): each creates or converts its entries to what the configuration asks
(:meth:`StateKind.conformed`), packs them for a state dict, loads them strictly from one, and releases them
when the optimizer goes back to stock. The runtime and the checkpoint hooks loop over the kinds
(``kinds.KINDS``); none is wired by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..formats import StateFormat
from ..formats.residual import MasterFormat
from .schema import StateSchema

Changes = dict[str, Any]  # state key -> its new value; None: the entry goes


@dataclass(frozen=True)
class StateConfig:
    """What the configuration asks of one parameter's state: each per-element state's format, the step's
    schema (the fp32 master recipe's under master weights), the master's format, whether a state rounds
    stochastically, the parameter's place in ``param_groups`` order (where its counters start) and the
    optimizer's class name (for messages)."""

    formats: Mapping[str, StateFormat]
    schema: StateSchema
    master: MasterFormat | None
    stochastic: bool
    position: int
    optimizer: str

    @property
    def dtypes(self) -> dict[str, torch.dtype]:
        """The dtype the step keeps each per-element state in."""
        return self.schema.dtypes


class StateKind(Protocol):
    """One kind of per-parameter state: its life cycle, each step reading a state and returning the
    :data:`Changes` to make (nothing changes until the caller applies them, so every kind of every
    parameter is read and checked before any is stored)."""

    def conformed(self, param: torch.Tensor, state: Mapping[str, Any], config: StateConfig) -> Changes:
        """Create or convert: what makes ``state`` (live, or left by a loader that bypasses
        ``load_state_dict``) fit ``config``."""

    def pack(self, entry: Mapping[str, Any], param: torch.Tensor) -> Changes:
        """``state_dict``: the entry's states of this kind as saved (``codec.py``)."""

    def loaded(self, param: torch.Tensor, entry: Mapping[str, Any], config: StateConfig) -> Changes:
        """``load_state_dict``: the states of this kind a saved ``entry`` (its earlier kinds read already) gives
        the parameter under ``config``, checked strictly (a ValueError naming the state; a state that does not
        fit is never replaced by a fresh one); None for an entry the stock loader must not get either."""

    def release(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """``restore``: leave ``state`` as the stock step keeps it (in place)."""


def apply(state: dict[str, Any], changes: Changes) -> None:
    """Set the entries of ``changes`` in ``state``; None removes one."""
    for key, value in changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value


def applied(state: Mapping[str, Any], changes: Changes) -> dict[str, Any]:
    """``state`` as :func:`apply` would leave it, without changing it."""
    out = dict(state)
    apply(out, changes)
    return out


def as_fp32(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved state as the fp32 step of ``param``'s master keeps it: on the param's device, fp32 if floating."""
    return value.to(device=param.device, dtype=torch.float32 if value.is_floating_point() else value.dtype)
