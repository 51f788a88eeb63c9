/* A test driver of the CPU kernels (moe_serve/kernels/cpu_ops) for any ISA, without Python: it is
 * linked with the kernels' sources built for a target (tests/kernels/test_cpu_ops_driver.py builds
 * it for each x86 ISA this CPU runs, and with an aarch64 cross compiler for NEON and the plain-C
 * path, run under qemu-user), runs every entry point on deterministic random inputs (shapes off the
 * vector width, tails, the panel path, grouped heads, fresh and continuing sequences; 1 and 2
 * OpenMP threads), and compares each output with a plain double-precision reference written here.
 *
 *   cc -O2 [target flags] -fopenmp -o driver tests/kernels/cpu_ops_driver.c
 *      moe_serve/kernels/cpu_ops/{attention,gated_delta,moe,norm,quant}.c -lm && ./driver
 *
 * Prints one line per check (its max error: |got - ref| / (1 + |ref|)) and exits 1 if any fails. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the kernels' entry points (moe.c, attention.c, norm.c, gated_delta.c) ---- */
int moe_experts_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                    const void* w13, const void* w2, int w_bf16, int64_t E, int64_t F, float* out, int nt);
int64_t moe_panel_groups_run(void);
int linear_panels_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, const float* b, int64_t K, int64_t N,
                      float* y, int64_t ldy, int nt);
void linear_f32(const float* x, int64_t ldx, int64_t M, const void* w, int w_bf16, int64_t K, int64_t N, float* y,
                int64_t ldy, int nt);
/* kv_fmt: 0 float32 caches, 1 FP8 e4m3fn, 2 FP8 e5m2 (attention.c, fp8.h) */
int write_kv_f32(const float* k, int64_t ldk, const float* v, int64_t ldv, void* k_cache, void* v_cache,
                 const int64_t* slots, int64_t T, int64_t dk, int64_t dv, int64_t nslots, int kv_fmt);
int decode_attention_f32(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, const int32_t* bt,
                         int64_t ldbt, const int32_t* seq_lens, float* out, int64_t B, int64_t N, int64_t G,
                         int64_t H, int64_t Hv, int64_t bs, float scale, int nt, int kv_fmt);
int prefill_attention_f32(const float* q, int64_t ldq, const void* k_cache, const void* v_cache, const int32_t* bt,
                          int64_t ldbt, const int32_t* seq_lens, const int32_t* qsl, int64_t b0, int64_t b1,
                          float* out, int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, float scale, int nt,
                          int kv_fmt);
void rms_norm_f32(const float* x, int64_t ldx, const float* r, int64_t ldr, float* h, const float* w, float* out,
                  int64_t T, int64_t D, float eps, int nt);
int norm_rope_f32(const float* x, int64_t T, int64_t nh, int64_t ldt, int64_t hd, const float* w, float eps,
                  int64_t rot, const float* cos_tab, const float* sin_tab, int64_t P, const int64_t* pos, float* out,
                  int nt);
int gated_delta_step_f32(const float* q, const float* k, int64_t ldqk, const float* v, int64_t ldv, const float* g,
                         const float* beta, float* state, const int64_t* slots, const uint8_t* keep, float* o,
                         int64_t B, int64_t H, int64_t K, int64_t V, float scale, int l2norm, float eps, int nt);
void conv_step_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* conv_state,
                   const int64_t* slots, const uint8_t* keep, float* y, int64_t B, int64_t C, int64_t W, int silu_act,
                   int nt);
/* quant.c: packed int8 / int4 weights (codes, per-group scales and offsets or NULL) */
int quant_linear_f32(const float* x, int64_t ldx, int64_t M, const uint8_t* q, int bits, const void* scales,
                     int scales16, const float* offsets, int zero, int64_t G, int64_t K, int64_t N, float* y,
                     int64_t ldy, int act8, int nt);
int quant_experts_f32(const float* x, int64_t T, int64_t D, const int64_t* ids, const float* wts, int64_t K,
                      const uint8_t* q13, int bits13, const void* s13, int s13_16, const float* o13, int z13,
                      int64_t G13, const uint8_t* q2, int bits2, const void* s2, int s2_16, const float* o2, int z2,
                      int64_t G2, int64_t E, int64_t F, float* out, int act8, int nt);
const char* cpu_ops_isa(void);

/* ---- inputs ---- */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(void) { /* [-1, 1) */
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}
static float* randf(int64_t n, double scale) {
  float* p = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
  for (int64_t i = 0; i < n; i++) p[i] = (float)(uniform() * scale);
  return p;
}
static double* zeros(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static uint16_t to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
/* w rounded to bf16 in place (the reference then reads exactly the weights the kernel widens); the
 * bf16 copy returned */
static uint16_t* bf16_copy(float* w, int64_t n) {
  uint16_t* h = malloc((size_t)n * sizeof(uint16_t));
  for (int64_t i = 0; i < n; i++) {
    h[i] = to_bf16(w[i]);
    w[i] = from_bf16(h[i]);
  }
  return h;
}

/* ---- checking ---- */
static int failures, checks;
static void check(const char* what, const float* got, const double* ref, int64_t n, double tol) {
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double e = fabs((double)got[i] - ref[i]) / (1.0 + fabs(ref[i]));
    if (!(e <= worst)) worst = e; /* NaN sticks */
  }
  const int ok = worst <= tol;
  checks++;
  failures += !ok;
  printf("%-58s max err %.2e %s\n", what, worst, ok ? "ok" : "FAIL");
}
static void check_true(const char* what, int ok) {
  checks++;
  failures += !ok;
  printf("%-58s %s\n", what, ok ? "ok" : "FAIL");
}
/* an entry point's return code: a line only when it is not 0 */
static void check_rc(const char* what, int rc) {
  if (rc) {
    failures++;
    printf("%-58s returned %d FAIL\n", what, rc);
  }
}
#define TOL 5e-5

