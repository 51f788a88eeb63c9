/* MoE experts on the CPU in one call: route, gather, gate/up GEMM, SiLU-and-mul, down GEMM and the
 * weighted top-k sum, with each routed expert's weights streamed from memory exactly once.
 *
 * Why not torch ops: at decode sizes (a few rows per expert, the dot-product tiles below) a step is
 * bound by reading expert weights, and torch's grouped GEMM plus the gather / scale / index_add around it reads them at about
 * half this core's bandwidth and costs a dozen ops per layer. Here the GEMM loops put the weight
 * rows outermost (a block of 4 weight rows stays in L1 while every routed row passes it), so the
 * weights are read once whatever the number of rows, and the activations stay in L1/L2. At prefill
 * sizes (from PANEL_MIN_ROWS rows of an expert) the panel GEMM of panel.h runs
 * an outer-product micro-kernel instead, with the gather, SiLU-and-mul, routing weight and top-k sum
 * in its packing and epilogues.
 *
 * Shapes (row-major, contiguous): x [T, D]; ids [T, K] (int64; an id outside [0, E) is held
 * elsewhere and contributes nothing); wts [T, K] float32; w13 [E, 2F, D] (gate rows then up rows,
 * as F.linear's weight); w2 [E, D, F]; out [T, D], overwritten. float32 activations; weights in
 * float32 or bfloat16 (kept bf16 in memory, widened in registers: half the bytes for a bf16
 * checkpoint; the panel path widens each block of 8 bf16 rows once, into L1, for all its panels).
 *
 * Written once over vec.h's 16-lane vectors: AVX-512, AVX2 + FMA, NEON or plain C, chosen at build.
 *
 * Threads: the weight-row blocks of each GEMM are split over OpenMP threads (the process's own
 * OpenMP runtime: torch's libgomp is already loaded under the same soname), nothing when nt == 1;
 * a decode-sized call that routes to enough experts gives whole experts to each thread instead
 * (common.h `experts_by_thread`: one parallel region a layer, the same bits as one thread).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "panel.h"

#define MB 4 /* rows of activations per micro-tile */
#define NB 4 /* weight rows per micro-tile (tile's sums are taken 4 at a time) */
#define PF_BLOCKS 2 /* how many NB-row tiles ahead the decode tiles prefetch weights */

/* 16 weights from k of a row (float32 or bf16), all of them, or the first n (the rest zero). */
VF_INLINE vf16 load_w(const void* w, int bf16, int64_t k) {
  return bf16 ? vf_load_bf16((const uint16_t*)w + k) : vf_load((const float*)w + k);
}
VF_INLINE vf16 load_wn(const void* w, int bf16, int64_t k, int64_t n) {
  return bf16 ? vf_load_bf16n((const uint16_t*)w + k, n) : vf_loadn((const float*)w + k, n);
}

/* One k step of a micro-tile: NB weight vectors (loaded with LOADW), each against the MBC rows. */
#define TILE_STEP(LOADW, LOADX)                                                                        \
  {                                                                                                    \
    vf16 wv[NB];                                                                                       \
    VF_UNROLL4 for (int j = 0; j < NB; j++) wv[j] = LOADW;                                \
    /* Weight rows PF_BLOCKS tiles ahead (contiguous after these) into L2 ahead of their tile: a step  \
     * reads NB * 16 weights, as many bytes as there are of those rows per step (bf16: 2 lines, fp32: \
     * 4). Into L2, not L1: an L1 prefetch holds one of the core's few line-fill buffers for a whole  \
     * DRAM round trip, which capped this loop below what the core streams (measured on a 1-row GEMV  \
     * over 512 MB of float32 rows: L1 one tile ahead 17.7 GB/s, none 18.4, L2 two tiles ahead 20.9; \
     * torch.sum streams 25). */                                                                      \
    if (pf) {                                                                                          \
      const char* at = pf + (k >> 4) * (bf16 ? 128 : 256);                                             \
      vf_prefetch_l2(at);                                                                              \
      vf_prefetch_l2(at + 64);                                                                         \
      if (!bf16) {                                                                                     \
        vf_prefetch_l2(at + 128);                                                                      \
        vf_prefetch_l2(at + 192);                                                                      \
      }                                                                                                \
    }                                                                                                  \
    VF_UNROLL4 for (int i = 0; i < MBC; i++) {                                            \
      const vf16 xv = LOADX;                                                                           \
      VF_UNROLL4 for (int j = 0; j < NB; j++) acc[i][j] = vs_fma(xv, wv[j], acc[i][j]);   \
    }                                                                                                  \
  }

