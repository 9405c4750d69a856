"""Checkpoints of wrapped optimizers: compact quantized states in ``state_dict()``, an all-or-nothing
``load_state_dict()`` at any sharding, conversion of stock or other-format states, an fp32 export.

A quantized state is saved *packed*: a plain dict of tensors and ints (so
``torch.load(weights_only=True)`` reads it), never fp32. Every tensor in it is raw bytes
(``uint8``), so a stock ``load_state_dict`` that casts them to the parameter's dtype (as it does
when the optimizer is rewritten only at its first step, under ``enable()``) keeps their values
exactly, and they are recovered at that step:

* ``codes``: per parameter row (dim 0), the row's code bytes;
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
of one state never disagree. Loading keeps the saved blocks bit for bit where they are the blocks
of the loading shard (same sharding), re-quantizes the others from the saved values, then brings the
state to the optimizer's configured format. ``load_state_dict`` reads and converts every state
before anything changes, so a checkpoint that cannot be read leaves the optimizer as it was.
"""

from __future__ import annotations

import collections
import math
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import sharding
from .kernels import blockquant
from .kernels.formats import DYNAMIC_MAP_VERSION, StateFormat, decode, upgrade_dynamic8_codes
from .kernels.residual import KEYS as MASTER_KEYS
from .kernels.rounding import SEED as ROUNDING_SEED
from .peer_state import BNB_KEYS as _BNB_KEYS
from .peer_state import TORCHAO_CLASSES as _TORCHAO_CLASSES
from .peer_state import from_peer_state_dict as from_peer_state_dict  # public here too
from .state import QuantizedState, bits_of
from .state_schema import is_real_number

_PENDING = "_lowbit_pending"
_TABLES = ("block_scales", "block_patch_values", "block_patch_index")
_TEXT = ("lowbit_format", "shape", "dtype", "row_splits")
_RECORD_DTYPES = (torch.float32, blockquant.PATCH_VALUE_DTYPE, blockquant.PATCH_INDEX_DTYPE)
REFUSED_PREFIX = "lowbit_"  # a refused value is saved under this prefix and its key
STOCK_REFUSAL = (
    b"this is a lowbit_compile low-bit optimizer state, which a stock optimizer cannot load. Resume it with "
    b"lowbit_compile(opt, ...) (or inside lowbit_compile.enable()) before load_state_dict, and call "
    b"lowbit_compile.restore(opt) for stock fp32 states; or load "
    b"lowbit_compile.checkpoint.stock_state_dict(checkpoint) into the stock optimizer"
)


def is_packed(value: object) -> bool:
    """Whether ``value`` is a quantized state as ``state_dict()`` saves it."""
    return isinstance(value, dict) and "lowbit_format" in value


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


