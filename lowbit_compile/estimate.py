"""Training-memory estimate for Adam/AdamW (and Muon on the matrices with AdamW on the rest): stock
fp32 states against a low-bit format, per component.

The same accounting people do by hand ("7B params, fp16 weights and grads, fp32 m, v and master
weights: 7e9 x (2 + 2 + 4 + 4 + 4) B = 112 GB"), with the low-bit states' sizes taken from the real
storage layout (``formats.blockquant.empty`` on the meta device: codes, per-block scales, outlier
patches), so the estimate follows any change of layout. Activations, the allocator's caches and
per-tensor scalars (the step counters) are not counted; the block count assumes tensors much
larger than a block (each tensor's last, partial block adds at most one block per tensor).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .config import DEFAULT_FMT, DEFAULT_OUTLIERS, NONNEG_STATES, Config
from .formats import StateFormat, blockquant
from .formats.residual import MODES as MASTER_MODES
from .formats.residual import MasterFormat, tie_words
from .options import FP32, MAX_PARAM_COUNT, PARAM_DTYPE_NAMES, Options, is_int

PARAM_DTYPES = dict(zip(PARAM_DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
GB = 10**9

# ZeRO stages (Rajbhandari et al. 2020): 1 shards optimizer states (and the fp32 master weights the
# optimizer steps), 2 also gradients, 3 also parameters (FSDP's full sharding).
_SHARDED_FROM_STAGE = {"states": 1, "master": 1, "grads": 2, "params": 3}


@dataclass(frozen=True)
class Row:
    component: str
    stock: int
    lowbit: int


@dataclass(frozen=True)
class Estimate:
    """Bytes per device of each component, stock AdamW and with the chosen low-bit format."""

    rows: tuple[Row, ...]
    title: str
    params: int = 0  # the model's parameters, when one device holds all of them (for the B/param line)

    @property
    def stock_total(self) -> int:
        return sum(r.stock for r in self.rows)

    @property
    def lowbit_total(self) -> int:
        return sum(r.lowbit for r in self.rows)

    def row(self, component: str) -> Row:
        return next(r for r in self.rows if r.component == component)

    def __str__(self) -> str:
        lines = [self.title, f"{'component':<24}{'stock bytes':>19}{'GB':>9}{'low-bit bytes':>19}{'GB':>9}"]
        for r in (*self.rows, Row("total", self.stock_total, self.lowbit_total)):
            lines.append(f"{r.component:<24}{r.stock:>19,}{r.stock / GB:>9.3f}{r.lowbit:>19,}{r.lowbit / GB:>9.3f}")
        saved = self.stock_total - self.lowbit_total
        pct = 100.0 * saved / self.stock_total if self.stock_total else 0.0
        lines.append(f"saved {saved:,} bytes = {saved / GB:.3f} GB ({pct:.1f}% of the total)   [GB = 10^9 bytes]")
        if self.params:
            lines.append(f"per parameter: {self.stock_total / self.params:.3f} B stock, "
                         f"{self.lowbit_total / self.params:.3f} B low-bit")
        return "\n".join(lines)


def estimate(
    params: int,
    *,
    param_dtype: str = FP32,
    master_weights: bool | str | None = False,
    fmt: str | Mapping[str, str] = DEFAULT_FMT,
    block_size: int | None = None,
    outliers: int = DEFAULT_OUTLIERS,
    shards: int = 1,
    zero_stage: int = 3,
    amsgrad: bool = False,
    muon_params: int = 0,
    release_grads: bool = False,
) -> Estimate:
    """Bytes per device for ``params`` parameters trained with Adam/AdamW, or ``muon_params`` of them
    (the matrices) with Muon, whose one state is its momentum, and the rest with AdamW. Muon's
    transient (one matrix's Newton-Schulz temporaries while it steps) is not counted.

    Gradients have the parameters' dtype. The optimizer steps the fp32 master weights when
    ``master_weights`` (mixed precision), else the parameters, and stock states have the dtype of
    what it steps. ``master_weights``: ``True`` or ``"fp32"``, an fp32 copy in both columns;
    ``"exact"`` or ``"8bit"``, the copy in the stock column and our residual state
    (``lowbit_compile(..., master_weights=...)``) in the low-bit one. With ``shards`` > 1 the components
    ZeRO stage ``zero_stage`` shards are divided evenly (rounded up) over the devices. With
    ``release_grads`` the low-bit column holds no grads: each steps and is freed as it lands in backward
    (what is in flight then, the grad stepping and a bucket of small ones, is not counted). ``block_size``
    None: each optimizer's states share the smallest default block of their formats, as ``lowbit_compile``'s.
    """
    if not is_int(params) or not 1 <= params <= MAX_PARAM_COUNT:
        raise ValueError(f"the parameter count must be an int from 1 to {MAX_PARAM_COUNT:.0e} (tensor sizes are "
                         f"int64), got {params!r}".replace("e+", "e"))
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {tuple(PARAM_DTYPES)}, got {param_dtype!r}")
    mode = FP32 if master_weights is True else (master_weights or None)
    if mode not in (None, FP32, *MASTER_MODES):
        raise ValueError(f"master_weights must be True, 'fp32', 'exact', '8bit' or False, got {master_weights!r}")
    if mode and param_dtype == FP32:
        raise ValueError("master weights are an fp32 copy of 16-bit params; pass param_dtype='bf16' or 'fp16'")
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(muon_params, int) or not 0 <= muon_params <= params:
        raise ValueError(f"muon_params must be an int between 0 and params ({params:,}), got {muon_params!r}")
    config = Config.of(Options(fmt, block_size, outliers, min_8bit_size=0, backend="reference"))

    def local(kind: str, n: int = params) -> int:
        return -(-n // shards) if zero_stage >= _SHARDED_FROM_STAGE[kind] else n

    p_bytes = PARAM_DTYPES[param_dtype].itemsize
    state_dtype = torch.float32 if mode else PARAM_DTYPES[param_dtype]
    rows = [
        Row(f"params ({param_dtype})", local("params") * p_bytes, local("params") * p_bytes),
        Row(f"grads ({param_dtype}{', released' if release_grads else ''})", local("grads") * p_bytes,
            0 if release_grads else local("grads") * p_bytes),
    ]
    if mode == FP32:
        rows.append(Row("master weights (fp32)", local("master") * 4, local("master") * 4))
    elif mode:
        n_master = local("master")
        residual = MasterFormat(mode, PARAM_DTYPES[param_dtype])
        held = n_master * residual.residual_dtype.itemsize + (4 * tie_words(n_master) if residual.has_ties else 0)
        rows.append(Row(f"master ({mode} residual)", n_master * 4, held))
    extra = 0
    states = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    states = [(key, local("states", params - muon_params)) for key in states]
    if muon_params:
        states.append(("momentum_buffer", local("states", muon_params)))
    blocks = {key: config.block_size_of(config.format_name(k) for k, _ in states if k != "momentum_buffer")
              for key, _ in states if key != "momentum_buffer"}
    if muon_params:
        blocks["momentum_buffer"] = config.block_size_of([config.format_name("momentum_buffer")])
    short = {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "max v"}
    dtype_name = next(k for k, v in PARAM_DTYPES.items() if v == state_dtype)
    for key, n_state in states:
        label = f"{key} ({short[key]}, {dtype_name})" if key in short else f"Muon momentum ({dtype_name})"
        state_fmt = StateFormat.make(config.format_name(key), blocks[key], outliers, key in NONNEG_STATES)
        stock = n_state * state_dtype.itemsize
        if state_fmt.passthrough:
            rows.append(Row(label, stock, stock))
            continue
        codes, *side = blockquant.empty(n_state, state_fmt, "meta")
        rows.append(Row(label, stock, codes.numel() * codes.element_size()))
        extra += sum(t.numel() * t.element_size() for t in side)
    rows.append(Row("scales + patches", 0, extra))

    what = f"{param_dtype} params and grads" + (", fp32 master weights" if mode else "")
    where = "1 device" if shards == 1 else f"per device of {shards} (ZeRO stage {zero_stage})"
    fmt_text = config.fmt if isinstance(config.fmt, str) else dict(config.fmt)
    which = f"Muon ({muon_params:,} of them) + AdamW" if muon_params else "Adam/AdamW"
    title = (f"{which} memory for {params:,} parameters ({what}), {where}; low-bit: fmt={fmt_text}, "
             f"block_size={'/'.join(map(str, sorted(set(blocks.values()), reverse=True)))}, outliers={outliers}"
             + (f", master_weights={mode!r}" if mode in MASTER_MODES else "")
             + (", release_grads=True (grads freed as each steps in backward)" if release_grads else ""))
    return Estimate(tuple(rows), title, params if shards == 1 else 0)
