/* test_snapshot_pipe.c — checkpoint staging's write thread (issue 37, item
 * 10): the writer hands each window of the file to a thread that writes it,
 * and fills and checksums the next window meanwhile. The window hook of
 * ferry_tools.h holds each write until the writer has handed on the next
 * window: only a writer that does not wait for the write gets there (one
 * that writes in series never does, and the hook gives up after a long
 * watchdog). The file is the streaming zip writer's, byte for byte (that
 * writer's file is torch.save's), whole or chunked into many windows; a
 * failed write on the write thread is the snapshot's error, with the path,
 * no temporary file left and the previous file intact; without the thread
 * (ferry_snapshot_set_write_thread(0), FERRY_SNAPSHOT_WRITE_THREAD=0) the
 * windows are written one after the other, with the same file; a staging
 * copy that fails on the writer with a write in flight, and two snapshots
 * at once with the engine destroyed under them, leave no slot written after
 * it went back. Each test sets the write thread's switches itself (the
 * suite's environment may hold FERRY_SNAPSHOT_WRITE_THREAD=0). Runs over
 * whichever backend FERRY_TEST_BACKEND names. */
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#include "test_reference_zip.h"

#define N_REC 10

static uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

typedef struct pstate {
  ferry_snapshot_record rec[N_REC];
  char names[N_REC][32];
  void *dev[N_REC];
  unsigned char *bytes[N_REC];
} pstate;

/* About 17 MiB: empty, one byte, sizes around a block, megabytes plus odd
 * bytes; records 4 and 7 host data. Whole, the file is several windows (16
 * MiB, 1 MiB, a tail); under a 3 MiB cap, two slots take turns over about
 * a dozen windows. */
static const uint64_t pipe_sizes[N_REC] = {0,     1,           4095, (3u << 20) + 77, 12345,
                                           (5u << 20) + 1, 4097, (2u << 20) + 3, 64,
                                           (7u << 20) + 11};

static int pstate_make(pstate *st, uint64_t seed) {
  memset(st, 0, sizeof *st);
  uint64_t rng = seed;
  for (size_t i = 0; i < N_REC; i++) {
    uint64_t b = pipe_sizes[i];
    snprintf(st->names[i], sizeof st->names[i], "pipe/data/%zu", i);
    if (!(st->bytes[i] = malloc(b ? b : 1))) return -1;
    for (uint64_t k = 0; k < b; k += 8) {
      uint64_t v = splitmix(&rng);
      memcpy(st->bytes[i] + k, &v, b - k < 8 ? b - k : 8);
    }
    st->rec[i] = (ferry_snapshot_record){.name = st->names[i], .bytes = b};
    if (place_record(&st->rec[i], &st->dev[i], st->bytes[i], b, i == 4 || i == 7)) return -1;
  }
  return 0;
}

static void pstate_free(pstate *st) {
  for (size_t i = 0; i < N_REC; i++) {
    free(st->bytes[i]);
    if (st->dev[i]) test_dev_free(st->dev[i]);
  }
}

/* The snapshots' temporary files in dir (".NAME.ferry-XXXXXX"). */
static int temp_files(const char *dir) {
  DIR *d = opendir(dir);
  int n = 0;
  for (struct dirent *ent; d && (ent = readdir(d));)
    n += ent->d_name[0] == '.' && strstr(ent->d_name, ".ferry-") != NULL;
  if (d) closedir(d);
  return n;
}

