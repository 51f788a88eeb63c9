/* MoE experts on the CPU in one call: route, gather, gate/up GEMM, SiLU-and-mul, down GEMM and the
 * weighted top-k sum, with each routed expert's weights streamed from memory exactly once.
 *
 * Why not torch ops: at decode sizes (a few rows per expert, the dot-product tiles below) a step is
 * bound by reading expert weights, and torch's grouped GEMM plus the gather / scale / index_add around it reads them at about
 * half this core's bandwidth and costs a dozen ops per layer. Here the GEMM loops put the weight
 * rows outermost (a block of 4 weight rows stays in L1 while every routed row passes it), so the
 * weights are read once whatever the number of rows, and the activations stay in L1/L2. At prefill
 * sizes (above PANEL_MIN_ROWS rows of an expert) the panel path further down runs
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
 * OpenMP runtime: torch's libgomp is already loaded under the same soname), nothing when nt == 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"

#define MB 4 /* rows of activations per micro-tile */
#define NB 4 /* weight rows per micro-tile (tile's sums are taken 4 at a time) */
#define PF_BLOCKS 2 /* how many NB-row tiles ahead the decode tiles prefetch weights */

/* Scratch kept between calls, grow-only, per calling thread and slot: a fresh multi-megabyte
 * allocation per layer would come from mmap and fault its pages in on every call. */
static void* scratch(int slot, size_t bytes) {
  static __thread void* buf[4];
  static __thread size_t cap[4];
  if (bytes > cap[slot]) {
    free(buf[slot]);
    const size_t want = (bytes + bytes / 4 + 63) & ~(size_t)63;
    buf[slot] = aligned_alloc(64, want);
    cap[slot] = buf[slot] ? want : 0;
  }
  return buf[slot];
}

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
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) wv[j] = LOADW;                                \
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
    _Pragma("GCC unroll 4") for (int i = 0; i < MBC; i++) {                                            \
      const vf16 xv = LOADX;                                                                           \
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) acc[i][j] = vs_fma(xv, wv[j], acc[i][j]);   \
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
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) {                                           \
        vf16 we, wo;                                                                                   \
        vf_load_bf16_pairs((const uint16_t*)wp[j] + k, &we, &wo);                                      \
        acc[0][j] = vs_fma(xe, we, acc[0][j]);                                                         \
        acc[1][j] = vs_fma(xo, wo, acc[1][j]);                                                         \
      }                                                                                                \
    } else {                                                                                           \
      vf16 we[NB], wo[NB];                                                                             \
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++)                                             \
        vf_load_bf16_pairs((const uint16_t*)wp[j] + k, &we[j], &wo[j]);                                \
      _Pragma("GCC unroll 4") for (int i = 0; i < MBC; i++) {                                          \
        const vf16 xe = vf_load(a[i] + k), xo = vf_load(a[i] + k + 16);                                \
        _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) {                                         \
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
  _Pragma("GCC unroll 4") for (int i = 0; i < MB; i++) a[i] = ar[i];
  _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) wp[j] = wr[j];
  vsum acc[MB][NB];
  _Pragma("GCC unroll 4") for (int i = 0; i < (MBC == 1 ? 2 : MBC); i++)
    _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) acc[i][j] = vs_zero();
  int64_t k = 0;
  if (split) {
    for (; k + 32 <= K; k += 32) TILE_STEP_PAIRS()
    if (MBC == 1 && !inv)
      _Pragma("GCC unroll 4") for (int j = 0; j < NB; j++) acc[0][j] = vs_add(acc[0][j], acc[1][j]);
  }
  for (; k + 16 <= K; k += 16) TILE_STEP(load_w(wp[j], bf16, k), vf_load(a[i] + k))
  if (k < K) TILE_STEP(load_wn(wp[j], bf16, k, K - k), vf_loadn(a[i] + k, K - k))
  /* (constant indices into acc only, so it lives in registers: a runtime index would keep it in
   * memory, stored on every step since the float loads above might alias it) */
  _Pragma("GCC unroll 4") for (int i = 0; i < MBC; i++) {
    float sums[NB];
    vs_hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
    _Pragma("GCC unroll 4") for (int j = 0; j < nb; j++) y[i * ldy + j] = sums[j];
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
  const int blocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(nt)
  {
#ifdef _OPENMP
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    const int t = omp_get_thread_num(), tn = omp_get_num_threads();
#else
    const int t = 0, tn = 1;
#endif
    const int b0 = (int)((int64_t)blocks * t / tn), b1 = (int)((int64_t)blocks * (t + 1) / tn);
    const int n0 = b0 * NB, n1 = b1 * NB < N ? b1 * NB : N;
    if (n0 < n1) gemm_block(a, lda, M, w, bf16, split, K, n0, n1, y, ldy, inv);
  }
  return 0;
}

