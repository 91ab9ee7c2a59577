/*
 * bench_stress.c — concurrency and load: engines on several threads of two
 * processes share one node-wide host cap (ferry_node_budget); the second
 * process is stopped mid-step and killed with SIGKILL. Reports tensors/s,
 * bytes, mismatches, how often the cap was seen exceeded, whether the dead
 * process's share came back, and RSS drift. FERRY_STRESS_STEPS sets the
 * steps per thread (`make soak` runs more).
 *
 * Every tensor is filled from a seeded generator at pack and checked byte
 * for byte at unpack; the policy offloads everything, so most tensors make
 * the device -> pinned -> device round trip, and those the cap refuses stay
 * on device (the engine keeps them).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench.h"
#include "ferry.h"

enum {
  PARENT_THREADS = 3,
  CHILD_THREADS = 2,
  TENSORS_PER_STEP = 24,
  CAP_BYTES = 12 << 20, /* below what 5 engines would hold uncapped */
};

/* Counters the child writes where the parent can read them after the kill. */
typedef struct shared_counts {
  atomic_long mismatches;
  atomic_long steps;
  atomic_int holding; /* the child has packed tensors in a step */
  /* The parent asks the child's workers to wait inside a step, between
   * ferry calls, before it stops the child: a worker stopped inside
   * ferry_pack could hold the node budget's lock, which a stopped (not
   * dead) process never gives back, and the parent's reading of the
   * shares would wait for it forever. */
  atomic_int stop_request;
  atomic_int parked;
} shared_counts;

typedef struct worker {
  ferry_node_budget *budget;
  int id;
  long steps; /* < 0: until killed */
  shared_counts *counts;
  atomic_long *progress;
  pthread_barrier_t *done; /* the parent samples RSS before engines go */
  long tensors, bytes, pack_errors;
  char err[256];
} worker;

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static void fill(unsigned char *p, size_t n, uint64_t seed) {
  uint64_t s = mix(seed | 1);
  for (size_t i = 0; i < n; i += 8) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    memcpy(p + i, &s, n - i < 8 ? n - i : 8);
  }
}

static int same(const unsigned char *p, size_t n, uint64_t seed) {
  unsigned char *want = malloc(n);
  if (!want) return 0;
  fill(want, n, seed);
  int ok = memcmp(p, want, n) == 0;
  free(want);
  return ok;
}

static int device_alloc(void *ud, uint64_t bytes, void *stream, void **ptr, void **owner) {
  (void)ud, (void)stream;
  void *b = malloc(bytes ? bytes : 1);
  if (!b) return -1;
  *ptr = *owner = b;
  return 0;
}
static void device_release(void *ud, void *owner) {
  (void)ud;
  free(owner);
}
static int decide_offload(void *ud, const ferry_tensor_desc *d, const ferry_context *c,
                          ferry_decision *out) {
  (void)ud, (void)d, (void)c;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_PREFETCH;
  out->prefetch_distance = 2;
  out->cacheable = 1;
  return 0;
}

/* Sizes from 4 KiB to 1 MiB, a few odd ones. */
static size_t tensor_bytes(uint64_t seed) {
  static const size_t sizes[] = {4096, 12288, 65536, 131072 + 8, 262144, 1 << 20, 520000};
  return sizes[mix(seed) % (sizeof sizes / sizeof sizes[0])];
}

