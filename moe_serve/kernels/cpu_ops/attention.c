/* Paged decode attention on the CPU: one query token per sequence against its cached keys and
 * values, read in place from the paged cache (no gather of the context into a new tensor).
 *
 * q [B, N, H] (row stride ldq per sequence); k_cache [NB, bs, G, H], v_cache [NB, bs, G, Hv], both
 * float32 and contiguous; block_tables [B, W] int32 (row stride ldbt); seq_lens [B] int32; out
 * [B, N, Hv] contiguous. Heads n of group g = n / (N / G) share kv head g (grouped-query attention).
 *
 * Per (sequence, kv head): the scores of the group's query heads for every key (one pass over the
 * keys), a float32 softmax per head, then one pass over the values. Sequences and kv heads are
 * split over OpenMP threads. Written once over vec.h's 16-lane vectors (any ISA). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"

static inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  vf16 acc = vf_zero();
  for (; i + 16 <= n; i += 16) acc = vf_fma(vf_load(a + i), vf_load(b + i), acc);
  float s = vf_hsum(acc);
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* p[s] = exp(p[s] - m) for s < n, returning their sum */
static float exp_shift(float* p, int64_t n, float m) {
  int64_t s = 0;
  double sum = 0.0;
  const vf16 mv = vf_set1(m);
  vf16 acc = vf_zero();
  for (; s + 16 <= n; s += 16) {
    const vf16 e = vf_exp(vf_sub(vf_load(p + s), mv));
    vf_store(p + s, e);
    acc = vf_add(acc, e);
  }
  sum = vf_hsum(acc);
  for (; s < n; s++) {
    p[s] = expf(p[s] - m);
    sum += p[s];
  }
  return (float)sum;
}

/* max of p[0..n) */
static float max_of(const float* p, int64_t n) {
  int64_t s = 0;
  vf16 mv = vf_set1(-FLT_MAX);
  for (; s + 16 <= n; s += 16) mv = vf_max(mv, vf_load(p + s));
  float m = vf_hmax(mv);
  for (; s < n; s++) m = p[s] > m ? p[s] : m;
  return m;
}

/* p[s] *= f for s < n */
static void scale_row(float* p, int64_t n, float f) {
  const vf16 fv = vf_set1(f);
  int64_t s = 0;
  for (; s + 16 <= n; s += 16) vf_store(p + s, vf_mul(vf_load(p + s), fv));
  for (; s < n; s++) p[s] *= f;
}

#define QR 4 /* (query, head) rows per block */
#define VT VF_ROW_VECS /* 16-lane vectors per row of a register tile (vec.h: 4 on AVX-512, else 1) */

/* s[r * lds] = scale * q_r . key for the 4 query heads q_r (rows H apart), H % 16 == 0. */
static inline void scores4(const float* q, const float* key, int64_t H, float scale, float* s, int64_t lds) {
  vf16 acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
  for (int64_t c = 0; c < H; c += 16) {
    const vf16 kv = vf_load(key + c);
    for (int r = 0; r < 4; r++) acc[r] = vf_fma(vf_load(q + r * H + c), kv, acc[r]);
  }
  float t[4];
  vf_hsum4(acc[0], acc[1], acc[2], acc[3], t);
  for (int r = 0; r < 4; r++) s[r * lds] = t[r] * scale;
}

/* o[r][0..Hv) = sum_{j < n} p[r][j] * vrow[j][..] for the QR rows (o[r] NULL: dropped), 16 VT
 * values at a time held in registers over the n keys. */
static void values_block(const float* p, int64_t lds, const float* const* vrow, int64_t n, int64_t Hv,
                         float* const* o) {
  for (int64_t d = 0; d < Hv; d += 16 * VT) {
    const int64_t left = Hv - d;
    vf16 acc[QR][VT];
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < VT; v++) acc[r][v] = vf_zero();
    if (left >= 16 * VT) {
      for (int64_t j = 0; j < n; j++) {
        vf16 vv[VT];
        for (int v = 0; v < VT; v++) vv[v] = vf_load(vrow[j] + d + 16 * v);
        for (int r = 0; r < QR; r++) {
          const vf16 pr = vf_set1(p[r * lds + j]);
          for (int v = 0; v < VT; v++) acc[r][v] = vf_fma(pr, vv[v], acc[r][v]);
        }
      }
    } else { /* the last values: the first `left` lanes */
      for (int64_t j = 0; j < n; j++) {
        vf16 vv[VT];
        for (int v = 0; v < VT; v++) vv[v] = vf_loadn(vrow[j] + d + 16 * v, left - 16 * v);
        for (int r = 0; r < QR; r++) {
          const vf16 pr = vf_set1(p[r * lds + j]);
          for (int v = 0; v < VT; v++) acc[r][v] = vf_fma(pr, vv[v], acc[r][v]);
        }
      }
    }
    for (int r = 0; r < QR; r++)
      if (o[r])
        for (int v = 0; v < VT; v++) vf_storen(o[r] + d + 16 * v, acc[r][v], left - 16 * v);
  }
}

