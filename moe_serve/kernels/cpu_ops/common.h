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

#define SCRATCH_SLOTS 6

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

/* Inside an OpenMP parallel region: this thread's rows [*n0, *n1) of N, whole blocks of `block`
 * rows each (outside one, or without OpenMP: all of them). */
static inline void thread_rows_of(int64_t N, int64_t block, int64_t* n0, int64_t* n1) {
#ifdef _OPENMP
  extern int omp_get_thread_num(void);
  extern int omp_get_num_threads(void);
  const int64_t t = omp_get_thread_num(), tn = omp_get_num_threads();
#else
  const int64_t t = 0, tn = 1;
#endif
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
