/* test_stream_rules.c — issue 36's stream rules, on the host backend and on
 * the CUDA test double (ferry_tests_cuda_double):
 *   - the reloads prefetch_at_backward_begin starts are ordered after the
 *     compute stream backward runs on (ferry_backward_begin_on), not after
 *     the legacy default stream, which orders nothing against it.
 * The embedder here is modelled on torch's caching allocator: a reload's
 * buffer comes from the compute stream's pool, so its previous user's last
 * work may still be queued on that stream (a slow write of garbage). A
 * reload not ordered after the stream is overwritten by it: the bytes read
 * back differ (and the double flags the unordered copies, rule 9). */
#include <stdlib.h>
#include <string.h>

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