/* Each of T new tokens' key row (dk floats at k + t * ldk) and value row (dv floats at v + t * ldv)
 * into slot slots[t] of the paged caches (rows of dk / dv floats, nslots of them). Returns 0, or -1
 * (nothing written) when a slot is outside [0, nslots). */
int write_kv_f32(const float* k, int64_t ldk, const float* v, int64_t ldv, float* k_cache, float* v_cache,
                 const int64_t* slots, int64_t T, int64_t dk, int64_t dv, int64_t nslots) {
  for (int64_t t = 0; t < T; t++)
    if (slots[t] < 0 || slots[t] >= nslots) return -1;
  for (int64_t t = 0; t < T; t++) {
    memcpy(k_cache + slots[t] * dk, k + t * ldk, (size_t)dk * sizeof(float));
    memcpy(v_cache + slots[t] * dv, v + t * ldv, (size_t)dv * sizeof(float));
  }
  return 0;
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
          const int grouped = R % 4 == 0 && H % 16 == 0; /* 4 heads per key: one reduction for 4 */
          /* block by block (a division per key would cost more than its dot products) */
          for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
            const float* key = k_cache + ((int64_t)table[s0 / bs] * bs * G + g) * H;
            const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
            for (int64_t o = 0; o < n; o++, key += G * H) {
              if (grouped) {
                for (int64_t r = 0; r < R; r += 4) scores4(qg + r * H, key, H, scale, p + r * ctx + s0 + o, ctx);
                continue;
              }
              for (int64_t r = 0; r < R; r++) p[r * ctx + s0 + o] = dot(qg + r * H, key, H) * scale;
            }
          }
          for (int64_t r = 0; r < R; r++) invp[r] = 1.f / exp_shift(p + r * ctx, ctx, max_of(p + r * ctx, ctx));
          /* values: 4 heads' outputs, 16 VT values at a time, held in registers over the context */
          const float** vrow = (const float**)(p + Rp * max_ctx);
          for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
            const float* val = v_cache + ((int64_t)table[s0 / bs] * bs * G + g) * Hv;
            const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
            for (int64_t o = 0; o < n; o++, val += G * Hv) vrow[s0 + o] = val;
          }
          for (int64_t r = 0; r < R; r++) scale_row(p + r * ctx, ctx, invp[r]);
          memset(p + R * ctx, 0, (size_t)((Rp - R) * ctx) * sizeof(float));
          for (int64_t r0 = 0; r0 < R; r0 += QR) {
            float* orow[QR];
            for (int r = 0; r < QR; r++) orow[r] = r0 + r < R ? og + (r0 + r) * Hv : 0;
            values_block(p + r0 * ctx, ctx, vrow, ctx, Hv, orow);
          }
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
 * are read in place from the cache, one key row (16 VT values at a time) serving the same 4 rows. */

/* s[r][j] = scale * q_r . K[:, j] for j < S16 (a multiple of 16), from kt [H][ldk]. */
static void scores_block(const float* const* qr, const float* kt, int64_t ldk, int64_t H, int64_t S16, float scale,
                         float* s, int64_t lds) {
  for (int64_t j = 0; j < S16; j += 16 * VT) {
    const int nv = S16 - j >= 16 * VT ? VT : (int)((S16 - j) / 16);
    vf16 acc[QR][VT];
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < VT; v++) acc[r][v] = vf_zero();
    for (int64_t h = 0; h < H; h++) {
      const float* krow = kt + h * ldk + j;
      vf16 kv[VT];
      for (int v = 0; v < VT; v++) kv[v] = v < nv ? vf_load(krow + 16 * v) : vf_zero();
      for (int r = 0; r < QR; r++) {
        const vf16 qh = vf_set1(qr[r][h]);
        for (int v = 0; v < VT; v++) acc[r][v] = vf_fma(qh, kv[v], acc[r][v]);
      }
    }
    const vf16 sc = vf_set1(scale);
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < nv; v++) vf_store(s + r * lds + j + 16 * v, vf_mul(acc[r][v], sc));
  }
}

/* Returns 0, or -1 without scratch memory. */
int prefill_attention_f32(const float* q, int64_t ldq, const float* k_cache, const float* v_cache, const int32_t* bt,
                          int64_t ldbt, const int32_t* seq_lens, const int32_t* qsl, int64_t b0, int64_t b1,
                          float* out, int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, float scale, int nt) {
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
            scale_row(pr, vis[r], 1.f / exp_shift(pr, vis[r], max_of(pr, vis[r])));
            for (int64_t s = vis[r]; s < vmax; s++) pr[s] = 0.f;
          }
          values_block(p, S16, vrow, vmax, Hv, orow);
        }
      }
    free(kt);
    free(vrow);
  }
  return failed ? -1 : 0;
}