static void *run_worker(void *arg) {
  worker *w = arg;
  ferry_config c = FERRY_CONFIG_INIT;
  c.device_alloc = device_alloc;
  c.release = device_release;
  c.decide = decide_offload;
  c.min_offload_bytes = 1;
  c.max_fwd_stash = 2;
  c.host_reserve = ferry_node_budget_reserve;
  c.host_reserve_ud = w->budget;
  ferry_engine *e = NULL;
  if (ferry_engine_create(&c, &e, w->err, sizeof w->err)) return NULL;
  ferry_handle hs[TENSORS_PER_STEP];
  uint64_t seeds[TENSORS_PER_STEP];
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  for (long step = 0; w->steps < 0 || step < w->steps; step++) {
    if (ferry_step_begin(e)) break;
    for (int i = 0; i < TENSORS_PER_STEP; i++) {
      seeds[i] = ((uint64_t)w->id << 48) ^ ((uint64_t)step << 16) ^ (uint64_t)i;
      d.bytes = tensor_bytes(seeds[i]);
      d.shape[0] = (int64_t)d.bytes;
      d.layer = i;
      unsigned char *p = malloc(d.bytes);
      fill(p, d.bytes, seeds[i]);
      if (ferry_pack(e, &d, p, p, NULL, &hs[i])) {
        free(p);
        hs[i] = 0;
        w->pack_errors++;
      }
    }
    if (w->counts) {
      atomic_store(&w->counts->holding, 1);
      if (atomic_load(&w->counts->stop_request)) { /* holding this step's tensors */
        atomic_fetch_add(&w->counts->parked, 1);
        for (;;) pause(); /* until SIGSTOP and SIGKILL */
      }
    }
    ferry_backward_begin(e);
    for (int i = TENSORS_PER_STEP - 1; i >= 0; i--) {
      void *ptr = NULL, *owner = NULL;
      if (!hs[i]) continue;
      size_t n = tensor_bytes(seeds[i]);
      if (ferry_unpack(e, hs[i], NULL, &ptr, &owner) || !same(ptr, n, seeds[i])) {
        if (w->counts) atomic_fetch_add(&w->counts->mismatches, 1);
      } else {
        w->tensors++;
        w->bytes += (long)n;
      }
      free(owner);
    }
    ferry_backward_end(e);
    ferry_step_end(e);
    if (w->counts) atomic_fetch_add(&w->counts->steps, 1);
    if (w->progress) atomic_fetch_add(w->progress, 1);
  }
  if (w->done) {
    pthread_barrier_wait(w->done); /* finished */
    pthread_barrier_wait(w->done); /* RSS taken */
  }
  ferry_engine_destroy(e);
  return NULL;
}

static double rss_mib(void) {
  long pages = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return -1;
  if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
  fclose(f);
  return resident < 0 ? -1 : (double)resident * (double)sysconf(_SC_PAGESIZE) / (1 << 20);
}

/* The child: CHILD_THREADS workers that run until the parent kills it. */
static void child_main(const char *name, shared_counts *counts) {
  ferry_node_budget *b = NULL;
  if (ferry_node_budget_open(name, CAP_BYTES, &b, NULL, 0)) _exit(2);
  worker ws[CHILD_THREADS];
  pthread_t ts[CHILD_THREADS];
  for (int i = 0; i < CHILD_THREADS; i++) {
    ws[i] = (worker){.budget = b, .id = 100 + i, .steps = -1, .counts = counts};
    pthread_create(&ts[i], NULL, run_worker, &ws[i]);
  }
  for (int i = 0; i < CHILD_THREADS; i++) pthread_join(ts[i], NULL);
  _exit(3); /* the workers never end on their own */
}

typedef struct monitor {
  ferry_node_budget *budget;
  atomic_int stop;
  long samples, over_cap;
  uint64_t peak_total;
} monitor;

static void *run_monitor(void *arg) {
  monitor *m = arg;
  while (!atomic_load(&m->stop)) {
    ferry_node_budget_stats st;
    if (ferry_node_budget_get_stats(m->budget, &st, NULL, NULL, 0) == 0) {
      m->samples++;
      if (st.total > st.cap) m->over_cap++;
      if (st.total > m->peak_total) m->peak_total = st.total;
    }
    usleep(500);
  }
  return NULL;
}

