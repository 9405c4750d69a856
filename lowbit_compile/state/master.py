"""The master residual of a 16-bit parameter (``master_weights="exact" | "8bit"``), one kind of per-parameter
state (``kind.StateKind``).

A bf16/fp16 parameter stepped with master weights has, next to its stock states (fp32, as stepping an
fp32 master copy keeps them, then in their configured formats), the residual of its master
(``formats/residual.py``): ``master_residual`` shaped like the param (int16 exact, int8 lossy),
``master_ties`` (exact bf16: one bit per element, in int32 words of the local shard) and
``master_seed`` (lossy: the step counter of its stochastic rounding). Here they are created, kept in
step with the configuration (converted between modes through the master they hold), saved
(``codec.py``: raw bytes per parameter row, which every sharding reads and a stock loader's cast keeps),
loaded strictly, dropped by ``restore``, and the fp32 master of a parameter read from them.

fp32 parameters (a norm kept fp32 in a bf16 model) are their own master: the option leaves them as
they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..formats import residual
from ..formats.residual import KEYS, PARAM_DTYPES, RESIDUAL, SEED, TIES, MasterFormat
from . import codec, sharding
from .kind import Changes, StateConfig, as_fp32
from .quantized import QuantizedState
from .schema import StateSchema

CHUNK = 1 << 22  # elements per piece of a host-side conversion (whole tie words): bounded temporaries


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """A tiny fp32 tensor of ``param``'s rank and device: what the stock state is probed with under
    master weights (the fp32 recipe's states, dtypes included)."""
    return torch.empty((1,) * param.dim(), dtype=torch.float32, device=sharding.local(param).device)


# the master state -----------------------------------------------------------------------------------
def create(param: torch.Tensor, fmt: MasterFormat, position: int) -> dict[str, torch.Tensor]:
    """A zero residual (the master is the param's value), sharded like ``param``; an 8bit one's counter
    starts at ``first_counter(position)``, apart from every other parameter's."""
    shard = sharding.local(param)
    out = {RESIDUAL: sharding.like(torch.zeros(shard.shape, dtype=fmt.residual_dtype, device=shard.device), param)}
    if fmt.has_ties:
        out[TIES] = torch.zeros(residual.tie_words(shard.numel()), dtype=torch.int32, device=shard.device)
    if fmt.seeded:
        out[SEED] = torch.tensor(residual.first_counter(position), dtype=torch.float32)
    return out


def conformed(param: torch.Tensor, state: dict, fmt: MasterFormat | None, schema: StateSchema,
              position: int) -> dict[str, Any]:
    """What changes in ``state`` (None: the entry goes) so that it fits ``fmt``: per-element states of
    the schema's dtype (fp32 under a master), a residual of ``fmt`` (created, unpacked from a
    checkpoint, or converted from another mode through the master it holds), nothing of a master
    where there is none. ``position``: the param's in ``param_groups`` order. Reads ``state``,
    changes nothing."""
    out: dict[str, Any] = _unpacked(param, state)
    state = {**state, **out}
    has_master = any(k in state for k in KEYS)
    if fmt is None and not has_master:
        return out
    for key, dtype in schema.dtypes.items():
        value = state.get(key)
        if isinstance(value, torch.Tensor) and value.dtype != dtype:
            out[key] = _with_dtype(value, dtype)
    if fmt is None:
        return dict(out, **{k: None for k in KEYS if k in state})
    held = _held(param, state)
    if held is None:
        out.update(create(param, fmt, position))
    elif held[0] != fmt:
        out.update(_converted(param, held, fmt, position))
    for key in KEYS:
        if key in state and key not in fmt.keys():
            out[key] = None
    seed = state.get(SEED)
    if fmt.seeded and not isinstance(seed, torch.Tensor):
        out[SEED] = torch.tensor(residual.first_counter(position), dtype=torch.float32)
    elif fmt.seeded and seed.dtype != torch.float32:  # a stock loader cast it to the param's dtype
        out[SEED] = seed.detach().to(torch.float32)
    return out


def _held(param: torch.Tensor, state: dict) -> tuple[MasterFormat, torch.Tensor, torch.Tensor | None] | None:
    """The format, residual and tie words (local) that ``state`` holds, or None without a usable residual."""
    state = {**state, **_unpacked(param, state)}
    value = state.get(RESIDUAL)
    if not isinstance(value, torch.Tensor):
        return None
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"state {RESIDUAL!r} has shape {tuple(value.shape)}, its parameter {tuple(param.shape)}; "
                         "the optimizer state does not belong to these parameters")
    if sharding.is_sharded(value) != sharding.is_sharded(param):
        raise ValueError(f"state {RESIDUAL!r} and its parameter are not both DTensors; load the optimizer state "
                         "of a sharded model through torch.distributed.checkpoint's set_state_dict")
    if param.dtype not in PARAM_DTYPES:
        return None  # a residual for no 16-bit param: the master is the param
    dtypes = {torch.int16: "exact", torch.int8: "8bit"}
    if value.dtype not in dtypes:
        raise ValueError(f"state {RESIDUAL!r} is {value.dtype}, not int16 (exact) or int8 (8bit); the checkpoint "
                         "is corrupt or was saved for other parameters")
    fmt = MasterFormat(dtypes[value.dtype], param.dtype)
    ties = state.get(TIES)
    local = sharding.local(value)
    if fmt.has_ties and not (isinstance(ties, torch.Tensor) and ties.dtype == torch.int32
                              and ties.numel() == residual.tie_words(local.numel())):
        raise ValueError(f"state {RESIDUAL!r} of an exact bf16 master has no {TIES!r} of its size; the "
                         "checkpoint is truncated or was saved for other parameters")
    return fmt, local, ties if fmt.has_ties else None