static void remove_tree(const char *dir) {
  char cmd[320];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

/* ---- the window hook ----------------------------------------------------------- */
#define WATCHDOG_S 30 /* a hung writer, not a slow one: the test fails, it does not hang */

typedef struct window_log {
  uint64_t file_size;
  _Atomic uint64_t filled_end;  /* the furthest end of a window handed on */
  _Atomic int filled, writes;   /* events seen */
  _Atomic int next_filled_first; /* writes that began after the next window was handed on */
  _Atomic int gave_up;          /* a write waited WATCHDOG_S for the next window */
  _Atomic int inline_writes;    /* writes on the thread that fills the windows */
  _Atomic(pthread_t) filler;    /* that thread */
  int hold;                     /* hold each write until the next window is handed on */
  int fail_write;               /* nonzero: that write (1 = the first) fails with EIO */
} window_log;

static window_log wlog;

static int window_hook(void *ud, int event, uint64_t off, size_t len) {
  window_log *l = ud;
  uint64_t end = off + len;
  if (event == FERRY_SNAP_WINDOW_FILLED) {
    atomic_store(&l->filler, pthread_self());
    atomic_fetch_add(&l->filled, 1);
    uint64_t cur = atomic_load(&l->filled_end);
    while (cur < end && !atomic_compare_exchange_weak(&l->filled_end, &cur, end)) {
    }
    return 0;
  }
  int nth = atomic_fetch_add(&l->writes, 1) + 1;
  /* written where it was filled: holding it would wait for ourselves */
  int same = pthread_equal(atomic_load(&l->filler), pthread_self());
  atomic_fetch_add(&l->inline_writes, same);
  if (end < l->file_size && !same) { /* not the last window: has the next been handed on? */
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (l->hold && !atomic_load(&l->gave_up) && atomic_load(&l->filled_end) <= end) {
      clock_gettime(CLOCK_MONOTONIC, &now);
      if (now.tv_sec - t0.tv_sec > WATCHDOG_S) {
        fprintf(stderr, "  the write of [%llu, %llu) waited %d s for the next window\n",
                (unsigned long long)off, (unsigned long long)end, WATCHDOG_S);
        atomic_store(&l->gave_up, 1);
      }
      usleep(200);
    }
    if (atomic_load(&l->filled_end) > end) atomic_fetch_add(&l->next_filled_first, 1);
  }
  return l->fail_write == nth ? EIO : 0;
}

static void log_reset(uint64_t file_size, int hold, int fail_write) {
  wlog.file_size = file_size;
  atomic_store(&wlog.filled_end, 0);
  atomic_store(&wlog.filled, 0);
  atomic_store(&wlog.writes, 0);
  atomic_store(&wlog.next_filled_first, 0);
  atomic_store(&wlog.gave_up, 0);
  atomic_store(&wlog.inline_writes, 0);
  wlog.hold = hold;
  wlog.fail_write = fail_write;
}

/* The switches of the write thread (ferry_snapshot_set_write_thread and
 * FERRY_SNAPSHOT_WRITE_THREAD) as a test wants them, whatever the
 * environment the suite was started in or a test before it left: with the
 * variable at 0 (a benchmark's serial baseline exported in the shell) every
 * window is written on the writer, and the overlap test's hook waited its
 * whole watchdog for a window the writer could only fill after that very
 * write. Returns the variable's value before (NULL: unset) for
 * write_thread_restore. */
static char saved_env[64];
static const char *write_thread_force(int on) {
  const char *env = getenv("FERRY_SNAPSHOT_WRITE_THREAD");
  const char *before = env ? (snprintf(saved_env, sizeof saved_env, "%s", env), saved_env) : NULL;
  if (on) unsetenv("FERRY_SNAPSHOT_WRITE_THREAD");
  ferry_snapshot_set_write_thread(on);
  return before;
}

static void write_thread_restore(const char *before) {
  ferry_snapshot_set_write_thread(1);
  if (before) setenv("FERRY_SNAPSHOT_WRITE_THREAD", before, 1);
  else unsetenv("FERRY_SNAPSHOT_WRITE_THREAD");
}

/* One snapshot of st to path under cap (0: none), the window hook set.
 * FERRY_OK or the snapshot's error code; its message in msg. */
static int snapshot_with_hook(const char *path, const pstate *st, uint64_t cap, char *msg,
                              size_t msg_len, uint64_t *arena_left) {
  test_device_stats dev = {0};
  ferry_config c = test_engine_config(&dev);
  c.retain = test_device_retain_cb;
  c.host_cap_bytes = cap;
  ferry_engine *e = NULL;
  char err[512];
  msg[0] = 0;
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    snprintf(msg, msg_len, "engine: %s", err);
    return FERRY_EINVAL;
  }
  ferry_snapshot_set_window_hook(window_hook, &wlog);
  ferry_snapshot *s = NULL;
  int rc = ferry_snapshot_start(e, path, st->rec, N_REC, NULL, &s);
  if (!rc) rc = ferry_snapshot_fence(s, NULL);
  if (!rc) rc = ferry_snapshot_wait(s);
  snprintf(msg, msg_len, "%s", s ? ferry_snapshot_error(s) : ferry_last_error(e));
  ferry_snapshot_free(s);
  ferry_snapshot_set_window_hook(NULL, NULL);
  ferry_stats fs;
  ferry_get_stats(e, &fs, sizeof fs);
  *arena_left = fs.arena_in_use;
  ferry_engine_destroy(e);
  return rc;
}

