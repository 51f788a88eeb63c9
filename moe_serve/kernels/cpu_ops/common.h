/* What the GEMM kernels (moe.c over float32 / bf16 weights, quant.c over packed int8 / int4 ones)
 * share besides vec.h: scratch memory kept between calls, a thread's share of the weight-row blocks,
 * SiLU-and-mul, the routed (token, k) pairs sorted by expert, and an expert's rows gathered from x and
 * its weighted outputs added back.
 *
 * Static functions: each file that includes this has its own copies, and its own scratch buffers. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "vec.h"

#define SCRATCH_SLOTS 7

/* Scratch kept between calls, grow-only, per calling thread and slot: a fresh multi-megabyte
 * allocation per layer would come from mmap and fault its pages in on every call. */
static void* scratch(int slot, size_t bytes) {
  static __thread void* buf[SCRATCH_SLOTS];
  static __thread size_t cap[SCRATCH_SLOTS];
  if (bytes > cap[slot]) {
    free(buf[slot]);
    const size_t want = (bytes + bytes / 4 + 63) & ~(size_t)63;
    buf[slot] = aligned_alloc(64, want);
    cap[slot] = buf[slot] ? want : 0;
  }
  return buf[slot];
}

/* This thread's number and the team's size (outside a parallel region, or without OpenMP: 0 of 1). */
static inline void this_thread(int* t, int* tn) {
#ifdef _OPENMP
  extern int omp_get_thread_num(void);
  extern int omp_get_num_threads(void);
  *t = omp_get_thread_num(), *tn = omp_get_num_threads();
#else
  *t = 0, *tn = 1;
#endif
}

/* Inside an OpenMP parallel region: this thread's rows [*n0, *n1) of N, whole blocks of `block`
 * rows each (outside one, or without OpenMP: all of them). */
static inline void thread_rows_of(int64_t N, int64_t block, int64_t* n0, int64_t* n1) {
  int t, tn;
  this_thread(&t, &tn);
  const int64_t blocks = (N + block - 1) / block;
  const int64_t a = blocks * t / tn * block, b = blocks * (t + 1) / tn * block;
  *n0 = a < N ? a : N;
  *n1 = b < N ? b : N;
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

/* The P routed pairs (ids[p] of E experts; an id outside [0, E) is held elsewhere and left out)
 * by expert: expert e's pairs are order[start[e] .. start[e + 1]), in pair order. start (E + 1),
 * fill (E) and order (P) are the caller's. Returns the most pairs any expert got (at least 1). */
static int64_t sort_by_expert(const int64_t* ids, int64_t P, int64_t E, int64_t* start, int64_t* fill,
                              int64_t* order) {
  memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
  for (int64_t p = 0; p < P; p++)
    if (ids[p] >= 0 && ids[p] < E) start[ids[p] + 1]++;
  int64_t rows = 1;
  for (int64_t e = 0; e < E; e++) {
    if (start[e + 1] > rows) rows = start[e + 1];
    start[e + 1] += start[e];
  }
  memcpy(fill, start, (size_t)E * sizeof(int64_t));
  for (int64_t p = 0; p < P; p++)
    if (ids[p] >= 0 && ids[p] < E) order[fill[ids[p]]++] = p;
  return rows;
}

/* The tokens of an expert's n pairs pe[0..n) (pair p: token p / K) gathered from x [T, D] into xs [n, D]. */
static void gather_rows(const float* x, int64_t D, const int64_t* pe, int64_t n, int64_t K, float* xs) {
  for (int64_t i = 0; i < n; i++) memcpy(xs + i * D, x + (pe[i] / K) * D, (size_t)D * sizeof(float));
}

/* out row of pair pe[i] (row pe[i] / per) += wts[pe[i]] * y[i] for i < n, rows of D: an expert's
 * outputs into the tokens' sums (per = K), or into each pair's own row (per = 1). */
static void add_weighted_rows(float* out, int64_t D, const int64_t* pe, int64_t n, int64_t per, const float* wts,
                              const float* y) {
  for (int64_t i = 0; i < n; i++) {
    const float wt = wts[pe[i]];
    float* o = out + (pe[i] / per) * D;
    const float* yi = y + i * D;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] += wt * yi[d];
  }
}

