/* Gated DeltaNet decode on the CPU: one token per sequence, its states updated in place in their slots.
 *
 * A decode step of a linear-attention layer must read and write each sequence's recurrent state
 * (H x K x V float32: 2 MiB for Qwen3-Next's 32 heads of 128 x 128) and its short-convolution
 * window; everything else it touches is a few KiB. Through torch the step gathers the states into a
 * batch, multiplies, updates and scatters them back: the state crosses memory four to six times.
 * Here each (sequence, head) reads its K x V state once from memory for both products (S^T k and
 * S^T q), and the update, which needs those products first, rewrites it from the L2 cache where it
 * still is (64 KiB a head): one read and one write of memory per step, as the speed of light has it.
 *
 * The rule, with a = exp(g) and q, k l2-normalised (optionally) and q scaled:
 *   pred = a S^T k,  delta = beta (v - pred),  o = a S^T q + (k . q) delta,  S' = a S + k delta^T.
 * A sequence with keep[b] == 0 (its context is empty) starts from a zero state.
 *
 * The loops are plain C that the compiler vectorises for the CPU at hand (-march=native): AVX-512,
 * AVX2 or NEON alike; silu's exp takes vec.h's 16-lane vectors (any ISA). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define GD_MAX_DIM 512

static void delta_head(const float* q, const float* k, const float* v, float g, float beta, float* S, int keep,
                       float* o, int64_t K, int64_t V, float scale, int l2norm, float eps) {
  float qn[GD_MAX_DIM], kn[GD_MAX_DIM], acc_k[GD_MAX_DIM], acc_q[GD_MAX_DIM], delta[GD_MAX_DIM];
  float sq = 0.f, sk = 0.f;
  for (int64_t i = 0; i < K; i++) {
    sq += q[i] * q[i];
    sk += k[i] * k[i];
  }
  const float fq = scale * (l2norm ? 1.f / sqrtf(sq + eps) : 1.f), fk = l2norm ? 1.f / sqrtf(sk + eps) : 1.f;
  float kq = 0.f;
  for (int64_t i = 0; i < K; i++) {
    qn[i] = q[i] * fq;
    kn[i] = k[i] * fk;
    kq += qn[i] * kn[i];
  }
  const float a = expf(g);
  for (int64_t j = 0; j < V; j++) acc_k[j] = acc_q[j] = 0.f;
  if (keep) {
    for (int64_t i = 0; i < K; i++) {
      const float* row = S + i * V;
      const float ki = kn[i], qi = qn[i];
      for (int64_t j = 0; j < V; j++) {
        acc_k[j] += ki * row[j];
        acc_q[j] += qi * row[j];
      }
    }
  }
  for (int64_t j = 0; j < V; j++) {
    delta[j] = beta * (v[j] - a * acc_k[j]);
    o[j] = a * acc_q[j] + kq * delta[j];
  }
  for (int64_t i = 0; i < K; i++) {
    float* row = S + i * V;
    const float ki = kn[i];
    if (keep)
      for (int64_t j = 0; j < V; j++) row[j] = a * row[j] + ki * delta[j];
    else
      for (int64_t j = 0; j < V; j++) row[j] = ki * delta[j];
  }
}

/* q, k: token b's head h at q + b*ldqk + h*K (K contiguous); v at v + b*ldv + h*V; g, beta: (B, H)
 * contiguous; state: (slots, H, K, V) contiguous, sequence b in slot slots[b]; keep: B bytes or NULL
 * (every sequence continues); o: (B, H, V) contiguous. Returns 1 if K or V is over GD_MAX_DIM. */
int gated_delta_step_f32(const float* q, const float* k, int64_t ldqk, const float* v, int64_t ldv, const float* g,
                         const float* beta, float* state, const int64_t* slots, const uint8_t* keep, float* o,
                         int64_t B, int64_t H, int64_t K, int64_t V, float scale, int l2norm, float eps, int nt) {
  if (K > GD_MAX_DIM || V > GD_MAX_DIM) return 1;
#pragma omp parallel for num_threads(nt) if (nt > 1 && B * H > 1) schedule(static)
  for (int64_t bh = 0; bh < B * H; bh++) {
    const int64_t b = bh / H, h = bh % H;
    delta_head(q + b * ldqk + h * K, k + b * ldqk + h * K, v + b * ldv + h * V, g[bh], beta[bh],
               state + (slots[b] * H + h) * K * V, keep ? keep[b] : 1, o + bh * V, K, V, scale, l2norm, eps);
  }
  return 0;
}

/* silu(x) = x / (1 + exp(-x)) over n values in place. */
static void silu_inplace(float* x, int64_t n) {
  int64_t i = 0;
  const vf16 one = vf_set1(1.f);
  for (; i + 16 <= n; i += 16) {
    const vf16 t = vf_load(x + i);
    vf_store(x + i, vf_div(t, vf_add(one, vf_exp(vf_sub(vf_zero(), t)))));
  }
  for (; i < n; i++) x[i] = x[i] / (1.f + expf(-x[i]));
}

#define CONV_CHANNELS 512 /* channels per work item */

/* The short causal convolution's step: token b's row x + b*ldx of C channels, the window of its last
 * W-1 inputs per channel at conv_state + slots[b]*C*(W-1) (C x (W-1), oldest first), updated in place
 * (zeros where keep[b] == 0); w: (C, W); bias: C values or NULL; y: (B, C) contiguous, silu'd if
 * silu_act. */
void conv_step_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* conv_state,
                   const int64_t* slots, const uint8_t* keep, float* y, int64_t B, int64_t C, int64_t W, int silu_act,
                   int nt) {
  const int64_t nblk = (C + CONV_CHANNELS - 1) / CONV_CHANNELS, Wm = W - 1;
#pragma omp parallel for num_threads(nt) if (nt > 1 && B * C >= 4096) schedule(static)
  for (int64_t item = 0; item < B * nblk; item++) {
    const int64_t b = item / nblk, c0 = (item % nblk) * CONV_CHANNELS;
    const int64_t c1 = c0 + CONV_CHANNELS < C ? c0 + CONV_CHANNELS : C;
    const float* xb = x + b * ldx;
    float* win = conv_state + slots[b] * C * Wm;
    float* yb = y + b * C;
    const int kp = keep ? keep[b] : 1;
    for (int64_t c = c0; c < c1; c++) {
      float* s = win + c * Wm;
      const float* wc = w + c * W;
      const float xc = xb[c];
      float acc = bias ? bias[c] : 0.f;
      if (kp)
        for (int64_t j = 0; j < Wm; j++) acc += wc[j] * s[j];
      acc += wc[Wm] * xc;
      yb[c] = acc;
      if (kp)
        for (int64_t j = 0; j + 1 < Wm; j++) s[j] = s[j + 1];
      else
        for (int64_t j = 0; j + 1 < Wm; j++) s[j] = 0.f;
      if (Wm) s[Wm - 1] = xc;
    }
    if (silu_act) silu_inplace(yb + c0, c1 - c0);
  }
}