static double silu(double g) { return g / (1.0 + exp(-g)); }

/* ---- moe_experts_f32 ---- */
static void moe_case(int64_t T, int64_t D, int64_t F, int64_t E, int64_t K, int bf16, int held, int nt,
                     int expect_panels) {
  float* x = randf(T * D, 1.0);
  float* w13 = randf(E * 2 * F * D, 1.0 / sqrt((double)D));
  float* w2 = randf(E * D * F, 1.0 / sqrt((double)F));
  float* wts = randf(T * K, 1.0);
  int64_t* ids = malloc((size_t)(T * K) * sizeof(int64_t));
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      ids[t * K + k] = (t * 5 + k) % E; /* distinct per token (K <= E) */
      if (held && uniform() < -0.4) ids[t * K + k] = -1; /* an expert on another rank */
    }
  uint16_t *w13h = 0, *w2h = 0;
  if (bf16) {
    w13h = bf16_copy(w13, E * 2 * F * D);
    w2h = bf16_copy(w2, E * D * F);
  }
  double* ref = zeros(T * D);
  double* h = zeros(2 * F);
  double* a = zeros(F);
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      const int64_t e = ids[t * K + k];
      if (e < 0 || e >= E) continue;
      for (int64_t f = 0; f < 2 * F; f++) {
        double s = 0;
        for (int64_t d = 0; d < D; d++) s += (double)w13[(e * 2 * F + f) * D + d] * x[t * D + d];
        h[f] = s;
      }
      for (int64_t f = 0; f < F; f++) a[f] = silu(h[f]) * h[F + f];
      for (int64_t d = 0; d < D; d++) {
        double s = 0;
        for (int64_t f = 0; f < F; f++) s += (double)w2[(e * D + d) * F + f] * a[f];
        ref[t * D + d] += wts[t * K + k] * s;
      }
    }
  float* out = malloc((size_t)(T * D) * sizeof(float));
  const int64_t before = moe_panel_groups_run();
  const int rc = moe_experts_f32(x, T, D, ids, wts, K, bf16 ? (const void*)w13h : w13, bf16 ? (const void*)w2h : w2,
                                 bf16, E, F, out, nt);
  char what[160];
  snprintf(what, sizeof what, "moe_experts %s T=%ld D=%ld F=%ld E=%ld K=%ld nt=%d%s", bf16 ? "bf16" : "f32", (long)T,
           (long)D, (long)F, (long)E, (long)K, nt, expect_panels ? " (panels)" : "");
  check_rc(what, rc);
  check(what, out, ref, T * D, TOL);
  if (expect_panels) check_true("  ... took the panel path", moe_panel_groups_run() > before);
  free(x), free(w13), free(w2), free(wts), free(ids), free(w13h), free(w2h), free(ref), free(h), free(a), free(out);
}

/* ---- linear_f32, linear_panels_f32 ---- */
static void linear_case(int64_t M, int64_t K, int64_t N, int bf16, int panels, int nt) {
  const int64_t ldx = K + 5;
  float* x = randf(M * ldx, 1.0);
  float* w = randf(N * K, 1.0 / sqrt((double)K));
  float* b = randf(N, 1.0);
  uint16_t* wh = bf16 ? bf16_copy(w, N * K) : 0;
  double* ref = zeros(M * N);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double s = panels ? b[n] : 0.0;
      for (int64_t k = 0; k < K; k++) s += (double)x[m * ldx + k] * w[n * K + k];
      ref[m * N + n] = s;
    }
  float* y = malloc((size_t)(M * N) * sizeof(float));
  char what[160];
  if (panels) {
    const int rc = linear_panels_f32(x, ldx, M, bf16 ? (const void*)wh : w, bf16, b, K, N, y, N, nt);
    snprintf(what, sizeof what, "linear_panels %s M=%ld K=%ld N=%ld +bias nt=%d", bf16 ? "bf16" : "f32", (long)M,
             (long)K, (long)N, nt);
    check_rc(what, rc);
  } else {
    linear_f32(x, ldx, M, bf16 ? (const void*)wh : w, bf16, K, N, y, N, nt);
    snprintf(what, sizeof what, "linear %s M=%ld K=%ld N=%ld nt=%d", bf16 ? "bf16" : "f32", (long)M, (long)K, (long)N,
             nt);
  }
  check(what, y, ref, M * N, TOL);
  free(x), free(w), free(b), free(wh), free(ref), free(y);
}

/* ---- quant_linear_f32, quant_experts_f32: a packed weight of R rows of K (codes random, scales
 * positive; `offsets` bit 1: offsets -2^(bits-1) * scale plus noise, bit 2: the zero code
 * 2^(bits-1) - 1, bit 4: float16 scales, multiples of 2^-17) and its values in double ---- */