def pack_state_dict(opt: torch.optim.Optimizer, state_dict: dict) -> dict:
    """``Optimizer.state_dict`` post hook: replace every quantized state by its packed form."""
    guard_stock_steps()
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
    """The packed form of one quantized state of ``param`` (``DTensor`` codes for a ``DTensor`` param;
    a collective over its mesh if its rows are narrower than a block: see the module docstring)."""
    qs: QuantizedState = sharding.local(value)
    rows, width = _rows(param.shape)
    start, stop = sharding.local_rows(param)
    sharded = sharding.is_sharded(param)
    code_bytes = qs.codes.element_size()
    parts = qs.storage_parts
    if sharded or not all(_owns_storage(t) for t in parts):
        # copies: a DTensor's row tables are computed, and a view into a larger buffer would make
        # torch.save write the whole buffer; all parts copied alike, so they never disagree
        parts = blockquant.Quantized(*(t.clone() for t in parts))
    splits = sharding.row_splits(param)
    gathered = sharded and qs.fmt.blockwise and width < qs.fmt.block_size
    if gathered:
        parts, splits = _gathered(parts, param, qs, splits)
    tables = {"codes": parts.codes.view(torch.uint8).view(stop - start, width * code_bytes)}
    if qs.fmt.blockwise:
        records = _row_tables(parts, width, qs.fmt) if sharded and not gathered else parts[1:]
        tables.update(zip(_TABLES, (_as_record_bytes(t) for t in records)))
    out = {
        "lowbit_format": _int(qs.fmt.tag()),
        "shape": _int(",".join(map(str, param.shape))),
        "dtype": _int(str(qs.dtype).removeprefix("torch.")),
        "row_splits": _int(_splits_text(splits)),
    }
    if qs.fmt.name == "dynamic8":
        out["lowbit_map"] = DYNAMIC_MAP_VERSION  # no tag: a version-1 map (converted on load)
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
        code_bytes = fmt.code_dtype.itemsize
        local_codes = parts.codes.view(torch.uint8).view(-1, width * code_bytes)
        codes = sharding.like(local_codes, param, (rows, width * code_bytes)).full_tensor()
        codes = codes.view(fmt.code_dtype).view(-1)
        blocks = _listed(splits, width, fmt.block_size, scales, values, index)
        blocks = _Blocks(*(t.to(codes.device) for t in blocks))
        whole = blockquant.quantize(_dequantize(codes, blocks, 0, fmt).to(qs.dtype), fmt)
        start, stop = sharding.local_rows(param)
        parts, splits = whole._replace(codes=whole.codes[start * width:stop * width]), [0, rows]
        scales, values, index = whole[1:]
    pad = capacity - scales.shape[0]
    tables = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (scales, values, index))
    return blockquant.Quantized(parts.codes, *tables), splits


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


