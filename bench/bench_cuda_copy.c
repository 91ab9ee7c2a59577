/* bench_cuda_copy.c — the cuda backend's copies on a real GPU, against the
 * CUDA runtime used directly in the same run, and the link figures the
 * simulator's hardware presets assume (sim_report.c; docs/hardware.md).
 *
 * Baseline: cudaMemcpyAsync on a stream of our own between the same device
 * buffer and a cudaHostAlloc'd (pinned) buffer, then an event synchronized:
 * what a trainer's own `tensor.to("cpu", non_blocking=True)` into pinned
 * memory does. The backend's side: copy_d2h/copy_h2d on an engine stream
 * into memory from its host_alloc (mmap + cudaHostRegister), then an event
 * recorded and synchronized, as the engine waits for a copy.
 *
 * Reported: each direction's GB/s and ratio at 1 MiB and 64 MiB, both
 * directions at once (the duplex figure), the per-copy fixed cost (latency
 * of a 4 KiB copy), and what pinning costs per GiB. Without a CUDA device
 * (CI) it says so and measures nothing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "bench.h"

#ifndef FERRY_HAVE_CUDA
void bench_cuda_copy(bench_report *r) {
  (void)r;
  printf("  (built without the CUDA toolkit: no cuda_* metrics)\n");
}
#else
#include <cuda_runtime_api.h>

#define CU(call)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (call);                                                        \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "bench_cuda_copy: %s: %s\n", #call, cudaGetErrorString(e_)); \
      goto out;                                                                     \
    }                                                                               \
  } while (0)
#define FB(call)                                                           \
  do {                                                                     \
    if ((call) != 0) {                                                     \
      fprintf(stderr, "bench_cuda_copy: %s: %s\n", #call, b->err);         \
      goto out;                                                            \
    }                                                                      \
  } while (0)

typedef struct rig {
  ferry_backend *b;
  bk_stream s, s2;     /* engine streams (the second for the duplex run) */
  bk_event *ev, *ev2;
  cudaStream_t raw;   /* the baseline's own stream and event */
  cudaEvent_t raw_ev;
  void *dev, *dev2;   /* device buffers */
  void *pin_b, *pin_b2; /* backend host_alloc */
  void *pin_raw;      /* cudaHostAlloc */
  size_t bytes;
} rig;

/* One timed copy of `bytes`: dir 0 = D2H, 1 = H2D; via the backend or raw. */
static double time_one(rig *g, int dir, int backend, size_t bytes) {
  ferry_backend *b = g->b;
  double t0 = bench_now_ns();
  if (backend) {
    if (dir) FB(b->ops->copy_h2d(b, g->dev, g->pin_b, bytes, g->s));
    else FB(b->ops->copy_d2h(b, g->pin_b, g->dev, bytes, g->s));
    FB(b->ops->event_record(b, g->ev, g->s));
    FB(b->ops->event_synchronize(b, g->ev));
  } else {
    CU(cudaMemcpyAsync(dir ? g->dev : g->pin_raw, dir ? g->pin_raw : g->dev, bytes,
                       dir ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, g->raw));
    CU(cudaEventRecord(g->raw_ev, g->raw));
    CU(cudaEventSynchronize(g->raw_ev));
  }
  return bench_now_ns() - t0;
out:
  return -1;
}

