"""Element formats of one quantized state: how a normalized value becomes an 8-bit code and back.

A format only maps numbers; grouping into blocks, scales and outlier patches lives in
``blockquant.py``. Every backend (eager reference, Triton, inductor) encodes and decodes with the
definitions here, so they agree on every code. In a block that holds +inf, -inf or NaN (a *flagged*
block, see ``blockquant.py``) three codes of each format mean those values, and the block's finite
values keep off them (``StateFormat.flagged_qmax``, ``special_codes``).

``sqrt8`` compands by a square root: the code is the magnitude's square root rounded to an integer
(0..127 with a sign, or 0..255), its value ``c * |c|``, so the resolution is fine near the block's
largest value and coarse only near zero (a relative step of ``2 / c``); one square root encodes it
(no table, no search), which makes it as cheap on a CPU as linear INT8. It encodes from the *root
domain* (:func:`normalize`): the value's square root times the block multiplier's, so a kernel that
already takes the state's square root (Adam's denominator) encodes without a second one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .rounding import threshold

FORMAT_NAMES = ("int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32", "sqrt8")
# The number of each format in the kernels (the C++ prelude's enum, triton_lib's constexprs).
FORMAT_IDS = {name: i for i, name in enumerate(FORMAT_NAMES)}


@dataclass(frozen=True)
class StateFormat:
    """The storage of one per-element state: element format, block size, patches per block, sign.

    ``nonneg`` marks a state that is never negative (a second moment): its codes spend all 256
    values on [0, max], and a positive value never encodes to zero (the zero-point problem of
    Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", Sec. 4.1), because
    ``m / (sqrt(v) + eps)`` turns a v that decodes to 0 into a step of ``m / eps``.
    """

    name: str
    block_size: int = 512  # the shipped defaults (options.DEFAULT_BLOCK_SIZE, DEFAULT_OUTLIERS)
    outliers: int = 0
    nonneg: bool = False

    def __post_init__(self) -> None:
        if self.name not in FORMAT_NAMES:
            raise ValueError(f"unknown format {self.name!r}; expected one of {FORMAT_NAMES}")

    @property
    def passthrough(self) -> bool:
        """fp32 keeps the stock tensor: no codes, no scales, bit-for-bit stock behaviour."""
        return self.name == "fp32"

    @property
    def blockwise(self) -> bool:
        """Whether codes are relative to a per-block scale (and so can carry outlier patches)."""
        return self.name not in ("bf16", "fp32")

    @property
    def patches(self) -> int:
        return self.outliers if self.blockwise else 0

    @property
    def code_dtype(self) -> torch.dtype:
        return {
            "int8": torch.uint8 if self.nonneg else torch.int8,
            "sqrt8": torch.uint8 if self.nonneg else torch.int8,
            "dynamic8": torch.uint8,
            "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2,
            "bf16": torch.bfloat16,
            "fp32": torch.float32,
        }[self.name]

    @property
    def bits(self) -> int:
        """Bits per element stored (what other libraries' "8bit", "4bit" name; a packed format, two codes a
        byte, says so here)."""
        return self.code_dtype.itemsize * 8

    @property
    def qmax(self) -> float:
        """The largest code: a block's largest positive value (or its absmax, where the format's codes
        are symmetric) maps onto it."""
        return {
            "int8": 255.0 if self.nonneg else 127.0,
            "sqrt8": 255.0**2 if self.nonneg else 127.0**2,  # codes are square roots: c * |c|
            "dynamic8": 1.0,
            "fp8_e4m3": 448.0,
            "fp8_e5m2": 57344.0,
            "bf16": 1.0,
            "fp32": 1.0,
        }[self.name]

    @property
    def neg_qmax(self) -> float:
        """The magnitude of the most negative code: a block's most negative value maps onto it. Only the
        signed dynamic map is asymmetric (it holds +1 but its bottom is -0.99297), so its block scale is
        the larger of the positive side over 1 and the negative side over 0.99297: the block's extreme
        element is stored exactly whichever its sign, and no resolution is lost."""
        if self.name == "dynamic8" and not self.nonneg:
            return -float(dynamic_map(False)[0])
        return self.qmax

    @property
    def mantissa_bits(self) -> int:
        """Of an fp8 format: its mantissa bits (the exponent has ``7 - mantissa_bits``)."""
        return {"fp8_e4m3": 3, "fp8_e5m2": 2}[self.name]

    @property
    def min_exponent(self) -> int:
        """Of an fp8 format: the exponent of its smallest normal value."""
        return 2 - 2 ** (6 - self.mantissa_bits)

    @property
    def flagged_qmax(self) -> float:
        """The largest code magnitude of a flagged block's finite values: the codes past it are the
        block's +inf, -inf and NaN (``special_codes``). fp8_e5m2 has those codes natively."""
        return {
            "int8": 252.0 if self.nonneg else 126.0,
            "sqrt8": 252.0**2 if self.nonneg else 126.0**2,
            "dynamic8": float(dynamic_map(self.nonneg)[252 if self.nonneg else 253]),
            "fp8_e4m3": 416.0,
        }.get(self.name, self.qmax)

    @property
    def min_positive(self) -> float:
        """The smallest positive normalized value this format can hold (what a tiny v rounds up to)."""
        return {
            "int8": 1.0,
            "sqrt8": 1.0,
            "dynamic8": float(dynamic_map(self.nonneg)[1 if self.nonneg else 128]),
            "fp8_e4m3": 2.0**-9,
            "fp8_e5m2": 2.0**-16,
            "bf16": float(torch.finfo(torch.bfloat16).smallest_normal) * 2.0**-7,
            "fp32": 0.0,
        }[self.name]

    @staticmethod
    def make(name: str, block_size: int, outliers: int, nonneg: bool) -> StateFormat:
        """The canonical format: block size and patches only where the format is blockwise."""
        if name in ("bf16", "fp32"):
            return StateFormat(name, 0, 0, nonneg)
        return StateFormat(name, block_size, outliers, nonneg)

    def tag(self) -> str:
        """A short stable name, used in op arguments, state dicts and cache keys."""
        return f"{self.name}:{self.block_size}:{self.outliers}:{'u' if self.nonneg else 's'}"

    @staticmethod
    def from_tag(tag: str) -> StateFormat:
        name, block, k, sign = tag.split(":")
        return StateFormat(name, int(block), int(k), sign == "u")