static inline float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

/* a[f] = silu(g[f]) * u[f] for f < F */
static void silu_mul_row(const float* g, const float* u, float* a, int64_t F) {
  int64_t f = 0;
  for (; f + 16 <= F; f += 16) {
    const vf16 gv = vf_load(g + f);
    const vf16 e = vf_exp(vf_sub(vf_zero(), gv));
    const vf16 s = vf_div(gv, vf_add(vf_set1(1.f), e));
    vf_store(a + f, vf_mul(s, vf_load(u + f)));
  }
  for (; f < F; f++) a[f] = silu_mul(g[f], u[f]);
}

/* ---- Experts with many rows (prefill): an outer-product micro-kernel over packed token panels ----
 *
 * Above PANEL_MIN_ROWS rows an expert is compute-bound, and the dot-product tile above (one reduction
 * per output) leaves FMA throughput unused. Here the GEMMs are computed transposed: the weight rows
 * are the broadcast operand, read in place in their checkpoint layout, and the routed tokens are
 * gathered straight into panels of NR tokens laid out [k][NR] (the gather is the packing), so each
 * k step is 3 vector loads and 8 broadcasts for 24 FMAs into 24 accumulators. The gate/up GEMM's
 * epilogue applies SiLU-and-mul and the routing weight and writes the activations already packed as
 * the down GEMM's panels [F][NR]; the down GEMM's epilogue adds each token's D outputs into out.
 * Nothing of P x 2F or P x D is materialised. float32 or bf16 weights (block_rows); F a multiple of 4
 * and D of 8. */
#define NR 48 /* tokens per panel: three 16-lane vectors */
#define RB 8  /* weight rows per micro-tile (gate/up: 4 gate rows and the 4 matching up rows; down: 8
                    * output dims, added into out 8 wide) */
#define PANEL_MIN_ROWS 17
#ifndef PF_AHEAD
#define PF_AHEAD 4
#endif

/* c[r][v] += w_r[k] * bp[k * NR + 16 v + lane] for r < NRW, v < NV: one k step. */
#define MK_STEP(NRW, NV, kk)                                                                 \
  {                                                                                          \
    vf16 b[NV];                                                                              \
    for (int v = 0; v < NV; v++) b[v] = vf_load(bp + (kk) * NR + 16 * v);                    \
    for (int r = 0; r < NRW; r++) {                                                          \
      const vf16 w = vf_set1(wr[r][kk]);                                                     \
      for (int v = 0; v < NV; v++) c[r][v] = vf_fma(w, b[v], c[r][v]);                       \
    }                                                                                        \
  }
/* acc[r0 + r][v0 + v] = sum_k w_r[k] * bp[k * NR + 16 v + lane], r < NRW, v < NV. (Accumulators
 * are locals, stored once at the end: vector types may alias floats, so accumulating through the
 * caller's array would go through memory on every FMA.) With pf: a row block ahead (two runs of 4
 * rows, Kd / 4 lines each) into L2, a line of each run every 4 k steps (8 short rows at a time are
 * too short for the hardware prefetcher), in a loop of its own so that the plain loop has no test. */
#define MK_BODY(NRW, NV)                                                                     \
  vf16 c[NRW][NV];                                                                           \
  for (int r = 0; r < NRW; r++)                                                              \
    for (int v = 0; v < NV; v++) c[r][v] = vf_zero();                                        \
  const char* const pa = pf[0];                                                              \
  const char* const pb = pf[1];                                                              \
  int64_t k = 0;                                                                             \
  if (pa)                                                                                    \
    for (; k + 4 <= Kd; k += 4) {                                                            \
      vf_prefetch_l2(pa + (k >> 2) * 64);                                                    \
      vf_prefetch_l2(pb + (k >> 2) * 64);                                                    \
      MK_STEP(NRW, NV, k) MK_STEP(NRW, NV, k + 1) MK_STEP(NRW, NV, k + 2) MK_STEP(NRW, NV, k + 3) \
    }                                                                                        \
  for (; k < Kd; k++) MK_STEP(NRW, NV, k)                                                    \
  for (int r = 0; r < NRW; r++)                                                              \
    for (int v = 0; v < NV; v++) acc[r0 + r][v0 + v] = c[r][v];