/* Alternating blocks of the two ways, medians; reports GB/s and the ratio. */
static void compare(bench_report *r, rig *g, int dir, size_t bytes, int reps, const char *tag) {
  double *tb = calloc((size_t)reps, sizeof *tb), *tr = calloc((size_t)reps, sizeof *tr);
  if (!tb || !tr) goto out;
  for (int i = -3; i < reps; i++) {
    double x = time_one(g, dir, i % 2 == 0, bytes), y = time_one(g, dir, i % 2 != 0, bytes);
    if (x < 0 || y < 0) goto out;
    if (i >= 0) {
      tb[i] = i % 2 == 0 ? x : y;
      tr[i] = i % 2 == 0 ? y : x;
    }
  }
  double gb_b = (double)bytes / bench_median(tb, reps), gb_r = (double)bytes / bench_median(tr, reps);
  const char *d = dir ? "h2d" : "d2h";
  char name[96], note[200];
  snprintf(name, sizeof name, "cuda_%s_vs_cudamemcpy_%s", d, tag);
  snprintf(note, sizeof note, "backend %.2f GB/s / cudaMemcpyAsync+cudaHostAlloc %.2f GB/s, median of %d",
           gb_b, gb_r, reps);
  bench_metric(r, name, gb_b / gb_r, "x", note);
  snprintf(name, sizeof name, "cuda_%s_GBps_%s", d, tag);
  bench_metric(r, name, gb_b, "GB/s", "cuda backend, copy + event synchronize");
  snprintf(name, sizeof name, "cudamemcpy_%s_GBps_%s", d, tag);
  bench_metric(r, name, gb_r, "GB/s", "cudaMemcpyAsync + event synchronize, pinned");
out:
  free(tb);
  free(tr);
}

/* Both directions at once on two engine streams: aggregate GB/s over the
 * sum of each direction alone (1 = full duplex, 0.5 = one direction at a
 * time). The simulator's presets carry this figure as their duplex factor. */
static void duplex(bench_report *r, rig *g, int reps) {
  ferry_backend *b = g->b;
  double *t = calloc((size_t)reps, sizeof *t);
  if (!t) return;
  for (int i = -2; i < reps; i++) {
    double t0 = bench_now_ns();
    FB(b->ops->copy_d2h(b, g->pin_b, g->dev, g->bytes, g->s));
    FB(b->ops->copy_h2d(b, g->dev2, g->pin_b2, g->bytes, g->s2));
    FB(b->ops->event_record(b, g->ev, g->s));
    FB(b->ops->event_record(b, g->ev2, g->s2));
    FB(b->ops->event_synchronize(b, g->ev));
    FB(b->ops->event_synchronize(b, g->ev2));
    if (i >= 0) t[i] = bench_now_ns() - t0;
  }
  {
    double both = 2.0 * (double)g->bytes / bench_median(t, reps);
    double d2h = (double)g->bytes / time_one(g, 0, 1, g->bytes);
    double h2d = (double)g->bytes / time_one(g, 1, 1, g->bytes);
    char note[200];
    snprintf(note, sizeof note, "64 MiB each way at once: %.2f GB/s together; alone %.2f D2H + %.2f H2D",
             both, d2h, h2d);
    bench_metric(r, "cuda_duplex_share", both / (d2h + h2d), "x", note);
  }
out:
  free(t);
}