/* Whole (every window staged at start) and chunked (a 3 MiB cap: two slots
 * take turns): every write but the last began only once the writer had
 * handed on the next window, and the file is the streaming writer's. */
static int overlap_writes(void) {
  char dir[] = "/var/tmp/ferry-pipe-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  pstate st;
  CHECK(pstate_make(&st, 11) == 0);
  char ref[256], path[256], msg[768];
  snprintf(ref, sizeof ref, "%s/reference.pt", dir);
  CHECK_EQ(write_reference_zip(ref, st.rec, st.bytes, N_REC), 0);
  long long size = file_size(ref);
  CHECK(size > 0);
  static const uint64_t caps[2] = {0, 3u << 20};
  for (int k = 0; k < 2; k++) {
    snprintf(path, sizeof path, "%s/ckpt-%d.pt", dir, k);
    log_reset((uint64_t)size, 1, 0);
    uint64_t left = 1;
    int rc = snapshot_with_hook(path, &st, caps[k], msg, sizeof msg, &left);
    if (rc) fprintf(stderr, "  cap %llu: %s\n", (unsigned long long)caps[k], msg);
    CHECK_OK(rc);
    printf("  cap %llu: %d windows, %d written after the next was handed on, %d on the "
           "writer thread\n",
           (unsigned long long)caps[k], atomic_load(&wlog.writes),
           atomic_load(&wlog.next_filled_first), atomic_load(&wlog.inline_writes));
    CHECK_EQ(atomic_load(&wlog.inline_writes), 0);
    CHECK_EQ(atomic_load(&wlog.gave_up), 0);
    CHECK(atomic_load(&wlog.writes) >= (k ? 8 : 3)); /* several windows, many when chunked */
    CHECK_EQ(atomic_load(&wlog.filled), atomic_load(&wlog.writes));
    CHECK_EQ(atomic_load(&wlog.next_filled_first), atomic_load(&wlog.writes) - 1);
    CHECK_EQ(left, 0);
    CHECK(same_file(path, ref) == 0);
  }
  CHECK_EQ(temp_files(dir), 0);
  pstate_free(&st);
  remove_tree(dir);
  return 0;
}

TEST(snapshot_pipe_threads_overlap_writes) {
  const char *before = write_thread_force(1);
  int rc = overlap_writes();
  write_thread_restore(before);
  return rc;
}

/* A write that fails on the write thread (EIO from the hook, on the second
 * window, while later windows are queued behind it): the snapshot fails
 * with the path and the errno's text, the temporary file is gone, the
 * previous file is untouched and the arena holds nothing of it; whole and
 * chunked. */
static int threads_write_error(void) {
  char dir[] = "/var/tmp/ferry-pipe-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  pstate prev, st;
  CHECK(pstate_make(&prev, 21) == 0);
  CHECK(pstate_make(&st, 22) == 0);
  char prev_ref[256], path[256], msg[768];
  snprintf(prev_ref, sizeof prev_ref, "%s/previous.pt", dir);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  CHECK_EQ(write_reference_zip(prev_ref, prev.rec, prev.bytes, N_REC), 0);
  uint64_t left = 1;
  log_reset((uint64_t)file_size(prev_ref), 0, 0);
  CHECK_OK(snapshot_with_hook(path, &prev, 0, msg, sizeof msg, &left));
  CHECK(same_file(path, prev_ref) == 0);
  static const uint64_t caps[2] = {0, 3u << 20};
  for (int k = 0; k < 2; k++) {
    log_reset((uint64_t)file_size(prev_ref), 0, 2);
    left = 1;
    int rc = snapshot_with_hook(path, &st, caps[k], msg, sizeof msg, &left);
    printf("  cap %llu: %s\n", (unsigned long long)caps[k], msg);
    CHECK_RC(rc, FERRY_EIO);
    CHECK_STR_CONTAINS(msg, path);
    CHECK_STR_CONTAINS(msg, "write to");
    CHECK_STR_CONTAINS(msg, "Input/output error");
    CHECK(atomic_load(&wlog.writes) >= 2);
    CHECK_EQ(left, 0);
    CHECK_EQ(temp_files(dir), 0);
    CHECK(same_file(path, prev_ref) == 0);
  }
  pstate_free(&prev);
  pstate_free(&st);
  remove_tree(dir);
  return 0;
}

