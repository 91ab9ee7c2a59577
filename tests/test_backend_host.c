/* test_backend_host.c — the host backend through its vtable: stream order,
 * events (re-record, never recorded, NULL stream), cross-stream waits, the
 * link model, host_alloc, errors, and concurrent use (run under TSan).
 *
 * Timing: the link model guarantees lower bounds only, so tests assert
 * lower bounds. Where a test needs an event to be still pending, it accepts
 * "complete" only if the modeled copy time has already passed, so a slow or
 * descheduled test thread cannot make it fail. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "ferry_tools.h"
#include "test.h"

static double mono_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static ferry_backend *make_backend(double d2h_bps, double h2d_bps,
                                   double latency_us, double duplex) {
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.link.d2h_bytes_per_s = d2h_bps;
  cfg.link.h2d_bytes_per_s = h2d_bps;
  cfg.link.latency_us = latency_us;
  cfg.link.duplex = duplex;
  ferry_backend *b = NULL;
  char err[256] = "";
  int rc = ferry_backend_host_create(&cfg, &b, err, sizeof err);
  if (rc != FERRY_OK) {
    fprintf(stderr, "ferry_backend_host_create: %s\n", err);
    return NULL;
  }
  return b;
}

static void fill_pattern(uint8_t *p, size_t n, uint32_t seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; i++) {
    x = x * 1664525u + 1013904223u;
    p[i] = (uint8_t)(x >> 24);
  }
}

/* A chain of dependent copies on one stream: copy i reads what copy i-1
 * wrote, so any reordering leaves wrong bytes. 3000 operations also overflow
 * the stream's ring, so the producer has to wait for free slots. */
static int enqueue_chain(ferry_backend *b, uint8_t *buf[2], const uint8_t *src,
                         size_t chunk, int stages, bk_stream s) {
  const ferry_backend_ops *o = b->ops;
  memset(buf[0], 0, chunk);
  memset(buf[1], 0, chunk);
  int rc = o->copy_d2h(b, buf[0], src, chunk, s);
  /* Ping-pong, each copy shifted by one byte so a stale read shows. */
  for (int i = 1; i < stages && rc == 0; i++) {
    uint8_t *from = buf[(i - 1) & 1], *to = buf[i & 1];
    rc = o->copy_h2d(b, to + 1, from, chunk - 1, s);
    if (rc == 0) rc = o->copy_d2h(b, to, from + chunk - 1, 1, s);
  }
  return rc;
}

/* Bytes of the chain's result that differ from what `stages` in-order
 * stages give: each stage rotates the buffer right by one byte. */
static int chain_mismatches(uint8_t *buf[2], const uint8_t *src, size_t chunk, int stages) {
  const uint8_t *last = buf[(stages - 1) & 1];
  int mismatches = 0;
  for (size_t i = 0; i < chunk; i++) {
    size_t from = (i + chunk - ((size_t)(stages - 1) % chunk)) % chunk;
    mismatches += last[i] != src[from];
  }
  return mismatches;
}

TEST(host_stream_runs_copies_in_order) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  enum { CHUNK = 4096, STAGES = 3000 };
  uint8_t *buf[2];
  CHECK_OK(o->host_alloc(b, CHUNK, 0, (void **)&buf[0]));
  CHECK_OK(o->host_alloc(b, CHUNK, 0, (void **)&buf[1]));
  uint8_t *src = malloc(CHUNK);
  CHECK(src);
  fill_pattern(src, CHUNK, 7);
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(enqueue_chain(b, buf, src, CHUNK, STAGES, s));
  bk_event *ev;
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_EQ(chain_mismatches(buf, src, CHUNK, STAGES), 0);
  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_OK(o->host_free(b, buf[0], CHUNK));
  CHECK_OK(o->host_free(b, buf[1], CHUNK));
  free(src);
  o->destroy(b);
  return 0;
}

TEST(host_event_never_recorded_is_complete) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  bk_event *ev;
  CHECK_OK(b->ops->event_create(b, &ev));
  CHECK_EQ(b->ops->event_query(b, ev), 1);
  CHECK_OK(b->ops->event_synchronize(b, ev));
  /* A stream waiting on it, and the NULL stream, go on at once. */
  bk_stream s;
  CHECK_OK(b->ops->stream_create(b, &s));
  CHECK_OK(b->ops->stream_wait_event(b, s, ev));
  CHECK_OK(b->ops->stream_wait_event(b, NULL, ev));
  /* Destroyed by destroy(): the backend frees leftovers (ASan checks). */
  b->ops->destroy(b);
  return 0;
}

