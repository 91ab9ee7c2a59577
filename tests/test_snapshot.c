/* test_snapshot.c — checkpoint staging through the public API: archives
 * that standard zip readers accept and that hold the state as of
 * ferry_snapshot_start, staging ordered after the compute stream, the host
 * cap with no device memory added. Runs over whichever backend
 * FERRY_TEST_BACKEND names. The archives are checked by python3 (on PATH)
 * and by `unzip -t` where installed (test_snapshot_fixture.h). */
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
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif
#include "test_snapshot_fixture.h"

/* ---- tests ------------------------------------------------------------------- */
TEST(snapshot_round_trip_random) {
  fixture f;
  ferry_config c = fixture_config(&f);
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  state st;
  CHECK(state_make(&st, 150, size_random, 7, 11) == 0);

  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  CHECK_OK(ferry_snapshot_wait(s));
  CHECK_OK(ferry_snapshot_poll(s));
  CHECK(strcmp(ferry_snapshot_error(s), "") == 0);
  ferry_snapshot_free(s);
  CHECK(file_exists(path));
  CHECK_EQ(temp_files(dir, NULL), 0);
  CHECK(check_archive(dir, path, &st) == 0);
  /* Nothing added on the device; the staging memory went back. */
  CHECK_EQ(atomic_load(&f.dev.allocs), 0);
  CHECK_EQ(arena_in_use(f.e), 0);

  /* A second snapshot over the first replaces it. */
  state_scribble(&st, 99);
  for (size_t i = 0; i < st.n; i++)
    if (st.dev[i]) test_dev_read(st.expect[i], st.dev[i], (size_t)st.rec[i].bytes);
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
  CHECK_OK(ferry_snapshot_wait(s));
  ferry_snapshot_free(s);
  CHECK(check_archive(dir, path, &st) == 0);

  /* An empty snapshot is an empty, valid archive. */
  char empty[160];
  snprintf(empty, sizeof empty, "%s/empty.pt", dir);
  CHECK_OK(ferry_snapshot_start(f.e, empty, NULL, 0, NULL, &s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  CHECK_OK(ferry_snapshot_wait(s));
  ferry_snapshot_free(s);
  CHECK(check_archive_bytes(dir, empty, 0, NULL, NULL) == 0);

  state_free(&st);
  ferry_engine_destroy(f.e);
  CHECK_EQ(test_buffers_live(), 0);
  remove_dir(dir);
  return 0;
}

/* The file holds the state as of start even though the caller overwrote
 * every tensor right after fence, while the copies (slowed by the link
 * model) could otherwise still have been reading them. Unchunked and
 * chunked (the cap far below the state). */
TEST(snapshot_consistent_after_fence) {
  for (int chunked = 0; chunked < 2; chunked++) {
    fixture f;
    ferry_config c = fixture_config(&f);
    c.link.d2h_bytes_per_s = 400e6; /* 16 MiB: ~40 ms */
    if (chunked) c.host_cap_bytes = 4u << 20;
    CHECK_OK(fixture_open(&f, &c));
    char dir[64], path[128];
    CHECK(make_dir(dir, sizeof dir) == 0);
    snprintf(path, sizeof path, "%s/ckpt.pt", dir);
    state st;
    CHECK(state_make(&st, 16, size_1m, 0, 21 + (uint64_t)chunked) == 0);
    ferry_snapshot *s = NULL;
    CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
    if (test_backend_kind() == FERRY_BACKEND_HOST)
      CHECK_EQ(ferry_snapshot_poll(s), 1); /* the link makes it take a while */
    CHECK_OK(ferry_snapshot_fence(s, NULL));
    state_scribble(&st, 12345); /* "optimizer step" */
    CHECK_OK(ferry_snapshot_wait(s));
    ferry_snapshot_free(s);
    CHECK(check_archive(dir, path, &st) == 0);
    CHECK_EQ(atomic_load(&f.dev.allocs), 0);
    state_free(&st);
    ferry_engine_destroy(f.e);
    remove_dir(dir);
  }
  return 0;
}

/* Staging copies wait for the work already queued on the compute stream:
 * here the writes that produce each tensor's final bytes, behind a slow one.
 * A staging copy that does not wait reads the zeros that were there. */
TEST(snapshot_staging_waits_for_the_compute_stream) {
  fixture f;
  ferry_config c = fixture_config(&f);
  c.link.d2h_bytes_per_s = c.link.h2d_bytes_per_s = 200e6;
  CHECK_OK(fixture_open(&f, &c));
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(20000);
#endif
  ferry_backend *bk = ferry_engine_backend(f.e);
  bk_stream compute = NULL;
  CHECK_OK(bk->ops->stream_create(bk, &compute));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  state st;
  CHECK(state_make(&st, 4, size_1m, 0, 77) == 0);
  const size_t busy_bytes = 4u << 20;
  void *busy = NULL, *scratch = test_dev_malloc(busy_bytes);
  CHECK_OK(bk->ops->host_alloc(bk, busy_bytes, 4096, &busy));
  void *pinned[4] = {0};
  CHECK_OK(bk->ops->copy_h2d(bk, scratch, busy, busy_bytes, compute)); /* ~20 ms */
  for (size_t i = 0; i < st.n; i++) {
    uint64_t n = st.rec[i].bytes;
    CHECK_OK(bk->ops->host_alloc(bk, n, 4096, &pinned[i]));
    memcpy(pinned[i], st.expect[i], n);
    unsigned char *zero = calloc(1, n);
    test_dev_write(st.dev[i], zero, n); /* what a copy that does not wait sees */
    free(zero);
    CHECK_OK(bk->ops->copy_h2d(bk, st.dev[i], pinned[i], n, compute)); /* the "kernel" */
  }
  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, compute, &s));
  CHECK_OK(ferry_snapshot_fence(s, compute));
  CHECK_OK(ferry_snapshot_wait(s));
  ferry_snapshot_free(s);
  CHECK_OK(bk->ops->stream_synchronize(bk, compute));
  CHECK(check_archive(dir, path, &st) == 0);
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(0);
#endif
  for (size_t i = 0; i < st.n; i++) CHECK_OK(bk->ops->host_free(bk, pinned[i], st.rec[i].bytes));
  CHECK_OK(bk->ops->host_free(bk, busy, busy_bytes));
  test_dev_free(scratch);
  CHECK_OK(bk->ops->stream_destroy(bk, compute));
  state_free(&st);
  ferry_engine_destroy(f.e);
  remove_dir(dir);
  return 0;
}

