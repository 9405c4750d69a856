// Runtime of the fused CPU step kernels that kernels/cpp_printer.py prints: SIMD helpers, the
// element formats of kernels/formats.py, and block (de)quantization with outlier patches exactly as
// kernels/blockquant.py defines them. The printer pastes this file in front of every kernel, with the
// format constants generated from formats.py in place of the @formats@ line, so a kernel's source
// (and its cache key) is self-contained.
//
// Vectors are GCC vector extensions of LB_W float lanes (16 with AVX-512, else 8); the compiler maps
// them onto the machine's SIMD registers. Per-lane loops over __builtin_fmaf/__builtin_sqrtf/
// __builtin_rintf compile to one vector instruction each under -O3 -fno-math-errno.
//
// Rounding: every value is rounded exactly where torch rounds it (fp32 per op, bf16 per op where a
// state or param is bf16), FMA only where torch's own CPU kernels fuse (lerp, add with alpha,
// addcmul), so the emitted update reproduces the traced aten ops bit for bit.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef LB_W
#if defined(__AVX512F__)
#define LB_W 16
#else
#define LB_W 8
#endif
#endif

typedef float vf __attribute__((vector_size(4 * LB_W)));
typedef int32_t vi __attribute__((vector_size(4 * LB_W)));
typedef uint32_t vu __attribute__((vector_size(4 * LB_W)));
typedef uint16_t vh __attribute__((vector_size(2 * LB_W)));
typedef uint8_t vb __attribute__((vector_size(LB_W)));
typedef int8_t vc __attribute__((vector_size(LB_W)));

#define LB_INLINE static inline __attribute__((always_inline))

LB_INLINE vf lb_splat(float x) { return (vf){} + x; }
LB_INLINE vi lb_splat_i(int32_t x) { return (vi){} + x; }
LB_INLINE vf lb_bits_f(vi x) { return (vf)x; }
LB_INLINE vi lb_bits_i(vf x) { return (vi)x; }

// ---- lane-wise math ---------------------------------------------------------------------------
LB_INLINE vf lb_fma(vf a, vf b, vf c) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}
LB_INLINE vf lb_sqrt(vf a) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = __builtin_sqrtf(a[l]);
  return r;
}
LB_INLINE vf lb_rint(vf a) {  // round half to even (the default rounding mode), like torch.round
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = __builtin_rintf(a[l]);
  return r;
}
LB_INLINE vf lb_nan() { return lb_bits_f(lb_splat_i(0x7FC00000)); }
LB_INLINE vf lb_maximum(vf a, vf b) {  // torch.maximum: NaN if either is NaN
  vf m = a > b ? a : b;
  return (a != a) | (b != b) ? lb_nan() : m;
}
LB_INLINE vf lb_minimum(vf a, vf b) {
  vf m = a < b ? a : b;
  return (a != a) | (b != b) ? lb_nan() : m;
}
LB_INLINE float lb_maximum_s(float a, float b) { return a != a || b != b ? NAN : (a > b ? a : b); }
LB_INLINE float lb_minimum_s(float a, float b) { return a != a || b != b ? NAN : (a < b ? a : b); }
LB_INLINE vf lb_abs(vf a) { return lb_bits_f(lb_bits_i(a) & 0x7FFFFFFF); }
LB_INLINE vi lb_mask(bool b) { return lb_splat_i(b ? -1 : 0); }  // a scalar condition as a lane mask
LB_INLINE vf lb_clamp(vf x, float lo, float hi) {  // NaN stays NaN, like Tensor.clamp
  x = x < lb_splat(lo) ? lb_splat(lo) : x;
  return x > lb_splat(hi) ? lb_splat(hi) : x;
}