TEST(snapshot_pipe_threads_write_error) {
  const char *before = write_thread_force(1);
  int rc = threads_write_error();
  write_thread_restore(before);
  return rc;
}

/* Without the write thread (the switch, then the environment variable)
 * each window is written before the next is filled, and the file is the
 * same. */
static int off_writes_in_series(void) {
  char dir[] = "/var/tmp/ferry-pipe-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  pstate st;
  CHECK(pstate_make(&st, 31) == 0);
  char ref[256], path[256], msg[768];
  snprintf(ref, sizeof ref, "%s/reference.pt", dir);
  CHECK_EQ(write_reference_zip(ref, st.rec, st.bytes, N_REC), 0);
  long long size = file_size(ref);
  for (int way = 0; way < 2; way++) {
    if (way == 0) ferry_snapshot_set_write_thread(0);
    else setenv("FERRY_SNAPSHOT_WRITE_THREAD", "0", 1);
    for (int k = 0; k < 2; k++) {
      snprintf(path, sizeof path, "%s/ckpt-%d-%d.pt", dir, way, k);
      log_reset((uint64_t)size, 0, 0);
      uint64_t left = 1;
      int rc = snapshot_with_hook(path, &st, k ? 3u << 20 : 0, msg, sizeof msg, &left);
      if (rc) fprintf(stderr, "  %s\n", msg);
      CHECK_OK(rc);
      CHECK(atomic_load(&wlog.writes) >= 3);
      CHECK_EQ(atomic_load(&wlog.next_filled_first), 0);
      CHECK_EQ(atomic_load(&wlog.inline_writes), atomic_load(&wlog.writes));
      CHECK_EQ(left, 0);
      CHECK(same_file(path, ref) == 0);
    }
    ferry_snapshot_set_write_thread(1); /* the next way alone */
    unsetenv("FERRY_SNAPSHOT_WRITE_THREAD");
  }
  pstate_free(&st);
  remove_tree(dir);
  return 0;
}

/* A failed check returns early: the switches are restored all the same,
 * or every snapshot of the tests after it would run in series. */
TEST(snapshot_pipe_off_writes_in_series) {
  const char *before = write_thread_force(1);
  int rc = off_writes_in_series();
  write_thread_restore(before);
  return rc;
}

/* ---- failures on the writer's side, several snapshots, teardown ---------------- */
static _Atomic int slow_writes; /* writes slept through by slow_hook */

/* Every write takes a few milliseconds more (no handshake: it works with
 * several snapshots at once): the writer fails, or the engine is torn
 * down, while a write is in flight. */
static int slow_hook(void *ud, int event, uint64_t off, size_t len) {
  (void)ud, (void)off, (void)len;
  if (event == FERRY_SNAP_WINDOW_WRITE) {
    atomic_fetch_add(&slow_writes, 1);
    usleep(3000);
  }
  return 0;
}

/* A chunked snapshot whose staging copies fail at random (seeded backend
 * faults): the copy of a later window fails on the writer while the write
 * thread still writes an earlier one from a slot. The snapshot's error is
 * the copy's, no temporary file is left, the previous file is untouched
 * and the arena gets every slot back (only after the write thread let go:
 * ASan's arena poisoning sees a write from a slot given back). */
