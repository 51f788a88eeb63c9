/* The panel GEMM: many activation rows (prefill) against a weight, compute-bound, so an outer-product
 * micro-kernel over packed token panels instead of the dot-product tiles decode uses (moe.c, quant.c).
 *
 * The GEMMs are computed transposed: the weight rows are the broadcast operand, read in place in
 * their checkpoint layout (float32) or widened to float32 a block of RB rows at a time (bf16,
 * packed int8 / int4: `wsrc_t.widen`, once per block for all the panels that pass it, so the
 * widening is paid once per RB rows and panel group), and the rows of x are gathered straight into
 * panels of NR rows laid out [k][NR] (the gather is the packing), so each k step is 3 vector loads and
 * 8 broadcasts for 24 FMAs into 24 accumulators.
 *
 * Two drivers: panel_linear (y = x @ W^T over whole blocks of RB weight rows) and panel_expert (one
 * routed expert: the gate/up GEMM's epilogue applies SiLU-and-mul and the routing weight and writes
 * the activations already packed as the down GEMM's panels [F][NR]; the down GEMM's epilogue adds
 * each token's D outputs into out; nothing of P x 2F or P x D is materialised; F a multiple of 4 and
 * D of 8). Rows are taken in groups of about 1 MB of packed panels (for L2); the row blocks of each
 * GEMM are split over OpenMP threads. Scratch: slots PANEL_SLOT_X and PANEL_SLOT_W of common.h's. */
#pragma once
#include "common.h"

/* A weight matrix of K-long rows as the panel GEMM reads it: float32 rows in place (widen NULL), or
 * rows widened to float32 by widen(w, row, K, dst) (bf16 here, packed codes in quant.c: w then
 * points at what that function reads). */
typedef struct wsrc wsrc_t;
struct wsrc {
  const void* w;
  void (*widen)(const wsrc_t* w, int64_t row, int64_t K, float* dst);
};

/* bf16 rows widened (a shift each). */
static inline void widen_bf16_row(const wsrc_t* w, int64_t row, int64_t K, float* d) {
  const uint16_t* src = (const uint16_t*)w->w + row * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) vf_store(d + k, vf_load_bf16(src + k));
  if (k < K) vf_storen(d + k, vf_load_bf16n(src + k, K - k), K - k);
}

#define PANEL_SLOT_X 4 /* scratch: a group's packed panels and their bookkeeping */
#define PANEL_SLOT_W 5 /* scratch: each thread's RB widened weight rows */

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
 * float32 weights; others widened into buf (RB x K floats: the block stays in L1/L2 while every
 * panel passes it, so the widening is paid once per block, not per panel; the rows' own bytes, bf16
 * or packed codes, are what streams from memory). */
static inline void block_rows(const wsrc_t* w, const int64_t* first, int64_t K, float* buf, const float** wr) {
  for (int r = 0; r < RB; r++) {
    if (!w->widen) {
      wr[r] = (const float*)w->w + first[r] * K;
      continue;
    }
    w->widen(w, first[r], K, buf + (int64_t)r * K);
    wr[r] = buf + (int64_t)r * K;
  }
}

/* This OpenMP thread's RB x K floats of wbuf (nt of them: block_rows' widened rows). */
static inline float* thread_rows(float* wbuf, int64_t K) {
  if (!wbuf) return 0;
#ifdef _OPENMP
  extern int omp_get_thread_num(void);
  return wbuf + (int64_t)omp_get_thread_num() * RB * K;
#else
  return wbuf;
#endif
}

/* Row block nb (rows 8 nb .. 8 nb + 7 of w, rows K apart; float32, or widened into wbuf) against
 * every one of npan packed panels [K][NR] of n rows: dst[drow[i] + 8 nb + r] = w_r . x_i (+ bias[8 nb
 * + r]). For float32 rows the row block PF_AHEAD on is prefetched while the first panel passes (the
 * weight rows stay in L1 for the others); widened blocks are read in one sequential run by the widening. */