def _converted(param: torch.Tensor, held: tuple, fmt: MasterFormat, position: int) -> dict[str, torch.Tensor]:
    """The residual of ``fmt`` for the master another residual holds (the param does not change:
    either residual's master rounds to it)."""
    old, codes, ties = held
    shard = sharding.local(param)
    out = create(param, fmt, position)
    for start, stop in chunks(shard.numel()):
        master = residual.read(shard.reshape(-1)[start:stop], codes.reshape(-1)[start:stop], _words(ties, start, stop),
                               old)
        store(out, fmt, residual.encode(master, fmt, offset=start), start, stop)
    return out


def chunks(n: int) -> list[tuple[int, int]]:
    """Pieces ``[start, stop)`` of ``n`` elements that a host-side conversion takes at a time."""
    return [(start, min(n, start + CHUNK)) for start in range(0, n, CHUNK)]


def _words(ties: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """The tie words of elements ``[start, stop)`` (``start`` a multiple of 32)."""
    return None if ties is None else ties[start // 32:residual.tie_words(stop)]


def store(made: dict[str, torch.Tensor], fmt: MasterFormat, encoded: tuple, start: int, stop: int) -> None:
    """Elements ``[start, stop)`` of ``residual.encode``'s codes and tie flags into the state ``made``."""
    _, code, flags = encoded
    sharding.local(made[RESIDUAL]).view(-1)[start:stop].copy_(code)
    if flags is not None:
        made[TIES][start // 32:residual.tie_words(stop)].copy_(residual.pack_ties(flags))


def _with_dtype(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A per-element state as ``dtype`` (a quantized one keeps its codes: its values are read as ``dtype``)."""
    held = sharding.local(value)
    if isinstance(held, QuantizedState):
        return sharding.like(QuantizedState(held.storage_parts, held.fmt, held.shape, dtype), value)
    return sharding.like(held.to(dtype), value)


def release(param: torch.Tensor, state: dict) -> None:
    """``restore``: the stock state of a 16-bit ``param`` stepped without a master. The residual goes
    (the param already is the master rounded to nearest even, as the fp32 recipe leaves it) and the
    per-element states take the param's dtype, which the stock step needs."""
    if not any(k in state for k in KEYS):
        return
    for key in KEYS:
        state.pop(key, None)
    for key, value in list(state.items()):
        if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape
                and value.dtype != param.dtype):
            state[key] = value.to(param.dtype)


# checkpoints ---------------------------------------------------------------------------------------------
def _unpacked(param: torch.Tensor, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The master's entries of ``state`` that are saved bytes, read back for ``param``'s shard."""
    out = {}
    if codec.is_packed_residual(state.get(RESIDUAL)):
        out[RESIDUAL] = codec.unpack_residual(state[RESIDUAL], param)
    if codec.is_packed_ties(state.get(TIES)):
        out[TIES] = codec.unpack_ties(state[TIES], param)
    if codec.is_packed_counter(state.get(SEED)):
        out[SEED] = codec.unpack_counter(state[SEED], SEED)
    return out


def loaded(param: torch.Tensor, entry: Mapping[str, Any], fmt: MasterFormat, schema: StateSchema,
           position: int) -> dict[str, Any]:
    """The master's entries of a saved ``entry`` (its per-element states already read) as ``param``
    keeps them under ``fmt`` (None: the entry goes): checked strictly
    (a residual, tie table or counter that does not fit is an error, never replaced by a fresh one),
    moved to the param's device, converted from another mode; a checkpoint without them (stock, or of
    the fp32 recipe) gives a zero residual (the master is the param)."""
    device = sharding.local(param).device
    entry = {**entry, **_unpacked(param, entry)}
    for key in (RESIDUAL, TIES):
        value = entry.get(key)
        if key not in entry:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"state {key!r} is a {type(value).__name__}, not a tensor; the checkpoint is corrupt")
        entry[key] = value if sharding.is_sharded(value) else value.to(device).contiguous()
    if SEED in entry:
        entry[SEED] = codec.checked_counter(entry[SEED], SEED)
    if RESIDUAL not in entry and (TIES in entry or SEED in entry):
        raise ValueError(f"the checkpoint holds {sorted(k for k in KEYS if k in entry)} but no {RESIDUAL!r}; "
                         "it is truncated or corrupt")
    out = {k: entry[k] for k in KEYS if k in entry}
    out.update(conformed(param, entry, fmt, schema, position))
    return out


# the fp32 master -----------------------------------------------------------------------------------------
def master_of(param: torch.Tensor, state: dict) -> torch.Tensor | None:
    """The fp32 master of ``param``'s local shard that ``state`` holds (None: it holds no residual)."""
    held = _held(param, state) if param.dtype in PARAM_DTYPES else None
    if held is None:
        return None
    fmt, codes, ties = held
    shard = sharding.local(param).detach()
    out = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
    for start, stop in chunks(shard.numel()):
        out[start:stop] = residual.read(shard.reshape(-1)[start:stop], codes.reshape(-1)[start:stop],
                                        _words(ties, start, stop), fmt)
    return out.view(shard.shape)


@torch.no_grad()
def set_master(param: torch.Tensor, state: dict[str, Any], master: torch.Tensor, fmt: MasterFormat | None,
               position: int) -> None:
    """Set ``param`` (and its residual under ``fmt``) from its fp32 ``master``: a 16-bit param with master
    weights to the master rounded to nearest even and the residual it loses (its rounding counter kept), any
    other param to the master's value."""
    shard, value = sharding.local(param), sharding.local(master).to(torch.float32)
    if fmt is None:
        shard.copy_(value)
        return
    seed = state.get(SEED)
    made = create(param, fmt, position)
    flat, values = shard.view(-1) if shard.is_contiguous() else shard.reshape(-1).clone(), value.reshape(-1)
    for start, stop in chunks(shard.numel()):
        encoded = residual.encode(values[start:stop].to(shard.device), fmt,
                                  float(seed) if seed is not None else 0.0, offset=start)
        flat[start:stop].copy_(encoded[0])
        store(made, fmt, encoded, start, stop)
    if not shard.is_contiguous():
        shard.copy_(flat.view(shard.shape))
    if seed is not None:
        made[SEED] = seed
    for key in KEYS:
        state.pop(key, None)
    state.update(made)


class MasterResidual:
    """The master residual as a kind of per-parameter state (``kind.StateKind``)."""

    keys = KEYS

    def conformed(self, param: torch.Tensor, state: Mapping[str, Any], config: StateConfig) -> Changes:
        return conformed(param, dict(state), config.master, config.schema, config.position)

    def pack(self, entry: Mapping[str, Any], param: torch.Tensor) -> Changes:
        out = {}
        if isinstance(entry.get(RESIDUAL), torch.Tensor):
            out[RESIDUAL] = codec.pack_residual(entry[RESIDUAL], param)
        if isinstance(entry.get(TIES), torch.Tensor):
            out[TIES] = codec.pack_ties(entry[TIES], param)
        if isinstance(entry.get(SEED), torch.Tensor):
            out[SEED] = codec.pack_counter(entry[SEED])
        return out

    def loaded(self, param: torch.Tensor, entry: Mapping[str, Any], config: StateConfig) -> Changes:
        """Without master weights the master's entries go (the stock loader never sees them); with them,
        :func:`loaded`, and the other scalar states of the saved entry (ASGD's ``eta``, ``mu``) as the fp32
        step of the master keeps them."""
        if config.master is None:
            return {k: None for k in KEYS if k in entry}
        out = {key: as_fp32(value, param) for key, value in entry.items()
               if key not in config.formats and isinstance(value, torch.Tensor) and key not in ("step", *KEYS)}
        out.update(loaded(param, {**entry, **out}, config.master, config.schema, config.position))
        return out

    def release(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        release(param, state)


MASTER = MasterResidual()