static int writer_fails_midway(void) {
  char dir[] = "/var/tmp/ferry-pipe-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  pstate prev, st;
  CHECK(pstate_make(&prev, 41) == 0);
  CHECK(pstate_make(&st, 42) == 0);
  char prev_ref[256], path[256], spec[96], err[512];
  snprintf(prev_ref, sizeof prev_ref, "%s/previous.pt", dir);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  CHECK_EQ(write_reference_zip(prev_ref, prev.rec, prev.bytes, N_REC), 0);
  CHECK_EQ(write_reference_zip(path, prev.rec, prev.bytes, N_REC), 0);
  int midway = 0;
  for (uint64_t seed = 1; seed <= 40 && midway < 3; seed++) {
    test_device_stats dev = {0};
    ferry_config c = test_engine_config(&dev);
    c.retain = test_device_retain_cb;
    c.host_cap_bytes = 3u << 20;
    snprintf(spec, sizeof spec, "seed=%llu,copy=0.08", (unsigned long long)seed);
    c.faults = spec;
    ferry_engine *e = NULL;
    CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
    atomic_store(&slow_writes, 0);
    ferry_snapshot_set_window_hook(slow_hook, NULL);
    ferry_snapshot *s = NULL;
    int rc = ferry_snapshot_start(e, path, st.rec, N_REC, NULL, &s);
    if (!rc) {
      ferry_snapshot_fence(s, NULL);
      rc = ferry_snapshot_wait(s);
      if (rc && atomic_load(&slow_writes) > 0) {
        midway++;
        printf("  seed %llu after %d writes: %s\n", (unsigned long long)seed,
               atomic_load(&slow_writes), ferry_snapshot_error(s));
        CHECK_STR_CONTAINS(ferry_snapshot_error(s), "staging copy failed");
      }
    }
    ferry_snapshot_free(s);
    ferry_snapshot_set_window_hook(NULL, NULL);
    ferry_stats fs;
    ferry_get_stats(e, &fs, sizeof fs);
    CHECK_EQ(fs.arena_in_use, 0);
    ferry_engine_destroy(e);
    CHECK_EQ(temp_files(dir), 0);
    if (rc) CHECK(same_file(path, prev_ref) == 0);
    else CHECK_OK(write_reference_zip(path, prev.rec, prev.bytes, N_REC));
  }
  CHECK(midway > 0); /* else the seeds never failed a copy after a write began */
  pstate_free(&prev);
  pstate_free(&st);
  remove_tree(dir);
  return 0;
}

TEST(snapshot_pipe_threads_writer_fails_midway) {
  const char *before = write_thread_force(1);
  int rc = writer_fails_midway();
  write_thread_restore(before);
  return rc;
}

/* Two snapshots at once (one whole, one chunked: each its writer and write
 * thread), the engine destroyed while both are mid-pipeline: destroy
 * waits for them, both files are the streaming writer's, and the handles
 * outlive the engine. */
static int two_at_once_then_destroy(void) {
  char dir[] = "/var/tmp/ferry-pipe-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  pstate a, b;
  CHECK(pstate_make(&a, 51) == 0);
  CHECK(pstate_make(&b, 52) == 0);
  char ref_a[256], ref_b[256], path_a[256], path_b[256], err[512];
  snprintf(ref_a, sizeof ref_a, "%s/a.ref", dir);
  snprintf(ref_b, sizeof ref_b, "%s/b.ref", dir);
  snprintf(path_a, sizeof path_a, "%s/a.pt", dir);
  snprintf(path_b, sizeof path_b, "%s/b.pt", dir);
  CHECK_EQ(write_reference_zip(ref_a, a.rec, a.bytes, N_REC), 0);
  CHECK_EQ(write_reference_zip(ref_b, b.rec, b.bytes, N_REC), 0);
  test_device_stats dev = {0};
  ferry_config c = test_engine_config(&dev);
  c.retain = test_device_retain_cb;
  c.host_cap_bytes = 24u << 20; /* the first whole, the second chunked in what is left */
  ferry_engine *e = NULL;
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  atomic_store(&slow_writes, 0);
  ferry_snapshot_set_window_hook(slow_hook, NULL);
  ferry_snapshot *sa = NULL, *sb = NULL;
  CHECK_OK(ferry_snapshot_start(e, path_a, a.rec, N_REC, NULL, &sa));
  CHECK_OK(ferry_snapshot_start(e, path_b, b.rec, N_REC, NULL, &sb));
  CHECK_OK(ferry_snapshot_fence(sa, NULL));
  CHECK_OK(ferry_snapshot_fence(sb, NULL));
  ferry_engine_destroy(e); /* both still writing: 3 ms a window */
  ferry_snapshot_set_window_hook(NULL, NULL);
  CHECK_OK(ferry_snapshot_wait(sa));
  CHECK_OK(ferry_snapshot_wait(sb));
  ferry_snapshot_free(sa);
  ferry_snapshot_free(sb);
  printf("  %d writes\n", atomic_load(&slow_writes));
  CHECK(same_file(path_a, ref_a) == 0);
  CHECK(same_file(path_b, ref_b) == 0);
  CHECK_EQ(temp_files(dir), 0);
  pstate_free(&a);
  pstate_free(&b);
  remove_tree(dir);
  return 0;
}

TEST(snapshot_pipe_threads_two_at_once_then_destroy) {
  const char *before = write_thread_force(1);
  int rc = two_at_once_then_destroy();
  write_thread_restore(before);
  return rc;
}
