/*
 *  bench_snapshot.c — checkpoint staging on the host backend, in one run:
 * How it works: docs/internals.md#bench_snapshotc.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "ferry.h"

#define N_TENSORS 16
#define TENSOR_BYTES ((size_t)16 << 20)
#define STATE_BYTES (N_TENSORS * TENSOR_BYTES)
#define ACT_BYTES ((size_t)64 << 20)
#define ROUNDS 3

static int no_device_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  (void)ud, (void)bytes, (void)stream, (void)dev, (void)owner;
  return -1; /* a snapshot never allocates device memory */
}
static void no_release(void *ud, void *owner) { (void)ud, (void)owner; }

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void clobber(void *p) { __asm__ __volatile__("" : : "r"(p) : "memory"); }

/* Forward + backward stand-in: arithmetic over the activation memory. */
static void compute_step(uint64_t *act, size_t words, int passes) {
  for (int pass = 0; pass < passes; pass++)
    for (size_t i = 0; i < words; i++) act[i] = act[i] * 6364136223846793005ull + 1442695040888963407ull;
  clobber(act);
}

/* The optimizer step: every word of the state changes in place. */
static void optimizer_step(uint64_t **state, uint64_t step) {
  for (int t = 0; t < N_TENSORS; t++) {
    uint64_t *p = state[t];
    for (size_t i = 0; i < TENSOR_BYTES / 8; i++) p[i] += step;
    clobber(p);
  }
}

static void sync_copy(uint64_t **state, unsigned char *dst) {
  for (int t = 0; t < N_TENSORS; t++) memcpy(dst + (size_t)t * TENSOR_BYTES, state[t], TENSOR_BYTES);
  clobber(dst);
}

/* write() + fsync of the state to a file: what the disk does without ferry.
 * Milliseconds, or -1 on failure. */
static double raw_write_ms(const char *path, uint64_t **state) {
  double t0 = bench_now_ns();
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int ok = fd >= 0;
  for (int t = 0; t < N_TENSORS && ok; t++) {
    const char *p = (const char *)state[t];
    size_t left = TENSOR_BYTES;
    while (left && ok) {
      ssize_t w = write(fd, p, left);
      ok = w > 0;
      if (ok) p += w, left -= (size_t)w;
    }
  }
  ok = ok && fsync(fd) == 0;
  if (fd >= 0) close(fd);
  if (!ok) fprintf(stderr, "bench_snapshot: writing %s failed\n", path);
  return ok ? (bench_now_ns() - t0) / 1e6 : -1;
}

static int snapshot(ferry_engine *e, const char *path, ferry_snapshot_record *rec,
                    ferry_snapshot **out) {
  int rc = ferry_snapshot_start(e, path, rec, N_TENSORS + 1, NULL, out);
  if (rc) fprintf(stderr, "bench_snapshot: start: %s\n", ferry_last_error(e));
  return rc;
}

static int finish(ferry_snapshot *s) {
  int rc = ferry_snapshot_wait(s);
  if (rc) fprintf(stderr, "bench_snapshot: %s\n", ferry_snapshot_error(s));
  ferry_snapshot_free(s);
  return rc;
}

