/* Linear layers and MoE experts over packed int8 / int4 weights (moe_serve/quantization/packed.py's
 * PackedWeight), for decode-sized batches: the packed bytes streamed from memory once, widened to
 * float32 in registers.
 *
 * The packed format: a weight W (N, K) with group size G (G divides K) is
 *   q       uint8 codes: bits 8, (N, K), one code 0..255 a byte; bits 4, (N, K / 2), element k in the
 *           low nibble of byte k / 2 when k is even, in the high nibble when k is odd (codes 0..15);
 *   scales  float32 or float16 (N, K / G);   offsets  float32 (N, K / G) or NULL (zero);   zero  a code z;
 *   W[n, k] = scales[n, k / G] * (q[n, k] - z) + offsets[n, k / G].
 * A symmetric format (GGUF Q4_0 / Q8_0 / Q6_K, GPTQ and compressed-tensors without zero points) needs
 * no offsets array: its offsets are -z * scale, with z = 8, 128 or 32 (a sixth of Q4_0's bytes not read).
 * (Experts: E such weights back to back.)
 *
 * How: with o[n, g] = offsets[n, g] - z * scales[n, g] (the group's offset), the inner loop widens a
 * vector of codes (int8: a zero-extension and a convert; int4: the low and high nibbles of 16
 * bytes, a mask and a shift: no cross-lane shuffles), turns it into weights by one fused
 * multiply-add with its row's group scale and offset (shared by every activation row) and
 * accumulates them against the activations. A lone activation row (decode) instead sums q x per
 * group and adds sum_g o[n, g] * xsum[m, g] once per output (xsum[m, g]: the sum of x[m, k] over
 * group g, computed once per call). For int4 the activations are first laid out to match the nibbles: within each
 * group, each chunk of up to 32 elements as its even elements then its odd ones (split4).
 * Two shortcuts where they pay: a lone activation row (decode) accumulates each group's sums of
 * q x and scales them once per group (no multiply per vector); on AVX-512 int4 codes
 * become weights by a lookup, the group's 16 values scale * c + offset in one register indexed by
 * the nibble (vpermps: no convert, no multiply, no mask; the offsets are then in the weights, not in
 * offset * xsum); on AVX2 each int4 byte is converted whole, and b & 0xF0 beside it, against odd
 * activations laid out as odd / 16 - even (q4_dot_load: 12 vector instructions per 32 codes and row, not 15).
 *
 * Tiles as moe.c's decode path: a block of QNB weight rows stays in L1 while every activation row
 * passes it (up to QMB at a time, a compile-time count), so the weights are read once whatever M is;
 * the row blocks are split over OpenMP threads (whole outputs each: a thread never splits a sum), or,
 * for experts routed to by a decode-sized call, whole experts are (common.h `experts_by_thread`).
 * Written over vec.h's 16-lane vectors; the code widening is this file's (q8_load / q4_load below)
 * for AVX-512, AVX2, NEON and plain C.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "panel.h"

#define QMB 4 /* activation rows per tile */
#define QNB 4 /* weight rows per tile */
#define QPF 2 /* how many tiles ahead the first activation tile prefetches weight rows (into L2) */

/* ---- widening codes to float32: q8_load (16 bytes), q4_load (16 bytes: the 16 low nibbles, the
 * 16 high ones); the *n forms read only the first n bytes (the other lanes zero). ---- */
#if defined(VF_AVX512)
VF_INLINE vf16 q8_widen_(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
VF_INLINE vf16 q8_load(const uint8_t* p) { return q8_widen_(_mm_loadu_si128((const __m128i*)p)); }
VF_INLINE vf16 q8_loadn(const uint8_t* p, int64_t n) { return q8_widen_(_mm_maskz_loadu_epi8(vf_mask_(n), p)); }
VF_INLINE void q4_widen_(__m128i b, vf16* lo, vf16* hi) {
  const __m512i v = _mm512_cvtepu8_epi32(b);
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
VF_INLINE void q4_load(const uint8_t* p, vf16* lo, vf16* hi) { q4_widen_(_mm_loadu_si128((const __m128i*)p), lo, hi); }
VF_INLINE void q4_loadn(const uint8_t* p, int64_t n, vf16* lo, vf16* hi) {
  q4_widen_(_mm_maskz_loadu_epi8(vf_mask_(n), p), lo, hi);
}
#elif defined(VF_AVX2)
VF_INLINE __m256 q8_cvt_(__m128i b8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8)); }
VF_INLINE vf16 q8_widen_(__m128i b) {
  vf16 r;
  r.lo = q8_cvt_(b);
  r.hi = q8_cvt_(_mm_srli_si128(b, 8));
  return r;
}
VF_INLINE vf16 q8_load(const uint8_t* p) { return q8_widen_(_mm_loadu_si128((const __m128i*)p)); }
VF_INLINE void q4_widen_(__m128i b, vf16* lo, vf16* hi) {
  const __m256i a = _mm256_cvtepu8_epi32(b), c = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i m = _mm256_set1_epi32(15);
  lo->lo = _mm256_cvtepi32_ps(_mm256_and_si256(a, m));
  lo->hi = _mm256_cvtepi32_ps(_mm256_and_si256(c, m));
  hi->lo = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
  hi->hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
VF_INLINE void q4_load(const uint8_t* p, vf16* lo, vf16* hi) { q4_widen_(_mm_loadu_si128((const __m128i*)p), lo, hi); }
VF_INLINE __m128i q_loadn_(const uint8_t* p, int64_t n) {
  uint8_t t[16] = {0};
  memcpy(t, p, (size_t)(n < 16 ? n : 16));
  return _mm_loadu_si128((const __m128i*)t);
}
VF_INLINE vf16 q8_loadn(const uint8_t* p, int64_t n) { return q8_widen_(q_loadn_(p, n)); }
VF_INLINE void q4_loadn(const uint8_t* p, int64_t n, vf16* lo, vf16* hi) { q4_widen_(q_loadn_(p, n), lo, hi); }
/* The dot products' form of 16 int4 bytes on AVX2 (Q4_BYTE_FORM): each whole byte b = lo + 16 hi and
 * b & 0xF0 = 16 hi, against activations split4 laid out as x_even and x_odd / 16 - x_even:
 * b x_even + 16 hi (x_odd / 16 - x_even) = lo x_even + hi x_odd. A zero-extension straight from
 * memory, a mask and a convert per 8 weights, where the nibbles themselves take a shift and a mask
 * more: 12 vector instructions per 32 weights and row instead of 15, on a loop that the vector ports
 * bound (the int4 GEMV is compute-bound on AVX2). */
#define Q4_BYTE_FORM 1
VF_INLINE void q4_bytes2_(__m256i a, __m256i c, vf16* lo, vf16* hi) {
  const __m256i mh = _mm256_set1_epi32(0xF0);
  lo->lo = _mm256_cvtepi32_ps(a);
  lo->hi = _mm256_cvtepi32_ps(c);
  hi->lo = _mm256_cvtepi32_ps(_mm256_and_si256(a, mh));
  hi->hi = _mm256_cvtepi32_ps(_mm256_and_si256(c, mh));
}
VF_INLINE void q4_dot_load(const uint8_t* p, vf16* lo, vf16* hi) {
  q4_bytes2_(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)),
             _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8))), lo, hi);
}
VF_INLINE void q4_dot_loadn(const uint8_t* p, int64_t n, vf16* lo, vf16* hi) {
  const __m128i b = q_loadn_(p, n);
  q4_bytes2_(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), lo, hi);
}
#elif defined(VF_NEON)
VF_INLINE vf16 q8_widen_(uint8x16_t v) {
  const uint16x8_t a = vmovl_u8(vget_low_u8(v)), b = vmovl_u8(vget_high_u8(v));
  vf16 r;
  r.q[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(a)));
  r.q[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(a)));
  r.q[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(b)));
  r.q[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(b)));
  return r;
}
VF_INLINE vf16 q8_load(const uint8_t* p) { return q8_widen_(vld1q_u8(p)); }
VF_INLINE void q4_widen_(uint8x16_t v, vf16* lo, vf16* hi) {
  *lo = q8_widen_(vandq_u8(v, vdupq_n_u8(15)));
  *hi = q8_widen_(vshrq_n_u8(v, 4));
}
VF_INLINE void q4_load(const uint8_t* p, vf16* lo, vf16* hi) { q4_widen_(vld1q_u8(p), lo, hi); }
VF_INLINE uint8x16_t q_loadn_(const uint8_t* p, int64_t n) {
  uint8_t t[16] = {0};
  memcpy(t, p, (size_t)(n < 16 ? n : 16));
  return vld1q_u8(t);
}
VF_INLINE vf16 q8_loadn(const uint8_t* p, int64_t n) { return q8_widen_(q_loadn_(p, n)); }
VF_INLINE void q4_loadn(const uint8_t* p, int64_t n, vf16* lo, vf16* hi) { q4_widen_(q_loadn_(p, n), lo, hi); }
#else
VF_INLINE vf16 q8_loadn(const uint8_t* p, int64_t n) {
  vf16 r;
  for (int i = 0; i < 16; i++) r.v[i] = i < n ? (float)p[i] : 0.f;
  return r;
}
VF_INLINE vf16 q8_load(const uint8_t* p) {
  vf16 r;
  for (int i = 0; i < 16; i++) r.v[i] = (float)p[i];
  return r;
}
VF_INLINE void q4_loadn(const uint8_t* p, int64_t n, vf16* lo, vf16* hi) {
  for (int i = 0; i < 16; i++) {
    const int b = i < n ? p[i] : 0;
    lo->v[i] = (float)(b & 15);
    hi->v[i] = (float)(b >> 4);
  }
}
VF_INLINE void q4_load(const uint8_t* p, vf16* lo, vf16* hi) { q4_loadn(p, 16, lo, hi); }
#endif