typedef struct {
  uint8_t* q;
  float *s, *o;
  uint16_t* h; /* the scales as float16 (bit 4) */
  int z;
  double* w;
} packed_t;
/* The float16 bits of a positive float that float16 holds exactly (a normal one). */
static uint16_t f16_bits(float f) {
  int e;
  const float m = frexpf(f, &e); /* f = m 2^e, m in [0.5, 1) */
  return (uint16_t)(((e + 14) << 10) | (uint32_t)((m * 2.0f - 1.0f) * 1024.0f));
}
static const void* packed_scales(const packed_t* p) { return p->h ? (const void*)p->h : (const void*)p->s; }
static packed_t packed_rand(int64_t R, int64_t K, int64_t G, int bits, int mode) {
  const int offsets = mode & 1;
  packed_t p;
  const int64_t ng = K / G;
  p.q = calloc((size_t)(R * K), 1);
  p.s = randf(R * ng, 0.01);
  p.o = offsets ? malloc((size_t)(R * ng) * sizeof(float)) : 0;
  p.w = zeros(R * K);
  p.z = mode & 2 ? (1 << (bits - 1)) - 1 : 0;
  p.h = mode & 4 ? malloc((size_t)(R * ng) * sizeof(uint16_t)) : 0;
  for (int64_t i = 0; i < R * ng; i++) {
    p.s[i] = fabsf(p.s[i]) + 0.001f;
    if (p.h) {
      p.s[i] = (float)(64 + (int)(p.s[i] * 40000.0f) % 1000) * (1.0f / 131072.0f);
      p.h[i] = f16_bits(p.s[i]);
    }
    if (offsets) p.o[i] = (float)(-(1 << (bits - 1)) * p.s[i] + 0.01 * uniform());
  }
  for (int64_t r = 0; r < R; r++)
    for (int64_t k = 0; k < K; k++) {
      const int c = (int)((uniform() + 1.0) * 0.5 * (1 << bits)) & ((1 << bits) - 1);
      if (bits == 8)
        p.q[r * K + k] = (uint8_t)c;
      else
        p.q[r * (K / 2) + k / 2] |= (uint8_t)(k % 2 ? c << 4 : c);
      const int64_t g = r * ng + k / G;
      p.w[r * K + k] = (double)p.s[g] * (c - p.z) + (offsets ? (double)p.o[g] : 0.0);
    }
  return p;
}
static void packed_free(packed_t p) { free(p.q), free(p.s), free(p.o), free(p.h), free(p.w); }

static void quant_linear_case(int64_t M, int64_t K, int64_t N, int64_t G, int bits, int offsets, int nt) {
  const int64_t ldx = K + 3;
  float* x = randf(M * ldx, 1.0);
  packed_t w = packed_rand(N, K, G, bits, offsets);
  double* ref = zeros(M * N);
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++)
      for (int64_t k = 0; k < K; k++) ref[m * N + n] += w.w[n * K + k] * x[m * ldx + k];
  float* y = malloc((size_t)(M * N) * sizeof(float));
  char what[160];
  snprintf(what, sizeof what, "quant_linear int%d%s%s%s M=%ld K=%ld N=%ld G=%ld nt=%d", bits, offsets & 1 ? "+off" : "",
           offsets & 2 ? "+zero" : "", offsets & 4 ? "+f16" : "", (long)M, (long)K, (long)N, (long)G, nt);
  check_rc(what, quant_linear_f32(x, ldx, M, w.q, bits, packed_scales(&w), w.h != 0, w.o, w.z, G, K, N, y, N, 0, nt));
  check(what, y, ref, M * N, TOL);
  free(x), free(ref), free(y), packed_free(w);
}

static void quant_experts_case(int64_t T, int64_t D, int64_t F, int64_t E, int64_t K, int64_t G, int bits, int nt) {
  float* x = randf(T * D, 1.0);
  packed_t w13 = packed_rand(E * 2 * F, D, G, bits, 6), w2 = packed_rand(E * D, F, F, 12 - bits, 3);
  float* wts = randf(T * K, 1.0);
  int64_t* ids = malloc((size_t)(T * K) * sizeof(int64_t));
  for (int64_t i = 0; i < T * K; i++) ids[i] = uniform() < -0.6 ? -1 : (i * 3 + i / K) % E;
  double* ref = zeros(T * D);
  double* h = zeros(2 * F);
  double* a = zeros(F);
  for (int64_t t = 0; t < T; t++)
    for (int64_t k = 0; k < K; k++) {
      const int64_t e = ids[t * K + k];
      if (e < 0) continue;
      for (int64_t f = 0; f < 2 * F; f++) {
        h[f] = 0;
        for (int64_t d = 0; d < D; d++) h[f] += w13.w[(e * 2 * F + f) * D + d] * x[t * D + d];
      }
      for (int64_t f = 0; f < F; f++) a[f] = silu(h[f]) * h[F + f];
      for (int64_t d = 0; d < D; d++) {
        double s = 0;
        for (int64_t f = 0; f < F; f++) s += w2.w[(e * D + d) * F + f] * a[f];
        ref[t * D + d] += wts[t * K + k] * s;
      }
    }
  float* out = malloc((size_t)(T * D) * sizeof(float));
  char what[160];
  snprintf(what, sizeof what, "quant_experts int%d/int%d T=%ld D=%ld F=%ld E=%ld K=%ld G=%ld nt=%d", bits, 12 - bits,
           (long)T, (long)D, (long)F, (long)E, (long)K, (long)G, nt);
  check_rc(what, quant_experts_f32(x, T, D, ids, wts, K, w13.q, bits, packed_scales(&w13), w13.h != 0, w13.o, w13.z, G,
                                   w2.q, 12 - bits, packed_scales(&w2), w2.h != 0, w2.o, w2.z, F, E, F, out, 0, nt));
  check(what, out, ref, T * D, TOL);
  free(x), free(wts), free(ids), free(ref), free(h), free(a), free(out), packed_free(w13), packed_free(w2);
}

/* ---- paged attention: a cache of nb blocks of bs slots, G kv heads; each sequence's blocks
 * scattered (block b of sequence i is table[i][b]) ---- */
typedef struct {
  int64_t nb, bs, G, H, Hv, B, W;
  float *k, *v;
  int32_t* table;
  uint8_t *k8, *v8; /* an FP8 cache (fmt 1 or 2): its bytes, k and v their values widened here */
} cache_t;

