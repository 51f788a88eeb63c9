/* A small SIMD layer the CPU kernels are written over once: `vf16`, 16 float32 lanes, and the
 * operations the kernels use on it, for the instruction set chosen at build time:
 *
 *   avx512   one __m512                      (AVX-512 F + BW + VL)
 *   avx2     two __m256                      (AVX2 + FMA)
 *   neon     four float32x4_t                (aarch64)
 *   generic  a struct of 16 floats in plain C (any CPU; the compiler vectorises what it can)
 *
 * The build picks the widest the target has (`-march=native` for the CPU at hand, see __init__.py);
 * `-DCPU_OPS_GENERIC` forces the plain-C path. CPU_OPS_ISA names the one chosen, and the library
 * exports it as `cpu_ops_isa()`.
 *
 * Operations: vf_zero / vf_set1 / vf_load / vf_store; vf_loadn / vf_storen (the first n lanes, the
 * others zero / untouched: tails); vf_load_bf16[n] (bf16 widened in registers, u16 << 16);
 * vf_load_bf16_pairs (32 bf16 as their even and odd elements, widened by a shift and a mask alone:
 * no cross-lane widening, half the loads; see vf_split_pairs for the matching activations); vf_fma
 * (a * b + c), vf_fnma (c - a * b); vf_add / sub / mul / div / max / min; vf_hsum, vf_hmax and
 * vf_hsum4 (four sums at once); vf_exp; vf_rcp (1 / x: an estimate refined by a Newton step on
 * AVX-512, the exact quotient elsewhere); vf_prefetch_l2; vf_gather (int32 offsets, lanes past n
 * zero). vsum, a dot product's accumulator: vs_zero, vs_add, vs_fma (c + a * b with the vf16 product folded
 * into one native register, so a tile of them fits the register file on every ISA) and vs_hsum4.
 *
 * Register blocking that depends on the register file (VF_ROW_VECS, VF_PANEL_ROWS below) is the
 * only tuning the kernels take from here. */
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(CPU_OPS_GENERIC)
#define VF_GENERIC 1
#define CPU_OPS_ISA "generic"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define VF_AVX512 1
#define CPU_OPS_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VF_AVX2 1
#define CPU_OPS_ISA "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define VF_NEON 1
#define CPU_OPS_ISA "neon"
#else
#define VF_GENERIC 1
#define CPU_OPS_ISA "generic"
#endif

#define VF_INLINE static inline __attribute__((always_inline))
/* Loops over a tile's rows and columns (compile-time counts): unrolled where a vf16 is a register or
 * a few; not in plain C, where a vf16 is 16 floats and unrolled tiles made quant.c and moe.c take 30 s
 * and 12 s to compile (GCC walking the aliases of the straight-line code), not 7 and 4. */
#if defined(VF_GENERIC)
#define VF_UNROLL4 _Pragma("GCC unroll 1")
#else
#define VF_UNROLL4 _Pragma("GCC unroll 4")
#endif

/* How many vf16 accumulators a register tile keeps per row: 4 with 32 registers of 16 lanes
 * (AVX-512), 1 where a vf16 takes two registers of 16 (AVX2), four of 32 (NEON) or memory. */
#ifdef VF_AVX512
#define VF_ROW_VECS 4
#else
#define VF_ROW_VECS 1
#endif

/* Weight rows per pass of the panel micro-kernel (moe.c): its 8-row blocks in one pass on
 * AVX-512 (24 accumulators of 48 tokens), in two passes of 4 rows of 16 tokens elsewhere. */
#ifdef VF_AVX512
#define VF_PANEL_ROWS 8
#else
#define VF_PANEL_ROWS 4
#endif

/* exp's constants: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for the reduction), a degree-6
 * polynomial for e^r (relative error ~2e-7, below float32's own rounding of the sum), scaled by 2^n;
 * x is clamped to [-104, 88.7] first (e^x then saturates to 0 / a finite max, never NaN). */
#define VF_EXP_HI 88.7f
#define VF_EXP_LO (-104.f)
#define VF_LOG2E 1.44269504f
#define VF_LN2_HI 0.693145752f
#define VF_LN2_LO 1.42860677e-6f

