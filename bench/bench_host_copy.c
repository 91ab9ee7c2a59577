/* bench_host_copy.c — throughput of the host backend's D2H copies against
 * plain memcpy of the same buffers in the same run; the target is >= 0.9 at
 * 1 MB and 64 MB.
 *
 * Each timed copy is enqueued, an event recorded after it and synchronized,
 * so the hand-off to the stream's worker thread is paid per copy; a run of 8
 * distinct 1 MB buffers back to back (what a layer's activations look like)
 * is reported beside it. On this project's 2-core VMs memory bandwidth swings
 * from run to run: compare ratios within one run only. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "bench.h"

/* Keep the compiler from dropping or moving a memcpy whose result it
 * cannot see being read. */
static void clobber(void *p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

#define MAX_BATCH 8

static void measure(bench_report *r, ferry_backend *b, bk_stream s, bk_event *ev,
                    size_t bytes, int batch, int reps, const char *name, const char *what) {
  const ferry_backend_ops *o = b->ops;
  void *dsts[MAX_BATCH] = {0}; /* pinned host side */
  void *srcs[MAX_BATCH] = {0}; /* the "device" side: ordinary memory on this backend */
  double *t_memcpy = NULL, *t_host = NULL;
  for (int k = 0; k < batch; k++) {
    if (o->host_alloc(b, bytes, 0, &dsts[k]) != 0 || o->host_alloc(b, bytes, 0, &srcs[k]) != 0) {
      fprintf(stderr, "bench_host_copy: host_alloc(%zu): %s\n", bytes, b->err);
      goto out;
    }
    /* Fault every page in before timing. */
    memset(srcs[k], 0x5a + k, bytes);
    memset(dsts[k], 0, bytes);
  }

  t_memcpy = malloc(sizeof(double) * (size_t)reps);
  t_host = malloc(sizeof(double) * (size_t)reps);
  if (!t_memcpy || !t_host) {
    fprintf(stderr, "bench_host_copy: out of memory\n");
    goto out;
  }
  /* Blocks of repetitions, alternating memcpy and the host backend, so that
   * each runs with the buffers warm in its own core's cache (as a steady
   * stream of copies would) and drift over the run hits both alike. */
  const int blocks = 4, warmup = 2;
  int done_host = 0, done_memcpy = 0;
  for (int blk = 0; blk < 2 * blocks; blk++) {
    bool host_turn = (blk % 2 == 1) == (blk / 2 % 2 == 0);
    int *done = host_turn ? &done_host : &done_memcpy;
    int upto = reps * (blk / 2 + 1) / blocks;
    for (int i = -warmup; *done < upto; i++) {
      double t0 = bench_now_ns();
      if (host_turn) {
        for (int k = 0; k < batch; k++)
          if (o->copy_d2h(b, dsts[k], srcs[k], bytes, s) != 0) {
            fprintf(stderr, "bench_host_copy: %s\n", b->err);
            goto out;
          }
        if (o->event_record(b, ev, s) != 0 || o->event_synchronize(b, ev) != 0) {
          fprintf(stderr, "bench_host_copy: %s\n", b->err);
          goto out;
        }
      } else {
        for (int k = 0; k < batch; k++) {
          memcpy(dsts[k], srcs[k], bytes);
          clobber(dsts[k]);
        }
      }
      double t = bench_now_ns() - t0;
      if (i >= 0) (host_turn ? t_host : t_memcpy)[(*done)++] = t;
    }
  }
  for (int k = 0; k < batch; k++)
    if (memcmp(dsts[k], srcs[k], bytes) != 0) {
      fprintf(stderr, "bench_host_copy: copied bytes differ\n");
      goto out;
    }
  {
    /* bytes per ns = GB/s */
    double total = (double)bytes * batch;
    double host_gbs = total / bench_median(t_host, reps);
    double memcpy_gbs = total / bench_median(t_memcpy, reps);
    char metric[96], note[200];
    snprintf(note, sizeof note, "%s; median of %d, memcpy %.1f GB/s, host backend %.1f GB/s",
             what, reps, memcpy_gbs, host_gbs);
    bench_metric(r, name, host_gbs / memcpy_gbs, "x", note);
    snprintf(metric, sizeof metric, "%s_GBps", name);
    bench_metric(r, metric, host_gbs, "GB/s", "host backend D2H, median");
  }
out:
  free(t_memcpy);
  free(t_host);
  for (int k = 0; k < batch; k++) {
    if (dsts[k]) o->host_free(b, dsts[k], bytes);
    if (srcs[k]) o->host_free(b, srcs[k], bytes);
  }
}

void bench_host_copy(bench_report *r) {
  ferry_config cfg = FERRY_CONFIG_INIT; /* link unthrottled */
  ferry_backend *b = NULL;
  char err[256];
  if (ferry_backend_host_create(&cfg, &b, err, sizeof err) != 0) {
    fprintf(stderr, "bench_host_copy: %s\n", err);
    return;
  }
  bk_stream s = NULL;
  bk_event *ev = NULL;
  if (b->ops->stream_create(b, &s) != 0 || b->ops->event_create(b, &ev) != 0) {
    fprintf(stderr, "bench_host_copy: %s\n", b->err);
    b->ops->destroy(b);
    return;
  }
  measure(r, b, s, ev, (size_t)1 << 20, 1, 301, "host_copy_vs_memcpy_1MB",
          "one 1 MB copy, enqueue+record+synchronize: the hand-off paid per copy");
  measure(r, b, s, ev, (size_t)64 << 20, 1, 21, "host_copy_vs_memcpy_64MB",
          "one 64 MB copy, enqueue+record+synchronize");
  measure(r, b, s, ev, (size_t)1 << 20, MAX_BATCH, 101, "host_copy_stream8_vs_memcpy_1MB",
          "8 distinct 1 MB buffers back to back, one event (16 MB working set)");
  b->ops->destroy(b);
}
