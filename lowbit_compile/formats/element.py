"""The storage of one quantized state (:class:`StateFormat`: an element format of the registry, block size,
patches, sign) and the encode and decode of every registered format: how a normalized value becomes a code
and back.

A format only maps numbers; grouping into blocks, scales and outlier patches lives in ``blockquant.py``.
Every backend (eager reference, Triton, the C++ kernel) encodes and decodes with the definitions here and
each format's record (``registry.py``; the shipped formats and their reference encodes in ``builtin.py``),
so they agree on every code. In a block that holds +inf, -inf or NaN (a *flagged* block, see
``blockquant.py``) three codes of each format mean those values, and the block's finite values keep off
them (``StateFormat.flagged_qmax``, ``special_codes``). A format of the *root domain* (``sqrt8``) encodes
from the value's square root times the block multiplier's (:func:`normalize`), so a kernel that already
takes the state's square root (Adam's denominator) encodes without a second one.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .packing import packed_numel
from .registry import ElementFormat, element_format
from .rounding import threshold


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
        spec = element_format(self.name)  # a registered format, or an error naming them
        if spec.bits == 4 and self.block_size % 2:
            raise ValueError(f"format {self.name!r} packs two codes a byte: its block_size must be even, got "
                             f"{self.block_size}")

    @property
    def spec(self) -> ElementFormat:
        """The format's record in the registry."""
        return element_format(self.name)

    @property
    def passthrough(self) -> bool:
        """The stock tensor: no codes, no scales, bit-for-bit stock behaviour."""
        return self.spec.passthrough

    @property
    def blockwise(self) -> bool:
        """Whether codes are relative to a per-block scale (and so can carry outlier patches)."""
        return self.spec.blockwise

    @property
    def patches(self) -> int:
        return self.outliers if self.blockwise else 0

    @property
    def code_dtype(self) -> torch.dtype:
        return self.spec.code_dtype[self.nonneg]

    @property
    def bits(self) -> int:
        """Bits per element stored (what other libraries' "8bit", "4bit" name)."""
        return self.spec.bits or self.code_dtype.itemsize * 8

    @property
    def packed(self) -> bool:
        """Two 4-bit codes a byte (``packing.py``): the stored codes are uint8 bytes, ``code_dtype`` is one
        unpacked code's."""
        return self.bits == 4

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the stored codes tensor: packed bytes, or the codes themselves."""
        return torch.uint8 if self.packed else self.code_dtype

    def storage_numel(self, numel: int) -> int:
        """Elements of the stored codes tensor of a state of ``numel`` elements."""
        return packed_numel(numel) if self.packed else numel

    @property
    def qmax(self) -> float:
        """The largest code: a block's largest positive value (or its absmax, where the format's codes
        are symmetric) maps onto it."""
        return self.spec.qmax[self.nonneg]

    @property
    def neg_qmax(self) -> float:
        """The magnitude of the most negative code: a block's most negative value maps onto it. Only a
        signed map that is asymmetric (``ElementFormat.neg_qmax``) differs from ``qmax``; its block scale is
        then the larger of the positive side over ``qmax`` and the negative side over this: the block's
        extreme element is stored exactly whichever its sign, and no resolution is lost."""
        if self.spec.neg_qmax is not None and not self.nonneg:
            return self.spec.neg_qmax
        return self.qmax

    @property
    def mantissa_bits(self) -> int:
        """Of an fp8 format: its mantissa bits (the exponent has ``7 - mantissa_bits``)."""
        if self.spec.fp8_mantissa is None:
            raise ValueError(f"format {self.name!r} is not an fp8 format")
        return self.spec.fp8_mantissa

    @property
    def min_exponent(self) -> int:
        """Of an fp8 format: the exponent of its smallest normal value."""
        return 2 - 2 ** (6 - self.mantissa_bits)

    @property
    def flagged_qmax(self) -> float:
        """The largest code magnitude of a flagged block's finite values: the codes past it are the
        block's +inf, -inf and NaN (``special_codes``); a format with its own inf and NaN codes keeps qmax."""
        return (self.spec.flagged_qmax or self.spec.qmax)[self.nonneg]

    @property
    def min_positive(self) -> float:
        """The smallest positive normalized value this format can hold (what a tiny v rounds up to)."""
        return self.spec.min_positive[self.nonneg]

    @staticmethod
    def make(name: str, block_size: int, outliers: int, nonneg: bool) -> StateFormat:
        """The canonical format: block size and patches only where the format is blockwise."""
        if not element_format(name).blockwise:
            return StateFormat(name, 0, 0, nonneg)
        return StateFormat(name, block_size, outliers, nonneg)

    def tag(self) -> str:
        """A short stable name, used in op arguments, state dicts and cache keys."""
        return f"{self.name}:{self.block_size}:{self.outliers}:{'u' if self.nonneg else 's'}"

    @staticmethod
    def from_tag(tag: str) -> StateFormat:
        name, block, k, sign = tag.split(":")
        return StateFormat(name, int(block), int(k), sign == "u")