/* acc + s * p over a dot product's accumulators (vsum, vec.h): a group's partial sums scaled. */
#if defined(VF_AVX512)
VF_INLINE vsum qs_fma1(float s, vsum p, vsum acc) { return _mm512_fmadd_ps(_mm512_set1_ps(s), p, acc); }
/* int4 codes to weights by a lookup: the 16 values scale * c + offset of a row's group in one register,
 * indexed by the code (vpermps reads an index's low 4 bits: the low nibble needs no mask). */
#define Q4_LUT 1
VF_INLINE vf16 q4_lut(float s, float o) {
  return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(s),
                         _mm512_set1_ps(o));
}
VF_INLINE void q4_lookup_(__m128i b, vf16 lut, vf16* lo, vf16* hi) {
  const __m512i v = _mm512_cvtepu8_epi32(b);
  *lo = _mm512_permutexvar_ps(v, lut);
  *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
}
#elif defined(VF_AVX2)
VF_INLINE vsum qs_fma1(float s, vsum p, vsum acc) { return _mm256_fmadd_ps(_mm256_set1_ps(s), p, acc); }
#elif defined(VF_NEON)
VF_INLINE vsum qs_fma1(float s, vsum p, vsum acc) { return vfmaq_n_f32(acc, p, s); }
#else
VF_INLINE vsum qs_fma1(float s, vsum p, vsum acc) { return vf_fma(vf_set1(s), p, acc); }
#endif
#ifndef Q4_LUT
#define Q4_LUT 0
#endif
#ifndef Q4_BYTE_FORM /* elsewhere the dot products take the nibbles as they are */
#define Q4_BYTE_FORM 0
#define q4_dot_load q4_load
#define q4_dot_loadn q4_loadn
#endif

/* out[2i] = even[i], out[2i + 1] = odd[i] for i < 16: an int4 row's low and high nibbles' weights
 * back in the row's order. */
#if defined(VF_AVX512)
VF_INLINE void q4_interleave(vf16 even, vf16 odd, float* out) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(even, lo, odd));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(even, hi, odd));
}
#elif defined(VF_AVX2)
VF_INLINE void q4_interleave8_(__m256 e, __m256 o, float* out) {
  const __m256 a = _mm256_unpacklo_ps(e, o), b = _mm256_unpackhi_ps(e, o); /* pairs 0, 1, 4, 5 | 2, 3, 6, 7 */
  _mm256_storeu_ps(out, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(out + 8, _mm256_permute2f128_ps(a, b, 0x31));
}
VF_INLINE void q4_interleave(vf16 even, vf16 odd, float* out) {
  q4_interleave8_(even.lo, odd.lo, out);
  q4_interleave8_(even.hi, odd.hi, out + 16);
}
#else
VF_INLINE void q4_interleave(vf16 even, vf16 odd, float* out) {
  float e[16], o[16];
  vf_store(e, even);
  vf_store(o, odd);
  for (int i = 0; i < 16; i++) {
    out[2 * i] = e[i];
    out[2 * i + 1] = o[i];
  }
}
#endif

/* A packed weight as the kernels read it (see the header). */
typedef struct {
  const uint8_t* q;
  const void* scales;   /* float32, or float16's bits where scales16 */
  const float* offsets; /* NULL: none */
  int64_t G;
  int bits;
  int zero; /* the code of 0 (offsets - zero * scales) */
  int scales16;
  int act8; /* calls round the activations to int8 (the int8-activation tiles and panel below) */
} qweight_t;

/* A float16's value (exact in float32): F16C where the build has it, else by its fields. */
VF_INLINE float q_f16(uint16_t h) {
#if defined(__F16C__) && (defined(VF_AVX512) || defined(VF_AVX2))
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  uint32_t b;
  float f;
  if (e == 0) { /* zero or subnormal: m * 2^-24 */
    f = (float)m * 5.9604644775390625e-8f;
    memcpy(&b, &f, 4);
    b |= sign;
  } else if (e == 31) {
    b = sign | 0x7F800000u | (m << 13);
  } else {
    b = sign | ((e + 112u) << 23) | (m << 13);
  }
  memcpy(&f, &b, 4);
  return f;
#endif
}

/* Scale i (a row's group g: row * K / G + g) of a weight. */
VF_INLINE float qscale(const qweight_t* w, int64_t i) {
  return w->scales16 ? q_f16(((const uint16_t*)w->scales)[i]) : ((const float*)w->scales)[i];
}

/* Group g's offset of a row whose scales (widened) and offsets (or NULL) are sp, op. */
VF_INLINE float qoff(const qweight_t* w, const float* sp, const float* op, int64_t g) {
  return (op ? op[g] : 0.f) - (float)w->zero * sp[g];
}

/* n float16 scales widened into dst (the tiles read float32 scales: a tile's rows widened once,
 * not a conversion per group in the inner loops). */
static void q_f16_row(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && (defined(VF_AVX512) || defined(VF_AVX2))
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
  for (; i < n; i++) dst[i] = q_f16(src[i]);
}

/* Each row of x (M rows of K, ldx apart) into dst (M x K, contiguous) laid out for int4 codes:
 * within each group of G, each chunk of up to 32 elements (c of them) as its c/2 even elements,
 * then its c/2 odd ones (the low and high nibbles of its c/2 bytes); with Q4_BYTE_FORM, each odd
 * one as odd / 16 - its even neighbour (see q4_dot_load). */
static void split4(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t G, float* dst) {
  for (int64_t m = 0; m < M; m++) {
    const float* xr = x + m * ldx;
    float* d = dst + m * K;
    for (int64_t k0 = 0; k0 < K; k0 += G)
      for (int64_t c0 = k0; c0 < k0 + G; c0 += 32) {
        const int64_t h = (k0 + G - c0 < 32 ? k0 + G - c0 : 32) / 2;
        for (int64_t i = 0; i < h; i++) {
          d[c0 + i] = xr[c0 + 2 * i];
          d[c0 + h + i] = Q4_BYTE_FORM ? xr[c0 + 2 * i + 1] * 0.0625f - xr[c0 + 2 * i] : xr[c0 + 2 * i + 1];
        }
      }
  }
}

/* xsum[m, g] = the sum of row m's elements in group g (M x K/G). */
static void group_sums(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t G, float* xsum) {
  const int64_t ng = K / G;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < ng; g++) {
      const float* xr = x + m * ldx + g * G;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < G; k++) s += xr[k];
      xsum[m * ng + g] = s;
    }
}

/* One tile: MBC activation rows a[0..MBC) (K floats each; split4's layout for int4) against weight
 * rows n..n+nb (nb <= QNB), y rows ldy apart at column n. xs: the rows' group sums (K/G each);
 * spr: the QNB rows' scales as float32 (K/G each). */