/* ---- FP8 (e4m3fn: fmt 1, e5m2: fmt 2), from their definitions: an independent widening, and the
 * nearest code by search (ties to the even code) for the rounding the kernels must match ---- */
static double fp8_value(uint8_t b, int fmt) {
  const int mb = fmt == 1 ? 3 : 2, bias = fmt == 1 ? 7 : 15, emax = fmt == 1 ? 15 : 31;
  const int e = (b & 0x7f) >> mb, m = b & ((1 << mb) - 1);
  const double sgn = b & 0x80 ? -1.0 : 1.0;
  if (fmt == 1 && e == emax && m == (1 << mb) - 1) return NAN;
  if (fmt == 2 && e == emax) return m ? NAN : sgn * INFINITY;
  return sgn * (e ? ldexp((double)((1 << mb) + m), e - bias - mb) : ldexp((double)m, 1 - bias - mb));
}
static double fp8_max(int fmt) { return fmt == 1 ? 448.0 : 57344.0; }
static uint8_t fp8_nearest(float x, int fmt) {
  if (isnan(x)) return 0x7f;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const double a = fmin(fabs((double)x), fp8_max(fmt));
  int best = 0;
  for (int c = 1; c < 0x80; c++) {
    const double v = fp8_value((uint8_t)c, fmt);
    if (!isfinite(v)) continue;
    const double d = fabs(v - a), db = fabs(fp8_value((uint8_t)best, fmt) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return sign | (uint8_t)best;
}
/* n random FP8 bytes of values below 8 in magnitude (subnormals included), their values in f */
static uint8_t* fp8_rand(int64_t n, int fmt, float* f) {
  uint8_t* p = malloc((size_t)(n > 0 ? n : 1));
  const int mb = fmt == 1 ? 3 : 2, etop = fmt == 1 ? 10 : 18; /* exponent fields 0 .. etop - 1 */
  for (int64_t i = 0; i < n; i++) {
    const int e = (int)((uniform() + 1.0) * 0.5 * etop), m = (int)((uniform() + 1.0) * 0.5 * (1 << mb));
    p[i] = (uint8_t)((uniform() < 0 ? 0x80 : 0) | (e << mb) | m);
    f[i] = (float)fp8_value(p[i], fmt);
  }
  return p;
}

static cache_t make_cache(int64_t B, const int32_t* lens, int64_t bs, int64_t G, int64_t H, int64_t Hv, int fmt) {
  cache_t c = {0, bs, G, H, Hv, B, 1, 0, 0, 0, 0, 0};
  for (int64_t b = 0; b < B; b++) {
    const int64_t w = (lens[b] + bs - 1) / bs;
    c.nb += w;
    if (w > c.W) c.W = w;
  }
  c.nb += 3;
  c.k = randf(c.nb * bs * G * H, 1.0);
  c.v = randf(c.nb * bs * G * Hv, 1.0);
  if (fmt) {
    c.k8 = fp8_rand(c.nb * bs * G * H, fmt, c.k);
    c.v8 = fp8_rand(c.nb * bs * G * Hv, fmt, c.v);
  }
  c.table = calloc((size_t)(B * c.W), sizeof(int32_t));
  int64_t next = 0;
  for (int64_t b = 0; b < B; b++) /* blocks handed out backwards, skipping some: not contiguous */
    for (int64_t w = 0; w < (lens[b] + bs - 1) / bs; w++) c.table[b * c.W + w] = (int32_t)(c.nb - 1 - next++ * 1);
  return c;
}
static const float* key_at(const cache_t* c, int64_t b, int64_t s, int64_t g) {
  const int64_t slot = (int64_t)c->table[b * c->W + s / c->bs] * c->bs + s % c->bs;
  return c->k + (slot * c->G + g) * c->H;
}
static const float* val_at(const cache_t* c, int64_t b, int64_t s, int64_t g) {
  const int64_t slot = (int64_t)c->table[b * c->W + s / c->bs] * c->bs + s % c->bs;
  return c->v + (slot * c->G + g) * c->Hv;
}
/* o[0..Hv) = softmax_s(scale q . k_s) v_s over s < vis */
static void attend(const cache_t* c, int64_t b, int64_t g, const float* q, int64_t vis, double scale, double* o) {
  double* p = zeros(vis);
  double m = -INFINITY, sum = 0;
  for (int64_t s = 0; s < vis; s++) {
    const float* kk = key_at(c, b, s, g);
    double d = 0;
    for (int64_t h = 0; h < c->H; h++) d += (double)q[h] * kk[h];
    p[s] = d * scale;
    if (p[s] > m) m = p[s];
  }
  for (int64_t s = 0; s < vis; s++) sum += p[s] = exp(p[s] - m);
  for (int64_t d = 0; d < c->Hv; d++) o[d] = 0;
  for (int64_t s = 0; s < vis; s++) {
    const float* vv = val_at(c, b, s, g);
    for (int64_t d = 0; d < c->Hv; d++) o[d] += p[s] / sum * vv[d];
  }
  free(p);
}

#define FMT_NAME(fmt) ((fmt) == 1 ? " e4m3" : (fmt) == 2 ? " e5m2" : "")

/* write_kv_f32 into FP8 caches: every FP8 value, the midpoints between neighbours (ties) and the
 * floats just off them, float32 subnormals, saturation, infinities and random values over many
 * binades, each stored as the nearest code (ties to even) of its value clamped to the finite max;
 * and every byte read back exactly by the decode kernel (a context of one key: output = its value
 * row; vector lanes and a tail). */
static void fp8_write_read_case(int fmt) {
  enum { H = 16 };
  float* x = malloc(4096 * sizeof(float));
  int64_t n = 0;
  for (int c = 0; c < 0x7f; c++) {
    const double v = fp8_value((uint8_t)c, fmt), w = fp8_value((uint8_t)(c + 1), fmt);
    if (!isfinite(v)) continue;
    x[n++] = (float)v;
    if (!isfinite(w)) continue;
    const float mid = (float)((v + w) / 2);
    x[n++] = mid, x[n++] = nextafterf(mid, 0.f), x[n++] = nextafterf(mid, INFINITY);
  }
  const float specials[] = {0.f, 1e-45f, 1.2e-38f, 3e-30f, 1e-8f, 448.f, 464.f, 465.f, 480.f, 1e4f,
                            57344.f, 61440.f, 61441.f, 1e30f, INFINITY};
  for (size_t i = 0; i < sizeof specials / sizeof *specials; i++) x[n++] = specials[i];
  while (n % H || n < 1400) x[n++] = (float)(uniform() * ldexp(1.0, (int)(uniform() * 24)));
  for (int64_t i = 0, m = n; i < m; i++) x[n++] = -x[i];
  const int64_t T = n / H;
  int64_t* slots = malloc((size_t)T * sizeof(int64_t));
  for (int64_t t = 0; t < T; t++) slots[t] = T - 1 - t;
  uint8_t *kc = calloc((size_t)n, 1), *vc = calloc((size_t)n, 1);
  int bad = write_kv_f32(x, H, x, H, kc, vc, slots, T, H, H, T, fmt) != 0;
  for (int64_t t = 0; t < T; t++)
    for (int64_t i = 0; i < H; i++)
      bad += kc[slots[t] * H + i] != fp8_nearest(x[t * H + i], fmt) || vc[slots[t] * H + i] != kc[slots[t] * H + i];
  char what[160];
  snprintf(what, sizeof what, "write_kv%s: %ld values as the nearest code", FMT_NAME(fmt), (long)n);
  check_true(what, bad == 0);
  /* reads: a value row of all 256 codes, one key; rows of 256 and 23 (a tail) */
  uint8_t row[256], key[H];
  for (int i = 0; i < 256; i++) row[i] = (uint8_t)i;
  memset(key, fmt == 1 ? 0x38 : 0x3c, H); /* 1.0 */
  const int32_t table = 0, len = 1;
  float q[H], out[256];
  for (int i = 0; i < H; i++) q[i] = (float)uniform();
  bad = 0;
  for (int hv = 256; hv >= 23; hv -= 233) {
    bad += decode_attention_f32(q, H, key, row, &table, 1, &len, out, 1, 1, 1, H, hv, 1, 0.25f, 1, fmt) != 0;
    for (int i = 0; i < hv; i++) {
      const double want = fp8_value((uint8_t)i, fmt);
      bad += isnan(want) ? !isnan(out[i]) : (double)out[i] != want;
    }
  }
  snprintf(what, sizeof what, "decode_attention%s reads all 256 bytes exactly", FMT_NAME(fmt));
  check_true(what, bad == 0);
  free(x), free(slots), free(kc), free(vc);
}

static void decode_attention_case(int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, int nt, int fmt) {
  const int32_t lens[4] = {1, 9, 3 * (int32_t)bs + 1, 37};
  const int64_t B = 4;
  cache_t c = make_cache(B, lens, bs, G, H, Hv, fmt);
  const int64_t ldq = N * H + 3;
  float* q = randf(B * ldq, 1.0);
  const double scale = 1.0 / sqrt((double)H);
  double* ref = zeros(B * N * Hv);
  for (int64_t b = 0; b < B; b++)
    for (int64_t n = 0; n < N; n++) attend(&c, b, n / (N / G), q + b * ldq + n * H, lens[b], scale, ref + (b * N + n) * Hv);
  float* out = malloc((size_t)(B * N * Hv) * sizeof(float));
  const int rc = decode_attention_f32(q, ldq, fmt ? (void*)c.k8 : c.k, fmt ? (void*)c.v8 : c.v, c.table, c.W, lens,
                                      out, B, N, G, H, Hv, bs, (float)scale, nt, fmt);
  char what[160];
  snprintf(what, sizeof what, "decode_attention%s N=%ld G=%ld H=%ld Hv=%ld bs=%ld nt=%d", FMT_NAME(fmt), (long)N,
           (long)G, (long)H, (long)Hv, (long)bs, nt);
  check_rc(what, rc);
  check(what, out, ref, B * N * Hv, TOL);
  free(c.k), free(c.v), free(c.table), free(c.k8), free(c.v8), free(q), free(ref), free(out);
}

static void prefill_attention_case(int64_t N, int64_t G, int64_t H, int64_t Hv, int64_t bs, int nt, int fmt) {
  /* sequence 0 is not computed (b0 = 1); sequence 2: 35 cached tokens, then a chunk of 5 */
  const int32_t qlen[5] = {1, 7, 5, 1, 70}, lens[5] = {9, 7, 40, 1, 70};
  const int64_t B = 5;
  int32_t qsl[6] = {0};
  for (int64_t b = 0; b < B; b++) qsl[b + 1] = qsl[b] + qlen[b];
  const int64_t T = qsl[B];
  cache_t c = make_cache(B, lens, bs, G, H, Hv, fmt);
  const int64_t ldq = N * H + 1;
  float* q = randf(T * ldq, 1.0);
  const double scale = 1.0 / sqrt((double)H);
  double* ref = zeros(T * N * Hv);
  float* out = malloc((size_t)(T * N * Hv) * sizeof(float));
  for (int64_t i = 0; i < T * N * Hv; i++) out[i] = 7.f, ref[i] = 7.0;
  for (int64_t b = 1; b < B; b++)
    for (int64_t i = 0; i < qlen[b]; i++)
      for (int64_t n = 0; n < N; n++)
        attend(&c, b, n / (N / G), q + (qsl[b] + i) * ldq + n * H, lens[b] - qlen[b] + i + 1, scale,
               ref + ((qsl[b] + i) * N + n) * Hv);
  const int rc = prefill_attention_f32(q, ldq, fmt ? (void*)c.k8 : c.k, fmt ? (void*)c.v8 : c.v, c.table, c.W, lens,
                                       qsl, 1, B, out, N, G, H, Hv, bs, (float)scale, nt, fmt);
  char what[160];
  snprintf(what, sizeof what, "prefill_attention%s N=%ld G=%ld H=%ld Hv=%ld bs=%ld nt=%d", FMT_NAME(fmt), (long)N,
           (long)G, (long)H, (long)Hv, (long)bs, nt);
  check_rc(what, rc);
  check(what, out, ref, T * N * Hv, TOL); /* sequence 0's rows: still 7 */
  free(c.k), free(c.v), free(c.table), free(c.k8), free(c.v8), free(q), free(ref), free(out);
}

/* ---- rms_norm_f32, norm_rope_f32 ---- */
static void rms_norm_case(int64_t T, int64_t D, int residual, int nt) {
  const int64_t ldx = D + 3;
  float* x = randf(T * ldx, 3.0);
  float* r = randf(T * ldx, 1.0);
  float* w = randf(D, 1.0);
  const double eps = 1e-6;
  double* ref = zeros(T * D);
  double* href = zeros(T * D);
  for (int64_t t = 0; t < T; t++) {
    double ss = 0;
    for (int64_t d = 0; d < D; d++) {
      href[t * D + d] = residual ? (double)(x[t * ldx + d] + r[t * ldx + d]) : x[t * ldx + d];
      ss += href[t * D + d] * href[t * D + d];
    }
    const double inv = 1.0 / sqrt(ss / D + eps);
    for (int64_t d = 0; d < D; d++) ref[t * D + d] = href[t * D + d] * inv * w[d];
  }
  float* h = malloc((size_t)(T * D) * sizeof(float));
  float* out = malloc((size_t)(T * D) * sizeof(float));
  rms_norm_f32(x, ldx, residual ? r : 0, ldx, residual ? h : 0, w, out, T, D, (float)eps, nt);
  char what[160];
  snprintf(what, sizeof what, "rms_norm%s T=%ld D=%ld nt=%d", residual ? "+residual" : "", (long)T, (long)D, nt);
  check(what, out, ref, T * D, TOL);
  if (residual) check("  ... h = x + r", h, href, T * D, 0.0);
  free(x), free(r), free(w), free(ref), free(href), free(h), free(out);
}

static void norm_rope_case(int64_t T, int64_t nh, int64_t hd, int64_t rot, int norm, int nt) {
  const int64_t ldt = nh * hd + 8, P = 64;
  float* x = randf(T * ldt, 2.0);
  float* w = norm ? randf(hd, 1.0) : 0;
  float* cs = malloc((size_t)(P * rot) * sizeof(float));
  float* sn = malloc((size_t)(P * rot) * sizeof(float));
  for (int64_t p = 0; p < P; p++)
    for (int64_t i = 0; i < rot; i++) {
      const double f = p * pow(10000.0, -2.0 * (double)(i % (rot / 2)) / rot);
      cs[p * rot + i] = (float)cos(f);
      sn[p * rot + i] = (float)(i < rot / 2 ? -sin(f) : sin(f)); /* rotate_half's sign in the table */
    }
  int64_t* pos = malloc((size_t)T * sizeof(int64_t));
  for (int64_t t = 0; t < T; t++) pos[t] = (t * 7 + 3) % P;
  const double eps = 1e-6;
  double* ref = zeros(T * nh * hd);
  double* y = zeros(hd);
  for (int64_t t = 0; t < T; t++)
    for (int64_t h = 0; h < nh; h++) {
      const float* src = x + t * ldt + h * hd;
      double ss = 0;
      for (int64_t i = 0; i < hd; i++) ss += (double)src[i] * src[i];
      const double inv = norm ? 1.0 / sqrt(ss / hd + eps) : 1.0;
      for (int64_t i = 0; i < hd; i++) y[i] = src[i] * inv * (norm ? w[i] : 1.0);
      double* o = ref + (t * nh + h) * hd;
      for (int64_t i = 0; i < rot; i++)
        o[i] = y[i] * cs[pos[t] * rot + i] + y[(i + rot / 2) % rot] * sn[pos[t] * rot + i];
      for (int64_t i = rot; i < hd; i++) o[i] = y[i];
    }
  float* out = malloc((size_t)(T * nh * hd) * sizeof(float));
  const int rc = norm_rope_f32(x, T, nh, ldt, hd, w, (float)eps, rot, cs, sn, P, pos, out, nt);
  char what[160];
  snprintf(what, sizeof what, "norm_rope T=%ld nh=%ld hd=%ld rot=%ld%s nt=%d", (long)T, (long)nh, (long)hd, (long)rot,
           norm ? " +norm" : "", nt);
  check_rc(what, rc);
  check(what, out, ref, T * nh * hd, 2 * TOL);
  pos[T - 1] = P; /* outside the table: refused, nothing written */
  check_true("  ... refuses a position outside the table", norm_rope_f32(x, T, nh, ldt, hd, w, (float)eps, rot, cs,
                                                                         sn, P, pos, out, nt) == -1);
  free(x), free(w), free(cs), free(sn), free(pos), free(ref), free(y), free(out);
}

/* ---- gated_delta_step_f32, conv_step_f32 ---- */
static void gated_delta_case(int64_t B, int64_t H, int64_t K, int64_t V, int l2norm, int nt) {
  const int64_t ldqk = H * K + 4, ldv = H * V + 2, S = B + 2;
  float* q = randf(B * ldqk, 1.0);
  float* k = randf(B * ldqk, 1.0);
  float* v = randf(B * ldv, 1.0);
  float* g = randf(B * H, 1.0);
  float* beta = randf(B * H, 1.0);
  for (int64_t i = 0; i < B * H; i++) g[i] = -fabsf(g[i]), beta[i] = fabsf(beta[i]);
  float* state = randf(S * H * K * V, 0.3);
  double* sref = zeros(S * H * K * V);
  for (int64_t i = 0; i < S * H * K * V; i++) sref[i] = state[i];
  int64_t* slots = malloc((size_t)B * sizeof(int64_t));
  uint8_t* keep = malloc((size_t)B);
  for (int64_t b = 0; b < B; b++) slots[b] = (b * 2 + 1) % S, keep[b] = b % 3 != 1;
  const double scale = 1.0 / sqrt((double)K), eps = 1e-6;
  double* oref = zeros(B * H * V);
  double *qn = zeros(K), *kn = zeros(K), *delta = zeros(V);
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++) {
      const float *qb = q + b * ldqk + h * K, *kb = k + b * ldqk + h * K, *vb = v + b * ldv + h * V;
      double sq = 0, sk = 0, kq = 0;
      for (int64_t i = 0; i < K; i++) sq += (double)qb[i] * qb[i], sk += (double)kb[i] * kb[i];
      for (int64_t i = 0; i < K; i++) {
        qn[i] = qb[i] * scale / (l2norm ? sqrt(sq + eps) : 1.0);
        kn[i] = kb[i] / (l2norm ? sqrt(sk + eps) : 1.0);
        kq += qn[i] * kn[i];
      }
      double* Sm = sref + (slots[b] * H + h) * K * V;
      if (!keep[b])
        for (int64_t i = 0; i < K * V; i++) Sm[i] = 0;
      const double a = exp(g[b * H + h]);
      for (int64_t j = 0; j < V; j++) {
        double pk = 0, pq = 0;
        for (int64_t i = 0; i < K; i++) pk += kn[i] * Sm[i * V + j], pq += qn[i] * Sm[i * V + j];
        delta[j] = beta[b * H + h] * (vb[j] - a * pk);
        oref[(b * H + h) * V + j] = a * pq + kq * delta[j];
      }
      for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < V; j++) Sm[i * V + j] = a * Sm[i * V + j] + kn[i] * delta[j];
    }
  float* o = malloc((size_t)(B * H * V) * sizeof(float));
  const int rc = gated_delta_step_f32(q, k, ldqk, v, ldv, g, beta, state, slots, keep, o, B, H, K, V, (float)scale,
                                      l2norm, (float)eps, nt);
  char what[160];
  snprintf(what, sizeof what, "gated_delta_step B=%ld H=%ld K=%ld V=%ld%s nt=%d", (long)B, (long)H, (long)K, (long)V,
           l2norm ? " l2norm" : "", nt);
  check_rc(what, rc);
  check(what, o, oref, B * H * V, 2 * TOL);
  check("  ... every state slot", state, sref, S * H * K * V, 2 * TOL);
  free(q), free(k), free(v), free(g), free(beta), free(state), free(sref), free(slots), free(keep), free(oref);
  free(qn), free(kn), free(delta), free(o);
}