/* A record covers the work enqueued before it, not after; a re-record
 * replaces the target; a record on the NULL stream is complete at once. */
TEST(host_event_rerecord) {
  const double bps = 20e6; /* 2 MB takes >= 100 ms */
  enum { N = 2000000 };
  const double copy_s = N / bps;
  ferry_backend *b = make_backend(bps, bps, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *dev = calloc(1, N), *host;
  CHECK(dev);
  CHECK_OK(o->host_alloc(b, N, 0, (void **)&host));
  bk_stream s, idle;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(o->stream_create(b, &idle));
  bk_event *ev, *before;
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->event_create(b, &before));

  CHECK_OK(o->event_record(b, before, s)); /* nothing enqueued yet */
  double t0 = mono_s();
  CHECK_OK(o->copy_d2h(b, host, dev, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_EQ(o->event_query(b, before), 1); /* the later copy is not in it */
  int q = o->event_query(b, ev);
  CHECK(q == 0 || mono_s() - t0 >= copy_s);
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK(mono_s() - t0 >= copy_s);
  CHECK_EQ(o->event_query(b, ev), 1);

  /* Re-arm on the same stream behind a new copy. */
  t0 = mono_s();
  CHECK_OK(o->copy_h2d(b, dev, host, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  q = o->event_query(b, ev);
  CHECK(q == 0 || mono_s() - t0 >= copy_s);
  /* Re-record on the NULL stream: the calling thread's work is done. */
  CHECK_OK(o->event_record(b, ev, NULL));
  CHECK_EQ(o->event_query(b, ev), 1);
  /* Re-record on an idle stream: complete, even with s still copying. */
  CHECK_OK(o->event_record(b, ev, idle));
  CHECK_EQ(o->event_query(b, ev), 1);
  /* And back onto s, behind the copy still running or already done. */
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK(mono_s() - t0 >= copy_s);

  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->event_destroy(b, before));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_OK(o->stream_destroy(b, idle));
  CHECK_OK(o->host_free(b, host, N));
  free(dev);
  o->destroy(b);
  return 0;
}

/* Stream B's copy reads what stream A's copy wrote, ordered only by
 * stream_wait_event. A's copy sits behind a slow one, so without the wait
 * B would read the zeros. */
TEST(host_stream_wait_event_orders_streams) {
  const double bps = 20e6;
  enum { SLOW = 2000000, N = 65536 }; /* the slow copy takes >= 100 ms */
  ferry_backend *b = make_backend(bps, 0, 0, 1); /* only D2H throttled */
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *slow_src = calloc(1, SLOW), *slow_dst = malloc(SLOW);
  uint8_t *x = malloc(N), *y = calloc(1, N), *z = calloc(1, N);
  CHECK(slow_src && slow_dst && x && y && z);
  fill_pattern(x, N, 3);
  bk_stream a, sb;
  CHECK_OK(o->stream_create(b, &a));
  CHECK_OK(o->stream_create(b, &sb));
  bk_event *a_done, *b_done;
  CHECK_OK(o->event_create(b, &a_done));
  CHECK_OK(o->event_create(b, &b_done));

  CHECK_OK(o->copy_d2h(b, slow_dst, slow_src, SLOW, a));
  CHECK_OK(o->copy_d2h(b, y, x, N, a));
  CHECK_OK(o->event_record(b, a_done, a));
  CHECK_OK(o->stream_wait_event(b, sb, a_done));
  /* Re-recording a_done now must not change what sb already waits for. */
  CHECK_OK(o->event_record(b, a_done, NULL));
  CHECK_OK(o->copy_h2d(b, z, y, N, sb));
  CHECK_OK(o->event_record(b, b_done, sb));
  CHECK_OK(o->event_synchronize(b, b_done));
  CHECK_EQ(memcmp(z, x, N), 0);
  CHECK_EQ(memcmp(y, x, N), 0);

  CHECK_OK(o->event_destroy(b, a_done));
  CHECK_OK(o->event_destroy(b, b_done));
  CHECK_OK(o->stream_destroy(b, a));
  CHECK_OK(o->stream_destroy(b, sb));
  free(slow_src), free(slow_dst), free(x), free(y), free(z);
  o->destroy(b);
  return 0;
}

/* On the NULL (external) stream, stream_wait_event blocks the caller. */
TEST(host_null_stream_wait_blocks) {
  const double bps = 20e6;
  enum { N = 2000000 };
  ferry_backend *b = make_backend(bps, bps, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *src = malloc(N), *dst = calloc(1, N);
  CHECK(src && dst);
  fill_pattern(src, N, 11);
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  bk_event *ev;
  CHECK_OK(o->event_create(b, &ev));
  double t0 = mono_s();
  CHECK_OK(o->copy_h2d(b, dst, src, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->stream_wait_event(b, NULL, ev));
  CHECK(mono_s() - t0 >= N / bps);
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_EQ(memcmp(src, dst, N), 0);
  /* A pointer that is not one of the backend's streams is external too. */
  int compute_stream_token;
  t0 = mono_s();
  CHECK_OK(o->copy_h2d(b, dst, src, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->stream_wait_event(b, &compute_stream_token, ev));
  CHECK(mono_s() - t0 >= N / bps);
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_OK(o->event_record(b, ev, &compute_stream_token));
  CHECK_EQ(o->event_query(b, ev), 1);
  o->destroy(b); /* stream and event freed by destroy */
  free(src), free(dst);
  return 0;
}

/* A copy of N bytes takes at least latency + N / bandwidth, per direction. */
TEST(host_link_model_lower_bound) {
  const double d2h = 40e6, h2d = 25e6, lat_us = 5000;
  enum { N = 2000000 };
  ferry_backend *b = make_backend(d2h, h2d, lat_us, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *src = malloc(N), *dst = malloc(N);
  CHECK(src && dst);
  fill_pattern(src, N, 5);
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  bk_event *ev;
  CHECK_OK(o->event_create(b, &ev));

  double t0 = mono_s();
  CHECK_OK(o->copy_d2h(b, dst, src, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK(mono_s() - t0 >= lat_us * 1e-6 + N / d2h);
  CHECK_EQ(memcmp(src, dst, N), 0);

  t0 = mono_s();
  CHECK_OK(o->copy_h2d(b, dst, src, N, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK(mono_s() - t0 >= lat_us * 1e-6 + N / h2d);

  /* Two copies in one direction share it: in sequence on one stream, or
   * side by side on two, the pair takes at least 2 N / bandwidth. */
  bk_stream s2;
  CHECK_OK(o->stream_create(b, &s2));
  bk_event *ev2;
  CHECK_OK(o->event_create(b, &ev2));
  uint8_t *dst2 = malloc(N);
  CHECK(dst2);
  t0 = mono_s();
  CHECK_OK(o->copy_d2h(b, dst, src, N, s));
  CHECK_OK(o->copy_d2h(b, dst2, src, N, s2));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_record(b, ev2, s2));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK_OK(o->event_synchronize(b, ev2));
  CHECK(mono_s() - t0 >= 2.0 * N / d2h);
  CHECK_EQ(memcmp(src, dst2, N), 0);

  o->destroy(b);
  free(src), free(dst), free(dst2);
  return 0;
}

/* With duplex 0.5 the two directions together move no faster than one
 * direction alone: however the copies overlap, a D2H copy of T_d seconds
 * and an H2D copy of T_h seconds take at least T_d + T_h. (With full
 * duplex they could finish in max(T_d, T_h).) */
TEST(host_link_duplex_slows_both_directions) {
  const double bps = 40e6;
  enum { ND = 2400000, NH = 4000000 }; /* 60 ms and 100 ms alone */
  ferry_backend *b = make_backend(bps, bps, 0, 0.5);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *dev = calloc(1, NH), *host = calloc(1, NH);
  uint8_t *dev2 = calloc(1, NH), *host2 = calloc(1, NH);
  CHECK(dev && host && dev2 && host2);
  fill_pattern(dev, ND, 1);
  fill_pattern(host2, NH, 2);
  bk_stream d2h, h2d;
  CHECK_OK(o->stream_create(b, &d2h));
  CHECK_OK(o->stream_create(b, &h2d));
  bk_event *ed, *eh;
  CHECK_OK(o->event_create(b, &ed));
  CHECK_OK(o->event_create(b, &eh));
  double t0 = mono_s();
  CHECK_OK(o->copy_h2d(b, dev2, host2, NH, h2d));
  CHECK_OK(o->copy_d2h(b, host, dev, ND, d2h));
  CHECK_OK(o->event_record(b, eh, h2d));
  CHECK_OK(o->event_record(b, ed, d2h));
  CHECK_OK(o->event_synchronize(b, ed));
  CHECK_OK(o->event_synchronize(b, eh));
  double elapsed = mono_s() - t0;
  CHECK(elapsed >= (double)ND / bps + (double)NH / bps);
  CHECK_EQ(memcmp(host, dev, ND), 0);
  CHECK_EQ(memcmp(dev2, host2, NH), 0);
  o->destroy(b);
  free(dev), free(host), free(dev2), free(host2);
  return 0;
}

TEST(host_alloc_alignment) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  const size_t aligns[] = {0, 64, 4096, 65536, (size_t)1 << 20, (size_t)2 << 20};
  const size_t sizes[] = {1, 4096, 100000, (size_t)3 << 20};
  for (size_t i = 0; i < sizeof aligns / sizeof aligns[0]; i++) {
    for (size_t j = 0; j < sizeof sizes / sizeof sizes[0]; j++) {
      void *p = NULL;
      CHECK_OK(o->host_alloc(b, sizes[j], aligns[i], &p));
      CHECK(p != NULL);
      size_t want = aligns[i] > 4096 ? aligns[i] : 4096;
      CHECK_EQ((uintptr_t)p % want, 0);
      memset(p, 0xA5, sizes[j]); /* every byte is writable */
      CHECK_EQ(((uint8_t *)p)[sizes[j] - 1], 0xA5);
      CHECK_OK(o->host_free(b, p, sizes[j]));
    }
  }
  void *p = (void *)1;
  CHECK_RC(o->host_alloc(b, 4096, 3000, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "power of two");
  CHECK(p == NULL);
  CHECK_RC(o->host_alloc(b, 4096, (size_t)4 << 20, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "2 MiB");
  CHECK_RC(o->host_alloc(b, 0, 0, &p), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "size is 0");
  CHECK_RC(o->host_alloc(b, 4096, 0, NULL), FERRY_EINVAL);
  CHECK_RC(o->host_free(b, NULL, 4096), FERRY_EINVAL);
  o->destroy(b);
  return 0;
}

TEST(host_backend_rejects_bad_arguments) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  char buf[16];
  int not_a_stream;
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_RC(o->copy_d2h(b, buf, buf + 8, 8, NULL), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "NULL stream");
  CHECK_RC(o->copy_h2d(b, buf, buf + 8, 8, &not_a_stream), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "not a stream of this host backend");
  CHECK_RC(o->copy_d2h(b, NULL, buf, 8, s), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "destination pointer is NULL");
  CHECK_RC(o->copy_h2d(b, buf, NULL, 8, s), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "source pointer is NULL");
  /* An empty copy is valid, with any pointers (as in CUDA). */
  CHECK_OK(o->copy_d2h(b, NULL, NULL, 0, s));
  CHECK_RC(o->event_record(b, NULL, s), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "event is NULL");
  CHECK_RC(o->event_query(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_synchronize(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->stream_wait_event(b, s, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_destroy(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->event_create(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->stream_create(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->stream_destroy(b, NULL), FERRY_EINVAL);
  CHECK_RC(o->stream_destroy(b, &not_a_stream), FERRY_EINVAL);

  /* A destroyed stream is named as such; events recorded on it before
   * stay valid and complete. */
  bk_event *ev;
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->copy_d2h(b, buf, buf + 8, 8, s));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_EQ(o->event_query(b, ev), 1);
  CHECK_RC(o->copy_d2h(b, buf, buf + 8, 8, s), FERRY_EINVAL);
  CHECK_STR_CONTAINS(b->err, "was destroyed");
  CHECK_RC(o->event_record(b, ev, s), FERRY_EINVAL);
  CHECK_RC(o->stream_destroy(b, s), FERRY_EINVAL);
  CHECK_OK(o->event_destroy(b, ev));
  o->destroy(b);

  /* Bad link models are refused at creation, naming the field. */
  ferry_config cfg = FERRY_CONFIG_INIT;
  char err[256];
  ferry_backend *bad = NULL;
  cfg.link.d2h_bytes_per_s = -1;
  CHECK_RC(ferry_backend_host_create(&cfg, &bad, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "link.d2h_bytes_per_s");
  CHECK(bad == NULL);
  cfg.link.d2h_bytes_per_s = 1e9;
  cfg.link.duplex = 0;
  CHECK_RC(ferry_backend_host_create(&cfg, &bad, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "link.duplex");
  CHECK_RC(ferry_backend_host_create(NULL, &bad, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "config is NULL");
  return 0;
}

/* stream_destroy runs everything already enqueued before it returns. */
TEST(host_stream_destroy_drains) {
  const double bps = 50e6;
  enum { N = 1000000, COPIES = 4 }; /* >= 80 ms in all */
  ferry_backend *b = make_backend(bps, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *src = malloc(N), *dst = calloc(COPIES, N);
  CHECK(src && dst);
  fill_pattern(src, N, 9);
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  double t0 = mono_s();
  for (int i = 0; i < COPIES; i++)
    CHECK_OK(o->copy_d2h(b, dst + (size_t)i * N, src, N, s));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK(mono_s() - t0 >= COPIES * (double)N / bps);
  for (int i = 0; i < COPIES; i++)
    CHECK_EQ(memcmp(dst + (size_t)i * N, src, N), 0);
  o->destroy(b);
  free(src), free(dst);
  return 0;
}

/* A thread that synchronizes runs the copies no thread has started yet
 * itself. With the process held on one CPU, the stream's worker runs only
 * when the caller yields or is preempted, so the caller, which claims the
 * copy as soon as it synchronizes, runs most of them; without the help it
 * runs none, as after ferry_backend_thread_runs_waited_copies(0). The copy
 * listener tells which thread ran each copy. */
typedef struct {
  pthread_t caller;
  atomic_int on_caller, on_other;
} who_ran;

static void note_who_ran(void *ud, int dir, double t0, double t1, uint64_t bytes,
                         const void *dev, const void *host) {
  (void)dir, (void)t0, (void)t1, (void)bytes, (void)dev, (void)host;
  who_ran *w = ud;
  atomic_fetch_add(pthread_equal(pthread_self(), w->caller) ? &w->on_caller : &w->on_other, 1);
}

TEST(host_synchronize_runs_unstarted_copies) {
  enum { N = 64 << 10, COPIES = 200 };
  cpu_set_t old, one;
  CHECK_EQ(sched_getaffinity(0, sizeof old, &old), 0);
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  /* The worker inherits the mask it is created with. */
  CHECK_EQ(sched_setaffinity(0, sizeof one, &one), 0);
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  who_ran w = {.caller = pthread_self()};
  CHECK_OK(o->set_copy_listener(b, note_who_ran, &w));
  uint8_t *src = malloc(N), *dst;
  CHECK(src);
  CHECK_OK(o->host_alloc(b, N, 0, (void **)&dst));
  bk_stream s;
  bk_event *ev;
  CHECK_OK(o->stream_create(b, &s));
  CHECK_OK(o->event_create(b, &ev));
  int wrong = 0, on_caller_opted_out = -1;
  for (int i = 0; i < 2 * COPIES; i++) {
    /* the first COPIES with the help turned off for this thread */
    if (i == 0) ferry_backend_thread_runs_waited_copies(0);
    if (i == COPIES) {
      ferry_backend_thread_runs_waited_copies(1);
      on_caller_opted_out = atomic_load(&w.on_caller);
    }
    fill_pattern(src, N, (uint32_t)i);
    CHECK_OK(o->copy_d2h(b, dst, src, N, s));
    CHECK_OK(o->event_record(b, ev, s));
    CHECK_OK(o->event_synchronize(b, ev));
    wrong += memcmp(dst, src, N) != 0;
  }
  CHECK_OK(o->stream_synchronize(b, s));
  CHECK_OK(o->stream_destroy(b, s));
  CHECK_EQ(sched_setaffinity(0, sizeof old, &old), 0);
  int helped = atomic_load(&w.on_caller) - on_caller_opted_out;
  printf("copies run by the synchronizing thread: %d of %d, %d of %d opted out\n", helped,
         COPIES, on_caller_opted_out, COPIES);
  CHECK_EQ(wrong, 0);
  CHECK_EQ(atomic_load(&w.on_caller) + atomic_load(&w.on_other), 2 * COPIES);
  CHECK_EQ(on_caller_opted_out, 0);
  CHECK(helped >= 1);
  CHECK_OK(o->event_destroy(b, ev));
  CHECK_OK(o->host_free(b, dst, N));
  free(src);
  o->destroy(b);
  return 0;
}

/* Synchronizing threads that run queued copies themselves (above) and the
 * stream's worker must still run one operation at a time, in order. The
 * stream is held behind a wait on a slow copy of another stream while a
 * chain of dependent copies is queued; then four threads synchronize on it
 * at once, so when the gate opens five threads compete for each copy. */
typedef struct {
  ferry_backend *b;
  bk_event *ev;
  int rc;
} sync_arg;

static void *sync_on(void *p) {
  sync_arg *a = p;
  a->rc = a->b->ops->event_synchronize(a->b, a->ev);
  return NULL;
}

TEST(host_stream_order_holds_while_waiters_help) {
  const double bps = 20e6; /* D2H only: the 1-byte chain copies cost ~50 ns */
  enum { GATE = 1000000, CHUNK = 65536, STAGES = 500, HELPERS = 4, ROUNDS = 5 };
  ferry_backend *b = make_backend(bps, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  uint8_t *gate_src = calloc(1, GATE), *gate_dst = malloc(GATE), *src = malloc(CHUNK);
  uint8_t *buf[2] = {malloc(CHUNK), malloc(CHUNK)};
  CHECK(gate_src && gate_dst && src && buf[0] && buf[1]);
  bk_stream gate, s;
  CHECK_OK(o->stream_create(b, &gate));
  CHECK_OK(o->stream_create(b, &s));
  bk_event *opened, *done;
  CHECK_OK(o->event_create(b, &opened));
  CHECK_OK(o->event_create(b, &done));
  for (int r = 0; r < ROUNDS; r++) {
    fill_pattern(src, CHUNK, (uint32_t)(40 + r));
    CHECK_OK(o->copy_d2h(b, gate_dst, gate_src, GATE, gate)); /* >= 50 ms */
    CHECK_OK(o->event_record(b, opened, gate));
    CHECK_OK(o->stream_wait_event(b, s, opened));
    CHECK_OK(enqueue_chain(b, buf, src, CHUNK, STAGES, s)); /* 999 of 1024 slots */
    CHECK_OK(o->event_record(b, done, s));
    pthread_t th[HELPERS];
    sync_arg args[HELPERS];
    for (int i = 0; i < HELPERS; i++) {
      args[i] = (sync_arg){b, done, -1};
      CHECK_EQ(pthread_create(&th[i], NULL, sync_on, &args[i]), 0);
    }
    for (int i = 0; i < HELPERS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < HELPERS; i++) CHECK_OK(args[i].rc);
    CHECK_EQ(chain_mismatches(buf, src, CHUNK, STAGES), 0);
  }
  CHECK_OK(o->event_destroy(b, opened));
  CHECK_OK(o->event_destroy(b, done));
  CHECK_OK(o->stream_destroy(b, gate));
  CHECK_OK(o->stream_destroy(b, s));
  free(gate_src), free(gate_dst), free(src), free(buf[0]), free(buf[1]);
  o->destroy(b);
  return 0;
}

/* Several threads share two streams and a set of events: each thread owns
 * a region, copies it there and back through the streams, and records,
 * queries, waits and synchronizes events concurrently. Run under TSan. */
enum { MT_THREADS = 4, MT_ROUNDS = 200, MT_BYTES = 8192 };
typedef struct {
  ferry_backend *b;
  bk_stream d2h, h2d;
  bk_event *shared_ev; /* recorded and queried by every thread */
  uint8_t *dev, *host, *back;
  int id;
  int failed;
} mt_arg;

static void *mt_worker(void *p) {
  mt_arg *a = p;
  const ferry_backend_ops *o = a->b->ops;
  bk_event *mine;
  if (o->event_create(a->b, &mine) != 0) {
    a->failed = 1;
    return NULL;
  }
  size_t off = (size_t)a->id * MT_BYTES;
  for (int r = 0; r < MT_ROUNDS && !a->failed; r++) {
    fill_pattern(a->dev + off, MT_BYTES, (uint32_t)(a->id * 1000 + r));
    int rc = o->copy_d2h(a->b, a->host + off, a->dev + off, MT_BYTES, a->d2h);
    rc |= o->event_record(a->b, mine, a->d2h);
    rc |= o->event_record(a->b, a->shared_ev, r & 1 ? a->d2h : a->h2d);
    rc |= o->stream_wait_event(a->b, a->h2d, mine);
    rc |= o->copy_h2d(a->b, a->back + off, a->host + off, MT_BYTES, a->h2d);
    rc |= o->event_record(a->b, mine, a->h2d);
    if (o->event_query(a->b, a->shared_ev) < 0) rc = -1;
    rc |= o->event_synchronize(a->b, a->shared_ev);
    rc |= o->event_synchronize(a->b, mine);
    if (rc != 0 || memcmp(a->back + off, a->dev + off, MT_BYTES) != 0)
      a->failed = 1;
  }
  o->event_destroy(a->b, mine);
  return NULL;
}

TEST(host_concurrent_record_query) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  mt_arg args[MT_THREADS];
  uint8_t *dev = calloc(MT_THREADS, MT_BYTES), *back = calloc(MT_THREADS, MT_BYTES);
  uint8_t *host;
  CHECK(dev && back);
  CHECK_OK(o->host_alloc(b, MT_THREADS * MT_BYTES, 0, (void **)&host));
  bk_stream d2h, h2d;
  CHECK_OK(o->stream_create(b, &d2h));
  CHECK_OK(o->stream_create(b, &h2d));
  bk_event *shared;
  CHECK_OK(o->event_create(b, &shared));
  pthread_t th[MT_THREADS];
  for (int i = 0; i < MT_THREADS; i++) {
    args[i] = (mt_arg){b, d2h, h2d, shared, dev, host, back, i, 0};
    CHECK_EQ(pthread_create(&th[i], NULL, mt_worker, &args[i]), 0);
  }
  for (int i = 0; i < MT_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < MT_THREADS; i++) CHECK_EQ(args[i].failed, 0);
  CHECK_OK(o->event_destroy(b, shared));
  CHECK_OK(o->host_free(b, host, MT_THREADS * MT_BYTES));
  o->destroy(b);
  free(dev), free(back);
  return 0;
}

/* Several threads enqueue on one stream at once, far more than its ring
 * holds, without waiting in between: every copy must run exactly once. */
enum { FILL_THREADS = 4, FILL_COPIES = 1500, FILL_SLOT = 16 };
typedef struct {
  ferry_backend *b;
  bk_stream s;
  const uint8_t *src;
  uint8_t *dst;
  int id;
  int failed;
} fill_arg;

static void *fill_worker(void *p) {
  fill_arg *a = p;
  for (int i = 0; i < FILL_COPIES; i++) {
    size_t slot = (size_t)a->id * FILL_COPIES + (size_t)i;
    if (a->b->ops->copy_d2h(a->b, a->dst + slot * FILL_SLOT,
                            a->src + slot * FILL_SLOT, FILL_SLOT, a->s) != 0)
      a->failed = 1;
  }
  return NULL;
}

TEST(host_concurrent_producers_fill_ring) {
  ferry_backend *b = make_backend(0, 0, 0, 1);
  CHECK(b);
  const ferry_backend_ops *o = b->ops;
  const size_t total = (size_t)FILL_THREADS * FILL_COPIES * FILL_SLOT;
  uint8_t *src = malloc(total), *dst = calloc(1, total);
  CHECK(src && dst);
  fill_pattern(src, total, 21);
  bk_stream s;
  CHECK_OK(o->stream_create(b, &s));
  fill_arg args[FILL_THREADS];
  pthread_t th[FILL_THREADS];
  for (int i = 0; i < FILL_THREADS; i++) {
    args[i] = (fill_arg){b, s, src, dst, i, 0};
    CHECK_EQ(pthread_create(&th[i], NULL, fill_worker, &args[i]), 0);
  }
  for (int i = 0; i < FILL_THREADS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < FILL_THREADS; i++) CHECK_EQ(args[i].failed, 0);
  bk_event *ev;
  CHECK_OK(o->event_create(b, &ev));
  CHECK_OK(o->event_record(b, ev, s));
  CHECK_OK(o->event_synchronize(b, ev));
  CHECK_EQ(memcmp(src, dst, total), 0);
  o->destroy(b);
  free(src), free(dst);
  return 0;
}