// ---- loads and stores: full vectors, and the first r lanes of a tail ----------------------------
LB_INLINE vf lb_ld(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
LB_INLINE void lb_st(float* p, vf v) { memcpy(p, &v, sizeof v); }
LB_INLINE vf lb_ld_n(const float* p, int64_t r) {
  float t[LB_W] = {0};
  memcpy(t, p, r * sizeof(float));
  return lb_ld(t);
}
LB_INLINE void lb_st_n(float* p, vf v, int64_t r) {
  float t[LB_W];
  lb_st(t, v);
  memcpy(p, t, r * sizeof(float));
}

// Widening loads and narrowing stores of 8- and 16-bit lanes. GCC scalarizes these conversions on
// vector extensions, so x86 gets one or two intrinsics each; other targets the generic version.
#if defined(__AVX512F__) && defined(__AVX512BW__) && LB_W == 16
#include <immintrin.h>
LB_INLINE vi lb_ld_u8(const uint8_t* p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
LB_INLINE void lb_st_u8(uint8_t* p, vi x) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8((__m512i)x)); }
LB_INLINE vi lb_ld_u16(const uint16_t* p) { return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)); }
LB_INLINE void lb_st_u16(uint16_t* p, vi x) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16((__m512i)x)); }
LB_INLINE int lb_any(vi m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0; }  // any lane set
LB_INLINE vf lb_gather(const float* base, vi idx) { return (vf)_mm512_i32gather_ps((__m512i)idx, base, 4); }
LB_INLINE void lb_st_u8x4(uint8_t* p, vi a, vi b, vi c, vi d) {
  lb_st_u8(p, a);
  lb_st_u8(p + LB_W, b);
  lb_st_u8(p + 2 * LB_W, c);
  lb_st_u8(p + 3 * LB_W, d);
}
#elif defined(__AVX2__) && LB_W == 8
#include <immintrin.h>
LB_INLINE vi lb_ld_u8(const uint8_t* p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
LB_INLINE void lb_st_u8(uint8_t* p, vi x) {  // the low byte of each lane (lanes hold 0..255)
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  __m256i t = _mm256_shuffle_epi8((__m256i)x, pick);
  _mm_storel_epi64((__m128i*)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}
LB_INLINE vi lb_ld_u16(const uint16_t* p) { return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)); }
LB_INLINE void lb_st_u16(uint16_t* p, vi x) {  // lanes hold 0..65535
  __m256i t = _mm256_permute4x64_epi64(_mm256_packus_epi32((__m256i)x, (__m256i)x), 0xD8);
  _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(t));
}
LB_INLINE int lb_any(vi m) { return !_mm256_testz_si256((__m256i)m, (__m256i)m); }
LB_INLINE vf lb_gather(const float* base, vi idx) { return (vf)_mm256_i32gather_ps(base, (__m256i)idx, 4); }
LB_INLINE void lb_st_u8x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors of 0..255: two packs, one store
  __m256i t = _mm256_packus_epi16(_mm256_packus_epi32((__m256i)a, (__m256i)b),
                                  _mm256_packus_epi32((__m256i)c, (__m256i)d));
  t = _mm256_permutevar8x32_epi32(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)p, t);
}
#else
LB_INLINE vi lb_ld_u8(const uint8_t* p) {
  vb b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
LB_INLINE void lb_st_u8(uint8_t* p, vi x) {
  vb b = __builtin_convertvector(x, vb);
  memcpy(p, &b, sizeof b);
}
LB_INLINE vi lb_ld_u16(const uint16_t* p) {
  vh h;
  memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vi);
}
LB_INLINE void lb_st_u16(uint16_t* p, vi x) {
  vh h = __builtin_convertvector(x, vh);
  memcpy(p, &h, sizeof h);
}
LB_INLINE int lb_any(vi m) {
  int any = 0;
  for (int l = 0; l < LB_W; ++l) any |= m[l];
  return any != 0;
}
LB_INLINE vf lb_gather(const float* base, vi idx) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = base[idx[l]];
  return r;
}
LB_INLINE void lb_st_u8x4(uint8_t* p, vi a, vi b, vi c, vi d) {
  lb_st_u8(p, a);
  lb_st_u8(p + LB_W, b);
  lb_st_u8(p + 2 * LB_W, c);
  lb_st_u8(p + 3 * LB_W, d);
}
#endif

LB_INLINE vi lb_gather_i(const int32_t* base, vi idx) { return lb_bits_i(lb_gather((const float*)base, idx)); }

