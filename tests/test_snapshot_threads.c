/* test_snapshot_threads.c — snapshots and threads: engine teardown with a
 * snapshot in flight, writer threads reused, and pack/unpack on another
 * thread meanwhile. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#include "test_snapshot_fixture.h"

/* ferry_engine_destroy with a snapshot in flight waits for it: the file is
 * complete, and the handle still answers until freed. */
TEST(snapshot_engine_destroy_waits) {
  fixture f;
  ferry_config c = fixture_config(&f);
  c.link.d2h_bytes_per_s = 200e6; /* 8 MiB: ~40 ms */
  c.host_cap_bytes = 2u << 20;
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  state st;
  CHECK(state_make(&st, 8, size_1m, 0, 71) == 0);
  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
  if (test_backend_kind() == FERRY_BACKEND_HOST)
    CHECK_EQ(ferry_snapshot_poll(s), 1); /* still staging over the slow link */
  ferry_engine_destroy(f.e);
  CHECK_OK(ferry_snapshot_poll(s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  CHECK_OK(ferry_snapshot_wait(s));
  ferry_snapshot_free(s);
  CHECK(check_archive(dir, path, &st) == 0);
  state_free(&st);
  remove_dir(dir);
  return 0;
}

/* The threads of this process named "ferry-snapshot"; *idle: how many of
 * them run at SCHED_IDLE. -1 where /proc/self/task cannot be read. */
static int writer_threads(int *idle) {
  *idle = 0;
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d))) {
    if (de->d_name[0] == '.') continue;
    char p[300], comm[32] = "";
    snprintf(p, sizeof p, "/proc/self/task/%s/comm", de->d_name);
    FILE *f = fopen(p, "r");
    if (!f) continue;
    if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
    fclose(f);
    if (strcmp(comm, "ferry-snapshot\n") != 0) continue;
    n++;
#if defined(__linux__)
    /* a background writer: niced, at normal scheduling (not SCHED_IDLE) */
    pid_t tid = (pid_t)atoi(de->d_name);
    if (getpriority(PRIO_PROCESS, (id_t)tid) > getpriority(PRIO_PROCESS, 0) &&
        sched_getscheduler(tid) == SCHED_OTHER)
      (*idle)++;
#endif
  }
  closedir(d);
  return n;
}

static int snapshot_and_check(fixture *f, const char *dir, const char *path, state *st) {
  ferry_snapshot *s = NULL;
  int rc = ferry_snapshot_start(f->e, path, st->rec, st->n, NULL, &s);
  if (!rc) rc = ferry_snapshot_fence(s, NULL);
  if (!rc) rc = ferry_snapshot_wait(s);
  ferry_snapshot_free(s);
  return rc ? rc : check_archive(dir, path, st);
}

/* Writer threads outlive their snapshot and take the engine's next one
 * (creating a thread was most of ferry_snapshot_start's time): one thread
 * for snapshots one after another, one per snapshot running at once, a
 * normal-priority one for a chunked snapshot once the first was niced (it
 * cannot come back), none after the engine is destroyed. */
