/* test_resident.c — resident buffers through the public API: bit-identical
 * round trips, the arena cap, ordering after the compute stream and between
 * a buffer's own copies, engine teardown with copies in flight, misuse, and
 * the stats. Runs over whichever backend FERRY_TEST_BACKEND names. */
#include <pthread.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

static uint64_t rs_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void rs_fill(unsigned char *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rs_next(&seed);
    memcpy(p + i, &v, n - i < 8 ? n - i : 8);
  }
}

static ferry_engine *rs_open(uint64_t cap, double link_bytes_per_s) {
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.retain = test_device_retain_cb;
  static test_device_stats dev;
  c.callback_ud = &dev;
  if (cap) c.host_cap_bytes = cap;
  if (link_bytes_per_s > 0) {
    c.link.d2h_bytes_per_s = link_bytes_per_s;
    c.link.h2d_bytes_per_s = link_bytes_per_s;
  }
  ferry_engine *e = NULL;
  char err[512] = "";
  if (ferry_engine_create(&c, &e, err, sizeof err)) {
    fprintf(stderr, "engine create failed: %s\n", err);
    return NULL;
  }
  return e;
}

/* Many round trips of odd sizes: device -> host -> (host scribbled, then
 * restored from a copy) -> device, bit for bit; the stats count each copy. */
TEST(resident_round_trip_bit_identical) {
  ferry_engine *e = rs_open(0, 0);
  CHECK(e);
  enum { N = 5, ROUNDS = 40 };
  const size_t sizes[N] = {1, 7, 4096, 65537, (1u << 20) + 3};
  ferry_resident *r[N];
  void *dev[N];
  unsigned char *want[N], *got[N];
  uint64_t total = 0;
  for (int i = 0; i < N; i++) {
    CHECK_OK(ferry_resident_create(e, sizes[i], &r[i]));
    CHECK_EQ(ferry_resident_bytes(r[i]), sizes[i]);
    CHECK(ferry_resident_host_ptr(r[i]) != NULL);
    dev[i] = test_dev_malloc(sizes[i]);
    want[i] = malloc(sizes[i]);
    got[i] = malloc(sizes[i]);
    CHECK(dev[i] && want[i] && got[i]);
    total += sizes[i];
  }
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.resident_buffers, N);
  CHECK_EQ(st.resident_bytes, total);
  for (int round = 0; round < ROUNDS; round++) {
    for (int i = 0; i < N; i++) {
      rs_fill(want[i], sizes[i], (uint64_t)(round * 131 + i));
      test_dev_write(dev[i], want[i], sizes[i]);
      CHECK_OK(ferry_resident_to_host(r[i], dev[i], NULL));
    }
    for (int i = 0; i < N; i++) {
      CHECK_OK(ferry_resident_wait(r[i]));
      CHECK(memcmp(ferry_resident_host_ptr(r[i]), want[i], sizes[i]) == 0);
      memset(got[i], 0xA5, sizes[i]);
      test_dev_write(dev[i], got[i], sizes[i]); /* the device copy is gone */
      CHECK_OK(ferry_resident_to_device(r[i], dev[i], NULL));
    }
    for (int i = 0; i < N; i++) {
      CHECK_OK(ferry_resident_wait(r[i]));
      test_dev_read(got[i], dev[i], sizes[i]);
      CHECK(memcmp(got[i], want[i], sizes[i]) == 0);
    }
  }
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.resident_to_host, N * ROUNDS);
  CHECK_EQ(st.resident_to_device, N * ROUNDS);
  CHECK_EQ(st.resident_bytes_d2h, total * ROUNDS);
  CHECK_EQ(st.resident_bytes_h2d, total * ROUNDS);
  CHECK(st.arena_in_use >= total);
  for (int i = 0; i < N; i++) {
    CHECK_OK(ferry_resident_destroy(r[i]));
    test_dev_free(dev[i]);
    free(want[i]);
    free(got[i]);
  }
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.resident_buffers, 0);
  CHECK_EQ(st.resident_bytes, 0);
  CHECK_EQ(st.arena_in_use, 0);
  ferry_engine_destroy(e);
  return 0;
}

/* The cap is the arena's: a buffer that does not fit is refused with
 * FERRY_ECAP and a message; freeing one makes room again. */
