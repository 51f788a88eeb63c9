/* RMSNorm on the CPU, optionally fused with the residual add before it:
 *   h = x (+ r);  out = h * rsqrt(mean(h^2) + eps) * w
 * float32 rows of D contiguous values (row strides given), float32 weight. One pass over the row for
 * the sum of squares and one to scale it: on the CPU torch's rms_norm is five ops at about 25 us
 * each at decode sizes, and at prefill sizes each writes a new T x D tensor.
 * The sum of squares is accumulated in float32 lanes, then in double across lanes. */
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static void one_row(const float* x, const float* r, float* h, const float* w, float* out, int64_t D, float eps) {
  double ss = 0.0;
  int64_t d = 0;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    __m512 v = _mm512_loadu_ps(x + d);
    if (r) {
      v = _mm512_add_ps(v, _mm512_loadu_ps(r + d));
      _mm512_storeu_ps(h + d, v);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  {
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    for (int i = 0; i < 16; i++) ss += lanes[i];
  }
#endif
  for (; d < D; d++) {
    float v = x[d];
    if (r) {
      v += r[d];
      h[d] = v;
    }
    ss += (double)v * v;
  }
  const float scale = 1.0f / sqrtf((float)(ss / (double)D) + eps);
  const float* src = r ? h : x;
  d = 0;
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(scale);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(src + d), s), _mm512_loadu_ps(w + d)));
#endif
  for (; d < D; d++) out[d] = src[d] * scale * w[d];
}

/* rows: x rows at x + t*ldx; r (residual, may be NULL) rows at r + t*ldr; h (x + r, written when r is
 * given) and out contiguous T x D. */
void rms_norm_f32(const float* x, int64_t ldx, const float* r, int64_t ldr, float* h, const float* w, float* out,
                  int64_t T, int64_t D, float eps, int nt) {
#pragma omp parallel for num_threads(nt) if (nt > 1 && T * D >= 65536) schedule(static)
  for (int64_t t = 0; t < T; t++)
    one_row(x + t * ldx, r ? r + t * ldr : 0, r ? h + t * D : 0, w, out + t * D, D, eps);
}
