/* FP8 key/value caches (vLLM's --kv-cache-dtype fp8_e4m3 / fp8_e5m2) for the CPU kernels: one byte
 * per element, widened exactly to float32 in registers when read, and written from float32 the way
 * torch's `x.clamp(-max, max).to(torch.float8_e4m3fn)` (resp. float8_e5m2) writes it: round to
 * nearest even, saturating to the finite max (e4m3fn +-448, e5m2 +-57344), NaN kept NaN.
 *
 *   e4m3fn  s eeee mmm  bias 7, no infinities: 0x7f / 0xff are NaN; subnormals m * 2^-9
 *   e5m2    s eeeee mm  bias 15, IEEE-like (the top byte of a half): inf, NaN; subnormals m * 2^-16
 *
 * Widening is vectorised for AVX-512 and AVX2 through the half conversion (F16C: e5m2 is a half's
 * top byte, e4m3fn a half rebiased and scaled by 2^8; the conversion widens half subnormals whatever
 * MXCSR's denormals-are-zero mode); on NEON lane-wise and in plain C per element, building the
 * float32 bits with integer operations (a subnormal's mantissa converted as an integer and scaled by
 * a power of two: every float operand normal, so a flush-to-zero mode changes nothing).
 * KV_F32 names a float32 cache. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "vec.h"

enum { KV_F32 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

VF_INLINE float fp8_bits_f32_(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* One FP8 byte of format fmt (KV_E4M3 or KV_E5M2) as the float32 it is, exactly. */
VF_INLINE float fp8_to_f32(uint8_t b, int fmt) {
  const uint32_t sign = (uint32_t)(b & 0x80) << 24, em = b & 0x7f;
  float a;
  if (fmt == KV_E4M3) {
    if (em == 0x7f) return NAN;
    a = em < 8 ? (float)em * (1.f / 512) : fp8_bits_f32_((em << 20) + (120u << 23));
  } else {
    if (em >= 0x7c) return em == 0x7c ? (sign ? -INFINITY : INFINITY) : NAN;
    a = em < 4 ? (float)em * (1.f / 65536) : fp8_bits_f32_((em << 21) + (112u << 23));
  }
  uint32_t u;
  memcpy(&u, &a, 4);
  return fp8_bits_f32_(u | sign);
}

/* x as an FP8 byte of format fmt: saturated to the finite max, rounded to nearest even (what torch
 * gives for x.clamp(-max, max).to(float8)); NaN as 0x7f with x's sign. Branch-free (both roundings
 * computed, one selected), so that a loop of it vectorises. */
VF_INLINE uint8_t f32_to_fp8(float x, int fmt) {
  uint32_t u;
  memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 24) & 0x80;
  u &= 0x7fffffffu;
  const uint32_t nan = u > 0x7f800000u;
  /* m bits of mantissa, the format's exponent bias (7 / 15) as float32's minus `rebias`; the
   * finite max (448, 57344) */
  const uint32_t m = fmt == KV_E4M3 ? 3 : 2, rebias = fmt == KV_E4M3 ? 120 : 112;
  const uint32_t maxbits = fmt == KV_E4M3 ? 0x43e00000u : 0x47600000u;
  u = u < maxbits ? u : maxbits; /* inf too; NaN selected below */
  const uint32_t e = u >> 23, sh = 23 - m;
  /* a normal: the mantissa rounded to m bits in place (a carry moves into the exponent), rebiased */
  const uint32_t nrm = ((u + (1u << (sh - 1)) - 1 + ((u >> sh) & 1)) >> sh) - (rebias << m);
  /* below the smallest normal: a multiple of the subnormal step, the significand shifted right by
   * s >= 21 (past 31 everything shifts out: clamped to 31, the significand is below 2^24) */
  const uint32_t mant = (u & 0x7fffffu) | (e ? 0x800000u : 0);
  uint32_t s = rebias + 1 + 23 - m - (e ? e : 1);
  s = s < 31 ? s : 31;
  const uint32_t q = mant >> s, r = mant & ((1u << s) - 1), h = 1u << (s - 1);
  const uint32_t sub = q + (r > h || (r == h && (q & 1)));
  const uint32_t code = nan ? 0x7f : e <= rebias ? sub : nrm;
  return (uint8_t)(sign | code);
}