/* One k step of 32 over bf16 weights and activations split by vf_split_pairs: each weight row's 32
 * values as their even and odd elements (a shift and a mask: no cross-lane widening, one load),
 * against the rows' matching halves. Same prefetch as TILE_STEP (4 lines: the NB rows' bytes). */
#define TILE_STEP_PAIRS()                                                                              \
  {                                                                                                    \
    if (pf) {                                                                                          \
      const char* at = pf + (k >> 5) * 256;                                                            \
      vf_prefetch_l2(at);                                                                              \
      vf_prefetch_l2(at + 64);                                                                         \
      vf_prefetch_l2(at + 128);                                                                        \
      vf_prefetch_l2(at + 192);                                                                        \
    }                                                                                                  \
    if (MBC == 1 && !inv) { /* a lone row: weight row by weight row, odd halves into the spare acc[1] */\
      const vf16 xe = vf_load(a[0] + k), xo = vf_load(a[0] + k + 16);                                  \
      VF_UNROLL4 for (int j = 0; j < NB; j++) {                                           \
        vf16 we, wo;                                                                                   \
        vf_load_bf16_pairs((const uint16_t*)wp[j] + k, &we, &wo);                                      \
        acc[0][j] = vs_fma(xe, we, acc[0][j]);                                                         \
        acc[1][j] = vs_fma(xo, wo, acc[1][j]);                                                         \
      }                                                                                                \
    } else {                                                                                           \
      vf16 we[NB], wo[NB];                                                                             \
      VF_UNROLL4 for (int j = 0; j < NB; j++)                                             \
        vf_load_bf16_pairs((const uint16_t*)wp[j] + k, &we[j], &wo[j]);                                \
      VF_UNROLL4 for (int i = 0; i < MBC; i++) {                                          \
        const vf16 xe = vf_load(a[i] + k), xo = vf_load(a[i] + k + 16);                                \
        VF_UNROLL4 for (int j = 0; j < NB; j++) {                                         \
          acc[i][j] = vs_fma(xe, we[j], acc[i][j]);                                                    \
          acc[i][j] = vs_fma(xo, wo[j], acc[i][j]);                                                    \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  }

/* One micro-tile: MBC rows of a (a compile-time count, so a lone decode row does a quarter of the
 * FMAs) against NB weight rows starting at wr[0..NB), written to y rows m0.. at columns n..n+nb.
 * inv (batch-invariant mode): a lone row takes the same FMA sequence as a row of a larger tile (no
 * spare accumulator for its odd halves), so every row's sums are in one order whatever M is. */
VF_INLINE void tile(const float* const* ar, const int MBC, const char* const* wr, int bf16, int split, int64_t K,
                    float* y, int64_t ldy, int nb, const char* pf, int inv) {
  /* The row pointers as locals: loads through the callers' pointer arrays could alias the
   * accumulators (vector types may alias anything), which would then be stored back on every step. */
  const float* a[MB];
  const char* wp[NB];
  VF_UNROLL4 for (int i = 0; i < MB; i++) a[i] = ar[i];
  VF_UNROLL4 for (int j = 0; j < NB; j++) wp[j] = wr[j];
  vsum acc[MB][NB];
  VF_UNROLL4 for (int i = 0; i < (MBC == 1 ? 2 : MBC); i++)
    VF_UNROLL4 for (int j = 0; j < NB; j++) acc[i][j] = vs_zero();
  int64_t k = 0;
  if (split) {
    for (; k + 32 <= K; k += 32) TILE_STEP_PAIRS()
    if (MBC == 1 && !inv)
      VF_UNROLL4 for (int j = 0; j < NB; j++) acc[0][j] = vs_add(acc[0][j], acc[1][j]);
  }
  for (; k + 16 <= K; k += 16) TILE_STEP(load_w(wp[j], bf16, k), vf_load(a[i] + k))
  if (k < K) TILE_STEP(load_wn(wp[j], bf16, k, K - k), vf_loadn(a[i] + k, K - k))
  /* (constant indices into acc only, so it lives in registers: a runtime index would keep it in
   * memory, stored on every step since the float loads above might alias it) */
  VF_UNROLL4 for (int i = 0; i < MBC; i++) {
    float sums[NB];
    vs_hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    VF_UNROLL4 for (int j = 0; j < nb; j++) y[i * ldy + j] = sums[j];
  }
}
#undef TILE_STEP
#undef TILE_STEP_PAIRS

/* y[m, n] = sum_k a[m, k] * w[n, k] for m < M, n in [n0, n1); a rows a + m*lda, y rows y + m*ldy. */
static void gemm_block(const float* a, int64_t lda, int M, const void* w, int bf16, int split, int64_t K, int n0,
                       int n1, float* y, int64_t ldy, int inv) {
  const int64_t esz = bf16 ? 2 : 4;
  for (int n = n0; n < n1; n += NB) {
    const int nb = n1 - n < NB ? n1 - n : NB;
    const char* wr[NB];
    for (int j = 0; j < NB; j++) wr[j] = (const char*)w + (int64_t)(n + (j < nb ? j : 0)) * K * esz;
    for (int m0 = 0; m0 < M; m0 += MB) {
      const int mb = M - m0 < MB ? M - m0 : MB;
      const float* ar[MB];
      for (int i = 0; i < MB; i++) ar[i] = a + (int64_t)(m0 + (i < mb ? i : 0)) * lda;
      float* yt = y + (int64_t)m0 * ldy + n;
      /* The NB rows PF_BLOCKS tiles on, prefetched while the first row tile runs. */
      const char* pf = m0 == 0 && n + (PF_BLOCKS + 1) * NB <= n1 ? wr[0] + PF_BLOCKS * NB * K * esz : 0;
      switch (mb) {
        case 1: tile(ar, 1, wr, bf16, split, K, yt, ldy, nb, pf, inv); break;
        case 2: tile(ar, 2, wr, bf16, split, K, yt, ldy, nb, pf, inv); break;
        case 3: tile(ar, 3, wr, bf16, split, K, yt, ldy, nb, pf, inv); break;
        default: tile(ar, 4, wr, bf16, split, K, yt, ldy, nb, pf, inv); break;
      }
    }
  }
}

/* y = a @ w^T over all N weight rows, the row blocks split over nt threads (whole outputs each: a
 * thread never splits a reduction). inv: batch-invariant (see tile); then a missing scratch for the
 * split rows is an error (-1), not the plain path, whose sums would be in another order. Returns 0. */
static int gemm(const float* a, int64_t lda, int M, const void* w, int bf16, int64_t K, int N, float* y, int64_t ldy,
                int nt, int inv) {
  /* bf16 weights: the rows of a split for TILE_STEP_PAIRS (without the scratch, the plain path) */
  int split = 0;
  if (bf16 && K >= 32) {
    float* s = scratch(2, (size_t)M * (size_t)K * sizeof(float));
    if (s) {
      for (int m = 0; m < M; m++) vf_split_pairs(a + (int64_t)m * lda, K, s + (int64_t)m * K);
      a = s;
      lda = K;
      split = 1;
    } else if (inv) {
      return -1;
    }
  }
  if (nt <= 1 || N < 2 * NB * nt) {
    gemm_block(a, lda, M, w, bf16, split, K, 0, N, y, ldy, inv);
    return 0;
  }
#pragma omp parallel num_threads(nt)
  {
    int64_t n0, n1;
    thread_rows_of(N, NB, &n0, &n1);
    if (n0 < n1) gemm_block(a, lda, M, w, bf16, split, K, (int)n0, (int)n1, y, ldy, inv);
  }
  return 0;
}


/* Panel groups run so far by this process (the tests check which path a shape takes). */
static int64_t panel_groups_run;
int64_t moe_panel_groups_run(void) { return panel_groups_run; }

/* Calls that gave whole experts to each thread (common.h `experts_by_thread`) in this process. */
static int64_t by_thread_run;
int64_t moe_experts_by_thread_run(void) { return by_thread_run; }

typedef struct {
  const float* x;
  int64_t D, K, F, esz;
  const void *w13, *w2;
  int w_bf16;
} experts_ctx;

/* Expert e's decode-sized pass over its n pairs pe[0..n): gather, gate/up, SiLU-and-mul, down, on nt
 * threads (inv: batch-invariant tiles). Returns its n output rows (in xs: n * (D + 2F + F + D)
 * floats), or NULL with *rc = -1. */
static const float* expert_rows(const experts_ctx* c, int64_t e, const int64_t* pe, int64_t n, float* xs, int nt,
                                int inv, int* rc) {
  const int64_t D = c->D, F = c->F;
  float* h = xs + n * D;
  float* act = h + n * 2 * F;
  float* y = act + n * F;
  gather_rows(c->x, D, pe, n, c->K, xs);
  *rc = gemm(xs, D, (int)n, (const char*)c->w13 + e * 2 * F * D * c->esz, c->w_bf16, D, (int)(2 * F), h, 2 * F, nt,
             inv);
  if (*rc) return 0;
  for (int64_t i = 0; i < n; i++) silu_mul_row(h + i * 2 * F, h + i * 2 * F + F, act + i * F, F);
  *rc = gemm(act, F, (int)n, (const char*)c->w2 + e * D * F * c->esz, c->w_bf16, F, (int)D, y, D, nt, inv);
  return *rc ? 0 : y;
}

/* experts_by_thread's expert_rows_fn: one thread, the plain tiles. */
static const float* expert_pass(const void* ctx, int64_t e, const int64_t* pe, int64_t n, float* xs, int* rc) {
  return expert_rows((const experts_ctx*)ctx, e, pe, n, xs, 1, 0, rc);
}

/* moe_experts_f32 and its batch-invariant form (inv): every expert's rows by the dot-product tiles,
 * whatever their number (the panel path's sums run in another order, and which path an expert takes
 * depends on how many rows the batch routes to it), and out (T * K, D): each (token, k) pair's
 * weighted output apart, w * y rounded once (added to zero), which the caller sums in expert id order
 * (a sum kept here would fuse each product into the running sum, an order an expert-parallel combine,
 * whose ranks each hold some of a token's experts, could not repeat). Returns 0, or -1 without
 * scratch memory. */
static int moe_experts(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                       const void* w13, const void* w2, int w_bf16, int64_t E, int64_t F, float* out, int nt,
                       int inv) {
  const int64_t P = T * K;
  const int64_t esz = w_bf16 ? 2 : 4;
  int64_t* start = scratch(0, (size_t)(2 * E + 1 + P) * sizeof(int64_t));
  if (!start) return -1;
  int64_t* order = start + 2 * E + 1;
  const int64_t rows = sort_by_expert(ids, P, E, start, start + E + 1, order); /* sizes the scratch */
  /* Scratch for the dot-product path's rows (at most PANEL_MIN_ROWS - 1 of them where experts with
   * more take the panel path, whose scratch is its own) */
  const int panels = !inv && panel_path(rows, D, F);
  const experts_ctx ctx = {x, D, K, F, esz, w13, w2, w_bf16};
  if (!inv && !panels && experts_by_thread_fits(start, E, K, nt)) {
    by_thread_run++;
    return experts_by_thread(T, D, ids, start, order, E, K, wts, (size_t)(rows * (D + 2 * F + F + D)), expert_pass,
                             &ctx, out, nt);
  }
  const int64_t small = panels ? PANEL_MIN_ROWS - 1 : rows;
  float* xs = scratch(1, (size_t)(small * (D + 2 * F + F + D)) * sizeof(float));
  float *pxs, *pwbuf;
  if (!xs || (panels && panel_expert_scratch(D, F, w_bf16, nt, &pxs, &pwbuf))) return -1;
  memset(out, 0, (size_t)(T * (inv ? K : 1) * D) * sizeof(float));
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = start[e + 1] - start[e];
    if (!n) continue;
    const int64_t* pe = order + start[e];
    if (panels && panel_path(n, D, F)) {
      const wsrc_t w13e = {(const char*)w13 + e * 2 * F * D * esz, w_bf16 ? widen_bf16_row : 0};
      const wsrc_t w2e = {(const char*)w2 + e * D * F * esz, w_bf16 ? widen_bf16_row : 0};
      const int64_t groups = panel_expert(x, T, D, pe, n, wts, K, &w13e, &w2e, F, out, nt);
      if (groups < 0) return -1;
      panel_groups_run += groups;
      continue;
    }
    int rc;
    const float* y = expert_rows(&ctx, e, pe, n, xs, nt, inv, &rc);
    if (rc) return -1;
    add_weighted_rows(out, D, pe, n, inv ? 1 : K, wts, y);
  }
  return 0;
}

/* Returns 0, or -1 when scratch memory could not be had (out is then untouched). */
int moe_experts_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                    const void* w13, const void* w2, int w_bf16, int64_t E, int64_t F, float* out, int nt) {
  return moe_experts(x, T, D, ids, wts, K, w13, w2, w_bf16, E, F, out, nt, 0);
}

/* The same, batch-invariant: each (token, k) pair's weighted output, out (T * K, D), bitwise the
 * same whatever else the batch holds (each (token, expert) row's sums in one order). Returns 0, or
 * -1 without scratch memory (out may then be partly written). */
int moe_experts_pairs_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                              const void* w13, const void* w2, int w_bf16, int64_t E, int64_t F, float* out, int nt) {
  return moe_experts(x, T, D, ids, wts, K, w13, w2, w_bf16, E, F, out, nt, 1);
}

