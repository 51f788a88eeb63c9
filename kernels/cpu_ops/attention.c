/* Paged decode attention on the CPU: one query token per sequence against its cached keys and
 * values, read in place from the paged cache (no gather of the context into a new tensor).
 *
 * q [B, N, H] (row stride ldq per sequence); k_cache [NB, bs, G, H], v_cache [NB, bs, G, Hv], both
 * float32 and contiguous; block_tables [B, W] int32 (row stride ldbt); seq_lens [B] int32; out
 * [B, N, Hv] contiguous. Heads n of group g = n / (N / G) share kv head g (grouped-query attention).
 *
 * Per (sequence, kv head): the scores of the group's query heads for every key (one pass over the
 * keys), a float32 softmax per head, then one pass over the values. Sequences and kv heads are
 * split over OpenMP threads. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"

static inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

static inline void axpy(float* y, float a, const float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 av = _mm512_set1_ps(a);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#endif
  for (; i < n; i++) y[i] += a * x[i];
}

/* p[s] = exp(p[s] - m) for s < n, returning their sum */
static float exp_shift(float* p, int64_t n, float m) {
  int64_t s = 0;
  double sum = 0.0;
#ifdef __AVX512F__
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (; s + 16 <= n; s += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + s), mv));
    _mm512_storeu_ps(p + s, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; s < n; s++) {
    p[s] = expf(p[s] - m);
    sum += p[s];
  }
  return (float)sum;
}

/* max of p[0..n) */
static float max_of(const float* p, int64_t n) {
  float m = -FLT_MAX;
  int64_t s = 0;
#ifdef __AVX512F__
  __m512 mv = _mm512_set1_ps(-FLT_MAX);
  for (; s + 16 <= n; s += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + s));
  m = _mm512_reduce_max_ps(mv);
#endif
  for (; s < n; s++) m = p[s] > m ? p[s] : m;
  return m;
}

#define QR 4 /* (query, head) rows per block */
#ifdef __AVX512F__
static void values_block(const float* p, int64_t lds, const float* const* vrow, int64_t n, int64_t Hv,
                         float* const* o);

/* The sums of the 16 lanes of each of a, b, c, d: the four reductions share their shuffles. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  /* 128-bit quarter i of abcd: two partial quarters of input i, added */
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E)); /* every lane of quarter i: the sum of input i */
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0), x));
}

/* s[r * lds] = scale * q_r . key for the 4 query heads q_r (rows H apart), H % 16 == 0. */
static inline void scores4(const float* q, const float* key, int64_t H, float scale, float* s, int64_t lds) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < H; c += 16) {
    const __m512 kv = _mm512_loadu_ps(key + c);
    for (int r = 0; r < 4; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * H + c), kv, acc[r]);
  }
  float t[4];
  _mm_storeu_ps(t, _mm_mul_ps(reduce4(acc[0], acc[1], acc[2], acc[3]), _mm_set1_ps(scale)));
  for (int r = 0; r < 4; r++) s[r * lds] = t[r];
}
#endif

/* Returns 0, or -1 without scratch memory. */
int decode_attention_f32(const float* q, int64_t ldq, const float* k_cache, const float* v_cache, const int32_t* bt,
                         int64_t ldbt, const int32_t* seq_lens, float* out, int64_t B, int64_t N, int64_t G,
                         int64_t H, int64_t Hv, int64_t bs, float scale, int nt) {
  const int64_t R = N / G; /* query heads per kv head */
  int64_t max_ctx = 1;
  for (int64_t b = 0; b < B; b++)
    if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && B * G > 1)
  {
    /* scores, then weights, of one group, in rows rounded up to whole blocks of QR (the rows past R
     * zero: the value blocks read them, their outputs dropped); then the value row pointers */
    const int64_t Rp = (R + QR - 1) / QR * QR;
    float* p = malloc((size_t)(Rp * max_ctx) * sizeof(float) + (size_t)max_ctx * sizeof(float*));
    float inv[64];
    float* invp = R <= 64 ? inv : malloc((size_t)R * sizeof(float));
#pragma omp for schedule(dynamic, 1) collapse(2)
      for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < G; g++) {
          if (!p || !invp) {
#pragma omp atomic write
            failed = 1;
            continue;
          }
          const int64_t ctx = seq_lens[b];
          const float* qg = q + b * ldq + g * R * H;
          float* og = out + (b * N + g * R) * Hv;
          memset(og, 0, (size_t)(R * Hv) * sizeof(float));
          if (ctx <= 0) continue;
          const int32_t* table = bt + b * ldbt;
#ifdef __AVX512F__
          const int grouped = R % 4 == 0 && H % 16 == 0; /* 4 heads per key: one reduction for 4 */
#endif
          /* block by block (a division per key would cost more than its dot products) */
          for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
            const float* key = k_cache + ((int64_t)table[s0 / bs] * bs * G + g) * H;
            const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
            for (int64_t o = 0; o < n; o++, key += G * H) {
#ifdef __AVX512F__
              if (grouped) {
                for (int64_t r = 0; r < R; r += 4) scores4(qg + r * H, key, H, scale, p + r * ctx + s0 + o, ctx);
                continue;
              }
#endif
              for (int64_t r = 0; r < R; r++) p[r * ctx + s0 + o] = dot(qg + r * H, key, H) * scale;
            }
          }
          for (int64_t r = 0; r < R; r++) invp[r] = 1.f / exp_shift(p + r * ctx, ctx, max_of(p + r * ctx, ctx));
