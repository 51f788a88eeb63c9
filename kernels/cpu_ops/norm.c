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

/* Per-head RMSNorm (optional) and RoPE of q or k in one pass:
 *   y = w ? x * rsqrt(mean(x^2) + eps) * w : x                  (over each head's hd values)
 *   out[i] = y[i] * cos[p][i] + y[(i + rot/2) % rot] * sin[p][i]   for i < rot (rotate_half's sign in sin)
 *   out[i] = y[i]                                                 for rot <= i < hd (partial rotary)
 * x: T tokens of nh heads of hd floats, token rows ldt apart, heads contiguous within a row; cos, sin:
 * tables [P, rot] of every position; pos [T] int64 positions; out: T x nh x hd contiguous; hd at
 * most 1024 (checked by the caller). Returns 0, or -1 (out untouched) when a position is not in
 * [0, P). Replaces the norm's call, two table gathers, a roll and three
 * elementwise ops per tensor and layer, each a new T x nh x hd tensor. */
int norm_rope_f32(const float* x, int64_t T, int64_t nh, int64_t ldt, int64_t hd, const float* w, float eps,
                  int64_t rot, const float* cos_tab, const float* sin_tab, int64_t P, const int64_t* pos, float* out,
                  int nt) {
  const int64_t half = rot / 2;
  for (int64_t t = 0; t < T; t++)
    if (pos[t] < 0 || pos[t] >= P) return -1;
#pragma omp parallel for num_threads(nt) if (nt > 1 && T * nh * hd >= 65536) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float* c = cos_tab + pos[t] * rot;
    const float* s = sin_tab + pos[t] * rot;
    float y[1024];
    for (int64_t h = 0; h < nh; h++) {
      const float* src = x + t * ldt + h * hd;
      float* o = out + (t * nh + h) * hd;
      const float* v = src;
      if (w) {
        one_row(src, 0, 0, w, y, hd, eps);
        v = y;
      }
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= half; i += 16) {
        const __m512 a = _mm512_loadu_ps(v + i), b = _mm512_loadu_ps(v + half + i);
        _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + i)),
                                              _mm512_mul_ps(b, _mm512_loadu_ps(s + i))));
        _mm512_storeu_ps(o + half + i, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + half + i)),
                                                     _mm512_mul_ps(a, _mm512_loadu_ps(s + half + i))));
      }
#endif
      for (; i < half; i++) {
        const float a = v[i], b = v[half + i];
        o[i] = a * c[i] + b * s[i];
        o[half + i] = b * c[half + i] + a * s[half + i];
      }
      for (i = rot; i < hd; i++) o[i] = v[i];
    }
  }
  return 0;
}