@dataclass(frozen=True)
class DynamicLevel:
    """One level of the dynamic map: code magnitudes ``p`` in ``[first, 2 * first)`` (``first = 2**L``)
    decode to ``spacing * p + offset``, equally spaced up to the level's top value (about a power of ten).
    Magnitudes from ``lower`` (the midpoint to the level below; for level 0 the midpoint to zero) up
    to the next level's ``lower`` encode into it."""

    first: int
    spacing: float
    offset: float
    lower: float


# The map's version, saved with dynamic8 checkpoints: version 1 (no tag) was a sorted 256-entry
# table (legacy_dynamic_map), which a checkpoint load converts code by code.
DYNAMIC_MAP_VERSION = 2


@functools.cache
def dynamic_levels(nonneg: bool) -> tuple[DynamicLevel, ...]:
    """The levels of the dynamic map (after Dettmers et al. 2022, "8-bit Optimizers via Block-wise
    Quantization", Sec. 2.2: a decimal exponent and a linear fraction whose resolution grows with
    it, so small magnitudes keep relative precision). Level L covers about the decade up to
    ``10**(L - levels + 1)`` with ``2**L`` values; signed: 7 levels (1e-6 .. 1, 127 magnitudes a
    sign), unsigned: 8 (1e-7 .. 1, 255 magnitudes). The top value is 1.

    Built from the top down: each level's values are ``top_below + spacing * (j + 1)``, where
    ``top_below`` is the level below's top value (level 0 holds one value, above zero). Every
    spacing has 12 significant bits and every value is a multiple of its level's spacing's last bit,
    so values, midpoints and ``spacing * p + offset`` are exact in fp32 (with or without fma), and
    a level's lower bound (the midpoint to the level below) is exactly its first bucket's lower
    edge: kernels decode and encode by arithmetic, bit for bit.
    """
    n = 8 if nonneg else 7
    levels: list[DynamicLevel] = []
    top = 1.0
    for i in reversed(range(1, n)):
        count = 2**i
        unit = 2.0 ** (math.frexp(0.9 * top / count)[1] - 12)
        spacing = round(0.9 * top / count / unit) * unit
        below = top - spacing * count
        levels.append(DynamicLevel(count, spacing, below - spacing * (count - 1), below + spacing / 2))
        top = below
    levels.append(DynamicLevel(1, top, 0.0, top / 2))
    for level in levels:
        assert all(float(torch.tensor(v, dtype=torch.float32)) == v for v in (level.spacing, level.offset, level.lower))
    return tuple(reversed(levels))


