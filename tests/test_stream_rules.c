/* test_stream_rules.c — issue 36's stream and thread rules, on the host
 * backend and on the CUDA test double (ferry_tests_cuda_double):
 *   - the reloads prefetch_at_backward_begin starts are ordered after the
 *     compute stream backward runs on (ferry_backward_begin_on), not after
 *     the legacy default stream, which orders nothing against it;
 *   - a thread waiting for another's reload of the same tensor lets the
 *     embedder's global lock go (wait_begin/wait_end), as the reloading
 *     thread may need it to finish (Python's GIL around torch's allocator).
 * The embedder here is modelled on torch's caching allocator: a reload's
 * buffer comes from the compute stream's pool, so its previous user's last
 * work may still be queued on that stream (a slow write of garbage). A
 * reload not ordered after the stream is overwritten by it: the bytes read
 * back differ (and the double flags the unordered copies, rule 9). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"
#ifdef FERRY_TEST_CUDA_DOUBLE
#include "cuda_double.h"
#endif

#define BYTES (256u << 10)
#define BUSY_BYTES (4u << 20)

static int offload_and_prefetch(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                                ferry_decision *out) {
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_PREFETCH;
  out->prefetch_distance = 4;
  out->cacheable = 1;
  return FERRY_OK;
}

/* The caching-allocator stand-in: every block it hands out was last used by
 * work queued on the compute stream (the pool it comes from), whatever
 * stream the engine names; it notes which stream that was. */
typedef struct {
  test_device_stats st; /* first: the release/retain callbacks get callback_ud */
  ferry_backend *bk;
  bk_stream compute;
  void *scratch, *busy, *garbage;
  int allocs, allocs_for_compute;
} pool_ctx;

static int alloc_from_compute_pool(void *ud, uint64_t bytes, void *stream, void **dev,
                                   void **owner) {
  pool_ctx *r = ud;
  int rc = test_device_alloc_cb(&r->st, bytes, stream, dev, owner);
  if (rc) return rc;
  r->allocs++;
  r->allocs_for_compute += stream == (void *)r->compute;
  if (r->bk->ops->copy_h2d(r->bk, r->scratch, r->busy, BUSY_BYTES, r->compute) ||
      r->bk->ops->copy_h2d(r->bk, *dev, r->garbage, bytes, r->compute))
    return -1;
  return 0;
}

TEST(backward_begin_prefetch_is_ordered_after_the_compute_stream) {
  ferry_config c = test_engine_config(NULL);
  pool_ctx r = {0};
  c.decide = offload_and_prefetch;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 0;
  c.prefetch_at_backward_begin = 1;
  c.link.h2d_bytes_per_s = c.link.d2h_bytes_per_s = 200e6;
  c.device_alloc = alloc_from_compute_pool;
  c.callback_ud = &r;
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ferry_backend *bk = r.bk = ferry_engine_backend(e);
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(20000);
#endif
  CHECK_OK(bk->ops->stream_create(bk, &r.compute));
  unsigned char *pattern = NULL, *seen = NULL; /* pinned: the double insists */
  CHECK_OK(bk->ops->host_alloc(bk, BUSY_BYTES, 4096, &r.busy));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, &r.garbage));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&pattern));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&seen));
  for (size_t i = 0; i < BYTES; i++) pattern[i] = (unsigned char)(i * 131 + 7);
  memset(r.garbage, 0xEE, BYTES);
  r.scratch = test_dev_malloc(BUSY_BYTES);

  test_buffer *b = test_buffer_new(BYTES);
  test_dev_write(b->ptr, pattern, BYTES);
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = BYTES;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = BYTES;
  ferry_handle h = 0;
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, r.compute, &h));
  CHECK_OK(ferry_backward_begin_on(e, r.compute)); /* the reload starts here */
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK_EQ(st.prefetches, 1);
  CHECK_EQ(r.allocs, 1);
  CHECK_EQ(r.allocs_for_compute, 1); /* the buffer is for the compute stream */
  void *p = NULL, *o = NULL;
  CHECK_OK(ferry_unpack(e, h, r.compute, &p, &o));
  /* the "kernel" that reads it, on the compute stream right away */
  CHECK_OK(bk->ops->copy_d2h(bk, seen, p, BYTES, r.compute));
  CHECK_OK(bk->ops->stream_synchronize(bk, r.compute));
  size_t first = 0;
  while (first < BYTES && seen[first] == pattern[first]) first++;
  if (first < BYTES)
    fprintf(stderr, "bytes differ from offset %zu (saw %u, want %u)\n", first, seen[first],
            pattern[first]);
  CHECK_EQ(first, BYTES);
  test_buffer_unref(o);
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(0);
  CHECK_EQ(cuda_double_violations(), 0);
