/* RMSNorm on the CPU, optionally fused with the residual add before it:
 *   h = x (+ r);  out = h * rsqrt(mean(h^2) + eps) * w
 * float32 rows of D contiguous values (row strides given), float32 weight. One pass over the row for
 * the sum of squares and one to scale it: on the CPU torch's rms_norm is five ops at about 25 us
 * each at decode sizes, and at prefill sizes each writes a new T x D tensor.
 * The sum of squares is accumulated in float32 lanes, then in double across lanes. Written over
 * vec.h's 16-lane vectors (any ISA). */
#include <math.h>
#include <stdint.h>
#include "vec.h"

static void one_row(const float* x, const float* r, float* h, const float* w, float* out, int64_t D, float eps) {
  double ss = 0.0;
  int64_t d = 0;
  vf16 acc = vf_zero();
  for (; d + 16 <= D; d += 16) {
    vf16 v = vf_load(x + d);
    if (r) {
      v = vf_add(v, vf_load(r + d));
      vf_store(h + d, v);
    }
    acc = vf_fma(v, v, acc);
  }
  {
    float lanes[16];
    vf_store(lanes, acc);
    for (int i = 0; i < 16; i++) ss += lanes[i];
  }
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
  const vf16 s = vf_set1(scale);
  for (; d + 16 <= D; d += 16) vf_store(out + d, vf_mul(vf_mul(vf_load(src + d), s), vf_load(w + d)));
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
      for (; i + 16 <= half; i += 16) {
        const vf16 a = vf_load(v + i), b = vf_load(v + half + i);
        vf_store(o + i, vf_add(vf_mul(a, vf_load(c + i)), vf_mul(b, vf_load(s + i))));
        vf_store(o + half + i, vf_add(vf_mul(b, vf_load(c + half + i)), vf_mul(a, vf_load(s + half + i))));
      }
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
