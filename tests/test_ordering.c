/* test_ordering.c — the engine's copies are ordered after the embedder's
 * compute stream, and the compute stream after the engine's reloads. The
 * compute stream here is asynchronous and busy (a stream of the engine's
 * own backend with a slow write on it), so a missing wait reads stale bytes
 * and fails the comparison: on the host backend through its link model, on
 * the CUDA test double through a long copy delay. */
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

/* The engine of these tests: every tensor offloaded and reloaded (no
 * forward stash); on the host backend 256 KiB at 200 MB/s is ~1.3 ms a copy,
 * on every stream. */
static ferry_config ordering_config(void) {
  ferry_config c = test_engine_config(NULL);
  c.decide = test_decide_offload_on_use;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 0;
  c.link.h2d_bytes_per_s = c.link.d2h_bytes_per_s = 200e6;
  return c;
}

/* One step with b (BYTES, whose reference goes to the engine) saved and
 * reloaded on `compute`, then read back on it into seen: seen must equal
 * pattern, after a real reload. */
static int pack_reload_and_read(ferry_engine *e, ferry_backend *bk, bk_stream compute,
                                test_buffer *b, const unsigned char *pattern,
                                unsigned char *seen) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = BYTES;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = BYTES;
  ferry_handle h = 0;
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, compute, &h));
  CHECK_OK(ferry_backward_begin(e));
  void *p = NULL, *o = NULL;
  CHECK_OK(ferry_unpack(e, h, compute, &p, &o));
  /* the "kernel" that reads it, on the compute stream right away */
  CHECK_OK(bk->ops->copy_d2h(bk, seen, p, BYTES, compute));
  CHECK_OK(bk->ops->stream_synchronize(bk, compute));
  ferry_stats st;
  CHECK_OK(ferry_get_stats(e, &st, sizeof st));
  CHECK(st.bytes_h2d >= BYTES); /* a real reload, not a stash hit */
  int same = memcmp(seen, pattern, BYTES) == 0;
  if (!same) {
    size_t first = 0;
    while (first < BYTES && seen[first] == pattern[first]) first++;
    fprintf(stderr, "bytes differ from offset %zu (saw %u, want %u)\n", first, seen[first],
            pattern[first]);
  }
  CHECK(same);
  test_buffer_unref(o);
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  return 0;
}

TEST(copies_wait_for_a_busy_compute_stream) {
  ferry_config c = ordering_config();
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ferry_backend *bk = ferry_engine_backend(e);
  CHECK(bk != NULL);
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(20000);
#endif
  bk_stream compute = NULL;
  CHECK_OK(bk->ops->stream_create(bk, &compute));
  unsigned char *pattern = NULL, *seen = NULL, *busy = NULL; /* pinned: the double insists */
  CHECK_OK(bk->ops->host_alloc(bk, BUSY_BYTES, 4096, (void **)&busy));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&pattern));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&seen));
  for (size_t i = 0; i < BYTES; i++) pattern[i] = (unsigned char)(i * 131 + 7);
  memset(seen, 0, BYTES);

  test_buffer *b = test_buffer_new(BYTES);
  unsigned char *zero = calloc(1, BYTES);
  test_dev_write(b->ptr, zero, BYTES); /* what a copy that does not wait sees */
  /* the "kernels" that produce the tensor, still running when it is saved:
   * a long one (~20 ms) first, so an offload that does not wait for the
   * compute stream is over long before the tensor is written */
  void *scratch = test_dev_malloc(BUSY_BYTES);
  CHECK_OK(bk->ops->copy_h2d(bk, scratch, busy, BUSY_BYTES, compute));
  CHECK_OK(bk->ops->copy_h2d(bk, b->ptr, pattern, BYTES, compute));
  if (pack_reload_and_read(e, bk, compute, b, pattern, seen)) return 1;
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(0);
#endif
  CHECK_OK(bk->ops->stream_destroy(bk, compute));
  CHECK_OK(bk->ops->host_free(bk, pattern, BYTES));
  CHECK_OK(bk->ops->host_free(bk, seen, BYTES));
  CHECK_OK(bk->ops->host_free(bk, busy, BUSY_BYTES));
  test_dev_free(scratch);
  free(zero);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

/* A reload writes into memory the device allocator hands out in the order
 * of the compute stream: the block's previous user may still have work
 * queued there (here: a slow write into it). The reload copy must wait for
 * that work, or the earlier write lands after the reloaded bytes. */
typedef struct {
  test_device_stats st; /* first: the engine's release/retain callbacks get callback_ud */
  ferry_backend *bk;
  void *scratch, *busy, *garbage;
} reuse_ctx;

static int alloc_still_in_use(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  reuse_ctx *r = ud;
  int rc = test_device_alloc_cb(&r->st, bytes, stream, dev, owner);
  if (rc) return rc;
  /* the previous user's last kernels, queued on the compute stream */
  if (r->bk->ops->copy_h2d(r->bk, r->scratch, r->busy, BUSY_BYTES, stream) ||
      r->bk->ops->copy_h2d(r->bk, *dev, r->garbage, bytes, stream))
    return -1;
  return 0;
}

TEST(reloads_wait_for_the_compute_stream_before_writing) {
  ferry_config c = ordering_config();
  reuse_ctx r = {0};
  c.device_alloc = alloc_still_in_use;
  c.callback_ud = &r;
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  ferry_backend *bk = r.bk = ferry_engine_backend(e);
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(20000);
#endif
  bk_stream compute = NULL;
  CHECK_OK(bk->ops->stream_create(bk, &compute));
  unsigned char *pattern = NULL, *seen = NULL;
  CHECK_OK(bk->ops->host_alloc(bk, BUSY_BYTES, 4096, &r.busy));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, &r.garbage));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&pattern));
  CHECK_OK(bk->ops->host_alloc(bk, BYTES, 4096, (void **)&seen));
  for (size_t i = 0; i < BYTES; i++) pattern[i] = (unsigned char)(i * 131 + 7);
  memset(r.garbage, 0xEE, BYTES);
  r.scratch = test_dev_malloc(BUSY_BYTES);

  test_buffer *b = test_buffer_new(BYTES);
  test_dev_write(b->ptr, pattern, BYTES);
  if (pack_reload_and_read(e, bk, compute, b, pattern, seen)) return 1;
#ifdef FERRY_TEST_CUDA_DOUBLE
  cuda_double_set_copy_delay_us(0);
#endif
  CHECK_OK(bk->ops->stream_destroy(bk, compute));
  CHECK_OK(bk->ops->host_free(bk, pattern, BYTES));
  CHECK_OK(bk->ops->host_free(bk, seen, BYTES));
  CHECK_OK(bk->ops->host_free(bk, r.garbage, BYTES));
  CHECK_OK(bk->ops->host_free(bk, r.busy, BUSY_BYTES));
  test_dev_free(r.scratch);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}