// bf16 <-> fp32. Rounding is c10's round_to_nearest_even, NaN -> 0x7FC0.
LB_INLINE vi lb_f32_to_bf16_bits(vf x) {  // in the low 16 bits of each lane
  vu u = (vu)x;
  vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
  return (x != x) ? lb_splat_i(0x7FC0) : (vi)r;
}
LB_INLINE vf lb_round_bf16(vf x) {
  vu u = (vu)x;
  vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) & 0xFFFF0000u;
  return (x != x) ? lb_bits_f(lb_splat_i(0x7FC00000)) : (vf)r;
}
LB_INLINE vf lb_ld_bf16(const uint16_t* p) { return lb_bits_f(lb_ld_u16(p) << 16); }
LB_INLINE void lb_st_bf16(uint16_t* p, vf v) { lb_st_u16(p, lb_f32_to_bf16_bits(v)); }
LB_INLINE vf lb_ld_bf16_n(const uint16_t* p, int64_t r) {
  uint16_t t[LB_W] = {0};
  memcpy(t, p, r * sizeof(uint16_t));
  return lb_ld_bf16(t);
}
LB_INLINE void lb_st_bf16_n(uint16_t* p, vf v, int64_t r) {
  uint16_t t[LB_W];
  lb_st_bf16(t, v);
  memcpy(p, t, r * sizeof(uint16_t));
}
static inline float lb_bf16_scalar(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t lb_bf16_bits(float x) {
  if (x != x) return 0x7FC0;
  uint32_t u;
  memcpy(&u, &x, 4);
  return (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}

static inline float lb_round_bf16_s(float x) { return lb_bf16_scalar(lb_bf16_bits(x)); }

// fp16 <-> fp32 through the compiler's _Float16 (IEEE conversions, to nearest even).
LB_INLINE vf lb_round_f16(vf x) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = (float)(_Float16)x[l];
  return r;
}
static inline float lb_round_f16_s(float x) { return (float)(_Float16)x; }
LB_INLINE vf lb_ld_f16(const uint16_t* p) {
  _Float16 h[LB_W];
  memcpy(h, p, sizeof h);
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = (float)h[l];
  return r;
}
LB_INLINE void lb_st_f16(uint16_t* p, vf v) {
  _Float16 h[LB_W];
  for (int l = 0; l < LB_W; ++l) h[l] = (_Float16)v[l];
  memcpy(p, h, sizeof h);
}
LB_INLINE vf lb_ld_f16_n(const uint16_t* p, int64_t r) {
  uint16_t t[LB_W] = {0};
  memcpy(t, p, r * sizeof(uint16_t));
  return lb_ld_f16(t);
}
LB_INLINE void lb_st_f16_n(uint16_t* p, vf v, int64_t r) {
  uint16_t t[LB_W];
  lb_st_f16(t, v);
  memcpy(p, t, r * sizeof(uint16_t));
}

// ---- element formats (kernels/formats.py) -----------------------------------------------------
// @formats@

LB_INLINE vi lb_ld_codes(const uint8_t* p) { return lb_ld_u8(p); }  // one byte per lane, zero-extended
LB_INLINE vi lb_ld_codes_n(const uint8_t* p, int64_t r) {
  uint8_t t[LB_W] = {0};
  memcpy(t, p, r);
  return lb_ld_u8(t);
}
LB_INLINE void lb_st_codes(uint8_t* p, vi c) { lb_st_u8(p, c); }  // lanes hold 0..255
LB_INLINE void lb_st_codes_n(uint8_t* p, vi c, int64_t r) {
  uint8_t t[LB_W];
  lb_st_u8(t, c);
  memcpy(p, t, r);
}

// fp8 with M mantissa bits and 7 - M exponent bits: e4m3fn (M = 3: no infinities, all-ones is NaN)
// and e5m2 (M = 2: infinities and NaNs as in IEEE).
template <int M>
LB_INLINE vf lb_decode_fp8(vi u) {
  const int E = 7 - M, BIAS = (1 << (E - 1)) - 1;
  vi e = (u >> M) & ((1 << E) - 1), m = u & ((1 << M) - 1);
  vf normal = lb_bits_f(((e + (127 - BIAS)) << 23) | (m << (23 - M)));
  vf sub = __builtin_convertvector(m, vf) * lb_bits_f(lb_splat_i((127 + 1 - BIAS - M) << 23));  // m * 2^(1-BIAS-M)
  vf v = e == 0 ? sub : normal;
  if (M == 3) v = (u & 0x7F) == 0x7F ? lb_nan() : v;
  else v = e == (1 << E) - 1 ? lb_bits_f((255 << 23) | (m << (23 - M))) : v;
  return lb_bits_f(lb_bits_i(v) | ((u & 0x80) << 24));
}
// Round |y| <= qmax to fp8 with M mantissa bits (normals from 2^MIN_EXP) by adding and removing
// 2^(max(E, MIN_EXP) + 23 - M): the FPU's round-to-nearest-even does the rounding, so the codes
// are those of c10's fp8*_from_fp32_value (formats.encode) for every finite input in range.
template <int M, int MIN_EXP>
LB_INLINE vi lb_encode_fp8_rounded(vf y) {
  const int32_t bias = (1 << (6 - M)) - 1;  // 7 - M exponent bits: e4m3 7, e5m2 15
  vi bits = lb_bits_i(y);
  vi sign = bits & (int32_t)0x80000000;
  vi ab = bits ^ sign;
  vi e = ab & 0x7F800000;
  vi magic = (e > ((127 + MIN_EXP) << 23) ? e : lb_splat_i((127 + MIN_EXP) << 23)) + ((23 - M) << 23);
  vf c = lb_bits_f(magic);
  vf r = (lb_bits_f(ab) + c) - c;
  vi normal = (lb_bits_i(r) >> (23 - M)) - ((127 - bias) << M);
  vi sub = __builtin_convertvector(r * lb_bits_f(lb_splat_i((127 + M - MIN_EXP) << 23)), vi);  // r / 2^(MIN_EXP-M)
  vi code = r >= lb_bits_f(lb_splat_i((127 + MIN_EXP) << 23)) ? normal : sub;
  code = y != y ? lb_splat_i(0x7F) : code;
  return (code | (vi)((vu)sign >> 24)) & 0xFF;
}

// dynamic8: a sorted 256-entry map; encode is bucketize(x, midpoints, right=True), by one table
// look-up. The sign, exponent and top 7 mantissa bits of x pick a bucket of magnitudes [lo, hi)
// (those below 2^-30 join the first, those from 2 the last) that holds at most one midpoint (the
// map's spacing is at least twice a bucket's width; lb_dyn_build checks it and sets lb_dyn_bad,
// which makes every step fail with status 3 instead of encoding wrongly). A bucket's entry is the
// count of midpoints <= x at the bucket's start, and the low 16 bits of its midpoint's magnitude,
// from which one more midpoint (x > 0) or one fewer (x < 0) is <= x.
static const int LB_DYN_MIN_EXP = -30;
static const int LB_DYN_KEYS = (1 - LB_DYN_MIN_EXP) * 128;  // exponents 2^-30 .. 2^0, 128 buckets each
static const int32_t LB_DYN_NONE = 1 << 17;                 // no midpoint in the bucket: never reached
struct lb_dyn_keys {
  int32_t e[2 * LB_DYN_KEYS];  // positive x, then negative x; count | threshold << 8
};
static int lb_dyn_bad = 0;  // a map finer than the buckets (formats.py changed without this table)
static lb_dyn_keys lb_dyn_build(const float* mids) {  // the 255 sorted midpoints
  lb_dyn_keys t;
  for (int neg = 0; neg < 2; ++neg)
    for (int k = 0; k < LB_DYN_KEYS; ++k) {
      const uint32_t lo_bits = (uint32_t)(k + ((127 + LB_DYN_MIN_EXP) << 7)) << 16;
      const uint32_t hi_bits = lo_bits + (1u << 16);
      float lo, hi;
      memcpy(&lo, &lo_bits, 4);
      memcpy(&hi, &hi_bits, 4);
      if (k == 0) lo = 0.0f;
      int32_t count = 0, inside = 0, threshold = LB_DYN_NONE;
      for (int j = 0; j < 255; ++j) {
        const float m = mids[j], a = fabsf(m);
        uint32_t bits;
        memcpy(&bits, &a, 4);
        if (!neg) {
          if (m <= lo) ++count;
          else if (m < hi) ++inside, threshold = (int32_t)(bits & 0xFFFF);  // x >= m from these low bits
        } else {
          if (m <= -lo) ++count;
          if (m < 0 && a >= lo && a < hi) ++inside, threshold = (int32_t)(bits & 0xFFFF) + 1;  // x < m past them
        }
      }
      if (inside > 1) lb_dyn_bad = 1;
      t.e[neg * LB_DYN_KEYS + k] = count | threshold << 8;
    }
  return t;
}
LB_INLINE vf lb_decode_dynamic8(vi u, const float* map) { return lb_gather(map, u); }
LB_INLINE vi lb_encode_dynamic8(vf y, const int32_t* keys) {
  const vi bits = lb_bits_i(y), neg = bits < 0, ab = bits & 0x7FFFFFFF;
  vi key = (ab >> 16) - ((127 + LB_DYN_MIN_EXP) << 7);
  key = key < 0 ? lb_splat_i(0) : key;
  key = key > LB_DYN_KEYS - 1 ? lb_splat_i(LB_DYN_KEYS - 1) : key;
  const vi e = lb_gather_i(keys, key + (neg & LB_DYN_KEYS));
  const vi past = ((ab & 0xFFFF) >= (e >> 8)) & 1;
  const vi idx = (e & 0xFF) + ((past ^ neg) - neg);  // + past, or - past where x < 0
  return y != y ? lb_splat_i(255) : idx;  // NaN: torch.bucketize puts it past every midpoint
}

// Codes (one byte per lane) -> values relative to the block scale.
template <int F, bool U>
LB_INLINE vf lb_decode(vi u, const float* map) {
  if constexpr (F == LB_INT8) return U ? __builtin_convertvector(u, vf) : __builtin_convertvector((u << 24) >> 24, vf);
  else if constexpr (F == LB_E4M3 || F == LB_E5M2) return lb_decode_fp8<lb_format<F, U>::mantissa>(u);
  else return lb_decode_dynamic8(u, map);
}

// Values already multiplied by qmax/absmax -> codes; a positive value of a non-negative state never
// becomes code 0 (formats.encode).
template <int F, bool U>
LB_INLINE vi lb_encode(vf y, const int32_t* keys) {
  if constexpr (F == LB_INT8) {
    vf q = lb_clamp(lb_rint(y), U ? 0.0f : -lb_format<F, U>::qmax, lb_format<F, U>::qmax);
    if (U) q = (y > 0) & (q == 0) ? lb_splat(1.0f) : q;
    return __builtin_convertvector(q, vi) & 0xFF;
  } else if constexpr (F == LB_DYNAMIC8) {
    vi idx = lb_encode_dynamic8(y, keys);
    if (U) idx = (y > 0) & (idx == 0) ? lb_splat_i(1) : idx;
    return idx;
  } else {
    const float qmax = lb_format<F, U>::qmax, min_positive = lb_format<F, U>::min_positive;
    vf c = lb_clamp(y, -qmax, qmax);
    if (U) c = (c > 0) & (c < min_positive) ? lb_splat(min_positive) : c;
    return lb_encode_fp8_rounded<lb_format<F, U>::mantissa, lb_format<F, U>::min_exponent>(c);
  }
}

// bf16 state storage (not blockwise): a positive value of a non-negative state stays positive.
template <bool U>
LB_INLINE vf lb_bf16_state_clamp(vf x) {
  const float min_positive = lb_format<LB_BF16_CODES, U>::min_positive;  // the smallest positive bf16
  return U ? ((x > 0) & (x < min_positive) ? lb_splat(min_positive) : x) : x;
}

// ---- block quantization with outlier patches (blockquant.quantize_into) -------------------------
// Magnitudes compare as the integer bits of |x| (NaN above inf, like argmax); -1 marks no element.
LB_INLINE vi lb_key(vf x) { return lb_bits_i(x) & 0x7FFFFFFF; }
LB_INLINE vi lb_lane_mask(int64_t r) {  // lanes [0, r) set
  vi lane;
  for (int l = 0; l < LB_W; ++l) lane[l] = l;
  return lane < lb_splat_i((int32_t)r);
}
// The update loop keeps, per lane, the largest key it wrote to a state's block buffer.
LB_INLINE vi lb_key_masked(vf x, int64_t r) {
  return r == LB_W ? lb_key(x) : (lb_key(x) & lb_lane_mask(r)) | ~lb_lane_mask(r);
}
LB_INLINE vi lb_vmax(vi a, vi b) { return a > b ? a : b; }

struct lb_patch {
  int32_t key;
  int32_t index;
  float value;
};

// The K+1 largest elements seen, ordered as repeated argmax finds them: key descending, offset
// ascending. Elements arrive in offset order, so an equal key never displaces an earlier one.
template <int K>
struct lb_best {
  lb_patch e[K + 1];
  int n = 0;
  int32_t floor() const { return n <= K ? -1 : e[K].key; }  // a newcomer must beat this
  void add(int32_t key, int32_t index, float value) {
    int j = n <= K ? n++ : K;
    for (; j > 0 && e[j - 1].key < key; --j) e[j] = e[j - 1];
    e[j] = lb_patch{key, index, value};
  }
};

// Offer buf[i, i + r) to `best` (off the hot loop: a handful of vectors per block get here); the
// key a later element must reach.
template <int K>
__attribute__((noinline)) static vi lb_collect(lb_best<K>& best, const float* buf, int64_t i, int64_t r,
                                               int32_t bound) {
  for (int64_t l = 0; l < r; ++l) {
    int32_t key;
    memcpy(&key, buf + i + l, 4);
    key &= 0x7FFFFFFF;
    if (key >= bound && key > best.floor()) best.add(key, (int32_t)(i + l), buf[i + l]);
  }
  if (best.n <= K) return lb_splat_i(bound);
  return lb_splat_i(best.floor() < INT32_MAX ? best.floor() + 1 : INT32_MAX);  // an equal key loses: it comes later
}

// Quantize the block held in buf[0, len) (a block of `block` elements, zero-padded past len) into
// its codes, scale and K patches. `lane_max` holds each lane's largest key in buf. The K patches
// are the K largest |x| (ties: lowest offset) in the order the reference's repeated argmax finds
// them; the scale is the absmax of the rest over qmax.
template <int F, bool U, int K>
static void lb_quantize_block(vi lane_max, float* buf, int64_t len, int64_t block, float qmax, uint8_t* codes,
                              float* scale, uint16_t* patch_values, int16_t* patch_index, const int32_t* keys) {
  // Bound: the (K+1)-th largest lane maximum. K+1 lanes hold an element at least this large, so
  // the K+1 largest elements all reach it, and one pass collects them exactly.
  int32_t lm[LB_W];
  memcpy(lm, &lane_max, sizeof lm);
  for (int j = 0; j <= K && j < LB_W; ++j)
    for (int l = j + 1; l < LB_W; ++l)
      if (lm[l] > lm[j]) {
        int32_t t = lm[j];
        lm[j] = lm[l];
        lm[l] = t;
      }
  int32_t rest = lm[0] > 0 ? lm[0] : 0;  // no patches: the absmax is the largest lane maximum
  if (K > 0) {
    const int32_t bound = K < LB_W ? lm[K] : -1;
    lb_best<K> best;
    vi thr = lb_splat_i(bound);
    int64_t i = 0;
    for (; i + 2 * LB_W <= len; i += 2 * LB_W)  // two vectors per test: hits are a handful per block
      if (lb_any((lb_key(lb_ld(buf + i)) >= thr) | (lb_key(lb_ld(buf + i + LB_W)) >= thr)))
        thr = lb_collect(best, buf, i, 2 * LB_W, bound);
    for (; i < len; i += LB_W) {
      const int64_t r = len - i < LB_W ? len - i : LB_W;
      if (lb_any(lb_key_masked(r == LB_W ? lb_ld(buf + i) : lb_ld_n(buf + i, r), r) >= thr))
        thr = lb_collect(best, buf, i, r, bound);
    }
    for (int64_t pad = len; pad < block && best.n <= K; ++pad) best.add(0, (int32_t)pad, 0.0f);  // the padding's zeros
    rest = best.n > K && best.e[K].key > 0 ? best.e[K].key : 0;
    for (int k = 0; k < K; ++k) {
      patch_values[k] = lb_bf16_bits(best.e[k].value);
      patch_index[k] = (int16_t)best.e[k].index;
      if (best.e[k].index < len) buf[best.e[k].index] = 0.0f;
    }
  }
  float absmax;
  memcpy(&absmax, &rest, 4);
  const vf vinv = lb_splat(absmax > 0 ? (1.0f / absmax) * qmax : 0.0f);  // torch's qmax / absmax: reciprocal() * qmax
  *scale = absmax / qmax;
  int64_t i = 0;
  for (; i + 4 * LB_W <= len; i += 4 * LB_W)
    lb_st_u8x4(codes + i, lb_encode<F, U>(lb_ld(buf + i) * vinv, keys),
               lb_encode<F, U>(lb_ld(buf + i + LB_W) * vinv, keys),
               lb_encode<F, U>(lb_ld(buf + i + 2 * LB_W) * vinv, keys),
               lb_encode<F, U>(lb_ld(buf + i + 3 * LB_W) * vinv, keys));
  for (; i + LB_W <= len; i += LB_W) lb_st_codes(codes + i, lb_encode<F, U>(lb_ld(buf + i) * vinv, keys));
  if (i < len) lb_st_codes_n(codes + i, lb_encode<F, U>(lb_ld_n(buf + i, len - i) * vinv, keys), len - i);
}

// The patches of one block that fall inside its len elements, sorted by offset (the update loop
// decodes codes times scale and puts these values in the lanes they fall on). Returns their count.
static const int64_t LB_NO_PATCH = INT64_MAX / 2;
template <int K>
static inline int lb_sorted_patches(const int16_t* index, const uint16_t* values, int64_t len, int64_t* out_index,
                                    float* out_value) {
  int n = 0;
  for (int k = 0; k < K; ++k) {
    if (index[k] >= len) continue;
    int j = n++;
    for (; j > 0 && out_index[j - 1] > index[k]; --j) {
      out_index[j] = out_index[j - 1];
      out_value[j] = out_value[j - 1];
    }
    out_index[j] = index[k];
    out_value[j] = lb_bf16_scalar(values[k]);
  }
  return n;
}

// ---- float32 square roots as torch computes them ------------------------------------------------
// torch built with MKL takes float32 square roots with vmsSqrt(VML_HA), which is not correctly
// rounded; the Python side passes that function here so a step without quantized states stays
// bit-for-bit stock. Without it, the SIMD square root (what torch uses when built without MKL).
typedef void (*lb_vsqrt_fn)(int, const float*, float*, long long);
static lb_vsqrt_fn lb_vsqrt_impl = nullptr;
static const long long LB_VML_MODE = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
extern "C" void lowbit_set_vsqrt(void* fn) { lb_vsqrt_impl = (lb_vsqrt_fn)fn; }
static void lb_vsqrt(int64_t n, float* x) {
  if (lb_vsqrt_impl) {
    lb_vsqrt_impl((int)n, x, x, LB_VML_MODE);
    return;
  }
  int64_t i = 0;
  for (; i + LB_W <= n; i += LB_W) lb_st(x + i, lb_sqrt(lb_ld(x + i)));
  if (i < n) lb_st_n(x + i, lb_sqrt(lb_ld_n(x + i, n - i)), n - i);
}

// ---- per-thread scratch ---------------------------------------------------------------------------
static float* lb_scratch(int64_t floats) {
  static thread_local float* buf = nullptr;
  static thread_local int64_t cap = 0;
  if (cap < floats) {
    free(buf);
    buf = (float*)aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
    cap = floats;
  }
  return buf;
}