def _root_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (float64's, rounded to fp32, is), as every kernel's."""
    return x.double().sqrt().float()


def normalize(x: torch.Tensor, inverse: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Values to what :func:`encode` takes, given their block's multiplier ``inverse`` (``qmax / absmax``):
    ``x * inverse``; for a format of the root domain (``sqrt8``) ``sqrt(|x|) * sqrt(inverse)`` with x's sign
    (a non-negative state's negative values as 0), each square root the fp32 one."""
    if not fmt.spec.root_domain:
        return x * inverse
    r = _root_f32(x.clamp(min=0.0) if fmt.nonneg else x.abs()) * _root_f32(inverse)
    return r if fmt.nonneg else torch.where(x < 0, -r, r)


def domain_bound(fmt: StateFormat, bound: float) -> float:
    """A bound of normalized values (``qmax``, ``flagged_qmax``) in :func:`encode`'s input domain."""
    return math.sqrt(bound) if fmt.spec.root_domain else bound


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
    """Encode normalized values (:func:`normalize`: divided by their block scale, |x| <= qmax; a root-domain
    format's in the root domain, |x| <= sqrt(qmax)) into codes, by the format's reference encode.

    Rounding is to nearest, ties to even, or with ``draws`` (the 16-bit draw of each element,
    ``rounding.state_draws``: int64 shaped like ``x``) stochastic (:func:`round_stochastic`, a root-domain
    format's from the value ``x * |x|``); for a non-negative state a positive value never becomes code 0.
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
        rounding = fmt.spec.round_stochastic or round_stochastic
        if not fmt.spec.root_domain:
            return rounding(x, encode(x, fmt), fmt, draws)
        codes = rounding(x * x.abs(), encode(x, fmt), fmt, draws)
        # x * |x| underflows to 0 for a root below 2^-75: the zero-point rule reads the root itself
        return torch.where((x > 0) & (codes == 0), 1, codes) if fmt.nonneg else codes
    return fmt.spec.encode(x, fmt)


def round_stochastic(x: torch.Tensor, codes: torch.Tensor, fmt: StateFormat, draws: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding (``rounding.py``) of a format of one-byte codes, from the nearest ``codes`` of
    ``x``: of the two codes around ``x``, the one of larger magnitude (outer, value ``w_out``) replaces the
    one nearer zero (inner, ``w_in``) where ``fl(t * |w_out - w_in|) < |x - w_in|``, ``t = (u + 0.5) / 2**16``
    from the element's 16-bit draw ``u`` (``rounding.threshold``), so with probability ``round(2**16 p) /
    2**16``, ``p = |x - w_in| / |w_out - w_in|``: the expected value is ``x`` to within 2**-17 of the gap
    between the two codes, an error that averages to zero over ``p``. Except where the rules of
    :func:`encode` act: ``x`` is first clamped into the format's range (the top code never rounds up), a
    non-finite ``x`` keeps its nearest code, and a positive value of a non-negative state never becomes
    code 0 (values below the smallest positive code all round up to it, a bias of at most that code's
    value).

    Both distances are exact in fp32 for every format, and the product is one fp32 multiply on every
    backend (exact for int8 and fp8, whose gaps are powers of two). A format of other codes (bf16) has its
    own (``ElementFormat.round_stochastic``)."""
    signed_int = fmt.code_dtype == torch.int8
    sign_magnitude = fmt.spec.fp8_mantissa is not None
    lo = 0.0 if fmt.nonneg and fmt.spec.unsigned_map else -fmt.qmax
    y = x.clamp(lo, fmt.qmax)
    v = decode(codes, fmt)
    q = codes.to(torch.int32) if signed_int else codes.view(torch.uint8).to(torch.int32)
    # the other code around x: the map is monotone in the code (int8, dynamic8) or in its magnitude bits
    # (fp8, sign and magnitude)
    away = (y.abs() > v.abs()) if sign_magnitude else (y > v)
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
    """Codes back to fp32 values relative to the block scale, by the format's reference decode; where
    ``flagged``, the special codes decode to +inf, -inf and NaN (which the caller must not multiply by the
    scale)."""
    values = fmt.spec.decode(codes, fmt)
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


def special_codes(fmt: StateFormat) -> tuple[int, int, int]:
    """The code bytes of +inf, -inf and NaN in a flagged block of a blockwise ``fmt`` (the record's)."""
    return fmt.spec.special_codes[fmt.nonneg]


@functools.cache
def _special_table(name: str, nonneg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per code byte: whether it is special in a flagged block, and its value there."""
    is_special = torch.zeros(256, dtype=torch.bool)
    values = torch.zeros(256)
    for code, value in zip(special_codes(StateFormat(name, nonneg=nonneg)), (math.inf, -math.inf, math.nan)):
        is_special[code], values[code] = True, value
    return is_special, values
