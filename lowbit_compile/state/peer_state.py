"""bitsandbytes' and torchao's Adam state dicts read as stock ones: each moment dequantized with the
peer's own map and scales (checked first: nothing saved decides where a read goes), so that switching
to lowbit_compile mid-run keeps the moments and the step count.

Layouts read (told by keys and class names; neither library is imported here):

* bitsandbytes ``Adam8bit``/``AdamW8bit`` (and their paged and ``optim_bits=8`` forms): per parameter
  ``state1``/``state2`` (uint8 codes, the parameter's shape), ``qmap1``/``qmap2`` (256 map values) and
  either ``absmax1``/``absmax2`` (blockwise: one scale per 256 elements, the last block partial) or,
  before 0.46 with ``block_wise=False``, ``max1``/``max2`` (one scale for the whole tensor); a value is
  ``qmap[code] * scale``. Since 0.48 these sit in one dict under ``__bnb_optimizer_quant_state__``.
  Parameters under ``min_8bit_size`` keep fp32 ``state1``/``state2``. ``step`` is a Python int.
* torchao ``Adam(W)8bit``/``Adam(W)4bit``/``Adam(W)Fp8``: ``exp_avg``/``exp_avg_sq`` (and
  ``max_exp_avg_sq``) as tensor subclasses holding ``codes``, one ``scale`` per block (block size:
  elements over scales) and, for 8 and 4 bits, a ``qmap``; 4-bit codes are packed two per byte, high
  nibble first. Parameters torchao does not quantize keep plain tensors. ``lr`` is a tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..param_groups import is_real_number
from . import sharding

BNB_WRAPPER = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.48 nests its tensors under this key
# every key a bitsandbytes optimizer saves in a parameter's state besides "step"
BNB_KEYS = frozenset({BNB_WRAPPER, "state1", "state2", "qmap1", "qmap2", "absmax1", "absmax2", "max1", "max2",
                      "new_max1", "new_max2", "unorm_vec", "gnorm_vec"})
TORCHAO_CLASSES = frozenset({"OptimState8bit", "OptimStateFp8", "OptimState4bit"})
_BNB_BLOCK = 256  # bitsandbytes' optimizers quantize blocks of 256 elements (its kernels fix it)
_BNB_ADEMAMIX = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}  # AdEMAMix's group keys, as Adam saves them
_NONNEG = ("exp_avg_sq", "max_exp_avg_sq")  # second moments: never negative
_CORRUPT = "the checkpoint is corrupt or not a state dict that library saved"


def is_torchao_state(value: object) -> bool:
    """Whether ``value`` is one of torchao's low-bit optimizer states (or a ``DTensor`` of one)."""
    cls = type(sharding.local(value)) if isinstance(value, torch.Tensor) else type(value)
    return cls.__name__ in TORCHAO_CLASSES and cls.__module__.split(".")[0] == "torchao"


def is_bnb_entry(entry: object) -> bool:
    """Whether a parameter's saved state is a bitsandbytes optimizer's."""
    return isinstance(entry, Mapping) and any(isinstance(k, str) and k in BNB_KEYS for k in entry)