static void conv_case(int64_t B, int64_t C, int64_t W, int act, int nt) {
  const int64_t ldx = C + 3, Wm = W - 1, S = B + 1;
  float* x = randf(B * ldx, 1.0);
  float* w = randf(C * W, 1.0);
  float* bias = randf(C, 1.0);
  float* st = randf(S * C * Wm, 1.0);
  double* sref = zeros(S * C * Wm);
  for (int64_t i = 0; i < S * C * Wm; i++) sref[i] = st[i];
  int64_t* slots = malloc((size_t)B * sizeof(int64_t));
  uint8_t* keep = malloc((size_t)B);
  for (int64_t b = 0; b < B; b++) slots[b] = (b + 1) % S, keep[b] = b != 1;
  double* ref = zeros(B * C);
  for (int64_t b = 0; b < B; b++)
    for (int64_t c = 0; c < C; c++) {
      double* s = sref + (slots[b] * C + c) * Wm;
      double acc = bias[c];
      for (int64_t j = 0; j < Wm; j++) acc += (double)w[c * W + j] * (keep[b] ? s[j] : 0.0);
      acc += (double)w[c * W + Wm] * x[b * ldx + c];
      ref[b * C + c] = act ? silu(acc) : acc;
      for (int64_t j = 0; j + 1 < Wm; j++) s[j] = keep[b] ? s[j + 1] : 0.0;
      s[Wm - 1] = x[b * ldx + c];
    }
  float* y = malloc((size_t)(B * C) * sizeof(float));
  conv_step_f32(x, ldx, w, bias, st, slots, keep, y, B, C, W, act, nt);
  char what[160];
  snprintf(what, sizeof what, "conv_step B=%ld C=%ld W=%ld%s nt=%d", (long)B, (long)C, (long)W, act ? " silu" : "",
           nt);
  check(what, y, ref, B * C, TOL);
  check("  ... every window", st, sref, S * C * Wm, 0.0);
  free(x), free(w), free(bias), free(st), free(sref), free(slots), free(keep), free(ref), free(y);
}