VF_INLINE float vf_bf16_to_f32(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

VF_INLINE void vf_prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

/* ================================================================================ AVX-512 */
#if defined(VF_AVX512)
#include <immintrin.h>

typedef __m512 vf16;

VF_INLINE __mmask16 vf_mask_(int64_t n) {
  return n >= 16 ? (__mmask16)0xFFFF : n > 0 ? (__mmask16)((1u << n) - 1) : (__mmask16)0;
}
VF_INLINE vf16 vf_zero(void) { return _mm512_setzero_ps(); }
VF_INLINE vf16 vf_set1(float a) { return _mm512_set1_ps(a); }
VF_INLINE vf16 vf_load(const float* p) { return _mm512_loadu_ps(p); }
VF_INLINE void vf_store(float* p, vf16 v) { _mm512_storeu_ps(p, v); }
VF_INLINE vf16 vf_loadn(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(vf_mask_(n), p); }
VF_INLINE void vf_storen(float* p, vf16 v, int64_t n) { _mm512_mask_storeu_ps(p, vf_mask_(n), v); }
VF_INLINE vf16 vf_load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
VF_INLINE vf16 vf_load_bf16n(const uint16_t* p, int64_t n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(vf_mask_(n), p)), 16));
}
/* 32 bf16 at p: even[i] = p[2i], odd[i] = p[2i + 1], both widened to float32. */
VF_INLINE void vf_load_bf16_pairs(const uint16_t* p, vf16* even, vf16* odd) {
  const __m512i v = _mm512_loadu_si512((const void*)p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}
VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }
VF_INLINE vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
VF_INLINE vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
VF_INLINE vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
VF_INLINE vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
VF_INLINE vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
VF_INLINE vf16 vf_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
VF_INLINE float vf_hsum(vf16 a) { return _mm512_reduce_add_ps(a); }
VF_INLINE float vf_hmax(vf16 a) { return _mm512_reduce_max_ps(a); }
/* out[i] = the sum of the lanes of input i: the four reductions share their shuffles. */
VF_INLINE void vf_hsum4(vf16 a, vf16 b, vf16 c, vf16 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  /* 128-bit quarter i of x: two partial quarters of input i, added */
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E)); /* every lane of quarter i: the sum of input i */
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(
                         _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), x)));
}
VF_INLINE vf16 vf_exp(vf16 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(VF_EXP_HI)), _mm512_set1_ps(VF_EXP_LO));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(VF_LOG2E)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VF_LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(VF_LN2_LO), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n); /* saturates to 0 / inf */
}
/* A reciprocal estimate and one Newton step (a full-width divide holds its port ~16 cycles). */
VF_INLINE vf16 vf_rcp(vf16 d) {
  const __m512 r0 = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.f)));
}
/* lane i < n: base[idx[i]] (idx holds 16 readable offsets); lanes past n: 0 */
VF_INLINE vf16 vf_gather(const float* base, const int32_t* idx, int64_t n) {
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), vf_mask_(n), _mm512_loadu_si512(idx), base, 4);
}

/* vsum: one register of partial dot products (vf16 itself here) */
typedef vf16 vsum;
VF_INLINE vsum vs_zero(void) { return vf_zero(); }
VF_INLINE vsum vs_fma(vf16 a, vf16 b, vsum c) { return vf_fma(a, b, c); }
VF_INLINE vsum vs_add(vsum a, vsum b) { return vf_add(a, b); }
VF_INLINE void vs_hsum4(vsum a, vsum b, vsum c, vsum d, float* out) { vf_hsum4(a, b, c, d, out); }

/* ================================================================================ AVX2 + FMA */
#elif defined(VF_AVX2)
#include <immintrin.h>

typedef struct {
  __m256 lo, hi;
} vf16;

