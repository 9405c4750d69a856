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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// No <math.h> (nor <immintrin.h>, below): parsing them took longer than compiling a kernel, and the
// few functions and constants the kernels need are compiler builtins.
#define LB_NAN __builtin_nanf("")
#define LB_INF __builtin_inff()

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
#define LB_INLINE_LAMBDA __attribute__((always_inline))

// A runtime bool as a compile-time one: lb_versions calls f once per combination of its bools' values,
// each call a copy of f with those tests folded away (a lane loop per kind of block).
template <bool B>
struct lb_const {
  constexpr operator bool() const { return B; }
};
template <class F>
LB_INLINE void lb_versions(const F& f) { f(); }
template <class F, class... B>
LB_INLINE void lb_versions(const F& f, bool b, B... rest) {
  if (b) lb_versions([&](auto... c) LB_INLINE_LAMBDA { f(lb_const<true>{}, c...); }, rest...);
  else lb_versions([&](auto... c) LB_INLINE_LAMBDA { f(lb_const<false>{}, c...); }, rest...);
}
template <class F, bool V, class... B>
LB_INLINE void lb_versions(const F& f, lb_const<V>, B... rest) {  // already compile-time: one version
  lb_versions([&](auto... c) LB_INLINE_LAMBDA { f(lb_const<V>{}, c...); }, rest...);
}

// Whether a block's lane loop may write the previous block's codes (the fused layout, `fuse`): 16 lanes
// (AVX-512's 32 registers) overlap the encode with the step's arithmetic; with 8 (AVX2's 16 registers)
// the encode's values spill inside the loop and a loop of its own is faster (docs/performance.md).
// bench/fused_encode.py defines LB_FUSE_ENCODES to time both layouts on one machine.
#ifndef LB_FUSE_ENCODES
#define LB_FUSE_ENCODES (LB_W == 16)
#endif
#if LB_FUSE_ENCODES
LB_INLINE bool lb_fuse_if(bool fusable) { return fusable; }
#else
LB_INLINE lb_const<false> lb_fuse_if(bool) { return {}; }
#endif

// A broadcast: the integer form, because (vf){} + x is an add GCC may not drop (-0 + 0 is +0) and,
// re-materialized inside a loop short of registers, costs an add and a shuffle per use.
LB_INLINE vi lb_splat_i(int32_t x) { return (vi){} + x; }
LB_INLINE vf lb_splat(float x) { return (vf)lb_splat_i(__builtin_bit_cast(int32_t, x)); }
LB_INLINE vf lb_bits_f(vi x) { return (vf)x; }
LB_INLINE vi lb_bits_i(vf x) { return (vi)x; }

// ---- lane-wise math ---------------------------------------------------------------------------
// With GCC on x86 each is one instruction, written as the builtin <immintrin.h> wraps: GCC turns a
// per-lane loop into one instruction only where its SLP vectorizer succeeds, and in a long update
// loop (dynamic8's) it left an fma as eight scalar ones. Other targets and compilers: per-lane loops.
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__) && LB_W == 16
LB_INLINE vf lb_fma(vf a, vf b, vf c) { return __builtin_ia32_vfmaddps512_mask(a, b, c, (uint16_t)-1, 4); }
LB_INLINE vf lb_sqrt(vf a) { return __builtin_ia32_sqrtps512_mask(a, a, (uint16_t)-1, 4); }
LB_INLINE vf lb_rint(vf a) { return __builtin_ia32_rndscaleps_mask(a, 0x04, a, (uint16_t)-1, 4); }  // half to even
LB_INLINE vf lb_floor(vf a) { return __builtin_ia32_rndscaleps_mask(a, 0x01, a, (uint16_t)-1, 4); }
#elif defined(__GNUC__) && !defined(__clang__) && defined(__AVX__) && defined(__FMA__) && LB_W == 8
LB_INLINE vf lb_fma(vf a, vf b, vf c) { return __builtin_ia32_vfmaddps256(a, b, c); }
LB_INLINE vf lb_sqrt(vf a) { return __builtin_ia32_sqrtps256(a); }
LB_INLINE vf lb_rint(vf a) { return __builtin_ia32_roundps256(a, 0x04); }  // half to even
LB_INLINE vf lb_floor(vf a) { return __builtin_ia32_roundps256(a, 0x01); }
#else
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
LB_INLINE vf lb_floor(vf a) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = __builtin_floorf(a[l]);
  return r;
}
#endif
LB_INLINE vf lb_nan() { return lb_bits_f(lb_splat_i(0x7FC00000)); }
LB_INLINE vf lb_maximum(vf a, vf b) {  // torch.maximum: NaN if either is NaN
  vf m = a > b ? a : b;
  return (a != a) | (b != b) ? lb_nan() : m;
}
LB_INLINE vf lb_minimum(vf a, vf b) {
  vf m = a < b ? a : b;
  return (a != a) | (b != b) ? lb_nan() : m;
}
LB_INLINE float lb_maximum_s(float a, float b) { return a != a || b != b ? LB_NAN : (a > b ? a : b); }
LB_INLINE float lb_minimum_s(float a, float b) { return a != a || b != b ? LB_NAN : (a < b ? a : b); }
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
// Ask for the element `ahead` elements past p. The update loop asks for the next block of each input
// stream, so memory keeps streaming while the block's states are re-quantized (no loads then): the
// hardware prefetcher alone lets it idle. A prefetch never faults, past the end of a buffer included.
template <class T>
LB_INLINE void lb_prefetch(const T* p, int64_t ahead) {
  __builtin_prefetch((const void*)((uintptr_t)p + ahead * sizeof(T)), 0, 3);
}

