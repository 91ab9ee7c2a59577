/*
 *  bench_snapshot.c — checkpoint staging on the host backend, in one run:
 * staging and write throughput, then a training-like loop: time blocked by a
 * snapshot against a synchronous copy of the state, and the slowdown of the
 * steps that overlap a snapshot's drain. Definitions (the same as
 * bench/bench_checkpoint.py's): bench/README.md, "Checkpoint benchmarks".
 */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
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
#define ROUNDS 3      /* throughput rounds */
#define ROUNDS_LOOP 9 /* training-loop rounds */
#define PLAIN_STEPS 2 /* steps with no snapshot in flight before, and after, a snapshot's */
#define MAX_OVERLAP 40 /* steps overlapping one snapshot, at most */

static int no_device_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  (void)ud, (void)bytes, (void)stream, (void)dev, (void)owner;
  return -1; /* a snapshot never allocates device memory */
}
static void no_release(void *ud, void *owner) { (void)ud, (void)owner; }

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

/* What the disk does without ferry, done as a snapshot does it (issue 37):
 * the state's bytes written to a new temporary file beside path, fsync,
 * close, rename over path, fsync of the directory. Milliseconds, or -1 on
 * failure. */
static double disk_baseline_ms(const char *path, uint64_t **state) {
  char tmp[256], dir[256];
  snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash) *slash = 0;
  double t0 = bench_now_ns();
  int fd = mkstemp(tmp);
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
  if (fd >= 0) ok = close(fd) == 0 && ok;
  ok = ok && rename(tmp, path) == 0;
  int dfd = ok ? open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
  ok = ok && dfd >= 0 && fsync(dfd) == 0;
  if (dfd >= 0) close(dfd);
  if (!ok) {
    fprintf(stderr, "bench_snapshot: writing %s failed\n", tmp);
    unlink(tmp);
  }
  return ok ? (bench_now_ns() - t0) / 1e6 : -1;
}

/* CPU time (ns, from schedstat) of this process's threads whose name
 * starts with prefix: the writer threads ("ferry-snapshot"); -1 if unknown. */
static double threads_cpu_ns(const char *prefix) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  double total = 0;
  for (struct dirent *ent; (ent = readdir(d));) {
    if (ent->d_name[0] == '.') continue;
    char p[320], comm[64] = "";
    snprintf(p, sizeof p, "/proc/self/task/%s/comm", ent->d_name);
    FILE *f = fopen(p, "r");
    if (f) {
      if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
      fclose(f);
    }
    if (strncmp(comm, prefix, strlen(prefix)) != 0) continue;
    snprintf(p, sizeof p, "/proc/self/task/%s/schedstat", ent->d_name);
    unsigned long long ns = 0;
    if ((f = fopen(p, "r"))) {
      if (fscanf(f, "%llu", &ns) != 1) ns = 0;
      fclose(f);
    }
    total += (double)ns;
  }
  closedir(d);
  return total;
}

/* Every core busy, as DataLoader workers keep them: one spinning thread
 * per online CPU at the process's priority. */