/* SiLU at extreme gates through the vectorised exp: one expert whose gate rows pick single input
 * columns (-120 .. 120), up rows a constant 1: out = silu(x) exactly, finite. */
static void silu_range_case(void) {
  const int64_t F = 32, D = 33;
  float* x = calloc((size_t)(2 * D), sizeof(float));
  float* w13 = calloc((size_t)(2 * F * D), sizeof(float));
  float* w2 = calloc((size_t)(D * F), sizeof(float));
  for (int64_t t = 0; t < 2; t++) {
    for (int64_t f = 0; f < F; f++) x[t * D + f] = (float)(-120.0 + 240.0 * f / (F - 1));
    x[t * D + D - 1] = 1.f;
  }
  for (int64_t f = 0; f < F; f++) {
    w13[f * D + f] = 1.f;
    w13[(F + f) * D + D - 1] = 1.f;
    w2[f * F + f] = 1.f;
  }
  int64_t ids[2] = {0, 0};
  float wts[2] = {1.f, 1.f};
  double ref[66];
  for (int64_t t = 0; t < 2; t++)
    for (int64_t d = 0; d < D; d++) ref[t * D + d] = d < F ? silu(x[t * D + d]) : 0.0;
  float out[66];
  moe_experts_f32(x, 2, D, ids, wts, 1, w13, w2, 0, 1, F, out, 1);
  check("moe_experts silu over -120 .. 120 (finite, exact)", out, ref, 2 * D, 2e-6);
  free(x), free(w13), free(w2);
}