void bench_snapshot(bench_report *r) {
  char path[] = "/tmp/ferry-bench-snapshot.pt";
  char raw_path[] = "/tmp/ferry-bench-snapshot.raw";
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = FERRY_BACKEND_HOST;
  c.device_alloc = no_device_alloc;
  c.release = no_release;
  ferry_engine *e = NULL;
  char err[512];
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "bench_snapshot: %s\n", err);
    return;
  }
  uint64_t *state[N_TENSORS] = {0};
  uint64_t *act = malloc(ACT_BYTES);
  unsigned char *sync_dst = malloc(STATE_BYTES);
  char names[N_TENSORS][32];
  static const char pickle_stand_in[] = "a pickle record would go here";
  ferry_snapshot_record rec[N_TENSORS + 1];
  int ok = act && sync_dst;
  for (int t = 0; t < N_TENSORS && ok; t++) {
    ok = (state[t] = malloc(TENSOR_BYTES)) != NULL;
    if (!ok) break;
    memset(state[t], t + 1, TENSOR_BYTES);
    snprintf(names[t], sizeof names[t], "archive/data/%d", t);
    rec[t + 1] = (ferry_snapshot_record){.name = names[t], .device_ptr = state[t],
                                         .bytes = TENSOR_BYTES};
  }
  if (!ok) {
    fprintf(stderr, "bench_snapshot: out of memory\n");
    goto out;
  }
  rec[0] = (ferry_snapshot_record){.name = "archive/data.pkl", .host_data = pickle_stand_in,
                                   .bytes = sizeof pickle_stand_in};
  memset(act, 1, ACT_BYTES);
  memset(sync_dst, 0, STATE_BYTES);

  /* Warm-up: the arena's pinned memory is faulted in once, as in training. */
  ferry_snapshot *s = NULL;
  if (snapshot(e, path, rec, &s) || ferry_snapshot_fence(s, NULL) || finish(s)) goto out;

  /* Throughput: staging, memcpy, archive write, raw write. */
  double stage_ms[ROUNDS], memcpy_ms[ROUNDS], write_ms[ROUNDS], raw_ms[ROUNDS];
  for (int round = 0; round < ROUNDS; round++) {
    double t0 = bench_now_ns();
    if (snapshot(e, path, rec, &s) || ferry_snapshot_fence(s, NULL)) goto out;
    double t1 = bench_now_ns();
    if (finish(s)) goto out;
    double t2 = bench_now_ns();
    stage_ms[round] = (t1 - t0) / 1e6;
    write_ms[round] = (t2 - t0) / 1e6;
    t0 = bench_now_ns();
    sync_copy(state, sync_dst);
    memcpy_ms[round] = (bench_now_ns() - t0) / 1e6;
    if ((raw_ms[round] = raw_write_ms(raw_path, state)) < 0) goto out;
  }
  double gb = (double)STATE_BYTES / 1e9;
  double staging_ms = median(stage_ms, ROUNDS);
  double stage_gbps = gb / (staging_ms / 1e3);
  double memcpy_gbps = gb / (median(memcpy_ms, ROUNDS) / 1e3);
  double write_gbps = gb / (median(write_ms, ROUNDS) / 1e3);
  double disk_gbps = gb / (median(raw_ms, ROUNDS) / 1e3);
  bench_metric(r, "engine_snapshot_state_MiB", (double)STATE_BYTES / (1 << 20), "MiB",
               "16 tensors, host backend");
  bench_metric(r, "engine_snapshot_staging_GBps", stage_gbps, "GB/s", "start to last copy done");
  bench_metric(r, "engine_snapshot_memcpy_GBps", memcpy_gbps, "GB/s", "same bytes, one thread");
  bench_metric(r, "engine_snapshot_staging_vs_memcpy", stage_gbps / memcpy_gbps, "ratio", NULL);
  bench_metric(r, "engine_snapshot_write_GBps", write_gbps, "GB/s", "start to durable file in /tmp");
  bench_metric(r, "engine_snapshot_disk_write_GBps", disk_gbps, "GB/s", "write()+fsync, same bytes");
  bench_metric(r, "engine_snapshot_write_vs_disk", write_gbps / disk_gbps, "ratio", NULL);

  /* The step's compute, in passes over the activations, from the staging
   * time: one pass timed here. */
  double t0 = bench_now_ns();
  compute_step(act, ACT_BYTES / 8, 1);
  double pass_ms = (bench_now_ns() - t0) / 1e6;
  static const struct {
    double times_staging;
    const char *suffix;
  } scenarios[] = {{1.5, ""}, {0.33, "_short_step"}};
  uint64_t step = 0;
  for (size_t k = 0; k < sizeof scenarios / sizeof scenarios[0]; k++) {
    int passes = (int)(scenarios[k].times_staging * staging_ms / pass_ms + 0.5);
    if (passes < 1) passes = 1;
    double blocked[ROUNDS], t_start[ROUNDS], t_fence[ROUNDS], sync_ms[ROUNDS], compute_ms[ROUNDS];
    for (int round = 0; round < ROUNDS; round++) {
      /* A plain step, timed: the compute that the snapshot overlaps with. */
      t0 = bench_now_ns();
      compute_step(act, ACT_BYTES / 8, passes);
      compute_ms[round] = (bench_now_ns() - t0) / 1e6;
      optimizer_step(state, ++step);

      /* Checkpoint the synchronous way. */
      t0 = bench_now_ns();
      sync_copy(state, sync_dst);
      sync_ms[round] = (bench_now_ns() - t0) / 1e6;

      /* Checkpoint with ferry: start after the optimizer step... */
      t0 = bench_now_ns();
      if (snapshot(e, path, rec, &s)) goto out;
      double t1 = bench_now_ns();
      compute_step(act, ACT_BYTES / 8, passes); /* ...the next step runs... */
      double t2 = bench_now_ns();
      int rc = ferry_snapshot_fence(s, NULL); /* ...and fences before its update */
      double t3 = bench_now_ns();
      optimizer_step(state, ++step);
      if (rc || finish(s)) goto out;
      t_start[round] = (t1 - t0) / 1e6;
      t_fence[round] = (t3 - t2) / 1e6;
      blocked[round] = t_start[round] + t_fence[round];
    }
    double blocked_med = median(blocked, ROUNDS), sync_med = median(sync_ms, ROUNDS);
    char name[96];
    const char *sfx = scenarios[k].suffix;
#define METRIC(base, value, unit, note)                \
  do {                                                 \
    snprintf(name, sizeof name, "%s%s", base, sfx);    \
    bench_metric(r, name, value, unit, note);          \
  } while (0)
    METRIC("engine_snapshot_step_compute_ms", median(compute_ms, ROUNDS), "ms",
           k == 0 ? "1.5x the staging time" : "0.33x the staging time");
    METRIC("engine_snapshot_start_ms", median(t_start, ROUNDS), "ms", NULL);
    METRIC("engine_snapshot_fence_ms", median(t_fence, ROUNDS), "ms", "host backend: waits for copies");
    METRIC("engine_snapshot_blocked_ms", blocked_med, "ms", "start + fence, median");
    METRIC("engine_sync_memcpy_ms", sync_med, "ms", "memcpy of the state, warm destination");
    METRIC("engine_snapshot_blocked_vs_sync_cpu", blocked_med / sync_med, "ratio",
           k == 0 ? "target <= 0.1" : "compute shorter than staging");
#undef METRIC
  }

out:
  unlink(path);
  unlink(raw_path);
  ferry_engine_destroy(e);
  for (int t = 0; t < N_TENSORS; t++) free(state[t]);
  free(act);
  free(sync_dst);
}
