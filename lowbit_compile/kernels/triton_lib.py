"""Triton building blocks of the emitted step kernels: exact rounding, and the block decode and
block encode of every format of the registry (``formats/``) (the reference is ``blockquant.py``).

Every rounding here ends in a value that is exactly representable in the target type, computed with
IEEE fp32 arithmetic or integer bit arithmetic, so a kernel gives the same bits on a GPU and under
``TRITON_INTERPRET=1``, whose own float downcasts are not round-to-nearest-even (fp32 to bf16
truncates, fp32 to fp8 loses the carry into the exponent, bf16 subnormals go wrong both ways). Two
rules for kernels that use these helpers:

* compile bit-identical kernels with ``enable_fp_fusion=False``: :func:`rne` relies on ``(x + C) - C``
  not being contracted with the product that feeds it, and the emitter writes every fma ATen uses
  explicitly. Kernels of 8-bit states (``APPROXIMATE``) keep the contract of quantized formats instead
  (docs/numerics.md, "The GPU kernels") and compile with contraction: there ``rne(a * b)`` rounds the exact product
  once, and the approximate roots and divisions move a code by at most one step;
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

from ..formats import registered
from ..formats.dynamic import DYNAMIC_CELL_BITS, DYNAMIC_CELLS, DYNAMIC_FIRST_EXPONENT, DYNAMIC_NO_EDGE

# Element formats: the registry's number of each format (ElementFormat.id) under its triton_name, the name
# the printed kernels pass as FMT; fp32 states never reach a kernel.
_FORMAT_IDS = {f.triton_name: f.id for f in registered() if f.triton_name is not None}
INT8 = tl.constexpr(_FORMAT_IDS["INT8"])
DYNAMIC8 = tl.constexpr(_FORMAT_IDS["DYNAMIC8"])
FP8_E4M3 = tl.constexpr(_FORMAT_IDS["FP8_E4M3"])
FP8_E5M2 = tl.constexpr(_FORMAT_IDS["FP8_E5M2"])
BF16_CODES = tl.constexpr(_FORMAT_IDS["BF16_CODES"])
SQRT8 = tl.constexpr(_FORMAT_IDS["SQRT8"])
SQRT4 = tl.constexpr(_FORMAT_IDS["SQRT4"])  # sqrt8's map in 4-bit codes, two a byte

# Value dtypes of params and stock states: every value lives in fp32 registers, rounded to its dtype.
F32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
F16 = tl.constexpr(2)


@triton.jit
def rne(x):
    """Round to the nearest integer, ties to even, for |x| < 2**22 (every code magnitude is < 2**16)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def nearest_value_root(r, APPROXIMATE: tl.constexpr = False):
    """sqrt4's encode (``builtin._encode_sqrt4``) of a root ``r`` >= 0: of the roots ``floor(r)`` and the next,
    the one whose square is nearer ``r * r``, ties to the even root: up where ``r * r - c (c + 1)`` (exact) is
    over 1/2. ``APPROXIMATE`` (the contract of quantized formats): a tie may round either way."""
    low = tl.floor(r)
    d = tl.fma(-low, low + 1.0, r * r)
    if APPROXIMATE:
        return tl.where(d > 0.5, low + 1.0, low)
    else:
        odd = low - 2.0 * tl.floor(low * 0.5)
        return tl.where((d > 0.5) | ((d == 0.5) & (odd == 1.0)), low + 1.0, low)