int main(void) {
  printf("cpu_ops driver: vec.h built for %s\n", cpu_ops_isa());
  silu_range_case();
  fp8_write_read_case(1);
  fp8_write_read_case(2);
  for (int nt = 1; nt <= 2; nt++) {
    /* decode tiles: every row count of a micro-tile, D, F and 2F off the vector width and the
     * 4-row tile, experts held elsewhere */
    moe_case(1, 64, 32, 8, 2, 0, 1, nt, 0);
    moe_case(5, 40, 24, 6, 2, 0, 1, nt, 0);
    moe_case(7, 17, 9, 4, 2, 0, 1, nt, 0);
    moe_case(5, 40, 24, 6, 2, 1, 1, nt, 0);
    moe_case(7, 17, 9, 4, 2, 1, 1, nt, 0);
    moe_case(33, 128, 80, 16, 4, 1, 1, nt, 0); /* bf16, at most 16 rows an expert: the tiles */
    moe_case(100, 64, 32, 3, 2, 1, 1, nt, 1); /* bf16 panels: each row block widened once */
    moe_case(34, 40, 12, 2, 1, 1, 0, nt, 1);  /* bf16 panels, rows shorter than a vector (tails) */
    /* the panel path: 17+ rows an expert, partial panels, D off 16, experts on both sides */
    moe_case(34, 40, 12, 2, 1, 0, 0, nt, 1);
    moe_case(100, 64, 32, 3, 2, 0, 1, nt, 1);
    moe_case(120, 48, 20, 16, 4, 0, 1, nt, 1);
    linear_case(1, 64, 40, 0, 0, nt);
    linear_case(3, 40, 17, 0, 0, nt);
    linear_case(5, 37, 30, 1, 0, nt);
    linear_case(16, 64, 96, 1, 0, nt);
    linear_case(5, 33, 40, 0, 1, nt);
    linear_case(50, 20, 16, 0, 1, nt);
    linear_case(17, 100, 200, 0, 1, nt);
    linear_case(50, 20, 16, 1, 1, nt);
    linear_case(17, 100, 200, 1, 1, nt);
    for (int fmt = 0; fmt <= 2; fmt++) { /* float32 caches, then FP8 e4m3fn and e5m2 */
      decode_attention_case(8, 2, 64, 64, 4, nt, fmt); /* grouped: 4 heads a key, H % 16 == 0 */
      decode_attention_case(3, 1, 40, 24, 3, nt, fmt);
      decode_attention_case(4, 4, 17, 80, 1, nt, fmt);
      prefill_attention_case(8, 2, 64, 64, 4, nt, fmt);
      prefill_attention_case(3, 1, 40, 24, 3, nt, fmt);
      prefill_attention_case(6, 2, 16, 72, 8, nt, fmt);
    }
    rms_norm_case(3, 37, 1, nt);
    rms_norm_case(5, 64, 0, nt);
    rms_norm_case(2, 300, 1, nt);
    norm_rope_case(5, 3, 40, 24, 1, nt);
    norm_rope_case(4, 2, 64, 64, 0, nt);
    norm_rope_case(3, 2, 128, 64, 1, nt);
    gated_delta_case(3, 2, 20, 36, 1, nt);
    gated_delta_case(2, 3, 64, 16, 0, nt);
    conv_case(3, 40, 4, 1, nt);
    conv_case(2, 600, 4, 0, nt);
    for (int bits = 4; bits <= 8; bits += 4) { /* groups of 32, 64, K, and with a tail (40) */
      quant_linear_case(1, 128, 37, 32, bits, 1, nt);
      quant_linear_case(3, 128, 19, 64, bits, 0, nt);
      quant_linear_case(1, 96, 13, 32, bits, 2, nt);
      quant_linear_case(6, 64, 11, 16, bits, 2, nt);
      quant_linear_case(2, 64, 7, 32, bits, 3, nt);
      quant_linear_case(1, 64, 9, 32, bits, 6, nt);
      quant_linear_case(5, 96, 13, 48, bits, 7, nt);
      quant_linear_case(2, 1040, 6, 4, bits, 6, nt); /* 260 groups a row: the tiles' widened scales on the heap */
      quant_linear_case(5, 80, 23, 40, bits, 1, nt);
      quant_linear_case(17, 96, 9, 96, bits, 1, nt);
      quant_experts_case(5, 64, 24, 4, 2, 32, bits, nt);
    }
  }
  printf("cpu_ops driver (%s): %d of %d checks passed\n", cpu_ops_isa(), checks - failures, checks);
  return failures ? 1 : 0;
}