/* ---- 16 FP8 bytes at p widened to a vf16 ---- */
#if defined(VF_AVX512) || defined(VF_AVX2)
/* The 16 bytes as the halves whose float32 values are the FP8 values, exactly: e5m2's byte is a
 * half's top byte; e4m3fn's s eeee mmm becomes the half s 0eeee mmm0000000 (2^-8 times its value:
 * normals rebiased from 7 to 15, subnormals m * 2^-17), 0x7f / 0xff a half NaN. */
VF_INLINE __m256i vf_fp8_halves_(__m128i raw, int fmt) {
  const __m256i x = _mm256_cvtepu8_epi16(raw);
  if (fmt == KV_E5M2) return _mm256_slli_epi16(x, 8);
  const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(x, _mm256_and_si256(x, _mm256_set1_epi16(0x80))), 7);
  const __m256i em = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
#if defined(VF_AVX512)
  return _mm256_mask_mov_epi16(h, _mm256_cmpeq_epi16_mask(em, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7e00));
#else
  return _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f)));
#endif
}
#endif
#if defined(VF_AVX512)
VF_INLINE vf16 vf_load_fp8(const uint8_t* p, int fmt) {
  const __m512 f = _mm512_cvtph_ps(vf_fp8_halves_(_mm_loadu_si128((const __m128i*)p), fmt));
  return fmt == KV_E5M2 ? f : _mm512_mul_ps(f, _mm512_set1_ps(256.f));
}
#elif defined(VF_AVX2)
VF_INLINE vf16 vf_load_fp8(const uint8_t* p, int fmt) {
  const __m256i h = vf_fp8_halves_(_mm_loadu_si128((const __m128i*)p), fmt);
  vf16 r = vf_mk_(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  return fmt == KV_E5M2 ? r : vf_mul(r, vf_set1(256.f));
}
#elif defined(VF_NEON)
/* 4 bytes (as u32 lanes) widened by integer operations: fp8_to_f32's formulas, lane-wise */
VF_INLINE float32x4_t vf_fp8_4_(uint32x4_t b, int fmt) {
  const uint32x4_t em = vandq_u32(b, vdupq_n_u32(0x7f));
  const int e4 = fmt == KV_E4M3;
  const uint32x4_t nrm = vaddq_u32(vshlq_u32(em, vdupq_n_s32(e4 ? 20 : 21)), vdupq_n_u32((e4 ? 120u : 112u) << 23));
  const float32x4_t sub = vmulq_n_f32(vcvtq_f32_u32(em), e4 ? 1.f / 512 : 1.f / 65536);
  uint32x4_t r = vbslq_u32(vcltq_u32(em, vdupq_n_u32(e4 ? 8 : 4)), vreinterpretq_u32_f32(sub), nrm);
  if (e4) /* 0x7f: NaN */
    r = vbslq_u32(vceqq_u32(em, vdupq_n_u32(0x7f)), vdupq_n_u32(0x7fc00000u), r);
  else /* exponent field 31: inf (mantissa 0), NaN */
    r = vbslq_u32(vcgeq_u32(em, vdupq_n_u32(0x7c)), vaddq_u32(vshlq_n_u32(vsubq_u32(em, vdupq_n_u32(0x7c)), 21),
                                                            vdupq_n_u32(0x7f800000u)), r);
  return vreinterpretq_f32_u32(vorrq_u32(r, vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x80)), 24)));
}
VF_INLINE vf16 vf_load_fp8(const uint8_t* p, int fmt) {
  const uint8x16_t raw = vld1q_u8(p);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(raw)), hi = vmovl_u8(vget_high_u8(raw));
  vf16 r;
  r.q[0] = vf_fp8_4_(vmovl_u16(vget_low_u16(lo)), fmt);
  r.q[1] = vf_fp8_4_(vmovl_u16(vget_high_u16(lo)), fmt);
  r.q[2] = vf_fp8_4_(vmovl_u16(vget_low_u16(hi)), fmt);
  r.q[3] = vf_fp8_4_(vmovl_u16(vget_high_u16(hi)), fmt);
  return r;
}
#else
VF_INLINE vf16 vf_load_fp8(const uint8_t* p, int fmt) {
  float t[16];
  for (int i = 0; i < 16; i++) t[i] = fp8_to_f32(p[i], fmt);
  return vf_load(t);
}
#endif

/* the first n (< 16 allowed) bytes at p widened, the other lanes zero */
VF_INLINE vf16 vf_load_fp8n(const uint8_t* p, int64_t n, int fmt) {
  if (n >= 16) return vf_load_fp8(p, fmt);
  uint8_t t[16] = {0};
  if (n > 0) memcpy(t, p, (size_t)n);
  return vf_load_fp8(t, fmt);
}
