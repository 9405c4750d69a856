"""The shipped element formats: each one's record and reference encode and decode, registered in the
order the kernels number them (append a new format at the end).

``sqrt8`` compands by a square root: the code is the magnitude's square root rounded to an integer
(0..127 with a sign, or 0..255), its value ``c * |c|``, so the resolution is fine near the block's
largest value and coarse only near zero (a relative step of ``2 / c``); one square root encodes it
(no table, no search), which makes it as cheap on a CPU as linear INT8. It encodes from the *root
domain* (``element.normalize``): the value's square root times the block multiplier's, so a kernel that
already takes the state's square root (Adam's denominator) encodes without a second one.
"""

from __future__ import annotations

import torch

from . import dynamic
from .element import StateFormat, domain_bound, round_bf16, round_fp8, saturate_bf16
from .registry import ElementFormat, register


# reference encodes (of normalized values, see element.encode) and decodes --------------------------------
def _encode_int8(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    lo = 0.0 if fmt.nonneg else -fmt.qmax
    q = torch.round(x).clamp_(lo, fmt.qmax)
    if fmt.nonneg:
        q = torch.where((x > 0) & (q == 0), 1.0, q)
    return q.to(fmt.code_dtype)


def _encode_sqrt8(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The root rounded half to even (sqrt8's and sqrt4's: the root's range is the format's)."""
    top = domain_bound(fmt, fmt.qmax)
    root = torch.round(x.clamp(0.0, top) if fmt.nonneg else x.abs().clamp(max=top))
    if fmt.nonneg:
        root = torch.where((x > 0) & (root == 0), 1.0, root)
    else:
        root = torch.where(x < 0, -root, root)
    return root.to(fmt.code_dtype)


def _encode_sqrt4(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The code whose value ``c * |c|`` is nearest the value ``x * |x|``, ties to the even code: between
    roots c and c + 1 it rounds up where ``2 x^2 > c^2 + (c + 1)^2`` (one fp32 square, exact integers).
    Rounding the root instead (sqrt8's) takes values from a quarter of a gap up at 4 bits: Zipf +1.9%
    against fp32 (bench/results/quality.md)."""
    top = domain_bound(fmt, fmt.qmax)
    r = x.clamp(0.0, top) if fmt.nonneg else x.abs().clamp(max=top)
    low = torch.floor(r)
    twice, mid = 2.0 * (r * r), low * low + (low + 1.0) * (low + 1.0)
    root = torch.where((twice > mid) | ((twice == mid) & (low % 2 == 1)), low + 1.0, low)
    if fmt.nonneg:
        root = torch.where((x > 0) & (root == 0), 1.0, root)
    else:
        root = torch.where(x < 0, -root, root)
    return root.to(fmt.code_dtype)


def _decode_sqrt8(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    root = codes.float()
    return root * root.abs()


def _encode_dynamic8(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The count of thresholds <= |x|: to nearest, an exact tie to the larger magnitude."""
    p = torch.bucketize(x.abs().contiguous(), dynamic.dynamic_thresholds(fmt.nonneg).to(x.device), right=True)
    if fmt.nonneg:
        codes = torch.where(x > 0, p.clamp(min=1), 0)
    else:
        codes = 127 + torch.where(x < 0, -p, p)
    return torch.where(torch.isnan(x), 255, codes).to(torch.uint8)  # NaN saturates at the top


def _decode_dynamic8(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return dynamic.dynamic_map(fmt.nonneg).to(codes.device)[codes.long()]


def _floor_positive(y: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """A non-negative state's positive values at least its smallest positive code."""
    return torch.where(y > 0, y.clamp(min=fmt.min_positive), y) if fmt.nonneg else y


def _encode_fp8(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    y = _floor_positive(x.clamp(-fmt.qmax, fmt.qmax), fmt)
    return round_fp8(y.float(), fmt.mantissa_bits, fmt.min_exponent).to(fmt.code_dtype)  # an exact cast


def _encode_bf16(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return round_bf16(_floor_positive(x, fmt))


def _round_stochastic_bf16(x: torch.Tensor, codes: torch.Tensor, fmt: StateFormat, draws: torch.Tensor
                           ) -> torch.Tensor:
    """bf16 adds the 16-bit draw to the fp32 bit pattern and truncates to 16 bits: exactly unbiased (the
    nearest ``codes`` are kept for NaN)."""
    y = _floor_positive(saturate_bf16(x), fmt)
    pattern = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    up = ((pattern + draws) >> 16) & 0xFFFF
    up = torch.where(up >= 2**15, up - 2**16, up).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isnan(x), codes, up)


def _encode_fp32(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return x.float()


def _decode_linear(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return codes.float()


# the records: per format and sign, +inf, -inf and NaN in a flagged block are codes a finite value of an
# unflagged block may take (the largest magnitudes, and int8's spare -128), so every finite block keeps the
# full resolution; fp8_e5m2 uses its own inf and NaN codes and fp8_e4m3 (no inf) its largest finite codes,
# +-448, with NaN its own 0x7F
_WIDEST = "fmt='dynamic8' (a map spanning six decades)"

register(ElementFormat(
    "int8", (torch.int8, torch.uint8), qmax=(127.0, 255.0), min_positive=(1.0, 1.0),
    encode=_encode_int8, decode=_decode_linear, unsigned_map=True, flagged_qmax=(126.0, 252.0),
    special_codes=((0x7F, 0x81, 0x80), (255, 253, 254)),  # 127, -127, -128: finite -126..126; finite 0..252
    advice=_WIDEST, fused_cpu_encode=True, cpp_name="LB_INT8", triton_name="INT8"))
register(ElementFormat(
    "dynamic8", (torch.uint8, torch.uint8), qmax=(1.0, 1.0),
    min_positive=(float(dynamic.dynamic_map(False)[128]), float(dynamic.dynamic_map(True)[1])),
    encode=_encode_dynamic8, decode=_decode_dynamic8, unsigned_map=True,
    flagged_qmax=(float(dynamic.dynamic_map(False)[253]), float(dynamic.dynamic_map(True)[252])),
    neg_qmax=-float(dynamic.dynamic_map(False)[0]),
    # the spare code, -1 and +1: finite codes 1..253 (+-0.986); unsigned: finite codes 0..252 (up to 0.979)
    special_codes=((255, 0, 254), (255, 253, 254)),
    cpp_name="LB_DYNAMIC8", triton_name="DYNAMIC8", lookup_table=dynamic.dynamic_lookup_table,
    map_version=dynamic.DYNAMIC_MAP_VERSION, upgrade_codes=dynamic.upgrade_codes))
register(ElementFormat(
    "fp8_e4m3", (torch.float8_e4m3fn, torch.float8_e4m3fn), qmax=(448.0, 448.0), min_positive=(2.0**-9, 2.0**-9),
    encode=_encode_fp8, decode=_decode_linear, flagged_qmax=(416.0, 416.0),
    special_codes=((0x7E, 0xFE, 0x7F),) * 2, fp8_mantissa=3,  # finite values up to +-416
    advice="fmt='dynamic8'", fused_cpu_encode=True, cpp_name="LB_E4M3", triton_name="FP8_E4M3"))
register(ElementFormat(
    "fp8_e5m2", (torch.float8_e5m2, torch.float8_e5m2), qmax=(57344.0, 57344.0),
    min_positive=(2.0**-16, 2.0**-16), encode=_encode_fp8, decode=_decode_linear,
    special_codes=((0x7C, 0xFC, 0x7F),) * 2, fp8_mantissa=2,  # IEEE inf and torch's NaN
    advice="fmt='dynamic8'", fused_cpu_encode=True, cpp_name="LB_E5M2", triton_name="FP8_E5M2"))
# bf16: also the format of every outlier patch (blockquant.py)
PATCHES = register(ElementFormat(
    "bf16", (torch.bfloat16, torch.bfloat16), qmax=(1.0, 1.0),
    min_positive=(float(torch.finfo(torch.bfloat16).smallest_normal) * 2.0**-7,) * 2,
    encode=_encode_bf16, decode=_decode_linear, blockwise=False, round_stochastic=_round_stochastic_bf16,
    cpp_name="LB_BF16_CODES", triton_name="BF16_CODES"))
# the stock tensor (what small tensors keep, config.Config.formats_for)
PASSTHROUGH = register(ElementFormat(
    "fp32", (torch.float32, torch.float32), qmax=(1.0, 1.0), min_positive=(0.0, 0.0), encode=_encode_fp32,
    decode=_decode_linear, blockwise=False, passthrough=True))
register(ElementFormat(
    "sqrt8", (torch.int8, torch.uint8), qmax=(127.0**2, 255.0**2), min_positive=(1.0, 1.0),  # codes are roots
    encode=_encode_sqrt8, decode=_decode_sqrt8, unsigned_map=True, root_domain=True,
    flagged_qmax=(126.0**2, 252.0**2), special_codes=((0x7F, 0x81, 0x80), (255, 253, 254)),  # as int8
    advice=_WIDEST, fused_cpu_encode=True, cpp_name="LB_SQRT8", triton_name="SQRT8"))
# sqrt4: sqrt8's map in 4 bits, two codes a byte (packing.py): roots -7..7 (-8 spare) or 0..15, rounded to
# the nearest value (not root), in blocks of 128 (bench/results/format_screen4.md: larger blocks lose to
# fp32 on the quality tasks); a flagged block's +inf, -inf and NaN are 7, -7 and -8 (finite -6..6) or 15,
# 13 and 14 (finite 0..12). The C++ kernel writes its codes in loops of their own: in the next block's lane
# loop its step took 1.17x as long on AVX2 (bench/results/cpu_fused_encode_sqrt4_avx2.md)
register(ElementFormat(
    "sqrt4", (torch.int8, torch.uint8), qmax=(7.0**2, 15.0**2), min_positive=(1.0, 1.0),
    encode=_encode_sqrt4, decode=_decode_sqrt8, unsigned_map=True, root_domain=True,
    flagged_qmax=(6.0**2, 12.0**2), special_codes=((0x07, 0xF9, 0xF8), (15, 13, 14)),
    advice="fmt='sqrt8' for this state (8-bit codes)", bits=4, default_block_size=128, cpp_name="LB_SQRT4",
    triton_name="SQRT4"))