static void row_block(const wsrc_t* w, float* wbuf, int64_t K, int nb, int nblocks, const float* xp,
                      int npan, int64_t n, const int64_t* drow, float* dst, const float* bias) {
  const int64_t n0 = (int64_t)nb * RB;
  const float* wr[RB];
  int64_t first[RB];
  for (int r = 0; r < RB; r++) first[r] = n0 + r;
  block_rows(w, first, K, thread_rows(wbuf, K), wr);
  for (int p = 0; p < npan; p++) {
    const int np = panel_rows(n, p);
    vf16 acc[RB][3];
    const char* pf[2] = {0, 0};
    if (!w->widen && p == 0 && nb + PF_AHEAD < nblocks) {
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
                        int64_t K, const wsrc_t* w13, const wsrc_t* w2, float* wbuf, int64_t F, float* out,
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
    block_rows(w13, first, D, thread_rows(wbuf, D), wr);
    const char* pf[2] = {0, 0};
    const char* nopf[2] = {0, 0};
    if (!w13->widen && fb + PF_AHEAD < fblocks) {
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
  for (int db = 0; db < dblocks; db++) row_block(w2, wbuf, F, db, dblocks, ap, npan, ng, yrow, yb, 0);
  for (int64_t i = 0; i < ng; i++) {
    float* o = out + row[i];
    const float* yi = yb + i * ldy;
    for (int64_t d = 0; d < D; d += 16)
      vf_storen(o + d, vf_add(vf_loadn(o + d, D - d), vf_loadn(yi + d, D - d)), D - d);
  }
}

/* Whether panel_expert takes experts of hidden size D and intermediate size F (the shapes it is
 * written for), and whether an expert of n rows of those takes it (float32 or bf16 weights). */
static inline int panel_fits(int64_t D, int64_t F) { return F % 4 == 0 && D % RB == 0; }
static inline int panel_path(int64_t n, int64_t D, int64_t F) { return n >= PANEL_MIN_ROWS && panel_fits(D, F); }

/* Rows per panel group: as many whole panels as keep a group's packed K-long rows near 1 MB. */
static inline int64_t panel_group_rows(int64_t K) {
  const int64_t g = ((int64_t)1 << 20) / (K * NR * (int64_t)sizeof(float));
  return (g < 1 ? 1 : g) * NR;
}

/* Each thread's RB widened rows of up to K floats (NULL for weights read in place); *ok 0 without
 * scratch memory. */
static float* panel_wbuf(int widened, int64_t K, int nt, int* ok) {
  *ok = 1;
  if (!widened) return 0;
  float* b = scratch(PANEL_SLOT_W, (size_t)(nt < 1 ? 1 : nt) * RB * (size_t)K * sizeof(float));
  *ok = b != 0;
  return b;
}

/* y[M, n] = x[M, K] @ w[n, K]^T (+ b[n]) for the first N / RB * RB rows n of w (whole row blocks):
 * x rows ldx apart, y rows ldy. Returns 0, or -1 without scratch memory. */
static int panel_linear(const float* x, int64_t ldx, int64_t M, const wsrc_t* w, const float* b, int64_t K,
                        int64_t N, float* y, int64_t ldy, int nt) {
  int ok;
  float* wbuf = panel_wbuf(w->widen != 0, K, nt, &ok);
  if (!ok) return -1;
  const int64_t group = panel_group_rows(K);
  const int64_t g_rows = M < group ? M : group;
  const int64_t gpan = (g_rows + NR - 1) / NR;
  float* xp = scratch(PANEL_SLOT_X,
                      (size_t)(gpan * K * NR) * sizeof(float) + (size_t)(2 * gpan * NR) * sizeof(int64_t));
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
    for (int nb = 0; nb < nblocks; nb++) row_block(w, wbuf, K, nb, nblocks, xp, npan, ng, yrow, y, b);
  }
  return 0;
}

/* panel_expert's scratch (grow-only: once had, every later call of the same sizes has it): a panel
 * group of each operand (*xs) and, for weights widened, each thread's rows (*wbuf). Returns 0, or -1
 * without scratch memory. */
static int panel_expert_scratch(int64_t D, int64_t F, int widened, int nt, float** xs, float** wbuf) {
  int ok;
  *wbuf = panel_wbuf(widened, D > F ? D : F, nt, &ok);
  const int64_t group = panel_group_rows(D), gpan = group / NR;
  *xs = scratch(PANEL_SLOT_X, (size_t)(gpan * (D + F) * NR + 5 * group + 16 + group * (D + 16)) * sizeof(float));
  return ok && *xs ? 0 : -1;
}

/* One expert's n routed pairs pe[0..n) (of x [T, D], top-K routing; wts [T, K]) through gate/up
 * (w13: 2F rows of D, gate rows then up rows), SiLU-and-mul, the routing weight and down (w2: D rows
 * of F), added into out [T, D]; panel_fits(D, F) must hold. Returns the panel groups run, or -1
 * without scratch memory (out then untouched). */
static int64_t panel_expert(const float* x, int64_t T, int64_t D, const int64_t* pe, int64_t n, const float* wts,
                            int64_t K, const wsrc_t* w13, const wsrc_t* w2, int64_t F, float* out, int nt) {
  float *xs, *wbuf;
  if (panel_expert_scratch(D, F, w13->widen || w2->widen, nt, &xs, &wbuf)) return -1;
  const int64_t group = panel_group_rows(D), gpan = group / NR;
  int64_t groups = 0;
  for (int64_t g0 = 0; g0 < n; g0 += group, groups++)
    panel_group(x, T, D, pe + g0, n - g0 < group ? n - g0 : group, wts, K, w13, w2, wbuf, F, out, xs,
                xs + gpan * D * NR, nt);
  return groups;
}