// lb_cvt_rne: to int32, rounding half to even (the default rounding mode, like torch.round); lb_min_nn,
// lb_max_nn: one min or max instruction, for operands that are never NaN (their NaN result differs).
// Widening loads and narrowing stores of 8- and 16-bit lanes. GCC scalarizes these conversions on
// vector extensions, so with GCC x86 gets one or two SIMD instructions each, written as the builtins
// <immintrin.h> wraps (parsing that header took more time than compiling a kernel); other targets and
// compilers the generic version.
#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__) && defined(__AVX512BW__) && LB_W == 16
typedef char lb_v16qi __attribute__((vector_size(16)));
typedef short lb_v16hi __attribute__((vector_size(32)));
typedef float lb_v8sf __attribute__((vector_size(32)));
LB_INLINE vi lb_ld_u8(const uint8_t* p) {
  lb_v16qi b;
  memcpy(&b, p, sizeof b);
  return (vi)__builtin_ia32_pmovzxbd512_mask(b, (vi){}, (uint16_t)-1);
}
LB_INLINE vi lb_ld_s8(const uint8_t* p) {  // sign-extended
  lb_v16qi b;
  memcpy(&b, p, sizeof b);
  return (vi)__builtin_ia32_pmovsxbd512_mask(b, (vi){}, (uint16_t)-1);
}
LB_INLINE void lb_st_u8(uint8_t* p, vi x) {
  const lb_v16qi b = __builtin_ia32_pmovdb512_mask(x, (lb_v16qi){}, (uint16_t)-1);
  memcpy(p, &b, sizeof b);
}
LB_INLINE vi lb_code_byte(vi c) { return c; }  // the store keeps each lane's low byte
LB_INLINE vi lb_ld_u16(const uint16_t* p) {
  lb_v16hi h;
  memcpy(&h, p, sizeof h);
  return (vi)__builtin_ia32_pmovzxwd512_mask(h, (vi){}, (uint16_t)-1);
}
LB_INLINE void lb_st_u16(uint16_t* p, vi x) {
  const lb_v16hi h = __builtin_ia32_pmovdw512_mask(x, (lb_v16hi){}, (uint16_t)-1);
  memcpy(p, &h, sizeof h);
}
LB_INLINE uint32_t lb_hits(vi m) { return __builtin_ia32_ptestmd512(m, m, (uint16_t)-1); }  // bit l: lane l set
LB_INLINE vi lb_cvt_rne(vf x) { return __builtin_ia32_cvtps2dq512_mask(x, (vi){}, (uint16_t)-1, 4); }
LB_INLINE vf lb_min_nn(vf a, vf b) { return __builtin_ia32_minps512_mask(a, b, (vf){}, (uint16_t)-1, 4); }
LB_INLINE vf lb_max_nn(vf a, vf b) { return __builtin_ia32_maxps512_mask(a, b, (vf){}, (uint16_t)-1, 4); }
#define LB_CVT_SIGNED
LB_INLINE vi lb_cvt_signed(vf m, vf y) {  // y's sign bit on m, then one conversion (rint is symmetric)
  return lb_cvt_rne(lb_bits_f(lb_bits_i(m) | (lb_bits_i(y) & (int32_t)0x80000000)));
}
LB_INLINE vf lb_perm8(const float* t, vi idx) {  // t[idx & 7], in registers (t: 8 constants)
  lb_v8sf t8;
  memcpy(&t8, t, sizeof t8);
  const vf lo = __builtin_ia32_ps512_256ps(t8);
  const vf twice = __builtin_ia32_shuf_f32x4_mask(lo, lo, 0x44, (vf){}, (uint16_t)-1);  // t twice
  return __builtin_ia32_permvarsf512_mask(twice, idx, (vf){}, (uint16_t)-1);
}
#define LB_PERM32
LB_INLINE vi lb_perm32_i(const int32_t* t, vi idx) {  // t[idx & 31], in registers (t: 32 constants)
  vi lo, hi;
  memcpy(&lo, t, sizeof lo);
  memcpy(&hi, t + 16, sizeof hi);
  return __builtin_ia32_vpermt2vard512_mask(idx, lo, hi, (uint16_t)-1);
}
LB_INLINE vf lb_perm32(const float* t, vi idx) {
  vf lo, hi;
  memcpy(&lo, t, sizeof lo);
  memcpy(&hi, t + 16, sizeof hi);
  return __builtin_ia32_vpermt2varps512_mask(idx, lo, hi, (uint16_t)-1);
}
#define LB_F16C
#define LB_LO16
LB_INLINE vh lb_lo16(vi x) { return (vh)__builtin_ia32_pmovdw512_mask(x, (lb_v16hi){}, (uint16_t)-1); }
LB_INLINE vf lb_f16_bits_to_f32(vh h) {
  return __builtin_ia32_vcvtph2ps512_mask((lb_v16hi)h, (vf){}, (uint16_t)-1, 4);
}
#elif defined(__GNUC__) && !defined(__clang__) && defined(__AVX2__) && LB_W == 8
typedef char lb_v16qi __attribute__((vector_size(16)));
typedef char lb_v32qi __attribute__((vector_size(32)));
typedef short lb_v8hi __attribute__((vector_size(16)));
typedef short lb_v16hi __attribute__((vector_size(32)));
typedef int32_t lb_v4si __attribute__((vector_size(16)));
typedef long long lb_v2di __attribute__((vector_size(16)));
typedef long long lb_v4di __attribute__((vector_size(32)));
LB_INLINE vi lb_ld_u8(const uint8_t* p) {
  lb_v2di b = {0, 0};
  memcpy(&b, p, 8);
  return (vi)__builtin_ia32_pmovzxbd256((lb_v16qi)b);
}
LB_INLINE vi lb_ld_s8(const uint8_t* p) {  // sign-extended
  lb_v2di b = {0, 0};
  memcpy(&b, p, 8);
  return (vi)__builtin_ia32_pmovsxbd256((lb_v16qi)b);
}
LB_INLINE void lb_st_u8(uint8_t* p, vi x) {  // the low byte of each lane (lanes hold 0..255)
  const lb_v32qi pick = {0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
  const lb_v4di t = (lb_v4di)__builtin_ia32_pshufb256((lb_v32qi)x, pick);
  const lb_v2di lo = (lb_v2di)__builtin_ia32_punpckldq128((lb_v4si)__builtin_ia32_si_si256((vi)t),
                                                          (lb_v4si)__builtin_ia32_extract128i256(t, 1));
  memcpy(p, &lo, 8);
}
LB_INLINE vi lb_code_byte(vi c) { return c & 0xFF; }  // lb_st_u8x4's packs saturate: lanes hold 0..255
LB_INLINE vi lb_ld_u16(const uint16_t* p) {
  lb_v8hi h;
  memcpy(&h, p, sizeof h);
  return (vi)__builtin_ia32_pmovzxwd256(h);
}
LB_INLINE void lb_st_u16(uint16_t* p, vi x) {  // lanes hold 0..65535
  const lb_v4di t = __builtin_ia32_permdi256((lb_v4di)__builtin_ia32_packusdw256(x, x), 0xD8);
  const lb_v2di lo = {t[0], t[1]};
  memcpy(p, &lo, sizeof lo);
}
#define LB_HI16
LB_INLINE vi lb_ld_hi16(const uint16_t* p) {  // each u16 into the high half of its lane: one byte shuffle
  lb_v2di h;
  memcpy(&h, p, sizeof h);
  const lb_v4di both = {h[0], h[1], h[0], h[1]};
  const lb_v32qi pick = {-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                         -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15};
  return (vi)__builtin_ia32_pshufb256((lb_v32qi)both, pick);
}
LB_INLINE void lb_st_hi16(uint16_t* p, vi x) {  // the high halves of the lanes: a shuffle, no shift or pack
  const lb_v32qi pick = {2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                         2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1};
  const lb_v4di t = __builtin_ia32_permdi256((lb_v4di)__builtin_ia32_pshufb256((lb_v32qi)x, pick), 0x08);
  const lb_v2di lo = {t[0], t[1]};
  memcpy(p, &lo, sizeof lo);
}
LB_INLINE uint32_t lb_hits(vi m) { return (uint32_t)__builtin_ia32_movmskps256((vf)m); }  // lanes 0 or -1
LB_INLINE vi lb_cvt_rne(vf x) { return __builtin_ia32_cvtps2dq256(x); }
LB_INLINE vf lb_min_nn(vf a, vf b) { return __builtin_ia32_minps256(a, b); }
LB_INLINE vf lb_max_nn(vf a, vf b) { return __builtin_ia32_maxps256(a, b); }
#define LB_SIGN_OF
LB_INLINE vi lb_sign_of(vi c, vf y) { return __builtin_ia32_psignd256(c, lb_bits_i(y)); }  // y < 0 ? -c : c
LB_INLINE vf lb_perm8(const float* t, vi idx) {  // t[idx & 7], in registers (t: 8 constants)
  vf t8;
  memcpy(&t8, t, sizeof t8);
  return __builtin_ia32_permvarsf256(t8, idx);
}
#define LB_PACKED_U8X4
LB_INLINE void lb_st_u8x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors of 0..255: two packs, one store
  const lb_v32qi t = __builtin_ia32_packuswb256(__builtin_ia32_packusdw256(a, b), __builtin_ia32_packusdw256(c, d));
  const vi order = {0, 4, 1, 5, 2, 6, 3, 7};
  const vi out = __builtin_ia32_permvarsi256((vi)t, order);
  memcpy(p, &out, sizeof out);
}
#define LB_NIBBLES
LB_INLINE vi lb_ld_u8_wide(const uint8_t* p) {  // LB_W / 2 bytes, each zero-extended to a 64-bit lane
  lb_v4si b = {0, 0, 0, 0};
  memcpy(&b, p, 4);
  return (vi)__builtin_ia32_pmovzxbq256((lb_v16qi)b);
}
LB_INLINE void lb_st_nibbles_x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors of 4-bit codes, 16 bytes
  // codes -8..255 pack to 16 bits unchanged; their low nibbles then pack to bytes in element order (as
  // lb_st_u8x4's), and one multiply-add joins each pair: byte 2k + 16 * byte 2k + 1
  const lb_v16hi low = {15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
  const lb_v32qi t = __builtin_ia32_packuswb256(__builtin_ia32_packssdw256(a, b) & low,
                                                __builtin_ia32_packssdw256(c, d) & low);
  const vi order = {0, 4, 1, 5, 2, 6, 3, 7};
  const lb_v32qi e = (lb_v32qi)__builtin_ia32_permvarsi256((vi)t, order);
  const lb_v32qi weights = {1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16,
                            1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16, 1, 16};
  const lb_v4di pairs = (lb_v4di)__builtin_ia32_pmaddubsw256(e, weights);
  const lb_v16qi out = __builtin_ia32_packuswb128((lb_v8hi)__builtin_ia32_si_si256((vi)pairs),
                                                  (lb_v8hi)__builtin_ia32_extract128i256(pairs, 1));
  memcpy(p, &out, sizeof out);
}
#if defined(__F16C__)
#define LB_F16C
LB_INLINE vf lb_f16_bits_to_f32(vh h) { return __builtin_ia32_vcvtph2ps256((lb_v8hi)h); }
#endif
#else
LB_INLINE vi lb_ld_u8(const uint8_t* p) {
  vb b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
LB_INLINE vi lb_ld_s8(const uint8_t* p) {  // sign-extended
  vc b;
  memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi);
}
LB_INLINE void lb_st_u8(uint8_t* p, vi x) {
  vb b = __builtin_convertvector(x, vb);
  memcpy(p, &b, sizeof b);
}
LB_INLINE vi lb_code_byte(vi c) { return c; }  // the store keeps each lane's low byte
LB_INLINE vi lb_ld_u16(const uint16_t* p) {
  vh h;
  memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vi);
}
LB_INLINE void lb_st_u16(uint16_t* p, vi x) {
  vh h = __builtin_convertvector(x, vh);
  memcpy(p, &h, sizeof h);
}
LB_INLINE uint32_t lb_hits(vi m) {  // bit l: lane l set
  uint32_t hits = 0;
  for (int l = 0; l < LB_W; ++l) hits |= (uint32_t)(m[l] != 0) << l;
  return hits;
}
LB_INLINE vf lb_perm8(const float* t, vi idx) {  // t[idx & 7]
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = t[idx[l] & 7];
  return r;
}
LB_INLINE vi lb_cvt_rne(vf x) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = __builtin_rintf(x[l]);
  return __builtin_convertvector(r, vi);
}
LB_INLINE vf lb_min_nn(vf a, vf b) { return a < b ? a : b; }
LB_INLINE vf lb_max_nn(vf a, vf b) { return a > b ? a : b; }
#endif
#ifndef LB_F16C
LB_INLINE vf lb_f16_bits_to_f32(vh h) {  // per lane
  vf r;
  for (int l = 0; l < LB_W; ++l) {
    _Float16 x;
    memcpy(&x, (const uint16_t*)&h + l, 2);
    r[l] = (float)x;
  }
  return r;
}
#endif
#ifndef LB_LO16
LB_INLINE vh lb_lo16(vi x) { return __builtin_convertvector(x, vh); }  // each lane's low 16 bits
#endif
#ifndef LB_SIGN_OF
LB_INLINE vi lb_sign_of(vi c, vf y) { return y < 0 ? -c : c; }  // c carries y's sign (c >= 0; -0 gives 0)
#endif
#ifndef LB_CVT_SIGNED
LB_INLINE vi lb_cvt_signed(vf m, vf y) { return lb_sign_of(lb_cvt_rne(m), y); }  // rint(m) (m >= 0) with y's sign
#endif
#ifndef LB_HI16
LB_INLINE vi lb_ld_hi16(const uint16_t* p) { return lb_ld_u16(p) << 16; }  // each u16 into its lane's high half
LB_INLINE void lb_st_hi16(uint16_t* p, vi x) { lb_st_u16(p, (vi)((vu)x >> 16)); }  // the lanes' high halves
#endif
#ifndef LB_PACKED_U8X4
LB_INLINE void lb_st_u8x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors, one store each
  lb_st_u8(p, a);
  lb_st_u8(p + LB_W, b);
  lb_st_u8(p + 2 * LB_W, c);
  lb_st_u8(p + 3 * LB_W, d);
}
#endif
// 4-bit codes (formats/packing.py): two a byte, element 2k in the low nibble of byte k and 2k + 1 in the
// high one. A byte widened to a 64-bit lane is two 32-bit lanes, so one 64-bit shift moves a byte's high
// nibble into its element's lane (lb_ld_nibbles), and one moves the odd element's code back (lb_st_nibbles).
typedef int64_t lb_vq __attribute__((vector_size(4 * LB_W)));
typedef uint8_t lb_vb_half __attribute__((vector_size(LB_W / 2)));
#ifndef LB_NIBBLES
LB_INLINE vi lb_ld_u8_wide(const uint8_t* p) {  // LB_W / 2 bytes, each zero-extended to a 64-bit lane
  lb_vb_half b;
  memcpy(&b, p, sizeof b);
  return (vi)__builtin_convertvector(b, lb_vq);
}
#endif
template <bool S>
LB_INLINE vi lb_ld_nibbles(const uint8_t* p) {  // the codes at p one a lane, sign-extended (S) or not
  const lb_vq w = (lb_vq)lb_ld_u8_wide(p);
  const vi x = (vi)(w | (w << 28));  // each lane's code in its low 4 bits
  return S ? (x << 28) >> 28 : x & 0xF;
}
LB_INLINE void lb_st_nibbles(uint8_t* p, vi c) {  // a vector of codes (their low nibbles), LB_W / 2 bytes
  lb_vq w = (lb_vq)c & 0xF0000000FLL;
  w = (w | (w >> 28)) & 0xFF;
  const lb_vb_half b = __builtin_convertvector(w, lb_vb_half);
  memcpy(p, &b, sizeof b);
}
#ifndef LB_NIBBLES
LB_INLINE void lb_st_nibbles_x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors, one store each
  lb_st_nibbles(p, a);
  lb_st_nibbles(p + LB_W / 2, b);
  lb_st_nibbles(p + LB_W, c);
  lb_st_nibbles(p + 3 * LB_W / 2, d);
}
#endif

