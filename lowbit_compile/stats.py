"""``stats(opt)``: health of the quantized states of a wrapped optimizer, measured on demand.

Nothing is recorded while training; a call costs one extra fp32 step of each parameter, run on
copies (one parameter at a time), so the optimizer, its states and the parameters are unchanged.
Call it between ``backward()`` and ``step()``: the gradients say what the next step will store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import master
from .kernels import blockquant
from .kernels.formats import StateFormat
from .passes.trace import shell_optimizer, unhooked_step
from .state import QuantizedState
from .trace_cache import trace_group


@dataclass(frozen=True)
class StateStats:
    """One quantized state of one parameter.

    ``rel_error``: ``||Q(x) - x|| / ||x||`` for the value ``x`` the next step computes for this state
    (the stock fp32 step from the current, dequantized states and the current gradient) and ``Q``
    this state's quantize-dequantize round trip. ``zero_flush``: the fraction of non-zero entries of
    ``x`` that ``Q`` turns into exactly 0. ``patched_blocks``: the fraction of blocks of the stored
    state whose largest outlier patch is at least twice the absmax of the rest of the block (there
    the patches at least halve the step of the code grid); None for formats without patches.
    ``update_ratio``: ``||p_next - p|| / ||p||`` of that next step. The three measured on the
    next step are None when the parameter has no gradient.
    """

    param: str
    state: str
    fmt: str
    numel: int
    rel_error: float | None
    zero_flush: float | None
    patched_blocks: float | None
    update_ratio: float | None


class Stats(list):
    """A list of ``StateStats`` that prints as a table."""

    def __str__(self) -> str:
        def num(x: float | None, spec: str) -> str:
            return "-" if x is None else format(x, spec)

        lines = [f"{'param':<32}{'state':<16}{'format':<20}{'numel':>11}{'rel err':>10}{'zero flush':>12}"
                 f"{'patched':>9}{'upd/param':>11}"]
        for s in self:
            lines.append(f"{s.param[-31:]:<32}{s.state:<16}{s.fmt:<20}{s.numel:>11,}{num(s.rel_error, '.2e'):>10}"
                         f"{num(s.zero_flush, '.2e'):>12}{num(s.patched_blocks, '.1%'):>9}"
                         f"{num(s.update_ratio, '.2e'):>11}")
        return "\n".join(lines)


def stats(opt: torch.optim.Optimizer,
          named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None) -> Stats:
    """Per quantized state of ``opt``: relative quantization error, fraction of non-zero values
    flushed to zero, outlier-patch use and the update/param ratio (see ``StateStats``).

    ``named_parameters`` (e.g. ``model.named_parameters()``) labels the rows; without it a row is
    labelled ``group<i>.<j>``.
    """
    names = {id(p): n for n, p in named_parameters} if named_parameters is not None else {}
    out = Stats()
    for gi, group in enumerate(opt.param_groups):
        for pi, param in enumerate(group["params"]):
            state = opt.state.get(param, {})
            quantized = {k: v for k, v in state.items() if isinstance(v, QuantizedState)}
            if not quantized:
                continue
            nxt, ratio = _next_step(opt, group, param, state) if param.grad is not None else ({}, None)
            for key, value in quantized.items():
                err, flush = _round_trip(nxt[key], value.fmt) if key in nxt else (None, None)
                out.append(StateStats(names.get(id(param), f"group{gi}.{pi}"), key, value.fmt.tag(),
                                      param.numel(), err, flush, _patched_blocks(value), ratio))
    return out


@torch.no_grad()
def _next_step(opt: torch.optim.Optimizer, group: dict, param: torch.Tensor,
               state: dict) -> tuple[dict, float]:
    """The stock fp32 step of ``param`` on copies: the new per-element states and ||dp|| / ||p||. A param
    with master weights steps its fp32 master (with the grad as fp32), as the rewritten step does."""
    probe = master.master_of(param, state)
    probe = param.detach().clone() if probe is None else probe
    probe.grad = param.grad.detach().to(probe.dtype, copy=True)
    copies = {k: (v.dequantize() if isinstance(v, QuantizedState) else v.clone() if isinstance(v, torch.Tensor)
                  else v) for k, v in state.items() if k not in master.KEYS}
    unhooked_step(type(opt))(shell_optimizer(opt, trace_group(group), probe, copies))
    norm = param.detach().float().norm().item()
    ratio = (probe.float() - param.detach().float()).norm().item() / norm if norm > 0 else float("inf")
    return copies, ratio


def _round_trip(x: torch.Tensor, fmt: StateFormat) -> tuple[float, float]:
    flat = x.detach().reshape(-1).float()
    back = blockquant.dequantize(blockquant.quantize(flat, fmt), fmt)
    norm = flat.norm().item()
    err = (back - flat).norm().item() / norm if norm > 0 else 0.0
    nonzero = flat != 0
    n = int(nonzero.sum())
    flush = int((nonzero & (back == 0)).sum()) / n if n else 0.0
    return err, flush


def _patched_blocks(value: QuantizedState) -> float | None:
    fmt = value.fmt
    if not fmt.patches or value.scales.numel() == 0:
        return None
    largest = value.patch_values.float().abs().amax(dim=1)
    rest = value.scales.float() * fmt.qmax
    return (largest >= 2 * rest).logical_and(largest > 0).float().mean().item()
