/* Paged decode attention on the CPU: one query token per sequence against its cached keys and
 * values, read in place from the paged cache (no gather of the context into a new tensor).
 *
 * q [B, N, H] (row stride ldq per sequence); k_cache [NB, bs, G, H], v_cache [NB, bs, G, Hv], both
 * contiguous, of the element type kv_fmt names (fp8.h: KV_F32 float32, KV_E4M3 / KV_E5M2 FP8 bytes,
 * widened exactly to float32 in registers as they are read; no scale); block_tables [B, W] int32
 * (row stride ldbt); seq_lens [B] int32; out [B, N, Hv] contiguous. Heads n of group g = n / (N / G)
 * share kv head g (grouped-query attention).
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
#include "fp8.h"

/* A cache of element type fmt (KV_F32 or an FP8 format): element i of a row, 16 of them from i (the
 * first n: the rest zero), a row's address. The kernels below take fmt as a constant (each is
 * specialised per format by an always-inlined body), so the float32 path is the plain loads. */
VF_INLINE vf16 kv_load(const void* row, int64_t i, int fmt) {
  return fmt == KV_F32 ? vf_load((const float*)row + i) : vf_load_fp8((const uint8_t*)row + i, fmt);
}
VF_INLINE vf16 kv_loadn(const void* row, int64_t i, int64_t n, int fmt) {
  return fmt == KV_F32 ? vf_loadn((const float*)row + i, n) : vf_load_fp8n((const uint8_t*)row + i, n, fmt);
}
VF_INLINE float kv_at(const void* row, int64_t i, int fmt) {
  return fmt == KV_F32 ? ((const float*)row)[i] : fp8_to_f32(((const uint8_t*)row)[i], fmt);
}
VF_INLINE const void* kv_row(const void* cache, int64_t i, int fmt) {
  return (const char*)cache + i * (fmt == KV_F32 ? (int64_t)sizeof(float) : 1);
}

/* Rows are prefetched KV_AHEAD rows ahead (n elements from element i of row): rows G * H apart in
 * the cache leave the hardware's prefetchers little to follow, and a decode step finds the cache cold
 * (the weights it streamed since have evicted it). On the Xeon, 8 ahead made FP8 decode 1.5-2.9x
 * faster (e4m3fn; e5m2 1.1-2.6x; 1 thread, one sequence of 8K keys, 8 kv heads of 128). On the
 * 2-core Zen 5 VM, 2 threads, 16 layers' caches of 4 kv heads of 64 read after a 96 MB stream (bit
 * for bit the same outputs): float32 caches, which had no prefetch, 1 sequence of 96 keys 25 -> 18
 * us a layer, of 1024 keys 230 -> 90 us, 32 sequences of 96 keys 712 -> 335 us, of 512 keys 3.7 ->
 * 1.6 ms; e4m3fn caches with 16 ahead rather than 8 20-25% faster (1 x 1024, 32 x 512). */
#define KV_AHEAD 16
VF_INLINE void kv_prefetch(const void* row, int64_t i, int64_t n, int fmt) {
  if (!row) return;
  const int64_t es = fmt == KV_F32 ? (int64_t)sizeof(float) : 1;
  const char* at = (const char*)row + i * es;
  for (int64_t c = 0; c < n * es; c += 64) __builtin_prefetch(at + c, 0, 0);
}

