/* A decode graph's C calls replayed from C (moe_serve/cpu_graph.py): one call of `cpu_ops_replay`
 * runs a recorded run of kernel calls, in place of a ctypes call each (about 1.5 us of argument
 * conversion a call, and the Python loop around it: on a 2-core Xeon about half a millisecond of a
 * 7 ms Q4_0 decode step of 193 calls).
 *
 * Each recorded call is its function's address, the index of its C signature in `SIGS` and its
 * arguments, each a pointer, an integer (int64_t or int) or a float. A signature is the kernel's
 * return kind (i: int, v: void) then one letter an argument (p: a pointer, l: int64_t, i: int,
 * f: float), as the Python side reads it from the ctypes argtypes it binds; `cpu_ops_replay_sig`
 * says whether one is here. A kernel of a signature not here is replayed by its ctypes call (the
 * graph falls back call by call), so a new kernel runs either way; adding its signature here makes
 * its replay native. Each case calls through a pointer of that exact C type (every pointer is passed
 * as const void*: one representation on every ABI this builds for). */
#include <stdint.h>
#include <string.h>

#define REPLAY_ARGS 25

typedef union {
  const void* p;
  int64_t l;
  double f;
} replay_arg;

typedef struct {
  const void* fn;
  int64_t sig;
  replay_arg a[REPLAY_ARGS];
} replay_call;

static const char* const SIGS[] = {
    "ipllpplppillpi",
    "iplplppplllli",
    "iplllipp",
    "vplplpppllfi",
    "iplppplppllplllllfii",
    "ipllllpflpplppi",
    "iplpl",
    "ipllpipllpli",
    "ipllpillpli",
    "vpllpillpli",
    "ipplplppppppllllfifi",
    "iplppplppllllllfii",
    "vplpppppplllii",
    "ipllpipipilllplii",
    "ipllpplpipipilpipipilllpii"};

/* The index of signature `sig` here, or -1. */
int64_t cpu_ops_replay_sig(const char* sig) {
  for (int64_t i = 0; i < (int64_t)(sizeof SIGS / sizeof SIGS[0]); i++)
    if (!strcmp(SIGS[i], sig)) return i;
  return -1;
}

/* The bytes of one recorded call (the Python side checks its layout against it). */
int64_t cpu_ops_replay_call_bytes(void) { return (int64_t)sizeof(replay_call); }