def _magnitudes(nonneg: bool) -> list[float]:
    """Code magnitude p = 1, 2, ... to its value (float64, exact in fp32)."""
    return [lv.spacing * p + lv.offset for lv in dynamic_levels(nonneg) for p in range(lv.first, 2 * lv.first)]


@functools.cache
def dynamic_map(nonneg: bool) -> torch.Tensor:
    """The value of each of the 256 codes (:func:`dynamic_levels`). Unsigned: code p is magnitude p
    (0 is zero, 255 is 1). Signed: code ``127 + p`` is +magnitude p and ``127 - p`` is -magnitude p,
    so the map is symmetric (+1 is 254, -1 is 0); the spare code 255, which no finite value encodes
    to outside a flagged block, decodes to 1 as well."""
    mags = [0.0] + _magnitudes(nonneg)
    values = mags if nonneg else [-m for m in mags[:0:-1]] + mags + [1.0]
    table = torch.tensor(values, dtype=torch.float32)
    assert table.numel() == 256 and torch.all(table[1:255] > table[:254])
    return table


@functools.cache
def dynamic_thresholds(nonneg: bool) -> torch.Tensor:
    """Magnitudes from which a value encodes to code magnitude p = 1, 2, ...: the midpoints between
    neighbouring magnitudes (zero included), all exact in fp32, so encode is exactly to nearest."""
    mags = [0.0] + _magnitudes(nonneg)
    return torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], dtype=torch.float32)


# The dynamic8 lookup table of the Triton kernels (dynamic_lookup_table): the 256 codes' values, then one
# cell per 2**-DYNAMIC_CELL_BITS of each binade of magnitudes, from 2**DYNAMIC_FIRST_EXPONENT up to [1, 2).
DYNAMIC_CELL_BITS = 7
DYNAMIC_FIRST_EXPONENT = -25
DYNAMIC_CELLS = (1 - DYNAMIC_FIRST_EXPONENT) << DYNAMIC_CELL_BITS
DYNAMIC_NO_EDGE = 1 << (23 - DYNAMIC_CELL_BITS)  # a cell's edge offset where no edge lies inside it