VF_INLINE vf16 vf_mk_(__m256 lo, __m256 hi) {
  vf16 r;
  r.lo = lo;
  r.hi = hi;
  return r;
}
VF_INLINE __m256i vf_mask8_(int64_t n) {
  const int k = n < 0 ? 0 : n > 8 ? 8 : (int)n;
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
VF_INLINE vf16 vf_zero(void) { return vf_mk_(_mm256_setzero_ps(), _mm256_setzero_ps()); }
VF_INLINE vf16 vf_set1(float a) { return vf_mk_(_mm256_set1_ps(a), _mm256_set1_ps(a)); }
VF_INLINE vf16 vf_load(const float* p) { return vf_mk_(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
VF_INLINE void vf_store(float* p, vf16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
VF_INLINE vf16 vf_loadn(const float* p, int64_t n) {
  if (n >= 16) return vf_load(p);
  return vf_mk_(_mm256_maskload_ps(p, vf_mask8_(n)), _mm256_maskload_ps(p + 8, vf_mask8_(n - 8)));
}
VF_INLINE void vf_storen(float* p, vf16 v, int64_t n) {
  if (n >= 16) {
    vf_store(p, v);
    return;
  }
  _mm256_maskstore_ps(p, vf_mask8_(n), v.lo);
  _mm256_maskstore_ps(p + 8, vf_mask8_(n - 8), v.hi);
}
VF_INLINE __m256 vf_widen8_(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
VF_INLINE vf16 vf_load_bf16(const uint16_t* p) {
  return vf_mk_(vf_widen8_(_mm_loadu_si128((const __m128i*)p)), vf_widen8_(_mm_loadu_si128((const __m128i*)(p + 8))));
}
VF_INLINE vf16 vf_load_bf16n(const uint16_t* p, int64_t n) {
  if (n >= 16) return vf_load_bf16(p);
  uint16_t t[16] = {0};
  if (n > 0) memcpy(t, p, (size_t)n * sizeof(uint16_t));
  return vf_load_bf16(t);
}
VF_INLINE void vf_load_bf16_pairs(const uint16_t* p, vf16* even, vf16* odd) {
  const __m256i a = _mm256_loadu_si256((const __m256i*)p), b = _mm256_loadu_si256((const __m256i*)(p + 16));
  const __m256i m = _mm256_set1_epi32((int)0xFFFF0000u);
  *even = vf_mk_(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)));
  *odd = vf_mk_(_mm256_castsi256_ps(_mm256_and_si256(a, m)), _mm256_castsi256_ps(_mm256_and_si256(b, m)));
}
VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) {
  return vf_mk_(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) {
  return vf_mk_(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
#define VF_BIN_(name, op) \
  VF_INLINE vf16 name(vf16 a, vf16 b) { return vf_mk_(op(a.lo, b.lo), op(a.hi, b.hi)); }
VF_BIN_(vf_add, _mm256_add_ps)
VF_BIN_(vf_sub, _mm256_sub_ps)
VF_BIN_(vf_mul, _mm256_mul_ps)
VF_BIN_(vf_div, _mm256_div_ps)
VF_BIN_(vf_max, _mm256_max_ps)
VF_BIN_(vf_min, _mm256_min_ps)
#undef VF_BIN_
VF_INLINE float vf_hsum8_(__m256 s) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
VF_INLINE float vf_hsum(vf16 a) { return vf_hsum8_(_mm256_add_ps(a.lo, a.hi)); }
VF_INLINE float vf_hmax(vf16 a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
VF_INLINE void vf_hsum4(vf16 a, vf16 b, vf16 c, vf16 d, float* out) {
  /* hadd twice leaves, per 128-bit half, the four inputs' partial sums; the halves added */
  const __m256 ab = _mm256_hadd_ps(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi));
  const __m256 cd = _mm256_hadd_ps(_mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
  const __m256 s = _mm256_hadd_ps(ab, cd);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
VF_INLINE __m256 vf_exp8_(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(VF_EXP_HI)), _mm256_set1_ps(VF_EXP_LO));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(VF_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VF_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(VF_LN2_LO), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  /* 2^n for n in [-150, 128] as 2^(n >> 1) * 2^(n - (n >> 1)): both factors normal floats */
  const __m256i ni = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(ni, 1), e2 = _mm256_sub_epi32(ni, e1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
VF_INLINE vf16 vf_exp(vf16 x) { return vf_mk_(vf_exp8_(x.lo), vf_exp8_(x.hi)); }
VF_INLINE vf16 vf_rcp(vf16 d) { return vf_div(vf_set1(1.f), d); }
VF_INLINE vf16 vf_gather(const float* base, const int32_t* idx, int64_t n) {
  float t[16] = {0};
  const int k = n < 0 ? 0 : n > 16 ? 16 : (int)n;
  for (int i = 0; i < k; i++) t[i] = base[idx[i]];
  return vf_load(t);
}

/* vsum: a vf16's two halves folded into one register (16 accumulators of a 4 x 4 dot-product tile
 * are 16 registers, not the 32 that vf16 accumulators would spill from AVX2's 16) */
typedef __m256 vsum;
VF_INLINE vsum vs_zero(void) { return _mm256_setzero_ps(); }
VF_INLINE vsum vs_add(vsum a, vsum b) { return _mm256_add_ps(a, b); }
VF_INLINE vsum vs_fma(vf16 a, vf16 b, vsum c) {
  return _mm256_fmadd_ps(a.hi, b.hi, _mm256_fmadd_ps(a.lo, b.lo, c));
}
VF_INLINE void vs_hsum4(vsum a, vsum b, vsum c, vsum d, float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* ================================================================================ NEON (aarch64) */
#elif defined(VF_NEON)
#include <arm_neon.h>

typedef struct {
  float32x4_t q[4];
} vf16;

#define VF_MAP1_(expr)                          \
  vf16 r_;                                      \
  for (int i_ = 0; i_ < 4; i_++) r_.q[i_] = expr; \
  return r_;
VF_INLINE vf16 vf_zero(void) { VF_MAP1_(vdupq_n_f32(0.f)) }
VF_INLINE vf16 vf_set1(float a) { VF_MAP1_(vdupq_n_f32(a)) }
VF_INLINE vf16 vf_load(const float* p) { VF_MAP1_(vld1q_f32(p + 4 * i_)) }
VF_INLINE void vf_store(float* p, vf16 v) {
  for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.q[i]);
}
VF_INLINE vf16 vf_loadn(const float* p, int64_t n) {
  if (n >= 16) return vf_load(p);
  float t[16] = {0};
  if (n > 0) memcpy(t, p, (size_t)n * sizeof(float));
  return vf_load(t);
}
VF_INLINE void vf_storen(float* p, vf16 v, int64_t n) {
  if (n >= 16) {
    vf_store(p, v);
    return;
  }
  float t[16];
  vf_store(t, v);
  if (n > 0) memcpy(p, t, (size_t)n * sizeof(float));
}
VF_INLINE vf16 vf_load_bf16(const uint16_t* p) {
  VF_MAP1_(vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * i_), 16)))
}
VF_INLINE vf16 vf_load_bf16n(const uint16_t* p, int64_t n) {
  if (n >= 16) return vf_load_bf16(p);
  uint16_t t[16] = {0};
  if (n > 0) memcpy(t, p, (size_t)n * sizeof(uint16_t));
  return vf_load_bf16(t);
}
VF_INLINE void vf_load_bf16_pairs(const uint16_t* p, vf16* even, vf16* odd) {
  for (int i = 0; i < 4; i++) {
    const uint32x4_t v = vreinterpretq_u32_u16(vld1q_u16(p + 8 * i));
    even->q[i] = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));
    odd->q[i] = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF0000u)));
  }
}
VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) { VF_MAP1_(vfmaq_f32(c.q[i_], a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) { VF_MAP1_(vfmsq_f32(c.q[i_], a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_add(vf16 a, vf16 b) { VF_MAP1_(vaddq_f32(a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_sub(vf16 a, vf16 b) { VF_MAP1_(vsubq_f32(a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_mul(vf16 a, vf16 b) { VF_MAP1_(vmulq_f32(a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_div(vf16 a, vf16 b) { VF_MAP1_(vdivq_f32(a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_max(vf16 a, vf16 b) { VF_MAP1_(vmaxq_f32(a.q[i_], b.q[i_])) }
VF_INLINE vf16 vf_min(vf16 a, vf16 b) { VF_MAP1_(vminq_f32(a.q[i_], b.q[i_])) }
VF_INLINE float vf_hsum(vf16 a) {
  return vaddvq_f32(vaddq_f32(vaddq_f32(a.q[0], a.q[1]), vaddq_f32(a.q[2], a.q[3])));
}
VF_INLINE float vf_hmax(vf16 a) {
  return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.q[0], a.q[1]), vmaxq_f32(a.q[2], a.q[3])));
}
VF_INLINE void vf_hsum4(vf16 a, vf16 b, vf16 c, vf16 d, float* out) {
  out[0] = vf_hsum(a);
  out[1] = vf_hsum(b);
  out[2] = vf_hsum(c);
  out[3] = vf_hsum(d);
}
VF_INLINE float32x4_t vf_exp4_(float32x4_t x) {
  x = vmaxq_f32(vminq_f32(x, vdupq_n_f32(VF_EXP_HI)), vdupq_n_f32(VF_EXP_LO));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(VF_LOG2E)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(VF_LN2_HI));
  r = vfmsq_f32(r, n, vdupq_n_f32(VF_LN2_LO));
  float32x4_t p = vdupq_n_f32(1.f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t ni = vcvtq_s32_f32(n), e1 = vshrq_n_s32(ni, 1), e2 = vsubq_s32(ni, e1);
  const int32x4_t bias = vdupq_n_s32(127);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e1, bias), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(e2, bias), 23));
  return vmulq_f32(vmulq_f32(p, s1), s2);
}
VF_INLINE vf16 vf_exp(vf16 x) { VF_MAP1_(vf_exp4_(x.q[i_])) }
VF_INLINE vf16 vf_rcp(vf16 d) { return vf_div(vf_set1(1.f), d); }
VF_INLINE vf16 vf_gather(const float* base, const int32_t* idx, int64_t n) {
  float t[16] = {0};
  const int k = n < 0 ? 0 : n > 16 ? 16 : (int)n;
  for (int i = 0; i < k; i++) t[i] = base[idx[i]];
  return vf_load(t);
}
/* vsum: a vf16's four quarters folded into one register (a 4 x 4 tile: 16 of the 32 registers) */
typedef float32x4_t vsum;
VF_INLINE vsum vs_zero(void) { return vdupq_n_f32(0.f); }
VF_INLINE vsum vs_add(vsum a, vsum b) { return vaddq_f32(a, b); }
VF_INLINE vsum vs_fma(vf16 a, vf16 b, vsum c) {
  for (int i = 0; i < 4; i++) c = vfmaq_f32(c, a.q[i], b.q[i]);
  return c;
}
VF_INLINE void vs_hsum4(vsum a, vsum b, vsum c, vsum d, float* out) {
  vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
#undef VF_MAP1_

/* ================================================================================ plain C */
#else

typedef struct {
  float v[16];
} vf16;

#define VF_MAP_(expr)                            \
  vf16 r_;                                       \
  for (int i_ = 0; i_ < 16; i_++) r_.v[i_] = expr; \
  return r_;
VF_INLINE vf16 vf_zero(void) { VF_MAP_(0.f) }
VF_INLINE vf16 vf_set1(float a) { VF_MAP_(a) }
VF_INLINE vf16 vf_load(const float* p) { VF_MAP_(p[i_]) }
VF_INLINE void vf_store(float* p, vf16 v) {
  for (int i = 0; i < 16; i++) p[i] = v.v[i];
}
VF_INLINE vf16 vf_loadn(const float* p, int64_t n) {
  if (n >= 16) return vf_load(p);
  VF_MAP_(i_ < n ? p[i_] : 0.f)
}
VF_INLINE void vf_storen(float* p, vf16 v, int64_t n) {
  for (int i = 0; i < 16 && i < n; i++) p[i] = v.v[i];
}
VF_INLINE vf16 vf_load_bf16(const uint16_t* p) { VF_MAP_(vf_bf16_to_f32(p[i_])) }
VF_INLINE void vf_load_bf16_pairs(const uint16_t* p, vf16* even, vf16* odd) {
  for (int i = 0; i < 16; i++) {
    even->v[i] = vf_bf16_to_f32(p[2 * i]);
    odd->v[i] = vf_bf16_to_f32(p[2 * i + 1]);
  }
}
VF_INLINE vf16 vf_load_bf16n(const uint16_t* p, int64_t n) {
  if (n >= 16) return vf_load_bf16(p);
  VF_MAP_(i_ < n ? vf_bf16_to_f32(p[i_]) : 0.f)
}
/* a * b + c rounded once where the target has a fused multiply-add (fmaf is inlined then) */
#ifdef FP_FAST_FMAF
#define VF_FMAF_(a, b, c) fmaf(a, b, c)
#else
#define VF_FMAF_(a, b, c) ((a) * (b) + (c))
#endif
VF_INLINE vf16 vf_fma(vf16 a, vf16 b, vf16 c) { VF_MAP_(VF_FMAF_(a.v[i_], b.v[i_], c.v[i_])) }
VF_INLINE vf16 vf_fnma(vf16 a, vf16 b, vf16 c) { VF_MAP_(VF_FMAF_(-a.v[i_], b.v[i_], c.v[i_])) }
VF_INLINE vf16 vf_add(vf16 a, vf16 b) { VF_MAP_(a.v[i_] + b.v[i_]) }
VF_INLINE vf16 vf_sub(vf16 a, vf16 b) { VF_MAP_(a.v[i_] - b.v[i_]) }
VF_INLINE vf16 vf_mul(vf16 a, vf16 b) { VF_MAP_(a.v[i_] * b.v[i_]) }
VF_INLINE vf16 vf_div(vf16 a, vf16 b) { VF_MAP_(a.v[i_] / b.v[i_]) }
VF_INLINE vf16 vf_max(vf16 a, vf16 b) { VF_MAP_(a.v[i_] > b.v[i_] ? a.v[i_] : b.v[i_]) }
VF_INLINE vf16 vf_min(vf16 a, vf16 b) { VF_MAP_(a.v[i_] < b.v[i_] ? a.v[i_] : b.v[i_]) }
VF_INLINE float vf_hsum(vf16 a) {
  float s[8]; /* pairwise, as the vector paths add */
  for (int i = 0; i < 8; i++) s[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; i++) s[i] += s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}
VF_INLINE float vf_hmax(vf16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; i++) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
VF_INLINE void vf_hsum4(vf16 a, vf16 b, vf16 c, vf16 d, float* out) {
  out[0] = vf_hsum(a);
  out[1] = vf_hsum(b);
  out[2] = vf_hsum(c);
  out[3] = vf_hsum(d);
}
VF_INLINE float vf_exp1_(float x) {
  x = x < VF_EXP_HI ? x : VF_EXP_HI;
  x = x > VF_EXP_LO ? x : VF_EXP_LO;
  /* round to nearest: adding 1.5 * 2^23 leaves no fraction bits (|x log2e| < 2^22) */
#if defined(FLT_EVAL_METHOD) && FLT_EVAL_METHOD == 0
  const float n = (x * VF_LOG2E + 12582912.f) - 12582912.f;
#else
  const float n = nearbyintf(x * VF_LOG2E);
#endif
  float r = VF_FMAF_(-n, VF_LN2_HI, x);
  r = VF_FMAF_(-n, VF_LN2_LO, r);
  float p = 1.f / 720;
  p = VF_FMAF_(p, r, 1.f / 120);
  p = VF_FMAF_(p, r, 1.f / 24);
  p = VF_FMAF_(p, r, 1.f / 6);
  p = VF_FMAF_(p, r, 0.5f);
  p = VF_FMAF_(p, r, 1.f);
  p = VF_FMAF_(p, r, 1.f);
  const int32_t ni = (int32_t)n, e1 = ni >> 1, e2 = ni - e1;
  const uint32_t b1 = (uint32_t)(e1 + 127) << 23, b2 = (uint32_t)(e2 + 127) << 23;
  float s1, s2;
  memcpy(&s1, &b1, 4);
  memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}
VF_INLINE vf16 vf_exp(vf16 x) { VF_MAP_(vf_exp1_(x.v[i_])) }
VF_INLINE vf16 vf_rcp(vf16 d) { VF_MAP_(1.f / d.v[i_]) }
VF_INLINE vf16 vf_gather(const float* base, const int32_t* idx, int64_t n) { VF_MAP_(i_ < n ? base[idx[i_]] : 0.f) }
typedef vf16 vsum;
VF_INLINE vsum vs_zero(void) { return vf_zero(); }
VF_INLINE vsum vs_fma(vf16 a, vf16 b, vsum c) { return vf_fma(a, b, c); }
VF_INLINE vsum vs_add(vsum a, vsum b) { return vf_add(a, b); }
VF_INLINE void vs_hsum4(vsum a, vsum b, vsum c, vsum d, float* out) { vf_hsum4(a, b, c, d, out); }
#undef VF_MAP_
#endif

/* The activations that match vf_load_bf16_pairs' weights: each whole 32-float chunk of x[0..K) as
 * its 16 even elements then its 16 odd ones, the tail (K % 32) copied as it is. A dot product of a
 * bf16 row with x is then sum(even(w) * dst[0..16)) + sum(odd(w) * dst[16..32)) per chunk. */
VF_INLINE void vf_split_pairs(const float* x, int64_t K, float* dst) {
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int i = 0; i < 16; i++) {
      dst[k + i] = x[k + 2 * i];
      dst[k + 16 + i] = x[k + 2 * i + 1];
    }
  for (; k < K; k++) dst[k] = x[k];
}

