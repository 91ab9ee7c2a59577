/* bench_host_copy.c — throughput of the host backend's D2H copies against
 * two baselines of the same buffers in the same run: memcpy on the calling
 * thread (the targets, >= 0.9 at 1 MB and 64 MB) and memcpy handed to a
 * worker thread of our own (reported).
 *
 * Each timed copy is enqueued, an event recorded after it and synchronized,
 * so the hand-off to the stream's worker thread is paid per copy; a run of 8
 * distinct 1 MB buffers back to back (what a layer's activations look like)
 * is reported beside it. On this project's 2-core VMs memory bandwidth swings
 * from run to run: compare ratios within one run only. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ferry_tools.h"
#include "bench.h"

/* Keep the compiler from dropping or moving a memcpy whose result it
 * cannot see being read. */
static void clobber(void *p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

#define MAX_BATCH 8

/* ---- the worker-thread baseline ------------------------------------------
 * The least a copy on another thread can cost: a job slot and a counter,
 * the waiter polling for completion. The worker waits for work as the host
 * backend's copy worker does (poll about 50 us, yielding between checks,
 * then sleep on a condition variable), so it is idle, not spinning, while
 * the backend's turn runs. The ratio to it leaves out what any copy thread
 * pays and keeps what the backend adds: ring slots, events, stream lookup.
 * (It can pass 1: the backend's caller may run the copy itself.) */
typedef struct {
  void *dst;
  const void *src;
  size_t n;
} copy_job;

typedef struct {
  pthread_t thread;
  copy_job jobs[MAX_BATCH]; /* slot seq % MAX_BATCH; at most MAX_BATCH in flight */
  _Atomic uint64_t requested, completed;
  _Atomic bool sleeping;
  bool stop; /* under lock */
  pthread_mutex_t lock;
  pthread_cond_t work_cv;
} copy_worker;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Poll until *v >= want for at most budget_ns (0: no limit), yielding
 * between rounds of checks so that, on 2 cores, the thread waited for is
 * not held up. */
static bool poll_until(_Atomic uint64_t *v, uint64_t want, double budget_ns) {
  double deadline = bench_now_ns() + budget_ns;
  for (;;) {
    for (int k = 0; k < 16; k++) {
      if (atomic_load_explicit(v, memory_order_acquire) >= want) return true;
      cpu_relax();
    }
    if (budget_ns > 0 && bench_now_ns() >= deadline) return false;
    sched_yield();
  }
}

static void *copy_worker_main(void *arg) {
  copy_worker *w = arg;
  uint64_t done = 0;
  for (;;) {
    if (!poll_until(&w->requested, done + 1, 50e3)) {
      pthread_mutex_lock(&w->lock);
      /* `sleeping` is raised before `requested` is read again and the
       * producer stores `requested` before reading `sleeping` (both
       * sequentially consistent): one of the two sees the other. */
      atomic_store(&w->sleeping, true);
      while (atomic_load(&w->requested) == done && !w->stop)
        pthread_cond_wait(&w->work_cv, &w->lock);
      atomic_store(&w->sleeping, false);
      bool stop = w->stop && atomic_load(&w->requested) == done;
      pthread_mutex_unlock(&w->lock);
      if (stop) return NULL;
      continue;
    }
    copy_job j = w->jobs[done % MAX_BATCH];
    memcpy(j.dst, j.src, j.n);
    atomic_store_explicit(&w->completed, ++done, memory_order_release);
  }
}

static void copy_worker_wake(copy_worker *w) {
  if (!atomic_load(&w->sleeping)) return;
  pthread_mutex_lock(&w->lock);
  pthread_cond_signal(&w->work_cv);
  pthread_mutex_unlock(&w->lock);
}

static int copy_worker_start(copy_worker *w) {
  memset(w, 0, sizeof *w);
  pthread_mutex_init(&w->lock, NULL);
  pthread_cond_init(&w->work_cv, NULL);
  return pthread_create(&w->thread, NULL, copy_worker_main, w);
}

static void copy_worker_stop(copy_worker *w) {
  pthread_mutex_lock(&w->lock);
  w->stop = true;
  pthread_cond_signal(&w->work_cv);
  pthread_mutex_unlock(&w->lock);
  pthread_join(w->thread, NULL);
  pthread_cond_destroy(&w->work_cv);
  pthread_mutex_destroy(&w->lock);
}

/* Hand the worker `batch` copies and wait until all are done. */
static void copy_on_worker(copy_worker *w, void **dsts, void **srcs, size_t bytes, int batch) {
  uint64_t seq = atomic_load(&w->requested);
  for (int k = 0; k < batch; k++) {
    w->jobs[(seq + (uint64_t)k) % MAX_BATCH] = (copy_job){dsts[k], srcs[k], bytes};
    atomic_store(&w->requested, seq + (uint64_t)k + 1);
    copy_worker_wake(w);
  }
  poll_until(&w->completed, seq + (uint64_t)batch, 0);
}

/* ---- one measurement ---------------------------------------------------- */

/* With w NULL the baseline is memcpy on this thread, else a copy on w. */
static void measure(bench_report *r, ferry_backend *b, bk_stream s, bk_event *ev,
                    copy_worker *w, size_t bytes, int batch, int reps, const char *name,
                    const char *what) {
  const ferry_backend_ops *o = b->ops;
  void *dsts[MAX_BATCH] = {0}; /* pinned host side */
  void *srcs[MAX_BATCH] = {0}; /* the "device" side: ordinary memory on this backend */
  double *t_memcpy = NULL, *t_host = NULL; /* t_memcpy: the baseline */
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
      } else if (w) {
        copy_on_worker(w, dsts, srcs, bytes, batch);
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
    snprintf(note, sizeof note, "%s; median of %d, %s %.1f GB/s, host backend %.1f GB/s",
             what, reps, w ? "worker-thread memcpy" : "memcpy", memcpy_gbs, host_gbs);
    bench_metric(r, name, host_gbs / memcpy_gbs, "x", note);
    snprintf(metric, sizeof metric, "%s_GBps", name);
    bench_metric(r, metric, host_gbs, "GB/s", "host backend D2H, median");
    snprintf(metric, sizeof metric, "%s_baseline_GBps", name);
    bench_metric(r, metric, memcpy_gbs, "GB/s",
                 w ? "memcpy on a worker thread, median" : "memcpy on the calling thread, median");
  }
out:
  free(t_memcpy);
  free(t_host);
  for (int k = 0; k < batch; k++) {
    if (dsts[k]) o->host_free(b, dsts[k], bytes);
    if (srcs[k]) o->host_free(b, srcs[k], bytes);
  }
}