TEST(snapshot_writer_threads_are_reused) {
  int idle;
  if (writer_threads(&idle) < 0) {
    printf("  skipped: /proc/self/task cannot be read\n");
    return 0;
  }
  CHECK_EQ(writer_threads(&idle), 0);
  fixture f;
  ferry_config c = fixture_config(&f);
  c.link.d2h_bytes_per_s = c.link.h2d_bytes_per_s = 200e6;
  /* the file image, host records too, is staged: two small ones fit with
   * room for the arena's extents */
  c.host_cap_bytes = 16u << 20;
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[4][128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  for (int i = 0; i < 4; i++) snprintf(path[i], sizeof path[i], "%s/ckpt%d.pt", dir, i);
  state small, big;
  CHECK(state_make(&small, 4, size_1m, 2, 5) == 0); /* 4 MiB staged: fits, all issued */
  CHECK(state_make(&big, 24, size_1m, 0, 6) == 0);  /* 24 MiB past a 16 MiB cap: chunked */

  for (int round = 0; round < 3; round++) { /* one after another: one thread */
    CHECK_OK(snapshot_and_check(&f, dir, path[0], &small));
    CHECK_EQ(writer_threads(&idle), 1);
  }
  int can_idle = idle == 1; /* niceness is best effort (19 already) */
  printf("  writer niced: %s\n", can_idle ? "yes" : "no (refused here)");

  /* at once: a second thread. a's copies wait behind ~160 ms of work on
   * its compute stream, so a is still running when b starts however slowly
   * this host runs (TSan, a loaded CI machine: 20 ms of staging was not) */
  ferry_backend *bk = ferry_engine_backend(f.e);
  bk_stream compute = NULL;
  CHECK_OK(bk->ops->stream_create(bk, &compute));
  const size_t busy_bytes = 32u << 20;
  void *busy = NULL, *scratch = test_dev_malloc(busy_bytes);
  CHECK_OK(bk->ops->host_alloc(bk, busy_bytes, 4096, &busy));
  CHECK_OK(bk->ops->copy_h2d(bk, scratch, busy, busy_bytes, compute));
  ferry_snapshot *a = NULL, *b = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path[1], small.rec, small.n, compute, &a));
  CHECK_OK(ferry_snapshot_start(f.e, path[2], small.rec, small.n, NULL, &b));
  CHECK_EQ(ferry_snapshot_poll(a), 1);
  CHECK_OK(ferry_snapshot_wait(a));
  CHECK_OK(ferry_snapshot_wait(b));
  ferry_snapshot_free(a);
  ferry_snapshot_free(b);
  CHECK_OK(bk->ops->stream_synchronize(bk, compute));
  CHECK_OK(bk->ops->host_free(bk, busy, busy_bytes));
  test_dev_free(scratch);
  CHECK_OK(bk->ops->stream_destroy(bk, compute));
  CHECK_EQ(writer_threads(&idle), 2);
  CHECK(check_archive(dir, path[1], &small) == 0);
  CHECK(check_archive(dir, path[2], &small) == 0);

  /* chunked: every parked thread is niced (where it could be), so
   * a third one at normal priority; it is reused the next time */
  for (int round = 0; round < 2; round++) {
    CHECK_OK(snapshot_and_check(&f, dir, path[3], &big));
    CHECK_EQ(writer_threads(&idle), can_idle ? 3 : 2);
    if (can_idle) CHECK_EQ(idle, 2);
  }
  CHECK_OK(snapshot_and_check(&f, dir, path[0], &small)); /* a parked thread, any */
  CHECK_EQ(writer_threads(&idle), can_idle ? 3 : 2);

  ferry_engine_destroy(f.e);
  CHECK_EQ(writer_threads(&idle), 0);
  state_free(&small);
  state_free(&big);
  remove_dir(dir);
  return 0;
}

typedef struct packer {
  ferry_engine *e;
  atomic_int stop;
  int rc;
  long rounds;
} packer;

static void *packer_main(void *arg) {
  packer *p = arg;
  uint64_t seed = 1000;
  while (!atomic_load(&p->stop) && !p->rc) {
    p->rc = stash_round_trip(p->e, 256 * 1024 + (size_t)(seed % 4096), seed);
    seed++;
    p->rounds++;
  }
  return NULL;
}

/* Snapshots while another thread packs and unpacks through the same arena
 * and D2H stream: every tensor and every archive comes out right. */
TEST(snapshot_concurrent_pack_unpack) {
  fixture f;
  ferry_config c = fixture_config(&f);
  c.host_cap_bytes = 8u << 20; /* shared by both: cap fallbacks are fine */
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  packer p = {.e = f.e};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, packer_main, &p) == 0);
  for (int round = 0; round < 4; round++) {
    snprintf(path, sizeof path, "%s/ckpt-%d.pt", dir, round);
    state st;
    CHECK(state_make(&st, 40, size_random, 9, 81 + (uint64_t)round) == 0);
    ferry_snapshot *s = NULL;
    CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
    CHECK_OK(ferry_snapshot_fence(s, NULL));
    state_scribble(&st, 4242);
    CHECK_OK(ferry_snapshot_wait(s));
    ferry_snapshot_free(s);
    CHECK(check_archive(dir, path, &st) == 0);
    state_free(&st);
  }
  atomic_store(&p.stop, 1);
  pthread_join(th, NULL);
  CHECK_OK(p.rc);
  CHECK(p.rounds > 0);
  ferry_stats fs;
  CHECK_OK(ferry_get_stats(f.e, &fs, sizeof fs));
  CHECK(fs.arena_reserved <= c.host_cap_bytes);
  CHECK_EQ(fs.arena_in_use, 0);
  ferry_engine_destroy(f.e);
  CHECK_EQ(test_buffers_live(), 0);
  remove_dir(dir);
  return 0;
}