#define MK_FN(NRW, NV)                                                                            \
  VF_INLINE void mk_##NRW##_##NV(const float* const* wr, const float* bp, int64_t Kd, const char* const* pf, \
                                 vf16 acc[RB][3], int r0, int v0) {                               \
    MK_BODY(NRW, NV)                                                                              \
  }
#if VF_PANEL_ROWS == 8
MK_FN(8, 1)
MK_FN(8, 2)
MK_FN(8, 3)
#else
MK_FN(4, 1)
#endif
#undef MK_FN
#undef MK_BODY
#undef MK_STEP

/* The micro-kernel for a panel of np tokens: only the vectors holding tokens are computed. pf: the
 * two runs of 4 rows of the row block PF_AHEAD blocks on, to prefetch (pf[0] NULL: none). With 32
 * vector registers (VF_PANEL_ROWS 8) the 8 rows and up to 3 token vectors in one pass; with fewer,
 * each token vector in two passes of 4 rows (8 x 16 tokens would not fit in registers), the
 * prefetch in the first. */
static inline void micro(const float* const* wr, const float* bp, int64_t Kd, int np, const char* const* pf,
                         vf16 acc[RB][3]) {
#if VF_PANEL_ROWS == 8
  if (np > 32) mk_8_3(wr, bp, Kd, pf, acc, 0, 0);
  else if (np > 16) mk_8_2(wr, bp, Kd, pf, acc, 0, 0);
  else mk_8_1(wr, bp, Kd, pf, acc, 0, 0);
#else
  static const char* const nopf[2] = {0, 0};
  for (int v = 0; v * 16 < np; v++) {
    mk_4_1(wr, bp + 16 * v, Kd, v == 0 ? pf : nopf, acc, 0, v);
    mk_4_1(wr + 4, bp + 16 * v, Kd, nopf, acc, 4, v);
  }
#endif
}

/* dst[row[i] + d0 + r] = acc[r][v] lane i (+ bias[d0 + r]), for r < 8 and i < ntok: the 8 x 16 tile
 * through a stack tile, then one run of 8 per token (as fast as a transpose in registers here: a
 * tile's stores are ~1% of the K * 8 * 16 FMAs that made it). */
static inline void put_tile(vf16 acc[RB][3], int v, const int64_t* row, int ntok, int64_t d0, float* dst,
                            const float* bias) {
  float t[RB][16], b[RB];
  for (int r = 0; r < RB; r++) {
    vf_store(t[r], acc[r][v]);
    b[r] = bias ? bias[d0 + r] : 0.f;
  }
  for (int i = 0; i < ntok; i++) {
    float* o = dst + row[i] + d0;
    for (int r = 0; r < RB; r++) o[r] = t[r][i] + b[r];
  }
}

/* Rows of panel p of n packed rows. */
static inline int panel_rows(int64_t n, int p) {
  const int64_t left = n - (int64_t)p * NR;
  return left < NR ? (int)left : NR;
}

/* Weight rows first[0..RB) (indices of K-long rows of w) as float32 row pointers: in place for
 * float32 weights; bf16 ones widened into buf (RB x K floats: the block stays in L1/L2 while every
 * panel passes it, so the widening is paid once per block, not per panel; the rows' bytes, half of
 * float32's, are what streams from memory). */
static inline void block_rows(const void* w, int bf16, const int64_t* first, int64_t K, float* buf,
                              const float** wr) {
  for (int r = 0; r < RB; r++) {
    if (!bf16) {
      wr[r] = (const float*)w + first[r] * K;
      continue;
    }
    const uint16_t* src = (const uint16_t*)w + first[r] * K;
    float* d = buf + (int64_t)r * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) vf_store(d + k, vf_load_bf16(src + k));
    if (k < K) vf_storen(d + k, vf_load_bf16n(src + k, K - k), K - k);
    wr[r] = d;
  }
}

/* This OpenMP thread's RB x K floats of wbuf (nt of them: block_rows' widened bf16 rows). */
static inline float* thread_rows(float* wbuf, int64_t K) {
  if (!wbuf) return 0;
#ifdef _OPENMP
  extern int omp_get_thread_num(void);
  return wbuf + (int64_t)omp_get_thread_num() * RB * K;
#else
  return wbuf;
#endif
}

