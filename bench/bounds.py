"""The stated error bound of each format (docs/numerics.md, the README's "Numerics"), and the long-idle-row
run held to it: what ``bench/numerics.py`` reports and ``tests/test_numerics.py`` asserts."""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch

from lowbit_compile import lowbit_compile
from lowbit_compile.formats import StateFormat, blockquant
from lowbit_compile.formats.dynamic import dynamic_map

FLT_MAX = torch.finfo(torch.float32).max
INF = math.inf

# Mantissa bits and smallest normal exponent of the fp8 formats, for their rounding bound.
_FP8 = {"fp8_e4m3": (3, -6), "fp8_e5m2": (2, -14)}


@functools.cache
def _finite_map(nonneg: bool, flagged: bool) -> torch.Tensor:
    """The dynamic map values a finite value may decode to (a flagged block's specials excluded)."""
    table = dynamic_map(nonneg).double()
    if not flagged:
        return table
    return table[:253] if nonneg else table[1:254]


def element_bound(x: torch.Tensor, scale: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor) -> torch.Tensor:
    """Per finite non-patch element (float64): how far its decoded value may be from ``x``."""
    scale = torch.where(scale > 0, scale, 1.0)  # a zero scale holds only zeros (bound 0 + slack)
    if fmt.name == "int8":
        step = scale / 2
    elif fmt.spec.root_domain:  # the nearest square root (sqrt8, sqrt4): |c^2 - t| <= sqrt(t) + 1/4 (t = |x| / scale)
        step = ((x.abs() / scale).sqrt() + 0.25) * scale
    elif fmt.name == "dynamic8":  # the nearest finite map value
        t = x / scale
        step = torch.where(flagged, *((t[:, None] - _finite_map(fmt.nonneg, f)[None, :]).abs().amin(1)
                                      for f in (True, False))) * scale
    else:
        mantissa, min_exp = _FP8[fmt.name]
        step = torch.maximum(2.0 ** -(mantissa + 1) * x.abs(), 2.0 ** (min_exp - mantissa - 1) * scale)
    if fmt.nonneg:  # the zero-point rule raises a tiny positive value to the smallest code
        step = torch.where(x > 0, torch.maximum(step, fmt.min_positive * scale - x), step)
    return step + 2.0**-20 * (x.abs() + step) + 2.0**-149


def bf16_bound(x: torch.Tensor, nonneg: bool) -> torch.Tensor:
    """Round to nearest bf16 (half an ulp: 2^-8 relative, 2^-134 absolute among subnormals),
    saturating; for a non-negative state a positive value below 2^-133 is raised to it."""
    bound = 2.0**-8 * x.abs() + 2.0**-134
    return torch.where(x > 0, torch.maximum(bound, 2.0**-133 - x), bound) if nonneg else bound


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that every NaN equals every NaN (payloads are not preserved)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    bits = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return torch.equal(a.view(bits)[~nan_a], b.view(bits)[~nan_b])  # bits first: torch 2.9 cannot index fp8


