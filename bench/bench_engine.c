/*
 * bench_engine.c — engine bookkeeping per tensor and pinned allocations per
 * step, on the host backend.
 * How it works: docs/internals.md#bench_enginec.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <valgrind/callgrind.h>

#include "bench.h"
#include "ferry.h"

typedef struct owner_buf {
  unsigned char bytes[256];
} owner_buf;

static atomic_long live;
static int alloc_cb(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  owner_buf *b = malloc(sizeof *b > bytes ? sizeof *b : bytes);
  if (!b) return -1;
  atomic_fetch_add(&live, 1);
  *ptr = b;
  *owner = b;
  return 0;
}
static void release_cb(void *ud, void *owner) {
  atomic_fetch_sub(&live, 1);
  free(owner);
}
static int decide_keep(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                       ferry_decision *out) {
  out->action = FERRY_KEEP;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 1;
  return 0;
}
static int decide_offload(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                          ferry_decision *out) {
  decide_keep(ud, d, c, out);
  out->action = FERRY_OFFLOAD;
  return 0;
}

static ferry_engine *open_engine(ferry_decide_fn fn, uint32_t stash) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.device_alloc = alloc_cb;
  c.release = release_cb;
  c.decide = fn;
  c.min_offload_bytes = 1;
  c.max_fwd_stash = stash;
  ferry_engine *e = NULL;
  char err[256];
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "bench_engine: %s\n", err);
    exit(1);
  }
  return e;
}

static ferry_tensor_desc small_desc(void) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 256;
  d.dtype = FERRY_DTYPE_F32;
  d.ndim = 1;
  d.shape[0] = 64;
  d.layer = 3;
  d.module_path = "model.layers.3.mlp.up_proj";
  return d;
}

/* Pack a batch of `batch` tensors then unpack them in reverse, `iters`
 * pairs in all. Returns ns per pair. */
static double run_pairs(ferry_engine *e, long iters, int batch, int instrument) {
  owner_buf *bufs = calloc((size_t)batch, sizeof *bufs);
  ferry_handle *hs = calloc((size_t)batch, sizeof *hs);
  ferry_tensor_desc d = small_desc();
  double t0 = bench_now_ns();
  long done = 0;
  if (instrument) CALLGRIND_TOGGLE_COLLECT;
  while (done < iters) {
    for (int i = 0; i < batch; i++) {
      owner_buf *b = malloc(sizeof *b);
      atomic_fetch_add(&live, 1);
      memcpy(b, &bufs[i], sizeof *b);
      if (ferry_pack(e, &d, b, b, NULL, &hs[i])) abort();
    }
    for (int i = batch - 1; i >= 0; i--) {
      void *p, *o;
      if (ferry_unpack(e, hs[i], NULL, &p, &o)) abort();
      release_cb(NULL, o);
    }
    done += batch;
  }
  if (instrument) CALLGRIND_TOGGLE_COLLECT;
  double ns = (bench_now_ns() - t0) / (double)done;
  free(bufs);
  free(hs);
  return ns;
}

static double run_malloc_baseline(long iters, int batch) {
  void **ps = calloc((size_t)batch, sizeof *ps);
  double t0 = bench_now_ns();
  long done = 0;
  while (done < iters) {
    for (int i = 0; i < batch; i++) ps[i] = malloc(256);
    for (int i = batch - 1; i >= 0; i--) free(ps[i]);
    done += batch;
  }
  double ns = (bench_now_ns() - t0) / (double)done;
  free(ps);
  return ns;
}

int bench_engine_instr(const char *which, long iters) {
  int offload = !strcmp(which, "offload");
  ferry_engine *e = open_engine(offload ? decide_offload : decide_keep, 4);
  run_pairs(e, 1000, 64, 0); /* warm up */
  run_pairs(e, iters, 64, 1);
  ferry_engine_destroy(e);
  return 0;
}

void bench_engine(bench_report *r) {
  enum { REPS = 9, BATCH = 64 };
  const long iters = 200000;
  double keep[REPS], offl[REPS], base[REPS];
  ferry_engine *ek = open_engine(decide_keep, 4);
  ferry_engine *eo = open_engine(decide_offload, 4);
  run_pairs(ek, 20000, BATCH, 0);
  run_pairs(eo, 20000, BATCH, 0);
  for (int i = 0; i < REPS; i++) {
    keep[i] = run_pairs(ek, iters, BATCH, 0);
    offl[i] = run_pairs(eo, iters / 10, BATCH, 0);
    base[i] = run_malloc_baseline(iters, BATCH);
  }
  double k = bench_median(keep, REPS), off = bench_median(offl, REPS), b = bench_median(base, REPS);
  char note[128];
  snprintf(note, sizeof note, "median of %d; %.1fx a malloc+free pair (%.1f ns)", REPS, k / b, b);
  bench_metric(r, "pack_unpack_keep_ns", k, "ns", note);
  snprintf(note, sizeof note, "median of %d; 256 B tensors, stash of 4", REPS);
  bench_metric(r, "pack_unpack_offload_ns", off, "ns", note);
  bench_metric(r, "malloc_free_pair_ns", b, "ns", "baseline, same run");
  ferry_engine_destroy(ek);
  ferry_engine_destroy(eo);

  /* Pinned allocations after warm-up: a training-like step, fixed sizes. */
  ferry_engine *e = open_engine(decide_offload, 2);
  static const uint64_t sizes[] = {1 << 20, 3 << 20, 512 << 10, 2 << 20, 1 << 20, 4 << 20,
                                   256 << 10, 3 << 20};
  enum { NS = sizeof sizes / sizeof sizes[0], STEPS = 50 };
  ferry_tensor_desc d = small_desc();
  uint64_t after_warmup = 0;
  for (int step = 0; step < STEPS; step++) {
    ferry_handle hs[NS];
    ferry_step_begin(e);
    for (int i = 0; i < NS; i++) {
      void *p = NULL, *o = NULL;
      if (alloc_cb(NULL, sizes[i], NULL, &p, &o)) abort();
      d.bytes = sizes[i];
      if (ferry_pack(e, &d, p, o, NULL, &hs[i])) abort();
    }
    for (int i = NS - 1; i >= 0; i--) {
      void *p, *o;
      if (ferry_unpack(e, hs[i], NULL, &p, &o)) abort();
      release_cb(NULL, o);
    }
    ferry_step_end(e);
    ferry_stats s;
    ferry_get_stats(e, &s, sizeof s);
    if (step == 0) after_warmup = s.backend_pinned_allocs;
    if (step == STEPS - 1) {
      double per_step = (double)(s.backend_pinned_allocs - after_warmup) / (STEPS - 1);
      snprintf(note, sizeof note, "%s arena, %llu allocations in step 1", ferry_arena_name(e),
               (unsigned long long)after_warmup);
      bench_metric(r, "pinned_allocs_per_step_after_warmup", per_step, "allocs", note);
    }
  }
  ferry_engine_destroy(e);
}