def _row_tables(parts: blockquant.Quantized, width: int, fmt: StateFormat
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the scale and patches of each block that intersects it, in block order."""
    b, device = fmt.block_size, parts.scales.device
    n_rows = parts.codes.numel() // width if width else 0
    offset = torch.arange(n_rows, device=device) * width
    block = offset[:, None] // b + torch.arange(_slots(width, b), device=device)
    valid = (block <= (offset[:, None] + width - 1) // b) & (block < parts.scales.numel())
    # each part with one zero row appended, which padding slots (and an empty shard) read
    scales, values, index = (torch.cat([t, t.new_zeros(1, *t.shape[1:])]) for t in parts[1:])
    block = torch.where(valid, block, parts.scales.numel())
    return scales[block], values[block], index[block]


# load_state_dict() ---------------------------------------------------------------------------------
# (group, param) -> each per-element state's configured format and the dtype the optimizer keeps it in
SpecsOf = Callable[[dict, torch.Tensor], Mapping[str, tuple[StateFormat, torch.dtype]]]
# (group, param) -> None for a param without master weights, else what its saved entry (per-element
# states converted) changes to: the master's entries read and brought to the configured mode
MastersOf = Callable[[dict, torch.Tensor], Callable[[dict], dict] | None]
# (group, param) -> what a saved entry's other states change to, after checking them against what the
# optimizer keeps: its scalar states (``step``) as the stock loader is to get them, and the states of its
# own it keeps aside (the rounding counter; None: the entry goes)
ScalarsOf = Callable[[dict, torch.Tensor], Callable[[dict], tuple[dict, dict]]]


def prepare_load(opt: torch.optim.Optimizer, state_dict: dict, specs_of: SpecsOf,
                 name_of: Callable[[torch.Tensor], str | None], masters_of: MastersOf | None = None,
                 scalars_of: ScalarsOf | None = None) -> dict:
    """``load_state_dict`` pre hook: read and check all of the checkpoint, and convert every
    per-element state, before the stock loader changes anything; any error names the parameter and
    state, and leaves the optimizer as it was (the stock loader itself is run first on a stand-in,
    so what it would fail on fails here). The converted states are kept aside for
    :func:`finish_load`, and the stock loader gets the rest (``step`` and other scalar states).

    ``specs_of(group, param)`` gives the configured format of each per-element state of ``param``
    in ``group`` (the saved group, as it will be after loading) and the dtype the optimizer keeps it
    in. ``masters_of`` reads the master weights (``lowbit_compile.master``): a param with them reads
    its per-element states as fp32 (its master's step keeps them so; the stock loader would cast them
    to the param's dtype), and the master's entries never reach the stock loader (dropped for a param
    without master weights). ``scalars_of`` checks the other states and reads the rounding counter.
    A state saved in another layout (format, block size, outliers) is converted, with one warning. The
    rounding counter is brought to the configured rounding: read back, started where a state now rounds
    stochastically and the checkpoint has none, dropped where none does.
    """
    guard_stock_steps()
    state_dict = unmarked_state_dict(_checked_structure(state_dict))
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) "
                         f"than the optimizer ({len(groups)}); load a checkpoint of this optimizer")
    for i, (group, saved) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                f"loaded state dict contains a parameter group that doesn't match the size of optimizer's group: "
                f"param_groups[{i}] has {len(saved['params'])} parameters in the checkpoint and "
                f"{len(group['params'])} in the optimizer; load a checkpoint of this optimizer")
        _check_saved_group(i, group, saved)
    where: dict[Any, tuple[int, int, torch.Tensor]] = {}
    for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
        for pi, (idx, param) in enumerate(zip(saved["params"], group["params"])):
            where[idx] = (gi, pi, param)
    pending: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    plain: dict = {}
    relayouts: collections.Counter[tuple[str, str]] = collections.Counter()
    for idx, entry in state_dict["state"].items():
        if idx not in where:
            plain[idx] = entry
            continue
        gi, pi, param = where[idx]
        # the group as it will be: the saved values, the optimizer's own for keys an older torch did not save
        group = {**groups[gi], **saved_groups[gi], "params": groups[gi]["params"]}
        label = _label(gi, pi, param, name_of(param))
        try:
            specs = specs_of(group, param)
        except Exception as err:  # probing the step with the saved group: the stock constructor's checks, ...
            raise ValueError(f"{label}: the checkpoint's param_groups[{gi}] cannot step it "
                             f"({type(err).__name__}: {err}); nothing was loaded") from err
        if not isinstance(entry, Mapping):
            raise ValueError(f"{label}: its saved state is a {type(entry).__name__}, not a dict of states; the "
                             "checkpoint is corrupt")
        refuse_foreign(entry, specs, label)
        finish = masters_of(group, param) if masters_of is not None else None
        new = {}
        for key, value in entry.items():
            fmt, dtype = specs.get(key, (None, None))
            if fmt is None:
                if is_packed(value):
                    raise ValueError(f"{label}: the checkpoint holds a low-bit state {key!r}, which "
                                     f"{type(opt).__name__} does not keep per element ({sorted(specs)}); "
                                     "load a checkpoint of this optimizer")
                if finish is not None and isinstance(value, torch.Tensor) and key not in ("step", *MASTER_KEYS):
                    new[key] = _as_fp32(value, param)  # a scalar state of the fp32 step (ASGD's eta, mu)
                continue
            if not is_packed(value) and isinstance(value, torch.Tensor):
                if finish is None:  # the stock cast: to the param's device and dtype
                    value = torch.optim.Optimizer._process_value_according_to_param_policy(
                        param, value, idx, saved_groups, key)
                else:  # the fp32 step of the param's master keeps them fp32
                    value = _as_fp32(value, param)
            elif not is_packed(value):
                raise ValueError(f"{label}: state {key!r} is a {type(value).__name__}, not a tensor; "
                                 "load a checkpoint of this optimizer")
            try:
                converted_value = converted(param, key, value, fmt, dtype)
            except ValueError as err:
                raise ValueError(f"{label}: {err}") from err
            if is_packed(value) and (saved := _saved_format(value)) != _layout_of(fmt):
                relayouts[saved, _layout_of(fmt)] += 1
            if converted_value is not None or finish is not None:
                new[key] = value if converted_value is None else converted_value
        try:
            if finish is not None:
                new = {k: v for k, v in {**new, **finish({**entry, **new})}.items() if v is not None}
            stock, ours = scalars_of(group, param)(entry) if scalars_of is not None else ({}, {})
        except ValueError as err:
            raise ValueError(f"{label}: {err}") from err
        new.update({k: v for k, v in ours.items() if v is not None})
        if new:
            pending[param] = new
        plain[idx] = {k: stock.get(k, v) for k, v in entry.items()
                      if k not in new and k not in MASTER_KEYS and k not in ours}
    loaded = {**state_dict, "state": plain}
    _dry_run(opt, loaded)
    if relayouts:
        _warn_relayout(relayouts)
    opt.__dict__[_PENDING] = pending
    return loaded


def _layout_of(fmt: StateFormat) -> str:
    """A state's layout as a message names it: ``int8 (blocks of 64, 2 outliers)``."""
    if not fmt.blockwise:
        return fmt.name
    return f"{fmt.name} (blocks of {fmt.block_size}" + (f", {fmt.outliers} outliers)" if fmt.outliers else ")")


def _saved_format(packed: dict[str, Any]) -> str:
    """The layout of a packed state (its header already checked)."""
    return _layout_of(StateFormat.from_tag(_field(packed, "lowbit_format")))


def _warn_relayout(relayouts: collections.Counter[tuple[str, str]]) -> None:
    """The one warning of a load that converted states saved in another layout than the configured one."""
    listed = "; ".join(f"{n} state{'s' * (n > 1)} saved as {saved}, now {now}" for (saved, now), n in relayouts.items())
    warnings.warn(f"lowbit_compile: this checkpoint's low-bit states are in another layout than this optimizer's: "
                  f"{listed}. They were converted (each value within the new layout's resolution of the saved "
                  "one), so the run does not resume bit for bit; give lowbit_compile the saved fmt, block_size "
                  "and outliers to resume exactly", stacklevel=_outside_stacklevel())


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the caller of this function that names the first frame
    outside torch and lowbit_compile (the user's ``load_state_dict`` call, through however many of
    torch's wrappers)."""
    inside = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


# Other libraries' optimizer states: what identifies them (peer_state.py, which reads them), and what to do.
FOREIGN_ADVICE = ("convert it first, which keeps its moments (dequantized with that library's own maps, then stored "
                  "in this optimizer's format) and its step: "
                  "optimizer.load_state_dict(lowbit_compile.checkpoint.from_peer_state_dict(state_dict))")


def foreign_library(entry: Mapping, kept: Mapping[str, Any]) -> str | None:
    """The library whose optimizer saved the state ``entry`` (bitsandbytes, torchao), or None: keys that
    are bitsandbytes' and not states the optimizer keeps (``kept``), or torchao's low-bit tensor
    subclasses, told by class name and module (torchao is never imported here)."""
    if any(isinstance(k, str) and k in _BNB_KEYS and k not in kept for k in entry):
        return "bitsandbytes"
    for value in entry.values():
        cls = type(value)
        if cls.__name__ in _TORCHAO_CLASSES and cls.__module__.split(".")[0] == "torchao":
            return "torchao"
    return None


def refuse_foreign(entry: Mapping, kept: Mapping[str, Any], label: str) -> None:
    """Refuse a saved state of another library's optimizer, naming it and what to do."""
    library = foreign_library(entry, kept)
    if library is not None:
        keys = sorted(map(str, entry))[:6]
        raise ValueError(f"{label}: this optimizer state was saved by a {library} optimizer (its keys: {keys}), "
                         f"not by torch.optim or lowbit_compile; {FOREIGN_ADVICE}")


def _checked_structure(state_dict: object) -> dict:
    """``state_dict`` after checking it has the shape of an optimizer's: a dict with a dict ``state``
    and a list ``param_groups`` of dicts, each with a list ``params``."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict takes an optimizer's state dict, got a {type(state_dict).__name__}")
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"the state dict has no {missing}: it is not an optimizer's state dict (keys "
                         f"{sorted(map(str, state_dict))[:8]}); pass optimizer.state_dict()'s output")
    if not isinstance(state_dict["state"], Mapping):
        raise ValueError(f"the state dict's 'state' is a {type(state_dict['state']).__name__}, not a dict")
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise ValueError("the state dict's 'param_groups' is not a list of dicts; the checkpoint is corrupt")
    for i, group in enumerate(groups):
        if not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"the state dict's param_groups[{i}] has no list 'params'; the checkpoint is corrupt")
    return dict(state_dict)


def _check_saved_group(index: int, group: Mapping, saved: Mapping) -> None:
    """Refuse a saved hyperparameter of another kind than the optimizer's own (a number for a
    number, a bool for a bool, a tuple of numbers of the same length): the stock loader takes any
    value, and the step would fail on it after the load changed everything."""
    for key, value in saved.items():
        if key in ("params", "param_names") or key not in group:
            continue
        live = group[key]
        if isinstance(live, bool) or live is None:
            ok = value is None or isinstance(value, bool) or not isinstance(live, bool)
        elif is_real_number(live):
            ok = is_real_number(value)
        elif isinstance(live, (tuple, list)) and live and all(is_real_number(v) for v in live):
            ok = isinstance(value, (tuple, list)) and len(value) == len(live) and all(map(is_real_number, value))
        else:
            continue
        if not ok:
            shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
            raise ValueError(f"param_groups[{index}][{key!r}] in the checkpoint is {shown}, where the optimizer "
                             f"has {live!r}; the checkpoint is corrupt or of another optimizer (nothing was loaded)")


def _dry_run(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """Run the loader of ``opt``'s class (without its hooks) over ``state_dict`` on a stand-in that
    shares no state or group with ``opt``: what the stock loader fails on (its ``__setstate__``
    reading a ``step`` that is not a number) fails here, before it has replaced ``opt``'s state, and so
    does a saved group that would leave out a hyperparameter the optimizer's group has."""
    shell = object.__new__(type(opt))
    shell.__dict__.update(opt.__dict__)
    shell.state = collections.defaultdict(dict)
    shell.param_groups = [dict(g) for g in opt.param_groups]
    shell._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
    shell._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
    # tensors of more than one element stand in as empty ones: the stock loader only casts and moves them
    light = {idx: ({k: torch.empty(0, dtype=v.dtype, device=v.device) if isinstance(v, torch.Tensor) and v.numel() > 1
                    else v for k, v in entry.items()} if isinstance(entry, Mapping) else entry)
             for idx, entry in state_dict["state"].items()}
    try:
        type(opt).load_state_dict(shell, {**state_dict, "state": light})
    except Exception as err:  # whatever the stock loader raises: nothing of opt was changed
        raise ValueError(f"{type(opt).__name__}'s own load_state_dict cannot read this checkpoint "
                         f"({type(err).__name__}: {err}); nothing was loaded") from err
    for i, (group, loaded) in enumerate(zip(opt.param_groups, shell.param_groups)):
        missing = sorted(map(str, group.keys() - loaded.keys()))
        if missing:
            raise ValueError(f"the checkpoint's param_groups[{i}] lacks {missing}, which the optimizer's step "
                             "reads; the checkpoint is truncated or of another optimizer (nothing was loaded)")


def _as_fp32(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A saved state as the fp32 step of ``param``'s master keeps it: on the param's device, fp32 if floating."""
    return value.to(device=param.device, dtype=torch.float32 if value.is_floating_point() else value.dtype)


def finish_load(opt: torch.optim.Optimizer) -> None:
    """``load_state_dict`` post hook: put the states :func:`prepare_load` converted in place."""
    for param, states in opt.__dict__.pop(_PENDING, {}).items():
        opt.state[param].update(states)


def _label(group: int, index: int, param: torch.Tensor, name: str | None) -> str:
    named = f" {name!r}" if name else ""
    return f"parameter{named} (param_groups[{group}]['params'][{index}], shape {tuple(param.shape)})"


def converted(param: torch.Tensor, key: str, value: object, fmt: StateFormat,
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``value`` (the state ``key`` of ``param``) stored in ``fmt`` and sharded like ``param``, or
    ``None`` where nothing changes (it already is, or it is not a per-element state).

    Takes what a loader may leave in ``optimizer.state``: packed states (of any format, block size
    or sharding, their bytes cast to another dtype included), stock dense tensors, and quantized
    states of another format. ``dtype``: the one the optimizer keeps the state in, which a packed
    state is read as (:func:`unpack`).
    """
    packed = is_packed(value)
    if packed:
        guard_stock_steps()
        value = unpack(value, param, key, dtype)
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


def conform(param: torch.Tensor, state: dict, formats: dict[str, StateFormat], dtypes: Mapping[str, torch.dtype]
            ) -> None:
    """Bring ``param``'s per-element states to ``formats`` in place (see :func:`converted`; ``dtypes``:
    the ones the optimizer keeps them in); every new state is built before any is stored."""
    updates = {key: converted(param, key, state.get(key), fmt, dtypes.get(key)) for key, fmt in formats.items()}
    state.update({k: v for k, v in updates.items() if v is not None})


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
    if version < DYNAMIC_MAP_VERSION:  # codes of the old dynamic map: the nearest codes of this one
        at_element = torch.searchsorted(saved.first, start * width + torch.arange(codes.numel()), right=True) - 1
        codes = upgrade_dynamic8_codes(codes, fmt.nonneg, torch.signbit(saved.scales[at_element.clamp(min=0)]))
    n, b = codes.numel(), fmt.block_size
    first = start * width + torch.arange(blockquant.n_blocks(n, fmt), device=shard.device) * b
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
    bits_of(qs.codes)[exact] = bits_of(codes)[exact]
    return sharding.like(qs, param)


def kept_dtypes(param: torch.Tensor, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a checkpoint may hold a per-element state of ``param`` in, where the optimizer keeps
    it in ``dtype``: that one, and for a 16-bit parameter both what its stock step keeps (the param's
    dtype) and what its fp32 master's keeps (fp32), so a run resumes with or without master weights."""
    if param.dtype in (torch.bfloat16, torch.float16):
        return tuple(dict.fromkeys((dtype, param.dtype, torch.float32)))
    return (dtype,)


def _map_version(packed: dict[str, Any], fmt: StateFormat) -> int:
    """The dynamic map a dynamic8 state's codes were saved in (1 before maps were tagged)."""
    if fmt.name != "dynamic8":
        return DYNAMIC_MAP_VERSION
    version = packed.get("lowbit_map", 1)
    if not isinstance(version, int) or not 1 <= version <= DYNAMIC_MAP_VERSION:
        raise ValueError(f"its dynamic8 codes use map version {version!r}, newer than this version of "
                         f"lowbit_compile reads (1..{DYNAMIC_MAP_VERSION}): upgrade lowbit_compile to load it")
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
    fmt, shape, dtype = _header(packed, shape)
    rows, width = _rows(shape)
    _check_table(packed, "codes", (rows, width * fmt.code_dtype.itemsize), fmt, shape)
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
    """The flat codes of rows ``[start, stop)``, in the format's code dtype."""
    codes = _as_bytes(_rows_of(packed["codes"], start, stop, rows), "codes").contiguous()
    return codes.view(fmt.code_dtype).reshape(-1)


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
    state_dict = unmarked_state_dict(source.state_dict() if isinstance(source, torch.optim.Optimizer) else source)
    state = {idx: {k: (_dense(v) if is_packed(v) else v) for k, v in entry.items()
                   if k not in MASTER_KEYS and k != ROUNDING_SEED}
             for idx, entry in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _dense(packed: dict[str, Any]) -> torch.Tensor:
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