VF_INLINE void qtile(const float* const* ar, const float* const* xsr, const int MBC, const int BITS,
                     const qweight_t* w, const float* const* spr, int64_t n, int nb, int64_t K, float* y, int64_t ldy,
                     const uint8_t* pf) {
  const float* a[QMB];
  const uint8_t* qp[QNB];
  const float* sp[QNB];
  const float* op[QNB]; /* offsets' rows (NULL: none) */
  const int64_t G = w->G, ng = K / G, rowbytes = BITS == 8 ? K : K / 2;
  VF_UNROLL4 for (int i = 0; i < QMB; i++) a[i] = ar[i];
  VF_UNROLL4 for (int j = 0; j < QNB; j++) {
    const int64_t r = n + (j < nb ? j : 0);
    qp[j] = w->q + r * rowbytes;
    sp[j] = spr[j];
    op[j] = w->offsets ? w->offsets + r * ng : 0;
    (void)op[j];
  }
  vsum acc[QMB][QNB];
  VF_UNROLL4 for (int i = 0; i < MBC; i++)
    VF_UNROLL4 for (int j = 0; j < QNB; j++) acc[i][j] = vs_zero();
  for (int64_t g = 0; g < ng; g++) {
    const int64_t k0 = g * G, k1 = k0 + G;
    int64_t k = k0;
    if (BITS == 8 && MBC == 1) { /* a lone row: the group's sums of q x, then scaled once */
      vsum p[QNB];
      VF_UNROLL4 for (int j = 0; j < QNB; j++) p[j] = vs_zero();
      for (; k + 16 <= k1; k += 16) {
        if (pf) vf_prefetch_l2(pf + (k >> 4) * 64);
        const vf16 xv = vf_load(a[0] + k);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) p[j] = vs_fma(xv, q8_load(qp[j] + k), p[j]);
      }
      if (k < k1) {
        const vf16 xv = vf_loadn(a[0] + k, k1 - k);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) p[j] = vs_fma(xv, q8_loadn(qp[j] + k, k1 - k), p[j]);
      }
      VF_UNROLL4 for (int j = 0; j < QNB; j++) acc[0][j] = qs_fma1(sp[j][g], p[j], acc[0][j]);
    } else if (BITS == 8) {
      vf16 vs[QNB], vo[QNB];
      VF_UNROLL4 for (int j = 0; j < QNB; j++) {
        vs[j] = vf_set1(sp[j][g]);
        vo[j] = vf_set1(qoff(w, sp[j], op[j], g));
      }
      for (; k + 16 <= k1; k += 16) {
        if (pf) vf_prefetch_l2(pf + (k >> 4) * 64);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          const vf16 wv = vf_fma(q8_load(qp[j] + k), vs[j], vo[j]);
          VF_UNROLL4 for (int i = 0; i < MBC; i++) acc[i][j] = vs_fma(vf_load(a[i] + k), wv, acc[i][j]);
        }
      }
      if (k < k1)
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          const vf16 wv = vf_fma(q8_loadn(qp[j] + k, k1 - k), vs[j], vo[j]);
          VF_UNROLL4 for (int i = 0; i < MBC; i++)
            acc[i][j] = vs_fma(vf_loadn(a[i] + k, k1 - k), wv, acc[i][j]);
        }
    } else if (Q4_LUT) {
#if Q4_LUT
      vf16 lut[QNB];
      VF_UNROLL4 for (int j = 0; j < QNB; j++) lut[j] = q4_lut(sp[j][g], qoff(w, sp[j], op[j], g));
      for (; k + 32 <= k1; k += 32) {
        if (pf) vf_prefetch_l2(pf + (k >> 5) * 64);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_lookup_(_mm_loadu_si128((const __m128i*)(qp[j] + k / 2)), lut[j], &we, &wo);
          VF_UNROLL4 for (int i = 0; i < MBC; i++) {
            acc[i][j] = vs_fma(vf_load(a[i] + k), we, acc[i][j]);
            acc[i][j] = vs_fma(vf_load(a[i] + k + 16), wo, acc[i][j]);
          }
        }
      }
      if (k < k1) {
        const int64_t h = (k1 - k) / 2;
        const __mmask16 mh = vf_mask_(h);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_lookup_(_mm_maskz_loadu_epi8(mh, qp[j] + k / 2), lut[j], &we, &wo);
          VF_UNROLL4 for (int i = 0; i < MBC; i++) {
            acc[i][j] = vs_fma(vf_loadn(a[i] + k, h), we, acc[i][j]);
            acc[i][j] = vs_fma(vf_loadn(a[i] + k + h, h), wo, acc[i][j]);
          }
        }
      }
#endif
    } else if (MBC == 1) { /* a lone row: the group's sums of q x, then scaled once */
      vsum p[QNB];
      VF_UNROLL4 for (int j = 0; j < QNB; j++) p[j] = vs_zero();
      for (; k + 32 <= k1; k += 32) {
        if (pf) vf_prefetch_l2(pf + (k >> 5) * 64);
        const vf16 xe = vf_load(a[0] + k), xo = vf_load(a[0] + k + 16);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_dot_load(qp[j] + k / 2, &we, &wo);
          p[j] = vs_fma(xo, wo, vs_fma(xe, we, p[j]));
        }
      }
      if (k < k1) {
        const int64_t h = (k1 - k) / 2;
        const vf16 xe = vf_loadn(a[0] + k, h), xo = vf_loadn(a[0] + k + h, h);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_dot_loadn(qp[j] + k / 2, h, &we, &wo);
          p[j] = vs_fma(xo, wo, vs_fma(xe, we, p[j]));
        }
      }
      VF_UNROLL4 for (int j = 0; j < QNB; j++) acc[0][j] = qs_fma1(sp[j][g], p[j], acc[0][j]);
    } else {
      /* the weights of a group: s * lo + o (even), s * hi + o (odd); in the AVX2 byte form (see
       * q4_dot_load) s * b + 17 o against x_even and s * (b & 0xF0) + 16 o against x_odd / 16 - x_even */
      vf16 vs[QNB], voe[QNB], voo[QNB];
      VF_UNROLL4 for (int j = 0; j < QNB; j++) {
        const float o = qoff(w, sp[j], op[j], g);
        vs[j] = vf_set1(sp[j][g]);
        voe[j] = vf_set1(Q4_BYTE_FORM ? 17.f * o : o);
        voo[j] = vf_set1(Q4_BYTE_FORM ? 16.f * o : o);
      }
      for (; k + 32 <= k1; k += 32) {
        if (pf) vf_prefetch_l2(pf + (k >> 5) * 64);
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_dot_load(qp[j] + k / 2, &we, &wo);
          we = vf_fma(we, vs[j], voe[j]);
          wo = vf_fma(wo, vs[j], voo[j]);
          VF_UNROLL4 for (int i = 0; i < MBC; i++) {
            acc[i][j] = vs_fma(vf_load(a[i] + k), we, acc[i][j]);
            acc[i][j] = vs_fma(vf_load(a[i] + k + 16), wo, acc[i][j]);
          }
        }
      }
      if (k < k1) {
        const int64_t h = (k1 - k) / 2;
        VF_UNROLL4 for (int j = 0; j < QNB; j++) {
          vf16 we, wo;
          q4_dot_loadn(qp[j] + k / 2, h, &we, &wo);
          we = vf_fma(we, vs[j], voe[j]);
          wo = vf_fma(wo, vs[j], voo[j]);
          VF_UNROLL4 for (int i = 0; i < MBC; i++) {
            acc[i][j] = vs_fma(vf_loadn(a[i] + k, h), we, acc[i][j]);
            acc[i][j] = vs_fma(vf_loadn(a[i] + k + h, h), wo, acc[i][j]);
          }
        }
      }
    }
  }
  VF_UNROLL4 for (int i = 0; i < MBC; i++) {
    float sums[QNB];
    vs_hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    for (int j = 0; j < nb; j++) {
      float s = sums[j];
      if (MBC == 1 && (w->offsets || w->zero) && !(BITS == 4 && Q4_LUT)) { /* (elsewhere in the weights) */
        const float* o = w->offsets ? w->offsets + (n + j) * ng : 0;
        const float* xs = xsr[i];
        float t = 0.f;
        if (w->zero) {
          for (int64_t gg = 0; gg < ng; gg++) t += qoff(w, sp[j], o, gg) * xs[gg];
        } else {
#pragma omp simd reduction(+ : t)
          for (int64_t gg = 0; gg < ng; gg++) t += o[gg] * xs[gg];
        }
        s += t;
      }
      y[i * ldy + j] = s;
    }
  }
}

#define QSC_STACK 256 /* groups a row whose widened float16 scales a tile keeps on the stack (more: malloc) */

/* The scales of the QNB rows from row n (nb of them real) as float32, in spr: the weight's own
 * float32 scales, or its float16 ones widened into wide (QNB * ng floats). */
static void tile_scales(const qweight_t* w, int64_t n, int nb, int64_t ng, float* wide, const float** spr) {
  for (int j = 0; j < QNB; j++) {
    const int64_t r = n + (j < nb ? j : 0);
    if (w->scales16) {
      q_f16_row((const uint16_t*)w->scales + r * ng, wide + j * ng, ng);
      spr[j] = wide + j * ng;
    } else {
      spr[j] = (const float*)w->scales + r * ng;
    }
  }
}

/* Row blocks [n0, n1) of N rows QNB at a time, by one thread or split over nt (a block function
 * and its context); 0, or -1 when a block had no memory. */
