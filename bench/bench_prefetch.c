/*
 * bench_prefetch.c — the stash's cost per tensor as a step grows: every
 * tensor offloaded and reloaded with prefetching a quarter of the step ahead
 * (what a layers policy asks for with 4 layers; at most 4096), at 1k and
 * 100k tensors.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench.h"
#include "ferry.h"

#define TENSOR_BYTES 256

static int alloc_cb(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  void *b = malloc(bytes);
  if (!b) return -1;
  *ptr = *owner = b;
  return 0;
}

static void release_cb(void *ud, void *owner) { free(owner); }

/* Offload everything; prefetch a quarter of the step's tensors ahead, at
 * most 4096 (the engine's bound on an answer). */
static int decide_prefetch(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                           ferry_decision *out) {
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_PREFETCH;
  long quarter = *(const long *)ud / 4;
  out->prefetch_distance = (int32_t)(quarter < 4096 ? quarter : 4096);
  out->cacheable = 1;
  return 0;
}

/* ns per tensor (pack + unpack) of the second of two steps of n tensors. */
static double per_tensor_ns(long n) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.device_alloc = alloc_cb;
  c.release = release_cb;
  c.decide = decide_prefetch;
  c.decide_ud = &n;
  c.min_offload_bytes = 1;
  c.max_fwd_stash = 0;
  ferry_engine *e = NULL;
  char err[256];
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "bench_prefetch: %s\n", err);
    return -1;
  }
  ferry_handle *h = malloc((size_t)n * sizeof *h);
  double ns = -1;
  for (int step = 0; step < 2 && h; step++) {
    double t0 = bench_now_ns();
    ferry_step_begin(e);
    for (long i = 0; i < n; i++) {
      void *buf = malloc(TENSOR_BYTES);
      ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
      d.bytes = TENSOR_BYTES;
      d.dtype = FERRY_DTYPE_U8;
      d.ndim = 1;
      d.shape[0] = TENSOR_BYTES;
      d.layer = (int32_t)(i * 4 / n);
      d.layer_count = 4;
      if (ferry_pack(e, &d, buf, buf, NULL, &h[i])) free(buf), h[i] = 0;
    }
    ferry_backward_begin(e);
    for (long i = n - 1; i >= 0; i--) {
      void *p, *o;
      if (h[i] && ferry_unpack(e, h[i], NULL, &p, &o) == FERRY_OK) free(o);
    }
    ferry_backward_end(e);
    ferry_step_end(e);
    ns = (bench_now_ns() - t0) / (double)n;
  }
  free(h);
  ferry_engine_destroy(e);
  return ns;
}

void bench_prefetch(bench_report *r) {
  double small = per_tensor_ns(1000), large = per_tensor_ns(100000);
  if (small <= 0 || large <= 0) return;
  bench_metric(r, "prefetch_per_tensor_ns_1k", small, "ns", "pack + unpack, prefetch n/4 ahead");
  bench_metric(r, "prefetch_per_tensor_ns_100k", large, "ns", "the same at 100k tensors a step");
  bench_metric(r, "prefetch_per_tensor_100k_vs_1k", large / small, "ratio",
               "per-tensor cost at 100k / at 1k; target <= 1.2");
}
