"""The wire codec: how every kind of per-parameter state is saved in a state dict and read back, the one
place a stored layout is defined. Every packed state carries :data:`LAYOUT_VERSION` (``lowbit_layout``;
one saved before layouts carried it is layout 0, which this version reads alike), and one saved by a newer
lowbit-compile is refused, naming the fix.

A quantized state is saved *packed*: a plain dict of tensors and ints (so
``torch.load(weights_only=True)`` reads it), never fp32. Every tensor in it is raw bytes
(``uint8``), so a stock ``load_state_dict`` that casts them to the parameter's dtype (as it does
when the optimizer is rewritten only at its first step, under ``enable()``) keeps their values
exactly, and they are recovered at that step:

* ``codes``: per parameter row (dim 0), the row's code bytes. A 4-bit format's row holds ``ceil(width / 2)``
  bytes, its codes packed from the row's first element (``formats/packing.py``; an odd row's last high nibble
  0): that is the stored bytes themselves (a view) where rows are even, a repacked copy where they are odd and
  the parameter is a ``DTensor``; a plain parameter's odd rows keep the stored bytes flat, ``(ceil(numel / 2),)``
  (a view: a row of a 1-D parameter costs half a byte, not one);
* ``block_scales`` / ``block_patch_values`` / ``block_patch_index``: the bytes of each block's fp32
  scale, bf16 patch values and int16 patch offsets, in one of three layouts:

  - *by block* ``(blocks, bytes)``: one record per block, in order, for parameters that are not
    ``DTensor``s: every shape (1-D ones and FSDP1's flat buffers included) costs one code byte per
    element plus one record per block, and every tensor is a view of the live state (no copy).
  - *by row* ``(rows, slots, bytes)``: per row, every block that intersects it (``_slots`` of
    them, zero-padded), for ``DTensor`` parameters (FSDP2) with rows of a block or more: dim 0 is
    how FSDP2 shards, so ``torch.distributed.checkpoint`` hands any world size exactly the rows it
    needs, without collectives.
  - *gathered* ``(capacity, bytes)``: for ``DTensor`` parameters with rows narrower than a block
    (1-D ones), where a record per row would cost more than the codes: the records of every
    shard's blocks, gathered from all ranks (``state_dict()`` is then a collective: every rank
    calls it, as ``get_state_dict`` does), listed in order and zero-padded to ``_capacity``: one
    per block of the parameter, plus one per 8 blocks (at least 64), room for the blocks of any
    sharding into up to that many shards plus one. A plain tensor of the same shape at every
    world size, which each rank holds whole. Shards with more blocks than that are saved
    re-quantized as one tensor (each value within the format's resolution of the held one): only
    such a state does not resume bit for bit.

* ``row_splits``: where the shards the blocks were counted in start and end (blocks start at each
  shard's first element), plus ``lowbit_format`` (format tag), ``shape`` and ``dtype``. These four
  are text stored as one int each (little-endian UTF-8, e.g. ``"0,65,129"``; evenly chunked shards
  whose list would pass the 255 bytes a weights-only ``torch.load`` reads in an int as ``"*65"``),
  because a state dict that torch flattens (``flatten_optimizer_state_dict``) may hold only tensors,
  ints, floats and dicts.

For a plain parameter every tensor of ``state_dict()`` is a view of the live state (as stock
AdamW's are); for a ``DTensor`` one, every tensor is a copy taken at the call. Either way the parts
of one state never disagree. :func:`unpack` keeps the saved blocks bit for bit where they are the blocks
of the loading shard (same sharding) and re-quantizes the others from the saved values. Every field is
checked against the parameter before anything whose size the file claims is read.

The master residual of a 16-bit parameter is saved as its raw bytes per parameter row, its tie bits per
row (a DTensor sharded like a DTensor param, so a checkpoint loads at any sharding), and a step counter of
stochastic rounding as its four bytes: raw ``uint8``, whose values a stock loader's cast to the param's
dtype keeps exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..formats import StateFormat, blockquant, decode
from ..formats import residual as residual_format
from ..formats.packing import pack4, unpack4
from ..formats.residual import RESIDUAL, SEED_PERIOD, TIES
from . import sharding
from .quantized import QuantizedState, bits_of

LAYOUT_VERSION = 1  # the layout every packed state is saved in; 0: saved before states carried it
_VERSION = "lowbit_layout"

_TABLES = ("block_scales", "block_patch_values", "block_patch_index")
_RECORD_DTYPES = (torch.float32, blockquant.PATCH_VALUE_DTYPE, blockquant.PATCH_INDEX_DTYPE)


def is_packed(value: object) -> bool:
    """Whether ``value`` is a quantized state as ``state_dict()`` saves it."""
    return isinstance(value, dict) and "lowbit_format" in value



def layout_version(packed: Mapping) -> int:
    """The layout a packed state was saved in (0 where it carries none); a ValueError for a value that is
    no version, or for a layout newer than this version of lowbit-compile reads, naming the fix."""
    version = packed.get(_VERSION, 0)
    if type(version) is not int or version < 0:
        raise ValueError(f"its {_VERSION!r} is {version!r:.40}, not a layout version; the checkpoint is corrupt")
    if version > LAYOUT_VERSION:
        raise ValueError(f"it was saved in layout {version} by a newer lowbit-compile, and this version reads "
                         f"layouts 0 to {LAYOUT_VERSION}: upgrade lowbit-compile (pip install -U lowbit-compile) to "
                         "load it")
    return version


def pack(value: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """The packed form of one quantized state of ``param`` (``DTensor`` codes for a ``DTensor`` param;
    a collective over its mesh if its rows are narrower than a block: see the module docstring)."""
    qs: QuantizedState = sharding.local(value)
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    sharded = sharding.is_sharded(param)
    parts = qs.storage_parts
    if sharded or not all(_owns_storage(t) for t in parts):
        # copies: a DTensor's row tables are computed, and a view into a larger buffer would make
        # torch.save write the whole buffer; all parts copied alike, so they never disagree
        parts = blockquant.Quantized(*(t.clone() for t in parts))
    splits = sharding.row_splits(param)
    gathered = sharded and qs.fmt.blockwise and width < qs.fmt.block_size
    if gathered:
        parts, splits = _gathered(parts, param, qs, splits)
    tables = {"codes": _code_table(parts.codes, qs.fmt, stop - start, width, per_row=sharded)}
    if qs.fmt.blockwise:
        records = _row_tables(parts, stop - start, width, qs.fmt) if sharded and not gathered else parts[1:]
        tables.update(zip(_TABLES, (_as_record_bytes(t) for t in records)))
    out = {
        _VERSION: LAYOUT_VERSION,
        "lowbit_format": _int(qs.fmt.tag()),
        "shape": _int(",".join(map(str, param.shape))),
        "dtype": _int(str(qs.dtype).removeprefix("torch.")),
        "row_splits": _int(_splits_text(splits)),
    }
    if qs.fmt.spec.map_version is not None:
        out["lowbit_map"] = qs.fmt.spec.map_version  # no tag: a version-1 map (converted on load)
    for name, t in tables.items():
        by_rows = sharded and (name == "codes" or not gathered)
        out[name] = sharding.like(t, param, (rows, *t.shape[1:])) if by_rows else t
    return out


def _capacity(numel: int, block_size: int) -> int:
    """Records in a gathered table, the same at every world size: one per block of the parameter and
    room for the partial blocks of ``max(blocks // 8, 64) + 1`` shards (``n`` shards add at most ``n - 1``)."""
    blocks = -(-numel // block_size)
    return blocks + max(blocks // 8, 64)


def _gathered(parts: blockquant.Quantized, param: torch.Tensor, qs: QuantizedState, splits: list[int]
              ) -> tuple[blockquant.Quantized, list[int]]:
    """This rank's codes with the block records of every shard of ``param`` (in row order, zero-padded
    to ``_capacity`` records), and the row splits those blocks were counted in (``splits``, ``param``'s
    own): a collective over ``param``'s mesh. Shards with more blocks than that are re-quantized as one
    tensor, on blocks counted from its first element."""
    fmt, (rows, width) = qs.fmt, _rows(param.shape)
    ranges = sharding.shard_ranges(param)
    counts = [-(-(hi - lo) * width // fmt.block_size) for lo, hi in ranges]
    records = torch.cat([_as_record_bytes(t) for t in parts[1:]], dim=1)
    most = max(counts)
    padded = torch.cat([records, records.new_zeros(most - records.shape[0], records.shape[1])])
    every = sharding.like(padded, param, (len(ranges) * most, records.shape[1])).full_tensor()
    listed = torch.cat([every[i * most:i * most + n] for i, n in enumerate(counts)])
    scales, values, index = _records(list(torch.split(listed, _record_widths(fmt), dim=1)))
    capacity = _capacity(rows * width, fmt.block_size)
    if scales.numel() > capacity:
        start, stop = sharding.local_rows(param)
        local_codes = _code_table(parts.codes, fmt, stop - start, width, per_row=True)
        codes = _table_codes(sharding.like(local_codes, param, (rows, local_codes.shape[1])).full_tensor(), fmt, width)
        blocks = _listed(splits, width, fmt.block_size, scales, values, index)
        blocks = _Blocks(*(t.to(codes.device) for t in blocks))
        whole = blockquant.quantize(_dequantize(codes, blocks, 0, fmt).to(qs.dtype), fmt)
        mine = blockquant.unpacked_codes(whole.codes, rows * width, fmt)[start * width:stop * width]
        parts, splits = whole._replace(codes=blockquant.stored_codes(mine, fmt)), [0, rows]
        scales, values, index = whole[1:]
    pad = capacity - scales.shape[0]
    tables = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (scales, values, index))
    return blockquant.Quantized(parts.codes, *tables), splits


def _code_table(codes: torch.Tensor, fmt: StateFormat, n_rows: int, width: int, per_row: bool) -> torch.Tensor:
    """The saved code bytes of ``n_rows`` rows of ``width`` from the stored ``codes``: per row, a view where
    rows start on a byte; a 4-bit format's odd rows repacked per row (a copy) where ``per_row``, else the
    stored bytes flat (a view)."""
    if not fmt.packed:
        return codes.view(torch.uint8).view(n_rows, width * fmt.code_dtype.itemsize)
    if width % 2 == 0:
        return codes.view(n_rows, width // 2)
    if not per_row:
        return codes
    rows = unpack4(codes, n_rows * width, fmt.code_dtype).view(torch.uint8).view(n_rows, width)
    return pack4(torch.cat([rows, rows.new_zeros(n_rows, 1)], dim=1)).view(n_rows, (width + 1) // 2)


def _table_codes(table: torch.Tensor, fmt: StateFormat, width: int) -> torch.Tensor:
    """The flat codes, one a ``fmt.code_dtype`` element (a 4-bit format's unpacked), of a per-row table of
    code bytes (``_code_table``'s, or a checkpoint's, whose shape is checked)."""
    table = table.contiguous()
    if not fmt.packed:
        return table.view(fmt.code_dtype).reshape(-1)
    return unpack4(table.reshape(-1), table.numel() * 2, fmt.code_dtype).view(table.shape[0], -1)[:, :width].reshape(-1)


def _owns_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _as_record_bytes(t: torch.Tensor) -> torch.Tensor:
    """A table of per-block values (``(blocks,)`` or ``(..., K)``) viewed as raw bytes, last dim bytes."""
    if t.dim() == 1 or (t.dim() == 2 and t.dtype == torch.float32):
        t = t.unsqueeze(-1)
    return t.view(torch.uint8)


def _int(text: str) -> int:
    return int.from_bytes(text.encode(), "little")


def _text(value: int) -> str:
    return value.to_bytes((value.bit_length() + 7) // 8, "little").decode()


def _slots(width: int, block_size: int) -> int:
    """The most blocks a row of ``width`` elements can intersect, wherever blocks start."""
    return (width + block_size - 2) // block_size + 1


def _row_tables(parts: blockquant.Quantized, n_rows: int, width: int, fmt: StateFormat
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (``n_rows`` of ``width``), the scale and patches of each block that intersects it, in block order."""
    b, device = fmt.block_size, parts.scales.device
    n_rows = n_rows if width else 0
    offset = torch.arange(n_rows, device=device) * width
    block = offset[:, None] // b + torch.arange(_slots(width, b), device=device)
    valid = (block <= (offset[:, None] + width - 1) // b) & (block < parts.scales.numel())
    # each part with one zero row appended, which padding slots (and an empty shard) read
    scales, values, index = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in parts[1:])
    block = torch.where(valid, block, parts.scales.numel())
    return scales[block], values[block], index[block]


def unpack(packed: dict[str, Any], param: torch.Tensor, key: str = "state", dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """The state a packed dict holds, for this rank's shard of ``param``, in the saved format.

    The blocks of the shard are the saved blocks (bit for bit) wherever a saved block has the same
    first element and length; the other blocks are re-quantized from the saved values. ``dtype``: the
    one the optimizer keeps the state in; the saved one must be a dtype it would keep it in
    (:func:`kept_dtypes`), and the state is read as ``dtype``.
    """
    header = _read_header(packed, param, key)
    fmt, _, saved_dtype, splits = header
    if dtype is not None and saved_dtype not in kept_dtypes(param, dtype):
        raise ValueError(
            f"state {key!r} was saved as {saved_dtype} for a {param.dtype} parameter whose optimizer keeps it "
            f"{' or '.join(map(str, kept_dtypes(param, dtype)))}: it belongs to another model or is corrupt")
    dtype = saved_dtype if dtype is None else dtype
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    shard = sharding.local(param)
    try:
        codes = _codes(packed, fmt, start, stop, rows, width).to(shard.device)
        if not fmt.blockwise:
            empty = blockquant.empty(0, fmt, shard.device)
            qs = QuantizedState(blockquant.Quantized(codes, *empty[1:]), fmt, shard.shape, dtype)
            return sharding.like(qs, param)
        saved = _saved_blocks(packed, header, start, stop, width)
        version = _map_version(packed, fmt)
    except ValueError as err:
        raise ValueError(f"state {key!r}: {err}") from err
    saved = _Blocks(*(t.to(shard.device) for t in saved))
    if version is not None and version < fmt.spec.map_version:  # codes of an older map: this one's nearest
        at_element = torch.searchsorted(saved.first, start * width + torch.arange(codes.numel()), right=True) - 1
        codes = fmt.spec.upgrade_codes(codes, fmt, torch.signbit(saved.scales[at_element.clamp(min=0)]))
    n, b = codes.numel(), fmt.block_size
    first = start * width + torch.arange(blockquant.n_blocks(n, fmt), device=shard.device) * b
    length = torch.clamp(start * width + n - first, max=b)
    at = torch.searchsorted(saved.first, first).clamp(max=max(saved.first.numel() - 1, 0))
    same = (saved.first[at] == first) & (saved.length[at] == length) if saved.first.numel() else first < 0
    stored = blockquant.stored_codes(codes, fmt)
    if bool(same.all()):
        parts = blockquant.Quantized(stored, saved.scales[at], saved.patch_values[at], saved.patch_index[at])
        return sharding.like(QuantizedState(parts, fmt, shard.shape, dtype), param)
    qs = QuantizedState.from_dense(_dequantize(codes, saved, start * width, fmt).to(dtype).view(shard.shape), fmt)
    hit, keep = same.nonzero().squeeze(1), at[same]
    qs.scales[hit] = saved.scales[keep]
    qs.patch_values[hit] = saved.patch_values[keep]
    qs.patch_index[hit] = saved.patch_index[keep]
    exact = same.repeat_interleave(length)
    held = blockquant.unpacked_codes(qs.codes, n, fmt)  # the stored codes themselves unless packed
    bits_of(held)[exact] = bits_of(codes)[exact]
    if fmt.packed:
        qs.codes.copy_(pack4(held))
    return sharding.like(qs, param)


def saved_format(packed: dict[str, Any]) -> StateFormat:
    """The format a packed state was saved in (its header checked already)."""
    return StateFormat.from_tag(_field(packed, "lowbit_format"))


def kept_dtypes(param: torch.Tensor, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a checkpoint may hold a per-element state of ``param`` in, where the optimizer keeps
    it in ``dtype``: that one, and for a 16-bit parameter both what its stock step keeps (the param's
    dtype) and what its fp32 master's keeps (fp32), so a run resumes with or without master weights."""
    if param.dtype in (torch.bfloat16, torch.float16):
        return tuple(dict.fromkeys((dtype, param.dtype, torch.float32)))
    return (dtype,)


def _map_version(packed: dict[str, Any], fmt: StateFormat) -> int | None:
    """The version of the code map a state's codes were saved in (1 before maps were tagged); None for a
    format whose map has no versions (``ElementFormat.map_version``)."""
    latest = fmt.spec.map_version
    if latest is None:
        return None
    version = packed.get("lowbit_map", 1)
    if not isinstance(version, int) or not 1 <= version <= latest:
        raise ValueError(f"its {fmt.name} codes use map version {version!r}, newer than this version of "
                         f"lowbit_compile reads (1..{latest}): upgrade lowbit_compile to load it")
    return version


class _Header(NamedTuple):
    """The fields of a packed state, read and checked against each other and its tables."""

    fmt: StateFormat
    shape: torch.Size
    dtype: torch.dtype
    row_splits: torch.Tensor  # int64, on the CPU


# A header field is at most this many bytes: all that pack() writes (but a long uneven row_splits) and all
# that a weights-only torch.load reads in an int. Checked before a field is decoded.
_FIELD_BYTES = 255
_FLOAT_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values()
                 if isinstance(d, torch.dtype) and d.is_floating_point}
_MAX_EMPTY_SHARDS = 1 << 16  # even row splits of a parameter without elements: more shards than this are refused


class _OtherParameter(ValueError):
    """A packed state saved for a parameter of another shape (``args[0]``)."""


def _field(packed: dict[str, Any], name: str, limit: int = _FIELD_BYTES) -> str:
    """Header field ``name`` as text, refused before it is decoded unless it is an int of at most ``limit`` bytes."""
    value = packed[name]
    if type(value) is not int or value < 0:
        raise ValueError(f"its {name!r} is a {type(value).__name__}, not a header field")
    if value.bit_length() > 8 * limit:
        raise ValueError(f"its {name!r} is {(value.bit_length() + 7) // 8} bytes long, more than the {limit} it can be")
    return _text(value)


def _header(packed: dict[str, Any], shape: torch.Size | None = None) -> tuple[StateFormat, torch.Size, torch.dtype]:
    """The format, shape and dtype of a packed state, each field checked before it is used. ``shape``
    is the parameter's where there is one: a state saved for another shape is refused here
    (:class:`_OtherParameter`), before anything whose size the file claims is read."""
    tag = _field(packed, "lowbit_format")
    fmt = StateFormat.from_tag(tag)
    if fmt.blockwise and not (1 <= fmt.block_size <= 32768 and 0 <= fmt.outliers <= min(fmt.block_size, 64)):
        raise ValueError(f"format {tag!r} has a block size or outlier count no lowbit_compile writes")
    dtype = _FLOAT_DTYPES.get(name := _field(packed, "dtype"))
    if dtype is None:
        raise ValueError(f"unknown or non-floating-point dtype {name!r}")
    missing = {"codes", *(_TABLES if fmt.blockwise else ())} - packed.keys()
    if missing:
        raise ValueError(f"it lacks {sorted(missing)}")
    dims = tuple(int(n) for n in _field(packed, "shape").split(",") if n)
    if shape is not None and dims != tuple(shape):
        raise _OtherParameter(dims)
    if any(not 0 <= n < 2**63 for n in dims):
        raise ValueError(f"shape {dims} is not the shape of a tensor")
    return fmt, torch.Size(dims), dtype


def _splits_text(splits: list[int]) -> str:
    """Row splits as text: ``"0,65,129"``, or ``"*65"`` (every 65 rows) where that list would pass
    255 bytes, which ``torch.load(weights_only=True)`` refuses in an int: FSDP2's shards are torch.chunk's
    of the rows, equal but the last, so at any world size the text stays short."""
    listed = ",".join(map(str, splits))
    step = splits[1] - splits[0] if len(splits) > 2 else 0
    even = step > 0 and splits == [*range(0, splits[-1], step), splits[-1]]
    return f"*{step}" if len(listed) > 255 and even else listed


def _parse_splits(packed: dict[str, Any], rows: int, width: int) -> torch.Tensor:
    """The row splits, at most as many as the parameter's rows allow (a list of them as long as its text,
    which is bounded by the rows; every ``step`` rows only when those shards are no more than its
    elements), never as many as the file claims."""
    text = _field(packed, "row_splits", max(_FIELD_BYTES, (rows + 1) * (len(str(rows)) + 1)))
    if text.startswith("*"):
        step = int(text[1:])
        if step <= 0:
            raise ValueError(f"row_splits {text!r} split the rows every {step}")
        if -(-rows // step) > max(rows * width, _MAX_EMPTY_SHARDS):
            raise ValueError(f"row_splits {text!r} split the {rows} rows into more shards than the parameter has "
                             "elements")
        return torch.cat([torch.arange(0, rows, min(step, max(rows, 1))), torch.tensor([rows])])
    splits = [int(n) for n in text.split(",")]
    if any(not 0 <= n <= rows for n in splits):
        raise ValueError(f"row_splits {_brief(splits)} do not split the {rows} rows of the parameter")
    return torch.tensor(splits, dtype=torch.int64)


def _brief(splits: torch.Tensor | list[int]) -> str:
    """Row splits for a message: all of them when there are few."""
    values = splits.tolist() if isinstance(splits, torch.Tensor) else splits
    if len(values) <= 8:
        return str(values)
    return f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)} of them)"


def _checked_header(packed: dict[str, Any], shape: torch.Size | None = None) -> _Header:
    """The header (see :func:`_header`), after checking that the codes have the saved shape's rows, that
    the row splits split them, and that every table has the shape its layout gives it (so a truncated
    or mismatched tensor fails here, before any is read)."""
    layout_version(packed)
    fmt, shape, dtype = _header(packed, shape)
    rows, width = _rows(shape)
    _check_table(packed, "codes", _codes_shape(packed["codes"], fmt, rows, width), fmt, shape)
    header = _Header(fmt, shape, dtype, _parse_splits(packed, rows, width))
    _check_splits(header)
    if fmt.blockwise:
        saved, padded = _n_saved_blocks(header, width), _capacity(rows * width, fmt.block_size)
        scales = packed["block_scales"]
        if not isinstance(scales, torch.Tensor):
            raise ValueError(f"its 'block_scales' is a {type(scales).__name__}, not a tensor")
        if scales.dim() == 3:
            lead = (rows, _slots(width, fmt.block_size))
        else:  # by block, or gathered and padded
            lead = (padded if scales.shape[0] == padded >= saved else saved,)
        for name, w in zip(_TABLES, _record_widths(fmt)):
            _check_table(packed, name, (*lead, w), fmt, shape)
    return header


def _check_splits(header: _Header) -> None:
    splits, rows = header.row_splits, _rows(header.shape)[0]
    if splits[0] != 0 or splits[-1] != rows or bool((splits[1:] < splits[:-1]).any()):
        raise ValueError(f"row_splits {_brief(splits)} do not split the {rows} rows of the parameter")


def _codes_shape(table: object, fmt: StateFormat, rows: int, width: int) -> tuple[int, ...]:
    """The shape the saved codes must have (``_code_table``'s): ``(rows, row bytes)``, or a plain
    parameter's 4-bit codes of odd rows flat (a 1-D table that is no ``DTensor``), ``(ceil(numel / 2),)``."""
    if not fmt.packed:
        return rows, width * fmt.code_dtype.itemsize
    flat = width % 2 and isinstance(table, torch.Tensor) and table.dim() == 1 and not sharding.is_sharded(table)
    return (fmt.storage_numel(rows * width),) if flat else (rows, (width + 1) // 2)


def _record_widths(fmt: StateFormat) -> tuple[int, int, int]:
    """Bytes per block of each table: the fp32 scale, the bf16 patch values, the int16 offsets."""
    return 4, 2 * fmt.patches, 2 * fmt.patches


def _check_table(packed: dict[str, Any], name: str, want: tuple[int, ...], fmt: StateFormat,
                 shape: torch.Size) -> None:
    t = packed[name]
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"its {name!r} is a {type(t).__name__}, not a tensor")
    if tuple(t.shape) != want:
        raise ValueError(f"its {name!r} has shape {tuple(t.shape)}, not {want} (the {fmt.tag()} state of a "
                         f"{tuple(shape)} parameter): the checkpoint is truncated or corrupt")


_UNREADABLE = (ValueError, TypeError, AttributeError, KeyError, UnicodeDecodeError, OverflowError)


def _read_header(packed: dict[str, Any], param: torch.Tensor, key: str) -> _Header:
    """The header of a packed state, after checking it can be read and belongs to ``param``: every field
    is checked against the parameter before anything whose size the file claims is read."""
    try:
        layout_version(packed)
    except ValueError as err:
        raise ValueError(f"state {key!r}: {err}") from None
    try:
        _header(packed, param.shape)
    except _OtherParameter as err:
        raise ValueError(
            f"state {key!r} was saved for a parameter of shape {err.args[0]}, not "
            f"{tuple(param.shape)}; the optimizer state does not belong to these parameters"
        ) from None
    except _UNREADABLE as err:
        raise ValueError(
            f"state {key!r} of a parameter of shape {tuple(param.shape)} is not a lowbit_compile state "
            f"this version can read ({type(err).__name__}: {err})"
        ) from err
    try:
        return _checked_header(packed, param.shape)
    except _UNREADABLE as err:
        raise ValueError(f"state {key!r} of a parameter of shape {tuple(param.shape)}: {err}") from err


class _Blocks(NamedTuple):
    """Saved blocks in order: first element (flat, in the whole parameter), length, scale, patches."""

    first: torch.Tensor
    length: torch.Tensor
    scales: torch.Tensor
    patch_values: torch.Tensor
    patch_index: torch.Tensor


def _as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """A saved table as ``uint8`` bytes; a stock loader may have cast them to a float dtype, which
    keeps every byte value exactly."""
    if t.dtype == torch.uint8:
        return t
    if t.is_floating_point() and t.numel() and not bool(((t == t.round()) & (t >= 0) & (t <= 255)).all()):
        raise ValueError(f"its {name!r} holds values that are not bytes (dtype {t.dtype}): it is corrupt")
    if not t.is_floating_point():
        raise ValueError(f"its {name!r} has dtype {t.dtype}, not uint8 bytes: it is corrupt")
    return t.to(torch.uint8)


def _codes(packed: dict[str, Any], fmt: StateFormat, start: int, stop: int, rows: int, width: int) -> torch.Tensor:
    """The flat codes of rows ``[start, stop)``, one a ``fmt.code_dtype`` element (a 4-bit format's unpacked),
    after checking that a packed row's (or the flat table's) unused last nibble is 0, as every save leaves it."""
    table = packed["codes"]
    if fmt.packed and table.dim() == 1:  # flat (``_codes_shape``): the rows' nibbles from the bytes that hold them
        first, last = start * width, stop * width
        held = _as_bytes(table[first // 2:(last + 1) // 2], "codes")
        spare = held[-1:] >> 4 if last == rows * width and last % 2 else held.new_zeros(0)
        codes = unpack4(held, 2 * held.numel(), fmt.code_dtype)[first % 2:first % 2 + last - first]
    else:
        held = _as_bytes(_rows_of(table, start, stop, rows), "codes")
        spare = held[:, -1] >> 4 if fmt.packed and width % 2 else held.new_zeros(0)
        codes = _table_codes(held, fmt, width)
    if bool(spare.any()):
        raise ValueError("its 'codes' hold a 4-bit code past the end of a row (the last byte's high nibble is not 0); "
                         "the checkpoint was damaged or crafted")
    return codes


def _n_saved_blocks(header: _Header, width: int) -> int:
    b, splits = header.fmt.block_size, header.row_splits
    return int(((splits[1:] - splits[:-1]) * width + b - 1).div(b, rounding_mode="floor").sum())


def _records(tables: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale, patch values and patch offsets from their saved bytes (selected rows, last dim bytes)."""
    scales, values, index = (_from_bytes(_as_bytes(t, name), dtype)
                             for t, name, dtype in zip(tables, _TABLES, _RECORD_DTYPES))
    return scales.squeeze(-1), values, index


def _from_bytes(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (last dim) viewed as ``dtype``; an empty last dim (no patches) stays empty."""
    if t.shape[-1] == 0:
        return torch.empty(*t.shape, dtype=dtype, device=t.device)
    return t.contiguous().view(dtype)


def _saved_blocks(packed: dict, header: _Header, start: int, stop: int, width: int) -> _Blocks:
    """Every saved block that holds an element of rows ``[start, stop)``, its records checked
    (``blockquant.invalid_records``: finite scales, patch offsets inside their block, once each)."""
    if packed["block_scales"].dim() == 3:
        blocks = _blocks_by_row(packed, header, start, stop, width)
    else:
        blocks = _blocks_listed(packed, header, start, stop, width)
    why = blockquant.invalid_records(blocks.scales, blocks.patch_index, header.fmt)
    if why is not None:
        raise ValueError(f"its block records are corrupt (the {why}); the checkpoint was damaged or crafted")
    return blocks


def _blocks_listed(packed: dict, header: _Header, start: int, stop: int, width: int) -> _Blocks:
    """The saved blocks of a by-block table (one record per block, in order; gathered ones padded)."""
    tables = [packed[name] for name in _TABLES]
    if any(sharding.is_sharded(t) for t in tables):
        raise ValueError("a by-block table saved as a DTensor; this version saves only unsharded ones so")
    saved = _n_saved_blocks(header, width)
    blocks = _listed(header.row_splits, width, header.fmt.block_size, *_records([t[:saved] for t in tables]))
    keep = (blocks.first < stop * width) & (blocks.first + blocks.length > start * width)
    return _Blocks(*(t[keep] for t in blocks))


def _listed(splits: torch.Tensor | list[int], width: int, block_size: int, scales: torch.Tensor,
            patch_values: torch.Tensor, patch_index: torch.Tensor) -> _Blocks:
    """Records of blocks listed in order, each shard's counted from its first element, as blocks."""
    b, splits = block_size, torch.as_tensor(splits) * width
    count = -(-(splits[1:] - splits[:-1]) // b)
    shard = torch.repeat_interleave(torch.arange(count.numel()), count)
    within = torch.arange(int(count.sum())) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    first = splits[shard] + within * b
    length = torch.minimum(splits[shard + 1] - first, torch.tensor(b))
    return _Blocks(first, length, scales, patch_values, patch_index)


def _blocks_by_row(packed: dict, header: _Header, start: int, stop: int, width: int) -> _Blocks:
    """The saved blocks of a by-row table (per row, every block that intersects it)."""
    b, splits = header.fmt.block_size, header.row_splits
    rows = int(splits[-1])
    tables = [_rows_of(packed[name], start, stop, rows) for name in _TABLES]
    row = torch.arange(start, stop)
    shard = torch.searchsorted(splits, row, right=True) - 1
    shard_first, shard_numel = splits[shard] * width, (splits[shard + 1] - splits[shard]) * width
    offset = row * width - shard_first  # the row's first element, counted from its shard's first
    block = offset[:, None] // b + torch.arange(tables[0].shape[1])
    valid = (block <= (offset[:, None] + width - 1) // b) & (block * b < shard_numel[:, None])
    first = shard_first[:, None] + block * b
    length = torch.clamp(shard_numel[:, None] - block * b, max=b)
    first, order = torch.unique(first[valid], return_inverse=True)  # a block spanning rows is in each
    pick = torch.empty(first.numel(), dtype=torch.long).scatter_(0, order, torch.arange(order.numel()))
    scales, values, index = _records([t.to("cpu")[valid][pick] for t in tables])
    return _Blocks(first, length[valid][pick], scales, values, index)


def _dequantize(codes: torch.Tensor, saved: _Blocks, offset: int, fmt: StateFormat) -> torch.Tensor:
    """fp32 values of elements ``offset, offset + 1, ...`` of the parameter, from codes and blocks."""
    n = codes.numel()
    element = offset + torch.arange(n, device=codes.device)
    block = torch.searchsorted(saved.first, element, right=True) - 1
    if n and (bool((block < 0).any()) or bool((element >= saved.first[block] + saved.length[block]).any())):
        raise ValueError("the checkpoint holds no block scale for some elements of this shard; it is "
                         "truncated or was saved for other parameters")
    values = blockquant.decode_scaled(codes, saved.scales[block], fmt)
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


def _rows(shape: torch.Size) -> tuple[int, int]:
    """Rows (dim 0) and elements per row of a parameter shape (a 0-d parameter is one row of one)."""
    if len(shape) == 0:
        return 1, 1
    return shape[0], math.prod(shape[1:])



def dense(packed: dict[str, Any]) -> torch.Tensor:
    """The dense tensor a packed state holds: this rank's rows in a ``DTensor`` if its tensors are
    ``DTensor``s, else the whole state."""
    header = _checked_header(packed)
    fmt, shape, dtype, _ = header
    rows, width = _rows(shape)
    codes = packed["codes"]
    start, stop = sharding.local_rows(codes) if sharding.is_sharded(codes) else (0, rows)
    local = _codes(packed, fmt, start, stop, rows, width)
    if fmt.blockwise:
        values = _dequantize(local, _saved_blocks(packed, header, start, stop, width), start * width, fmt)
    else:
        values = decode(local, fmt)
    values = values.to(dtype)
    if not sharding.is_sharded(codes):
        return values.view(shape)
    return sharding.like(values.view(stop - start, *shape[1:]), codes, shape)




# the master residual and the step counters ----------------------------------------------------------------
_PACKED_TIES, _PACKED_RESIDUAL, _PACKED_SEED = "lowbit_master_ties", "lowbit_master_residual", "lowbit_master_seed"
_CHUNK = 1 << 22  # rows of tie bits repacked at a time, in elements (whole tie words): bounded temporaries


def is_packed_residual(value: object) -> bool:
    return _is_packed(value, _PACKED_RESIDUAL)


def is_packed_ties(value: object) -> bool:
    return _is_packed(value, _PACKED_TIES)


def _is_packed(value: object, marker: str) -> bool:
    return isinstance(value, dict) and marker in value


def pack_residual(value: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """The residual's bytes per parameter row, ``(rows, width * code bytes)``: a view of the live state."""
    local = sharding.local(value)
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    size = local.element_size()
    table = local.reshape(-1).view(torch.uint8).view(stop - start, width * size)
    return {_VERSION: LAYOUT_VERSION, _PACKED_RESIDUAL: size,
            "bytes": sharding.like(table, param, (rows, width * size))}


def pack_counter(value: torch.Tensor) -> dict[str, Any]:
    """A step counter of stochastic rounding (fp32, 0-d) as its four bytes, which a stock loader's cast keeps."""
    return {_VERSION: LAYOUT_VERSION, _PACKED_SEED: 1, "bytes": value.detach().reshape(1).view(torch.uint8)}


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
    if not (math.isfinite(number) and number.is_integer() and 0 <= number < SEED_PERIOD):
        raise ValueError(f"state {key!r} is {number}, not a whole number in [0, {SEED_PERIOD}) as every "
                         "step leaves it; the checkpoint is corrupt")
    return torch.tensor(number, dtype=torch.float32)


def unpack_counter(packed: dict[str, Any], key: str) -> torch.Tensor:
    """The counter (fp32, 0-d, on the CPU) that :func:`pack_counter` saved as state ``key``."""
    _check_layout(packed, key)
    raw = packed.get("bytes")
    if not isinstance(raw, torch.Tensor) or raw.numel() != 4:
        raise ValueError(f"saved {key!r} are not the four bytes of one number; the checkpoint is corrupt")
    return checked_counter(_as_bytes(raw.reshape(4), key).to("cpu").view(torch.float32).reshape(()), key)


def unpack_residual(packed: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """The residual of ``param``'s shard (sharded like it) from its saved per-row bytes."""
    _check_layout(packed, RESIDUAL)
    width = packed[_PACKED_RESIDUAL]
    dtype = {1: torch.int8, 2: torch.int16}.get(width) if type(width) is int else None
    table = packed.get("bytes")
    if dtype is None or not isinstance(table, torch.Tensor):
        raise ValueError(f"saved {RESIDUAL!r} are not a table of int8 or int16 codes; the checkpoint is corrupt")
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    table = _as_bytes(_rows_of(table, start, stop, rows), RESIDUAL)
    if table.shape[1:] != (width * dtype.itemsize,):
        raise ValueError(f"saved {RESIDUAL!r} of shape {tuple(table.shape)} do not fit a parameter of shape "
                         f"{tuple(param.shape)}; the checkpoint is truncated or was saved for other parameters")
    shard = sharding.local(param)
    return sharding.like(table.to(shard.device).contiguous().view(dtype).view(shard.shape), param)


def pack_ties(words: torch.Tensor, param: torch.Tensor) -> dict[str, Any]:
    """Rows of whole bytes (``width % 8 == 0``: every 2-D weight of a usual model) are the words' own
    bytes (little-endian: element i is bit i % 8 of byte i // 8), a view, as a state dict holds the
    live states; other widths are repacked, a chunk of rows at a time."""
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    local, row_bytes = stop - start, -(-width // 8)
    if width % 8 == 0:
        packed = words.view(torch.uint8)[:local * row_bytes].view(local, row_bytes)
    else:
        packed = torch.empty(local, row_bytes, dtype=torch.uint8, device=words.device)
        step = max(32, _CHUNK // width // 32 * 32)  # rows per chunk, a multiple of 32: whole tie words
        for r0 in range(0, local, step):
            r1 = min(local, r0 + step)
            words_of_rows = words[r0 * width // 32:residual_format.tie_words(r1 * width)]
            flags = residual_format.unpack_ties(words_of_rows, (r1 - r0) * width)
            bits = torch.zeros(r1 - r0, row_bytes * 8, dtype=torch.int32, device=words.device)
            bits[:, :width] = flags.view(r1 - r0, width)
            packed[r0:r1] = (bits.view(r1 - r0, row_bytes, 8) << torch.arange(8, device=words.device)).sum(2)
    return {_VERSION: LAYOUT_VERSION, _PACKED_TIES: 1, "bits": sharding.like(packed, param, (rows, row_bytes))}


def unpack_ties(packed: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """The local tie words of ``param``'s shard from a saved per-row table."""
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    _check_layout(packed, TIES)
    bits = packed.get("bits")
    if not isinstance(bits, torch.Tensor):
        raise ValueError(f"saved {TIES!r} have no table of bits; the checkpoint is corrupt")
    table = _as_bytes(_rows_of(bits, start, stop, rows), TIES)
    if table.shape[1:] != (-(-width // 8),):
        raise ValueError(f"saved {TIES!r} of shape {tuple(table.shape)} do not fit a parameter of shape "
                         f"{tuple(param.shape)}")
    table = table.to(sharding.local(param).device)
    local = stop - start
    words = torch.zeros(residual_format.tie_words(local * width), dtype=torch.int32, device=table.device)
    if width % 8 == 0:
        words.view(torch.uint8)[:local * width // 8].copy_(table.reshape(-1))
        return words
    step = max(32, _CHUNK // width // 32 * 32)
    for r0 in range(0, local, step):
        r1 = min(local, r0 + step)
        flags = ((table[r0:r1].to(torch.int32)[:, :, None] >> torch.arange(8, device=table.device)) & 1)
        words[r0 * width // 32:residual_format.tie_words(r1 * width)] = residual_format.pack_ties(
            flags.reshape(r1 - r0, -1)[:, :width].reshape(-1).bool())
    return words




def _check_layout(packed: Mapping, key: str) -> None:
    """Refuse a packed state of a layout this version cannot read (:func:`layout_version`), naming ``key``."""
    try:
        layout_version(packed)
    except ValueError as err:
        raise ValueError(f"state {key!r}: {err}") from None