// bf16 <-> fp32. Rounding is c10's round_to_nearest_even, NaN -> 0x7FC0.
LB_INLINE vi lb_bf16_high(vf x) {  // x rounded, in the high 16 bits of each lane (the low 16: garbage)
  vu u = (vu)x;
  vu r = u + (((u >> 16) & 1u) + 0x7FFFu);
  return (x != x) ? lb_splat_i(0x7FC00000) : (vi)r;
}
LB_INLINE vi lb_f32_to_bf16_bits(vf x) { return (vi)((vu)lb_bf16_high(x) >> 16); }  // in the low 16 bits
LB_INLINE vf lb_round_bf16(vf x) { return lb_bits_f(lb_bf16_high(x) & (int32_t)0xFFFF0000); }
LB_INLINE vf lb_ld_bf16(const uint16_t* p) { return lb_bits_f(lb_ld_hi16(p)); }
LB_INLINE void lb_st_bf16(uint16_t* p, vf v) { lb_st_hi16(p, lb_bf16_high(v)); }
LB_INLINE void lb_st_bf16_exact(uint16_t* p, vf v) { lb_st_hi16(p, lb_bits_i(v)); }  // v is a bf16 value
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
LB_INLINE void lb_st_bf16_exact_n(uint16_t* p, vf v, int64_t r) {
  uint16_t t[LB_W];
  lb_st_bf16_exact(t, v);
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

// Random bits of stochastic rounding, with Chris Wellons' lowbias32 hash: the lossy residual's
// hash32(index ^ hash32(seed)) (residual.random_bits), a stochastically rounded state's 16-bit draws
// (lb_draws, rounding.state_draws).
static inline uint32_t lb_hash32_s(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
LB_INLINE vu lb_hash32_tail(vu x) {  // lowbias32 after its first x ^= x >> 16
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}
LB_INLINE vi lb_iota() {  // lane l holds l: a constant
  vi lane;
  for (int l = 0; l < LB_W; ++l) lane[l] = l;
  return lane;
}
LB_INLINE vi lb_lane_mask(int64_t r) { return lb_iota() < lb_splat_i((int32_t)r); }  // lanes [0, r) set
// The bits of the LB_W elements from `first` on. Where first is a multiple of LB_W (every lane vector of
// a block of at least LB_W elements) the lanes' hash inputs (first + l) ^ seed_hash are h ^ l, h that of
// lane 0, so hash32's first round, h ^ l ^ (h >> 16), is scalar work and one xor with the lane numbers.
LB_INLINE vu lb_random_bits(uint32_t seed_hash, int64_t first) {
  const uint32_t h = (uint32_t)first ^ seed_hash;
  vu x;
  if (__builtin_expect(((uint32_t)first & (LB_W - 1)) == 0, 1)) {
    x = (vu)lb_splat_i((int32_t)(h ^ (h >> 16))) ^ (vu)lb_iota();
  } else {
    x = (((vu){} + (uint32_t)first) + (vu)lb_iota()) ^ seed_hash;
    x ^= x >> 16;
  }
  return lb_hash32_tail(x);  // one copy, which the caller's use of the bits may merge into
}

// ---- element formats (kernels/formats.py) -----------------------------------------------------
// @formats@

// Template arguments by name: a state's sign (the U of lb_format<F, U>: unsigned codes for a
// non-negative state), and how a block's codes are encoded (lb_encode_at, lb_encode_block,
// lb_encode_pair, lb_quantize_scale: these flags or-ed together).
constexpr bool LB_SIGNED = false, LB_UNSIGNED = true;
enum lb_encoding : unsigned {
  LB_PLAIN = 0,  // to nearest, an unflagged block, the root taken here, no underflow lift
  LB_FLAGGED = 1,  // a block holding inf or NaN: finite values within flagged_qmax, special codes for the rest
  LB_LIFT = 2,  // a positive value whose product underflowed still gets a positive code
  LB_STOCHASTIC = 4,  // rounds stochastically (lb_rand)
  LB_ROOT = 8,  // a root-domain format encodes from the square roots the step took (a non-negative state's)
};
template <unsigned M>
struct lb_mode {
  static constexpr bool flagged = M & LB_FLAGGED, lift = M & LB_LIFT, sr = M & LB_STOCHASTIC, root = M & LB_ROOT;
};

LB_INLINE vi lb_key(vf x) { return lb_bits_i(x) & 0x7FFFFFFF; }  // |x| as ordered integer bits

// A code in a lane as lb_decode takes it: the signed codes of int8 and the root-domain formats (two's
// complement) sign-extended, so one widening load does what a shift pair would after it; every other
// format's code zero-extended. lb_lane turns a code as encodes return it (its lane's low byte:
// lb_code_byte) into that form.
template <int F, bool U>
constexpr bool lb_sign_extended = !U && (F == LB_INT8 || lb_root_domain<F>);
template <int F, bool U>
LB_INLINE vi lb_lane(vi byte) { return lb_sign_extended<F, U> ? (byte << 24) >> 24 : byte; }
// The codes of element i of a block from the block's first code byte: a 4-bit format's two a byte
// (lb_packed; i is even, as every block and lane vector starts on a byte).
template <int F, class T>
LB_INLINE T* lb_codes_at(T* p, int64_t i) { return p + (lb_packed<F> ? i / 2 : i); }
template <int F, bool U>
LB_INLINE vi lb_ld_codes(const uint8_t* p) {
  if constexpr (lb_packed<F>) return lb_ld_nibbles<lb_sign_extended<F, U>>(p);
  else return lb_sign_extended<F, U> ? lb_ld_s8(p) : lb_ld_u8(p);
}
template <int F, bool U>
LB_INLINE vi lb_ld_codes_n(const uint8_t* p, int64_t r) {  // the first r codes, zero after
  uint8_t t[LB_W] = {0};
  memcpy(t, p, lb_packed<F> ? (r + 1) / 2 : r);
  return lb_ld_codes<F, U>(t);
}
template <int F>
LB_INLINE void lb_st_codes(uint8_t* p, vi c) {  // each lane's low byte (a 4-bit format's low nibble)
  if constexpr (lb_packed<F>) lb_st_nibbles(p, c);
  else lb_st_u8(p, c);
}
template <int F>
LB_INLINE void lb_st_codes_n(uint8_t* p, vi c, int64_t r) {  // an odd count's last high nibble is 0
  uint8_t t[LB_W];
  lb_st_codes<F>(t, lb_packed<F> ? c & lb_lane_mask(r) : c);
  memcpy(p, t, lb_packed<F> ? (r + 1) / 2 : r);
}
template <int F>
LB_INLINE void lb_st_codes_x4(uint8_t* p, vi a, vi b, vi c, vi d) {  // four vectors of codes, in one store
  if constexpr (lb_packed<F>) lb_st_nibbles_x4(p, a, b, c, d);
  else lb_st_u8x4(p, a, b, c, d);
}

// An integer code of a non-negative state where y is positive: at least 1 (formats.encode's zero-point
// rule). y > 0 is y's bits > 0 as an integer (NaN aside, whose code a flagged block replaces): two
// integer min/max, no compare mask to merge under.
LB_INLINE vi lb_lift_positive(vi code, vf y) {
  const vi one = lb_splat_i(1), bits = lb_bits_i(y);
  const vi lift = bits < one ? bits : one;  // 1 where y > 0, else <= 0
  return code > lift ? code : lift;
}

// fp8 with M mantissa bits and 7 - M exponent bits: e4m3fn (M = 3: no infinities, all-ones is NaN)
// and e5m2 (M = 2: infinities and NaNs as in IEEE). Decoded through fp16, whose conversion is exact
// and one instruction with F16C (lb_f16_bits_to_f32; unlike arithmetic on subnormal fp32 bits, no DAZ
// mode flushes it), in 16-bit lanes (half the width to shift): e5m2 is fp16's high byte. e4m3's sign
// at fp16's and its magnitude under fp16's top exponent bit are the fp16 of the value / 256 (its
// subnormals fp16 subnormals), so lb_decode_fp8 gives that and the 256 goes into the block's scale
// (lb_unit); an all-ones magnitude carries into that exponent bit, which makes it fp16's NaN (of the
// bits torch's own e4m3 decode gives).
template <int M>
LB_INLINE vf lb_decode_fp8(vi u) {
  const vh w = lb_lo16(u);
  if constexpr (M == 2) return lb_f16_bits_to_f32(w << 8);
  typedef int16_t vhs __attribute__((vector_size(2 * LB_W)));
  const vh h = (vh)((vhs)(w << 8) >> 1);  // the sign in bits 15 and 14, the magnitude in 7-13
  return lb_f16_bits_to_f32(h ^ ((h + 0x80) & 0x4000));  // bit 14 cleared, or set for all-ones (NaN)
}
// fp8 codes of y in range (|y| at most a few ulps over qmax, which rounds to qmax), half to even as
// c10's fp8*_from_fp32_value (formats.encode): from 2^MIN_EXP up the fp32 bits rounded to M mantissa
// bits with the exponent rebiased, below it the multiple of the subnormal unit that the conversion
// rounds; the sign bit as is (-0 is 0x80). A positive value of a non-negative state is at least code 1.
template <int M, int MIN_EXP, bool U>
LB_INLINE vi lb_encode_fp8(vf y) {
  const int32_t bias = (1 << (6 - M)) - 1;  // 7 - M exponent bits: e4m3 7, e5m2 15
  const vi bits = lb_bits_i(y), a = bits & 0x7FFFFFFF;
  const vi normal = (a + ((((1 << (22 - M)) - 1) - ((127 - bias) << 23)) + ((a >> (23 - M)) & 1))) >> (23 - M);
  const vi sub = lb_cvt_rne(lb_bits_f(a) * lb_splat(__builtin_ldexpf(1.0f, M - MIN_EXP)));
  vi code = (a < ((127 + MIN_EXP) << 23) ? sub : normal) | ((vi)((vu)bits >> 24) & 0x80);
  return U ? lb_lift_positive(code, y) : code;
}

// dynamic8 (formats.dynamic_levels): code magnitude p of level L (p in [2^L, 2^(L+1))) is
// spacing * p + offset, exact in fp32. L is the exponent of (float)p and lb_dyn<U> keeps each
// level's fields at slot (127 + L) & 7, read by one in-register permute: no table in memory.
template <bool U>
LB_INLINE vf lb_decode_dynamic8(vi u) {
  const vi s = U ? u : u - 127;  // signed codes: 127 +- p
  const vi p = s < 0 ? -s : s;
  const vf pf = __builtin_convertvector(p, vf);
  const vi slot = lb_bits_i(pf) >> 23;
  const vf v = lb_fma(pf, lb_perm8(lb_dyn<U>::spacing, slot), lb_perm8(lb_dyn<U>::offset, slot));
  const vi bits = lb_bits_i(v) & (p != 0);  // p = 0 is zero
  return lb_bits_f(U ? bits : bits | (s & (int32_t)0x80000000));
}
// The level bounds by binade: they are about a decade (3.3 binades) apart, so a binade holds at most
// one, and the level of a value is the count of bounds in lower binades plus one compare with its own
// binade's bound. Index 0 is the lowest bound's binade (and every binade below it), 31 and up every
// binade above the highest bound's.
template <bool U>
struct lb_dyn_binades {
  int32_t first = 0;     // the biased exponent of index 0
  int32_t slot[32] = {};  // 127 + the count of bounds in lower binades (the encode's slot)
  float bound[32] = {};   // the binade's bound, or NaN (no value reaches it, inf included)
  bool ok = true;         // one bound per binade, all of them below index 31
  constexpr lb_dyn_binades() {
    using T = lb_dyn<U>;
    int32_t e[8] = {};
    for (int l = 1; l < T::levels; ++l) {  // the biased exponent of lower[l] (below 1)
      e[l] = 127;
      for (float p = 1.0f; p > T::lower[l]; p *= 0.5f) --e[l];
    }
    first = e[1];
    for (int i = 0; i < 32; ++i) {
      slot[i] = 127;
      bound[i] = LB_NAN;
      for (int l = 1; l < T::levels; ++l) {
        slot[i] += e[l] < first + i;
        if (e[l] == first + i) bound[i] = T::lower[l];
        ok = ok && (l == 1 || e[l] > e[l - 1]) && e[l] < first + 31;
      }
    }
  }
};
template <bool U>
constexpr lb_dyn_binades<U> lb_binades{};
static_assert(lb_binades<false>.ok && lb_binades<true>.ok, "dynamic8's level bounds share a binade");

// Encode to nearest (formats.encode: an exact tie to the larger magnitude): the level is the count
// of level bounds <= |y| (with 32-lane permutes, by binade: lb_dyn_binades); p = floor(|y| * recip +
// bias) is the bucket or the one below it (0 below level 0's bound, which is where zero ends), and
// one exact compare with the next bucket's lower edge settles it.
template <bool U>
LB_INLINE vi lb_encode_dynamic8(vf y) {
  using T = lb_dyn<U>;
  const vf a = U ? y : lb_abs(y);
#ifdef LB_PERM32
  vi i = (lb_bits_i(a) >> 23) - lb_binades<U>.first;  // a negative a (unsigned state) clamps to index 0
  i = i < 0 ? 0 : (i > 31 ? 31 : i);
  const vi base = lb_perm32_i(lb_binades<U>.slot, i);
  const vi slot = a >= lb_perm32(lb_binades<U>.bound, i) ? base + 1 : base;
#else
  vi slot = lb_splat_i(127);
  for (int l = 1; l < T::levels; ++l) slot = a >= lb_splat(T::lower[l]) ? slot + 1 : slot;
#endif
  vf p = lb_floor(lb_fma(a, lb_perm8(T::recip, slot), lb_perm8(T::bias, slot)));
  p = a >= lb_fma(p, lb_perm8(T::spacing, slot), lb_perm8(T::step, slot)) ? p + 1.0f : p;
  const vf last = lb_perm8(T::last, slot);
  p = lb_min_nn(p, last);
  vi code;
  if (U) {
    p = lb_max_nn(p, lb_splat(1.0f));  // a positive value never becomes 0
    code = __builtin_convertvector(p, vi) & (y > 0);
  } else {
    code = __builtin_convertvector(lb_bits_f(lb_bits_i(p) | (lb_bits_i(y) & (int32_t)0x80000000)), vi) + 127;
  }
  return code;
}

// lb_decode_units' unit: e4m3 decodes to the value / 256, which the block's scale times 256 undoes.
template <int F>
constexpr float lb_unit = F == LB_E4M3 ? 256.0f : 1.0f;
// Codes (one per lane, as lb_ld_codes widens them) -> values relative to the block scale, in lb_unit.
template <int F, bool U>
LB_INLINE vf lb_decode_units(vi u) {
  if constexpr (F == LB_INT8) return __builtin_convertvector(u, vf);
  else if constexpr (lb_root_domain<F>) {  // the code is the square root: c * |c|
    const vf c = __builtin_convertvector(u, vf);
    return c * (U ? c : lb_abs(c));
  }
  else if constexpr (F == LB_E4M3 || F == LB_E5M2) return lb_decode_fp8<lb_format<F, U>::mantissa>(u);
  else return lb_decode_dynamic8<U>(u);
}
// Codes -> values relative to the block scale.
template <int F, bool U>
LB_INLINE vf lb_decode(vi u) {
  if constexpr (lb_unit<F> == 1.0f) return lb_decode_units<F, U>(u);
  else return lb_decode_units<F, U>(u) * lb_unit<F>;
}

// The codes of values already in the format's range (lb_encode clamps first): int8's y in [-qmax,
// qmax] ([0, qmax] unsigned), a root-domain format's (sqrt8's, sqrt4's) magnitude r in [0, enc_qmax]
// with the sign of `sign`; rounded half to even. A block's values times its multiplier are (lb_encode_scaled): the
// largest magnitude comes within a few ulps of qmax, which rounds to qmax.
template <bool U>
LB_INLINE vi lb_encode_int8(vf y) {
  const vi q = lb_cvt_rne(y);
  return U ? lb_lift_positive(q, y) : lb_code_byte(q);
}
template <bool U>
LB_INLINE vi lb_encode_sqrt8(vf r, vf sign) {
  return U ? lb_lift_positive(lb_cvt_rne(r), r) : lb_code_byte(lb_cvt_signed(r, sign));
}
// sqrt4's (builtin._encode_sqrt4): the root whose value is nearest r * r, not the nearest root: of c =
// floor(r) and c + 1, c + 1 where 2 r^2 > c^2 + (c + 1)^2 (one fp32 square), i.e. where d = r^2 - c (c + 1),
// exact in one fma, is over 1/2; a tie to the even root: an odd c compares d with the float below 1/2 (no
// d lies between the two). A positive root lifts code 0 to 1.
template <bool U>
LB_INLINE vi lb_encode_sqrt4(vf r, vf sign) {
  const vf c = lb_floor(r), d = lb_fma(-c, c + 1.0f, r * r);
  const vi low = __builtin_convertvector(c, vi);
  const vi m = low - (vi)(d > lb_bits_f(lb_splat_i(0x3F000000) - (low & 1)));  // a true compare is -1: up
  return U ? lb_lift_positive(m, r) : lb_code_byte(lb_sign_of(m, sign));
}
// The nearest code of a root-domain format (the root r in [0, enc_qmax], the sign of `sign`).
template <int F, bool U>
LB_INLINE vi lb_encode_root(vf r, vf sign) {
  if constexpr (F == LB_SQRT4) return lb_encode_sqrt4<U>(r, sign);
  else return lb_encode_sqrt8<U>(r, sign);
}

// Normalized values (formats.normalize: times qmax/absmax; sqrt8's and sqrt4's in the root domain) ->
// codes; a positive value of a non-negative state never becomes code 0 (formats.encode). Never NaN: only a
// flagged block holds NaN, and lb_encode_scaled gives it (and +-inf) the block's special codes after
// encoding.
template <int F, bool U>
LB_INLINE vi lb_encode(vf y) {
  if constexpr (F == LB_INT8) {
    const float qmax = lb_format<F, U>::qmax;
    return lb_encode_int8<U>(lb_min_nn(lb_max_nn(y, lb_splat(U ? 0.0f : -qmax)), lb_splat(qmax)));
  } else if constexpr (lb_root_domain<F>) {  // NaN: a non-negative state's 0 (max returns its second operand)
    const vf r = U ? lb_max_nn(y, lb_splat(0.0f)) : lb_abs(y);
    return lb_encode_root<F, U>(lb_min_nn(r, lb_splat(lb_format<F, U>::enc_qmax)), y);
  } else if constexpr (F == LB_DYNAMIC8) {
    return lb_encode_dynamic8<U>(y);
  } else {
    const float qmax = lb_format<F, U>::qmax;
    return lb_encode_fp8<lb_format<F, U>::mantissa, lb_format<F, U>::min_exponent, U>(
        lb_min_nn(lb_max_nn(y, lb_splat(-qmax)), lb_splat(qmax)));
  }
}

// Stochastic rounding of 8-bit codes (formats.round_stochastic, triton_lib.round_stochastic): of the two
// codes around y (the value clamped into the format's range), the one of larger magnitude (outer, value
// w_out) replaces the one nearer zero (inner, value w_in) where t * |w_out - w_in| < |y - w_in| (one fp32
// product, both distances exact), t = (u + 0.5) / 2^16 the element's threshold (lb_thresholds_x4); a
// positive value of a non-negative state never becomes code 0. Where y is a code's value |y - w_in| is 0
// or the whole gap and it keeps that code; a non-finite value gets its special code after
// (lb_encode_scaled: only a flagged block holds one).
// The code magnitude c + 1 (outer) or c (inner) of the integral c, from a comparison of two non-negative
// floats as integers (their bit patterns order as they do), then a truncating conversion: no compare
// mask to blend under.
LB_INLINE vi lb_step_up(vf c, vf below, vf above) {
  return __builtin_convertvector(c, vi) - (lb_bits_i(below) < lb_bits_i(above));
}
// int8 (y already normalized): on the magnitude, the inner code floor(|y|), 1 below the outer, and the
// distance |y| - floor(|y|), all exact; the sign put back on the code.
template <bool U>
LB_INLINE vi lb_stochastic_int8(vf y, vf t) {
  typedef lb_format<LB_INT8, U> f;
  const vf yc = lb_clamp(y, U ? 0.0f : -f::qmax, f::qmax), a = U ? yc : lb_abs(yc), c = lb_floor(a);
  const vi m = lb_step_up(c, t, a - c);
  if (U) return lb_lift_positive(m, y);
  return lb_code_byte(lb_sign_of(m, yc));
}
// sqrt8 and sqrt4 from the root-domain magnitude r (the nearest encode's input) and the sign of `sign`:
// the value y = a * a of the clamped root a, the inner code c = floor(a), y - c * c in one fma (c * c is exact)
// and the outer code's value 2c + 1 above c * c: all exact, nothing decoded. A positive root lifts a code 0
// to 1 (a root below 2^-75 squares to 0).
template <int F, bool U>
LB_INLINE vi lb_stochastic_sqrt8(vf r, vf sign, vf t) {
  const vf a = lb_min_nn(r, lb_splat(lb_format<F, U>::enc_qmax)), c = lb_floor(a), y = a * a;
  const vf d = lb_fma(-c, c, y), gap = lb_fma(c, lb_splat(2.0f), lb_splat(1.0f));
  const vi m = lb_step_up(c, t * gap, d);
  return U ? lb_lift_positive(m, a) : lb_code_byte(lb_sign_of(m, sign));  // a, not y: a * a may underflow
}
// fp8 on the magnitude, nothing decoded: the codes around |y| are the multiples c and c + 1 of its
// binade's unit 2^(max(e, MIN_EXP) - M) (the outer one at the binade's top is the next binade's first
// value), |y| over the unit exact, and the rounded magnitude (a code's value, exact) with y's sign
// encoded to nearest. A positive value of a non-negative state is at least code 1 (lb_encode_fp8's lift
// from x, the value before rounding).
template <int F, bool U>
LB_INLINE vi lb_stochastic_fp8(vf x, vf t) {
  typedef lb_format<F, U> f;
  constexpr int M = f::mantissa, MIN_EXP = f::min_exponent;
  const vf y = lb_clamp(x, -f::qmax, f::qmax);
  const vi a = lb_bits_i(y) & 0x7FFFFFFF, sign = lb_bits_i(y) & (int32_t)0x80000000;
  vi e = a >> 23;
  e = e > 127 + MIN_EXP ? e : lb_splat_i(127 + MIN_EXP);
  const vf s = lb_bits_f(a) * lb_bits_f((254 + M - e) << 23), c = lb_floor(s);  // |y| / unit, exact
  const vf m = (t < s - c ? c + 1.0f : c) * lb_bits_f((e - M) << 23);
  const vi code = lb_encode_fp8<M, MIN_EXP, false>(lb_bits_f(lb_bits_i(m) | sign));
  return U ? lb_lift_positive(code, x) : code;
}
// dynamic8, from the nearest code: the other code around y is code +- 1 (the map is monotone in the
// code), both codes decoded. (fp8 took this path before lb_stochastic_fp8: the same codes.)
template <int F, bool U>
LB_INLINE vi lb_round_stochastic(vf x, vi code, vf t) {
  typedef lb_format<F, U> f;
  constexpr bool fp8 = F == LB_E4M3 || F == LB_E5M2;
  const vf y = lb_clamp(x, U && !fp8 ? 0.0f : -f::qmax, f::qmax);
  const vf v = lb_decode<F, U>(lb_lane<F, U>(code));
  const vi away = fp8 ? (vi)(lb_abs(y) > lb_abs(v)) : (vi)(y > v);
  const vi other = (code + (away ? lb_splat_i(1) : lb_splat_i(-1))) & 0xFF;
  const vf w = lb_decode<F, U>(lb_lane<F, U>(other));
  // the other code is the inner one (where y is a code's value either answer keeps the code)
  const vi inward = fp8 ? ~away : away ^ (vi)(y >= 0);
  const vi outer = t * lb_abs(w - v) < lb_abs(y - (inward ? w : v));
  vi out = inward ? (outer ? code : other) : (outer ? other : code);
  if (U) out = (x > 0) & (out == 0) ? lb_splat_i(1) : out;
  return out;
}
// bf16 bits of x (already clamped as the nearest encode clamps it) rounded stochastically: the 16-bit
// draws added to the fp32 pattern, truncated; NaN rounds to nearest.
LB_INLINE vi lb_bf16_bits_stochastic(vf x, vu draws) {
  const vi up = (vi)(((vu)lb_bits_i(x) + draws) >> 16);
  return x != x ? lb_f32_to_bf16_bits(x) : up;
}
// What a block's stochastic rounding draws from: the state's key (hash32 of its seed) and the index
// of the block's first element.
struct lb_rand {
  uint32_t key;
  int64_t first;
};
// The 16-bit draws (rounding.state_draws): element i draws the low half of hash32((i / 2) ^ key) where i
// is even, the high half where it is odd, so one hash serves two elements.
static inline uint32_t lb_draw_s(uint32_t key, int64_t i) {
  return (lb_hash32_s((uint32_t)(i >> 1) ^ key) >> ((i & 1) << 4)) & 0xFFFFu;
}
// The draws of the LB_W elements from index `first` on (a bf16 state's lane vector), each lane its own
// hash: lane l is element first + l, word (first + l) / 2.
LB_INLINE vu lb_draws(uint32_t key, int64_t first) {
  const vi l = lb_splat_i((int32_t)(first & 1)) + lb_iota();
  const vu word = ((vu){} + (uint32_t)(first >> 1)) + (vu)(l >> 1);
  const vu x = word ^ key;
  return (lb_hash32_tail(x ^ (x >> 16)) >> (vu)((l & 1) << 4)) & 0xFFFFu;
}
// t = (u + 0.5) / 2^16 of 16-bit draws u, exact in one fma (rounding.threshold).
LB_INLINE vf lb_threshold(vi u) { return lb_fma(__builtin_convertvector(u, vf), lb_splat(0x1p-16f), lb_splat(0x1p-17f)); }
// The thresholds of the LB_W elements from rnd.first + j on, a hash per element (tails, odd starts).
template <bool SR>
LB_INLINE vf lb_thresholds_at(lb_rand rnd, int64_t j) {
  if constexpr (SR) return lb_threshold((vi)lb_draws(rnd.key, rnd.first + j));
  else return vf{};
}
// The thresholds of the four lane vectors from an even index rnd.first + j, from two vectors of LB_W
// hashes (one per two elements): each 128-bit lane of a hash vector holds two words of the first half
// and two of the second, so interleaving the lanes' low (high) 16-bit halves with zeros gives the first
// (second) LB_W elements' draws in order.
struct lb_vf4 {
  vf v[4];
};
#if LB_W == 16
typedef uint16_t lb_vh2 __attribute__((vector_size(4 * LB_W)));
#define LB_WORD_ORDER 0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15
#define LB_LOW_HALVES 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43, \
                      16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59
#define LB_HIGH_HALVES 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47, \
                       20, 52, 21, 53, 22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63
#elif LB_W == 8
typedef uint16_t lb_vh2 __attribute__((vector_size(4 * LB_W)));
#define LB_WORD_ORDER 0, 1, 4, 5, 2, 3, 6, 7
#define LB_LOW_HALVES 0, 16, 1, 17, 2, 18, 3, 19, 8, 24, 9, 25, 10, 26, 11, 27
#define LB_HIGH_HALVES 4, 20, 5, 21, 6, 22, 7, 23, 12, 28, 13, 29, 14, 30, 15, 31
#else
#error "LB_W must be 8 or 16"
#endif
template <bool SR>
LB_INLINE lb_vf4 lb_thresholds_x4(lb_rand rnd, int64_t j) {
  if constexpr (!SR) return {};
  else {
    const int64_t first = rnd.first + j;
    if (__builtin_expect(first & 1, 0))  // blocks of one element
      return {{lb_thresholds_at<SR>(rnd, j), lb_thresholds_at<SR>(rnd, j + LB_W),
               lb_thresholds_at<SR>(rnd, j + 2 * LB_W), lb_thresholds_at<SR>(rnd, j + 3 * LB_W)}};
    const vu order = {LB_WORD_ORDER}, base = (vu){} + (uint32_t)(first >> 1);
    const lb_vh2 zero = {};
    lb_vf4 t;
    for (int h = 0; h < 2; ++h) {
      vu x = (base + (uint32_t)(h * LB_W) + order) ^ rnd.key;
      const lb_vh2 halves = (lb_vh2)lb_hash32_tail(x ^ (x >> 16));
      t.v[2 * h] = lb_threshold((vi)__builtin_shufflevector(halves, zero, LB_LOW_HALVES));
      t.v[2 * h + 1] = lb_threshold((vi)__builtin_shufflevector(halves, zero, LB_HIGH_HALVES));
    }
    return t;
  }
}

// bf16 storage (states and patches; formats.encode, round_bf16): a finite value saturates at bf16's
// largest instead of rounding to inf, and a positive value of a non-negative state stays positive.
static const float LB_BF16_TOP = 0x1.fep+127f;
template <bool U>
LB_INLINE vf lb_bf16_state_clamp(vf x) {
  const float min_positive = lb_format<LB_BF16_CODES, U>::min_positive;  // the smallest positive bf16
  const vf a = lb_abs(x);
  x = (a > LB_BF16_TOP) & (a < lb_splat(LB_INF)) ? lb_bits_f((lb_bits_i(x) & (int32_t)0x80000000) |
                                                                lb_bits_i(lb_splat(LB_BF16_TOP))) : x;
  return U ? ((x > 0) & (x < min_positive) ? lb_splat(min_positive) : x) : x;
}
template <bool U, bool SR>
static inline uint16_t lb_patch_bits(float x, lb_rand rnd, int64_t index) {  // as lb_bf16_state_clamp then round
  const float a = __builtin_fabsf(x);
  if (a > LB_BF16_TOP && a < LB_INF) x = __builtin_copysignf(LB_BF16_TOP, x);
  if (U && x > 0 && x < lb_format<LB_BF16_CODES, U>::min_positive) x = lb_format<LB_BF16_CODES, U>::min_positive;
  if constexpr (SR) return (uint16_t)lb_bf16_bits_stochastic(lb_splat(x), (vu){} + lb_draw_s(rnd.key, rnd.first + index))[0];
  return lb_bf16_bits(x);
}

// Codes of a block whose scale is `scale` (its magnitude, splat) back to values (blockquant.decode_scaled):
// in a flagged block (the scale's sign bit set: `flagged`, a per-block constant, so the branch is free)
// the format's three special codes are +inf, -inf and NaN, and a non-finite decode is not scaled
// (lb_decode_flagged: d in lb_unit, the scale times it).
template <int F, bool U>
__attribute__((noinline)) static vf lb_decode_flagged(vi u, vf d, vf scale) {
  typedef lb_format<F, U> f;
  const vi byte = u & 0xFF;
  vf v = lb_key(d) < 0x7F800000 ? d * scale : d;
  v = byte == f::pos_inf_code ? lb_splat(LB_INF) : v;
  v = byte == f::neg_inf_code ? lb_splat(-LB_INF) : v;
  return byte == f::nan_code ? lb_nan() : v;
}
template <int F, bool U>
LB_INLINE vf lb_decode_scaled(vi u, vf scale, bool flagged) {
  const vf d = lb_decode_units<F, U>(u);
  // Exact, and the same product as the value times the scale: a block's scale is at most FLT_MAX / qmax
  // (blockquant), so times lb_unit it neither overflows nor rounds; a loop invariant, out of the loop.
  const vf s = lb_unit<F> == 1.0f ? scale : scale * lb_unit<F>;
  if (__builtin_expect(!flagged, 1)) return d * s;
  // fp8 decodes the codes' 16-bit form, which the flagged path widens again: no second, 32-bit load
  // of the codes stays in the loop for it
  if constexpr (F == LB_E4M3 || F == LB_E5M2)
    return lb_decode_flagged<F, U>(__builtin_convertvector(lb_lo16(u), vi), d, s);
  else return lb_decode_flagged<F, U>(u, d, s);
}

// ---- block quantization with outlier patches (blockquant.quantize_into) -------------------------
// Magnitudes compare as the integer bits of |x| (NaN above inf, like argmax); -1 marks no element.
// The update loop keeps, per lane, the largest key it wrote to a state's block buffer.
LB_INLINE vi lb_key_masked(vf x, int64_t r) {
  return r == LB_W ? lb_key(x) : (lb_key(x) & lb_lane_mask(r)) | ~lb_lane_mask(r);
}
LB_INLINE vi lb_vmax(vi a, vi b) { return a > b ? a : b; }
LB_INLINE int32_t lb_hmax(vi x) {  // the largest lane: the halves folded onto each other, log2(LB_W) steps
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 12) || (LB_W != 8 && LB_W != 16)
  for (int l = 1; l < LB_W; ++l) x[0] = x[l] > x[0] ? x[l] : x[0];  // (no __builtin_shufflevector)
#elif LB_W == 16
  x = lb_vmax(x, __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  x = lb_vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  x = lb_vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = lb_vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
  x = lb_vmax(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
  x = lb_vmax(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
  x = lb_vmax(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
  return x[0];
}

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

// The lanes of buf[v, min(v + LB_W, end)) whose key reaches the bound, as bits.
LB_INLINE uint32_t lb_hits_at(const float* buf, int64_t v, int64_t end, vi bound) {
  const int64_t w = end - v < LB_W ? end - v : LB_W;
  const uint32_t hits = lb_hits(lb_key(w == LB_W ? lb_ld(buf + v) : lb_ld_n(buf + v, w)) >= bound);
  return w == LB_W ? hits : hits & (uint32_t)((1u << w) - 1);
}
// Offer best every element of buf[0, len) whose key reaches `bound`, in offset order. The hits are a
// handful per block: one pass marks the vectors holding any (a bit each, no branch per vector, 64
// vectors a word), then only those are read again.
template <int K>
static void lb_collect(lb_best<K>& best, const float* buf, int64_t len, int32_t bound) {
  const vi thr = lb_splat_i(bound);
  for (int64_t first = 0; first < len; first += 64 * LB_W) {
    const int64_t end = len - first < 64 * LB_W ? len : first + 64 * LB_W;
    uint64_t marked = 0;
    for (int64_t v = first; v < end; v += LB_W)
      marked |= (uint64_t)(lb_hits_at(buf, v, end, thr) != 0) << ((v - first) / LB_W);
    for (; marked; marked &= marked - 1) {
      const int64_t v = first + __builtin_ctzll(marked) * LB_W;
      for (uint32_t hits = lb_hits_at(buf, v, end, thr); hits; hits &= hits - 1) {
        const int64_t j = v + __builtin_ctz(hits);
        int32_t key;
        memcpy(&key, buf + j, 4);
        key &= 0x7FFFFFFF;
        if (key > best.floor()) best.add(key, (int32_t)j, buf[j]);
      }
    }
  }
}

// ---- block scales (blockquant._scale_and_inverse, _block_scale) ----------------------------------
// absmax / qmax and the multiplier (1 / absmax) * qmax, fixed as the reference fixes them: a nonzero
// block below qmax * 2^-126 gets the scale 2^-126 and the exact multiplier 2^126; a scale that is inf
// (qmax < 1) multiplies by 1 / FLT_MAX; a scale whose largest code would decode to inf loses one ulp.
static inline void lb_scale_and_inverse(float absmax, float qmax, float* scale, float* inverse) {
  float s = absmax / qmax, inv = absmax > 0 ? (1.0f / absmax) * qmax : 0.0f;
  if (absmax > 0 && s < 0x1p-126f) s = 0x1p-126f, inv = 0x1p126f;
  if (__builtin_isinf(s)) inv = (float)(1.0 / 0x1.fffffep+127);
  if (__builtin_isinf(s * qmax)) s = __builtin_nextafterf(s, 0.0f);
  *scale = s;
  *inverse = inv;
}
// The scale of a block of finite values buf[0, len) whose largest magnitude is absmax: over qmax, or,
// for a format whose bottom code is smaller than its top (signed dynamic8), from whichever side needs
// the larger scale (positive over qmax, negative over neg_qmax; a tie is positive): one more pass.
template <int F, bool U>
static inline void lb_block_scale(const float* buf, int64_t len, float absmax, float* scale, float* inverse) {
  typedef lb_format<F, U> f;
  if constexpr (f::neg_qmax == f::qmax) {
    lb_scale_and_inverse(absmax, f::qmax, scale, inverse);
  } else {
    vi pos = lb_splat_i(0), neg = lb_splat_i(0);  // the largest key of each sign (bits ^ sign orders negatives)
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const vi b = lb_bits_i(lb_ld(buf + i));
      pos = lb_vmax(pos, b);
      neg = lb_vmax(neg, b ^ (int32_t)0x80000000);
    }
    if (i < len) {
      const vi b = lb_bits_i(lb_ld_n(buf + i, len - i));  // zero-padded: +0 joins the positive side
      pos = lb_vmax(pos, b);
      neg = lb_vmax(neg, b ^ (int32_t)0x80000000);
    }
    const int32_t p = lb_hmax(pos), n = lb_hmax(neg);  // both start at 0: at least 0
    float pmax, nmax, sp, ip, sn, in;
    memcpy(&pmax, &p, 4);
    memcpy(&nmax, &n, 4);
    lb_scale_and_inverse(pmax, f::qmax, &sp, &ip);
    lb_scale_and_inverse(nmax, f::neg_qmax, &sn, &in);
    *scale = sn > sp ? sn : sp;
    *inverse = sn > sp ? in : ip;
  }
}

// Values x -> codes (blockquant.quantize_into) under the block's multiplier (sqrt8, sqrt4: its square
// root). They encode from the root domain (formats.normalize): `root` is sqrt(x) of a non-negative state
// when the step has it already (LB_ROOT), else taken here. With LB_LIFT (a non-negative state whose
// multiplier is below 1) a positive value whose product underflowed still gets a positive code (a
// root times a multiplier's root never underflows); in a flagged block finite values stay within
// flagged_qmax and +inf, -inf and NaN take the format's special codes. M: lb_encoding flags.
template <int F, bool U, unsigned M>
LB_INLINE vi lb_encode_scaled(vf x, vf root, vf inverse, vf t) {
  typedef lb_format<F, U> f;
  constexpr bool FLAGGED = lb_mode<M>::flagged, LIFT = lb_mode<M>::lift, SR = lb_mode<M>::sr, ROOT = lb_mode<M>::root;
  vi code;
  if constexpr (lb_root_domain<F>) {
    vf r = (ROOT ? root : lb_sqrt(U ? x : lb_abs(x))) * inverse;
    if (FLAGGED) r = lb_min_nn(U ? lb_max_nn(r, lb_splat(0.0f)) : r, lb_splat(f::enc_flagged_qmax));  // NaN: 0
    code = SR ? lb_stochastic_sqrt8<F, U>(r, x, t) : lb_encode_root<F, U>(r, x);  // in range (lb_encode_sqrt8)
  } else {
    vf y = x * inverse;
    if (LIFT) y = (x > 0) & (y < 0x1p-149f) ? lb_splat(0x1p-149f) : y;
    if (FLAGGED) y = lb_clamp(y, -f::flagged_qmax, f::flagged_qmax);
    if constexpr (F == LB_INT8) code = SR ? lb_stochastic_int8<U>(y, t) : lb_encode_int8<U>(y);  // in range
    else if constexpr ((F == LB_E4M3 || F == LB_E5M2) && SR) code = lb_stochastic_fp8<F, U>(y, t);
    else if constexpr (F == LB_E4M3 || F == LB_E5M2)
      code = lb_encode_fp8<lb_format<F, U>::mantissa, lb_format<F, U>::min_exponent, U>(y);
    else code = lb_encode<F, U>(y);
    if (SR && F == LB_DYNAMIC8) code = lb_round_stochastic<F, U>(y, code, t);
  }
  if (!FLAGGED) return code;
  const vi special = x != x ? lb_splat_i(f::nan_code) : (x > 0 ? lb_splat_i(f::pos_inf_code) : lb_splat_i(f::neg_inf_code));
  return lb_key(x) < 0x7F800000 ? code : special;
}
// The codes of the whole lane vector at buf + j, from the thresholds t (LB_STOCHASTIC); with LB_ROOT,
// root holds the square roots of buf (lb_encode_scaled), and only a flagged block reads buf.
template <int F, bool U, unsigned M>
LB_INLINE vi lb_encode_at(const float* buf, const float* root, int64_t j, vf vinv, vf t) {
  typedef lb_mode<M> m;
  constexpr bool reads_x = !m::root || m::flagged;
  const vf x = reads_x ? lb_ld(buf + j) : vf{}, r = m::root ? lb_ld(root + j) : vf{};
  return lb_encode_scaled<F, U, M>(x, r, vinv, t);
}
// The codes of the four lane vectors at buf + j, in one store (lb_encode_at); with LB_STOCHASTIC their
// draws are those of the elements from rnd.first + j (rnd: the block's key and first element's index).
template <int F, bool U, unsigned M>
LB_INLINE void lb_encode_x4(const float* buf, const float* root, int64_t j, vf vinv, lb_rand rnd, uint8_t* codes) {
  const lb_vf4 t = lb_thresholds_x4<lb_mode<M>::sr>(rnd, j);
  const auto at = [&](int k) LB_INLINE_LAMBDA { return lb_encode_at<F, U, M>(buf, root, j + k * LB_W, vinv, t.v[k]); };
  lb_st_codes_x4<F>(lb_codes_at<F>(codes, j), at(0), at(1), at(2), at(3));
}
// The codes of buf[0, len) (lb_encode_at), rounding stochastically with the draws of rnd (LB_STOCHASTIC).
template <int F, bool U, unsigned M>
static inline void lb_encode_loop(const float* buf, const float* root, int64_t len, float inverse, uint8_t* codes,
                                  lb_rand rnd) {
  typedef lb_mode<M> m;
  const vf vinv = lb_splat(inverse);
  int64_t i = 0;
  if constexpr (!m::flagged)  // a flagged block (inf or NaN in it) is rare: not unrolled, less to compile
    for (; i + 4 * LB_W <= len; i += 4 * LB_W) lb_encode_x4<F, U, M>(buf, root, i, vinv, rnd, codes);
  for (; i + LB_W <= len; i += LB_W)
    lb_st_codes<F>(lb_codes_at<F>(codes, i), lb_encode_at<F, U, M>(buf, root, i, vinv, lb_thresholds_at<m::sr>(rnd, i)));
  if (i < len) {
    const vf x = lb_ld_n(buf + i, len - i), r = m::root ? lb_ld_n(root + i, len - i) : vf{};
    lb_st_codes_n<F>(lb_codes_at<F>(codes, i), lb_encode_scaled<F, U, M>(x, r, vinv, lb_thresholds_at<m::sr>(rnd, i)), len - i);
  }
}
// The multiplier a block's encode applies: the inverse of its scale (root domain: the inverse's square root,
// formats.normalize's root domain).
template <int F>
LB_INLINE float lb_multiplier(float inverse) { return lb_root_domain<F> ? __builtin_sqrtf(inverse) : inverse; }
// A multiplier >= 1 keeps every positive value positive (the product is at least the value), so the
// usual block of a non-negative state skips the underflow test (LB_LIFT).
template <int F, bool U>
LB_INLINE bool lb_lifts(float mult) { return !lb_root_domain<F> && U && !(mult >= 1.0f); }
// Whether the next block's lane loop may write a quantized block's codes, a vector per iteration
// (lb_encode_at, no underflow lift): lb_quantize_scale left them to encode and no lift is needed.
// M: LB_ROOT where the state encodes from the step's roots.
template <int F, bool U, unsigned M>
LB_INLINE bool lb_fusable(bool enc, float mult) { return enc && (lb_mode<M>::root || !lb_lifts<F, U>(mult)); }
// The codes of buf[0, len) under the multiplier `mult` (lb_multiplier); the root domain encodes from the step's
// roots where it gives them. M: LB_FLAGGED, LB_STOCHASTIC or neither (this picks LB_ROOT and LB_LIFT).
template <int F, bool U, unsigned M>
static inline void lb_encode_block(const float* buf, const float* root, int64_t len, float mult, uint8_t* codes,
                                   lb_rand rnd) {
  if (lb_root_domain<F> && U && root) lb_encode_loop<F, U, M | LB_ROOT>(buf, root, len, mult, codes, rnd);
  else if (lb_lifts<F, U>(mult)) lb_encode_loop<F, U, M | LB_LIFT>(buf, nullptr, len, mult, codes, rnd);
  else lb_encode_loop<F, U, M>(buf, nullptr, len, mult, codes, rnd);
}

// A block holding inf or NaN (rare: off the hot path, scalar): patches are the K largest finite
// magnitudes (a non-finite value ranks below every finite one, so it is patched only where fewer than K
// are finite), and if a non-finite value remains the block is flagged: scale from the finite rest over
// flagged_qmax, stored with its sign bit set, non-finite values as special codes. M: LB_STOCHASTIC or not.
template <int F, bool U, int K, unsigned M>
__attribute__((noinline)) static void lb_quantize_nonfinite(float* buf, float* root, int64_t len, int64_t block,
                                                           uint8_t* codes, float* scale, uint16_t* patch_values,
                                                           int16_t* patch_index, lb_rand rnd) {
  if (K > 0) {
    lb_best<K> best;  // keys shifted by one: finite values 1.., non-finite 0
    for (int64_t i = 0; i < len; ++i) {
      int32_t key;
      memcpy(&key, buf + i, 4);
      key &= 0x7FFFFFFF;
      key = key < 0x7F800000 ? key + 1 : 0;
      if (key > best.floor()) best.add(key, (int32_t)i, buf[i]);
    }
    for (int64_t pad = len; pad < block && best.floor() < 1; ++pad) best.add(1, (int32_t)pad, 0.0f);  // padding zeros
    for (int k = 0; k < K; ++k) {
      patch_values[k] = lb_patch_bits<U, lb_mode<M>::sr>(best.e[k].value, rnd, best.e[k].index);
      patch_index[k] = (int16_t)best.e[k].index;
      if (best.e[k].index < len) buf[best.e[k].index] = 0.0f;
      if (root && best.e[k].index < len) root[best.e[k].index] = 0.0f;
    }
  }
  int32_t top = 0;
  bool flagged = false;
  for (int64_t i = 0; i < len; ++i) {
    int32_t key;
    memcpy(&key, buf + i, 4);
    key &= 0x7FFFFFFF;
    if (key >= 0x7F800000) flagged = true;
    else if (key > top) top = key;
  }
  float absmax, s, inv;
  memcpy(&absmax, &top, 4);
  if (flagged) {
    lb_scale_and_inverse(absmax, lb_format<F, U>::flagged_qmax, &s, &inv);
    *scale = -s;  // the sign bit flags the block (-0.0 included)
    lb_encode_block<F, U, M | LB_FLAGGED>(buf, root, len, lb_multiplier<F>(inv), codes, rnd);
  } else {
    lb_block_scale<F, U>(buf, len, absmax, &s, &inv);
    *scale = s;
    lb_encode_block<F, U, M>(buf, root, len, lb_multiplier<F>(inv), codes, rnd);
  }
}

// Quantize the block held in buf[0, len) (a block of `block` elements, zero-padded past len): its
// scale and K patches, and true with the multiplier its codes are then encoded with (lb_encode_block,
// or lb_encode_pair for two states at once); a block holding inf or NaN (`lane_max`, each lane's
// largest key in buf, says which) is quantized whole here (lb_quantize_nonfinite): false. The K
// patches are the K largest |x| (ties: lowest offset) in the order the reference's repeated argmax
// finds them; the scale comes from the rest (lb_block_scale). With M = LB_STOCHASTIC the patches round
// stochastically, drawing from rnd (the codes draw when they are encoded: lb_encode_block, lb_encode_x4).
// A non-negative root-domain state may give `root`, buf's square roots as the step took them (lb_encode_scaled).
template <int F, bool U, int K, unsigned M = LB_PLAIN>
static bool lb_quantize_scale(vi lane_max, float* buf, int64_t len, int64_t block, uint8_t* codes, float* scale,
                              uint16_t* patch_values, int16_t* patch_index, float* mult, lb_rand rnd = {},
                              float* root = nullptr) {
  // Bound: the (K+1)-th largest lane maximum. K+1 lanes hold an element at least this large, so
  // the K+1 largest elements all reach it, and one pass collects them exactly. With K+1 > LB_W lanes
  // there is no such bound: every element is offered (-1).
  const int32_t top = lb_hmax(lane_max);
  if (__builtin_expect(top >= 0x7F800000, 0)) {
    lb_quantize_nonfinite<F, U, K, M>(buf, root, len, block, codes, scale, patch_values, patch_index, rnd);
    return false;
  }
  int32_t rest = top > 0 ? top : 0;  // no patches: the absmax is the largest lane maximum
  if (K > 0) {
    int32_t bound = K < LB_W ? top : -1;
    vi lm = lane_max;
    for (int j = 1; j <= K && K < LB_W; ++j) {  // set aside one lane holding the j-th largest, take the next
      lm[__builtin_ctz(lb_hits(lm == lb_splat_i(bound)))] = INT32_MIN;
      bound = lb_hmax(lm);
    }
    lb_best<K> best;
    lb_collect(best, buf, len, bound);
    for (int64_t pad = len; pad < block && best.n <= K; ++pad) best.add(0, (int32_t)pad, 0.0f);  // the padding's zeros
    rest = best.n > K && best.e[K].key > 0 ? best.e[K].key : 0;
    for (int k = 0; k < K; ++k) {
      patch_values[k] = lb_patch_bits<U, lb_mode<M>::sr>(best.e[k].value, rnd, best.e[k].index);
      patch_index[k] = (int16_t)best.e[k].index;
      if (best.e[k].index < len) buf[best.e[k].index] = 0.0f;
      if (root && best.e[k].index < len) root[best.e[k].index] = 0.0f;
    }
  }
  float absmax, inv;
  memcpy(&absmax, &rest, 4);
  lb_block_scale<F, U>(buf, len, absmax, scale, &inv);
  *mult = lb_multiplier<F>(inv);
  return true;
}
// The codes of two states' blocks of len elements in one loop (each as lb_encode_block encodes it): one
// state's square roots (sqrt8's signed m) then overlap the other's arithmetic instead of running
// alone. M1, M2: LB_STOCHASTIC, and LB_ROOT where the state encodes from the roots it is given (a
// non-negative root-domain state).
template <int F1, bool U1, unsigned M1, int F2, bool U2, unsigned M2>
static void lb_encode_pair(const float* buf1, const float* root1, float mult1, uint8_t* codes1, lb_rand rnd1,
                           const float* buf2, const float* root2, float mult2, uint8_t* codes2, lb_rand rnd2,
                           int64_t len) {
  if (lb_lifts<F1, U1>(mult1) || lb_lifts<F2, U2>(mult2)) {  // a block of large values, no faster together
    lb_encode_block<F1, U1, M1 & LB_STOCHASTIC>(buf1, root1, len, mult1, codes1, rnd1);
    lb_encode_block<F2, U2, M2 & LB_STOCHASTIC>(buf2, root2, len, mult2, codes2, rnd2);
    return;
  }
  const vf v1 = lb_splat(mult1), v2 = lb_splat(mult2);
  int64_t i = 0;
  for (; i + 4 * LB_W <= len; i += 4 * LB_W) {
    lb_encode_x4<F1, U1, M1>(buf1, root1, i, v1, rnd1, codes1);
    lb_encode_x4<F2, U2, M2>(buf2, root2, i, v2, rnd2, codes2);
  }
  if (i < len) {  // the last partial group, each state alone
    lb_encode_loop<F1, U1, M1>(buf1 + i, lb_mode<M1>::root ? root1 + i : nullptr, len - i, mult1, lb_codes_at<F1>(codes1, i),
                               {rnd1.key, rnd1.first + i});
    lb_encode_loop<F2, U2, M2>(buf2 + i, lb_mode<M2>::root ? root2 + i : nullptr, len - i, mult2, lb_codes_at<F2>(codes2, i),
                               {rnd2.key, rnd2.first + i});
  }
}

// The patches of one block that fall inside its len elements, sorted by offset (the update loop
// decodes codes times scale and puts these values in the lanes they fall on). Returns their count.
// An offset outside [0, len) is skipped, a negative one too (one unsigned compare): the loader refuses
// such offsets, and the kernel never writes where one points whatever reaches it.
static const int64_t LB_NO_PATCH = INT64_MAX / 2;
template <int K>
static inline int lb_sorted_patches(const int16_t* index, const uint16_t* values, int64_t len, int64_t* out_index,
                                    float* out_value) {
  int n = 0;
  for (int k = 0; k < K; ++k) {
    if ((uint64_t)(int64_t)index[k] >= (uint64_t)len) continue;
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

// ---- fp32 master weights: a 16-bit param and its residual (kernels/residual.py) -------------------
LB_INLINE vi lb_ld_i16(const int16_t* p) { return lb_ld_hi16((const uint16_t*)p) >> 16; }  // sign-extended
LB_INLINE vi lb_ld_i16_n(const int16_t* p, int64_t r) {
  int16_t t[LB_W] = {0};
  memcpy(t, p, r * sizeof(int16_t));
  return lb_ld_i16(t);
}
LB_INLINE void lb_st_i16(int16_t* p, vi c) { lb_st_u16((uint16_t*)p, c & 0xFFFF); }
LB_INLINE void lb_st_i16_n(int16_t* p, vi c, int64_t r) {
  int16_t t[LB_W];
  lb_st_i16(t, c);
  memcpy(p, t, r * sizeof(int16_t));
}
LB_INLINE void lb_st_u16_n(uint16_t* p, vi c, int64_t r) {
  uint16_t t[LB_W];
  lb_st_u16(t, c);
  memcpy(p, t, r * sizeof(uint16_t));
}
LB_INLINE vi lb_ld_i8(const int8_t* p) { return lb_ld_s8((const uint8_t*)p); }
LB_INLINE vi lb_ld_i8_n(const int8_t* p, int64_t r) {
  int8_t t[LB_W] = {0};
  memcpy(t, p, r);
  return lb_ld_i8(t);
}
LB_INLINE void lb_st_i8(int8_t* p, vi c) { lb_st_u8((uint8_t*)p, c & 0xFF); }
LB_INLINE void lb_st_i8_n(int8_t* p, vi c, int64_t r) {
  int8_t t[LB_W];
  lb_st_i8(t, c);
  memcpy(p, t, r);
}

// bf16: the residual d = |x| - |p| in fp32 bit patterns. A master is the param's bits plus d, kept
// in [0, inf] for a residual that no longer fits a changed param; a NaN param stays NaN.
LB_INLINE vf lb_master_join_bf16(vf p, vi d) {
  const vi bits = lb_bits_i(p), sign = bits & (int32_t)0x80000000, mag = bits & 0x7FFFFFFF;
  vi m = mag + d;
  m = m < 0 ? lb_splat_i(0) : m;
  m = m > 0x7F800000 ? lb_splat_i(0x7F800000) : m;
  m = mag > 0x7F800000 ? mag : m;
  return lb_bits_f(m | sign);
}
LB_INLINE vi lb_master_d_bf16(vf x, vi p_bits) {  // p_bits: lb_f32_to_bf16_bits(x)
  const vi d = (lb_bits_i(x) & 0x7FFFFFFF) - ((p_bits << 16) & 0x7FFFFFFF);
  return x != x ? lb_splat_i(0) : d;
}
// Exact bf16 codes are d, with -2^15 for either tie; the tie's side (1: d = -2^15, a tie rounded up)
// is bit e % 32 of word e / 32 of `ties`, e the element's index. Bits are read and written only where
// the code is a tie (rare), atomically: two threads may share a word.
LB_INLINE vi lb_master_d_exact(vi code, const int32_t* ties, int64_t first) {
  vi d = code;
  for (uint32_t hits = lb_hits(code == -32768); hits; hits &= hits - 1) {
    const int l = __builtin_ctz(hits);
    const int64_t e = first + l;
    const uint32_t word = __atomic_load_n((const uint32_t*)ties + (e >> 5), __ATOMIC_RELAXED);  // others' bits
    d[l] = ((word >> (e & 31)) & 1u) ? -32768 : 32768;
  }
  return d;
}
LB_INLINE vi lb_master_code_exact(vi d, int32_t* ties, int64_t first, int64_t r) {
  const vi tie = (d == 32768) | (d == -32768);
  for (uint32_t hits = lb_hits(tie) & ((1u << r) - 1u); hits; hits &= hits - 1) {  // the first r lanes
    const int l = __builtin_ctz(hits);
    const int64_t e = first + l;
    uint32_t* word = (uint32_t*)ties + (e >> 5);
    const uint32_t bit = 1u << (e & 31);
    if (d[l] < 0) __atomic_fetch_or(word, bit, __ATOMIC_RELAXED);
    else __atomic_fetch_and(word, ~bit, __ATOMIC_RELAXED);
  }
  return tie ? lb_splat_i(-32768) : d;
}
// 8bit codes: d stochastically rounded to a multiple of 2^S (floor(d / 2^S + u), u uniform), in [-127, 127].
template <int S>
LB_INLINE vi lb_master_code_8bit(vi d, uint32_t seed_hash, int64_t first) {
  const vi u = (vi)(lb_random_bits(seed_hash, first) & ((1u << S) - 1u));
  vi q = (d + u) >> S;
  q = q > 127 ? lb_splat_i(127) : q;
  return q < -127 ? lb_splat_i(-127) : q;
}
// fp16: d = (x - p) / 2^(e - 24), e the exponent of p (at least -14), rounded to an integer (exact
// unless |x| < 2^-15); 0 where p is inf or NaN.
LB_INLINE vi lb_f16_exponent(vf p) {  // biased fp32 exponent, at least 127 - 14
  const vi e = (lb_bits_i(p) >> 23) & 0xFF;
  return e < 113 ? lb_splat_i(113) : e;
}
LB_INLINE vf lb_master_join_f16(vf p, vi d) {
  const vf unit = lb_bits_f((lb_f16_exponent(p) - 24) << 23);
  const vf m = p + __builtin_convertvector(d, vf) * unit;
  return d == 0 ? p : m;  // keeps the sign of a zero
}
LB_INLINE vi lb_master_d_f16(vf x, vf p) {  // p: x rounded to fp16
  const vf inverse = lb_bits_f((278 - lb_f16_exponent(p)) << 23);  // 2^(24 - e), exact
  const vf d = lb_rint((x - p) * inverse);
  return (lb_bits_i(p) & 0x7F800000) == 0x7F800000 ? lb_splat_i(0) : __builtin_convertvector(d, vi);
}

// ---- the exported step ------------------------------------------------------------------------------
// The generated part defines lb_step_block (one block of one tensor) and, for a step with quantized
// states, lb_job (lb_pending) and lb_finish; lowbit_step calls lb_run with them.

// Quantized blocks whose codes are still to be written: the next block's lane loop writes them, or
// lb_finish, in loops of their own.
template <int N>
struct lb_pending {
  static constexpr bool pending = true;
  int64_t len;  // 0: none pending
  uint8_t* codes[N];
  float mult[N];  // lb_quantize_scale's
  lb_rand rnd[N];  // what a stochastically rounded state's codes draw from
  bool enc[N];  // false: encoded already (a block with inf or NaN)
};
struct lb_no_job {  // a step without quantized states: nothing left to write after a block
  static constexpr bool pending = false;
};
LB_INLINE void lb_finish(lb_no_job&, const float*) {}

// table: one row of ROW int64 per tensor (element count, then its input pointers); scalars: N_SCALARS per
// row, the step's scalar inputs for that tensor (rounded to float, as aten rounds a Python scalar; rows
// differ in their stochastic-rounding counters). Every block of every row, split over threads; with a
// Job each thread carries the block whose codes are still to be written from one STEP call to the next,
// and writes the last one's at the end. 0, or 1 (2) where the table (a thread's scratch) could not be
// allocated.
template <int64_t ROW, int64_t BLOCK, int N_SCALARS, int N_BUFS, class Job, auto STEP>
static int lb_run(int64_t n_tensors, const int64_t* table, const double* scalars, int n_threads) {
  int64_t* first = (int64_t*)malloc((n_tensors + 1) * sizeof(int64_t));
  if (!first) return 1;
  first[0] = 0;
  for (int64_t t = 0; t < n_tensors; ++t) first[t + 1] = first[t] + (table[t * ROW] + BLOCK - 1) / BLOCK;
  const int64_t total = first[n_tensors];
  int64_t nt = n_threads < 1 ? 1 : n_threads;
  if (nt > total) nt = total > 0 ? total : 1;
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
    float* scratch = lb_scratch(N_BUFS * BLOCK + 1);
    if (!scratch) {
#pragma omp atomic write
      failed = 1;
    } else {
      int64_t t = 0, s_row = -1;
      float s[N_SCALARS > 0 ? N_SCALARS : 1];
      Job job = {};  // the block before g, its codes still to write
      for (int64_t g = lo; g < hi; ++g) {
        while (first[t + 1] <= g) ++t;
        if (t != s_row) {  // the row's scalars
          for (int k = 0; k < N_SCALARS; ++k) s[k] = (float)scalars[t * N_SCALARS + k];
          s_row = t;
        }
        const int64_t* row = table + t * ROW;
        const int64_t blk = g - first[t], start = blk * BLOCK;
        const int64_t len = row[0] - start < BLOCK ? row[0] - start : BLOCK;
        if constexpr (Job::pending) STEP(row + 1, s, start, len, blk, scratch, job);
        else STEP(row + 1, s, start, len, blk, scratch);
      }
      lb_finish(job, scratch);
    }
  }
  free(first);
  return failed ? 2 : 0;
}
