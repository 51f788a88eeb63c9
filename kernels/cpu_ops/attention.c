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
    float* p = malloc((size_t)(R * max_ctx) * sizeof(float)); /* scores, then weights, of one group */
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
          for (int64_t s = 0; s < ctx; s++) {
            const float* key = k_cache + (((int64_t)table[s / bs] * bs + s % bs) * G + g) * H;
            for (int64_t r = 0; r < R; r++) p[r * ctx + s] = dot(qg + r * H, key, H) * scale;
          }
          for (int64_t r = 0; r < R; r++) {
            float m = -FLT_MAX;
            for (int64_t s = 0; s < ctx; s++) m = p[r * ctx + s] > m ? p[r * ctx + s] : m;
            invp[r] = 1.f / exp_shift(p + r * ctx, ctx, m);
          }
          for (int64_t s = 0; s < ctx; s++) {
            const float* val = v_cache + (((int64_t)table[s / bs] * bs + s % bs) * G + g) * Hv;
            for (int64_t r = 0; r < R; r++) axpy(og + r * Hv, p[r * ctx + s], val, Hv);
          }
          for (int64_t r = 0; r < R; r++)
            for (int64_t d = 0; d < Hv; d++) og[r * Hv + d] *= invp[r];
        }
    free(p);
    if (invp != inv) free(invp);
  }
  return failed ? -1 : 0;
}