#ifdef __AVX512F__
          /* values: 4 heads' outputs, 64 values at a time, held in registers over the context */
          const float** vrow = (const float**)(p + Rp * max_ctx);
          for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
            const float* val = v_cache + ((int64_t)table[s0 / bs] * bs * G + g) * Hv;
            const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
            for (int64_t o = 0; o < n; o++, val += G * Hv) vrow[s0 + o] = val;
          }
          for (int64_t r = 0; r < R; r++) {
            float* pr = p + r * ctx;
            const __m512 iv = _mm512_set1_ps(invp[r]);
            int64_t s = 0;
            for (; s + 16 <= ctx; s += 16) _mm512_storeu_ps(pr + s, _mm512_mul_ps(_mm512_loadu_ps(pr + s), iv));
            for (; s < ctx; s++) pr[s] *= invp[r];
          }
          memset(p + R * ctx, 0, (size_t)((Rp - R) * ctx) * sizeof(float));
          for (int64_t r0 = 0; r0 < R; r0 += QR) {
            float* orow[QR];
            for (int r = 0; r < QR; r++) orow[r] = r0 + r < R ? og + (r0 + r) * Hv : 0;
            values_block(p + r0 * ctx, ctx, vrow, ctx, Hv, orow);
          }
#else
          for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
            const float* val = v_cache + ((int64_t)table[s0 / bs] * bs * G + g) * Hv;
            const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
            for (int64_t o = 0; o < n; o++, val += G * Hv)
              for (int64_t r = 0; r < R; r++) axpy(og + r * Hv, p[r * ctx + s0 + o], val, Hv);
          }
          for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < Hv; d++) og[r * Hv + d] *= invp[r];
#endif
        }
    free(p);
    if (invp != inv) free(invp);
  }
  return failed ? -1 : 0;
}

/* ---- Causal attention of query chunks (prefill, chunked prefill) over their paged contexts ----
 *
 * Sequence b's query rows are qsl[b] .. qsl[b+1] of q and out (q [T, N, H], row stride ldq; out
 * [T, N, Hv] contiguous); they are the last q_len tokens of its context of seq_lens[b], so query i
 * sees keys 0 .. seq_lens[b] - q_len + i. Only sequences b0 <= b < b1 are computed.
 *
 * Per (sequence, kv head): the group's keys are packed once transposed, [H][S] (S the context
 * rounded up to 16), so scores come out 16 keys per vector; the (query, head) rows are taken 4 at a
 * time (the heads of a group share their query's visibility; rows past it are masked), each head
 * dimension's 16-key vector of K^T serving the 4 rows. Softmax in float32 per row, then the values
 * are read in place from the cache, one key row (64 values at a time) serving the same 4 rows. */
#ifdef __AVX512F__
/* s[r][j] = scale * q_r . K[:, j] for j < S16 (a multiple of 16), from kt [H][ldk]. */
static void scores_block(const float* const* qr, const float* kt, int64_t ldk, int64_t H, int64_t S16, float scale,
                         float* s, int64_t lds) {
  for (int64_t j = 0; j < S16; j += 64) {
    const int nv = S16 - j >= 64 ? 4 : (int)((S16 - j) / 16);
    __m512 acc[QR][4];
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t h = 0; h < H; h++) {
      const float* krow = kt + h * ldk + j;
      __m512 kv[4];
      for (int v = 0; v < 4; v++) kv[v] = v < nv ? _mm512_loadu_ps(krow + 16 * v) : _mm512_setzero_ps();
      for (int r = 0; r < QR; r++) {
        const __m512 qh = _mm512_set1_ps(qr[r][h]);
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(qh, kv[v], acc[r][v]);
      }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < nv; v++) _mm512_storeu_ps(s + r * lds + j + 16 * v, _mm512_mul_ps(acc[r][v], sc));
  }
}