typedef int (*qblock_fn)(const void* ctx, int64_t n0, int64_t n1);
static int run_blocks_of(qblock_fn f, const void* ctx, int64_t N, int64_t block, int nt) {
  if (nt <= 1 || N < 2 * block * nt) return f(ctx, 0, N);
  int failed = 0;
#pragma omp parallel num_threads(nt)
  {
    int64_t n0, n1;
    thread_rows_of(N, block, &n0, &n1);
    if (n0 < n1 && f(ctx, n0, n1)) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? -1 : 0;
}
static int run_blocks(qblock_fn f, const void* ctx, int64_t N, int nt) { return run_blocks_of(f, ctx, N, QNB, nt); }


static int qweight_ok(const qweight_t* w, int64_t K) {
  return (w->bits == 8 || (w->bits == 4 && w->G % 2 == 0)) && w->G > 0 && K % w->G == 0 && w->q && w->scales &&
         w->zero >= 0 && w->zero < (1 << w->bits);
}

/* ---- Many activation rows (prefill): panel.h's panel GEMM over weight rows widened from the codes ----
 * Each block of RB weight rows is widened to float32 (scale * q + offset, in the row's own order) once
 * into L1/L2 and every packed panel of up to NR activation rows passes it: the packed bytes are still
 * read once, the widening is paid once per block and panel group (not per activation row), and the
 * FMAs run in the outer-product micro-kernel, as for float32 weights. From QPANEL_MIN_ROWS rows of a
 * linear layer or an expert: where the panel GEMM of that many rows takes less time than the dot-
 * product tiles (which grow with every row, while the panel micro-kernel costs the same up to each
 * 16 rows). Measured on a Xeon (AVX-512 and the AVX2 build), 1 thread, a 1536 x 2048 weight warm in
 * cache, int8 per channel / int4 group 128, dot tiles vs panels: AVX-512 at 16 rows 1.05 / 1.11 ms,
 * 24 rows 1.60 / 1.72, 32 rows 2.15 / 1.70; AVX2 at 12 rows 1.30-1.48 / 1.40-1.44, 16 rows
 * 1.75-2.00 / 1.46-1.49. */
#ifndef QPANEL_MIN_ROWS
#if VF_PANEL_ROWS == 8
#define QPANEL_MIN_ROWS 26
#else
#define QPANEL_MIN_ROWS 13
#endif
#endif
#define QPANEL_PATH(n, D, F) ((n) >= QPANEL_MIN_ROWS && panel_fits(D, F))

/* The rows from which the panel GEMM runs (the tests place their cases by it). */
int64_t quant_panel_min_rows(void) { return QPANEL_MIN_ROWS; }

/* Row `row` of a packed weight (s->w: its qweight_t) widened: dst[k] = scale * q[k] + offset. */
static void qwiden_row(const wsrc_t* s, int64_t row, int64_t K, float* d) {
  const qweight_t* w = (const qweight_t*)s->w;
  const int64_t G = w->G, ng = K / G;
  const int64_t sb = row * ng;
  const float* of = w->offsets ? w->offsets + row * ng : 0;
  const uint8_t* q = w->q + row * (w->bits == 8 ? K : K / 2);
  for (int64_t g = 0; g < ng; g++) {
    const float sg = qscale(w, sb + g);
    const vf16 vs = vf_set1(sg), vo = vf_set1((of ? of[g] : 0.f) - (float)w->zero * sg);
    const int64_t k1 = (g + 1) * G;
    int64_t k = g * G;
    if (w->bits == 8) {
      for (; k + 16 <= k1; k += 16) vf_store(d + k, vf_fma(q8_load(q + k), vs, vo));
      if (k < k1) vf_storen(d + k, vf_fma(q8_loadn(q + k, k1 - k), vs, vo), k1 - k);
      continue;
    }
    for (; k + 32 <= k1; k += 32) {
      vf16 lo, hi;
      q4_load(q + k / 2, &lo, &hi);
      q4_interleave(vf_fma(lo, vs, vo), vf_fma(hi, vs, vo), d + k);
    }
    if (k < k1) { /* a group's last (k1 - k) / 2 bytes */
      vf16 lo, hi;
      float t[32];
      q4_loadn(q + k / 2, (k1 - k) / 2, &lo, &hi);
      q4_interleave(vf_fma(lo, vs, vo), vf_fma(hi, vs, vo), t);
      memcpy(d + k, t, (size_t)(k1 - k) * sizeof(float));
    }
  }
}

/* Rows [n0, ..) of a packed weight of K-long rows, as a weight of its own. */
static qweight_t qrows_from(const qweight_t* w, int64_t n0, int64_t K) {
  qweight_t r = *w;
  r.q += n0 * (w->bits == 8 ? K : K / 2);
  r.scales = (const char*)w->scales + n0 * (K / w->G) * (w->scales16 ? 2 : 4);
  if (r.offsets) r.offsets += n0 * (K / w->G);
  return r;
}

/* ---- int8 activations (opt-in: `act8`, the engine's --cpu-int8-activations) ----
 * Decode-sized calls may round each activation row to int8 per group of the weight's G codes, as
 * llama.cpp does (its Q8_0 activations; W8A8's per-token int8 where G = K): d = max|x| / 127,
 * xq = round(x / d) (ties to even), and take the products in integers:
 *   y[n] = sum_g scales[n, g] * d[g] * sum_{k in g} (q[n, k] - zero) * xq[k] + sum_g offsets[n, g] * xsum[g]
 * (xsum of the float activations). A step takes 64 bytes of a weight row: 128 int4 codes (the low
 * nibbles against the step's even activations, the high ones against its odd ones) or 64 int8 codes,
 * into 16 int32 lanes of 8 (int4) or 4 (int8) codes each; the zero code's term is each lane's start
 * value (-zero * its activations' sum), and each lane's sum is scaled by its group's scale times d
 * into float32. With AVX-512 VNNI a step is one or two vpdpbusd per activation row (unsigned codes
 * times signed activations), its nibbles split by a mask and a shift shared by the rows; elsewhere
 * the same sums in plain C (correct, not fast). Taken where a step holds whole groups or lies in
 * one (G a multiple of a lane's codes, 16 lanes a multiple of a group's or the reverse) and K is a
 * whole number of steps; other weights stay float. Calls of QP_MIN_ROWS rows or more take the int8
 * panel further down instead (AVX-512 VNNI), or the float panel GEMM (other builds). */
#define QA_LANES 16
#define QA_STEP_BYTES 64

static int qa_per_lane(int bits) { return bits == 4 ? 8 : 4; }
static int64_t qa_step_codes(int bits) { return bits == 4 ? 128 : 64; }

static int qa_fits(const qweight_t* w, int64_t K) {
  const int64_t per = qa_per_lane(w->bits), lpg = w->G / per;
  return w->act8 && K % qa_step_codes(w->bits) == 0 && w->G % per == 0 && (QA_LANES % lpg == 0 || lpg % QA_LANES == 0);
}

/* Calls that took the int8-activation tiles in this process (the tests check which path ran). */
static int64_t qa8_run;
int64_t quant_act8_run(void) { return qa8_run; }

#if defined(VF_AVX512) && defined(__AVX512VNNI__)
#define QA_VNNI 1
#else
#define QA_VNNI 0
#endif
#if defined(VF_AVX512)
#define QA_VEC 512
#elif defined(VF_AVX2)
#define QA_VEC 256
#else
#define QA_VEC 0
#endif
/* Without vpdpbusd, a byte pair's products are summed in 16 bits (vpmaddubsw), which 8-bit codes
 * (up to 255 x 127, twice) would overflow: there an int8 weight's codes are taken signed, q - 128
 * (their magnitude against the activation carrying their sign, as llama.cpp's AVX2 dot products do),
 * and the zero code's term becomes (128 - zero) times the lane's activation sum. */
#define QA_SIGNED8 (!QA_VNNI)

/* Whether this build's int8-activation tiles are vector code (AVX-512, with or without VNNI, and
 * AVX2): the engine rounds activations by default only where they are (plain C is correct, slow). */
int quant_act8_vector(void) { return QA_VEC != 0; }

static int32_t qa_zero_term(const qweight_t* w) { return w->bits == 8 && QA_SIGNED8 ? 128 - w->zero : -w->zero; }

#if QA_VEC == 512
/* s + each lane's 4 products of unsigned u and signed v bytes (no byte pair's sum over 32767 where
 * VNNI is missing: the callers' operands keep to that). */
VF_INLINE __m512i qa_dp512(__m512i s, __m512i u, __m512i v) {
#if QA_VNNI
  return _mm512_dpbusd_epi32(s, u, v);
#else
  return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u, v), _mm512_set1_epi16(1)));
#endif
}
#endif

