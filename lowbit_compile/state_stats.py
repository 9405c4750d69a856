"""``stats(opt)``: health of the quantized states of a wrapped optimizer, measured on demand.

Nothing is recorded while training; a call costs one extra fp32 step of each parameter, run on
copies (one parameter at a time, then one round trip per format for all of them), so the optimizer,
its states and the parameters are unchanged.
Call it between ``backward()`` and ``step()``: the gradients say what the next step will store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .formats import StateFormat, blockquant
from .formats.rounding import state_draws
from .passes.trace import shell_optimizer, unhooked_step
from .passes.trace_cache import trace_group
from .runtime.wrapped import wrapped_of
from .state import QuantizedState, master
from .state.schema import probe_schema


@dataclass(frozen=True)
class StateStats:
    """One quantized state of one parameter.

    ``rel_error``: ``||Q(x) - x|| / ||x||`` for the value ``x`` the next step computes for this state
    (the stock fp32 step from the current, dequantized states and the current gradient) and ``Q``
    this state's quantize-dequantize round trip. ``zero_flush``: the fraction of non-zero entries of
    ``x`` that ``Q`` turns into exactly 0. ``rounding_bias``, of a non-negative state (Adam's v; None
    for a signed one, where entries near 0 would swamp the mean): the mean over the non-zero entries
    of ``x`` of ``(Q(x) - x) / x``, the signed drift one step's rounding adds: a moving average
    with decay ``beta`` compounds it about ``1 / (1 - beta)``-fold (v's 1000-fold at ``beta2 = 0.999``),
    where rounding to nearest keeps a value that moves less than half a code per step, so a v whose
    gradients shrank is held above its exact average (docs/monitoring.md). A stochastically rounded
    state is measured with one draw of its rounding. ``patched_blocks``: the fraction of blocks of the stored
    state whose largest outlier patch is at least twice the absmax of the rest of the block (there
    the patches at least halve the step of the code grid); None for formats without patches.
    ``update_ratio``: ``||p_next - p|| / ||p||`` of that next step. The four measured on the
    next step are None when the parameter has no gradient. ``sampled``: the share of the
    parameter's elements they were measured on (1.0 unless ``stats(..., max_blocks=)`` sampled).
    """

    param: str
    state: str
    fmt: str
    numel: int
    rel_error: float | None
    zero_flush: float | None
    patched_blocks: float | None
    update_ratio: float | None
    sampled: float = 1.0
    rounding_bias: float | None = None


class Stats(list):
    """A list of ``StateStats`` that prints as a table."""

    def __str__(self) -> str:
        def num(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        lines = [f"{'param':<32}{'state':<16}{'format':<20}{'numel':>11}{'rel err':>10}{'zero flush':>12}"
                 f"{'bias/step':>11}{'patched':>9}{'upd/param':>11}"]
        for s in self:
            lines.append(f"{s.param[-31:]:<32}{s.state:<16}{s.fmt:<20}{s.numel:>11,}{num(s.rel_error, '.2e'):>10}"
                         f"{num(s.zero_flush, '.2e'):>12}{num(s.rounding_bias, '+.1e'):>11}"
                         f"{num(s.patched_blocks, '.1%'):>9}{num(s.update_ratio, '.2e'):>11}")
        return "\n".join(lines)


def stats(opt: torch.optim.Optimizer,
          named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None, *,
          max_blocks: int | None = None, offset: int = 0) -> Stats:
    """Per quantized state of ``opt``: relative quantization error, fraction of non-zero values
    flushed to zero, rounding bias, outlier-patch use and the update/param ratio (see ``StateStats``).

    ``named_parameters`` (e.g. ``model.named_parameters()``) labels the rows; without it a row is
    labelled ``group<i>.<j>``. ``max_blocks`` measures the next step on at most that many
    quantization blocks per parameter, evenly spaced from ``offset`` (the step is elementwise and
    blocks quantize independently, so the figures are those of the blocks measured, exactly);
    ``None`` measures every block, as does a step that is not elementwise (Muon's).
    """
    if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
        raise ValueError(f"max_blocks must be a positive int or None, got {max_blocks!r}")
    names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
    wrapped = wrapped_of(opt)
    rows: list[dict] = []
    measured: list[tuple[dict, torch.Tensor, StateFormat, bool]] = []  # (row, next value, format, stochastic)
    for gi, group in enumerate(opt.param_groups):
        for pi, param in enumerate(group["params"]):
            state = opt.state.get(param, {})
            quantized = {k: v for k, v in state.items() if isinstance(v, QuantizedState)}
            if not quantized:
                continue
            # a step that is not elementwise (Muon's) is measured on the whole parameter, never on blocks
            whole = probe_schema(opt, group, param).shaped
            index = None if whole else _sample(param.numel(), quantized.values(), max_blocks, offset)
            nxt, ratio = _next_step(opt, group, param, state, index) if param.grad is not None else ({}, None)
            share = 1.0 if index is None else index.numel() / max(param.numel(), 1)
            stochastic = wrapped.config.stochastic({k: v.fmt for k, v in quantized.items()}) if wrapped else ()
            for key, value in quantized.items():
                row = dict(param=names.get(id(param), f"group{gi}.{pi}"), state=key, fmt=value.fmt.tag(),
                           numel=param.numel(), rel_error=None, zero_flush=None,
                           patched_blocks=_patched_blocks(value), update_ratio=ratio, sampled=share)
                rows.append(row)
                if key in nxt:
                    measured.append((row, nxt[key], value.fmt, key in stochastic))
    by_rounding: dict[tuple[StateFormat, bool], list[tuple[dict, torch.Tensor]]] = {}
    for row, x, fmt, sr in measured:
        by_rounding.setdefault((fmt, sr), []).append((row, x))
    for (fmt, sr), items in by_rounding.items():
        figures = _round_trips([x for _, x in items], fmt, stochastic_seed=offset if sr else None)
        for row, (err, flush, bias) in zip((r for r, _ in items), figures):
            row.update(rel_error=err, zero_flush=flush, rounding_bias=bias)
    return Stats(StateStats(**row) for row in rows)


def _sample(numel: int, quantized: Iterable[QuantizedState], max_blocks: int | None,
            offset: int) -> torch.Tensor | None:
    """The flat indices of ``max_blocks`` evenly spaced whole blocks (of the largest block size among
    the states; the smaller ones divide it), or None to measure every element."""
    block = max((v.fmt.block_size for v in quantized if v.fmt.blockwise), default=0)
    nb = -(-numel // block) if block else 0
    if max_blocks is None or nb <= max_blocks:
        return None
    stride = nb // max_blocks
    blocks = offset % stride + torch.arange(max_blocks) * stride
    index = (blocks[:, None] * block + torch.arange(block)).reshape(-1)
    return index[index < numel]


def _sampled_state(value: QuantizedState, index: torch.Tensor) -> torch.Tensor:
    """The values of ``value`` at ``index`` (whole blocks of it), decoding only those blocks."""
    fmt = value.fmt
    if not fmt.blockwise:
        return blockquant.dequantize(blockquant.Quantized(value.codes[index], *value.storage_parts[1:]), fmt,
                                     value.dtype)
    blocks = torch.unique_consecutive(index // fmt.block_size)
    # a 4-bit format's blocks are whole bytes (an even block size), two codes each: the bytes of every other index
    codes = value.codes[index[::2] // 2] if fmt.packed else value.codes[index]
    part = blockquant.Quantized(codes, value.scales[blocks], value.patch_values[blocks], value.patch_index[blocks])
    return blockquant.dequantize(part, fmt, value.dtype, index.numel())


@torch.no_grad()
def _next_step(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor, state: dict,
               index: torch.Tensor | None) -> tuple[dict, float]:
    """The stock fp32 step of ``param`` (of its elements at ``index``) on copies: the new
    per-element states and ||dp|| / ||p||. A param with master weights steps its fp32 master (with
    the grad as fp32), as the rewritten step does."""
    def part(t: torch.Tensor) -> torch.Tensor:
        return t.detach() if index is None else t.detach().reshape(-1)[index]

    held = master.master_of(param, state)
    start = part(param if held is None else held).clone()
    probe = start.clone()
    probe.grad = part(param.grad).to(probe.dtype, copy=True)
    grad_scale = getattr(opt, "grad_scale", None)  # a fused optimizer under GradScaler unscales in its step
    if grad_scale is not None:
        probe.grad.div_(grad_scale)
    copies = {}
    for k, v in state.items():
        if k in master.KEYS:
            continue
        if isinstance(v, QuantizedState):
            copies[k] = v.dequantize() if index is None else _sampled_state(v, index)
        elif isinstance(v, torch.Tensor):
            copies[k] = part(v).clone() if v.shape == param.shape and v.dim() > 0 else v.clone()
        else:
            copies[k] = v
    unhooked_step(type(opt))(shell_optimizer(opt, trace_group(group), probe, copies))
    norm = start.float().norm().item()
    ratio = (probe.float() - start.float()).norm().item() / norm if norm > 0 else float("inf")
    return copies, ratio


def _round_trips(values: list[torch.Tensor], fmt: StateFormat,
                 stochastic_seed: int | None = None) -> list[tuple[float, float, float | None]]:
    """(relative error, zero-flush share, rounding bias: for a non-negative ``fmt`` the mean relative
    error, else None) of ``fmt``'s round trip of each value, from one quantize of them all: each is
    zero-padded to whole blocks, which changes none of its blocks (blocks quantize independently, and
    zeros move no block's absmax, patch or flag). With ``stochastic_seed`` they round stochastically,
    with the draws of that counter."""
    block = fmt.block_size if fmt.blockwise else 1
    flats = [v.detach().reshape(-1).float() for v in values]
    lengths = [-(-f.numel() // block) * block for f in flats]
    x = torch.cat([torch.nn.functional.pad(f, (0, n - f.numel())) for f, n in zip(flats, lengths)])
    quantized = blockquant.empty(x.numel(), fmt, x.device)
    draws = None if stochastic_seed is None else state_draws(stochastic_seed, 1, x.numel())
    blockquant.quantize_into(x, quantized, fmt, draws=draws)
    back = blockquant.dequantize(quantized, fmt, numel=x.numel())
    segment = torch.repeat_interleave(torch.arange(len(flats)), torch.tensor(lengths, dtype=torch.long))
    nonzero = x != 0
    terms = [x.double().square(), (back - x).double().square(), nonzero.double(), (nonzero & (back == 0)).double()]
    if fmt.nonneg:  # a signed state's entries near 0 would swamp a mean of relative errors
        moving = nonzero & torch.isfinite(x)
        terms += [torch.where(moving, (back.double() - x.double()) / x.double(), 0.0), moving.double()]
    sums = torch.zeros(len(terms), len(flats), dtype=torch.float64)
    for i, term in enumerate(terms):
        sums[i].index_add_(0, segment, term)
    out = []
    for norm2, err2, n, flushed, *drift in sums.t().tolist():
        bias = (drift[0] / drift[1] if drift[1] else 0.0) if drift else None
        out.append(((err2 / norm2) ** 0.5 if norm2 > 0 else 0.0, flushed / n if n else 0.0, bias))
    return out


def _patched_blocks(value: QuantizedState) -> float | None:
    fmt = value.fmt
    if not fmt.patches or value.scales.numel() == 0:
        return None
    largest = value.patch_values.float().abs().amax(dim=1)
    rest = value.scales.float().abs() * fmt.qmax  # a flagged block's scale is negative
    return (largest >= 2 * rest).logical_and(largest > 0).float().mean().item()