def from_peer_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The stock ``torch.optim`` state dict of a bitsandbytes ``Adam8bit``/``AdamW8bit`` or torchao
    ``Adam(W)8bit``/``Adam(W)4bit``/``Adam(W)Fp8`` state dict: every moment dequantized with the
    peer's own map and scales into fp32 ``exp_avg``/``exp_avg_sq`` (and ``max_exp_avg_sq``), the
    peer's step as each ``step``, the param groups kept (torchao's tensor ``lr`` as a float). Load it
    into a wrapped optimizer, which stores the moments in its own format::

        opt.load_state_dict(lowbit_compile.checkpoint.from_peer_state_dict(torch.load(path)))

    (a torchao checkpoint needs torchao importable to be ``torch.load``-ed: its states are torchao
    classes). Every field is checked before it is read, and the input is left as it was: codes, maps and
    scales of the shapes and dtypes the peer saves, maps within [-1, 1], scales finite and non-negative,
    fp8 codes finite. Entries that are neither library's (stock ones) are kept as they are.
    """
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping) or not isinstance(
            state_dict.get("param_groups"), (list, tuple)):
        raise TypeError("from_peer_state_dict takes an optimizer's state dict (a dict with 'state' and "
                        f"'param_groups'), got {type(state_dict).__name__}: pass the peer optimizer's state_dict()")
    where = {}
    for gi, group in enumerate(state_dict["param_groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), (list, tuple)):
            raise ValueError(f"the state dict's param_groups[{gi}] is not a dict with a list 'params'; {_CORRUPT}")
        where.update({idx: f"param_groups[{gi}]['params'][{pi}]" for pi, idx in enumerate(group["params"])})
    state, libraries = {}, set()
    for idx, entry in state_dict["state"].items():
        label = f"parameter {where.get(idx, f'state[{idx!r}]')}"
        if is_bnb_entry(entry):
            state[idx] = _bnb_entry(entry, label)
            libraries.add("bitsandbytes")
        elif isinstance(entry, Mapping) and any(is_torchao_state(v) for v in entry.values()):
            state[idx] = _torchao_entry(entry, label)
            libraries.add("torchao")
        else:
            state[idx] = entry
    groups = [_group(g, i, libraries) for i, g in enumerate(state_dict["param_groups"])]
    return {**state_dict, "state": state, "param_groups": groups}


# bitsandbytes -------------------------------------------------------------------------------------------
def _bnb_entry(entry: Mapping, label: str) -> dict[str, torch.Tensor]:
    entry = dict(entry)
    nested = entry.pop(BNB_WRAPPER, {})
    if not isinstance(nested, Mapping) or set(nested) & set(entry):
        raise ValueError(f"{label}: its {BNB_WRAPPER!r} is not a dict of keys found only there; {_CORRUPT}")
    entry.update(nested)
    label = f"{label} (bitsandbytes)"
    if "state1" not in entry or "state2" not in entry:
        raise ValueError(f"{label} has no 'state1' and 'state2' (keys {sorted(map(str, entry))}): only Adam8bit/"
                         "AdamW8bit states (two moments) are read; the state of another bitsandbytes optimizer "
                         "(Lion, SGD, RMSprop, ...) cannot continue as Adam: start this optimizer afresh")
    m, v = (_plain(entry[k], label, repr(k)) for k in ("state1", "state2"))
    if m.shape != v.shape:
        raise ValueError(f"{label}: 'state1' has shape {tuple(m.shape)} and 'state2' {tuple(v.shape)}, where Adam "
                         "keeps both in the parameter's shape (AdEMAMix keeps two first moments in 'state1'): only "
                         f"Adam8bit/AdamW8bit states are read, or {_CORRUPT}")
    step = _step(entry.get("step"), label)
    if m.dtype == torch.uint8 and v.dtype == torch.uint8:
        blockwise = "absmax1" in entry or "absmax2" in entry
        moments = [_bnb_moment(entry, label, i, codes, blockwise) for i, codes in ((1, m), (2, v))]
    elif m.is_floating_point() and v.is_floating_point():  # a parameter under min_8bit_size, or optim_bits=32
        moments = [m, v]
    else:
        raise ValueError(f"{label}: 'state1' is {m.dtype} and 'state2' {v.dtype}; bitsandbytes saves both uint8 "
                         f"codes or both fp32; {_CORRUPT}")
    out = {"step": step, "exp_avg": moments[0], "exp_avg_sq": moments[1]}
    _check_moments(out, label)
    return out


def _bnb_moment(entry: Mapping, label: str, i: int, codes: torch.Tensor, blockwise: bool) -> torch.Tensor:
    """State ``i`` (1: m, 2: v) of a bitsandbytes entry: ``qmap[code] * scale`` per element."""
    qmap = _qmap(entry.get(f"qmap{i}"), 256, label, f"'qmap{i}'", codes.device)
    n = codes.numel()
    if blockwise:
        scales = _scales(entry.get(f"absmax{i}"), -(-n // _BNB_BLOCK), label, f"'absmax{i}'", codes.device)
        per_element = scales.repeat_interleave(_BNB_BLOCK)[:n]
    elif f"max{i}" not in entry:
        raise ValueError(f"{label} has neither 'absmax{i}' (a scale per block) nor 'max{i}' (one scale): its "
                         f"'state{i}' codes cannot be read; {_CORRUPT}")
    else:  # one scale: the max of the whole state, after the step (bitsandbytes swaps max and new_max)
        per_element = _scales(entry[f"max{i}"], 1, label, f"'max{i}'", codes.device).expand(n)
    return (qmap[codes.reshape(-1).long()] * per_element).view(codes.shape)


# torchao ------------------------------------------------------------------------------------------------
def _torchao_entry(entry: Mapping, label: str) -> dict[str, torch.Tensor]:
    label = f"{label} (torchao)"
    out = {}
    for key, value in entry.items():
        if key == "step":
            out[key] = _step(value, label)
        elif is_torchao_state(value):
            out[key] = _torchao_moment(value, f"{label}, state {key!r}")
        else:
            out[key] = value
    _check_moments(out, label)
    return out


def _torchao_moment(value: torch.Tensor, label: str) -> torch.Tensor:
    """A torchao low-bit state dequantized: ``qmap[code] * scale`` (fp8: ``code * scale``) per block."""
    if sharding.is_sharded(value):
        raise ValueError(f"{label} is a DTensor (a sharded run): gather the peer's optimizer state dict to full "
                         "tensors first, with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict("
                         "model, optimizer, options=StateDictOptions(full_state_dict=True)), and convert that")
    kind = type(value).__name__
    shape = tuple(value.shape)
    n = math.prod(shape)
    codes = _plain(getattr(value, "codes", None), label, "codes")
    device = codes.device
    if kind == "OptimState4bit":
        _want(codes, torch.uint8, label, "codes")
        if codes.dim() != 1 or 2 * codes.numel() != n:
            raise ValueError(f"{label}: its codes have shape {tuple(codes.shape)}, where a state of shape {shape} "
                             f"packs {n} 4-bit codes in {-(-n // 2)} bytes; {_CORRUPT}")
        unpacked = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1)
        values = _qmap(getattr(value, "qmap", None), 16, label, "qmap", device)[unpacked.long()]
    elif kind == "OptimState8bit":
        _want(codes, torch.uint8, label, "codes")
        _same_shape(codes, shape, label)
        values = _qmap(getattr(value, "qmap", None), 256, label, "qmap", device)[codes.reshape(-1).long()]
    else:
        if codes.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{label}: its codes are {codes.dtype}, where torchao saves float8_e4m3fn; {_CORRUPT}")
        _same_shape(codes, shape, label)
        values = codes.reshape(-1).float()
        if not torch.isfinite(values).all():
            raise ValueError(f"{label}: its fp8 codes hold inf or NaN, which torchao never stores; {_CORRUPT}")
    scale = _plain(getattr(value, "scale", None), label, "scale")
    blocks = scale.numel()
    if scale.dim() != 1 or blocks == 0 or n % blocks:
        raise ValueError(f"{label}: its scale has shape {tuple(scale.shape)}, which does not split its {n} "
                         f"elements into equal blocks; {_CORRUPT}")
    scales = _scales(scale, blocks, label, "scale", device)
    out = (values.view(blocks, n // blocks) * scales[:, None]).view(shape)
    if not torch.isfinite(out).all():  # fp8 codes up to 448 times a scale near the float maximum
        raise ValueError(f"{label}: its codes times its scales overflow to inf; {_CORRUPT}")
    return out


# checks (``label``: the parameter and state; ``field``: the saved tensor) ----------------------------------
def _plain(value: object, label: str, field: str) -> torch.Tensor:
    """``value`` if it is a plain (dense, unsharded) tensor."""
    if type(value) is not torch.Tensor:
        raise ValueError(f"{label}: its {field} is {type(value).__name__ if value is not None else 'missing'}, not "
                         f"a plain tensor; {_CORRUPT}")
    if value.layout != torch.strided:
        raise ValueError(f"{label}: its {field} is a {value.layout} tensor, not a dense one; {_CORRUPT}")
    return value


def _want(t: torch.Tensor, dtype: torch.dtype, label: str, field: str) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{label}: its {field} are {t.dtype}, not {dtype}; {_CORRUPT}")


def _same_shape(codes: torch.Tensor, shape: tuple[int, ...], label: str) -> None:
    if tuple(codes.shape) != shape:
        raise ValueError(f"{label}: its codes have shape {tuple(codes.shape)}, not the state's {shape}; {_CORRUPT}")


def _qmap(value: object, size: int, label: str, field: str, device: torch.device) -> torch.Tensor:
    """A code -> value map: ``size`` finite fp32 values within [-1, 1] (every code indexes one)."""
    qmap = _plain(value, label, field)
    _want(qmap, torch.float32, label, field)
    if qmap.shape != (size,):
        raise ValueError(f"{label}: its {field} has shape {tuple(qmap.shape)}, not ({size},): one value per code; "
                         f"{_CORRUPT}")
    if not (torch.isfinite(qmap) & (qmap.abs() <= 1)).all():
        raise ValueError(f"{label}: its {field} holds values that are not finite or outside [-1, 1]; {_CORRUPT}")
    return qmap.to(device)


def _scales(value: object, count: int, label: str, field: str, device: torch.device) -> torch.Tensor:
    """``count`` block scales: fp32, finite and non-negative (a peer's state of a run already diverged has
    inf or NaN scales; it cannot be continued)."""
    scales = _plain(value, label, field)
    _want(scales, torch.float32, label, field)
    if scales.numel() != count:
        raise ValueError(f"{label}: its {field} holds {scales.numel()} scales, where its codes need {count}; "
                         f"{_CORRUPT}")
    scales = scales.reshape(-1)
    if not (torch.isfinite(scales) & (scales >= 0)).all():
        raise ValueError(f"{label}: its {field} holds inf, NaN or negative scales: the peer's run had diverged, or "
                         f"{_CORRUPT}")
    return scales.to(device)


def _step(value: object, label: str) -> torch.Tensor:
    """The step count as a stock fp32 tensor."""
    if not is_real_number(value) or not math.isfinite(step := float(value)) or step < 0 or step != int(step):
        raise ValueError(f"{label}: its 'step' is {value!r}, not a count of steps; {_CORRUPT}")
    return torch.tensor(step, dtype=torch.float32)


def _check_moments(out: Mapping[str, torch.Tensor], label: str) -> None:
    """The moments are floating point and the second moments non-negative."""
    for key, value in out.items():
        if key == "step" or not isinstance(value, torch.Tensor) or sharding.is_sharded(value):
            continue
        if not value.is_floating_point():
            raise ValueError(f"{label}: its {key!r} is a {value.dtype} tensor, not a floating one; {_CORRUPT}")
        if key in _NONNEG and (value < 0).any():
            raise ValueError(f"{label}: its second moment {key!r} holds negative values; {_CORRUPT}")


def _group(group: Mapping, index: int, libraries: set[str]) -> dict:
    """A peer's param group as stock Adam's: torchao's tensor ``lr`` as a float, bitsandbytes' AdEMAMix
    keys (at their Adam values) left out."""
    group = dict(group)
    if "bitsandbytes" in libraries:
        extra = {k: group.pop(k) for k in _BNB_ADEMAMIX if k in group}
        betas = group.get("betas")
        three_betas = isinstance(betas, (tuple, list)) and len(betas) > 2
        if three_betas or any(v != _BNB_ADEMAMIX[k] for k, v in extra.items()):
            raise ValueError(f"param_groups[{index}] is an AdEMAMix group ({extra}, betas {betas}): "
                             "only Adam8bit/AdamW8bit states are read")
    lr = group.get("lr")
    if "torchao" in libraries and isinstance(lr, torch.Tensor):
        if not is_real_number(lr) or not math.isfinite(float(lr)):
            raise ValueError(f"param_groups[{index}]['lr'] is {lr!r}, not one finite number; {_CORRUPT}")
        group["lr"] = float(lr)
    return group
