/* bench_host_copy.c — throughput of the host backend's D2H copy (enqueue on
 * a stream, record an event, synchronize it) against a plain memcpy of the
 * same buffers in the same run. The ratio shows what the hand-off to the
 * stream's worker thread costs; the target is >= 0.9 at 1 MB and 64 MB. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench.h"

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Keep the compiler from dropping or moving a memcpy whose result it
 * cannot see being read. */
static void clobber(void *p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

static void measure(bench_report *r, ferry_backend *b, bk_stream s,
                    bk_event *ev, size_t bytes, int reps, const char *label) {
  const ferry_backend_ops *o = b->ops;
  void *dst = NULL; /* pinned host side */
  void *src = NULL; /* the "device" side: ordinary memory on this backend */
  if (o->host_alloc(b, bytes, 0, &dst) != 0 ||
      o->host_alloc(b, bytes, 0, &src) != 0) {
    fprintf(stderr, "bench_host_copy: host_alloc(%zu): %s\n", bytes, b->err);
    if (dst) o->host_free(b, dst, bytes);
    return;
  }
  /* Fault every page in before timing. */
  memset(src, 0x5a, bytes);
  memset(dst, 0, bytes);

  double *t_memcpy = malloc(sizeof(double) * (size_t)reps);
  double *t_host = malloc(sizeof(double) * (size_t)reps);
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
        if (o->copy_d2h(b, dst, src, bytes, s) != 0 ||
            o->event_record(b, ev, s) != 0 ||
            o->event_synchronize(b, ev) != 0) {
          fprintf(stderr, "bench_host_copy: %s\n", b->err);
          goto out;
        }
      } else {
        memcpy(dst, src, bytes);
        clobber(dst);
      }
      double t = bench_now_ns() - t0;
      if (i >= 0) (host_turn ? t_host : t_memcpy)[(*done)++] = t;
    }
  }
  if (memcmp(dst, src, bytes) != 0) {
    fprintf(stderr, "bench_host_copy: copied bytes differ\n");
    goto out;
  }
  /* bytes per ns = GB/s */
  double host_gbs = (double)bytes / median(t_host, reps);
  double memcpy_gbs = (double)bytes / median(t_memcpy, reps);
  char name[64], note[160];
  snprintf(name, sizeof name, "host_copy_vs_memcpy_%s", label);
  snprintf(note, sizeof note,
           "host backend D2H (enqueue+record+synchronize) / memcpy, "
           "median of %d, target >= 0.9", reps);
  bench_metric(r, name, host_gbs / memcpy_gbs, "x", note);
  snprintf(name, sizeof name, "host_copy_%s_GBps", label);
  bench_metric(r, name, host_gbs, "GB/s", "host backend D2H copy, median");
  snprintf(name, sizeof name, "memcpy_%s_GBps", label);
  bench_metric(r, name, memcpy_gbs, "GB/s", "plain memcpy, same buffers");
out:
  free(t_memcpy);
  free(t_host);
  o->host_free(b, dst, bytes);
  o->host_free(b, src, bytes);
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
  measure(r, b, s, ev, (size_t)1 << 20, 301, "1MB");
  measure(r, b, s, ev, (size_t)64 << 20, 21, "64MB");
  b->ops->destroy(b);
}
