"""fp32 master weights of 16-bit params kept in the optimizer state (``master_weights="exact" | "8bit"``).

A bf16/fp16 parameter stepped with master weights has, next to its stock states (fp32, as stepping an
fp32 master copy keeps them, then in their configured formats), the residual of its master
(``formats/residual.py``): ``master_residual`` shaped like the param (int16 exact, int8 lossy),
``master_ties`` (exact bf16: one bit per element, in int32 words of the local shard) and
``master_seed`` (lossy: the step counter of its stochastic rounding). Here they are created, kept in
step with the configuration, saved as raw bytes per parameter row (every sharding reads them, and a
stock loader's cast to the param's dtype keeps them), loaded (read and checked in
``checkpoint.prepare_load``, out of the stock loader's way), dropped by ``restore``, and the fp32
masters exported and imported for checkpoints of the fp32 master recipe.

fp32 parameters (a norm kept fp32 in a bf16 model) are their own master: the option leaves them as
they are, and warns only when no parameter of the optimizer is 16-bit, where it can do nothing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import checkpoint, sharding
from .config import Config
from .formats import residual
from .formats.residual import KEYS, PARAM_DTYPES, RESIDUAL, SEED, TIES, MasterFormat
from .state import QuantizedState
from .state_schema import StateSchema
from .wrapped import wrapped_of

_PACKED_TIES, _PACKED_RESIDUAL, _PACKED_SEED = "lowbit_master_ties", "lowbit_master_residual", "lowbit_master_seed"
_CHUNK = 1 << 22  # elements per piece of a host-side conversion (whole tie words): bounded temporaries


def format_for(param: torch.Tensor, config: Config) -> MasterFormat | None:
    """How ``param`` keeps its master under ``config`` (None: it is fp32, or the option is off)."""
    if config.master_weights is None or param.dtype not in PARAM_DTYPES:
        return None
    return MasterFormat(config.master_weights, param.dtype)


def stand_in(param: torch.Tensor) -> torch.Tensor:
    """A tiny fp32 tensor of ``param``'s rank and device: what the stock state is probed with under
    master weights (the fp32 recipe's states, dtypes included)."""
    return torch.empty((1,) * param.dim(), dtype=torch.float32, device=sharding.local(param).device)


def warn_if_no_effect(opt: torch.optim.Optimizer, config: Config) -> None:
    """One warning when ``master_weights`` is set but no parameter of ``opt`` is bf16 or fp16."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if config.master_weights is not None and params and all(p.dtype not in PARAM_DTYPES for p in params):
        warnings.warn(f"master_weights={config.master_weights!r} has no effect: every parameter of this "
                      f"{type(opt).__name__} is {params[0].dtype}, its own master; it keeps the fp32 "
                      "master of bfloat16 and float16 parameters", stacklevel=3)


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
    for key, (kind, *rest) in schema.init:
        value = state.get(key)
        if kind in ("fill", "computed") and isinstance(value, torch.Tensor) and value.dtype != rest[-1]:
            out[key] = _with_dtype(value, rest[-1])
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
    for start, stop in _chunks(shard.numel()):
        master = residual.read(shard.reshape(-1)[start:stop], codes.reshape(-1)[start:stop], _words(ties, start, stop),
                               old)
        _store(out, fmt, residual.encode(master, fmt, offset=start), start, stop)
    return out


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(start, min(n, start + _CHUNK)) for start in range(0, n, _CHUNK)]


def _words(ties: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """The tie words of elements ``[start, stop)`` (``start`` a multiple of 32)."""
    return None if ties is None else ties[start // 32:residual.tie_words(stop)]


def _store(made: dict[str, torch.Tensor], fmt: MasterFormat, encoded: tuple, start: int, stop: int) -> None:
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


# checkpoints ------------------------------------------------------------------------------------------
def is_packed_ties(value: object) -> bool:
    return isinstance(value, dict) and _PACKED_TIES in value


def _is_packed(value: object, marker: str) -> bool:
    return isinstance(value, dict) and marker in value


def pack_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``state_dict`` post hook: the master's entries saved as raw bytes (``uint8``, whose values a stock
    loader's cast to the param's dtype keeps exactly, as for the packed states): the residual's bytes
    and the tie bits per parameter row (a DTensor sharded like a DTensor param, so a checkpoint loads at
    any sharding), the step counter's four bytes."""
    params = {idx: p for saved, group in zip(state_dict["param_groups"], opt.param_groups)
              for idx, p in zip(saved["params"], group["params"])}
    for idx, entry in list(state_dict["state"].items()):
        packed = {}
        if isinstance(entry.get(RESIDUAL), torch.Tensor):
            packed[RESIDUAL] = _pack_residual(entry[RESIDUAL], params[idx])
        if isinstance(entry.get(TIES), torch.Tensor):
            packed[TIES] = _pack_ties(entry[TIES], params[idx])
        if isinstance(entry.get(SEED), torch.Tensor):
            packed[SEED] = pack_counter(entry[SEED])
        if packed:
            state_dict["state"][idx] = {**entry, **packed}
    return state_dict


def _pack_residual(value: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """The residual's bytes per parameter row, ``(rows, width * code bytes)``: a view of the live state."""
    local = sharding.local(value)
    rows, width = checkpoint._rows(param.shape)
    start, stop = sharding.local_rows(param)
    size = local.element_size()
    table = local.reshape(-1).view(torch.uint8).view(stop - start, width * size)
    return {_PACKED_RESIDUAL: size, "bytes": sharding.like(table, param, (rows, width * size))}


def _unpacked(param: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
    """The master's entries of ``state`` that are saved bytes, read back for ``param``'s shard."""
    out = {}
    if _is_packed(state.get(RESIDUAL), _PACKED_RESIDUAL):
        out[RESIDUAL] = _unpack_residual(state[RESIDUAL], param)
    if is_packed_ties(state.get(TIES)):
        out[TIES] = _unpack_ties(state[TIES], param)
    if is_packed_counter(state.get(SEED)):
        out[SEED] = unpack_counter(state[SEED], SEED)
    return out


def pack_counter(value: torch.Tensor) -> dict[str, Any]:
    """A step counter of stochastic rounding (fp32, 0-d) as its four bytes, which a stock loader's cast keeps."""
    return {_PACKED_SEED: 1, "bytes": value.detach().reshape(1).view(torch.uint8)}


def is_packed_counter(value: object) -> bool:
    return _is_packed(value, _PACKED_SEED)


def checked_counter(value: object, key: str) -> torch.Tensor:
    """A step counter of stochastic rounding read from a checkpoint as the step keeps it (fp32, 0-d, on
    the CPU), after checking that it is one whole number in ``[0, SEED_PERIOD)``, as every step leaves
    it: the kernels take it as an unsigned 32-bit integer, which no other value converts to."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
        raise ValueError(f"state {key!r} is a {type(value).__name__} of {getattr(value, 'numel', lambda: '?')()} "
                         "elements, not one number; the checkpoint is corrupt")
    number = float(value.detach().to("cpu", torch.float64).reshape(()))
    if not (math.isfinite(number) and number.is_integer() and 0 <= number < residual.SEED_PERIOD):
        raise ValueError(f"state {key!r} is {number}, not a whole number in [0, {residual.SEED_PERIOD}) as every "
                         "step leaves it; the checkpoint is corrupt")
    return torch.tensor(number, dtype=torch.float32)


def unpack_counter(packed: dict[str, Any], key: str) -> torch.Tensor:
    """The counter (fp32, 0-d, on the CPU) that :func:`pack_counter` saved as state ``key``."""
    raw = packed.get("bytes")
    if not isinstance(raw, torch.Tensor) or raw.numel() != 4:
        raise ValueError(f"saved {key!r} are not the four bytes of one number; the checkpoint is corrupt")
    return checked_counter(checkpoint._as_bytes(raw.reshape(4), key).to("cpu").view(torch.float32).reshape(()), key)


def _unpack_residual(packed: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """The residual of ``param``'s shard (sharded like it) from its saved per-row bytes."""
    width = packed[_PACKED_RESIDUAL]
    dtype = {1: torch.int8, 2: torch.int16}.get(width) if type(width) is int else None
    table = packed.get("bytes")
    if dtype is None or not isinstance(table, torch.Tensor):
        raise ValueError(f"saved {RESIDUAL!r} are not a table of int8 or int16 codes; the checkpoint is corrupt")
    rows, width = checkpoint._rows(param.shape)
    start, stop = sharding.local_rows(param)
    table = checkpoint._as_bytes(checkpoint._rows_of(table, start, stop, rows), RESIDUAL)
    if table.shape[1:] != (width * dtype.itemsize,):
        raise ValueError(f"saved {RESIDUAL!r} of shape {tuple(table.shape)} do not fit a parameter of shape "
                         f"{tuple(param.shape)}; the checkpoint is truncated or was saved for other parameters")
    shard = sharding.local(param)
    return sharding.like(table.to(shard.device).contiguous().view(dtype).view(shard.shape), param)


def _pack_ties(words: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """Rows of whole bytes (``width % 8 == 0``: every 2-D weight of a usual model) are the words' own
    bytes (little-endian: element i is bit i % 8 of byte i // 8), a view, as a state dict holds the
    live states; other widths are repacked, a chunk of rows at a time."""
    rows, width = checkpoint._rows(param.shape)
    start, stop = sharding.local_rows(param)
    local, row_bytes = stop - start, -(-width // 8)
    if width % 8 == 0:
        packed = words.view(torch.uint8)[:local * row_bytes].view(local, row_bytes)
    else:
        packed = torch.empty(local, row_bytes, dtype=torch.uint8, device=words.device)
        step = max(32, _CHUNK // width // 32 * 32)  # rows per chunk, a multiple of 32: whole tie words
        for r0 in range(0, local, step):
            r1 = min(local, r0 + step)
            flags = residual.unpack_ties(words[r0 * width // 32:residual.tie_words(r1 * width)], (r1 - r0) * width)
            bits = torch.zeros(r1 - r0, row_bytes * 8, dtype=torch.int32, device=words.device)
            bits[:, :width] = flags.view(r1 - r0, width)
            packed[r0:r1] = (bits.view(r1 - r0, row_bytes, 8) << torch.arange(8, device=words.device)).sum(2)
    return {_PACKED_TIES: 1, "bits": sharding.like(packed, param, (rows, row_bytes))}


def _unpack_ties(packed: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """The local tie words of ``param``'s shard from a saved per-row table."""
    rows, width = checkpoint._rows(param.shape)
    start, stop = sharding.local_rows(param)
    bits = packed.get("bits")
    if not isinstance(bits, torch.Tensor):
        raise ValueError(f"saved {TIES!r} have no table of bits; the checkpoint is corrupt")
    table = checkpoint._as_bytes(checkpoint._rows_of(bits, start, stop, rows), TIES)
    if table.shape[1:] != (-(-width // 8),):
        raise ValueError(f"saved {TIES!r} of shape {tuple(table.shape)} do not fit a parameter of shape "
                         f"{tuple(param.shape)}")
    table = table.to(sharding.local(param).device)
    local = stop - start
    words = torch.zeros(residual.tie_words(local * width), dtype=torch.int32, device=table.device)
    if width % 8 == 0:
        words.view(torch.uint8)[:local * width // 8].copy_(table.reshape(-1))
        return words
    step = max(32, _CHUNK // width // 32 * 32)
    for r0 in range(0, local, step):
        r1 = min(local, r0 + step)
        flags = ((table[r0:r1].to(torch.int32)[:, :, None] >> torch.arange(8, device=table.device)) & 1)
        words[r0 * width // 32:residual.tie_words(r1 * width)] = residual.pack_ties(
            flags.reshape(r1 - r0, -1)[:, :width].reshape(-1).bool())
    return words


def loaded(param: torch.Tensor, entry: dict, fmt: MasterFormat, schema: StateSchema, position: int) -> dict[str, Any]:
    """The master's entries of a saved ``entry`` (its per-element states already read) as ``param``
    keeps them under ``fmt`` (None: the entry goes), for ``checkpoint.prepare_load``: checked strictly
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
        entry[SEED] = checked_counter(entry[SEED], SEED)
    if RESIDUAL not in entry and (TIES in entry or SEED in entry):
        raise ValueError(f"the checkpoint holds {sorted(k for k in KEYS if k in entry)} but no {RESIDUAL!r}; "
                         "it is truncated or corrupt")
    out = {k: entry[k] for k in KEYS if k in entry}
    out.update(conformed(param, entry, fmt, schema, position))
    return out


# the fp32 masters in and out ---------------------------------------------------------------------------
def master_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The fp32 master of every parameter of ``opt``, in ``param_groups`` order: what an fp32 master
    copy holds. A 16-bit param with master weights joins its residual (every bit with ``"exact"``,
    within the lossy residual's step with ``"8bit"``); any other param is its own master (a copy, as
    fp32). DTensor params give DTensors."""
    out = []
    for group in opt.param_groups:
        for param in group["params"]:
            value = master_of(param, opt.state.get(param, {}))
            out.append(sharding.like(value if value is not None else sharding.local(param).detach().to(
                torch.float32, copy=True), param))
    return out


def master_of(param: torch.Tensor, state: dict) -> torch.Tensor | None:
    """The fp32 master of ``param``'s local shard that ``state`` holds (None: it holds no residual)."""
    held = _held(param, state) if param.dtype in PARAM_DTYPES else None
    if held is None:
        return None
    fmt, codes, ties = held
    shard = sharding.local(param).detach()
    out = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
    for start, stop in _chunks(shard.numel()):
        out[start:stop] = residual.read(shard.reshape(-1)[start:stop], codes.reshape(-1)[start:stop],
                                        _words(ties, start, stop), fmt)
    return out.view(shard.shape)


@torch.no_grad()
def load_master_params(opt: torch.optim.Optimizer, masters: Sequence[torch.Tensor]) -> None:
    """Set every parameter of ``opt`` from its fp32 master (``param_groups`` order, as
    :func:`master_params` gives them, e.g. the fp32 copies of a mixed-precision checkpoint): 16-bit
    params with master weights to the master rounded to nearest even and the residual it loses, other
    params to the master's value. Checks every shape first; changes nothing when one does not fit."""
    wrapped = wrapped_of(opt)
    if wrapped is None:
        raise ValueError("load_master_params needs an optimizer wrapped by lowbit_compile (master_weights=...)")
    params = [p for group in opt.param_groups for p in group["params"]]
    masters = list(masters)
    if len(masters) != len(params):
        raise ValueError(f"got {len(masters)} master tensors for the optimizer's {len(params)} parameters")
    for i, (param, master) in enumerate(zip(params, masters)):
        if not isinstance(master, torch.Tensor) or tuple(master.shape) != tuple(param.shape):
            raise ValueError(f"master {i} has shape {tuple(getattr(master, 'shape', ()))}, its parameter "
                             f"{tuple(param.shape)}")
        if not master.is_floating_point():
            raise ValueError(f"master {i} is {master.dtype}, not a floating-point tensor")
    for position, (param, master) in enumerate(zip(params, masters)):
        fmt = format_for(param, wrapped.config)
        shard, value = sharding.local(param), sharding.local(master).to(torch.float32)
        if fmt is None:
            shard.copy_(value)
            continue
        state = opt.state[param]
        seed = state.get(SEED)
        made = create(param, fmt, position)
        flat, values = shard.view(-1) if shard.is_contiguous() else shard.reshape(-1).clone(), value.reshape(-1)
        for start, stop in _chunks(shard.numel()):
            encoded = residual.encode(values[start:stop].to(shard.device), fmt,
                                      float(seed) if seed is not None else 0.0, offset=start)
            flat[start:stop].copy_(encoded[0])
            _store(made, fmt, encoded, start, stop)
        if not shard.is_contiguous():
            shard.copy_(flat.view(shard.shape))
        if seed is not None:
            made[SEED] = seed
        for key in KEYS:
            state.pop(key, None)
        state.update(made)
