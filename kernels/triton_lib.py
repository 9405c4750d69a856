"""Triton building blocks of the emitted step kernels: exact rounding, and the block decode and
block encode of every format in ``formats.py`` (the reference is ``blockquant.py``).

Every rounding here ends in a value that is exactly representable in the target type, computed with
IEEE fp32 arithmetic or integer bit arithmetic, so a kernel gives the same bits on a GPU and under
``TRITON_INTERPRET=1``, whose own float downcasts are not round-to-nearest-even (fp32 to bf16
truncates, fp32 to fp8 loses the carry into the exponent, bf16 subnormals go wrong both ways). Two
rules for kernels that use these helpers:

* compile them with ``enable_fp_fusion=False``: :func:`rne` relies on ``(x + C) - C`` not being
  contracted with the product that feeds it, and the emitter writes every fma ATen uses explicitly;
* import this module only after ``TRITON_INTERPRET`` has its final value: ``triton.jit`` reads it when
  it decorates, and an interpreted kernel cannot call compiled helpers (nor the reverse).

FP8 codes take one of two paths, the constexpr ``FP8_NATIVE`` (read by fp8 formats only): float8 types
and their conversions (cvt instructions that only sm_89 and later have), or integer bit operations on
uint8 codes (:func:`fp8_code`, :func:`fp8_value`), which compile for every architecture. Both give the
same codes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import FORMAT_IDS

# Element formats (constexpr ids, formats.FORMAT_IDS); fp32 states never reach a kernel.
INT8 = tl.constexpr(FORMAT_IDS["int8"])
DYNAMIC8 = tl.constexpr(FORMAT_IDS["dynamic8"])
FP8_E4M3 = tl.constexpr(FORMAT_IDS["fp8_e4m3"])
FP8_E5M2 = tl.constexpr(FORMAT_IDS["fp8_e5m2"])
BF16_CODES = tl.constexpr(FORMAT_IDS["bf16"])

# Value dtypes of params and stock states: every value lives in fp32 registers, rounded to its dtype.
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)


@triton.jit
def rne(x):
    """Round to the nearest integer, ties to even, for |x| < 2**22 (every code magnitude is < 2**16)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def bf16_bits_to_f32(bits):
    """The fp32 value of bf16 bit patterns held in int16 (exact, subnormals included)."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """Round fp32 to bf16, to nearest even (overflow to inf, subnormals exact); the bits as int16."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return tl.where(x != x, (bits >> 16) | 64, rounded).to(tl.int16)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """``x`` rounded to DTYPE (to nearest even) and held in fp32: what an eager op of that dtype stores."""
    if DTYPE == BF16:
        return bf16_bits_to_f32(f32_to_bf16_bits(x))
    elif DTYPE == F16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def load_elements(ptr, offsets, mask, DTYPE: tl.constexpr):
    """Elements of a param, grad or stock state, as fp32."""
    if DTYPE == BF16:
        return bf16_bits_to_f32(tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.int16, bitcast=True))
    else:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_elements(ptr, offsets, x, mask, DTYPE: tl.constexpr):
    """Store fp32 values into a tensor of DTYPE, rounding to nearest even (``copy_``)."""
    if DTYPE == BF16:
        tl.store(ptr + offsets, f32_to_bf16_bits(x).to(tl.bfloat16, bitcast=True), mask=mask)
    elif DTYPE == F16:
        tl.store(ptr + offsets, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptr + offsets, x, mask=mask)


@triton.jit
def load_scalar(ptr, DTYPE: tl.constexpr):
    """A 0-d tensor input (a tensor hyperparameter or a value the prologue computed), as fp32."""
    if DTYPE == BF16:
        return bf16_bits_to_f32(tl.load(ptr).to(tl.int16, bitcast=True))
    else:
        return tl.load(ptr).to(tl.float32)


@triton.jit
def round_to_fp8(y, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """Round fp32 to the nearest fp8 value (ties to even, subnormals included), held exactly in fp32.

    The caller clamps ``y`` to the largest finite value first. ``y`` is scaled by a power of two to
    integer resolution, rounded, and scaled back, so the final cast to fp8 never rounds.
    """
    exponent = (y.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 127 + MIN_EXPONENT)
    to_units = ((127 + 127 + MANTISSA_BITS - exponent) << 23).to(tl.float32, bitcast=True)
    unit = ((exponent - MANTISSA_BITS) << 23).to(tl.float32, bitcast=True)
    magnitude = rne(tl.abs(y) * to_units) * unit
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -magnitude, magnitude)


@triton.jit
def fp8_code(r, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """The fp8 bit pattern (as uint8) of ``r``, a finite value :func:`round_to_fp8` returned, or NaN
    (0x7F with the sign): the fp32 exponent rebiased and the mantissa truncated (exact, no bits are
    lost), or below the smallest normal the multiple of the subnormal unit. ``cpu_prelude.h``'s
    ``lb_encode_fp8_rounded`` is the same arithmetic."""
    bits = r.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    smallest_normal = (127 + MIN_EXPONENT) << 23
    normal = (magnitude >> (23 - MANTISSA_BITS)) - ((127 + MIN_EXPONENT - 1) << MANTISSA_BITS)
    below = tl.minimum(magnitude, smallest_normal).to(tl.float32, bitcast=True)  # in range of the int cast
    subnormal = (below * (2.0 ** (MANTISSA_BITS - MIN_EXPONENT))).to(tl.int32)
    code = tl.where(magnitude >= smallest_normal, normal, subnormal)
    return (tl.where(r != r, 0x7F, code) | sign).to(tl.uint8)


@triton.jit
def fp8_value(code, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """The fp32 value of fp8 codes held in uint8, subnormals, infinities (e5m2) and NaNs included: the
    exponent rebiased into fp32's, or the subnormal multiple of ``2**(MIN_EXPONENT - MANTISSA_BITS)``.
    ``cpu_prelude.h``'s ``lb_decode_e4m3`` / ``lb_decode_e5m2`` are the same arithmetic."""
    u = code.to(tl.int32)
    exponent = (u & 0x7F) >> MANTISSA_BITS
    mantissa = u & ((1 << MANTISSA_BITS) - 1)
    normal = ((exponent + (127 + MIN_EXPONENT - 1)) << 23) | (mantissa << (23 - MANTISSA_BITS))
    subnormal = (mantissa.to(tl.float32) * (2.0 ** (MIN_EXPONENT - MANTISSA_BITS))).to(tl.int32, bitcast=True)
    bits = tl.where(exponent == 0, subnormal, normal)
    if MANTISSA_BITS == 3:  # e4m3fn: no infinities, only S.1111.111 is NaN
        bits = tl.where((u & 0x7F) == 0x7F, 0x7FC00000, bits)
    else:  # e5m2: the top exponent is infinity or NaN, as in IEEE
        bits = tl.where(exponent == 31, (255 << 23) | (mantissa << 21), bits)
    return (bits | ((u & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def dynamic8_index(y, bounds_ptr):
    """``torch.bucketize(y, bounds, right=True)`` over the 255 dynamic-map midpoints (padded to 256
    with +inf): a branchless binary search, 8 table loads per element."""
    pos = tl.zeros(y.shape, dtype=tl.int32)
    for level in tl.static_range(8):  # steps of 128, 64, ..., 1
        probe = tl.load(bounds_ptr + pos + ((128 >> level) - 1))
        pos = tl.where(probe <= y, pos + (128 >> level), pos)
    return pos


@triton.jit
def encode(y, bounds_ptr, FMT: tl.constexpr, NONNEG: tl.constexpr, QMAX: tl.constexpr,
           MIN_POSITIVE: tl.constexpr, FP8_NATIVE: tl.constexpr = True):
    """``formats.encode``: values already multiplied by their block's ``qmax / absmax`` to codes (fp8
    codes as float8, or as their uint8 bits where not ``FP8_NATIVE``)."""
    if FMT == INT8:
        if NONNEG:
            q = tl.minimum(tl.maximum(rne(y), 0.0), QMAX)
            q = tl.where((y > 0) & (q == 0), 1.0, q)
            return q.to(tl.uint8)
        else:
            return tl.minimum(tl.maximum(rne(y), -QMAX), QMAX).to(tl.int8)
    elif FMT == DYNAMIC8:
        idx = dynamic8_index(y, bounds_ptr)
        if NONNEG:
            idx = tl.where((y > 0) & (idx == 0), 1, idx)
        return idx.to(tl.uint8)
    elif FMT == BF16_CODES:
        if NONNEG:
            y = tl.where(y > 0, tl.maximum(y, MIN_POSITIVE), y)
        return f32_to_bf16_bits(y).to(tl.bfloat16, bitcast=True)
    else:
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if NONNEG:
            y = tl.where(y > 0, tl.maximum(y, MIN_POSITIVE), y)
        if FMT == FP8_E4M3:
            if FP8_NATIVE:
                return round_to_fp8(y, 3, -6).to(tl.float8e4nv)
            else:
                return fp8_code(round_to_fp8(y, 3, -6), 3, -6)
        else:
            if FP8_NATIVE:
                return round_to_fp8(y, 2, -14).to(tl.float8e5)
            else:
                return fp8_code(round_to_fp8(y, 2, -14), 2, -14)


@triton.jit
def dequantize(codes_ptr, scales_ptr, patch_values_ptr, patch_index_ptr, map_ptr, rows, cols, offsets, mask,
               row_mask, FMT: tl.constexpr, K: tl.constexpr, FP8_NATIVE: tl.constexpr = True):
    """``blockquant.dequantize`` of one tile of ``[ROWS, BLOCK]`` elements (one block per row) in fp32:
    decode, times the block's scale, the K patches written over their offsets. fp8 codes are float8,
    or their uint8 bits where not ``FP8_NATIVE``."""
    if FMT == BF16_CODES:
        codes = tl.load(codes_ptr + offsets, mask=mask, other=0.0)
        values = bf16_bits_to_f32(codes.to(tl.int16, bitcast=True))
    else:
        if FMT == DYNAMIC8:
            codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
            values = tl.load(map_ptr + codes.to(tl.int32), mask=mask, other=0.0)
        elif FMT == INT8:
            values = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.float32)
        elif FP8_NATIVE:  # float8 codes (no `other`: the interpreter cannot cast a fill value to fp8)
            values = tl.where(mask, tl.load(codes_ptr + offsets, mask=mask).to(tl.float32), 0.0)
        elif FMT == FP8_E4M3:  # fp8 codes as their uint8 bits
            values = fp8_value(tl.load(codes_ptr + offsets, mask=mask, other=0), 3, -6)
        else:
            values = fp8_value(tl.load(codes_ptr + offsets, mask=mask, other=0), 2, -14)
        scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
        values = values * scale[:, None]
        for k in tl.static_range(K):
            index = tl.load(patch_index_ptr + rows * K + k, mask=row_mask, other=-1).to(tl.int32)
            bits = tl.load(patch_values_ptr + rows * K + k, mask=row_mask, other=0.0).to(tl.int16, bitcast=True)
            values = tl.where(cols[None, :] == index[:, None], bf16_bits_to_f32(bits)[:, None], values)
    return values


@triton.jit
def quantize(x, codes_ptr, scales_ptr, patch_values_ptr, patch_index_ptr, bounds_ptr, rows, cols, offsets, mask,
             row_mask, FMT: tl.constexpr, NONNEG: tl.constexpr, K: tl.constexpr, QMAX: tl.constexpr,
             MIN_POSITIVE: tl.constexpr, INV_QMAX: tl.constexpr, FP8_NATIVE: tl.constexpr = True):
    """``blockquant.quantize_into`` of one tile: per row (block) the K largest magnitudes become bf16
    patches (ties to the lowest offset), the absmax of the rest sets the scale, the rest is encoded.

    ``INV_QMAX`` mirrors how the reference's ``absmax / qmax`` runs on the device: CUDA multiplies by
    the fp32 reciprocal of a CPU scalar divisor (INV_QMAX is that reciprocal), the CPU divides (0.0).
    """
    x = tl.where(mask, x, 0.0)  # the reference pads a partial last block with zeros
    if FMT == BF16_CODES:
        tl.store(codes_ptr + offsets, encode(x, bounds_ptr, FMT, NONNEG, QMAX, MIN_POSITIVE, FP8_NATIVE), mask=mask)
    else:
        magnitude = tl.abs(x)
        for k in tl.static_range(K):
            index = tl.argmax(magnitude, axis=1, tie_break_left=True)
            hit = cols[None, :] == index[:, None]
            value = tl.max(tl.where(hit, x, float("-inf")), axis=1)
            tl.store(patch_values_ptr + rows * K + k, f32_to_bf16_bits(value).to(tl.bfloat16, bitcast=True),
                     mask=row_mask)
            tl.store(patch_index_ptr + rows * K + k, index.to(tl.int16), mask=row_mask)
            magnitude = tl.where(hit, -1.0, magnitude)
            x = tl.where(hit, 0.0, x)
        absmax = tl.max(tl.abs(x), axis=1)
        # qmax / absmax in the reference is Tensor.__rtruediv__: reciprocal, then times qmax
        nonzero = absmax > 0
        inverse = tl.where(nonzero, tl.math.div_rn(1.0, tl.where(nonzero, absmax, 1.0)) * QMAX, 0.0)
        if INV_QMAX != 0.0:
            scale = absmax * INV_QMAX
        else:
            scale = tl.math.div_rn(absmax, QMAX)
        tl.store(scales_ptr + rows, scale, mask=row_mask)
        codes = encode(x * inverse[:, None], bounds_ptr, FMT, NONNEG, QMAX, MIN_POSITIVE, FP8_NATIVE)
        tl.store(codes_ptr + offsets, codes, mask=mask)