/* G activations rounded to int8 in order (d = max|x| / 127, round to nearest even): returns d. */
static float qa_round_group(const float* x, int64_t G, int8_t* q) {
  int64_t k = 0;
#if QA_VEC == 512
  if (G % 16 == 0) {
    __m512 m = _mm512_setzero_ps();
    for (; k < G; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float d = _mm512_reduce_max_ps(m) / 127.f;
    const __m512 vd = _mm512_set1_ps(d > 0.f ? d : 1.f), lim = _mm512_set1_ps(127.f);
    for (k = 0; k < G; k += 16) {
      __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), vd),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = d > 0.f ? _mm512_max_ps(_mm512_min_ps(v, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim)) : _mm512_setzero_ps();
      _mm_storeu_si128((__m128i*)(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    return d;
  }
#elif QA_VEC == 256
  if (G % 8 == 0) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (; k < G; k += 8) m = _mm256_max_ps(m, _mm256_and_ps(absm, _mm256_loadu_ps(x + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.f;
    const __m256 vd = _mm256_set1_ps(d > 0.f ? d : 1.f), lim = _mm256_set1_ps(127.f);
    for (k = 0; k < G; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = d > 0.f ? _mm256_max_ps(_mm256_min_ps(v, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim)) : _mm256_setzero_ps();
      const __m256i i32 = _mm256_cvtps_epi32(v);
      const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
      _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(i16, i16));
    }
    return d;
  }
#endif
  float amax = 0.f;
  for (k = 0; k < G; k++) amax = fmaxf(amax, fabsf(x[k]));
  const float d = amax / 127.f;
  for (k = 0; k < G; k++) {
    float v = d > 0.f ? nearbyintf(x[k] / d) : 0.f;
    q[k] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
  }
  return d;
}

/* Row m of x (K floats) rounded to int8 per group of G, laid out for the steps (int4: each step's
 * 64 even codes' activations, then its 64 odd ones'); dl: each lane's d; zc: each lane's start, the
 * zero code's term (qa_zero_term) times the sum of its activations. */
static void qa_quantize(const float* x, int64_t K, const qweight_t* w, int8_t* xq, float* dl, int32_t* zc) {
  const int64_t G = w->G, per = qa_per_lane(w->bits), C = qa_step_codes(w->bits);
  const int32_t zt = qa_zero_term(w);
  for (int64_t g0 = 0; g0 < K; g0 += G) {
    const float d = qa_round_group(x + g0, G, xq + g0);
    for (int64_t l = g0 / per; l < (g0 + G) / per; l++) dl[l] = d;
  }
#if QA_VEC == 512
  const __m512i ones = _mm512_set1_epi8(1), mz = _mm512_set1_epi32(zt);
  for (int64_t c = 0; c < K; c += C) {
    __m512i sum;
    if (w->bits == 4) { /* the step's 128 codes in order -> its 64 even ones, then its 64 odd ones */
      const __m512i a = _mm512_loadu_si512((const void*)(xq + c)), b = _mm512_loadu_si512((const void*)(xq + c + 64));
      const __m512i lo8 = _mm512_set1_epi16(0xFF), fix = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
      const __m512i ev = _mm512_permutexvar_epi64(fix, _mm512_packus_epi16(_mm512_and_si512(a, lo8),
                                                                             _mm512_and_si512(b, lo8)));
      const __m512i od = _mm512_permutexvar_epi64(fix, _mm512_packus_epi16(_mm512_srli_epi16(a, 8),
                                                                             _mm512_srli_epi16(b, 8)));
      _mm512_storeu_si512((void*)(xq + c), ev);
      _mm512_storeu_si512((void*)(xq + c + 64), od);
      sum = qa_dp512(qa_dp512(_mm512_setzero_si512(), ones, ev), ones, od);
    } else {
      sum = qa_dp512(_mm512_setzero_si512(), ones, _mm512_loadu_si512((const void*)(xq + c)));
    }
    _mm512_storeu_si512((void*)(zc + c / per), _mm512_mullo_epi32(sum, mz));
  }
#else
  if (w->bits == 4)
    for (int64_t c = 0; c < K; c += C) {
      int8_t t[128];
      for (int64_t k = 0; k < 64; k++) {
        t[k] = xq[c + 2 * k];
        t[64 + k] = xq[c + 2 * k + 1];
      }
      memcpy(xq + c, t, sizeof t);
    }
  for (int64_t l = 0; l < K / per; l++) {
    /* a lane's codes: int4, its step's 4 bytes' low nibbles' activations and their high ones' */
    const int64_t c = l * per / C * C, b0 = (l * per - c) / (w->bits == 4 ? 2 : 1);
    int32_t sum = 0;
    for (int64_t t = 0; t < 4; t++) sum += xq[c + b0 + t] + (w->bits == 4 ? xq[c + 64 + b0 + t] : 0);
    zc[l] = zt * sum;
  }
#endif
}

/* The scales of a row's 16 lanes at step c (sp: the row's scales, float32). */
static inline void qa_lane_scales(const float* sp, int64_t c, int64_t C, int64_t G, int64_t per, float* out) {
  for (int l = 0; l < QA_LANES; l++) out[l] = sp[(c * C + l * per) / G];
}

/* Which scale each lane of a step takes, fixed for a weight (worked out once a tile, not per step
 * and row): step c's groups start at group c * gps where a step holds whole groups (gps > 0), at
 * c / spg where a group spans spg steps; lane l takes the step's group l >> shift (a group's lanes
 * 1 << shift of them; shift 4 where a group spans the step: every lane its first group), of the
 * step's ngroups. */
typedef struct {
  int64_t gps, spg;
  int shift, ngroups;
} qa_spread_t;

static qa_spread_t qa_spread(int64_t G, int64_t per) {
  const int64_t lpg = G / per; /* qa_fits: a power of two dividing 16, or a multiple of 16 */
  if (lpg >= QA_LANES) return (qa_spread_t){0, lpg / QA_LANES, 4, 1};
  return (qa_spread_t){QA_LANES / lpg, 0, __builtin_ctzll((unsigned long long)lpg), (int)(QA_LANES / lpg)};
}

VF_INLINE int64_t qa_step_group(const qa_spread_t* sp, int64_t c) { return sp->gps ? c * sp->gps : c / sp->spg; }

/* One tile of the int8-activation path: MBC rows (their xq, dl, zc, float group sums xs) against
 * weight rows n..n+nb; spr: the QNB rows' scales as float32. */
VF_INLINE void qtile_a8(const int8_t* const* xq, const float* const* dl, const int32_t* const* zc,
                        const float* const* xsr, const int MBC, const int BITS, const qweight_t* w,
                        const float* const* spr, int64_t n, int nb, int64_t K, float* y, int64_t ldy,
                        const uint8_t* pf) {
  const int64_t G = w->G, ng = K / G, per = qa_per_lane(BITS), C = qa_step_codes(BITS);
  const int64_t rowbytes = BITS == 8 ? K : K / 2, steps = K / C;
  const uint8_t* qp[QNB];
  VF_UNROLL4 for (int j = 0; j < QNB; j++) qp[j] = w->q + (n + (j < nb ? j : 0)) * rowbytes;
  float sums[QMB][QNB];
#if QA_VEC == 512
  __m512 acc[QMB][QNB];
  VF_UNROLL4 for (int i = 0; i < MBC; i++)
    VF_UNROLL4 for (int j = 0; j < QNB; j++) acc[i][j] = _mm512_setzero_ps();
  const __m512i lo4 = _mm512_set1_epi8(0x0F), x80 = _mm512_set1_epi8((char)0x80);
  const qa_spread_t spread = qa_spread(G, per);
  const __m512i sidx = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         spread.shift);
  const __mmask16 smask = (__mmask16)((1u << spread.ngroups) - 1u);
  for (int64_t c = 0; c < steps; c++) {
    if (pf) /* the tile QPF on: its QNB rows are QNB * steps lines, QNB of them a step */
      VF_UNROLL4 for (int u = 0; u < QNB; u++) vf_prefetch_l2(pf + (c * QNB + u) * QA_STEP_BYTES);
    const int64_t g0 = qa_step_group(&spread, c);
    VF_UNROLL4 for (int j = 0; j < QNB; j++) {
      const __m512i b = _mm512_loadu_si512((const void*)(qp[j] + c * QA_STEP_BYTES));
      /* the step's groups' scales spread over their lanes */
      const __m512 sv = _mm512_permutexvar_ps(sidx, _mm512_maskz_loadu_ps(smask, spr[j] + g0));
      /* int4: the low and high nibbles; int8 without VNNI: the codes less 128, as magnitudes (lo)
       * and signs (neg, moved onto the activations) */
      __m512i lo = b, hi = b;
      __mmask64 neg = 0;
      if (BITS == 4) {
        lo = _mm512_and_si512(b, lo4);
        hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo4);
      } else if (QA_SIGNED8) {
        const __m512i s8 = _mm512_xor_si512(b, x80);
        lo = _mm512_abs_epi8(s8);
        neg = _mm512_movepi8_mask(s8);
      }
      VF_UNROLL4 for (int i = 0; i < MBC; i++) {
        __m512i s = _mm512_loadu_si512((const void*)(zc[i] + c * QA_LANES));
        __m512i xa = _mm512_loadu_si512((const void*)(xq[i] + c * C));
        if (BITS == 8 && QA_SIGNED8) xa = _mm512_mask_sub_epi8(xa, neg, _mm512_setzero_si512(), xa);
        s = qa_dp512(s, lo, xa);
        if (BITS == 4) s = qa_dp512(s, hi, _mm512_loadu_si512((const void*)(xq[i] + c * C + 64)));
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sv, _mm512_loadu_ps(dl[i] + c * QA_LANES)),
                                    acc[i][j]);
      }
    }
  }
  VF_UNROLL4 for (int i = 0; i < MBC; i++)
    VF_UNROLL4 for (int j = 0; j < QNB; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif QA_VEC == 256
  /* a weight row at a time (the accumulators of a whole tile would not fit 16 registers), each step
   * as two halves of 8 lanes; the rows' other bytes are in L1 from the first row's pass */
  const __m256i lo4 = _mm256_set1_epi8(0x0F), x80 = _mm256_set1_epi8((char)0x80), one16 = _mm256_set1_epi16(1);
  /* the lanes' scales (qa_spread): half h's first group, its lanes' groups from there, and how many */
  const qa_spread_t spread = qa_spread(G, per);
  const __m256i lane8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sidx = _mm256_srlv_epi32(lane8, _mm256_set1_epi32(spread.shift));
  const __m256i smask = _mm256_cmpgt_epi32(_mm256_set1_epi32(8 >> spread.shift ? 8 >> spread.shift : 1), lane8);
  const int64_t half_group = 8 >> spread.shift; /* the groups before the second half's first lane */
  for (int j = 0; j < nb; j++) {
    __m256 acc[QMB];
    VF_UNROLL4 for (int i = 0; i < MBC; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < steps; c++) {
      if (pf && j == 0)
        VF_UNROLL4 for (int u = 0; u < QNB; u++) vf_prefetch_l2(pf + (c * QNB + u) * QA_STEP_BYTES);
      const int64_t g0 = qa_step_group(&spread, c);
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(qp[j] + c * QA_STEP_BYTES + 32 * h));
        const __m256 sv = _mm256_permutevar8x32_ps(_mm256_maskload_ps(spr[j] + g0 + h * half_group, smask), sidx);
        const __m256i s8 = _mm256_xor_si256(b, x80);
        const __m256i lo = BITS == 4 ? _mm256_and_si256(b, lo4) : _mm256_abs_epi8(s8);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4);
        VF_UNROLL4 for (int i = 0; i < MBC; i++) {
          const __m256i xa = _mm256_loadu_si256((const __m256i*)(xq[i] + c * C + 32 * h));
          __m256i p; /* byte pairs' sums in 16 bits: int4 at most 2 x 2 x 15 x 127, int8 2 x 128 x 127 */
          if (BITS == 4)
            p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa),
                                 _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq[i] + c * C + 64 + 32 * h))));
          else
            p = _mm256_maddubs_epi16(lo, _mm256_sign_epi8(xa, s8));
          const __m256i s = _mm256_add_epi32(_mm256_loadu_si256((const __m256i*)(zc[i] + c * QA_LANES + 8 * h)),
                                             _mm256_madd_epi16(p, one16));
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sv, _mm256_loadu_ps(dl[i] + c * QA_LANES + 8 * h)),
                                   acc[i]);
        }
      }
    }
    VF_UNROLL4 for (int i = 0; i < MBC; i++) sums[i][j] = vf_hsum8_(acc[i]);
  }
