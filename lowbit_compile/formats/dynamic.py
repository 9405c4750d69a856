"""The dynamic map of ``dynamic8`` (after Dettmers et al. 2022): its levels, the value of each code, the
thresholds of its encode to nearest, the tables the kernels read, and the map of older checkpoints.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .element import StateFormat, encode, special_codes


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


# Per level, in this order, what the CPU kernel reads (dynamic_level_table): the lower bound,
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


def upgrade_codes(codes: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor) -> torch.Tensor:
    """Codes of the legacy map to this map's nearest codes (relative to the same block scale); in a
    ``flagged`` element's block the special codes, which both versions share, stay."""
    old = legacy_dynamic_map(fmt.nonneg)
    plain = encode(old, fmt).view(torch.uint8)
    inside = encode(old, fmt, torch.ones(256, dtype=torch.bool)).view(torch.uint8)
    special = torch.zeros(256, dtype=torch.bool)
    special[list(special_codes(fmt))] = True
    inside = torch.where(special, torch.arange(256).to(torch.uint8), inside)
    byte = codes.view(torch.uint8).long()
    return torch.where(flagged, inside.to(codes.device)[byte], plain.to(codes.device)[byte])
