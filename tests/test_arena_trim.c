/* test_arena_trim.c — giving pinned memory back (ferry_arena_release_free,
 * ferry_arena_trim), both arena kinds: free backend allocations go back to
 * the backend, live allocations keep their place and bytes, the floor is
 * kept, and the arena grows again afterwards. The engine test runs over
 * whichever backend FERRY_TEST_BACKEND names (host, or cuda over the CUDA
 * test double, whose pinned-byte count must drop too). */
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#include "test_pages_backend.h"
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

static uint8_t byte_at(uint64_t seed, size_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 29;
  return (uint8_t)(x * 0xBF58476D1CE4E5B9ull >> 56);
}

static void fill(void *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) ((uint8_t *)p)[i] = byte_at(seed, i);
}

static int same(const void *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++)
    if (((const uint8_t *)p)[i] != byte_at(seed, i)) return 0;
  return 1;
}

/* Sizes like a step's: a few staging-sized buffers and many small ones. */
static size_t size_of(int i) {
  return i % 5 == 0 ? ((size_t)3 << 20) + (size_t)i * 4096 : 700 + (size_t)i * 997;
}

/* ---- the arena alone, both kinds ---------------------------------------------- */
TEST(arena_trim_gives_free_memory_back) {
  static const int kinds[2] = {FERRY_ARENA_JEMALLOC, FERRY_ARENA_POOL};
  for (int k = 0; k < 2; k++) {
    pages_backend tb;
    pages_backend_init(&tb);
    ferry_arena *a = NULL;
    char err[256] = "";
    int rc = ferry_arena_create(&tb.base, kinds[k], 0, &a, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);
    printf("  %s arena\n", ferry_arena_kind_name(a));

    enum { N = 60 };
    void *p[N];
    for (int i = 0; i < N; i++) {
      p[i] = ferry_arena_alloc(a, size_of(i));
      CHECK(p[i] != NULL);
      fill(p[i], size_of(i), (uint64_t)i);
    }
    /* Nothing free yet: a trim gives nothing back and changes nothing. */
    ferry_arena_stats st0, st1, st2;
    ferry_arena_get_stats(a, &st0);
    CHECK_EQ(ferry_arena_release_free(a, 0), 0);
    ferry_arena_get_stats(a, &st1);
    CHECK_EQ(st1.reserved, st0.reserved);

    /* Keep one allocation in four (big and small ones), free the rest. */
    uint64_t kept_bytes = 0;
    for (int i = 0; i < N; i++) {
      if (i % 4 == 1 || i == 0) {
        kept_bytes += size_of(i);
        continue;
      }
      ferry_arena_free(a, p[i], size_of(i));
      p[i] = NULL;
    }
    ferry_arena_get_stats(a, &st1);
    CHECK_EQ(st1.reserved, st0.reserved); /* freeing alone keeps every byte pinned */
    CHECK_EQ(st1.in_use, kept_bytes);

    /* A floor above what is free keeps everything at or above it. */
    uint64_t floor = st1.reserved - ((uint64_t)2 << 20);
    uint64_t released = ferry_arena_release_free(a, floor);
    ferry_arena_get_stats(a, &st2);
    CHECK(st2.reserved >= floor);
    CHECK_EQ(st2.reserved, st1.reserved - released);

    /* No floor: the free memory goes back; what is in use stays, bit for bit. */
    long frees_before = atomic_load(&tb.frees);
    released = ferry_arena_release_free(a, 0);
    ferry_arena_get_stats(a, &st2);
    printf("  reserved %llu -> %llu bytes, %llu in use\n", (unsigned long long)st1.reserved,
           (unsigned long long)st2.reserved, (unsigned long long)st2.in_use);
    CHECK(released > 0);
    CHECK(atomic_load(&tb.frees) > frees_before);
    CHECK_EQ((long long)st2.reserved, atomic_load(&tb.outstanding));
    CHECK_EQ(st2.in_use, kept_bytes);
    CHECK(st2.reserved >= st2.in_use);
    /* Most of the 12 freed 3 MiB buffers went back (some share a backend
     * allocation with a kept one). */
    CHECK(st1.reserved - st2.reserved >= ((uint64_t)20 << 20));
    for (int i = 0; i < N; i++)
      if (p[i]) CHECK(same(p[i], size_of(i), (uint64_t)i));

    /* The arena grows again and serves new allocations next to the old. */
    for (int i = 0; i < N; i++) {
      if (p[i]) continue;
      p[i] = ferry_arena_alloc(a, size_of(i));
      CHECK(p[i] != NULL);
      fill(p[i], size_of(i), (uint64_t)i + 500);
    }
    for (int i = 0; i < N; i++)
      CHECK(same(p[i], size_of(i), (uint64_t)i + (i % 4 == 1 || i == 0 ? 0 : 500)));
    for (int i = 0; i < N; i++) {
      for (int j = i + 1; j < N; j++) { /* no two overlap */
        uintptr_t x = (uintptr_t)p[i], y = (uintptr_t)p[j];
        CHECK(x + size_of(i) <= y || y + size_of(j) <= x);
      }
    }

    /* Everything free: everything goes back. */
    for (int i = 0; i < N; i++) ferry_arena_free(a, p[i], size_of(i));
    ferry_arena_release_free(a, 0);
    ferry_arena_get_stats(a, &st2);
    CHECK_EQ(st2.in_use, 0);
    CHECK_EQ(st2.reserved, 0);
    CHECK_EQ(atomic_load(&tb.outstanding), 0);
    /* And it still works afterwards. */
    void *q = ferry_arena_alloc(a, (size_t)5 << 20);
    CHECK(q != NULL);
    fill(q, (size_t)5 << 20, 9);
    CHECK(same(q, (size_t)5 << 20, 9));
    ferry_arena_free(a, q, (size_t)5 << 20);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&tb.frees), atomic_load(&tb.allocs));
    CHECK_EQ(atomic_load(&tb.outstanding), 0);
  }
  return 0;
}