/* ---- Whole experts to each thread (decode-sized calls of moe.c and quant.c) ----
 * Where a call routes to at least as many experts as there are threads, evenly (a multiple of the
 * threads, or four times as many), each thread runs whole experts: one parallel region for the
 * layer instead of two per expert, and each expert's gather and SiLU on its own thread beside the
 * others'. Thread t takes a contiguous run of the routed experts, cut by cumulative cost (a weight's
 * bytes, the same for every expert, plus its rows), and leaves each pair's output row apart (scratch
 * slot 6, P rows); then each thread adds its share of the tokens' pairs into out in ascending expert
 * id, the order and the operations of the one-thread loop (`add_weighted_rows` per expert): the
 * same bits whatever the thread count. */
#define EXPERT_COST 8 /* an expert's weight bytes in rows' worth of work */

/* expert e's pass over its n pairs pe[0..n) with scratch xs: its n output rows (D floats each), or
 * NULL with *rc set (-1 no scratch, -2 a weight refused). */
typedef const float* (*expert_rows_fn)(const void* ctx, int64_t e, const int64_t* pe, int64_t n, float* xs, int* rc);

static int experts_by_thread_fits(const int64_t* start, int64_t E, int64_t K, int nt) {
  int64_t used = 0;
  for (int64_t e = 0; e < E; e++) used += start[e + 1] > start[e];
  return nt > 1 && K <= 64 && used >= nt && (used % nt == 0 || used >= 4 * nt);
}

/* out (T, D) overwritten; xs_floats: one thread's scratch for an expert's pass. Returns 0, -1, -2. */
static int experts_by_thread(int64_t T, int64_t D, const int64_t* ids, const int64_t* start, const int64_t* order,
                             int64_t E, int64_t K, const float* wts, size_t xs_floats, expert_rows_fn fn,
                             const void* ctx, float* out, int nt) {
  float* pairs = scratch(6, (size_t)(T * K * D) * sizeof(float));
  if (!pairs) return -1;
  memset(out, 0, (size_t)(T * D) * sizeof(float));
  int64_t cost = 0;
  for (int64_t e = 0; e < E; e++)
    if (start[e + 1] > start[e]) cost += EXPERT_COST + start[e + 1] - start[e];
  int failed = 0;
#pragma omp parallel num_threads(nt)
  {
    int t, tn;
    this_thread(&t, &tn);
    const int64_t lo = cost * t / tn, hi = cost * (t + 1) / tn;
    float* xs = scratch(1, xs_floats * sizeof(float));
    int rc = xs ? 0 : -1;
    int64_t c = 0;
    for (int64_t e = 0; e < E && !rc; e++) {
      const int64_t n = start[e + 1] - start[e];
      if (!n) continue;
      const int64_t mid = c + (EXPERT_COST + n) / 2; /* an expert goes where its cost's midpoint falls */
      c += EXPERT_COST + n;
      if (mid < lo || mid >= hi) continue;
      const int64_t* pe = order + start[e];
      const float* y = fn(ctx, e, pe, n, xs, &rc);
      for (int64_t i = 0; y && i < n; i++) memcpy(pairs + pe[i] * D, y + i * D, (size_t)D * sizeof(float));
    }
    if (rc) {
#pragma omp atomic write
      failed = rc;
    }
#pragma omp barrier
    int64_t t0, t1;
    thread_rows_of(T, 1, &t0, &t1);
    for (int64_t i = t0; i < t1 && !failed; i++) {
      int64_t mine[64], m = 0; /* token i's routed pairs by expert id (stable: the loop's order) */
      for (int64_t k = 0; k < K; k++) {
        const int64_t p = i * K + k;
        if (ids[p] < 0 || ids[p] >= E) continue;
        int64_t j = m++;
        for (; j > 0 && ids[mine[j - 1]] > ids[p]; j--) mine[j] = mine[j - 1];
        mine[j] = p;
      }
      for (int64_t j = 0; j < m; j++) add_weighted_rows(out, D, mine + j, 1, K, wts, pairs + mine[j] * D);
    }
  }
  return failed;
}