TEST(resident_cap_refusal) {
  const uint64_t cap = 4u << 20;
  ferry_engine *e = rs_open(cap, 0);
  CHECK(e);
  ferry_resident *a = NULL, *b = NULL;
  CHECK_OK(ferry_resident_create(e, 3u << 20, &a));
  CHECK_RC(ferry_resident_create(e, 3u << 20, &b), FERRY_ECAP);
  CHECK(b == NULL);
  CHECK_STR_CONTAINS(ferry_last_error(e), "ferry_resident_create");
  CHECK_STR_CONTAINS(ferry_last_error(e), "cap 4194304");
  CHECK_RC(ferry_resident_create(e, 64u << 20, &b), FERRY_ECAP);
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK(st.arena_reserved <= cap);
  CHECK_EQ(st.resident_buffers, 1);
  CHECK_OK(ferry_resident_destroy(a));
  CHECK_OK(ferry_resident_create(e, 3u << 20, &b));
  CHECK_OK(ferry_resident_destroy(b));
  ferry_engine_destroy(e);
  return 0;
}

/* Ordering over a slow link (each 8 MiB copy holds its stream ~40 ms; the
 * host backend copies first, then waits out the modeled time). A buffer's
 * copies run in the order issued even across the two engine streams: with
 * the D2H stream busy, a to_device issued right after a to_host copies the
 * new host bytes, not stale ones; with the H2D stream busy, a to_host issued
 * right after a to_device does not overwrite the host bytes before the H2D
 * has read them. A to_host right after a write (NULL compute stream: the
 * calling thread) sees the written bytes, and work on the compute stream
 * after a to_device sees the copied bytes. */
TEST(resident_copies_are_ordered) {
  const size_t n = 8u << 20;
  ferry_engine *e = rs_open(0, 200e6);
  CHECK(e);
  ferry_resident *r = NULL, *busy = NULL;
  CHECK_OK(ferry_resident_create(e, n, &r));
  CHECK_OK(ferry_resident_create(e, n, &busy));
  unsigned char *a = malloc(n), *b = malloc(n), *got = malloc(n);
  void *d1 = test_dev_malloc(n), *d2 = test_dev_malloc(n), *d3 = test_dev_malloc(n),
       *dx = test_dev_malloc(n);
  CHECK(a && b && got && d1 && d2 && d3 && dx);
  rs_fill(a, n, 1);
  rs_fill(b, n, 2);
  test_dev_write(d1, a, n);
  test_dev_write(d3, b, n);
  memset(got, 0, n);
  test_dev_write(d2, got, n);
  test_dev_write(dx, got, n);

  CHECK_OK(ferry_resident_to_host(busy, dx, NULL)); /* D2H stream busy */
  CHECK_OK(ferry_resident_to_host(r, d1, NULL));    /* host := a, queued */
  CHECK_OK(ferry_resident_to_device(r, d2, NULL));  /* d2 := host, after it */
  /* No wait: the compute stream (here the calling thread) is ordered after
   * the H2D, so the bytes are there when to_device returns. */
  test_dev_read(got, d2, n);
  CHECK(memcmp(got, a, n) == 0);

  memset(got, 0, n);
  test_dev_write(d2, got, n);
  CHECK_OK(ferry_resident_wait(busy));
  CHECK_OK(ferry_resident_to_device(busy, dx, NULL)); /* H2D stream busy */
  CHECK_OK(ferry_resident_to_device(r, d2, NULL));    /* d2 := host (a), queued */
  CHECK_OK(ferry_resident_to_host(r, d3, NULL));      /* host := b, after it */
  CHECK_OK(ferry_resident_wait(r));
  test_dev_read(got, d2, n);
  CHECK(memcmp(got, a, n) == 0);
  CHECK(memcmp(ferry_resident_host_ptr(r), b, n) == 0);

  CHECK_OK(ferry_resident_destroy(r));
  CHECK_OK(ferry_resident_destroy(busy));
  test_dev_free(d1);
  test_dev_free(d2);
  test_dev_free(d3);
  test_dev_free(dx);
  free(a);
  free(b);
  free(got);
  ferry_engine_destroy(e);
  return 0;
}