/* Which thread ran the copies: a pass of its own, since the listener that
 * tells costs two clock reads per copy. */
typedef struct {
  pthread_t caller;
  atomic_int on_caller, total;
} who_ran;

static void note_who_ran(void *ud, int dir, double t0, double t1, uint64_t bytes,
                         const void *dev, const void *host) {
  (void)dir, (void)t0, (void)t1, (void)bytes, (void)dev, (void)host;
  who_ran *w = ud;
  if (pthread_equal(pthread_self(), w->caller)) atomic_fetch_add(&w->on_caller, 1);
  atomic_fetch_add(&w->total, 1);
}

static void caller_share(bench_report *r, ferry_backend *b, bk_stream s, bk_event *ev,
                         size_t bytes, int reps) {
  const ferry_backend_ops *o = b->ops;
  void *dst = NULL, *src = NULL;
  who_ran w = {.caller = pthread_self()};
  if (o->host_alloc(b, bytes, 0, &dst) != 0 || o->host_alloc(b, bytes, 0, &src) != 0 ||
      o->set_copy_listener(b, note_who_ran, &w) != 0) {
    fprintf(stderr, "bench_host_copy: %s\n", b->err);
    goto out;
  }
  memset(src, 0x3c, bytes);
  for (int i = 0; i < reps; i++)
    if (o->copy_d2h(b, dst, src, bytes, s) != 0 || o->event_record(b, ev, s) != 0 ||
        o->event_synchronize(b, ev) != 0) {
      fprintf(stderr, "bench_host_copy: %s\n", b->err);
      goto out;
    }
  o->set_copy_listener(b, NULL, NULL);
  bench_metric(r, "host_copy_1MB_run_by_caller_share",
               (double)atomic_load(&w.on_caller) / atomic_load(&w.total), "",
               "share of the 1 MB copies (enqueue+record+synchronize) that the synchronizing "
               "thread ran itself, the worker not having started them");
out:
  o->set_copy_listener(b, NULL, NULL);
  if (dst) o->host_free(b, dst, bytes);
  if (src) o->host_free(b, src, bytes);
}

/* The stream's worker on the caller's core, which the scheduler picks at
 * times on its own (bench/README.md, "Copy benchmarks"): the process held
 * on one CPU while a stream is created (its worker inherits the mask) and
 * measured. */
static void one_cpu(bench_report *r, ferry_backend *b, bk_event *ev) {
  cpu_set_t old, one;
  bk_stream s = NULL;
  if (sched_getaffinity(0, sizeof old, &old) != 0) return;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) return;
  if (b->ops->stream_create(b, &s) == 0) {
    measure(r, b, s, ev, NULL, (size_t)1 << 20, 1, 301, "host_copy_vs_memcpy_1MB_one_cpu",
            "one 1 MB copy, enqueue+record+synchronize, the process on one CPU");
    b->ops->stream_destroy(b, s);
  }
  sched_setaffinity(0, sizeof old, &old);
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
  measure(r, b, s, ev, NULL, (size_t)1 << 20, 1, 301, "host_copy_vs_memcpy_1MB",
          "one 1 MB copy, enqueue+record+synchronize: the hand-off paid per copy");
  measure(r, b, s, ev, NULL, (size_t)64 << 20, 1, 21, "host_copy_vs_memcpy_64MB",
          "one 64 MB copy, enqueue+record+synchronize");
  measure(r, b, s, ev, NULL, (size_t)1 << 20, MAX_BATCH, 101, "host_copy_stream8_vs_memcpy_1MB",
          "8 distinct 1 MB buffers back to back, one event (16 MB working set)");
  caller_share(r, b, s, ev, (size_t)1 << 20, 301);
  /* The worker-thread baseline in passes of its own: its thread exists
   * only here, so it cannot disturb the same-thread figures above. */
  copy_worker w;
  if (copy_worker_start(&w) != 0) {
    fprintf(stderr, "bench_host_copy: cannot start the baseline's worker thread\n");
  } else {
    measure(r, b, s, ev, &w, (size_t)1 << 20, 1, 301, "host_copy_vs_worker_memcpy_1MB",
            "one 1 MB copy each, handed to a thread and waited for");
    measure(r, b, s, ev, &w, (size_t)64 << 20, 1, 21, "host_copy_vs_worker_memcpy_64MB",
            "one 64 MB copy each, handed to a thread and waited for");
    measure(r, b, s, ev, &w, (size_t)1 << 20, MAX_BATCH, 101,
            "host_copy_stream8_vs_worker_memcpy_1MB",
            "8 distinct 1 MB buffers back to back, handed to a thread, one wait");
    copy_worker_stop(&w);
  }
  one_cpu(r, b, ev);
  b->ops->destroy(b);
}