VF_INLINE float dot(const float* a, const void* b, int64_t n, int fmt) {
  int64_t i = 0;
  vf16 acc = vf_zero();
  for (; i + 16 <= n; i += 16) acc = vf_fma(vf_load(a + i), kv_load(b, i, fmt), acc);
  float s = vf_hsum(acc);
  /* fused as written: every format's copy rounds the tail alike (left to GCC, `s += a * b` was
   * contracted in some copies and not in others, by the CPU -march=native tunes for) */
  for (; i < n; i++) s = fmaf(a[i], kv_at(b, i, fmt), s);
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
VF_INLINE void scores4(const float* q, const void* key, int64_t H, float scale, float* s, int64_t lds, int fmt) {
  vf16 acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
  for (int64_t c = 0; c < H; c += 16) {
    const vf16 kv = kv_load(key, c, fmt);
    for (int r = 0; r < 4; r++) acc[r] = vf_fma(vf_load(q + r * H + c), kv, acc[r]);
  }
  float t[4];
  vf_hsum4(acc[0], acc[1], acc[2], acc[3], t);
  for (int r = 0; r < 4; r++) s[r * lds] = t[r] * scale;
}

/* o[r][0..Hv) = sum_{j < n} p[r][j] * vrow[j][..] for the QR rows (o[r] NULL: dropped), 16 VT
 * values at a time held in registers over the n keys. */
VF_INLINE void values_block(const float* p, int64_t lds, const void* const* vrow, int64_t n, int64_t Hv,
                             float* const* o, int fmt) {
  for (int64_t d = 0; d < Hv; d += 16 * VT) {
    const int64_t left = Hv - d;
    vf16 acc[QR][VT];
    for (int r = 0; r < QR; r++)
      for (int v = 0; v < VT; v++) acc[r][v] = vf_zero();
    if (left >= 16 * VT) {
      for (int64_t j = 0; j < n; j++) {
        vf16 vv[VT];
        kv_prefetch(j + KV_AHEAD < n ? vrow[j + KV_AHEAD] : 0, d, 16 * VT, fmt);
        for (int v = 0; v < VT; v++) vv[v] = kv_load(vrow[j], d + 16 * v, fmt);
        for (int r = 0; r < QR; r++) {
          const vf16 pr = vf_set1(p[r * lds + j]);
          for (int v = 0; v < VT; v++) acc[r][v] = vf_fma(pr, vv[v], acc[r][v]);
        }
      }
    } else { /* the last values: the first `left` lanes */
      for (int64_t j = 0; j < n; j++) {
        vf16 vv[VT];
        for (int v = 0; v < VT; v++) vv[v] = kv_loadn(vrow[j], d + 16 * v, left - 16 * v, fmt);
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
 * into slot slots[t] of the paged caches (rows of dk / dv elements of kv_fmt, nslots of them):
 * copied into a float32 cache, converted into an FP8 one (fp8.h: saturated to the format's finite
 * max, rounded to nearest even). Returns 0; -1 (nothing written) when a slot is outside [0, nslots);
 * -2 for an unknown kv_fmt. */
int write_kv_f32(const float* k, int64_t ldk, const float* v, int64_t ldv, void* k_cache, void* v_cache,
                 const int64_t* slots, int64_t T, int64_t dk, int64_t dv, int64_t nslots, int kv_fmt) {
  if (kv_fmt != KV_F32 && kv_fmt != KV_E4M3 && kv_fmt != KV_E5M2) return -2;
  for (int64_t t = 0; t < T; t++)
    if (slots[t] < 0 || slots[t] >= nslots) return -1;
  for (int64_t t = 0; t < T; t++) {
    if (kv_fmt == KV_F32) {
      memcpy((float*)k_cache + slots[t] * dk, k + t * ldk, (size_t)dk * sizeof(float));
      memcpy((float*)v_cache + slots[t] * dv, v + t * ldv, (size_t)dv * sizeof(float));
      continue;
    }
    uint8_t *kc = (uint8_t*)k_cache + slots[t] * dk, *vc = (uint8_t*)v_cache + slots[t] * dv;
    if (kv_fmt == KV_E4M3) { /* the format a constant in each loop: they vectorise */
      for (int64_t i = 0; i < dk; i++) kc[i] = f32_to_fp8(k[t * ldk + i], KV_E4M3);
      for (int64_t i = 0; i < dv; i++) vc[i] = f32_to_fp8(v[t * ldv + i], KV_E4M3);
    } else {
      for (int64_t i = 0; i < dk; i++) kc[i] = f32_to_fp8(k[t * ldk + i], KV_E5M2);
      for (int64_t i = 0; i < dv; i++) vc[i] = f32_to_fp8(v[t * ldv + i], KV_E5M2);
    }
  }
  return 0;
}

/* An attention call's operands, shared by its (sequence, kv head) groups. */
typedef struct {
  const float* q;
  int64_t ldq;
  const void *k, *v;
  const int32_t *bt, *seq_lens;
  int64_t ldbt;
  float* out;
  int64_t N, G, H, Hv, bs;
  float scale;
} attn_args;

/* Decode of sequence b's query heads of kv head g: scores, then weights, in p (rows rounded up to
 * whole blocks of QR, the rows past R zero: the value blocks read them, their outputs dropped), the
 * value row pointers after p's Rp * max_ctx floats, invp the R softmax normalisers. */
VF_INLINE void decode_group(const attn_args* a, int64_t b, int64_t g, float* p, float* invp, int64_t max_ctx,
                            int fmt) {
  const int64_t R = a->N / a->G, Rp = (R + QR - 1) / QR * QR, G = a->G, H = a->H, Hv = a->Hv, bs = a->bs;
  const int64_t ctx = a->seq_lens[b];
  const float scale = a->scale; /* in a register: the score stores below may not alias it */
  const float* qg = a->q + b * a->ldq + g * R * H;
  float* og = a->out + (b * a->N + g * R) * Hv;
  memset(og, 0, (size_t)(R * Hv) * sizeof(float));
  if (ctx <= 0) return;
  const int32_t* table = a->bt + b * a->ldbt;
  const int grouped = R % 4 == 0 && H % 16 == 0; /* 4 heads per key: one reduction for 4 */
  /* block by block (a division per key would cost more than its dot products) */
  for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
    const void* key = kv_row(a->k, ((int64_t)table[s0 / bs] * bs * G + g) * H, fmt);
    const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
    /* the next block's first row, for the prefetches past this block's last */
    const void* next =
        s0 + bs < ctx ? kv_row(a->k, ((int64_t)table[s0 / bs + 1] * bs * G + g) * H, fmt) : 0;
    for (int64_t o = 0; o < n; o++, key = kv_row(key, G * H, fmt)) {
      const int64_t ahead = o + KV_AHEAD;
      kv_prefetch(ahead < n ? kv_row(key, KV_AHEAD * G * H, fmt) : next ? kv_row(next, (ahead - n) * G * H, fmt) : 0, 0,
                  H, fmt);
      if (grouped) {
        for (int64_t r = 0; r < R; r += 4) scores4(qg + r * H, key, H, scale, p + r * ctx + s0 + o, ctx, fmt);
        continue;
      }
      for (int64_t r = 0; r < R; r++) p[r * ctx + s0 + o] = dot(qg + r * H, key, H, fmt) * scale;
    }
  }
  for (int64_t r = 0; r < R; r++) invp[r] = 1.f / exp_shift(p + r * ctx, ctx, max_of(p + r * ctx, ctx));
  /* values: 4 heads' outputs, 16 VT values at a time, held in registers over the context */
  const void** vrow = (const void**)(p + Rp * max_ctx);
  for (int64_t s0 = 0; s0 < ctx; s0 += bs) {
    const void* val = kv_row(a->v, ((int64_t)table[s0 / bs] * bs * G + g) * Hv, fmt);
    const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
    for (int64_t o = 0; o < n; o++, val = kv_row(val, G * Hv, fmt)) vrow[s0 + o] = val;
  }
  for (int64_t r = 0; r < R; r++) scale_row(p + r * ctx, ctx, invp[r]);
  memset(p + R * ctx, 0, (size_t)((Rp - R) * ctx) * sizeof(float));
  for (int64_t r0 = 0; r0 < R; r0 += QR) {
    float* orow[QR];
    for (int r = 0; r < QR; r++) orow[r] = r0 + r < R ? og + (r0 + r) * Hv : 0;
    values_block(p + r0 * ctx, ctx, vrow, ctx, Hv, orow, fmt);
  }
}

/* decode_group for each cache element type, the format a constant in each */
static void decode_group_f32(const attn_args* a, int64_t b, int64_t g, float* p, float* invp, int64_t max_ctx) {
  decode_group(a, b, g, p, invp, max_ctx, KV_F32);
}
static void decode_group_e4m3(const attn_args* a, int64_t b, int64_t g, float* p, float* invp, int64_t max_ctx) {
  decode_group(a, b, g, p, invp, max_ctx, KV_E4M3);
}
static void decode_group_e5m2(const attn_args* a, int64_t b, int64_t g, float* p, float* invp, int64_t max_ctx) {
  decode_group(a, b, g, p, invp, max_ctx, KV_E5M2);
}

/* Returns 0, -1 without scratch memory, -2 for an unknown kv_fmt. */
int decode_attention_f32(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, const int32_t* bt,
                         int64_t ldbt, const int32_t* seq_lens, float* out, int64_t B, int64_t N, int64_t G,
                         int64_t H, int64_t Hv, int64_t bs, float scale, int nt, int kv_fmt) {
  if (kv_fmt != KV_F32 && kv_fmt != KV_E4M3 && kv_fmt != KV_E5M2) return -2;
  const attn_args a = {q, ldq, k_cache, v_cache, bt, seq_lens, ldbt, out, N, G, H, Hv, bs, scale};
  const int64_t R = N / G; /* query heads per kv head */
  int64_t max_ctx = 1;
  for (int64_t b = 0; b < B; b++)
    if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && B * G > 1)
  {
    const int64_t Rp = (R + QR - 1) / QR * QR;
    float* p = malloc((size_t)(Rp * max_ctx) * sizeof(float) + (size_t)max_ctx * sizeof(void*));
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
          if (kv_fmt == KV_E4M3)
            decode_group_e4m3(&a, b, g, p, invp, max_ctx);
          else if (kv_fmt == KV_E5M2)
            decode_group_e5m2(&a, b, g, p, invp, max_ctx);
          else
            decode_group_f32(&a, b, g, p, invp, max_ctx);
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

/* Prefill of sequence b's query rows over kv head g, its keys packed transposed into kt (H rows of
 * S16 floats, then QR rows of scores), its value row pointers in vrow. */
VF_INLINE void prefill_group(const attn_args* a, const int32_t* qsl, int64_t b, int64_t g, float* kt,
                             const void** vrow, int fmt) {
  const int64_t R = a->N / a->G, G = a->G, H = a->H, Hv = a->Hv, bs = a->bs;
  const int64_t ctx = a->seq_lens[b], q0 = qsl[b], ql = qsl[b + 1] - qsl[b];
  if (ql <= 0 || ctx <= 0) return;
  const int32_t* table = a->bt + b * a->ldbt;
  const int64_t S16 = (ctx + 15) / 16 * 16;
  float* p = kt + H * S16;
  for (int64_t s0 = 0; s0 < ctx; s0 += bs) { /* block by block: no division per key */
    const int64_t slot0 = (int64_t)table[s0 / bs] * bs;
    const int64_t n = ctx - s0 < bs ? ctx - s0 : bs;
    for (int64_t o = 0; o < n; o++) {
      const void* key = kv_row(a->k, ((slot0 + o) * G + g) * H, fmt);
      if (fmt == KV_F32)
        for (int64_t h = 0; h < H; h++) kt[h * S16 + s0 + o] = kv_at(key, h, fmt);
      else /* widened 16 at a time */
        for (int64_t h0 = 0; h0 < H; h0 += 16) {
          float t[16];
          vf_store(t, kv_loadn(key, h0, H - h0, fmt));
          for (int64_t h = h0; h < H && h < h0 + 16; h++) kt[h * S16 + s0 + o] = t[h - h0];
        }
      vrow[s0 + o] = kv_row(a->v, ((slot0 + o) * G + g) * Hv, fmt);
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
      qr[r] = a->q + (q0 + i) * a->ldq + hh * H;
      orow[r] = r0 + r < rows ? a->out + ((q0 + i) * a->N + hh) * Hv : 0;
      vis[r] = ctx - ql + i + 1;
      if (vis[r] > vmax) vmax = vis[r];
    }
    const int64_t n16 = (vmax + 15) / 16 * 16;
    scores_block(qr, kt, S16, H, n16, a->scale, p, S16);
    for (int r = 0; r < QR; r++) {
      float* pr = p + r * S16;
      scale_row(pr, vis[r], 1.f / exp_shift(pr, vis[r], max_of(pr, vis[r])));
      for (int64_t s = vis[r]; s < vmax; s++) pr[s] = 0.f;
    }
    values_block(p, S16, vrow, vmax, Hv, orow, fmt);
  }
}

/* prefill_group for each cache element type, the format a constant in each */
static void prefill_group_f32(const attn_args* a, const int32_t* qsl, int64_t b, int64_t g, float* kt,
                              const void** vrow) {
  prefill_group(a, qsl, b, g, kt, vrow, KV_F32);
}
static void prefill_group_e4m3(const attn_args* a, const int32_t* qsl, int64_t b, int64_t g, float* kt,
                               const void** vrow) {
  prefill_group(a, qsl, b, g, kt, vrow, KV_E4M3);
}
static void prefill_group_e5m2(const attn_args* a, const int32_t* qsl, int64_t b, int64_t g, float* kt,
                               const void** vrow) {
  prefill_group(a, qsl, b, g, kt, vrow, KV_E5M2);
}

/* Returns 0, -1 without scratch memory, -2 for an unknown kv_fmt. */
int prefill_attention_f32(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, const int32_t* bt,
                          int64_t ldbt, const int32_t* seq_lens, const int32_t* qsl, int64_t b0, int64_t b1,
                          float* out, int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, float scale, int nt,
                          int kv_fmt) {
  if (kv_fmt != KV_F32 && kv_fmt != KV_E4M3 && kv_fmt != KV_E5M2) return -2;
  const attn_args a = {q, ldq, k_cache, v_cache, bt, seq_lens, ldbt, out, N, G, H, Hv, bs, scale};
  int64_t max_ctx = 1;
  for (int64_t b = b0; b < b1; b++)
    if (seq_lens[b] > max_ctx) max_ctx = seq_lens[b];
  const int64_t S = (max_ctx + 15) / 16 * 16;
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && (b1 - b0) * G > 1)
  {
    float* kt = malloc((size_t)(H * S + QR * S) * sizeof(float));
    const void** vrow = malloc((size_t)S * sizeof(void*));
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t b = b0; b < b1; b++)
      for (int64_t g = 0; g < G; g++) {
        if (!kt || !vrow) {
#pragma omp atomic write
          failed = 1;
          continue;
        }
        if (kv_fmt == KV_E4M3)
          prefill_group_e4m3(&a, qsl, b, g, kt, vrow);
        else if (kv_fmt == KV_E5M2)
          prefill_group_e5m2(&a, qsl, b, g, kt, vrow);
        else
          prefill_group_f32(&a, qsl, b, g, kt, vrow);
      }
    free(kt);
    free(vrow);
  }
  return failed ? -1 : 0;
}