/* to_host waits for the work already queued on the caller's stream (the
 * write that produces the bytes, behind a slow one); a copy that does not
 * wait reads the zeros that were there. */
TEST(resident_to_host_waits_for_the_callers_stream) {
  const size_t n = 1u << 20, busy_bytes = 4u << 20;
  ferry_engine *e = rs_open(0, 200e6);
  CHECK(e);
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(20000);
#endif
  ferry_backend *bk = ferry_engine_backend(e);
  bk_stream compute = NULL;
  CHECK_OK(bk->ops->stream_create(bk, &compute));
  ferry_resident *r = NULL;
  CHECK_OK(ferry_resident_create(e, n, &r));
  void *want = NULL, *busy = NULL;
  CHECK_OK(bk->ops->host_alloc(bk, n, 4096, &want));
  CHECK_OK(bk->ops->host_alloc(bk, busy_bytes, 4096, &busy));
  rs_fill(want, n, 9);
  void *dev = test_dev_malloc(n), *scratch = test_dev_malloc(busy_bytes);
  unsigned char *zero = calloc(1, n);
  test_dev_write(dev, zero, n);
  CHECK_OK(bk->ops->copy_h2d(bk, scratch, busy, busy_bytes, compute)); /* ~20 ms */
  CHECK_OK(bk->ops->copy_h2d(bk, dev, want, n, compute));              /* the "kernel" */
  CHECK_OK(ferry_resident_to_host(r, dev, compute));
  CHECK_OK(ferry_resident_wait(r));
  CHECK(memcmp(ferry_resident_host_ptr(r), want, n) == 0);
  CHECK_OK(bk->ops->stream_synchronize(bk, compute));
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(0);
#endif
  CHECK_OK(ferry_resident_destroy(r));
  CHECK_OK(bk->ops->host_free(bk, want, n));
  CHECK_OK(bk->ops->host_free(bk, busy, busy_bytes));
  CHECK_OK(bk->ops->stream_destroy(bk, compute));
  test_dev_free(dev);
  test_dev_free(scratch);
  free(zero);
  ferry_engine_destroy(e);
  return 0;
}

/* Engine teardown with copies in flight waits for them and detaches the
 * handles: they answer FERRY_ESTATE and are still destroyed cleanly; the
 * device buffers are untouched afterwards. Destroy with a copy in flight
 * waits for it. */
TEST(resident_destroy_with_copies_in_flight) {
  const size_t n = 4u << 20;
  ferry_engine *e = rs_open(0, 200e6);
  CHECK(e);
  ferry_resident *r[3];
  void *dev = test_dev_malloc(n);
  unsigned char *want = malloc(n), *got = malloc(n);
  CHECK(dev && want && got);
  rs_fill(want, n, 9);
  test_dev_write(dev, want, n);
  for (int i = 0; i < 3; i++) {
    CHECK_OK(ferry_resident_create(e, n, &r[i]));
    CHECK_OK(ferry_resident_to_host(r[i], dev, NULL));
  }
  CHECK_OK(ferry_resident_destroy(r[0])); /* waits for its copy */
  ferry_engine_destroy(e);               /* waits for the other two */
  CHECK(ferry_resident_host_ptr(r[1]) == NULL);
  CHECK_EQ(ferry_resident_bytes(r[1]), 0);
  CHECK_RC(ferry_resident_to_host(r[1], dev, NULL), FERRY_ESTATE);
  CHECK_RC(ferry_resident_to_device(r[1], dev, NULL), FERRY_ESTATE);
  CHECK_RC(ferry_resident_wait(r[1]), FERRY_ESTATE);
  CHECK_OK(ferry_resident_destroy(r[1]));
  CHECK_OK(ferry_resident_destroy(r[2]));
  test_dev_read(got, dev, n);
  CHECK(memcmp(got, want, n) == 0);
  test_dev_free(dev);
  free(want);
  free(got);
  return 0;
}

/* Misuse: NULL arguments, zero bytes, double destroy, calls on a destroyed
 * handle. */