/* y[M, N] = x[M, K] @ w[N, K]^T (+ b) over float32 or bf16 weights (w_bf16) with N % 8 == 0, by the
 * panel micro-kernel: x's rows packed into panels of NR (groups of about 1 MB, for L2), every block of
 * 8 weight rows passing each panel of a group; row blocks split over threads. x rows ldx apart, y
 * rows ldy. Returns 0, or -1 without scratch memory. */
int linear_panels_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, const float* b, int64_t K,
                      int64_t N, float* y, int64_t ldy, int nt) {
  const wsrc_t ws = {w, w_bf16 ? widen_bf16_row : 0};
  return panel_linear(x, ldx, M, &ws, b, K, N, y, ldy, nt);
}

/* y[M, N] = x[M, K] @ w[N, K]^T for a few rows (decode): the weight (float32 or bf16) streamed once. */
void linear_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, int64_t K, int64_t N, float* y,
                int64_t ldy, int nt) {
  gemm(x, ldx, (int)M, w, w_bf16, K, (int)N, y, ldy, nt, 0);
}

/* The same for any M, batch-invariant: each output's sum over k in one order (the dot-product
 * tiles', see tile) whatever M is and wherever the row sits. Returns 0, or -1 without scratch. */
int linear_invariant_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, int64_t K, int64_t N,
                         float* y, int64_t ldy, int nt) {
  return gemm(x, ldx, (int)M, w, w_bf16, K, (int)N, y, ldy, nt, 1);
}

