"""What a stock optimizer and stock tools see of a low-bit checkpoint: the refusal a stock loader meets in
its entries (their ``step``, or every tensor of an optimizer that keeps no step, pickled as
:data:`STOCK_REFUSAL`), the step pre-hook that fails a stock step over packed states naming the fix, and the
export to a stock fp32 state dict (:func:`stock_state_dict`).
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..formats.residual import KEYS as MASTER_KEYS
from ..formats.rounding import SEED as ROUNDING_SEED
from .codec import dense, is_packed

REFUSED_PREFIX = "lowbit_"  # a refused value is saved under this prefix and its key
STOCK_REFUSAL = (
    b"this is a lowbit_compile low-bit optimizer state, which a stock optimizer cannot load. Resume it with "
    b"lowbit_compile(opt, ...) (or inside lowbit_compile.enable()) before load_state_dict, and call "
    b"lowbit_compile.restore(opt) for stock fp32 states; or load "
    b"lowbit_compile.checkpoint.stock_state_dict(checkpoint) into the stock optimizer"
)



# state_dict() ---------------------------------------------------------------------------------------
class _Refused(dict):
    """A saved entry: itself in memory, pickled as an ``OrderedDict`` (which a weights-only ``torch.load``
    reads) with each of its ``refused`` keys' values as :data:`STOCK_REFUSAL` and the value under
    ``lowbit_<key>``."""

    def __init__(self, entry: Mapping, refused: tuple[str, ...]) -> None:
        super().__init__(entry)
        self.refused = refused

    def __reduce_ex__(self, protocol: Any) -> tuple:
        saved = {**self, **{k: STOCK_REFUSAL for k in self.refused},
                 **{REFUSED_PREFIX + k: self[k] for k in self.refused}}
        return collections.OrderedDict, (), None, None, iter(saved.items())


def mark_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post hook, the last: where any entry holds a low-bit state (a packed
    dict), a stock optimizer must not apply any of it. An entry with a step and a low-bit state pickles
    with its step refused (a stock load fails on it); in an optimizer that keeps no step (SGD), every
    fp32 state of the entries pickles refused, so a stock step fails at its first param, as it does on
    a packed one, before anything changes. A state dict without low-bit states stays stock."""
    state = state_dict["state"]
    if not any(is_packed(v) for entry in state.values() for v in entry.values()):
        return state_dict

    def refused(entry: Mapping) -> tuple[str, ...]:
        if "step" in entry:
            return ("step",) if any(is_packed(v) for v in entry.values()) else ()
        return tuple(k for k, v in entry.items() if isinstance(k, str) and isinstance(v, torch.Tensor))

    state_dict["state"] = {idx: (_Refused(entry, keys) if (keys := refused(entry)) else entry)
                           for idx, entry in state.items()}
    return state_dict


def unmarked(entry: Mapping) -> Mapping:
    """A saved entry with its own values back where a pickled entry had :data:`STOCK_REFUSAL`."""
    if not isinstance(entry, Mapping):
        return entry
    refused = [k for k, v in entry.items() if isinstance(v, bytes)]
    if not refused:
        return entry
    if any(not isinstance(k, str) or REFUSED_PREFIX + k not in entry for k in refused):
        raise ValueError(f"a saved entry's {refused} are bytes without their 'lowbit_<name>': the checkpoint "
                         "is corrupt")
    moved = {REFUSED_PREFIX + k for k in refused}
    return {**{k: v for k, v in entry.items() if k not in moved}, **{k: entry[REFUSED_PREFIX + k] for k in refused}}


def step_restored(state: Mapping) -> dict:
    """The changes (None: removed) that put back the values of a live state a loader left as pickled
    (``ZeroRedundancyOptimizer`` copies entries into its inner optimizer's state itself)."""
    restored = unmarked(state)
    if restored is state:
        return {}
    return {**{k: v for k, v in restored.items() if state.get(k) is not v},
            **{k: None for k in state if k not in restored}}