/* Row block nb (rows 8 nb .. 8 nb + 7 of w, rows K apart; float32, or bf16 widened into wbuf) against
 * every one of npan packed panels [K][NR] of n rows: dst[drow[i] + 8 nb + r] = w_r . x_i (+ bias[8 nb
 * + r]). For float32 rows the row block PF_AHEAD on is prefetched while the first panel passes (the
 * weight rows stay in L1 for the others); bf16 blocks are read in one sequential run by the widening. */
static void row_block(const void* w, int bf16, float* wbuf, int64_t K, int nb, int nblocks, const float* xp,
                      int npan, int64_t n, const int64_t* drow, float* dst, const float* bias) {
  const int64_t n0 = (int64_t)nb * RB;
  const float* wr[RB];
  int64_t first[RB];
  for (int r = 0; r < RB; r++) first[r] = n0 + r;
  block_rows(w, bf16, first, K, thread_rows(wbuf, K), wr);
  for (int p = 0; p < npan; p++) {
    const int np = panel_rows(n, p);
    vf16 acc[RB][3];
    const char* pf[2] = {0, 0};
    if (!bf16 && p == 0 && nb + PF_AHEAD < nblocks) {
      pf[0] = (const char*)(wr[0] + PF_AHEAD * RB * K);
      pf[1] = (const char*)(wr[4] + PF_AHEAD * RB * K);
    }
    micro(wr, xp + (int64_t)p * K * NR, K, np, pf, acc);
    for (int v = 0; v * 16 < np; v++)
      put_tile(acc, v, drow + (int64_t)p * NR + 16 * v, np - 16 * v < 16 ? np - 16 * v : 16, n0, dst, bias);
  }
}

/* A panel of np rows of x (their offsets in row[]), D values each, packed [D][NR], the lanes past np
 * zero. Gathers where every offset fits 32 bits (small_offsets). */
static void pack_tokens(const float* x, int small_offsets, int64_t D, const int64_t* row, int np, float* bp) {
  if (small_offsets) {
    int32_t off[NR];
    for (int i = 0; i < NR; i++) off[i] = i < np ? (int32_t)row[i] : 0;
    for (int64_t k = 0; k < D; k++)
      for (int v = 0; v < 3; v++)
        vf_store(bp + k * NR + 16 * v, 16 * v < np ? vf_gather(x + k, off + 16 * v, np - 16 * v) : vf_zero());
    return;
  }
  for (int64_t k = 0; k < D; k++)
    for (int i = 0; i < NR; i++) bp[k * NR + i] = i < np ? x[row[i] + k] : 0.f;
}

/* One panel group of an expert: ng tokens (pairs pe[0..ng)) through gate/up, SiLU-and-mul, the
 * routing weight and down, added into out. xp: ceil(ng/NR) panels [D][NR]; ap: as many [F][NR],
 * followed by room for ng int64 row offsets, a whole number of panels' float weights, ng int64
 * offsets into the group's token-major down output and that output, [ng][D + 16] (64-byte aligned). */