/* o[r][0..Hv) = sum_{j < n} p[r][j] * vrow[j][..] for the QR rows, 64 values at a time. */
static void values_block(const float* p, int64_t lds, const float* const* vrow, int64_t n, int64_t Hv,
                         float* const* o) {
  for (int64_t d = 0; d < Hv; d += 64) {
    const int64_t left = Hv - d;
    __mmask16 m[4];
    for (int v = 0; v < 4; v++) {
      const int64_t l = left - 16 * v;
      m[v] = l >= 16 ? (__mmask16)0xFFFF : l > 0 ? (__mmask16)((1u << l) - 1) : 0;
    }
    __m512 acc[QR][4];
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
      __m512 vv[4];
      for (int v = 0; v < 4; v++) vv[v] = _mm512_maskz_loadu_ps(m[v], vrow[j] + d + 16 * v);
      for (int r = 0; r < QR; r++) {
        const __m512 pr = _mm512_set1_ps(p[r * lds + j]);
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_fmadd_ps(pr, vv[v], acc[r][v]);
      }
    }
    for (int r = 0; r < QR; r++)
      if (o[r])
        for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(o[r] + d + 16 * v, m[v], acc[r][v]);
  }
}
#endif

/* Returns 0, or -1 without scratch memory; 1 when built without AVX-512 (nothing computed). */
int prefill_attention_f32(const float* q, int64_t ldq, const float* k_cache, const float* v_cache, const int32_t* bt,
                          int64_t ldbt, const int32_t* seq_lens, const int32_t* qsl, int64_t b0, int64_t b1,
                          float* out, int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, float scale, int nt) {
#ifndef __AVX512F__
  (void)q; (void)ldq; (void)k_cache; (void)v_cache; (void)bt; (void)ldbt; (void)seq_lens; (void)qsl; (void)b0;
  (void)b1; (void)out; (void)N; (void)G; (void)H; (void)Hv; (void)bs; (void)scale; (void)nt;
  return 1;
#else
  const int64_t R = N / G;
  int64_t max_ctx = 1;
  for (int64_t b = b0; b < b1; b++)
    if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
  const int64_t S = (max_ctx + 15) / 16 * 16;
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && (b1 - b0) * G > 1)
  {
    float* kt = malloc((size_t)(H * S + QR * S) * sizeof(float));
    const float** vrow = malloc((size_t)S * sizeof(float*));
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t b = b0; b < b1; b++)
      for (int64_t g = 0; g < G; g++) {
        if (!kt || !vrow) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        const int64_t ctx = seq_lens[b], q0 = qsl[b], ql = qsl[b + 1] - qsl[b];
        if (ql <= 0 || ctx <= 0) continue;
        const int32_t* table = bt + b * ldbt;
        const int64_t S16 = (ctx + 15) / 16 * 16;
        float* p = kt + H * S16;
        for (int64_t s0 = 0; s0 < ctx; s0 += bs) { /* block by block: no division per key */
          const int64_t slot0 = (int64_t)table[s0 / bs] * bs;
          const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
          for (int64_t o = 0; o < n; o++) {
            const float* key = k_cache + ((slot0 + o) * G + g) * H;
            for (int64_t h = 0; h < H; h++) kt[h * S16 + s0 + o] = key[h];
            vrow[s0 + o] = v_cache + ((slot0 + o) * G + g) * Hv;
          }
        }
        for (int64_t s = ctx; s < S16; s++)
          for (int64_t h = 0; h < H; h++) kt[h * S16 + s] = 0.f;
        const int64_t rows = ql * R; /* (query i, head r) as row i * R + r */
        for (int64_t r0 = 0; r0 < rows; r0 += QR) {
          const float* qr[QR];
          float* orow[QR];
          int64_t vis[QR], vmax = 0;
          for (int r = 0; r < QR; r++) {
            const int64_t row = r0 + r < rows ? r0 + r : rows - 1, i = row / R, hh = g * R + row % R;
            qr[r] = q + (q0 + i) * ldq + hh * H;
            orow[r] = r0 + r < rows ? out + ((q0 + i) * N + hh) * Hv : 0;
            vis[r] = ctx - ql + i + 1;
            if (vis[r] > vmax) vmax = vis[r];
          }
          const int64_t n16 = (vmax + 15) / 16 * 16;
          scores_block(qr, kt, S16, H, n16, scale, p, S16);
          for (int r = 0; r < QR; r++) {
            float* pr = p + r * S16;
            float m = -FLT_MAX;
            for (int64_t s = 0; s < vis[r]; s++) m = pr[s] > m ? pr[s] : m;
            const float inv = 1.f / exp_shift(pr, vis[r], m);
            for (int64_t s = 0; s < vis[r]; s++) pr[s] *= inv;
            for (int64_t s = vis[r]; s < vmax; s++) pr[s] = 0.f;
          }
          values_block(p, S16, vrow, vmax, Hv, orow);
        }
      }
    free(kt);
    free(vrow);
  }
  return failed ? -1 : 0;
#endif
}
