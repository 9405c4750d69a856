"""Checkpoints of wrapped optimizers: compact quantized states in ``state_dict()``, an exact
``load_state_dict()`` at any sharding, conversion of stock or other-format states, an fp32 export.

A quantized state is saved *packed*: a plain dict of tensors, strings and int lists (so
``torch.load(weights_only=True)`` reads it), never fp32. Its tensors are laid out by parameter row
(dim 0), which is how FSDP2 shards, so one form serves every world size:

* ``codes``: per row, the row's code bytes (raw ``uint8``, whatever the code dtype);
* ``block_scales`` / ``block_patch_values`` / ``block_patch_index``: per row, the scale and outlier
  patches of every block that intersects the row (``_slots`` of them, zero-padded);
* ``row_splits``: where the shards the blocks were counted in start and end (blocks start at each
  shard's first element), plus ``lowbit_format`` (format tag), ``shape`` and ``dtype``. These
  four are text stored as one int each (little-endian UTF-8, e.g. ``"0,65,129"``), because a state
  dict that torch flattens (``flatten_optimizer_state_dict``) may hold only tensors, ints, floats
  and dicts.

For a ``DTensor`` parameter every tensor is a ``DTensor`` sharded on dim 0 like the parameter, so
``torch.distributed.checkpoint`` saves each rank's rows and hands any world size (or an unsharded
model) exactly the rows it needs. Loading keeps the saved blocks bit for bit where they are the
blocks of the loading shard (same sharding), re-quantizes the others from the saved values, then
brings the state to the optimizer's configured format: stock fp32 states get quantized, other
formats or block sizes get converted, and a state that cannot be read fails naming it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

import torch

from . import sharding
from .kernels import blockquant
from .kernels.formats import StateFormat, decode
from .kernels.residual import KEYS as MASTER_KEYS
from .state import QuantizedState

_PENDING = "_lowbit_pending"
_TABLES = ("block_scales", "block_patch_values", "block_patch_index")
_TEXT = ("lowbit_format", "shape", "dtype", "row_splits")


def is_packed(value: object) -> bool:
    """Whether ``value`` is a quantized state as ``state_dict()`` saves it."""
    return isinstance(value, dict) and "lowbit_format" in value


# state_dict() ---------------------------------------------------------------------------------------
def pack_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post hook: replace every quantized state by its packed form."""
    params = {idx: p for saved, group in zip(state_dict["param_groups"], opt.param_groups)
              for idx, p in zip(saved["params"], group["params"])}
    packed = {}
    for idx, entry in state_dict["state"].items():
        if any(sharding.is_quantized(v) for v in entry.values()):
            entry = {k: (pack(v, params[idx]) if sharding.is_quantized(v) else v) for k, v in entry.items()}
        packed[idx] = entry
    state_dict["state"] = packed
    return state_dict