@functools.cache
def dynamic_lookup_table(nonneg: bool) -> torch.Tensor:
    """What the Triton kernels read to decode and encode dynamic8, fp32 (256 + ``DYNAMIC_CELLS``): the
    value of each code (:func:`dynamic_map`), then per cell of magnitudes (a binade's values sharing
    their top ``DYNAMIC_CELL_BITS`` mantissa bits, from ``2**DYNAMIC_FIRST_EXPONENT`` on; smaller ones
    take the first cell, larger the last) the bits of the int32 ``p | offset << 8``: p the code
    magnitude of the cell's lowest value, offset how far above it, in the cell's low mantissa bits, the
    lower edge of magnitude p + 1 lies (``DYNAMIC_NO_EDGE`` where it lies beyond the cell). No cell
    holds two edges, so one gather and one compare encode exactly to nearest (:func:`dynamic_thresholds`)."""
    edges = dynamic_thresholds(nonneg).view(torch.int32)
    first = (127 + DYNAMIC_FIRST_EXPONENT) << DYNAMIC_CELL_BITS
    low = (torch.arange(DYNAMIC_CELLS, dtype=torch.int32) + first) << (23 - DYNAMIC_CELL_BITS)  # the cells' bits
    p = torch.searchsorted(edges, low, right=True).to(torch.int32)
    above = torch.cat([edges, torch.tensor([0x7F800000, 0x7F800000], dtype=torch.int32)])  # no edge above the top
    inside = above[p] < low + DYNAMIC_NO_EDGE
    assert not torch.any(above[p + 1] < low + DYNAMIC_NO_EDGE), "a cell holds two edges: raise DYNAMIC_CELL_BITS"
    assert not inside[0], "the first cell holds an edge: lower DYNAMIC_FIRST_EXPONENT"
    offset = torch.where(inside, above[p] - low, DYNAMIC_NO_EDGE)
    return torch.cat([dynamic_map(nonneg), (p | offset << 8).view(torch.float32)])


# Per level, in this order, what the CPU kernel reads (formats.dynamic_level_table): the lower bound,
# an estimate of the code magnitude (p ~ |x| * recip + bias, never above the true bucket and at
# most one below), the decode spacing and offset, the lower edge of bucket p + 1 as
# ``spacing * p + step``, the level's last code magnitude, and the code of zero.
DYNAMIC_LEVEL_FIELDS = ("lower", "recip", "bias", "spacing", "offset", "step", "last", "zero")


@functools.cache
def dynamic_level_table(nonneg: bool) -> torch.Tensor:
    """``(len(DYNAMIC_LEVEL_FIELDS), 8)`` fp32: each field of each level (a signed map's 8th level
    is its spare code magnitude 128, which decodes to 1 and which encode never reaches)."""
    rows = []
    for lv in dynamic_levels(nonneg):
        # 1 / spacing shrunk by 2^-16: the estimate's rounding errors (a few ulp of values < 2^9)
        # stay inside the margin, so floor(estimate) is the bucket or the one below it
        recip = (1.0 / lv.spacing) * (1.0 - 2.0**-16)
        low_edge = lv.spacing * (lv.first - 0.5) + lv.offset
        rows.append([lv.lower, recip, lv.first - low_edge * recip, lv.spacing, lv.offset, lv.offset + lv.spacing / 2,
                     2 * lv.first - 1, 0 if nonneg else 127])
    if not nonneg:
        rows.append([math.nan, 0.0, 0.0, 0.0, 1.0, 0.0, 128, 127])
    return torch.tensor(rows, dtype=torch.float32).T.contiguous()