typedef struct sampler {
  ferry_engine *e;
  atomic_int stop;
  uint64_t max_reserved, max_in_use;
  long samples;
} sampler;

static void *sampler_main(void *arg) {
  sampler *sp = arg;
  while (!atomic_load(&sp->stop)) {
    ferry_stats st;
    ferry_get_stats(sp->e, &st, sizeof st);
    if (st.arena_reserved > sp->max_reserved) sp->max_reserved = st.arena_reserved;
    if (st.arena_in_use > sp->max_in_use) sp->max_in_use = st.arena_in_use;
    sp->samples++;
    struct timespec ts = {0, 200000};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

/* A snapshot of 8x the cap (one record alone is 5x the cap) completes
 * chunked: the arena never reserves more than the cap. */
TEST(snapshot_cap_holds_chunked) {
  fixture f;
  ferry_config c = fixture_config(&f);
  const uint64_t cap = 4u << 20;
  c.host_cap_bytes = cap;
  CHECK_OK(fixture_open(&f, &c));
  char dir[64], path[128];
  CHECK(make_dir(dir, sizeof dir) == 0);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  state st;
  CHECK(state_make(&st, 6, size_mixed_big, 0, 31) == 0);
  uint64_t total = 0;
  for (size_t i = 0; i < st.n; i++) total += st.rec[i].bytes;
  CHECK(total > 8 * cap);

  sampler sp = {.e = f.e};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, sampler_main, &sp) == 0);
  ferry_snapshot *s = NULL;
  CHECK_OK(ferry_snapshot_start(f.e, path, st.rec, st.n, NULL, &s));
  CHECK_OK(ferry_snapshot_fence(s, NULL));
  CHECK_OK(ferry_snapshot_wait(s));
  atomic_store(&sp.stop, 1);
  pthread_join(th, NULL);
  ferry_snapshot_free(s);

  ferry_stats fs;
  CHECK_OK(ferry_get_stats(f.e, &fs, sizeof fs));
  CHECK(sp.samples > 0);
  CHECK(sp.max_reserved <= cap);
  CHECK(fs.arena_reserved <= cap);
  CHECK(fs.arena_peak <= cap); /* so the state went through in chunks */
  CHECK(fs.arena_peak > 0);
  CHECK_EQ(fs.arena_in_use, 0);
  CHECK_EQ(atomic_load(&f.dev.allocs), 0);
  CHECK(check_archive(dir, path, &st) == 0);
  state_free(&st);
  ferry_engine_destroy(f.e);
  remove_dir(dir);
  return 0;
}