def unmarked_state_dict(state_dict: dict) -> dict:
    """``state_dict`` with every entry :func:`unmarked` (the same object if none was marked)."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping):
        return state_dict
    out = {}
    for idx, entry in state.items():
        try:
            out[idx] = unmarked(entry)
        except ValueError as err:
            raise ValueError(f"the checkpoint's state[{idx!r}]: {err}") from None
    if all(out[idx] is entry for idx, entry in state.items()):
        return state_dict
    return {**state_dict, "state": out}


# export ---------------------------------------------------------------------------------------------------
def stock_state_dict(source: torch.optim.Optimizer | dict) -> dict:
    """A stock ``torch.optim`` state dict, every state dense in its stock dtype (fp32 for fp32
    parameters), from a wrapped optimizer or from a state dict one saved.

    Load it into an unwrapped ``Adam``/``AdamW``, or hand it to any tool that expects stock
    checkpoints::

        torch.optim.AdamW(model.parameters()).load_state_dict(stock_state_dict(torch.load(path)))

    States of ``DTensor`` parameters stay ``DTensor`` (each rank's rows), as stock AdamW keeps them.
    The residuals of master weights are left out: with ``master.master_params`` (the fp32 masters) this
    is the checkpoint of the fp32 master recipe.
    """
    state_dict = unmarked_state_dict(source.state_dict() if isinstance(source, torch.optim.Optimizer) else source)
    state = {idx: {k: (dense(v) if is_packed(v) else v) for k, v in entry.items()
                   if k not in MASTER_KEYS and k != ROUNDING_SEED}
             for idx, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}



# a stock step over packed states ---------------------------------------------------------------------
_guard_lock = threading.Lock()
_guard_handle: list = []
_clean_states: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_HANDLED_ELSEWHERE: list[Callable[[torch.optim.Optimizer], bool]] = []


def refuse_packed_states(opt: torch.optim.Optimizer) -> None:
    """Fail naming the fix if the stock step of ``opt`` is about to run over packed low-bit states
    (a lowbit_compile checkpoint loaded into an optimizer that is not wrapped), before it changes
    anything. Checked once per ``opt.state`` object, which every ``load_state_dict`` replaces."""
    state = opt.__dict__.get("state")
    if state is None or _clean_states.get(opt) == id(state):
        return
    for param, entry in state.items():
        ours = sorted({k.removeprefix(REFUSED_PREFIX) for k, v in entry.items() if isinstance(k, str) and (
            is_packed(v) or (isinstance(v, bytes) and v == STOCK_REFUSAL))}) if isinstance(entry, dict) else []
        if ours:
            raise RuntimeError(
                f"this {type(opt).__name__} is a stock optimizer, but its states {ours} (of a parameter of shape "
                f"{tuple(getattr(param, 'shape', ()))}) are lowbit_compile low-bit states, loaded from a checkpoint "
                "saved with them. "
                f"Wrap it with lowbit_compile(opt, ...) (or step it inside lowbit_compile.enable()) before loading "
                "to resume with low-bit states, or load lowbit_compile.checkpoint.stock_state_dict(state_dict) "
                "to continue with stock fp32 states"
            )
    _clean_states[opt] = id(state)


def guard_stock_steps() -> None:
    """Register (once per process) the step pre-hook that runs :func:`refuse_packed_states` before
    every stock step: at ``import lowbit_compile`` (so a stock optimizer that loaded a low-bit
    checkpoint in a process that imports it fails naming the fix, not on the bytes the checkpoint
    holds for it), and wherever lowbit_compile is used (a wrap, an ``enable`` scope, a packed state
    written or read). The hook does nothing inside ``torch.compile``: a compiled stock step traces
    none of it."""
    with _guard_lock:
        if not _guard_handle:
            _guard_handle.append(register_optimizer_step_pre_hook(_guard_hook))


def defer_to(handles: Callable[[torch.optim.Optimizer], bool]) -> None:
    """Leave to the caller the optimizers for which ``handles(opt)`` is true (it rewrites them, or
    their step is not a stock update over their own state)."""
    _HANDLED_ELSEWHERE.append(handles)


def _guard_hook(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():  # a constant to dynamo: nothing below enters a compiled stock step
        return
    if not any(handles(opt) for handles in _HANDLED_ELSEWHERE):
        refuse_packed_states(opt)