void bench_stress(bench_report *r) {
  const char *env = getenv("FERRY_STRESS_STEPS");
  long steps = env && atol(env) > 0 ? atol(env) : 200;
  char name[64];
  snprintf(name, sizeof name, "ferry-bench-stress-%d", (int)getpid());
  ferry_node_budget_unlink(name, NULL, 0);
  ferry_node_budget *b = NULL;
  char err[256];
  if (ferry_node_budget_open(name, CAP_BYTES, &b, err, sizeof err)) {
    fprintf(stderr, "bench_stress: %s\n", err);
    return;
  }
  shared_counts *counts = mmap(NULL, sizeof *counts, PROT_READ | PROT_WRITE,
                               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (counts == MAP_FAILED) return;
  memset(counts, 0, sizeof *counts);
  /* fork before this process starts threads */
  pid_t kid = fork();
  if (kid == 0) child_main(name, counts);
  if (kid < 0) return;

  monitor mon = {.budget = b};
  pthread_t mt;
  pthread_create(&mt, NULL, run_monitor, &mon);
  atomic_long progress = 0;
  worker ws[PARENT_THREADS];
  pthread_t ts[PARENT_THREADS];
  pthread_barrier_t done;
  pthread_barrier_init(&done, NULL, PARENT_THREADS + 1);
  double t0 = bench_now_ns();
  for (int i = 0; i < PARENT_THREADS; i++) {
    ws[i] = (worker){.budget = b, .id = i, .steps = steps, .progress = &progress, .done = &done};
    pthread_create(&ts[i], NULL, run_worker, &ws[i]);
  }
  /* a quarter of the way in, with the child inside a step: stop it, note
   * its share, kill it */
  long total_steps = steps * PARENT_THREADS;
  while (atomic_load(&progress) < total_steps / 4 || !atomic_load(&counts->holding)) usleep(1000);
  atomic_store(&counts->stop_request, 1);
  for (int ms = 0; ms < 10000 && atomic_load(&counts->parked) < CHILD_THREADS; ms++) usleep(1000);
  kill(kid, SIGSTOP);
  waitpid(kid, NULL, WUNTRACED);
  ferry_node_budget_stats before;
  int32_t pids[8];
  uint64_t held[8];
  uint64_t child_share = 0;
  ferry_node_budget_get_stats(b, &before, pids, held, 8);
  for (uint32_t i = 0; i < before.processes && i < 8; i++)
    if (pids[i] == kid) child_share = held[i];
  kill(kid, SIGKILL);
  waitpid(kid, NULL, 0);
  ferry_node_budget_stats after_kill;
  ferry_node_budget_get_stats(b, &after_kill, NULL, NULL, 0);
  /* RSS half way (the survivors have grown into the dead one's share by
   * then) and once every step is done, before the engines are destroyed */
  while (atomic_load(&progress) < total_steps / 2) usleep(1000);
  double rss_warm = rss_mib();
  pthread_barrier_wait(&done);
  double secs = (bench_now_ns() - t0) / 1e9;
  double rss_end = rss_mib();
  pthread_barrier_wait(&done);
  for (int i = 0; i < PARENT_THREADS; i++) pthread_join(ts[i], NULL);
  pthread_barrier_destroy(&done);
  atomic_store(&mon.stop, 1);
  pthread_join(mt, NULL);
  ferry_node_budget_stats end;
  ferry_node_budget_get_stats(b, &end, NULL, NULL, 0);

  long tensors = 0, bytes = 0, errors = 0;
  for (int i = 0; i < PARENT_THREADS; i++) {
    if (ws[i].err[0]) fprintf(stderr, "bench_stress: worker %d: %s\n", i, ws[i].err);
    tensors += ws[i].tensors, bytes += ws[i].bytes, errors += ws[i].pack_errors;
  }
  /* the parent's own mismatches: every packed tensor must have come back */
  long mismatches = (long)PARENT_THREADS * steps * TENSORS_PER_STEP - tensors - errors;
  mismatches += atomic_load(&counts->mismatches); /* the child's, before the kill */
  char note[160];
  snprintf(note, sizeof note, "%d+%d threads, 2 processes, %ld steps each, cap %d MiB",
           PARENT_THREADS, CHILD_THREADS, steps, CAP_BYTES >> 20);
  bench_metric(r, "stress_tensors_per_s", (double)tensors / secs, "1/s", note);
  bench_metric(r, "stress_gb_per_s", (double)bytes / secs / 1e9, "GB/s",
               "bytes packed and checked at unpack, survivor process");
  bench_metric(r, "stress_mismatches", (double)mismatches, "count",
               "tensors that did not come back bit-identical, both processes");
  bench_metric(r, "stress_pack_errors", (double)errors, "count", "ferry_pack failures");
  bench_metric(r, "stress_cap_exceeded_samples", (double)mon.over_cap, "count", NULL);
  bench_metric(r, "stress_peak_over_cap", (double)mon.peak_total / CAP_BYTES, "ratio",
               "highest node total seen by the monitor / cap");
  bench_metric(r, "stress_cap_refusals", (double)end.refusals, "count",
               "reservations the cap refused (the cap was reached)");
  bench_metric(r, "stress_killed_share_bytes", (double)child_share, "B",
               "held by the child when it was killed");
  bench_metric(r, "stress_reclaimed_vs_killed_share",
               child_share ? (double)(after_kill.reclaimed - before.reclaimed) / child_share : -1,
               "ratio", "taken back after SIGKILL / the dead process's share");
  bench_metric(r, "stress_node_total_after_close", (double)end.total, "B",
               "node total once every survivor engine is destroyed");
  bench_metric(r, "stress_rss_drift_mib", rss_end - rss_warm, "MiB",
               "survivor RSS after every step - half way");
  printf("  (stress: %ld monitor samples, child ran %ld steps before SIGKILL)\n", mon.samples,
         atomic_load(&counts->steps));
  munmap(counts, sizeof *counts);
  ferry_node_budget_close(b);
  ferry_node_budget_unlink(name, NULL, 0);
}