@triton.jit
def neg(x):
    """``-x`` with IEEE's sign of zero, the sign bit flipped (NaNs too, as ATen's neg): Triton before 3.8
    compiles a float's ``-x`` as ``0 - x``, which is +0.0 for +0.0."""
    if x.dtype == tl.float32:
        return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)
    else:
        return -x


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
    if DTYPE == BF16:  # f32_to_bf16_bits in place: the rounded pattern's low half cleared
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return tl.where(x != x, (bits | 0x400000) & -65536, rounded).to(tl.float32, bitcast=True)
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
def store_elements(ptr, offsets, x, mask, DTYPE: tl.constexpr, ROUNDED: tl.constexpr = False):
    """Store fp32 values into a tensor of DTYPE, rounding to nearest even (``copy_``); ``ROUNDED``: ``x``
    already holds DTYPE values (:func:`round_to`'s), so a bf16's bits are the top half of x's."""
    if DTYPE == BF16:
        if ROUNDED:
            bits = (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        else:
            bits = f32_to_bf16_bits(x)
        tl.store(ptr + offsets, bits.to(tl.bfloat16, bitcast=True), mask=mask)
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
    return tl.where(y.to(tl.int32, bitcast=True) < 0, neg(magnitude), magnitude)


# fp32 bit patterns of the fp8 formats' largest finite values (formats.StateFormat.qmax, 448 and 57344)
E4M3_TOP_BITS = tl.constexpr(0x43E00000)
E5M2_TOP_BITS = tl.constexpr(0x47600000)


@triton.jit
def fp8_code(y, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr, NONNEG: tl.constexpr):
    """``formats.encode`` of fp8 as uint8 bits, by integer arithmetic on fp32's: |y| clamped to the
    largest finite value (NaN too: only a flagged block holds one, and its special code replaces it),
    from the smallest normal up the bits rounded to ``MANTISSA_BITS`` half to even with the exponent
    rebiased, below it the subnormal multiple that adding a power of two rounds in fp32; the sign bit as
    is (-0 is 0x80), and for a non-negative state a positive y at least code 1. ``cpu_prelude.h``'s
    ``lb_encode_fp8`` is the same."""
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(bits & 0x7FFFFFFF, E4M3_TOP_BITS if MANTISSA_BITS == 3 else E5M2_TOP_BITS)
    normal = (a + (((1 << (22 - MANTISSA_BITS)) - 1) - ((126 + MIN_EXPONENT) << 23)) +
              ((a >> (23 - MANTISSA_BITS)) & 1)) >> (23 - MANTISSA_BITS)
    # |y| + 2^(MIN_EXPONENT - MANTISSA_BITS + 23), where fp32's unit is the subnormal unit
    carrier = a.to(tl.float32, bitcast=True) + 2.0 ** (MIN_EXPONENT - MANTISSA_BITS + 23)
    subnormal = carrier.to(tl.int32, bitcast=True) - ((127 + MIN_EXPONENT - MANTISSA_BITS + 23) << 23)
    code = tl.where(a < ((127 + MIN_EXPONENT) << 23), subnormal, normal) | ((bits >> 24) & 0x80)
    if NONNEG:
        code = tl.maximum(code, tl.minimum(bits, 1))  # bits > 0 is y > 0
    return code.to(tl.uint8)


@triton.jit
def fp8_scaled_value(code, MANTISSA_BITS: tl.constexpr):
    """fp8 codes held in uint8 to fp32 through fp16, whose conversion is exact (``cpu_prelude.h``'s
    ``lb_decode_fp8``): e5m2 is fp16's high byte; e4m3's sign at fp16's and its magnitude under fp16's
    top exponent bit are the fp16 of the value / 256 (subnormals too), an all-ones magnitude carrying
    into that bit, which makes it NaN. The value is this times 256 for e4m3, times 1 for e5m2."""
    if MANTISSA_BITS == 2:
        h = code.to(tl.int32) << 8
    else:
        s = code.to(tl.int8, bitcast=True).to(tl.int32) << 7  # the sign in bits 14 and up, the magnitude 7-13
        h = s ^ ((s + 0x80) & 0x4000)  # bit 14 cleared, or set for all-ones
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp8_value(code, MANTISSA_BITS: tl.constexpr):
    """The fp32 value of fp8 codes held in uint8, subnormals, infinities (e5m2) and NaNs included."""
    if MANTISSA_BITS == 3:
        return fp8_scaled_value(code, MANTISSA_BITS) * 256.0
    else:
        return fp8_scaled_value(code, MANTISSA_BITS)


# The dynamic8 lookup table (formats.dynamic.dynamic_lookup_table): 256 code values, then the cells of magnitudes.
_CELL_SHIFT = tl.constexpr(23 - DYNAMIC_CELL_BITS)
_FIRST_CELL = tl.constexpr((127 + DYNAMIC_FIRST_EXPONENT) << DYNAMIC_CELL_BITS)
_LAST_CELL = tl.constexpr(DYNAMIC_CELLS - 1)
_IN_CELL = tl.constexpr(DYNAMIC_NO_EDGE - 1)  # the mantissa bits below a cell's


@triton.jit
def dynamic8_code(y, table_ptr, NONNEG: tl.constexpr):
    """``formats.encode`` of dynamic8 through ``formats.dynamic.dynamic_lookup_table``: |y|'s cell (its exponent
    and top mantissa bits) gives the code magnitude p of the cell's lowest value and where in the cell
    the lower edge of p + 1 lies; one compare of |y|'s low mantissa bits with it settles the code."""
    a = y if NONNEG else tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    cell = tl.minimum(tl.maximum((bits >> _CELL_SHIFT) - _FIRST_CELL, 0), _LAST_CELL)
    entry = tl.load(table_ptr + 256 + cell).to(tl.int32, bitcast=True)
    p = (entry & 0xFF) + ((bits & _IN_CELL) >= (entry >> 8)).to(tl.int32)
    if NONNEG:
        code = tl.where(y > 0, tl.maximum(p, 1), 0)  # a positive value never becomes 0
    else:
        code = 127 + tl.where(y < 0, -p, p)
    return tl.where(y != y, 255, code).to(tl.uint8)


@triton.jit
def dynamic8_value(codes, table_ptr):
    """``formats.decode`` of dynamic8 codes (uint8): the value table of ``formats.dynamic.dynamic_lookup_table``."""
    return tl.load(table_ptr + codes.to(tl.int32))


@triton.jit
def encode(y, table_ptr, FMT: tl.constexpr, NONNEG: tl.constexpr, QMAX: tl.constexpr,
           MIN_POSITIVE: tl.constexpr, FP8_NATIVE: tl.constexpr = True, APPROXIMATE: tl.constexpr = False):
    """``formats.encode``: normalized values (``formats.normalize``: times their block's ``qmax / absmax``,
    sqrt8's in the root domain) to codes (fp8 codes as float8, or as their uint8 bits where not
    ``FP8_NATIVE``)."""
    if FMT == INT8:
        if NONNEG:
            q = tl.minimum(tl.maximum(rne(y), 0.0), QMAX)
            q = tl.where((y > 0) & (q == 0), 1.0, q)
            return q.to(tl.uint8)
        else:
            return tl.minimum(tl.maximum(rne(y), -QMAX), QMAX).to(tl.int8)
    elif FMT == SQRT8 or FMT == SQRT4:  # sqrt8: the root rounded half to even; sqrt4: the nearest value's root
        if NONNEG:
            r = tl.minimum(tl.maximum(y, 0.0), QMAX**0.5)
            c = nearest_value_root(r, APPROXIMATE) if FMT == SQRT4 else rne(r)
            return tl.where((y > 0) & (c == 0), 1.0, c).to(tl.uint8)
        else:
            r = tl.minimum(tl.abs(y), QMAX**0.5)
            c = nearest_value_root(r, APPROXIMATE) if FMT == SQRT4 else rne(r)
            return tl.where(y < 0, neg(c), c).to(tl.int8)
    elif FMT == DYNAMIC8:
        return dynamic8_code(y, table_ptr, NONNEG)
    elif FMT == BF16_CODES:
        return bf16_code(y, NONNEG).to(tl.bfloat16, bitcast=True)
    else:
        if not FP8_NATIVE:
            return fp8_code(y, 3 if FMT == FP8_E4M3 else 2, -6 if FMT == FP8_E4M3 else -14, NONNEG)
        else:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            if NONNEG:
                y = tl.where(y > 0, tl.maximum(y, MIN_POSITIVE), y)
            if FMT == FP8_E4M3:
                return round_to_fp8(y, 3, -6).to(tl.float8e4nv)
            else:
                return round_to_fp8(y, 2, -14).to(tl.float8e5)


@triton.jit
def bf16_clamp(x, NONNEG: tl.constexpr):
    """What a bf16 state (or patch) clamps before rounding: a finite value saturates at bf16's largest
    (3.3895e38) instead of rounding to inf, and for a non-negative state a positive value is never
    below the smallest positive bf16 (2^-133)."""
    magnitude = tl.abs(x)
    x = tl.where((magnitude > 3.3895313892515355e38) & (magnitude < float("inf")),
                 tl.where(x > 0, 3.3895313892515355e38, -3.3895313892515355e38), x)
    if NONNEG:
        x = tl.where((x > 0) & (x < 2.0**-133), 2.0**-133, x)
    return x


@triton.jit
def bf16_code(x, NONNEG: tl.constexpr):
    """``formats.encode`` of a bf16 state (and of a patch), as int16 bits: :func:`bf16_clamp`, then to
    nearest even."""
    return f32_to_bf16_bits(bf16_clamp(x, NONNEG))


@triton.jit
def bf16_code_stochastic(x, draws, NONNEG: tl.constexpr):
    """``formats.round_stochastic`` of a bf16 state (and of a patch), as int16 bits: :func:`bf16_clamp`,
    the 16-bit ``draws`` (:func:`state_draws`) added to the fp32 pattern and truncated; NaN to nearest."""
    y = bf16_clamp(x, NONNEG)
    up = ((y.to(tl.uint32, bitcast=True) + draws.to(tl.uint32)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
    return tl.where(y != y, f32_to_bf16_bits(y), up)


@triton.jit
def code_value(bits, table_ptr, FMT: tl.constexpr, NONNEG: tl.constexpr):
    """The value (relative to the block scale) of 8-bit codes held as their uint8 bits."""
    if FMT == INT8:
        if NONNEG:
            return bits.to(tl.float32)
        else:
            return bits.to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == SQRT8 or FMT == SQRT4:
        if NONNEG:
            c = bits.to(tl.float32)
        else:
            c = bits.to(tl.int8, bitcast=True).to(tl.float32)
        return c * tl.abs(c)
    elif FMT == DYNAMIC8:
        return dynamic8_value(bits, table_ptr)
    elif FMT == FP8_E4M3:
        return fp8_value(bits, 3)
    else:
        return fp8_value(bits, 2)


@triton.jit
def round_stochastic(x, code, t1, table_ptr, FMT: tl.constexpr, NONNEG: tl.constexpr, QMAX: tl.constexpr):
    """``formats.round_stochastic`` of 8-bit codes (uint8 bits) from the nearest ``code`` of a finite
    ``x`` (sqrt8's in the root domain; the caller gives a non-finite x its special code): of the two
    codes around x, the outer (larger magnitude) replaces the inner where ``t * |w_out - w_in| < |x -
    w_in|``, ``t = (u + 0.5) / 2^16`` from the element's 16-bit draw ``u``, given as ``t1 = 1 + t``
    (:func:`tile_thresholds`; ``cpu_prelude.h``'s ``lb_round_stochastic``): ``fma(t1, gap, -gap)`` is
    ``t * gap`` rounded once, and ``t1 - 1`` is ``t``, both exact. int8 and sqrt8 work on magnitudes from
    the inner code ``floor``: int8's codes 1 apart, sqrt8's value the square of the clamped root, the inner
    code's value ``c * c`` and the outer's ``2c + 1`` above it, all exact; fp8 counts units of the value's
    binade (nothing decoded); dynamic8 takes the other code around x as code +- 1 and decodes both."""
    if FMT == SQRT8 or FMT == SQRT4 or FMT == INT8:
        if FMT != INT8:  # sqrt8's and sqrt4's: the clamp of encode, which the compiler shares
            if NONNEG:
                a = tl.minimum(tl.maximum(x, 0.0), QMAX**0.5)
            else:
                a = tl.minimum(tl.abs(x), QMAX**0.5)
            c = tl.floor(a)
            gap = tl.fma(c, 2.0, 1.0)
            m = tl.where(tl.fma(t1, gap, -gap) < tl.fma(-c, c, a * a), c + 1.0, c)
        else:
            if NONNEG:
                a = tl.minimum(tl.maximum(x, 0.0), QMAX)
            else:
                a = tl.minimum(tl.abs(x), QMAX)
            c = tl.floor(a)
            m = tl.where(t1 - 1.0 < a - c, c + 1.0, c)
        if NONNEG:
            out = m.to(tl.int32)
        else:
            out = tl.where(x < 0, neg(m), m).to(tl.int8).to(tl.uint8, bitcast=True).to(tl.int32)
    elif FMT == FP8_E4M3 or FMT == FP8_E5M2:
        # on the magnitude, nothing decoded: the codes around |y| are c and c + 1 units of its binade,
        # unit 2^(e - 127 - M) with e its fp32 exponent (at least E0 = 127 + the format's smallest normal
        # exponent: subnormal units below), and the magnitude code of c units is ((e - E0) << M) + c
        if FMT == FP8_E4M3:
            MB: tl.constexpr = 3
            E0: tl.constexpr = 121
        else:
            MB: tl.constexpr = 2
            E0: tl.constexpr = 113
        y = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        bits = y.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        e = tl.maximum(a >> 23, E0)
        units = a.to(tl.float32, bitcast=True) * ((254 + MB - e) << 23).to(tl.float32, bitcast=True)  # exact
        c = tl.floor(units)
        out = (((e - E0) << MB) + c.to(tl.int32) + tl.where(t1 - 1.0 < units - c, 1, 0)) | ((bits >> 24) & 0x80)
    else:
        if NONNEG:
            y = tl.minimum(tl.maximum(x, 0.0), QMAX)
        else:
            y = tl.minimum(tl.maximum(x, -QMAX), QMAX)
        q = code.to(tl.int32)
        v = code_value(code, table_ptr, FMT, NONNEG)
        away = y > v
        other = (q + tl.where(away, 1, -1)) & 0xFF
        w = code_value(other.to(tl.uint8), table_ptr, FMT, NONNEG)
        inward = away != (y >= 0)  # the other code is the inner one (where y is a code's value, either does)
        gap = tl.abs(w - v)
        outward = tl.fma(t1, gap, -gap) < tl.abs(y - tl.where(inward, w, v))
        out = tl.where(inward != outward, other, q)
    if NONNEG:
        out = tl.where((x > 0) & (out == 0), 1, out)
    return out.to(tl.uint8)


@triton.jit
def state_key(seed, STREAM: tl.constexpr):
    """A state's key at counter ``seed``: ``hash32(counter ^ STREAM << 24)`` (``rounding.state_draws``)."""
    return hash32(seed.to(tl.uint32) ^ ((tl.zeros([], tl.uint32) + STREAM) << 24))


@triton.jit
def state_draws(seed, offsets, STREAM: tl.constexpr):
    """``rounding.state_draws`` of any elements (a patch's): each element's 16-bit draw (int32), the low
    half of ``hash32((index // 2) ^ key)`` where the index is even, the high half where it is odd."""
    word = (offsets >> 1).to(tl.uint32)
    return ((hash32(word ^ state_key(seed, STREAM)) >> ((offsets & 1) * 16).to(tl.uint32)) & 0xFFFF).to(tl.int32)


@triton.jit
def tile_thresholds(seed, rows, offsets, STREAM: tl.constexpr):
    """``1 + t`` (``rounding.threshold``'s ``t = (u + 0.5) / 2^16``, exact) of each element of a ``[ROWS,
    BLOCK]`` tile (:func:`tile_draws`), from the bits of its draw: ``u`` as the mantissa bits below 1's
    (the fp32 ``1 + (u + 0.5) / 2^16`` is ``0x3F800040 | u << 7``), no conversion."""
    BLOCK: tl.constexpr = offsets.shape[1]
    if BLOCK % 2 == 1:
        bits = (state_draws(seed, offsets, STREAM) << 7) | 0x3F800040
        return bits.to(tl.float32, bitcast=True)
    else:
        words = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        h = hash32(words.to(tl.uint32) ^ state_key(seed, STREAM))
        lo = ((h << 7) & 0x7FFF80) | 0x3F800040
        hi = ((h >> 9) & 0x7FFF80) | 0x3F800040
        pairs = tl.join(lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True))
        return tl.reshape(pairs, (offsets.shape[0], BLOCK))


@triton.jit
def tile_draws(seed, rows, offsets, STREAM: tl.constexpr):
    """The draws of a ``[ROWS, BLOCK]`` tile whose ``offsets`` are ``rows * BLOCK + cols``: for an even
    BLOCK one hash per two elements, its halves joined side by side (``rounding.state_draws``)."""
    BLOCK: tl.constexpr = offsets.shape[1]
    if BLOCK % 2 == 1:
        return state_draws(seed, offsets, STREAM)
    else:
        words = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        h = hash32(words.to(tl.uint32) ^ state_key(seed, STREAM))
        pairs = tl.join((h & 0xFFFF).to(tl.int32), (h >> 16).to(tl.int32))
        return tl.reshape(pairs, (offsets.shape[0], BLOCK))


@triton.jit
def root_of(x, APPROXIMATE: tl.constexpr):
    """The square root of ``x >= 0``: correctly rounded, or the GPU's approximate one (``sqrt.approx``)."""
    if APPROXIMATE:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def any_set(flags):
    """Whether any of a tile's ``flags`` is set (a block holding inf or NaN, an exact bf16 tie): the
    tile-uniform condition of a rare fix-up, a branch the common tile skips instead of work per element."""
    return tl.max(flags.to(tl.int32)) != 0


@triton.jit
def scale_and_inverse(absmax, QMAX: tl.constexpr, INV_QMAX: tl.constexpr, APPROXIMATE: tl.constexpr = False):
    """``blockquant._scale_and_inverse`` per row: ``absmax / qmax`` and ``(1 / absmax) * qmax``; a nonzero
    block below ``qmax * 2^-126`` gets the scale 2^-126 and the multiplier 2^126, an inf scale (qmax < 1)
    the multiplier ``1 / FLT_MAX``, and a scale whose largest code would decode to inf loses one ulp.
    ``INV_QMAX`` mirrors how ``absmax / qmax`` runs on the device: CUDA multiplies by the fp32 reciprocal
    of a CPU scalar divisor (INV_QMAX is that reciprocal), the CPU divides (0.0). ``APPROXIMATE``: the
    multiplier by one approximate division."""
    nonzero = absmax > 0
    if APPROXIMATE:
        inverse = tl.where(nonzero, QMAX / tl.where(nonzero, absmax, 1.0), 0.0)
    else:  # qmax / absmax in the reference is Tensor.__rtruediv__: reciprocal, then times qmax
        inverse = tl.where(nonzero, tl.math.div_rn(1.0, tl.where(nonzero, absmax, 1.0)) * QMAX, 0.0)
    if INV_QMAX != 0.0:
        scale = absmax * INV_QMAX
    else:
        scale = tl.math.div_rn(absmax, QMAX)
    tiny = nonzero & (scale < 2.0**-126)
    scale = tl.where(tiny, 2.0**-126, scale)
    inverse = tl.where(tiny, 2.0**126, inverse)
    inverse = tl.where(scale == float("inf"), 2.938735877055719e-39, inverse)  # fp32(1 / FLT_MAX)
    top = scale * QMAX == float("inf")
    return tl.where(top, (scale.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), scale), inverse


@triton.jit
def code_bits(codes, FMT: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Codes of any 8-bit format as their uint8 bit patterns."""
    if FMT == DYNAMIC8:
        return codes
    elif FMT == INT8 or FMT == SQRT8 or FMT == SQRT4:
        return codes.to(tl.uint8, bitcast=True)
    elif FP8_NATIVE:
        return codes.to(tl.uint8, bitcast=True)
    else:
        return codes


@triton.jit
def packed_layout(rows, mask):
    """The bytes of a ``[ROWS, BLOCK]`` tile of 4-bit codes (``formats/packing.py``): their offsets, from
    ``arange`` so the compiler sees them contiguous, and which to touch (those of the tile's even elements:
    an odd count's last byte holds one code)."""
    ROWS: tl.constexpr = mask.shape[0]
    BLOCK: tl.constexpr = mask.shape[1]
    byte_mask, _ = tl.split(tl.reshape(mask, (ROWS, BLOCK // 2, 2)))
    return rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :], byte_mask


@triton.jit
def load_codes(codes_ptr, rows, offsets, mask, FMT: tl.constexpr, NONNEG: tl.constexpr):
    """The codes of a tile, 0 past its end; a 4-bit format's loaded as bytes and unpacked, element 2i the
    low nibble of byte i and 2i + 1 the high one, a signed state's sign-extended to int8 (-8..7)."""
    if FMT == SQRT4:
        byte_offsets, byte_mask = packed_layout(rows, mask)
        packed = tl.load(codes_ptr + byte_offsets, mask=byte_mask, other=0)
        if NONNEG:
            low, high = packed & 0xF, packed >> 4
        else:  # arithmetic shifts of the int8 byte
            signed = packed.to(tl.int8, bitcast=True)
            low, high = (signed << 4) >> 4, signed >> 4
        return tl.reshape(tl.join(low, high), offsets.shape)
    else:
        return tl.load(codes_ptr + offsets, mask=mask, other=0)


@triton.jit
def store_codes(codes_ptr, rows, offsets, codes, mask, FMT: tl.constexpr):
    """Store a tile's codes; a 4-bit format's (uint8 bits, of which the low nibble counts) two a byte, as
    :func:`load_codes` reads them. An odd count's last high nibble is 0: past the end codes are 0, the code
    of the 0.0 a partial block is padded with."""
    if FMT == SQRT4:
        byte_offsets, byte_mask = packed_layout(rows, mask)
        low, high = tl.split(tl.reshape(codes.to(tl.uint8, bitcast=True), (offsets.shape[0], offsets.shape[1] // 2, 2)))
        tl.store(codes_ptr + byte_offsets, (low & 0xF) | (high << 4), mask=byte_mask)
    else:
        tl.store(codes_ptr + offsets, codes, mask=mask)


@triton.jit
def dequantize(codes_ptr, scales_ptr, patch_values_ptr, patch_index_ptr, table_ptr, rows, cols, offsets, mask,
               row_mask, FMT: tl.constexpr, K: tl.constexpr, FP8_NATIVE: tl.constexpr = True,
               POS_INF_CODE: tl.constexpr = 0, NEG_INF_CODE: tl.constexpr = 0, NAN_CODE: tl.constexpr = 0,
               NONNEG: tl.constexpr = False):
    """``blockquant.dequantize`` of one tile of ``[ROWS, BLOCK]`` elements (one block per row) in fp32:
    decode, times the magnitude of the block's scale, the K patches written over their offsets. In a
    flagged block (the scale's sign bit set) the codes ``POS_INF_CODE``, ``NEG_INF_CODE`` and
    ``NAN_CODE`` (``formats.special_codes``, as uint8) are +inf, -inf and NaN, and a non-finite decode is
    not scaled. fp8 codes are float8, or their uint8 bits where not ``FP8_NATIVE``. ``NONNEG`` is read by
    4-bit formats only (whose bytes do not say the codes' sign; an 8-bit code's dtype does)."""
    if FMT == BF16_CODES:
        codes = tl.load(codes_ptr + offsets, mask=mask, other=0.0)
        values = bf16_bits_to_f32(codes.to(tl.int16, bitcast=True))
    else:
        if FMT == DYNAMIC8:
            codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
            values = dynamic8_value(codes, table_ptr)
        elif FMT == INT8:
            codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
            values = codes.to(tl.float32)
        elif FMT == SQRT8 or FMT == SQRT4:
            codes = load_codes(codes_ptr, rows, offsets, mask, FMT, NONNEG)
            values = codes.to(tl.float32)
            values = values * tl.abs(values)
        elif FP8_NATIVE:  # float8 codes (no `other`: the interpreter cannot cast a fill value to fp8)
            codes = tl.load(codes_ptr + offsets, mask=mask)
            values = tl.where(mask, codes.to(tl.float32), 0.0)
        else:  # fp8 codes as their uint8 bits, decoded to values / unit (the unit goes into the scale)
            codes = tl.load(codes_ptr + offsets, mask=mask, other=0)
            values = fp8_scaled_value(codes, 3 if FMT == FP8_E4M3 else 2)
        scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
        if FMT == FP8_E4M3 and not FP8_NATIVE:
            scaled = values * (tl.abs(scale) * 256.0)[:, None]  # exact: the scale is below FLT_MAX / 448
        else:
            scaled = values * tl.abs(scale)[:, None]
        if any_set(scale.to(tl.int32, bitcast=True) < 0):  # a flagged block
            flagged = (scale.to(tl.int32, bitcast=True) < 0)[:, None]
            bits = code_bits(codes, FMT, FP8_NATIVE)
            special = tl.where(bits == NAN_CODE, float("nan"),
                               tl.where(bits == POS_INF_CODE, float("inf"), float("-inf")))
            is_special = flagged & ((bits == POS_INF_CODE) | (bits == NEG_INF_CODE) | (bits == NAN_CODE))
            scaled = tl.where(is_special, special,
                              tl.where(flagged & ~(tl.abs(values) < float("inf")), values, scaled))
        values = scaled
        for k in tl.static_range(K):
            index = tl.load(patch_index_ptr + rows * K + k, mask=row_mask, other=-1).to(tl.int32)
            bits = tl.load(patch_values_ptr + rows * K + k, mask=row_mask, other=0.0).to(tl.int16, bitcast=True)
            values = tl.where(cols[None, :] == index[:, None], bf16_bits_to_f32(bits)[:, None], values)
    return values


@triton.jit
def quantize(x, codes_ptr, scales_ptr, patch_values_ptr, patch_index_ptr, table_ptr, rows, cols, offsets, mask,
             row_mask, FMT: tl.constexpr, NONNEG: tl.constexpr, K: tl.constexpr, QMAX: tl.constexpr,
             MIN_POSITIVE: tl.constexpr, INV_QMAX: tl.constexpr, FP8_NATIVE: tl.constexpr = True,
             NEG_QMAX: tl.constexpr = 0.0, INV_NEG_QMAX: tl.constexpr = 0.0, FLAGGED_QMAX: tl.constexpr = 0.0,
             INV_FLAGGED_QMAX: tl.constexpr = 0.0, POS_INF_CODE: tl.constexpr = 0, NEG_INF_CODE: tl.constexpr = 0,
             NAN_CODE: tl.constexpr = 0, seed=0.0, STREAM: tl.constexpr = 0, APPROXIMATE: tl.constexpr = False):
    """``blockquant.quantize_into`` of one tile: per row (block) the K largest finite magnitudes become
    bf16 patches (ties to the lowest offset; a non-finite value only where fewer than K are finite), the
    finite rest sets the scale (``scale_and_inverse``: the absmax over ``QMAX``, or where a ``NEG_QMAX``
    is given (signed dynamic8) the larger of the positive side over ``QMAX`` and the negative side over
    ``NEG_QMAX``), and the rest is encoded. A row whose rest holds inf or NaN is flagged: its scale comes
    from its finite values over ``FLAGGED_QMAX`` and is stored negated, its finite codes stay within
    ``FLAGGED_QMAX`` and its inf and NaN take the special codes. The ``INV_*`` are the fp32 reciprocals
    of the divisors on CUDA, 0.0 on the CPU (``scale_and_inverse``). A nonzero ``STREAM`` rounds codes and
    patches stochastically with the draws of counter ``seed`` in that stream (:func:`state_draws`; a patch
    with the draw of the element it holds).
    ``APPROXIMATE`` takes sqrt8's root with the GPU's approximate square root (codes within one step).
    """
    x = tl.where(mask, x, 0.0)  # the reference pads a partial last block with zeros
    if FMT == BF16_CODES:
        if STREAM != 0:
            draws = tile_draws(seed, rows, offsets, STREAM)
            tl.store(codes_ptr + offsets, bf16_code_stochastic(x, draws, NONNEG).to(tl.bfloat16, bitcast=True),
                     mask=mask)
        else:
            tl.store(codes_ptr + offsets, encode(x, table_ptr, FMT, NONNEG, QMAX, MIN_POSITIVE, FP8_NATIVE),
                     mask=mask)
    else:
        # a non-finite value ranks below every finite magnitude, a patched one below those
        magnitude = tl.where(tl.abs(x) < float("inf"), tl.abs(x), -1.0)
        for k in tl.static_range(K):
            index = tl.argmax(magnitude, axis=1, tie_break_left=True)
            hit = cols[None, :] == index[:, None]
            value = tl.sum(tl.where(hit, x.to(tl.int32, bitcast=True), 0), axis=1).to(tl.int32)  # its exact bits
            if STREAM != 0:
                patch = bf16_code_stochastic(value.to(tl.float32, bitcast=True),
                                             state_draws(seed, tl.sum(tl.where(hit, offsets, 0), axis=1), STREAM),
                                             NONNEG)
            else:
                patch = bf16_code(value.to(tl.float32, bitcast=True), NONNEG)
            tl.store(patch_values_ptr + rows * K + k, patch.to(tl.bfloat16, bitcast=True), mask=row_mask)
            tl.store(patch_index_ptr + rows * K + k, index.to(tl.int16), mask=row_mask)
            magnitude = tl.where(hit, -2.0, magnitude)
            x = tl.where(hit, 0.0, x)
        # one reduction finds both: magnitudes order as their bits, and inf and NaN lie above every finite one
        top = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        flagged = top >= 0x7F800000
        absmax = top.to(tl.float32, bitcast=True)
        any_flagged = any_set(flagged)
        if any_flagged:
            absmax = tl.max(tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0), axis=1)
        if NEG_QMAX != 0.0:
            finite = tl.abs(x) < float("inf")
            scale_p, inverse_p = scale_and_inverse(tl.max(tl.where(finite & (x > 0), x, 0.0), axis=1), QMAX, INV_QMAX,
                                                   APPROXIMATE)
            scale_n, inverse_n = scale_and_inverse(tl.max(tl.where(finite & (x < 0), neg(x), 0.0), axis=1), NEG_QMAX,
                                                   INV_NEG_QMAX, APPROXIMATE)
            negative = scale_n > scale_p
            scale = tl.where(negative, scale_n, scale_p)
            inverse = tl.where(negative, inverse_n, inverse_p)
        else:
            scale, inverse = scale_and_inverse(absmax, QMAX, INV_QMAX, APPROXIMATE)
        scale_f, inverse_f = scale_and_inverse(absmax, FLAGGED_QMAX, INV_FLAGGED_QMAX, APPROXIMATE)
        negated = (scale_f.to(tl.int32, bitcast=True) | -2147483648).to(tl.float32, bitcast=True)  # -0.0 too
        tl.store(scales_ptr + rows, tl.where(flagged, negated, scale), mask=row_mask)
        inverse = tl.where(flagged, inverse_f, inverse)
        flagged = flagged[:, None]
        if FMT == SQRT8 or FMT == SQRT4:  # the root domain (formats.normalize), which never underflows
            if NONNEG:
                root = root_of(tl.maximum(x, 0.0), APPROXIMATE)
                # a flushed subnormal root must still give a positive value a nonzero code
                y = tl.where((x > 0) & (root == 0), 2.0**-149, root * root_of(inverse, APPROXIMATE)[:, None])
            else:
                y = root_of(tl.abs(x), APPROXIMATE) * root_of(inverse, APPROXIMATE)[:, None]
                y = tl.where(x < 0, neg(y), y)
            if any_flagged:
                y = tl.where(flagged & (tl.abs(x) < float("inf")),
                             tl.minimum(tl.maximum(y, -(FLAGGED_QMAX**0.5)), FLAGGED_QMAX**0.5), y)
        else:
            y = x * inverse[:, None]
            if NONNEG:  # x * inverse may underflow to 0; the zero-point rule needs it positive
                y = tl.where((x > 0) & (y < 2.0**-149), 2.0**-149, y)
            if any_flagged:
                y = tl.where(flagged & (tl.abs(x) < float("inf")),
                             tl.minimum(tl.maximum(y, -FLAGGED_QMAX), FLAGGED_QMAX), y)
        codes = encode(y, table_ptr, FMT, NONNEG, QMAX, MIN_POSITIVE, FP8_NATIVE, APPROXIMATE)
        code = code_bits(codes, FMT, FP8_NATIVE)
        if STREAM != 0:
            t1 = tile_thresholds(seed, rows, offsets, STREAM)
            code = round_stochastic(y, code, t1, table_ptr, FMT, NONNEG, QMAX)
        if any_flagged:
            special = tl.where(x != x, NAN_CODE, tl.where(x > 0, POS_INF_CODE, NEG_INF_CODE)).to(tl.uint8)
            code = tl.where(flagged & ~(tl.abs(x) < float("inf")), special, code)
        store_codes(codes_ptr, rows, offsets, code.to(codes.dtype, bitcast=True), mask, FMT)


# fp32 master weights: a 16-bit param and its residual (the reference is residual.py) ---------------------
@triton.jit
def hash32(x):
    """Chris Wellons' ``lowbias32`` hash of uint32 values."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def f16_exponent(p):
    """The biased fp32 exponent of fp16 values held in fp32, at least that of 2**-14."""
    return tl.maximum((p.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 14)


@triton.jit
def master_read(param_ptr, residual_ptr, ties_ptr, offsets, mask, PARAM: tl.constexpr, EXACT: tl.constexpr,
                SHIFT: tl.constexpr):
    """``residual.read``: the fp32 master of each element from its 16-bit param and residual code (an
    exact bf16 tie takes its side from bit ``e % 32`` of tie word ``e // 32``)."""
    code = tl.load(residual_ptr + offsets, mask=mask, other=0).to(tl.int32)
    if EXACT:
        d = code
        if PARAM == BF16:
            tie = code == -32768
            if any_set(tie):
                word = tl.load(ties_ptr + (offsets >> 5), mask=mask & tie, other=0)
                up = ((word >> (offsets & 31).to(tl.int32)) & 1) != 0
                d = tl.where(tie, tl.where(up, -32768, 32768), code)
    else:
        d = code * (1 << SHIFT)
    if PARAM == BF16:
        bits = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) << 16
        magnitude = bits & 0x7FFFFFFF
        m = tl.minimum(tl.maximum(magnitude + d, 0), 0x7F800000)  # a residual a changed param no longer fits
        m = tl.where(magnitude > 0x7F800000, magnitude, m)  # NaN stays NaN
        return (m | (bits & -2147483648)).to(tl.float32, bitcast=True)
    else:
        p = tl.load(param_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        unit = ((f16_exponent(p) - 24) << 23).to(tl.float32, bitcast=True)
        return tl.where(d == 0, p, p + d.to(tl.float32) * unit)


@triton.jit
def master_write(x, param_ptr, residual_ptr, ties_ptr, seed, offsets, mask, PARAM: tl.constexpr,
                 EXACT: tl.constexpr, SHIFT: tl.constexpr):
    """``residual.write``: the new fp32 masters ``x`` as params rounded to nearest even and residual codes
    (stochastically rounded with ``hash32(index ^ hash32(seed))`` when lossy); exact bf16 ties set their
    side bits, atomically (one word spans 32 elements, which may belong to two programs)."""
    if PARAM == BF16:
        p_bits = f32_to_bf16_bits(x)
        tl.store(param_ptr + offsets, p_bits.to(tl.bfloat16, bitcast=True), mask=mask)
        d = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) - ((p_bits.to(tl.int32) << 16) & 0x7FFFFFFF)
        d = tl.where(x != x, 0, d)
    else:
        p = round_to(x, F16)
        tl.store(param_ptr + offsets, p.to(tl.float16), mask=mask)
        inverse = ((127 + 127 + 24 - f16_exponent(p)) << 23).to(tl.float32, bitcast=True)
        finite = (p.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
        d = tl.where(finite, rne(tl.where(finite, (x - p) * inverse, 0.0)), 0.0).to(tl.int32)
    if EXACT:
        if PARAM == BF16:
            if any_set(mask & ((d == 32768) | (d == -32768))):
                bit = (1 << (offsets & 31)).to(tl.int32)
                tl.atomic_or(ties_ptr + (offsets >> 5), bit, mask=mask & (d == -32768))
                tl.atomic_and(ties_ptr + (offsets >> 5), ~bit, mask=mask & (d == 32768))
            d = tl.where((d == 32768) | (d == -32768), -32768, d)
        tl.store(residual_ptr + offsets, d.to(tl.int16), mask=mask)
    else:
        key = hash32(seed.to(tl.uint32))
        u = (hash32(offsets.to(tl.uint32) ^ key) & ((1 << SHIFT) - 1)).to(tl.int32)
        q = tl.minimum(tl.maximum((d + u) >> SHIFT, -127), 127)
        tl.store(residual_ptr + offsets, q.to(tl.int8), mask=mask)