#else
  (void)pf;
  for (int i = 0; i < MBC; i++)
    for (int j = 0; j < QNB; j++) {
      float t = 0.f;
      for (int64_t c = 0; c < steps; c++) {
        float sl[QA_LANES];
        qa_lane_scales(spr[j], c, C, G, per, sl);
        const uint8_t* b = qp[j] + c * QA_STEP_BYTES;
        for (int l = 0; l < QA_LANES; l++) {
          int32_t s = zc[i][c * QA_LANES + l];
          for (int u = 0; u < 4; u++) { /* the lane's 4 bytes */
            const int byte = b[4 * l + u];
            if (BITS == 4)
              s += (byte & 15) * xq[i][c * C + 4 * l + u] + (byte >> 4) * xq[i][c * C + 64 + 4 * l + u];
            else
              s += (byte - (QA_SIGNED8 ? 128 : 0)) * xq[i][c * C + 4 * l + u];
          }
          t += (float)s * (sl[l] * dl[i][c * QA_LANES + l]);
        }
      }
      sums[i][j] = t;
    }
#endif
  for (int i = 0; i < MBC; i++)
    for (int j = 0; j < nb; j++) {
      float s = sums[i][j];
      if (w->offsets) {
        const float* o = w->offsets + (n + j) * ng;
        float t = 0.f;
        for (int64_t g = 0; g < ng; g++) t += o[g] * xsr[i][g];
        s += t;
      }
      y[i * ldy + j] = s;
    }
}

/* A qgemm call's operands: float activation rows a (K floats each, contiguous; split4's layout for
 * int4) for the float tiles, or quantized ones xq, dl, zc (qa_quantize's) for the int8-activation
 * tiles; xsum the rows' float group sums. The int8 panel's: xq the rows rounded in order, dl each
 * group's d, zc each group's activation sum (M x K/G each), a NULL. */
typedef struct {
  const float* a;
  const float* xsum;
  const int8_t* xq;
  const float* dl;
  const int32_t* zc;
  int64_t M;
  const qweight_t* w;
  int64_t K;
  float* y;
  int64_t ldy;
} qgemm_ctx;

/* Rows [n0, n1) of y = x @ W^T for a qgemm_ctx (run_blocks' block function). Returns 0, or -1
 * without memory for a tile's widened float16 scales (rows of over QSC_STACK groups). */
static int qgemm_block(const void* ctx, int64_t n0, int64_t n1) {
  const qgemm_ctx* c = (const qgemm_ctx*)ctx;
  const qweight_t* w = c->w;
  const int64_t K = c->K, M = c->M, ldy = c->ldy, ng = K / w->G, rowbytes = w->bits == 8 ? K : K / 2;
  const int64_t lanes = K / qa_per_lane(w->bits);
  float stack_scales[w->scales16 && ng <= QSC_STACK ? QNB * ng : 1];
  float* wide = w->scales16 && ng > QSC_STACK ? malloc((size_t)(QNB * ng) * sizeof(float)) : stack_scales;
  if (!wide) return -1;
  for (int64_t n = n0; n < n1; n += QNB) {
    const int nb = n1 - n < QNB ? (int)(n1 - n) : QNB;
    const float* spr[QNB];
    tile_scales(w, n, nb, ng, wide, spr);
    for (int64_t m0 = 0; m0 < M; m0 += QMB) {
      const int mb = M - m0 < QMB ? (int)(M - m0) : QMB;
      const float* ar[QMB];
      const float* xs[QMB];
      const int8_t* xr[QMB];
      const float* dr[QMB];
      const int32_t* zr[QMB];
      for (int i = 0; i < QMB; i++) {
        const int64_t m = m0 + (i < mb ? i : 0);
        ar[i] = c->a ? c->a + m * K : 0;
        xs[i] = c->xsum ? c->xsum + m * ng : 0;
        xr[i] = c->xq ? c->xq + m * K : 0;
        dr[i] = c->dl ? c->dl + m * lanes : 0;
        zr[i] = c->zc ? c->zc + m * lanes : 0;
      }
      float* yt = c->y + m0 * ldy + n;
      /* the rows QPF tiles on, into L2 while the first activation tile runs (short rows are too
       * short for the hardware prefetcher) */
      const uint8_t* pf = m0 == 0 && n + (QPF + 1) * QNB <= n1 ? w->q + (n + QPF * QNB) * rowbytes : 0;
#define QTILE_(MBC)                                                                                     \
  case MBC:                                                                                             \
    if (c->xq && w->bits == 8)                                                                          \
      qtile_a8(xr, dr, zr, xs, MBC, 8, w, spr, n, nb, K, yt, ldy, pf);                                  \
    else if (c->xq)                                                                                     \
      qtile_a8(xr, dr, zr, xs, MBC, 4, w, spr, n, nb, K, yt, ldy, pf);                                  \
    else if (w->bits == 8)                                                                              \
      qtile(ar, xs, MBC, 8, w, spr, n, nb, K, yt, ldy, pf);                                             \
    else                                                                                                \
      qtile(ar, xs, MBC, 4, w, spr, n, nb, K, yt, ldy, pf);                                             \
    break;
      switch (mb) {
        QTILE_(1)
        QTILE_(2)
        QTILE_(3)
        QTILE_(4)
      }
#undef QTILE_
    }
  }
  if (wide != stack_scales) free(wide);
  return 0;
}

/* An int8-activation call's buffers (scratch slots 2, 3): M rows of K codes, M rows of `per_row`
 * floats and ints, and the rows' float group sums where the weight has offsets (else NULL). */
static int qa_buffers(int64_t M, int64_t K, int64_t per_row, const qweight_t* w, int8_t** xq, float** f,
                      int32_t** i, float** xsum) {
  char* buf = scratch(2, (size_t)(M * K) + (size_t)(M * per_row) * (sizeof(float) + sizeof(int32_t)) + 64);
  *xsum = w->offsets ? scratch(3, (size_t)(M * (K / w->G)) * sizeof(float)) : 0;
  if (!buf || (w->offsets && !*xsum)) return -1;
  *f = (float*)buf;
  *i = (int32_t*)(*f + M * per_row);
  *xq = (int8_t*)(*i + M * per_row);
  return 0;
}

/* qgemm's int8-activation form (qa_fits): the rows quantized once, then the row blocks. */
static int qgemm_a8(const float* x, int64_t ldx, int64_t M, const qweight_t* w, int64_t K, int64_t N, float* y,
                    int64_t ldy, int nt) {
  const int64_t lanes = K / qa_per_lane(w->bits);
  int8_t* xq;
  float *dl, *xsum;
  int32_t* zc;
  if (qa_buffers(M, K, lanes, w, &xq, &dl, &zc, &xsum)) return -1;
  for (int64_t m = 0; m < M; m++) qa_quantize(x + m * ldx, K, w, xq + m * K, dl + m * lanes, zc + m * lanes);
  if (xsum) group_sums(x, ldx, M, K, w->G, xsum);
  __atomic_fetch_add(&qa8_run, 1, __ATOMIC_RELAXED); /* (experts by thread: calls from each thread) */
  const qgemm_ctx ctx = {0, xsum, xq, dl, zc, M, w, K, y, ldy};
  return run_blocks(qgemm_block, &ctx, N, nt);
}

/* ---- Many activation rows with int8 activations (AVX-512 VNNI): an outer-product panel in integers ----
 * Where the dot-product tiles above reduce each output across its lanes, this panel keeps 16 outputs
 * in the lanes of one register: a block of 16 weight rows is laid out once (each 4 codes of a row a
 * dword, the 16 rows' dwords of the same 4 codes side by side: int4 codes widened to a byte), then
 * every activation row passes it QP_R rows at a time, one vpdpbusd per 4 codes against the row's 4
 * int8 activations broadcast (64 products), summed in int32 over a group and scaled into float32
 * once a group: (sum - zero * the group's activation sum) * scale * d, plus offset * the float sum.
 * The activations are rounded as the tiles' (d = max|x| / 127 per group of G, in order). Taken for
 * QP_MIN_ROWS rows or more (act8 weights whose G is a multiple of 4); fewer rows take the tiles.
 * Without VNNI, int8 codes would overflow vpmaddubsw's 16-bit pairs against broadcast activations:
 * those builds keep the float panel. */
#define QP_NB 16 /* weight rows (outputs) per block: one register of int32 sums per activation row */
#define QP_R 8   /* activation rows per micro-tile */
#ifndef QP_MIN_ROWS
#define QP_MIN_ROWS 16
#endif