/* Routing from T tokens' logits (T x E, float32): each token's K largest, largest first (ties: the
 * lower expert id first, as a stable sort), and their weights: the softmax over those K (over_topk),
 * or the softmax over all E at those K. Returns 0, or -1 for K outside [1, min(E, 64)]. */
int topk_softmax_f32(const float* logits, int64_t T, int64_t E, int64_t K, int over_topk, float* w, int64_t* ids) {
  if (K < 1 || K > E || K > 64) return -1;
  for (int64_t t = 0; t < T; t++) {
    const float* l = logits + t * E;
    int64_t* it = ids + t * K;
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) { /* insertion into the K best so far, kept in order */
      const float v = l[e];
      if (n == K && !(v > l[it[K - 1]])) continue;
      int64_t j = n < K ? n++ : K - 1;
      for (; j > 0 && v > l[it[j - 1]]; j--) it[j] = it[j - 1];
      it[j] = e;
    }
    const float m = l[it[0]];
    float sum = 0.f;
    if (over_topk)
      for (int64_t j = 0; j < K; j++) sum += expf(l[it[j]] - m);
    else
      for (int64_t e = 0; e < E; e++) sum += expf(l[e] - m);
    for (int64_t j = 0; j < K; j++) w[t * K + j] = expf(l[it[j]] - m) / sum;
  }
  return 0;
}

/* The speed-of-light meter's marks: hits[id + 1] = 1 for each of n routed ids (any id below -1
 * counts as -1: hits[0] takes the rows whose slot is elsewhere). Returns 0, or -1 (nothing marked)
 * for an id past the n_hits - 1 slots. */
int mark_slots_i32(int32_t* hits, int64_t n_hits, const int64_t* ids, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (ids[i] + 1 >= n_hits) return -1;
  for (int64_t i = 0; i < n; i++) hits[ids[i] < -1 ? 0 : ids[i] + 1] = 1;
  return 0;
}

/* The instruction set vec.h was built for: "avx512", "avx2", "neon" or "generic". */
const char* cpu_ops_isa(void) { return CPU_OPS_ISA; }

/* 1 when built with a SIMD path of vec.h (avx512, avx2, neon), 0 for the plain-C one. Every path
 * computes every entry point; this only says which kind of code runs. */
int cpu_ops_vectorized(void) {
#ifdef VF_GENERIC
  return 0;
#else
  return 1;
#endif
}