static void panel_group(const float* x, int64_t T, int64_t D, const int64_t* pe, int64_t ng, const float* wts,
                        int64_t K, const void* w13, const void* w2, int bf16, float* wbuf, int64_t F, float* out,
                        float* xp, float* ap, int nt) {
  const int npan = (int)((ng + NR - 1) / NR);
  /* each pair's token row offset, computed once (a 64-bit division per use would cost as much as
   * the down GEMM's inner loop) */
  int64_t* row = (int64_t*)(ap + (int64_t)npan * F * NR);
  float* wg = (float*)(row + ng); /* the pairs' routing weights, zero past ng to a whole panel */
  for (int64_t i = 0; i < ng; i++) {
    row[i] = (pe[i] / K) * D;
    wg[i] = wts[pe[i]];
  }
  for (int64_t i = ng; i < (int64_t)npan * NR; i++) wg[i] = 0.f;
  int64_t* yrow = (int64_t*)(wg + (int64_t)npan * NR); /* the rows' offsets in yb */
  float* yb = (float*)(((uintptr_t)(yrow + ng) + 63) & ~(uintptr_t)63); /* [ng][D + 16] */
  for (int p = 0; p < npan; p++) {
    const int np = panel_rows(ng, p);
    pack_tokens(x, T * D < ((int64_t)1 << 31), D, row + (int64_t)p * NR, np, xp + (int64_t)p * D * NR);
  }
  /* gate/up: row blocks of 4 gate rows f0.. and their up rows F+f0.. (split over threads) */
  const int fblocks = (int)(F / 4);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int fb = 0; fb < fblocks; fb++) {
    const int64_t f0 = (int64_t)fb * 4;
    const float* wr[RB];
    int64_t first[RB];
    for (int r = 0; r < 4; r++) {
      first[r] = f0 + r;
      first[r + 4] = F + f0 + r;
    }
    block_rows(w13, bf16, first, D, thread_rows(wbuf, D), wr);
    const char* pf[2] = {0, 0};
    const char* nopf[2] = {0, 0};
    if (!bf16 && fb + PF_AHEAD < fblocks) {
      pf[0] = (const char*)(wr[0] + PF_AHEAD * 4 * D);
      pf[1] = (const char*)(wr[4] + PF_AHEAD * 4 * D);
    }
    for (int p = 0; p < npan; p++) {
      const int np = panel_rows(ng, p);
      vf16 acc[RB][3];
      micro(wr, xp + (int64_t)p * D * NR, D, np, p == 0 ? pf : nopf, acc);
      const float* wt = wg + (int64_t)p * NR;
      float* a = ap + (int64_t)p * F * NR;
      const int nv = (np + 15) / 16;
      for (int r = 0; r < 4; r++)
        for (int v = 0; v < nv; v++) {
          const vf16 g = acc[r][v];
          /* silu(g) = g / (1 + e^-g), the division as vf_rcp (on AVX-512 a reciprocal estimate and
           * one Newton step: a full-width divide holds its port ~16 cycles, 10% of this GEMM's time) */
          const vf16 d = vf_add(vf_set1(1.f), vf_exp(vf_sub(vf_zero(), g)));
          const vf16 s = vf_mul(g, vf_rcp(d));
          vf_store(a + (f0 + r) * NR + 16 * v, vf_mul(vf_mul(s, acc[r + 4][v]), vf_load(wt + 16 * v)));
        }
      for (int v = nv; v < 3; v++)
        for (int r = 0; r < 4; r++) vf_store(a + (f0 + r) * NR + 16 * v, vf_zero());
    }
  }
  /* down: row blocks of 8 output dims (split over threads), each passing every panel of the group
   * while its 8 weight rows stay in L1, into the group's token-major tile yb (rows padded off a
   * multiple of 4 KB: out's rows, D apart, fall in a few cache sets), then added into out's rows. */
  const int dblocks = (int)(D / RB);
  const int64_t ldy = D + 16;
  for (int64_t i = 0; i < ng; i++) yrow[i] = i * ldy;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int db = 0; db < dblocks; db++) row_block(w2, bf16, wbuf, F, db, dblocks, ap, npan, ng, yrow, yb, 0);
  for (int64_t i = 0; i < ng; i++) {
    float* o = out + row[i];
    const float* yi = yb + i * ldy;
    for (int64_t d = 0; d < D; d += 16)
      vf_storen(o + d, vf_add(vf_loadn(o + d, D - d), vf_loadn(yi + d, D - d)), D - d);
  }
}

/* Whether an expert of n rows takes the panel path (the shapes it is written for, any weight dtype). */
static inline int panel_path(int64_t n, int64_t D, int64_t F) {
  return n >= PANEL_MIN_ROWS && F % 4 == 0 && D % RB == 0;
}