static int qp_fits(const qweight_t* w, int64_t K, int64_t M) {
  return QA_VNNI && w->act8 && M >= QP_MIN_ROWS && w->G % 4 == 0 && K % w->G == 0;
}

/* Calls the int8 panel took in this process, and the rows it takes from (0: never, on this build):
 * the tests check which path ran. */
static int64_t qp8_run;
int64_t quant_act8_panels_run(void) { return qp8_run; }
int64_t quant_act8_panel_min_rows(void) { return QA_VNNI ? QP_MIN_ROWS : 0; }

#if QA_VNNI
/* A 16 x 16 matrix of dwords, r[j] its row j, transposed in place (r[t]: column t): pairs of rows
 * interleaved by dword, then by qword, then the 128-bit lanes of 4 rows' results transposed. */
static inline void qp_transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { /* u[i + e], lane k: rows i..i+3 of column 4k + e */
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int e = 0; e < 4; e++) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44),
                  v3 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
    r[e] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + e] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

/* Weight rows n..n+nb (nb <= 16; the others zero) laid out for the panel: pk[(c * 16 + j) * 4 + t] =
 * code 4c + t of row n + j; sc / of: [group][16] scales / offsets (0 past nb; of only with offsets).
 * tmp: the 16 rows' int4 codes widened a byte each (K bytes a row), then their float16 scales
 * widened (ng floats a row). */
static void qpanel_pack(const qweight_t* w, int64_t n, int nb, int64_t K, uint8_t* pk, float* sc, float* of,
                        uint8_t* tmp) {
  const int64_t ng = K / w->G, rowbytes = w->bits == 8 ? K : K / 2;
  const uint8_t* rows[QP_NB];
  for (int j = 0; j < QP_NB; j++) {
    const uint8_t* q = w->q + (n + (j < nb ? j : 0)) * rowbytes;
    if (w->bits == 8) {
      rows[j] = q;
      continue;
    }
    uint8_t* t = tmp + (int64_t)j * K; /* byte b's low nibble is code 2b, its high one code 2b + 1 */
    int64_t b = 0;
    for (; b + 32 <= K / 2; b += 32) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + b)));
      const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi16(0x0F)), hi = _mm512_srli_epi16(v, 4);
      _mm512_storeu_si512((void*)(t + 2 * b), _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(hi, _mm512_set1_epi16(0x0F)), 8)));
    }
    for (; b < K / 2; b++) {
      t[2 * b] = q[b] & 15;
      t[2 * b + 1] = q[b] >> 4;
    }
    rows[j] = t;
  }
  const __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 live = (__mmask16)((1u << nb) - 1u);
  /* dwords c..c+15 of the 16 rows (zero past nb), transposed in registers into dword c's 16 rows,
   * dword c+1's, ...: a gather a dword was as slow as the panel's products on AMD's Zen 5 */
  const int64_t nd = K / 4;
  for (int64_t c = 0; c < nd; c += 16) {
    const int nt = nd - c < 16 ? (int)(nd - c) : 16;
    const __mmask16 tm = (__mmask16)((1u << nt) - 1u);
    __m512i r[16];
    for (int j = 0; j < QP_NB; j++)
      r[j] = j < nb ? _mm512_maskz_loadu_epi32(tm, (const void*)(rows[j] + 4 * c)) : _mm512_setzero_si512();
    qp_transpose16(r);
    for (int t = 0; t < nt; t++) _mm512_store_si512((void*)(pk + (c + t) * 64), r[t]);
  }
  /* the scales (and offsets) by group, 16 rows side by side: the rows' float32 scales (widened once
   * into tmp's first ng * 16 floats where float16) gathered a group at a time */
  const float* s32 = (const float*)w->scales + n * ng;
  if (w->scales16) {
    float* wide = (float*)tmp;
    for (int j = 0; j < nb; j++) q_f16_row((const uint16_t*)w->scales + (n + j) * ng, wide + j * ng, ng);
    s32 = wide;
  }
  const __m512i gstep = _mm512_mullo_epi32(idx, _mm512_set1_epi32((int)ng));
  for (int64_t g = 0; g < ng; g++) {
    _mm512_store_ps(sc + g * QP_NB, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, gstep, s32 + g, 4));
    if (w->offsets)
      _mm512_store_ps(of + g * QP_NB, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, gstep,
                                                                w->offsets + n * ng + g, 4));
  }
}

/* MR activation rows from m0 against a packed block (qpanel_pack): y[m, n..n+nb). */
VF_INLINE void qpanel_micro(const qgemm_ctx* c, const uint8_t* pk, const float* sc, const float* of, int64_t m0,
                            const int MR, int64_t n, int nb) {
  const int64_t K = c->K, G = c->w->G, ng = K / G;
  const int32_t zero = c->w->zero;
  __m512 acc[QP_R];
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; g++) {
    __m512i s[QP_R];
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) s[i] = _mm512_setzero_si512();
    const uint8_t* wp = pk + g * G * QP_NB;
    for (int64_t kk = 0; kk < G / 4; kk++) {
      const __m512i wv = _mm512_load_si512((const void*)(wp + kk * 64));
      _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {
        int32_t xb;
        memcpy(&xb, c->xq + (m0 + i) * K + g * G + 4 * kk, 4);
        s[i] = _mm512_dpbusd_epi32(s[i], wv, _mm512_set1_epi32(xb));
      }
    }
    const __m512 sv = _mm512_load_ps(sc + g * QP_NB);
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {
      const int64_t r = (m0 + i) * ng + g;
      const __m512i t = zero ? _mm512_sub_epi32(s[i], _mm512_set1_epi32(zero * c->zc[r])) : s[i];
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sv, _mm512_set1_ps(c->dl[r])), acc[i]);
      if (c->xsum) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(of + g * QP_NB), _mm512_set1_ps(c->xsum[r]), acc[i]);
    }
  }
  const __mmask16 live = (__mmask16)((1u << nb) - 1u);
  _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) _mm512_mask_storeu_ps(c->y + (m0 + i) * c->ldy + n, live, acc[i]);
}

/* Rows [n0, n1) of the outputs (run_blocks_of's block function), 16 at a time. */
static int qpanel_block(const void* ctx, int64_t n0, int64_t n1) {
  const qgemm_ctx* c = (const qgemm_ctx*)ctx;
  const int64_t K = c->K, ng = K / c->w->G;
  const size_t pkb = (size_t)(K * QP_NB), scb = (size_t)(ng * QP_NB) * sizeof(float);
  /* tmp: int4 rows widened (K bytes each), then float16 scales widened (ng floats a row) */
  const size_t tmpb = (c->w->bits == 4 ? pkb : 0) + (c->w->scales16 ? scb : 0);
  uint8_t* buf = scratch(PANEL_SLOT_W, pkb + 2 * scb + tmpb + 64);
  if (!buf) return -1;
  uint8_t* pk = buf;
  float* sc = (float*)(buf + pkb);
  float* of = sc + ng * QP_NB;
  uint8_t* tmp = (uint8_t*)(of + ng * QP_NB);
  for (int64_t n = n0; n < n1; n += QP_NB) {
    const int nb = n1 - n < QP_NB ? (int)(n1 - n) : QP_NB;
    qpanel_pack(c->w, n, nb, K, pk, sc, of, tmp);
    if (n + QP_NB < n1) { /* the next block's rows into L2 while this one's products run */
      const int64_t rowbytes = c->w->bits == 8 ? K : K / 2, next = n1 - n - QP_NB < QP_NB ? n1 - n - QP_NB : QP_NB;
      const uint8_t* q = c->w->q + (n + QP_NB) * rowbytes;
      for (int64_t o = 0; o < next * rowbytes; o += 64) vf_prefetch_l2(q + o);
    }
    for (int64_t m0 = 0; m0 < c->M; m0 += QP_R) {
      switch (c->M - m0 < QP_R ? (int)(c->M - m0) : QP_R) {
#define QPM_(MR) \
  case MR:       \
    qpanel_micro(c, pk, sc, of, m0, MR, n, nb); \
    break;
        QPM_(1) QPM_(2) QPM_(3) QPM_(4) QPM_(5) QPM_(6) QPM_(7) QPM_(8)
#undef QPM_
      }
    }
  }
  return 0;
}
#endif

/* y = x @ W^T by the int8 panel (qp_fits): the rows rounded once, then blocks of 16 outputs over
 * the threads. */
static int qpanel_a8(const float* x, int64_t ldx, int64_t M, const qweight_t* w, int64_t K, int64_t N, float* y,
                     int64_t ldy, int nt) {
#if QA_VNNI
  const int64_t G = w->G, ng = K / G;
  int8_t* xq;
  float *d, *xs;
  int32_t* sq;
  if (qa_buffers(M, K, ng, w, &xq, &d, &sq, &xs)) return -1;
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < ng; g++) {
      int8_t* q = xq + m * K + g * G;
      d[m * ng + g] = qa_round_group(x + m * ldx + g * G, G, q);
      int32_t s = 0;
      for (int64_t k = 0; k < G; k++) s += q[k];
      sq[m * ng + g] = s;
    }
  if (xs) group_sums(x, ldx, M, K, G, xs);
  __atomic_fetch_add(&qp8_run, 1, __ATOMIC_RELAXED);
  const qgemm_ctx ctx = {0, xs, xq, d, sq, M, w, K, y, ldy};
  return run_blocks_of(qpanel_block, &ctx, N, QP_NB, nt);