/* ---- through the engine, after a snapshot -------------------------------------- */
static int offload_all(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                       ferry_decision *out) {
  (void)ud, (void)d, (void)ctx;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  return 0;
}

static uint64_t pinned_now(ferry_engine *e) {
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_counts c;
  cuda_double_get_counts(&c);
  return c.pinned_bytes;
#else
  ferry_stats st;
  ferry_get_stats(e, &st, sizeof st);
  return st.arena_reserved;
#endif
}

/* Whether the file at path holds n bytes equal to want (a stored entry). */
static int file_holds(const char *path, const unsigned char *want, size_t n) {
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *all = malloc((size_t)size);
  int ok = all && fread(all, 1, (size_t)size, f) == (size_t)size &&
           memmem(all, (size_t)size, want, n) != NULL;
  free(all);
  fclose(f);
  return ok;
}

static int snapshot_one(ferry_engine *e, const char *path, void *dev, size_t bytes) {
  ferry_snapshot_record rec = {.name = "archive/data/0", .device_ptr = dev, .bytes = bytes};
  ferry_snapshot *s = NULL;
  int rc = ferry_snapshot_start(e, path, &rec, 1, NULL, &s);
  if (!rc) rc = ferry_snapshot_fence(s, NULL);
  if (!rc) rc = ferry_snapshot_wait(s);
  ferry_snapshot_free(s);
  return rc;
}

TEST(arena_trim_after_snapshot) {
  test_device_stats dev;
  memset(&dev, 0, sizeof dev);
  ferry_config c = test_engine_config(&dev);
  c.retain = test_device_retain_cb;
  c.decide = offload_all;
  c.min_offload_bytes = 1;
  ferry_engine *e = NULL;
  char err[512] = "";
  int rc = ferry_engine_create(&c, &e, err, sizeof err);
  if (rc) fprintf(stderr, "%s\n", err);
  CHECK_OK(rc);
  CHECK_RC(ferry_arena_trim(NULL, 0, NULL), FERRY_EINVAL);

  char dir[] = "/tmp/ferry-trim-XXXXXX", path[96];
  CHECK(mkdtemp(dir) != NULL);
  snprintf(path, sizeof path, "%s/ckpt.pt", dir);
  enum { STATE = 12 << 20, KEPT = 3 << 20 };
  unsigned char *want = malloc(STATE);
  CHECK(want);
  fill(want, STATE, 1);
  test_buffer *state = test_buffer_new(STATE);
  CHECK(state);
  test_dev_write(state->ptr, want, STATE);

  /* Memory in use across the trim: a resident buffer. */
  ferry_resident *r = NULL;
  CHECK_OK(ferry_resident_create(e, KEPT, &r));
  fill(ferry_resident_host_ptr(r), KEPT, 2);

  CHECK_OK(snapshot_one(e, path, state->ptr, STATE));
  CHECK(file_holds(path, want, STATE));
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  uint64_t before = st.arena_reserved, pinned_before = pinned_now(e);
  CHECK(before >= (uint64_t)STATE + KEPT);
  CHECK_EQ(st.arena_in_use, KEPT);

  /* A floor above the whole arena keeps it all. */
  uint64_t released = 1;
  CHECK_OK(ferry_arena_trim(e, before, &released));
  CHECK_EQ(released, 0);
  CHECK_OK(ferry_arena_trim(e, 0, &released));
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  printf("  %s backend, %s arena: reserved %llu -> %llu, pinned %llu -> %llu\n",
         ferry_backend_name(e), ferry_arena_name(e), (unsigned long long)before,
         (unsigned long long)st.arena_reserved, (unsigned long long)pinned_before,
         (unsigned long long)pinned_now(e));
  CHECK(released >= (uint64_t)STATE);
  CHECK_EQ(st.arena_reserved, before - released);
  CHECK(st.arena_reserved < (uint64_t)STATE);
  CHECK(pinned_now(e) <= pinned_before - STATE);
  CHECK_EQ(st.arena_in_use, KEPT);
  CHECK(same(ferry_resident_host_ptr(r), KEPT, 2)); /* in use: untouched */

  /* The next snapshot grows the arena again and writes the same bytes. */
  fill(want, STATE, 3);
  test_dev_write(state->ptr, want, STATE);
  CHECK_OK(snapshot_one(e, path, state->ptr, STATE));
  CHECK(file_holds(path, want, STATE));
  CHECK(same(ferry_resident_host_ptr(r), KEPT, 2));

  CHECK_OK(ferry_resident_destroy(r));
  CHECK_OK(ferry_arena_trim(e, 0, NULL));
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.arena_in_use, 0);
  CHECK_EQ(st.arena_reserved, 0);
  test_buffer_unref(state);
  free(want);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  unlink(path);
  rmdir(dir);
  return 0;
}
