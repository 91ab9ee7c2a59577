/*
 *  bench_arena.c — memory efficiency and speed of the pinned arena.
 * How it works: docs/internals.md#bench_arenac.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ferry_tools.h"
#include "bench.h"

#define BENCH_TENSORS 300
#define BENCH_STEPS 8
#define BENCH_VARYING_STEPS 40

typedef struct bench_backend {
  ferry_backend base;
  uint64_t allocs;
} bench_backend;

static int bench_host_alloc(ferry_backend *b, size_t bytes, size_t alignment, void **out) {
  bench_backend *bb = (bench_backend *)b;
  size_t page = 4096, len = (bytes + page - 1) / page * page;
  size_t slack = alignment > page ? alignment : 0;
  uint8_t *base = mmap(NULL, len + slack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return FERRY_ENOMEM;
  uint8_t *p = base;
  if (slack) {
    p = (uint8_t *)(((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1));
    if (p > base) munmap(base, (size_t)(p - base));
    if (p + len < base + len + slack) munmap(p + len, (size_t)(base + len + slack - (p + len)));
  }
  __atomic_fetch_add(&bb->allocs, 1, __ATOMIC_RELAXED);
  *out = p;
  return 0;
}

static int bench_host_free(ferry_backend *b, void *p, size_t bytes) {
  munmap(p, (bytes + 4095) / 4096 * 4096);
  return 0;
}

static const ferry_backend_ops bench_backend_ops = {
    .name = "bench-counting",
    .host_alloc = bench_host_alloc,
    .host_free = bench_host_free,
};

static uint64_t bench_rng(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static void bench_sizes(size_t *sizes, int n, uint64_t seed) {
  const double lo = 4096.0, hi = 64.0 * 1024 * 1024;
  for (int i = 0; i < n; i++) {
    double u = (double)(bench_rng(&seed) >> 11) / 9007199254740992.0;
    sizes[i] = (size_t)(lo * pow(hi / lo, u));
  }
}

typedef struct kind_result {
  double reserved_over_peak;
  double backend_allocs_after_warmup;
  double ns_per_alloc_free;
  int ok;
} kind_result;

/* jitter: 0 = the same sizes every step; else each step adds up to 25%. */
static kind_result bench_kind(int kind, const size_t *base_sizes, int jitter) {
  kind_result res = {0};
  bench_backend bb = {.base = {.ops = &bench_backend_ops}};
  ferry_arena *a = NULL;
  char err[256] = "";
  if (ferry_arena_create(&bb.base, kind, 0, &a, err, sizeof err) != FERRY_OK) {
    fprintf(stderr, "bench_arena: %s\n", err);
    return res;
  }
  void *ptrs[BENCH_TENSORS];
  size_t sizes[BENCH_TENSORS];
  uint64_t allocs_after_first = 0, rng = 77;
  double ns = 0;
  int steps = jitter ? BENCH_VARYING_STEPS : BENCH_STEPS;
  for (int step = 0; step < steps; step++) {
    for (int i = 0; i < BENCH_TENSORS; i++)
      sizes[i] = base_sizes[i] + (jitter ? bench_rng(&rng) % (base_sizes[i] / 4 + 1) : 0);
    double t0 = bench_now_ns();
    for (int i = 0; i < BENCH_TENSORS; i++) {
      ptrs[i] = ferry_arena_alloc(a, sizes[i]);
      if (!ptrs[i]) {
        fprintf(stderr, "bench_arena: %s allocation of %zu bytes failed\n",
                ferry_arena_kind_name(a), sizes[i]);
        ferry_arena_destroy(a);
        return res;
      }
    }
    for (int i = BENCH_TENSORS - 1; i >= 0; i--) ferry_arena_free(a, ptrs[i], sizes[i]);
    double t1 = bench_now_ns();
    if (step == 0) {
      allocs_after_first = bb.allocs;
    } else {
      ns += t1 - t0;
    }
  }
  ferry_arena_stats st;
  ferry_arena_get_stats(a, &st);
  res.reserved_over_peak = (double)st.reserved / (double)st.peak;
  res.backend_allocs_after_warmup = (double)(bb.allocs - allocs_after_first);
  res.ns_per_alloc_free = ns / ((double)(steps - 1) * BENCH_TENSORS);
  res.ok = 1;
  ferry_arena_destroy(a);
  return res;
}

void bench_arena(bench_report *r) {
  size_t sizes[BENCH_TENSORS];
  bench_sizes(sizes, BENCH_TENSORS, 20240601);
  double total = 0, pow2_total = 0;
  for (int i = 0; i < BENCH_TENSORS; i++) {
    total += (double)sizes[i];
    pow2_total += exp2(ceil(log2((double)sizes[i])));
  }
  char note[160];
  snprintf(note, sizeof note,
           "%d tensors 4KiB-64MiB log-uniform, %.2f GiB per step; power-of-two "
           "rounding alone would give %.2f",
           BENCH_TENSORS, total / (1024.0 * 1024 * 1024), pow2_total / total);

  const char *varying_note = "same tensors, each size +0..25% at random every step, 40 steps";
  static const struct {
    int kind;
    const char *suffix, *label;
  } kinds[] = {{FERRY_ARENA_JEMALLOC, "", "jemalloc"}, {FERRY_ARENA_POOL, "_pool", "pool"}};
  for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
    char name[96], what[128];
    if (kinds[k].kind == FERRY_ARENA_JEMALLOC && !ferry_arena_jemalloc_available()) {
      bench_metric(r, "arena_reserved_over_peak", NAN, "ratio",
                   "jemalloc not loaded in this process");
      continue;
    }
    kind_result same = bench_kind(kinds[k].kind, sizes, 0);
    kind_result varying = bench_kind(kinds[k].kind, sizes, 1);
    if (same.ok) {
      snprintf(name, sizeof name, "arena_reserved_over_peak%s", kinds[k].suffix);
      bench_metric(r, name, same.reserved_over_peak, "ratio", note);
      snprintf(name, sizeof name, "arena_backend_allocs_after_warmup%s", kinds[k].suffix);
      snprintf(what, sizeof what, "%s kind, steps 2..%d of the same sizes", kinds[k].label,
               BENCH_STEPS);
      bench_metric(r, name, same.backend_allocs_after_warmup, "calls", what);
      snprintf(name, sizeof name, "arena_alloc_free_ns%s", kinds[k].suffix);
      snprintf(what, sizeof what, "%s kind, one alloc+free pair in steady state",
               kinds[k].label);
      bench_metric(r, name, same.ns_per_alloc_free, "ns", what);
    }
    if (varying.ok) {
      snprintf(name, sizeof name, "arena_reserved_over_peak_varying%s", kinds[k].suffix);
      bench_metric(r, name, varying.reserved_over_peak, "ratio", varying_note);
    }
  }
}