/* Panel groups run so far by this process (the tests check which path a shape takes). */
static int64_t panel_groups_run;
int64_t moe_panel_groups_run(void) { return panel_groups_run; }

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
  int64_t* fill = start + E + 1;
  int64_t* order = fill + E;
  memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
  /* counting sort of the (token, k) pairs by expert */
  for (int64_t p = 0; p < P; p++)
    if (ids[p] >= 0 && ids[p] < E) start[ids[p] + 1]++;
  int64_t rows = 1; /* the most pairs any expert gets: sizes the per-expert scratch */
  for (int64_t e = 0; e < E; e++) {
    if (start[e + 1] > rows) rows = start[e + 1];
    start[e + 1] += start[e];
  }
  memcpy(fill, start, (size_t)E * sizeof(int64_t));
  for (int64_t p = 0; p < P; p++)
    if (ids[p] >= 0 && ids[p] < E) order[fill[ids[p]]++] = p;
  /* Scratch: the dot-product path's rows (at most PANEL_MIN_ROWS - 1 of them), or one panel group
   * (as many panels as keep the gate/up GEMM's packed tokens near 1 MB, for L2) of each operand. */
  const int panels = !inv && panel_path(rows, D, F);
  const int64_t small = panels ? PANEL_MIN_ROWS - 1 : rows;
  int64_t group = ((int64_t)1 << 20) / (D * NR * (int64_t)sizeof(float));
  group = (group < 1 ? 1 : group) * NR;
  const int64_t panel_floats = panels ? (group / NR) * (D + F) * NR + 5 * group + 16 + group * (D + 16) : 0;
  const int64_t dot_floats = small * (D + 2 * F + F + D);
  const int64_t floats = panel_floats > dot_floats ? panel_floats : dot_floats;
  float* xs = scratch(1, (size_t)floats * sizeof(float));
  if (!xs) return -1;
  /* bf16 weights on the panel path: each thread's block of RB widened rows */
  float* wbuf = 0;
  if (panels && w_bf16) {
    wbuf = scratch(3, (size_t)(nt < 1 ? 1 : nt) * RB * (size_t)(D > F ? D : F) * sizeof(float));
    if (!wbuf) return -1;
  }
  float* h = xs + small * D;
  float* act = h + small * 2 * F;
  float* y = act + small * F;
  memset(out, 0, (size_t)(T * (inv ? K : 1) * D) * sizeof(float));
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = start[e + 1] - start[e];
    if (!n) continue;
    const int64_t* pe = order + start[e];
    if (panels && panel_path(n, D, F)) {
      const char* w13e = (const char*)w13 + e * 2 * F * D * esz;
      const char* w2e = (const char*)w2 + e * D * F * esz;
      for (int64_t g0 = 0; g0 < n; g0 += group, panel_groups_run++)
        panel_group(x, T, D, pe + g0, n - g0 < group ? n - g0 : group, wts, K, w13e, w2e, w_bf16, wbuf, F, out,
                    xs, xs + (group / NR) * D * NR, nt);
      continue;
    }
    for (int64_t i = 0; i < n; i++) memcpy(xs + i * D, x + (pe[i] / K) * D, (size_t)D * sizeof(float));
    if (gemm(xs, D, (int)n, (const char*)w13 + e * 2 * F * D * esz, w_bf16, D, (int)(2 * F), h, 2 * F, nt, inv))
      return -1;
    for (int64_t i = 0; i < n; i++) {
      const float* g = h + i * 2 * F;
      silu_mul_row(g, g + F, act + i * F, F);
    }
    if (gemm(act, F, (int)n, (const char*)w2 + e * D * F * esz, w_bf16, F, (int)D, y, D, nt, inv)) return -1;
    for (int64_t i = 0; i < n; i++) {
      const float wt = wts[pe[i]];
      float* o = out + (inv ? pe[i] : pe[i] / K) * D;
      const float* yi = y + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) o[d] += wt * yi[d];
    }
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
  float* wbuf = 0;
  if (w_bf16) {
    wbuf = scratch(3, (size_t)(nt < 1 ? 1 : nt) * RB * (size_t)K * sizeof(float));
    if (!wbuf) return -1;
  }
  int64_t group = ((int64_t)1 << 20) / (K * NR * (int64_t)sizeof(float));
  group = (group < 1 ? 1 : group) * NR;
  const int64_t g_rows = M < group ? M : group;
  const int64_t gpan = (g_rows + NR - 1) / NR;
  float* xp = scratch(1, (size_t)(gpan * K * NR) * sizeof(float) + (size_t)(2 * gpan * NR) * sizeof(int64_t));
  if (!xp) return -1;
  int64_t* xrow = (int64_t*)(xp + gpan * K * NR);
  int64_t* yrow = xrow + gpan * NR;
  const int nblocks = (int)(N / RB);
  for (int64_t m0 = 0; m0 < M; m0 += group) {
    const int64_t ng = M - m0 < group ? M - m0 : group;
    const int npan = (int)((ng + NR - 1) / NR);
    for (int64_t i = 0; i < ng; i++) {
      xrow[i] = (m0 + i) * ldx;
      yrow[i] = (m0 + i) * ldy;
    }
    for (int p = 0; p < npan; p++) {
      const int np = panel_rows(ng, p);
      pack_tokens(x, M * ldx < ((int64_t)1 << 31), K, xrow + (int64_t)p * NR, np, xp + (int64_t)p * K * NR);
    }
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int nb = 0; nb < nblocks; nb++) row_block(w, w_bf16, wbuf, K, nb, nblocks, xp, npan, ng, yrow, y, b);
  }
  return 0;
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
