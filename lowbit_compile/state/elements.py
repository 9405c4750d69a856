"""The per-element states (``exp_avg``, ``exp_avg_sq``, ...), the stock step's own states stored in their
configured formats: one kind of per-parameter state (``kind.StateKind``). Each is converted from whatever
holds it (a stock tensor, a quantized state of another format, a packed state a loader left) into its
configured format, saved packed (``codec.py``), loaded strictly and dequantized by ``restore``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..formats import StateFormat
from . import codec, sharding
from .kind import Changes, StateConfig, as_fp32
from .quantized import QuantizedState
from .stock import guard_stock_steps


def converted(param: torch.Tensor, key: str, value: object, fmt: StateFormat,
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``value`` (the state ``key`` of ``param``) stored in ``fmt`` and sharded like ``param``, or
    ``None`` where nothing changes (it already is, or it is not a per-element state).

    Takes what a loader may leave in ``optimizer.state``: packed states (of any format, block size
    or sharding, their bytes cast to another dtype included), stock dense tensors, and quantized
    states of another format. ``dtype``: the one the optimizer keeps the state in, which a packed
    state is read as (``codec.unpack``).
    """
    packed = codec.is_packed(value)
    if packed:
        guard_stock_steps()
        value = codec.unpack(value, param, key, dtype)
    elif not isinstance(value, torch.Tensor):
        return None
    elif value.shape != param.shape:
        raise ValueError(
            f"state {key!r} of a parameter of shape {tuple(param.shape)} has shape "
            f"{tuple(value.shape)}; the optimizer state does not belong to these parameters (it was saved for "
            "another model, or its param_groups list them in another order): load the optimizer state saved "
            "with this model, or load only the model's and start the optimizer afresh"
        )
    elif sharding.is_sharded(param) != sharding.is_sharded(value):
        kinds = ["a DTensor" if sharding.is_sharded(t) else "a plain tensor" for t in (value, param)]
        raise ValueError(
            f"state {key!r} is {kinds[0]} but its parameter is {kinds[1]}; load the optimizer state "
            "of a sharded model through torch.distributed.checkpoint's set_state_dict"
        )
    elif not (value.is_floating_point() or isinstance(sharding.local(value), QuantizedState)):
        raise ValueError(f"state {key!r} is a {value.dtype} tensor; per-element states are floating point")
    held = sharding.local(value)
    if (held.fmt == fmt) if isinstance(held, QuantizedState) else fmt.passthrough:
        return value if packed else None
    return sharding.quantize(value, fmt)


def _stock_cast(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """What the stock loader makes of a saved state other than ``step``: the param's device, and its dtype
    where the param is floating (``Optimizer._process_value_according_to_param_policy``)."""
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


class PerElementStates:
    """The per-element states as a kind of per-parameter state (``kind.StateKind``); which keys are the
    schema's (``StateConfig.formats``)."""

    def conformed(self, param: torch.Tensor, state: Mapping[str, Any], config: StateConfig) -> Changes:
        """Each per-element state in its configured format (every new one built before any is stored)."""
        updates = {key: converted(param, key, state.get(key), fmt, config.dtypes.get(key))
                   for key, fmt in config.formats.items()}
        return {k: v for k, v in updates.items() if v is not None}

    def pack(self, entry: Mapping[str, Any], param: torch.Tensor) -> Changes:
        return {k: codec.pack(v, param) for k, v in entry.items() if sharding.is_quantized(v)}

    def loaded(self, param: torch.Tensor, entry: Mapping[str, Any], config: StateConfig) -> Changes:
        """Each saved per-element state converted to its configured format (a stock tensor first cast as the
        stock loader casts it, or to fp32 where the fp32 step of a master keeps it); one that needs no
        conversion is left to the stock loader, but under a master. A low-bit state the step does not keep
        per element is refused."""
        out = {}
        for key, value in entry.items():
            fmt = config.formats.get(key)
            packed = codec.is_packed(value)
            if fmt is None:
                if packed:
                    raise ValueError(f"the checkpoint holds a low-bit state {key!r}, which {config.optimizer} does "
                                     f"not keep per element ({sorted(config.formats)}); load a checkpoint of this "
                                     "optimizer")
                continue
            if not packed and isinstance(value, torch.Tensor):
                value = _stock_cast(param, value) if config.master is None else as_fp32(value, param)
            elif not packed:
                raise ValueError(f"state {key!r} is a {type(value).__name__}, not a tensor; load a checkpoint of "
                                 "this optimizer")
            new = converted(param, key, value, fmt, config.dtypes.get(key))
            if new is not None or config.master is not None:
                out[key] = value if new is None else new
        return out

    def release(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Every quantized state dequantized (one of the meta device, which holds no values, as an empty one)."""
        for key, value in list(state.items()):
            if sharding.is_quantized(value):
                state[key] = torch.empty(value.shape, dtype=value.dtype, device="meta") if value.is_meta \
                    else sharding.dequantize(value)


PER_ELEMENT = PerElementStates()