static atomic_int spin_stop;
static void *spin(void *arg) {
  (void)arg;
  volatile uint64_t x = 0;
  while (!atomic_load_explicit(&spin_stop, memory_order_relaxed)) x++;
  return NULL;
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
  char raw_path[] = "/tmp/ferry-bench-snapshot.raw"; /* the disk baseline's target */
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
  double writer_cpu_ms[ROUNDS];
  for (int round = 0; round < ROUNDS; round++) {
    double cpu0 = threads_cpu_ns("ferry-snapshot");
    double t0 = bench_now_ns();
    if (snapshot(e, path, rec, &s) || ferry_snapshot_fence(s, NULL)) goto out;
    double t1 = bench_now_ns();
    if (finish(s)) goto out;
    double t2 = bench_now_ns();
    writer_cpu_ms[round] = (threads_cpu_ns("ferry-snapshot") - cpu0) / 1e6;
    stage_ms[round] = (t1 - t0) / 1e6;
    write_ms[round] = (t2 - t0) / 1e6;
    t0 = bench_now_ns();
    sync_copy(state, sync_dst);
    memcpy_ms[round] = (bench_now_ns() - t0) / 1e6;
    if ((raw_ms[round] = disk_baseline_ms(raw_path, state)) < 0) goto out;
  }
  /* The same start-to-durable against the same baseline with every core
   * busy (the writer's priority decides how long the file takes). */
  long n_cpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (n_cpu < 1 || n_cpu > 256) n_cpu = 1;
  pthread_t spinners[256];
  long n_spin = 0;
  double busy_write_ms[ROUNDS], busy_raw_ms[ROUNDS];
  atomic_store(&spin_stop, 0);
  for (; n_spin < n_cpu; n_spin++)
    if (pthread_create(&spinners[n_spin], NULL, spin, NULL)) break;
  int busy_ok = 1;
  for (int round = 0; round < ROUNDS && busy_ok; round++) {
    double t0 = bench_now_ns();
    busy_ok = !snapshot(e, path, rec, &s) && !ferry_snapshot_fence(s, NULL) && !finish(s);
    busy_write_ms[round] = (bench_now_ns() - t0) / 1e6;
    busy_ok = busy_ok && (busy_raw_ms[round] = disk_baseline_ms(raw_path, state)) >= 0;
  }
  atomic_store(&spin_stop, 1);
  for (long i = 0; i < n_spin; i++) pthread_join(spinners[i], NULL);
  if (!busy_ok) goto out;
  double gb = (double)STATE_BYTES / 1e9;
  double staging_ms = bench_median(stage_ms, ROUNDS);
  double stage_gbps = gb / (staging_ms / 1e3);
  double memcpy_gbps = gb / (bench_median(memcpy_ms, ROUNDS) / 1e3);
  double write_gbps = gb / (bench_median(write_ms, ROUNDS) / 1e3);
  double disk_gbps = gb / (bench_median(raw_ms, ROUNDS) / 1e3);
  bench_metric(r, "engine_snapshot_state_MiB", (double)STATE_BYTES / (1 << 20), "MiB",
               "16 tensors, host backend");
  bench_metric(r, "engine_snapshot_staging_GBps", stage_gbps, "GB/s", "start to last copy done");
  bench_metric(r, "engine_snapshot_memcpy_GBps", memcpy_gbps, "GB/s", "same bytes, one thread");
  bench_metric(r, "engine_snapshot_staging_vs_memcpy", stage_gbps / memcpy_gbps, "ratio", NULL);
  bench_metric(r, "engine_snapshot_write_GBps", write_gbps, "GB/s", "start to durable file in /tmp");
  bench_metric(r, "engine_snapshot_disk_write_GBps", disk_gbps, "GB/s",
               "same bytes: temp file, write, fsync, rename, dir fsync");
  bench_metric(r, "engine_snapshot_write_vs_disk", write_gbps / disk_gbps, "ratio",
               "start-to-durable / disk baseline, idle");
  bench_metric(r, "engine_snapshot_writer_cpu_ms", bench_median(writer_cpu_ms, ROUNDS), "ms",
               "CPU time of the writer thread per snapshot, idle (schedstat)");
  double busy_vs = bench_median(busy_raw_ms, ROUNDS) / bench_median(busy_write_ms, ROUNDS);
  bench_metric(r, "engine_snapshot_busy_write_ms", bench_median(busy_write_ms, ROUNDS), "ms",
               "start to durable, every core spinning");
  bench_metric(r, "engine_snapshot_busy_disk_ms", bench_median(busy_raw_ms, ROUNDS), "ms",
               "the disk baseline, every core spinning");
  bench_metric(r, "engine_snapshot_write_vs_disk_busy", busy_vs, "ratio",
               "start-to-durable / disk baseline, every core busy");

  /* The training loop. A step is compute (passes over a separate 64 MiB
   * activation buffer: forward and backward) then an optimizer step that
   * updates every word of the state in place. The compute is a fixed
   * number of passes (not derived from the staging time): the headline
   * scenario and a short step. Each round: one untimed step, PLAIN_STEPS
   * steps with no snapshot in flight, a snapshot started after an optimizer
   * step followed by the steps that overlap its drain (it is still in
   * flight when the step starts: staging copies or writer), the first of
   * which fences before its optimizer update, PLAIN_STEPS more plain steps
   * (A-B-A: drift from outside the process hits both sides). Then the
   * sync-copy baseline: memcpy of the state into the same warm destination
   * every round. Definitions: bench/README.md. */
  static const struct {
    int passes;
    const char *suffix;
  } scenarios[] = {{8, ""}, {1, "_short_step"}};
  uint64_t step = 0;
  for (size_t k = 0; k < sizeof scenarios / sizeof scenarios[0]; k++) {
    int passes = scenarios[k].passes;
    double blocked[ROUNDS_LOOP], t_start[ROUNDS_LOOP], t_fence[ROUNDS_LOOP], sync_ms[ROUNDS_LOOP];
    double plain[ROUNDS_LOOP * 2 * PLAIN_STEPS], during[ROUNDS_LOOP * MAX_OVERLAP];
    double compute_ms[ROUNDS_LOOP * 2 * PLAIN_STEPS], ratio[ROUNDS_LOOP], lost[ROUNDS_LOOP],
        tmp[MAX_OVERLAP];
    int n_plain = 0, n_during = 0, drain_max = 0;
    for (int round = 0; round < ROUNDS_LOOP; round++) {
      int plain0 = n_plain, during0 = n_during;
      /* one untimed step: the baseline copy of the round before must not
       * slow a timed one */
      compute_step(act, ACT_BYTES / 8, passes);
      optimizer_step(state, ++step);
      for (int phase = 0; phase < 3; phase++) {
        if (phase != 1) { /* plain steps before and after the snapshot's: A-B-A */
          for (int i = 0; i < PLAIN_STEPS; i++) {
            double t0 = bench_now_ns();
            compute_step(act, ACT_BYTES / 8, passes);
            double t1 = bench_now_ns();
            optimizer_step(state, ++step);
            compute_ms[n_plain] = (t1 - t0) / 1e6;
            plain[n_plain++] = (bench_now_ns() - t0) / 1e6;
          }
          continue;
        }
        double t0 = bench_now_ns();
        if (snapshot(e, path, rec, &s)) goto out;
        t_start[round] = (bench_now_ns() - t0) / 1e6;
        t_fence[round] = 0;
        for (int i = 0; i < MAX_OVERLAP && (i == 0 || ferry_snapshot_poll(s) == 1); i++) {
          t0 = bench_now_ns();
          compute_step(act, ACT_BYTES / 8, passes);
          if (i == 0) { /* the fence before the first in-place update */
            double t2 = bench_now_ns();
            int rc = ferry_snapshot_fence(s, NULL);
            t_fence[round] = (bench_now_ns() - t2) / 1e6;
            if (rc) {
              finish(s);
              goto out;
            }
          }
          optimizer_step(state, ++step);
          during[n_during++] = (bench_now_ns() - t0) / 1e6;
        }
        if (finish(s)) goto out;
        blocked[round] = t_start[round] + t_fence[round];
        if (n_during - during0 > drain_max) drain_max = n_during - during0;
      }
      /* this round's overlapped steps / its plain steps: load from outside
       * the process drifts, and hits both halves of a round alike */
      memcpy(tmp, during + during0, (size_t)(n_during - during0) * sizeof *tmp);
      double d = bench_median(tmp, n_during - during0), sum = 0;
      for (int i = during0; i < n_during; i++) sum += during[i];
      memcpy(tmp, plain + plain0, (size_t)(n_plain - plain0) * sizeof *tmp);
      double p = bench_median(tmp, n_plain - plain0);
      ratio[round] = d / p;
      lost[round] = sum - (n_during - during0) * p; /* the steps' extra time, summed */
      double t0 = bench_now_ns();
      sync_copy(state, sync_dst);
      sync_ms[round] = (bench_now_ns() - t0) / 1e6;
    }
    double blocked_med = bench_median(blocked, ROUNDS_LOOP), sync_med = bench_median(sync_ms, ROUNDS_LOOP);
    double plain_med = bench_median(plain, n_plain), during_med = bench_median(during, n_during);
    double compute_med = bench_median(compute_ms, n_plain);
    char name[96];
    const char *sfx = scenarios[k].suffix;
#define METRIC(base, value, unit, note)                \
  do {                                                 \
    snprintf(name, sizeof name, "%s%s", base, sfx);    \
    bench_metric(r, name, value, unit, note);          \
  } while (0)
    METRIC("engine_snapshot_step_compute_ms", compute_med, "ms",
           k == 0 ? "8 passes over 64 MiB" : "1 pass over 64 MiB");
    METRIC("engine_snapshot_compute_vs_staging", compute_med / staging_ms, "ratio",
           "the compute that can hide the copies / staging alone");
    METRIC("engine_snapshot_start_ms", bench_median(t_start, ROUNDS_LOOP), "ms", NULL);
    METRIC("engine_snapshot_fence_ms", bench_median(t_fence, ROUNDS_LOOP), "ms",
           "host backend: waits for copies");
    METRIC("engine_snapshot_blocked_ms", blocked_med, "ms", "start + fence, median");
    METRIC("engine_sync_memcpy_ms", sync_med, "ms", "memcpy of the state, warm destination");
    METRIC("engine_snapshot_blocked_vs_sync_cpu", blocked_med / sync_med, "ratio",
           k == 0 ? "blocked / sync copy" : "compute shorter than staging");
    METRIC("engine_plain_step_ms", plain_med, "ms", "no snapshot in flight, median");
    METRIC("engine_overlapped_step_ms", during_med, "ms", "steps overlapping a drain, median");
    METRIC("engine_overlapped_steps", (double)n_during, "steps", "pooled over the rounds");
    METRIC("engine_snapshot_drain_steps_max", (double)drain_max, "steps",
           "most steps one snapshot overlapped");
    METRIC("engine_snapshot_step_time_lost_ms", bench_median(lost, ROUNDS_LOOP), "ms",
           "per snapshot: sum over its steps of (step - plain step)");
    METRIC("engine_snapshot_step_slowdown", bench_median(ratio, ROUNDS_LOOP), "ratio",
           "per round overlapped / plain step, median of rounds");
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
