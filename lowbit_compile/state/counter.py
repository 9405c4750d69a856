"""The step counter of stochastically rounded states (``rounding="stochastic"``, ``formats/rounding.py``), one
kind of per-parameter state (``kind.StateKind``): one 0-d fp32 ``rounding_seed`` per parameter in the
optimizer state, created when a state of the parameter first rounds stochastically (at a start apart for
each parameter, ``first_counter``), advanced by the step itself, saved as its four bytes (``codec.py``, like
the master residual's counter, so a stock loader's cast to a bf16 param's dtype cannot round it) and read
back on the next step, so a resumed run draws the bits the uninterrupted one would."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..formats.residual import first_counter
from ..formats.rounding import SEED
from . import codec
from .kind import Changes, StateConfig


def conformed(state: Mapping[str, Any], stochastic: bool, position: int) -> Changes:
    """What changes in ``state`` (None: the entry goes) so that its counter fits: created (at
    ``first_counter(position)``) where a state rounds stochastically and none is held, read back from
    saved bytes, back to fp32 on the CPU after a cast, dropped where no state rounds stochastically.
    Reads ``state``, changes nothing."""
    value = state.get(SEED)
    if not stochastic:
        return {SEED: None} if SEED in state else {}
    if codec.is_packed_counter(value):
        return {SEED: codec.unpack_counter(value, SEED)}
    if value is None:
        return {SEED: torch.tensor(first_counter(position), dtype=torch.float32)}
    checked = codec.checked_counter(value, SEED)
    if value.dtype != torch.float32 or value.device.type != "cpu" or value.dim():
        return {SEED: checked}
    return {}


class RoundingCounter:
    """The rounding counter as a kind of per-parameter state (``kind.StateKind``)."""

    keys = (SEED,)

    def conformed(self, param: torch.Tensor, state: Mapping[str, Any], config: StateConfig) -> Changes:
        return conformed(state, config.stochastic, config.position)

    def pack(self, entry: Mapping[str, Any], param: torch.Tensor) -> Changes:
        return {SEED: codec.pack_counter(entry[SEED])} if isinstance(entry.get(SEED), torch.Tensor) else {}

    def loaded(self, param: torch.Tensor, entry: Mapping[str, Any], config: StateConfig) -> Changes:
        return conformed(entry, config.stochastic, config.position)

    def release(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        state.pop(SEED, None)


COUNTER = RoundingCounter()
