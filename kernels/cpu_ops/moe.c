/* MoE experts on the CPU in one call: route, gather, gate/up GEMM, SiLU-and-mul, down GEMM and the
 * weighted top-k sum, with each routed expert's weights streamed from memory exactly once.
 *
 * Why not torch ops: at decode sizes (a few rows per expert) a step is bound by reading expert
 * weights, and torch's grouped GEMM plus the gather / scale / index_add around it reads them at about
 * half this core's bandwidth and costs a dozen ops per layer. Here the GEMM loops put the weight
 * rows outermost (a block of 4 weight rows stays in L1 while every routed row passes it), so the
 * weights are read once whatever the number of rows, and the activations stay in L1/L2.
 *
 * Shapes (row-major, contiguous): x [T, D]; ids [T, K] (int64; an id outside [0, E) is held
 * elsewhere and contributes nothing); wts [T, K] float32; w13 [E, 2F, D] (gate rows then up rows,
 * as F.linear's weight); w2 [E, D, F]; out [T, D], overwritten. float32 activations; weights in
 * float32 or bfloat16 (upcast in registers: half the bytes for a bf16 checkpoint).
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
#define NB 4 /* weight rows per micro-tile */

static inline float bf16_to_f32(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

#ifdef __AVX512F__
static inline __m512 load_w(const void* w, int bf16, int64_t k, __mmask16 m) {
  if (bf16) {
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_maskz_loadu_ps(m, (const float*)w + k);
}
#endif

#ifdef __AVX512F__
/* One micro-tile: MBC rows of a (a compile-time count, so a lone decode row does a quarter of the
 * FMAs) against NB weight rows starting at wr[0..NB), written to y rows m0.. at columns n..n+nb. */
static inline __attribute__((always_inline)) void tile(const float* const* ar, const int MBC, const char* const* wr,
                                                       int bf16, int64_t K, float* y, int64_t ldy, int nb,
                                                       const char* pf) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MBC; i++)
    for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 msk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; j++) wv[j] = load_w(wr[j], bf16, k, msk);
    /* The next NB weight rows (contiguous after these) into cache ahead of their tile: a step reads
     * NB * 16 weights, as many bytes as there are of the next rows per step (bf16: 2 lines, fp32: 4). */
    if (pf) {
      const char* at = pf + (k >> 4) * (bf16 ? 128 : 256);
      _mm_prefetch(at, _MM_HINT_T0);
      _mm_prefetch(at + 64, _MM_HINT_T0);
      if (!bf16) {
        _mm_prefetch(at + 128, _MM_HINT_T0);
        _mm_prefetch(at + 192, _MM_HINT_T0);
      }
    }
    for (int i = 0; i < MBC; i++) {
      const __m512 xv = _mm512_maskz_loadu_ps(msk, ar[i] + k);
      for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MBC; i++)
    for (int j = 0; j < nb; j++) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

/* y[m, n] = sum_k a[m, k] * w[n, k] for m < M, n in [n0, n1); a rows a + m*lda, y rows y + m*ldy. */
static void gemm_block(const float* a, int64_t lda, int M, const void* w, int bf16, int64_t K, int n0, int n1,
                       float* y, int64_t ldy) {
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
#ifdef __AVX512F__
      /* The NB rows after these, prefetched while the first row tile runs. */
      const char* pf = m0 == 0 && n + 2 * NB <= n1 ? wr[0] + NB * K * esz : 0;
      switch (mb) {
        case 1: tile(ar, 1, wr, bf16, K, yt, ldy, nb, pf); break;
        case 2: tile(ar, 2, wr, bf16, K, yt, ldy, nb, pf); break;
        case 3: tile(ar, 3, wr, bf16, K, yt, ldy, nb, pf); break;
        default: tile(ar, 4, wr, bf16, K, yt, ldy, nb, pf); break;
      }
#else
      for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
          float s = 0.f;
          if (bf16) {
            const uint16_t* wj = (const uint16_t*)wr[j];
            for (int64_t k = 0; k < K; k++) s += ar[i][k] * bf16_to_f32(wj[k]);
          } else {
            const float* wj = (const float*)wr[j];
#pragma omp simd reduction(+ : s)
            for (int64_t k = 0; k < K; k++) s += ar[i][k] * wj[k];
          }
          yt[i * ldy + j] = s;
        }