#endif
  CHECK_OK(bk->ops->stream_destroy(bk, r.compute));
  CHECK_OK(bk->ops->host_free(bk, pattern, BYTES));
  CHECK_OK(bk->ops->host_free(bk, seen, BYTES));
  CHECK_OK(bk->ops->host_free(bk, r.garbage, BYTES));
  CHECK_OK(bk->ops->host_free(bk, r.busy, BUSY_BYTES));
  test_dev_free(r.scratch);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

/* ---- a wait with the embedder's global lock ------------------------------ */
/* The embedder: a global lock (the GIL) held around every engine call; its
 * allocator lets it go while it works and takes it back (torch.empty_strided
 * does), as a thread reloading a tensor does inside device_alloc. */
typedef struct {
  test_device_stats st; /* first: the release/retain callbacks get callback_ud */
  pthread_mutex_t gil;
  atomic_int reloading; /* the reloading thread let the lock go */
} gil_ctx;

static int alloc_letting_the_gil_go(void *ud, uint64_t bytes, void *stream, void **dev,
                                    void **owner) {
  gil_ctx *g = ud;
  pthread_mutex_unlock(&g->gil);
  atomic_store(&g->reloading, 1);
  usleep(50000); /* meanwhile the other thread takes the lock and unpacks */
  pthread_mutex_lock(&g->gil);
  return test_device_alloc_cb(&g->st, bytes, stream, dev, owner);
}

static void *gil_wait_begin(void *ud) {
  pthread_mutex_unlock(&((gil_ctx *)ud)->gil);
  return ud;
}

static void gil_wait_end(void *ud, void *token) {
  (void)token;
  pthread_mutex_lock(&((gil_ctx *)ud)->gil);
}

typedef struct {
  ferry_engine *e;
  gil_ctx *g;
  ferry_handle h;
  void *p, *o;
  int rc;
  atomic_int done;
} unpacker;

static void *unpack_holding_the_gil(void *arg) {
  unpacker *u = arg;
  pthread_mutex_lock(&u->g->gil);
  u->rc = ferry_unpack(u->e, u->h, NULL, &u->p, &u->o);
  pthread_mutex_unlock(&u->g->gil);
  atomic_store(&u->done, 1);
  return NULL;
}

TEST(waiting_for_a_reload_lets_the_embedders_lock_go) {
  gil_ctx g = {.gil = PTHREAD_MUTEX_INITIALIZER};
  ferry_config c = test_engine_config(&g.st);
  c.decide = test_decide_offload_on_use;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 1;
  c.device_alloc = alloc_letting_the_gil_go;
  c.callback_ud = &g;
  c.wait_begin = gil_wait_begin;
  c.wait_end = gil_wait_end;
  c.retain = test_device_retain_cb; /* the two packs of b: one entry */
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  unsigned char *pattern = malloc(BYTES), *seen = malloc(BYTES);
  CHECK(pattern && seen);
  for (size_t i = 0; i < BYTES; i++) pattern[i] = (unsigned char)(i * 37 + 1);
  test_buffer *b = test_buffer_new(BYTES), *other = test_buffer_new(BYTES);
  test_dev_write(b->ptr, pattern, BYTES);
  atomic_fetch_add(&b->refs, 1); /* two references handed over */
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = BYTES;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = BYTES;
  unpacker a = {.e = e, .g = &g}, w = {.e = e, .g = &g};
  ferry_handle h_other = 0;
  pthread_mutex_lock(&g.gil);
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &a.h));
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &w.h)); /* the same bytes: an alias */
  CHECK_OK(ferry_pack(e, &d, other->ptr, other, NULL, &h_other)); /* pushes b out */
  CHECK_OK(ferry_backward_begin(e));
  pthread_mutex_unlock(&g.gil);
  pthread_t ta, tw;
  CHECK(pthread_create(&ta, NULL, unpack_holding_the_gil, &a) == 0);
  while (!atomic_load(&g.reloading)) usleep(1000);
  CHECK(pthread_create(&tw, NULL, unpack_holding_the_gil, &w) == 0);
  /* a watchdog, not a timing: both finish in well under a second */
  for (int i = 0; i < 1000 && !(atomic_load(&a.done) && atomic_load(&w.done)); i++)
    usleep(10000);
  if (!atomic_load(&a.done) || !atomic_load(&w.done)) {
    fprintf(stderr, "deadlock: the waiting thread held the embedder's lock the reloading "
                    "thread needed\n");
    return 1; /* the threads stay stuck; the process exits */
  }
  pthread_join(ta, NULL);
  pthread_join(tw, NULL);
  CHECK_OK(a.rc);
  CHECK_OK(w.rc);
  CHECK(a.p == w.p);
  test_dev_read(seen, a.p, BYTES);
  CHECK(memcmp(seen, pattern, BYTES) == 0);
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK(st.bytes_h2d >= BYTES); /* a real reload, waited for */
  test_buffer_unref(a.o);
  test_buffer_unref(w.o);
  CHECK_OK(ferry_discard(e, h_other));
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  free(pattern);
  free(seen);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}