def pack(value: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """The packed form of one quantized state of ``param`` (``DTensor``s for a ``DTensor`` param)."""
    qs: QuantizedState = sharding.local(value)
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    tables = {"codes": qs.codes.view(torch.uint8).view(stop - start, width * qs.codes.element_size())}
    if qs.fmt.blockwise:
        scales, values, index = _row_tables(qs, width)
        # patch offsets as raw bytes too: gloo and NCCL cannot gather or broadcast int16
        tables.update(zip(_TABLES, (scales, values, index.view(torch.uint8))))
    return {
        "lowbit_format": _int(qs.fmt.tag()),
        "shape": _int(",".join(map(str, param.shape))),
        "dtype": _int(str(qs.dtype).removeprefix("torch.")),
        "row_splits": _int(",".join(map(str, sharding.row_splits(param)))),
        **{name: sharding.like(t, param, (rows, *t.shape[1:])) for name, t in tables.items()},
    }


def _int(text: str) -> int:
    return int.from_bytes(text.encode(), "little")


def _text(value: int) -> str:
    return value.to_bytes((value.bit_length() + 7) // 8, "little").decode()


def _slots(width: int, block_size: int) -> int:
    """The most blocks a row of ``width`` elements can intersect, wherever blocks start."""
    return (width + block_size - 2) // block_size + 1


def _row_tables(qs: QuantizedState, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``qs``, the scale and patches of each block that intersects it, in block order."""
    b, device = qs.fmt.block_size, qs.scales.device
    offset = torch.arange(qs.codes.numel() // width, device=device) * width
    block = offset[:, None] // b + torch.arange(_slots(width, b), device=device)
    valid = (block <= (offset[:, None] + width - 1) // b) & (block < qs.scales.numel())
    # each part with one zero row appended, which padding slots (and an empty shard) read
    scales, values, index = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in qs.storage_parts[1:])
    block = torch.where(valid, block, qs.scales.numel())
    return scales[block], values[block], index[block]


# load_state_dict() ---------------------------------------------------------------------------------
def unpack_pre_hook(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``load_state_dict`` pre hook: take the packed states out before the stock loader casts their
    tensors to the parameter dtype; :func:`reinsert_packed` puts them back afterwards. A packed
    state that cannot be read fails here, before the stock loader changes anything."""
    position = saved_positions(state_dict)
    params = [p for group in opt.param_groups for p in group["params"]]
    pending: dict[int, dict] = {}
    plain: dict = {}
    for idx, entry in state_dict["state"].items():
        ours = {k: v for k, v in entry.items() if is_packed(v)}
        if ours and position[idx] < len(params):
            for key, packed in ours.items():
                _read_header(packed, params[position[idx]], key)
        if ours:
            pending[position[idx]] = ours
            entry = {k: v for k, v in entry.items() if k not in ours}
        plain[idx] = entry
    opt.__dict__[_PENDING] = pending
    return {**state_dict, "state": plain}


def saved_positions(state_dict: dict) -> dict[int, int]:
    """Each saved parameter id's position over all groups (how the stock loader matches params)."""
    ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    return {idx: i for i, idx in enumerate(ids)}


def reinsert_packed(opt: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post hook: put the packed states back under their parameters (matched by
    position, as the stock loader matches), for :func:`converted` to turn into states."""
    pending = opt.__dict__.pop(_PENDING, {})
    params = [p for group in opt.param_groups for p in group["params"]]
    for position, entries in pending.items():
        opt.state[params[position]].update(entries)


def converted(param: torch.Tensor, key: str, value: object, fmt: StateFormat) -> torch.Tensor | None:
    """``value`` (the state ``key`` of ``param``) stored in ``fmt`` and sharded like ``param``, or
    ``None`` where nothing changes (it already is, or it is not a per-element state).

    Takes what a loader may leave in ``optimizer.state``: packed states (of any format, block size
    or sharding), stock dense tensors, and quantized states of another format.
    """
    packed = is_packed(value)
    if packed:
        value = unpack(value, param, key)
    elif not isinstance(value, torch.Tensor):
        return None
    elif value.shape != param.shape:
        raise ValueError(
            f"state {key!r} of a parameter of shape {tuple(param.shape)} has shape "
            f"{tuple(value.shape)}; the optimizer state does not belong to these parameters"
        )
    elif sharding.is_sharded(param) != sharding.is_sharded(value):
        kinds = ["a DTensor" if sharding.is_sharded(t) else "a plain tensor" for t in (value, param)]
        raise ValueError(
            f"state {key!r} is {kinds[0]} but its parameter is {kinds[1]}; load the optimizer state "
            "of a sharded model through torch.distributed.checkpoint's set_state_dict"
        )
    held = sharding.local(value)
    if (held.fmt == fmt) if isinstance(held, QuantizedState) else fmt.passthrough:
        return value if packed else None
    return sharding.quantize(value, fmt)


def conform(param: torch.Tensor, state: dict, formats: dict[str, StateFormat]) -> None:
    """Bring ``param``'s per-element states to ``formats`` in place (see :func:`converted`)."""
    for key, fmt in formats.items():
        new = converted(param, key, state.get(key), fmt)
        if new is not None:
            state[key] = new


def unpack(packed: dict[str, Any], param: torch.Tensor, key: str = "state") -> torch.Tensor:
    """The state a packed dict holds, for this rank's shard of ``param``, in the saved format.

    The blocks of the shard are the saved blocks (bit for bit) wherever a saved block has the same
    first element and length; the other blocks are re-quantized from the saved values.
    """
    fmt, _, dtype, splits = _read_header(packed, param, key)
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    shard = sharding.local(param)
    codes = _codes(packed, fmt, start, stop, rows).to(shard.device)
    if not fmt.blockwise:
        empty = blockquant.empty(0, fmt, shard.device)
        return sharding.like(QuantizedState(blockquant.Quantized(codes, *empty[1:]), fmt, shard.shape, dtype), param)
    saved = _saved_blocks(packed, fmt, splits, start, stop, width)
    n, b = codes.numel(), fmt.block_size
    first = start * width + torch.arange(blockquant.n_blocks(n, fmt)) * b
    length = torch.clamp(start * width + n - first, max=b)
    at = torch.searchsorted(saved.first, first).clamp(max=max(saved.first.numel() - 1, 0))
    same = (saved.first[at] == first) & (saved.length[at] == length) if saved.first.numel() else first < 0
    if bool(same.all()):
        parts = blockquant.Quantized(codes, saved.scales[at], saved.patch_values[at], saved.patch_index[at])
        return sharding.like(QuantizedState(parts, fmt, shard.shape, dtype), param)
    qs = QuantizedState.from_dense(_dequantize(codes, saved, start * width, fmt).to(dtype).view(shard.shape), fmt)
    hit, keep = same.nonzero().squeeze(1), at[same]
    qs.scales[hit] = saved.scales[keep]
    qs.patch_values[hit] = saved.patch_values[keep]
    qs.patch_index[hit] = saved.patch_index[keep]
    exact = same.repeat_interleave(length)
    _bits(qs.codes)[exact] = _bits(codes)[exact]
    return sharding.like(qs, param)


class _Header(NamedTuple):
    """The text fields of a packed state, read."""

    fmt: StateFormat
    shape: torch.Size
    dtype: torch.dtype
    row_splits: list[int]


def _header(packed: dict[str, Any]) -> _Header:
    text = {name: _text(packed[name]) for name in _TEXT}
    fmt = StateFormat.from_tag(text["lowbit_format"])
    dtype = getattr(torch, text["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {text['dtype']!r}")
    missing = {"codes", *(_TABLES if fmt.blockwise else ())} - packed.keys()
    if missing:
        raise ValueError(f"it lacks {sorted(missing)}")
    shape = torch.Size(int(n) for n in text["shape"].split(",") if n)
    return _Header(fmt, shape, dtype, [int(n) for n in text["row_splits"].split(",")])


def _check_splits(header: _Header) -> None:
    splits, rows = header.row_splits, _rows(header.shape)[0]
    if splits[0] != 0 or splits[-1] != rows or any(a > b for a, b in zip(splits, splits[1:])):
        raise ValueError(f"row_splits {splits} do not split the {rows} rows of the parameter")


def _read_header(packed: dict[str, Any], param: torch.Tensor, key: str) -> _Header:
    """The header of a packed state, after checking it can be read and belongs to ``param``."""
    try:
        header = _header(packed)
    except (ValueError, TypeError, AttributeError, KeyError, UnicodeDecodeError) as err:
        raise ValueError(
            f"state {key!r} of a parameter of shape {tuple(param.shape)} is not a lowbit_compile state "
            f"this version can read ({type(err).__name__}: {err})"
        ) from err
    if header.shape != param.shape:
        raise ValueError(
            f"state {key!r} was saved for a parameter of shape {tuple(header.shape)}, not "
            f"{tuple(param.shape)}; the optimizer state does not belong to these parameters"
        )
    try:
        _check_splits(header)
    except ValueError as err:
        raise ValueError(f"state {key!r} of a parameter of shape {tuple(param.shape)}: {err}") from err
    return header


class _Blocks(NamedTuple):
    """Saved blocks in order: first element (flat, in the whole parameter), length, scale, patches."""

    first: torch.Tensor
    length: torch.Tensor
    scales: torch.Tensor
    patch_values: torch.Tensor
    patch_index: torch.Tensor


def _codes(packed: dict[str, Any], fmt: StateFormat, start: int, stop: int, rows: int) -> torch.Tensor:
    """The flat codes of rows ``[start, stop)``, in the format's code dtype."""
    return _rows_of(packed["codes"], start, stop, rows).contiguous().view(fmt.code_dtype).reshape(-1)


def _saved_blocks(packed: dict, fmt: StateFormat, row_splits: list[int], start: int, stop: int,
                  width: int) -> _Blocks:
    """Every saved block that holds an element of rows ``[start, stop)``."""
    b, rows, splits = fmt.block_size, row_splits[-1], torch.tensor(row_splits)
    scales, values, index = (_rows_of(packed[name], start, stop, rows) for name in _TABLES)
    index = index.contiguous().view(blockquant.PATCH_INDEX_DTYPE)
    row = torch.arange(start, stop)
    shard = torch.searchsorted(splits, row, right=True) - 1
    shard_first, shard_numel = splits[shard] * width, (splits[shard + 1] - splits[shard]) * width
    offset = row * width - shard_first  # the row's first element, counted from its shard's first
    block = offset[:, None] // b + torch.arange(scales.shape[1])
    valid = (block <= (offset[:, None] + width - 1) // b) & (block * b < shard_numel[:, None])
    first = shard_first[:, None] + block * b
    length = torch.clamp(shard_numel[:, None] - block * b, max=b)
    first, order = torch.unique(first[valid], return_inverse=True)  # a block spanning rows is in each
    pick = torch.empty(first.numel(), dtype=torch.long).scatter_(0, order, torch.arange(order.numel()))
    return _Blocks(first, length[valid][pick], scales[valid][pick], values[valid][pick], index[valid][pick])


def _dequantize(codes: torch.Tensor, saved: _Blocks, offset: int, fmt: StateFormat) -> torch.Tensor:
    """fp32 values of elements ``offset, offset + 1, ...`` of the parameter, from codes and blocks."""
    n = codes.numel()
    element = offset + torch.arange(n)
    block = torch.searchsorted(saved.first, element, right=True) - 1
    if n and (bool((block < 0).any()) or bool((element >= saved.first[block] + saved.length[block]).any())):
        raise ValueError("the checkpoint holds no block scale for some elements of this shard; it is "
                         "truncated or was saved for other parameters")
    values = decode(codes, fmt) * saved.scales[block]
    index = saved.patch_index.long()
    position = saved.first[:, None] + index - offset
    inside = (index < saved.length[:, None]) & (position >= 0) & (position < n)
    values[position[inside]] = saved.patch_values[inside].float()
    return values


def _rows_of(t: torch.Tensor, start: int, stop: int, rows: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a saved table: its local part if it is a ``DTensor`` that holds
    exactly those rows, a slice if it is a full (gathered or unsharded) tensor."""
    if sharding.is_sharded(t):
        if sharding.local_rows(t) != (start, stop):
            raise ValueError(
                f"this checkpoint tensor holds rows {sharding.local_rows(t)} but the parameter's shard is "
                f"rows {(start, stop)}; load sharded optimizer state through torch.distributed.checkpoint "
                "(get_state_dict, dcp.load, set_state_dict), which reshards"
            )
        return sharding.local(t)
    if t.shape[0] != rows:
        raise ValueError(f"a checkpoint tensor of shape {tuple(t.shape)} does not have the parameter's {rows} rows")
    return t[start:stop]


def _bits(codes: torch.Tensor) -> torch.Tensor:
    """Codes viewed as integers of their width (masked writes work on those for every code dtype)."""
    return codes.view({1: torch.uint8, 2: torch.int16}[codes.element_size()])


def _rows(shape: torch.Size) -> tuple[int, int]:
    """Rows (dim 0) and elements per row of a parameter shape (a 0-d parameter is one row of one)."""
    if len(shape) == 0:
        return 1, 1
    return shape[0], math.prod(shape[1:])


# export ---------------------------------------------------------------------------------------------
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
    state_dict = source.state_dict() if isinstance(source, torch.optim.Optimizer) else source
    state = {idx: {k: (_dense(v) if is_packed(v) else v) for k, v in entry.items() if k not in MASTER_KEYS}
             for idx, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _dense(packed: dict[str, Any]) -> torch.Tensor:
    """The dense tensor a packed state holds: this rank's rows in a ``DTensor`` if its tensors are
    ``DTensor``s, else the whole state."""
    header = _header(packed)
    _check_splits(header)
    fmt, shape, dtype, splits = header
    rows, width = _rows(shape)
    codes = packed["codes"]
    start, stop = sharding.local_rows(codes) if sharding.is_sharded(codes) else (0, rows)
    local = _codes(packed, fmt, start, stop, rows)
    if fmt.blockwise:
        values = _dequantize(local, _saved_blocks(packed, fmt, splits, start, stop, width), start * width, fmt)
    else:
        values = decode(local, fmt)
    values = values.to(dtype)
    if not sharding.is_sharded(codes):
        return values.view(shape)
    return sharding.like(values.view(stop - start, *shape[1:]), codes, shape)
