"""The step counter of stochastically rounded states (``rounding="stochastic"``, ``formats/rounding.py``):
one 0-d fp32 ``rounding_seed`` per parameter in the optimizer state, created when a state of the
parameter first rounds stochastically (at a start apart for each parameter, ``first_counter``),
advanced by the step itself, saved as its four bytes (like the master residual's counter, so a stock
loader's cast to a bf16 param's dtype cannot round it) and read back on the next step, so a resumed
run draws the bits the uninterrupted one would."""

from __future__ import annotations

from typing import Any

import torch

from . import master
from .formats.residual import first_counter
from .formats.rounding import SEED


def conformed(state: dict, stochastic: bool, position: int) -> dict[str, Any]:
    """What changes in ``state`` (None: the entry goes) so that its counter fits: created (at
    ``first_counter(position)``) where a state rounds stochastically and none is held, read back from
    saved bytes, back to fp32 on the CPU after a cast, dropped where no state rounds stochastically.
    Reads ``state``, changes nothing."""
    value = state.get(SEED)
    if not stochastic:
        return {SEED: None} if SEED in state else {}
    if master.is_packed_counter(value):
        return {SEED: master.unpack_counter(value, SEED)}
    if value is None:
        return {SEED: torch.tensor(first_counter(position), dtype=torch.float32)}
    checked = master.checked_counter(value, SEED)
    if value.dtype != torch.float32 or value.device.type != "cpu" or value.dim():
        return {SEED: checked}
    return {}


def pack_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` post hook: every parameter's counter saved as its four bytes."""
    for idx, entry in list(state_dict["state"].items()):
        if isinstance(entry.get(SEED), torch.Tensor):
            state_dict["state"][idx] = {**entry, SEED: master.pack_counter(entry[SEED])}
    return state_dict