@functools.cache
def legacy_dynamic_map(nonneg: bool) -> torch.Tensor:
    """The dynamic map before version 2 (a sorted table of bitsandbytes' layout: signed without -1),
    kept to convert the codes of old checkpoints."""
    exponent_bits = 7
    values: list[float] = []
    for i in range(exponent_bits):
        n_frac = 2 ** (i + (0 if not nonneg else 1)) + 1
        bounds = torch.linspace(0.1, 1.0, n_frac, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10.0 ** (-(exponent_bits - 1) + i)
        values += means.tolist()
        if not nonneg:
            values += (-means).tolist()
    return torch.tensor(sorted(set(values + [0.0, 1.0])), dtype=torch.float32)


def upgrade_dynamic8_codes(codes: torch.Tensor, nonneg: bool, flagged: torch.Tensor) -> torch.Tensor:
    """Codes of the legacy map to this map's nearest codes (relative to the same block scale); in a
    ``flagged`` element's block the special codes, which both versions share, stay."""
    fmt = StateFormat("dynamic8", nonneg=nonneg)
    old = legacy_dynamic_map(nonneg)
    plain = encode(old, fmt).view(torch.uint8)
    inside = encode(old, fmt, torch.ones(256, dtype=torch.bool)).view(torch.uint8)
    special = torch.zeros(256, dtype=torch.bool)
    special[list(special_codes(fmt))] = True
    inside = torch.where(special, torch.arange(256).to(torch.uint8), inside)
    byte = codes.view(torch.uint8).long()
    return torch.where(flagged, inside.to(codes.device)[byte], plain.to(codes.device)[byte])


def _root_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (float64's, rounded to fp32, is), as every kernel's."""
    return x.double().sqrt().float()


def normalize(x: torch.Tensor, inverse: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Values to what :func:`encode` takes, given their block's multiplier ``inverse`` (``qmax / absmax``):
    ``x * inverse``; for sqrt8 the root domain, ``sqrt(|x|) * sqrt(inverse)`` with x's sign (a
    non-negative state's negative values as 0), each square root the fp32 one."""
    if fmt.name != "sqrt8":
        return x * inverse
    r = _root_f32(x.clamp(min=0.0) if fmt.nonneg else x.abs()) * _root_f32(inverse)
    return r if fmt.nonneg else torch.where(x < 0, -r, r)


def domain_bound(fmt: StateFormat, bound: float) -> float:
    """A bound of normalized values (``qmax``, ``flagged_qmax``) in :func:`encode`'s input domain."""
    return math.sqrt(bound) if fmt.name == "sqrt8" else bound


def round_fp8(y: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """fp32 ``y`` (within the format's range, or NaN) rounded to the nearest fp8 value, ties to even,
    subnormals included, held exactly in fp32: the formats' own rounding (``triton_lib.round_to_fp8``,
    the CPU kernel's ``lb_encode_fp8``), not whatever a torch version's float8 cast does. ``y`` is
    scaled by a power of two to integer resolution, rounded, and scaled back."""
    bits = y.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF).clamp(min=127 + min_exponent)
    to_units = ((254 + mantissa_bits - exponent) << 23).view(torch.float32)
    unit = ((exponent - mantissa_bits) << 23).view(torch.float32)
    magnitude = torch.round(y.abs() * to_units) * unit
    return torch.where(bits < 0, -magnitude, magnitude)


def encode(x: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor | None = None,
           draws: torch.Tensor | None = None) -> torch.Tensor:
    """Encode normalized values (:func:`normalize`: divided by their block scale, |x| <= qmax; sqrt8's
    in the root domain, |x| <= sqrt(qmax)) into codes.

    Rounding is to nearest, ties to even, or with ``draws`` (the 16-bit draw of each element,
    ``rounding.state_draws``: int64 shaped like ``x``) stochastic (:func:`round_stochastic`, sqrt8's
    from the value ``x * |x|``); for a non-negative state a positive value never becomes code 0.
    Where ``flagged`` (a bool tensor broadcasting against ``x``: the element's block is flagged)
    finite values are clamped to ``flagged_qmax`` and +inf, -inf and NaN get their special codes;
    elsewhere a non-finite value saturates like any value out of range.
    """
    if flagged is not None and fmt.blockwise:
        top = domain_bound(fmt, fmt.flagged_qmax)
        inner = torch.where(flagged, x.clamp(-top, top), x)
        codes = encode(inner, fmt, draws=draws).view(torch.uint8)
        pos_inf, neg_inf, nan = special_codes(fmt)
        special = torch.where(torch.isnan(x), nan, torch.where(x > 0, pos_inf, neg_inf)).to(torch.uint8)
        return torch.where(flagged & ~torch.isfinite(x), special, codes).view(fmt.code_dtype)
    if draws is not None:
        if fmt.name != "sqrt8":
            return round_stochastic(x, encode(x, fmt), fmt, draws)
        codes = round_stochastic(x * x.abs(), encode(x, fmt), fmt, draws)
        # x * |x| underflows to 0 for a root below 2^-75: the zero-point rule reads the root itself
        return torch.where((x > 0) & (codes == 0), 1, codes) if fmt.nonneg else codes
    name = fmt.name
    if name == "int8":
        lo = 0.0 if fmt.nonneg else -fmt.qmax
        q = torch.round(x).clamp_(lo, fmt.qmax)
        if fmt.nonneg:
            q = torch.where((x > 0) & (q == 0), 1.0, q)
        return q.to(fmt.code_dtype)
    if name == "sqrt8":  # the root rounded half to even
        top = domain_bound(fmt, fmt.qmax)
        root = torch.round(x.clamp(0.0, top) if fmt.nonneg else x.abs().clamp(max=top))
        if fmt.nonneg:
            root = torch.where((x > 0) & (root == 0), 1.0, root)
        else:
            root = torch.where(x < 0, -root, root)
        return root.to(fmt.code_dtype)
    if name == "dynamic8":
        # the count of thresholds <= |x|: to nearest, an exact tie to the larger magnitude
        p = torch.bucketize(x.abs().contiguous(), dynamic_thresholds(fmt.nonneg).to(x.device), right=True)
        if fmt.nonneg:
            codes = torch.where(x > 0, p.clamp(min=1), 0)
        else:
            codes = 127 + torch.where(x < 0, -p, p)
        return torch.where(torch.isnan(x), 255, codes).to(torch.uint8)  # NaN saturates at the top
    if name in ("fp8_e4m3", "fp8_e5m2", "bf16"):
        y = x.clamp(-fmt.qmax, fmt.qmax) if name != "bf16" else x
        if fmt.nonneg:
            y = torch.where(y > 0, y.clamp(min=fmt.min_positive), y)
        if name == "bf16":
            return round_bf16(y)
        return round_fp8(y.float(), fmt.mantissa_bits, fmt.min_exponent).to(fmt.code_dtype)  # an exact cast
    if name == "fp32":
        return x.float()
    raise AssertionError(name)


def round_stochastic(x: torch.Tensor, codes: torch.Tensor, fmt: StateFormat, draws: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding (``rounding.py``), from the nearest ``codes`` of ``x``: of the two codes around
    ``x``, the one of larger magnitude (outer, value ``w_out``) replaces the one nearer zero (inner,
    ``w_in``) where ``fl(t * |w_out - w_in|) < |x - w_in|``, ``t = (u + 0.5) / 2**16`` from the element's
    16-bit draw ``u`` (``rounding.threshold``), so with probability ``round(2**16 p) / 2**16``, ``p = |x -
    w_in| / |w_out - w_in|``: the expected value is ``x`` to within 2**-17 of the gap between the two codes,
    an error that averages to zero over ``p``. Except where the rules of :func:`encode` act: ``x`` is first
    clamped into the format's range (the top code never rounds up), a non-finite ``x`` keeps its nearest
    code, and a positive value of a non-negative state never becomes code 0 (values below the smallest
    positive code all round up to it, a bias of at most that code's value).

    Both distances are exact in fp32 for every format, and the product is one fp32 multiply on every
    backend (exact for int8 and fp8, whose gaps are powers of two). bf16 adds ``u`` to the fp32 bit
    pattern and truncates to 16 bits: exactly unbiased."""
    if fmt.name == "bf16":
        y = saturate_bf16(x)
        if fmt.nonneg:
            y = torch.where(y > 0, y.clamp(min=fmt.min_positive), y)
        pattern = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        up = ((pattern + draws) >> 16) & 0xFFFF
        up = torch.where(up >= 2**15, up - 2**16, up).to(torch.int16).view(torch.bfloat16)
        return torch.where(torch.isnan(x), codes, up)
    signed_int = fmt.name in ("int8", "sqrt8") and not fmt.nonneg
    fp8 = fmt.name.startswith("fp8")
    lo = 0.0 if fmt.nonneg and not fp8 else -fmt.qmax
    y = x.clamp(lo, fmt.qmax)
    v = decode(codes, fmt)
    q = codes.to(torch.int32) if signed_int else codes.view(torch.uint8).to(torch.int32)
    # the other code around x: the map is monotone in the code (int8, dynamic8) or in its magnitude bits
    # (fp8, sign and magnitude)
    away = (y.abs() > v.abs()) if fp8 else (y > v)
    other = torch.where(y == v, q, q + torch.where(away, 1, -1))
    other_codes = other.to(torch.int8) if signed_int else other.to(torch.uint8).view(fmt.code_dtype)
    w = decode(other_codes, fmt)
    inward = w.abs() < v.abs()  # the other code is the inner one
    t = threshold(draws)
    outward = t * (w - v).abs() < (y - torch.where(inward, w, v)).abs()
    out = torch.where((inward ^ outward) & torch.isfinite(x), other, q)
    if fmt.nonneg:
        out = torch.where((x > 0) & (out == 0), 1, out)
    return out.to(torch.int8) if signed_int else out.to(torch.uint8).view(fmt.code_dtype)


def decode(codes: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor | None = None) -> torch.Tensor:
    """Codes back to fp32 values relative to the block scale; where ``flagged``, the special codes
    decode to +inf, -inf and NaN (which the caller must not multiply by the scale)."""
    if fmt.name == "dynamic8":
        values = dynamic_map(fmt.nonneg).to(codes.device)[codes.long()]
    elif fmt.name == "sqrt8":
        root = codes.float()
        values = root * root.abs()
    else:
        values = codes.float()
    if flagged is None or not fmt.blockwise:
        return values
    is_special, special_values = _special_table(fmt.name, fmt.nonneg)
    byte = codes.view(torch.uint8).long()
    return torch.where(flagged & is_special.to(codes.device)[byte], special_values.to(codes.device)[byte], values)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16, to nearest even, a finite value saturating at bf16's largest instead of becoming
    inf (fp32 values above 3.3961e38 round to bf16 inf); inf and NaN stay."""
    return saturate_bf16(x).to(torch.bfloat16)


def saturate_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` with finite values clamped to bf16's largest magnitude (what every bf16 rounding starts from)."""
    top = torch.finfo(torch.bfloat16).max
    return torch.where(torch.isfinite(x), x.clamp(-top, top), x)


# ---- non-finite values in flagged blocks ------------------------------------------------------------
# Per format and sign: the code bytes (as uint8) of +inf, -inf and NaN in a flagged block. They are
# codes a finite value of an unflagged block may take (the largest magnitudes, and int8's spare
# -128), so every finite block keeps the full resolution; fp8_e5m2 uses its own inf and NaN codes and
# fp8_e4m3 (no inf) its largest finite codes, +-448, with NaN its own 0x7F.
_SPECIAL_CODES = {
    ("int8", False): (0x7F, 0x81, 0x80),  # 127, -127, -128; finite codes -126..126
    ("int8", True): (255, 253, 254),  # finite codes 0..252
    ("sqrt8", False): (0x7F, 0x81, 0x80),  # as int8
    ("sqrt8", True): (255, 253, 254),
    ("dynamic8", False): (255, 0, 254),  # the spare code, -1 and +1; finite codes 1..253 (+-0.986)
    ("dynamic8", True): (255, 253, 254),  # finite codes 0..252 (up to 0.979)
    ("fp8_e4m3", False): (0x7E, 0xFE, 0x7F),  # finite values up to +-416
    ("fp8_e5m2", False): (0x7C, 0xFC, 0x7F),  # IEEE inf and torch's NaN; finite values up to +-57344
}


def special_codes(fmt: StateFormat) -> tuple[int, int, int]:
    """The code bytes of +inf, -inf and NaN in a flagged block of ``fmt``."""
    fp8 = fmt.name.startswith("fp8")
    return _SPECIAL_CODES[(fmt.name, fmt.nonneg and not fp8)]


@functools.cache
def _special_table(name: str, nonneg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per code byte: whether it is special in a flagged block, and its value there."""
    is_special = torch.zeros(256, dtype=torch.bool)
    values = torch.zeros(256)
    for code, value in zip(special_codes(StateFormat(name, nonneg=nonneg)), (math.inf, -math.inf, math.nan)):
        is_special[code], values[code] = True, value
    return is_special, values