#endif
    }
  }
}

/* y = a @ w^T over all N weight rows, the row blocks split over nt threads. */
static void gemm(const float* a, int64_t lda, int M, const void* w, int bf16, int64_t K, int N, float* y, int64_t ldy,
                 int nt) {
  if (nt <= 1 || N < 2 * NB * nt) {
    gemm_block(a, lda, M, w, bf16, K, 0, N, y, ldy);
    return;
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
    if (n0 < n1) gemm_block(a, lda, M, w, bf16, K, n0, n1, y, ldy);
  }
}

static inline float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

/* a[f] = silu(g[f]) * u[f] for f < F */
static void silu_mul_row(const float* g, const float* u, float* a, int64_t F) {
  int64_t f = 0;
#ifdef __AVX512F__
  for (; f + 16 <= F; f += 16) {
    const __m512 gv = _mm512_loadu_ps(g + f);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    _mm512_storeu_ps(a + f, _mm512_mul_ps(s, _mm512_loadu_ps(u + f)));
  }
#endif
  for (; f < F; f++) a[f] = silu_mul(g[f], u[f]);
}

/* Returns 0, or -1 when scratch memory could not be had (out is then untouched). */
int moe_experts_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                    const void* w13, const void* w2, int w_bf16, int64_t E, int64_t F, float* out, int nt) {
  const int64_t P = T * K;
  const int64_t esz = w_bf16 ? 2 : 4;
  int64_t* start = calloc((size_t)(E + 1), sizeof(int64_t));
  int64_t* fill = malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t));
  int64_t* order = malloc((size_t)(P > 0 ? P : 1) * sizeof(int64_t));
  float* xs = NULL;
  if (!start || !fill || !order) goto fail;
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
  xs = malloc((size_t)(rows * (D + 2 * F + F + D)) * sizeof(float));
  if (!xs) goto fail;
  float* h = xs + rows * D;
  float* act = h + rows * 2 * F;
  float* y = act + rows * F;
  memset(out, 0, (size_t)(T * D) * sizeof(float));
  for (int64_t e = 0; e < E; e++) {
    const int64_t n = start[e + 1] - start[e];
    if (!n) continue;
    const int64_t* pe = order + start[e];
    for (int64_t i = 0; i < n; i++) memcpy(xs + i * D, x + (pe[i] / K) * D, (size_t)D * sizeof(float));
    gemm(xs, D, (int)n, (const char*)w13 + e * 2 * F * D * esz, w_bf16, D, (int)(2 * F), h, 2 * F, nt);
    for (int64_t i = 0; i < n; i++) {
      const float* g = h + i * 2 * F;
      silu_mul_row(g, g + F, act + i * F, F);
    }
    gemm(act, F, (int)n, (const char*)w2 + e * D * F * esz, w_bf16, F, (int)D, y, D, nt);
    for (int64_t i = 0; i < n; i++) {
      const float wt = wts[pe[i]];
      float* o = out + (pe[i] / K) * D;
      const float* yi = y + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) o[d] += wt * yi[d];
    }
  }
  free(start);
  free(fill);
  free(order);
  free(xs);
  return 0;
fail:
  free(start);
  free(fill);
  free(order);
  free(xs);
  return -1;
}

/* y[M, N] = x[M, K] @ w[N, K]^T for a few rows (decode): the weight (float32 or bf16) streamed once. */
void linear_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, int64_t K, int64_t N, float* y,
                int64_t ldy, int nt) {
  gemm(x, ldx, (int)M, w, w_bf16, K, (int)N, y, ldy, nt);
}

/* 1 when built with the AVX-512 paths: only then do the kernels beat torch's (measured on AVX-512
 * CPUs only); the portable loops elsewhere are correct but unmeasured, and are not chosen. */
int cpu_ops_vectorized(void) {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}