def reference_layout(x: torch.Tensor, fmt: StateFormat):
    """In float64: per block the patch offsets (K largest finite magnitudes, ties to the lowest
    offset, non-finite values after every finite one), the flag, and the scale of the rest."""
    b, n = fmt.block_size, x.numel()
    nb = -(-n // b)
    blocks = torch.zeros(nb * b, dtype=torch.float64)
    blocks[:n] = x.double()
    blocks = blocks.view(nb, b)
    finite = torch.isfinite(blocks)
    rank = torch.where(finite, blocks.abs(), -1.0)
    order = torch.sort(-rank, dim=1, stable=True).indices[:, : fmt.patches]
    is_patch = torch.zeros(nb, b, dtype=torch.bool).scatter_(1, order, True)
    rest_finite = finite | is_patch
    flagged = ~rest_finite.all(1)
    absmax = torch.where(finite & ~is_patch, blocks.abs(), 0.0).amax(1)
    qmax = torch.where(flagged, fmt.flagged_qmax, fmt.qmax)
    exact = absmax / qmax
    if fmt.neg_qmax != fmt.qmax:  # signed dynamic8: each side over its end of the map
        rest = torch.where(finite & ~is_patch, blocks, 0.0)
        sides = torch.maximum(rest.amax(1).clamp(min=0) / fmt.qmax, (-rest).amax(1).clamp(min=0) / fmt.neg_qmax)
        exact = torch.where(flagged, exact, sides)
    scale = torch.where(absmax > 0, torch.clamp(exact, min=blockquant.MIN_SCALE, max=FLT_MAX), 0.0)
    return order, is_patch.reshape(-1)[:n], flagged, scale


# -- long-idle rows ------------------------------------------------------------------------------------
class IdleRow(NamedTuple):
    finite: bool  # every param finite after the idle steps
    max_off: float  # max |p - p_fp32|
    off_over_movement: float  # ||p - p_fp32|| / ||stock's movement during the idle steps||
    bound_over_movement: float  # ||bound|| / the same
    within_bound: bool  # |p - p_fp32| <= bound, element by element


def stored_interval(x: torch.Tensor, fmt: StateFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """In float64, where ``fmt`` may store the fp32 values ``x`` (the stated bound)."""
    x = x.reshape(-1)
    x64 = x.double()
    if fmt.blockwise:
        _, _, flagged, scale = reference_layout(x, fmt)
        block = torch.arange(x64.numel()) // fmt.block_size
        err = element_bound(x64, scale[block], fmt, flagged[block])
        smallest = fmt.min_positive * scale[block]
    else:
        err = bf16_bound(x64, fmt.nonneg)
        smallest = torch.full_like(x64, 2.0**-133)
    lo = x64 - err
    if fmt.nonneg:  # the zero-point rule: a positive value decodes to at least the smallest code
        lo = torch.where(x64 > 0, torch.maximum(lo, smallest), lo)
    return lo, x64 + err


def _decayed(lo: torch.Tensor, hi: torch.Tensor, fmt: StateFormat, beta: float, k: torch.Tensor,
             block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the stored state may be after ``k`` idle steps (``x *= beta``; ``k`` a column), from
    where it may be after the update (``[lo, hi]``, one row)."""
    if fmt.blockwise:  # the codes stay, the scale decays (fp32 rounding: 2^-21 per step) ...
        f_lo, f_hi, spill = beta * (1 - 2.0**-21), beta * (1 + 2.0**-21), 0.0
    else:  # bf16 rounds every step, never away from zero, and 2^-134 absolute among subnormals
        f_lo, f_hi, spill = beta * (1 - 2.0**-8), min(1.0, beta * (1 + 2.0**-8)), 2.0**-134
    lo = torch.where(lo >= 0, lo * f_lo**k, lo * f_hi**k) - spill * k
    hi = torch.where(hi >= 0, hi * f_hi**k, hi * f_lo**k) + spill * k
    if fmt.blockwise:  # ... until the block's scale reaches MIN_SCALE: then anywhere below qmax * MIN_SCALE
        edge = fmt.qmax * blockquant.MIN_SCALE
        reach = torch.maximum(lo.abs(), hi.abs()).unflatten(1, (-1, block_size)).amax(2, keepdim=True)
        floor = (reach < 4 * edge).expand(-1, -1, block_size).flatten(1)
        lo = torch.where(floor, torch.clamp(lo, max=0.0 if fmt.nonneg else -edge), lo)
        hi = torch.where(floor, torch.clamp(hi, min=edge), hi)
    return lo, hi


def idle_row_run(fmt: str, steps: int, block_size: int = 256, backend: str = "reference",
                 rounding: str = "nearest") -> IdleRow:
    """Adam (lr 1e-3, default betas) on two rows of one block each: one step with N(0, 1) gradients
    (1e-20 in the second row), then ``steps`` steps with zero gradients, against stock.

    The bound: after the update both runs hold the same m and v up to the format's bound (``stored_interval``).
    While idle, m and v only decay (``x *= beta``), and a decayed block re-quantizes to the same codes
    (``test_a_decaying_block_keeps_its_codes``), so the stored values stay within the decayed interval
    (``_decayed``); a positive v stays at least the smallest code of its block. Each step's update over
    those intervals (its extremes are at the corners) differs from stock's by at most ``dev``; the
    param's own fp32 rounding adds at most ``min(ulp / 2, |update|)`` per run and step.
    """
    lr, (b1, b2), eps = 1e-3, (0.9, 0.999), 1e-8
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(2, block_size, generator=gen)
    grad = torch.randn(2, block_size, generator=gen) * torch.tensor([[1.0], [1e-20]])
    ours_p, stock_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ours = lowbit_compile(torch.optim.Adam([ours_p], lr=lr), fmt, block_size=block_size, outliers=0, min_8bit_size=0,
                          backend=backend, rounding=rounding)
    stock = torch.optim.Adam([stock_p], lr=lr)
    history = torch.empty(steps, 2, 2 * block_size)  # stock's m and v after each idle step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p, opt in ((ours_p, ours), (stock_p, stock)):
            p.grad = grad.clone()
            opt.step()
            p.grad = torch.zeros_like(grad)
        assert same_values(ours_p.detach(), stock_p.detach())  # the update itself starts from exact zeros
        first = stock_p.detach().double().reshape(-1)
        state = stock.state[stock_p]
        fm, fv = (ours.state[ours_p][k].fmt for k in ("exp_avg", "exp_avg_sq"))
        (m_lo, m_hi), (v_lo, v_hi) = stored_interval(state["exp_avg"], fm), stored_interval(state["exp_avg_sq"], fv)
        for i in range(steps):
            ours.step()
            stock.step()
            history[i, 0], history[i, 1] = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
    top = first.abs() * 2 + 2.0**-126
    half_ulp = (torch.nextafter(top.float(), torch.tensor(INF)).double() - top) / 2  # of any param reached
    v_floor = fv.min_positive * blockquant.MIN_SCALE if fv.blockwise else 2.0**-133  # a positive v stays above
    bound = torch.zeros_like(first)
    for chunk in torch.arange(1, steps + 1, dtype=torch.float64).split(500):
        k = chunk[:, None]  # idle steps so far; the optimizer's step count is k + 1
        lo_m, hi_m = _decayed(m_lo[None], m_hi[None], fm, b1, k, block_size)
        lo_v, hi_v = _decayed(v_lo[None], v_hi[None], fv, b2, k, block_size)
        lo_v = torch.where(v_lo[None] > 0, torch.clamp(lo_v, min=v_floor), lo_v.clamp(min=0.0))
        bc1, bc2 = 1 - b1 ** (k + 1), (1 - b2 ** (k + 1)).sqrt()

        def update(m, v, bc1=bc1, bc2=bc2):
            return lr / bc1 * m / (v.sqrt() / bc2 + eps)

        recorded = history[int(chunk[0]) - 1: int(chunk[-1])].double()
        want = update(recorded[:, 0], recorded[:, 1])
        corners = torch.stack([update(m, v) for m in (lo_m, hi_m) for v in (lo_v, hi_v)])
        dev = (corners - want).abs().amax(0) + 2.0**-21 * want.abs()
        bound += (dev + torch.minimum(half_ulp, want.abs()) + torch.minimum(half_ulp, corners.abs().amax(0))).sum(0)
    ours_final, stock_final = ours_p.detach().double().reshape(-1), stock_p.detach().double().reshape(-1)
    off = (ours_final - stock_final).abs()
    movement = (stock_final - first).norm().item()
    return IdleRow(bool(torch.isfinite(ours_p).all()), off.max().item(), off.norm().item() / movement,
                   bound.norm().item() / movement, bool((off <= bound).all()))