void bench_cuda_copy(bench_report *r) {
  int count = 0;
  cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    printf("  (no CUDA device here: %s; the cuda_* metrics are measured on a GPU machine)\n",
           probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices");
    return;
  }
  rig g = {0};
  g.bytes = (size_t)64 << 20;
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = FERRY_BACKEND_CUDA;
  cfg.device = 0;
  char err[256];
  ferry_backend *b = NULL;
  if (ferry_backend_cuda_create(&cfg, &b, err, sizeof err) != 0) {
    fprintf(stderr, "bench_cuda_copy: %s\n", err);
    return;
  }
  g.b = b;
  FB(b->ops->stream_create(b, &g.s));
  FB(b->ops->stream_create(b, &g.s2));
  FB(b->ops->event_create(b, &g.ev));
  FB(b->ops->event_create(b, &g.ev2));
  CU(cudaStreamCreateWithFlags(&g.raw, cudaStreamNonBlocking));
  CU(cudaEventCreateWithFlags(&g.raw_ev, cudaEventDisableTiming));
  CU(cudaMalloc(&g.dev, g.bytes));
  CU(cudaMalloc(&g.dev2, g.bytes));
  {
    unsigned char *fill = malloc(g.bytes);
    if (!fill) goto out;
    memset(fill, 0x5a, g.bytes);
    cudaError_t e = cudaMemcpy(g.dev, fill, g.bytes, cudaMemcpyHostToDevice);
    free(fill);
    CU(e);
  }
  {
    /* What pinning costs: the backend's host_alloc of 1 GiB (mmap, touch,
     * cudaHostRegister) against cudaHostAlloc of the same size. */
    size_t gib = (size_t)1 << 30;
    void *p = NULL;
    double t0 = bench_now_ns();
    FB(b->ops->host_alloc(b, gib, 0, &p));
    double t_reg = bench_now_ns() - t0;
    FB(b->ops->host_free(b, p, gib));
    t0 = bench_now_ns();
    CU(cudaHostAlloc(&p, gib, cudaHostAllocDefault));
    double t_ha = bench_now_ns() - t0;
    CU(cudaFreeHost(p));
    char note[160];
    snprintf(note, sizeof note, "backend host_alloc (mmap+touch+cudaHostRegister); cudaHostAlloc: %.1f ms/GiB",
             t_ha / 1e6);
    bench_metric(r, "cuda_pin_ms_per_GiB", t_reg / 1e6, "ms", note);
    bench_metric(r, "cudahostalloc_ms_per_GiB", t_ha / 1e6, "ms", "cudaHostAlloc of 1 GiB");
  }
  FB(b->ops->host_alloc(b, g.bytes, 0, &g.pin_b));
  FB(b->ops->host_alloc(b, g.bytes, 0, &g.pin_b2));
  CU(cudaHostAlloc(&g.pin_raw, g.bytes, cudaHostAllocDefault));
  {
    /* What comes back is what went out: a pattern each way through the
     * backend, checked whole (a count of differing bytes, target 0). */
    memset(g.pin_b, 0, g.bytes);
    memset(g.pin_b2, 0x33, g.bytes);
    FB(b->ops->copy_d2h(b, g.pin_b, g.dev, g.bytes, g.s));
    FB(b->ops->copy_h2d(b, g.dev2, g.pin_b2, g.bytes, g.s2));
    FB(b->ops->event_record(b, g.ev, g.s));
    FB(b->ops->event_record(b, g.ev2, g.s2));
    FB(b->ops->event_synchronize(b, g.ev));
    FB(b->ops->event_synchronize(b, g.ev2));
    unsigned char *back = malloc(g.bytes);
    if (!back) goto out;
    CU(cudaMemcpy(back, g.dev2, g.bytes, cudaMemcpyDeviceToHost));
    double bad = 0;
    for (size_t i = 0; i < g.bytes; i++)
      bad += (((unsigned char *)g.pin_b)[i] != 0x5a) + (back[i] != 0x33);
    free(back);
    bench_metric(r, "cuda_copy_mismatches", bad, "B", "64 MiB each way through the backend, bytes differing");
  }
  compare(r, &g, 0, (size_t)64 << 20, 21, "64MB");
  compare(r, &g, 1, (size_t)64 << 20, 21, "64MB");
  compare(r, &g, 0, (size_t)1 << 20, 201, "1MB");
  compare(r, &g, 1, (size_t)1 << 20, 201, "1MB");
  {
    /* The fixed cost of one copy: a 4 KiB copy, enqueue to synchronized. */
    enum { REPS = 501 };
    double t[REPS];
    for (int i = -20; i < REPS; i++) {
      double x = time_one(&g, 0, 1, 4096);
      if (x < 0) goto out;
      if (i >= 0) t[i] = x;
    }
    bench_metric(r, "cuda_copy_latency_us", bench_median(t, REPS) / 1e3, "us",
                 "4 KiB D2H through the backend, enqueue to event synchronized, median");
  }
  duplex(r, &g, 11);
out:
  if (g.pin_raw) cudaFreeHost(g.pin_raw);
  if (g.pin_b) b->ops->host_free(b, g.pin_b, g.bytes);
  if (g.pin_b2) b->ops->host_free(b, g.pin_b2, g.bytes);
  if (g.dev) cudaFree(g.dev);
  if (g.dev2) cudaFree(g.dev2);
  if (g.raw_ev) cudaEventDestroy(g.raw_ev);
  if (g.raw) cudaStreamDestroy(g.raw);
  if (g.ev) b->ops->event_destroy(b, g.ev);
  if (g.ev2) b->ops->event_destroy(b, g.ev2);
  if (g.s) b->ops->stream_destroy(b, g.s);
  if (g.s2) b->ops->stream_destroy(b, g.s2);
  b->ops->destroy(b);
}
#endif