TEST(resident_rejects_misuse) {
  ferry_engine *e = rs_open(0, 0);
  CHECK(e);
  ferry_resident *r = NULL;
  CHECK_RC(ferry_resident_create(NULL, 16, &r), FERRY_EINVAL);
  CHECK_RC(ferry_resident_create(e, 16, NULL), FERRY_EINVAL);
  CHECK_STR_CONTAINS(ferry_last_error(e), "out is NULL");
  CHECK_RC(ferry_resident_create(e, 0, &r), FERRY_EINVAL);
  CHECK_STR_CONTAINS(ferry_last_error(e), "bytes is 0");
  CHECK(r == NULL);
  CHECK_RC(ferry_resident_to_host(NULL, r, NULL), FERRY_EHANDLE);
  CHECK_RC(ferry_resident_wait(NULL), FERRY_EHANDLE);
  CHECK_RC(ferry_resident_destroy(NULL), FERRY_EHANDLE);
  CHECK(ferry_resident_host_ptr(NULL) == NULL);
  CHECK_OK(ferry_resident_create(e, 16, &r));
  CHECK_RC(ferry_resident_to_host(r, NULL, NULL), FERRY_EINVAL);
  CHECK_STR_CONTAINS(ferry_last_error(e), "device_ptr is NULL");
  CHECK_RC(ferry_resident_to_device(r, NULL, NULL), FERRY_EINVAL);
  CHECK_OK(ferry_resident_wait(r)); /* never copied: nothing to wait for */
  CHECK_OK(ferry_resident_destroy(r));
  CHECK_RC(ferry_resident_destroy(r), FERRY_EHANDLE); /* double destroy */
  CHECK_RC(ferry_resident_wait(r), FERRY_EHANDLE);
  CHECK(ferry_resident_host_ptr(r) == NULL);
  ferry_engine_destroy(e);
  return 0;
}

/* Threads each round-trip their own buffers on one engine while another
 * creates and destroys buffers: every round trip is bit-identical and the
 * stats add up. */
typedef struct rs_worker {
  ferry_engine *e;
  uint64_t seed;
  int failed;
} rs_worker;

static void *rs_worker_main(void *arg) {
  rs_worker *w = arg;
  const size_t n = 65536 + (size_t)(w->seed % 977);
  ferry_resident *r = NULL;
  void *dev = test_dev_malloc(n);
  unsigned char *want = malloc(n), *got = malloc(n);
  if (!dev || !want || !got || ferry_resident_create(w->e, n, &r)) {
    w->failed = 1;
  } else {
    for (int i = 0; i < 50 && !w->failed; i++) {
      rs_fill(want, n, w->seed * 1000 + (uint64_t)i);
      test_dev_write(dev, want, n);
      if (ferry_resident_to_host(r, dev, NULL) || ferry_resident_wait(r) ||
          memcmp(ferry_resident_host_ptr(r), want, n) != 0)
        w->failed = 2;
      memset(got, 0, n);
      test_dev_write(dev, got, n);
      if (ferry_resident_to_device(r, dev, NULL) || ferry_resident_wait(r)) w->failed = 3;
      test_dev_read(got, dev, n);
      if (memcmp(got, want, n) != 0) w->failed = 4;
    }
  }
  if (r && ferry_resident_destroy(r)) w->failed = 5;
  test_dev_free(dev);
  free(want);
  free(got);
  return NULL;
}

TEST(resident_threads_share_an_engine) {
  ferry_engine *e = rs_open(0, 0);
  CHECK(e);
  enum { T = 4 };
  pthread_t th[T];
  rs_worker w[T];
  for (int i = 0; i < T; i++) {
    w[i] = (rs_worker){e, (uint64_t)i + 1, 0};
    CHECK(pthread_create(&th[i], NULL, rs_worker_main, &w[i]) == 0);
  }
  for (int i = 0; i < 200; i++) { /* churn */
    ferry_resident *r = NULL;
    CHECK_OK(ferry_resident_create(e, 4096, &r));
    CHECK_OK(ferry_resident_destroy(r));
  }
  for (int i = 0; i < T; i++) {
    pthread_join(th[i], NULL);
    CHECK_EQ(w[i].failed, 0);
  }
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.resident_buffers, 0);
  CHECK_EQ(st.resident_bytes, 0);
  CHECK_EQ(st.resident_to_host, T * 50);
  CHECK_EQ(st.resident_to_device, T * 50);
  ferry_engine_destroy(e);
  return 0;
}