#else
  (void)x, (void)ldx, (void)M, (void)w, (void)K, (void)N, (void)y, (void)ldy, (void)nt;
  return -2;
#endif
}

/* Panel GEMMs run so far by this process: linear calls and expert panel groups (the tests check
 * which path a shape takes). */
static int64_t qpanels_run;
int64_t quant_panels_run(void) { return qpanels_run; }

/* y (M x N, rows ldy apart) = x (M x K, rows ldx apart) @ W^T, W packed (N, K): from QPANEL_MIN_ROWS
 * rows, its whole blocks of RB rows by the panel GEMM (scratch: panel.h's), the rest (and fewer rows)
 * by the dot-product tiles (scratch slots 2, 3).
 * Returns 0, -1 without scratch memory, -2 for a weight the kernels do not take (bits other than
 * 4 or 8, G not dividing K, an odd G for int4). */
static int qgemm(const float* x, int64_t ldx, int64_t M, const qweight_t* w, int64_t K, int64_t N, float* y,
                 int64_t ldy, int nt) {
  if (!qweight_ok(w, K)) return -2;
  if (M <= 0 || N <= 0) return 0;
  qweight_t rest;
  const int panels = M >= QPANEL_MIN_ROWS && N >= RB;
  if (qp_fits(w, K, M)) return qpanel_a8(x, ldx, M, w, K, N, y, ldy, nt); /* many rows, int8 activations */
  if (!panels && qa_fits(w, K)) return qgemm_a8(x, ldx, M, w, K, N, y, ldy, nt); /* decode-sized, int8 activations */
  if (panels) {
    const wsrc_t ws = {w, qwiden_row};
    if (panel_linear(x, ldx, M, &ws, 0, K, N, y, ldy, nt)) return -1;
    qpanels_run++;
    const int64_t done = N / RB * RB;
    if (done == N) return 0;
    rest = qrows_from(w, done, K);
    w = &rest;
    y += done;
    N -= done;
  }
  const int64_t ng = K / w->G;
  float* xsum = scratch(3, (size_t)(M * ng) * sizeof(float));
  if (!xsum) return -1;
  group_sums(x, ldx, M, K, w->G, xsum);
  const float* a = x;
  if (w->bits == 4 || ldx != K) {
    float* s = scratch(2, (size_t)(M * K) * sizeof(float));
    if (!s) return -1;
    if (w->bits == 4)
      split4(x, ldx, M, K, w->G, s);
    else
      for (int64_t m = 0; m < M; m++) memcpy(s + m * K, x + m * ldx, (size_t)K * sizeof(float));
    a = s;
  }
  const qgemm_ctx ctx = {a, xsum, 0, 0, 0, M, w, K, y, ldy};
  return run_blocks(qgemm_block, &ctx, N, nt);
}

/* y[M, N] = x[M, K] @ W^T, W packed (q, bits, scales (float32, or float16 where scales16), offsets or NULL, zero code, group size G): decode and
 * small batches, the packed weight streamed once. Returns 0, -1 without scratch memory, -2 for a
 * weight it does not take (see qgemm). */
int quant_linear_f32(const float* x, int64_t ldx, int64_t M, const uint8_t* q, int bits, const void* scales,
                     int scales16, const float* offsets, int zero, int64_t G, int64_t K, int64_t N, float* y,
                     int64_t ldy, int act8, int nt) {
  const qweight_t w = {q, scales, offsets, G, bits, zero, scales16, act8};
  return qgemm(x, ldx, M, &w, K, N, y, ldy, nt);
}

/* The expert e of E packed weights of (N, K) each, back to back. */
static qweight_t expert_of(const qweight_t* w, int64_t e, int64_t N, int64_t K) { return qrows_from(w, e * N, K); }

/* One routed expert's decode-sized pass: its n pairs pe[0..n) gathered from x, gate/up, SiLU-and-mul
 * and down. Returns the n output rows (D floats each, in xs), 0 for -1 / -2 in *rc (as qgemm).
 * xs: scratch of n * (D + 2F + F + D) floats. */
static const float* qexpert_rows(const float* x, int64_t D, const int64_t* pe, int64_t n, int64_t K,
                                 const qweight_t* gu, const qweight_t* dn, int64_t F, float* xs, int nt, int* rc) {
  float* h = xs + n * D;
  float* act = h + n * 2 * F;
  float* y = act + n * F;
  gather_rows(x, D, pe, n, K, xs);
  *rc = qgemm(xs, D, n, gu, D, 2 * F, h, 2 * F, nt);
  if (*rc) return 0;
  for (int64_t i = 0; i < n; i++) silu_mul_row(h + i * 2 * F, h + i * 2 * F + F, act + i * F, F);
  *rc = qgemm(act, F, n, dn, F, D, y, D, nt);
  return *rc ? 0 : y;
}

/* Calls that gave whole experts to each thread (common.h `experts_by_thread`) in this process. */
static int64_t qby_thread_run;
int64_t quant_experts_by_thread_run(void) { return qby_thread_run; }

typedef struct {
  const float* x;
  int64_t D, K, F;
  const qweight_t *w13, *w2;
} qexperts_ctx;

static const float* qexpert_pass(const void* ctx, int64_t e, const int64_t* pe, int64_t n, float* xs, int* rc) {
  const qexperts_ctx* c = (const qexperts_ctx*)ctx;
  const qweight_t gu = expert_of(c->w13, e, 2 * c->F, c->D), dn = expert_of(c->w2, e, c->D, c->F);
  return qexpert_rows(c->x, c->D, pe, n, c->K, &gu, &dn, c->F, xs, 1, rc);
}

/* moe.c's moe_experts_f32 (its decode path) over packed experts: x [T, D]; ids [T, K] int64 (an id
 * outside [0, E) contributes nothing); wts [T, K] float32; gate_up (E, 2F, D) packed (gate rows then
 * up rows) and down (E, D, F) packed, each with its own bits, scales (float32 or float16: s*_16), offsets (or NULL), zero code and group
 * size; out [T, D] = sum_k wts * down(silu(gate) * up), overwritten. Each routed expert's weights
 * are streamed once, whatever its number of rows. Returns 0, -1 without scratch memory, -2 for
 * weights the kernels do not take (checked first: out is then untouched). */
int quant_experts_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                      const uint8_t* q13, int bits13, const void* s13, int s13_16, const float* o13, int z13,
                      int64_t G13, const uint8_t* q2, int bits2, const void* s2, int s2_16, const float* o2, int z2,
                      int64_t G2, int64_t E, int64_t F, float* out, int act8, int nt) {
  const qweight_t w13 = {q13, s13, o13, G13, bits13, z13, s13_16, act8}, w2 = {q2, s2, o2, G2, bits2, z2, s2_16, act8};
  if (!qweight_ok(&w13, D) || !qweight_ok(&w2, F)) return -2;
  const int64_t P = T * K;
  int64_t* start = scratch(0, (size_t)(2 * E + 1 + P) * sizeof(int64_t));
  if (!start) return -1;
  int64_t* order = start + 2 * E + 1;
  const int64_t rows = sort_by_expert(ids, P, E, start, start + E + 1, order);
  /* the dot-product tiles' rows: at most QPANEL_MIN_ROWS - 1 where experts with more take the panels */
  /* (experts with int8 activations take the int8 panel through qgemm where they have the rows) */
  const int panels = QPANEL_PATH(rows, D, F) && !(QA_VNNI && act8 && G13 % 4 == 0 && G2 % 4 == 0);
  int64_t most = 0; /* the most rows an expert has */
  for (int64_t e = 0; e < E; e++) most = start[e + 1] - start[e] > most ? start[e + 1] - start[e] : most;
  const int64_t small = panels ? QPANEL_MIN_ROWS - 1 : most;
  if (!panels && experts_by_thread_fits(start, E, K, nt)) {
    const qexperts_ctx ctx = {x, D, K, F, &w13, &w2};
    qby_thread_run++;
    return experts_by_thread(T, D, ids, start, order, E, K, wts, (size_t)(rows * (D + 2 * F + F + D)), qexpert_pass,
                             &ctx, out, nt);
  }
  float* xs = scratch(1, (size_t)(small * (D + 2 * F + F + D)) * sizeof(float));
  float *pxs, *pwbuf;
  if (!xs || (panels && panel_expert_scratch(D, F, 1, nt, &pxs, &pwbuf))) return -1;
  memset(out, 0, (size_t)(T * D) * sizeof(float));
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = start[e + 1] - start[e];
    if (!n) continue;
    const int64_t* pe = order + start[e];
    const qweight_t gu = expert_of(&w13, e, 2 * F, D), dn = expert_of(&w2, e, D, F);
    if (panels && QPANEL_PATH(n, D, F)) {
      const wsrc_t pgu = {&gu, qwiden_row}, pdn = {&dn, qwiden_row};
      const int64_t groups = panel_expert(x, T, D, pe, n, wts, K, &pgu, &pdn, F, out, nt);
      if (groups < 0) return -1;
      qpanels_run += groups;
      continue;
    }
    int rc;
    const float* y = qexpert_rows(x, D, pe, n, K, &gu, &dn, F, xs, nt, &rc);
    if (rc) return rc;
    add_weighted_rows(out, D, pe, n, K, wts, y);
  }
  return 0;
}