static int replay_one(const replay_call* c) {
  const replay_arg* a = c->a;
  switch (c->sig) {
    case 0: /* ipllpplppillpi */
      return ((int (*)(const void*, int64_t, int64_t, const void*, const void*, int64_t, const void*, const void*, int, int64_t, int64_t, const void*, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, a[4].p, a[5].l, a[6].p, a[7].p, (int)a[8].l, a[9].l, a[10].l, a[11].p, (int)a[12].l);
    case 1: /* iplplppplllli */
      return ((int (*)(const void*, int64_t, const void*, int64_t, const void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t, int))c->fn)(a[0].p, a[1].l, a[2].p, a[3].l, a[4].p, a[5].p, a[6].p, a[7].l, a[8].l, a[9].l, a[10].l, (int)a[11].l);
    case 2: /* iplllipp */
      return ((int (*)(const void*, int64_t, int64_t, int64_t, int, const void*, const void*))c->fn)(a[0].p, a[1].l, a[2].l, a[3].l, (int)a[4].l, a[5].p, a[6].p);
    case 3: /* vplplpppllfi */
      ((void (*)(const void*, int64_t, const void*, int64_t, const void*, const void*, const void*, int64_t, int64_t, float, int))c->fn)(a[0].p, a[1].l, a[2].p, a[3].l, a[4].p, a[5].p, a[6].p, a[7].l, a[8].l, (float)a[9].f, (int)a[10].l);
      return 0;
    case 4: /* iplppplppllplllllfii */
      return ((int (*)(const void*, int64_t, const void*, const void*, const void*, int64_t, const void*, const void*, int64_t, int64_t, const void*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int))c->fn)(a[0].p, a[1].l, a[2].p, a[3].p, a[4].p, a[5].l, a[6].p, a[7].p, a[8].l, a[9].l, a[10].p, a[11].l, a[12].l, a[13].l, a[14].l, a[15].l, (float)a[16].f, (int)a[17].l, (int)a[18].l);
    case 5: /* ipllllpflpplppi */
      return ((int (*)(const void*, int64_t, int64_t, int64_t, int64_t, const void*, float, int64_t, const void*, const void*, int64_t, const void*, const void*, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].l, a[4].l, a[5].p, (float)a[6].f, a[7].l, a[8].p, a[9].p, a[10].l, a[11].p, a[12].p, (int)a[13].l);
    case 6: /* iplpl */
      return ((int (*)(const void*, int64_t, const void*, int64_t))c->fn)(a[0].p, a[1].l, a[2].p, a[3].l);
    case 7: /* ipllpipllpli */
      return ((int (*)(const void*, int64_t, int64_t, const void*, int, const void*, int64_t, int64_t, const void*, int64_t, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, (int)a[4].l, a[5].p, a[6].l, a[7].l, a[8].p, a[9].l, (int)a[10].l);
    case 8: /* ipllpillpli */
      return ((int (*)(const void*, int64_t, int64_t, const void*, int, int64_t, int64_t, const void*, int64_t, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, (int)a[4].l, a[5].l, a[6].l, a[7].p, a[8].l, (int)a[9].l);
    case 9: /* vpllpillpli */
      ((void (*)(const void*, int64_t, int64_t, const void*, int, int64_t, int64_t, const void*, int64_t, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, (int)a[4].l, a[5].l, a[6].l, a[7].p, a[8].l, (int)a[9].l);
      return 0;
    case 10: /* ipplplppppppllllfifi */
      return ((int (*)(const void*, const void*, int64_t, const void*, int64_t, const void*, const void*, const void*, const void*, const void*, const void*, int64_t, int64_t, int64_t, int64_t, float, int, float, int))c->fn)(a[0].p, a[1].p, a[2].l, a[3].p, a[4].l, a[5].p, a[6].p, a[7].p, a[8].p, a[9].p, a[10].p, a[11].l, a[12].l, a[13].l, a[14].l, (float)a[15].f, (int)a[16].l, (float)a[17].f, (int)a[18].l);
    case 11: /* iplppplppllllllfii */
      return ((int (*)(const void*, int64_t, const void*, const void*, const void*, int64_t, const void*, const void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int))c->fn)(a[0].p, a[1].l, a[2].p, a[3].p, a[4].p, a[5].l, a[6].p, a[7].p, a[8].l, a[9].l, a[10].l, a[11].l, a[12].l, a[13].l, (float)a[14].f, (int)a[15].l, (int)a[16].l);
    case 12: /* vplpppppplllii */
      ((void (*)(const void*, int64_t, const void*, const void*, const void*, const void*, const void*, const void*, int64_t, int64_t, int64_t, int, int))c->fn)(a[0].p, a[1].l, a[2].p, a[3].p, a[4].p, a[5].p, a[6].p, a[7].p, a[8].l, a[9].l, a[10].l, (int)a[11].l, (int)a[12].l);
      return 0;
    case 13: /* ipllpipipilllplii */
      return ((int (*)(const void*, int64_t, int64_t, const void*, int, const void*, int, const void*, int, int64_t, int64_t, int64_t, const void*, int64_t, int, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, (int)a[4].l, a[5].p, (int)a[6].l, a[7].p, (int)a[8].l, a[9].l, a[10].l, a[11].l, a[12].p, a[13].l, (int)a[14].l, (int)a[15].l);
    case 14: /* ipllpplpipipilpipipilllpii */
      return ((int (*)(const void*, int64_t, int64_t, const void*, const void*, int64_t, const void*, int, const void*, int, const void*, int, int64_t, const void*, int, const void*, int, const void*, int, int64_t, int64_t, int64_t, const void*, int, int))c->fn)(a[0].p, a[1].l, a[2].l, a[3].p, a[4].p, a[5].l, a[6].p, (int)a[7].l, a[8].p, (int)a[9].l, a[10].p, (int)a[11].l, a[12].l, a[13].p, (int)a[14].l, a[15].p, (int)a[16].l, a[17].p, (int)a[18].l, a[19].l, a[20].l, a[21].l, a[22].p, (int)a[23].l, (int)a[24].l);
  }
  return -100; /* an unknown signature: never recorded (cpu_ops_replay_sig said no) */
}

/* Run calls[0..n) in order; 0, or 1 + the index of the first call that returned an error (its
 * code in *rc). */
int64_t cpu_ops_replay(const replay_call* calls, int64_t n, int* rc) {
  for (int64_t i = 0; i < n; i++) {
    const int r = replay_one(&calls[i]);
    if (r) {
      *rc = r;
      return i + 1;
    }
  }
  return 0;
}
