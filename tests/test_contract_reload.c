/* test_contract_reload.c — device_alloc may discard the handle whose
 * reload it allocates for (ferry.h): the unpack then fails with
 * FERRY_EHANDLE, also when the allocation fails too, and never says the
 * discarded handle "stays valid". */
#include <string.h>

#include "test.h"
#include "test_device.h"

typedef struct {
  test_device_stats st;
  ferry_engine *e;
  ferry_handle victim;
  int discard_rc;
} discard_then_fail;

static int discard_then_fail_alloc(void *ud, uint64_t bytes, void *stream, void **device_ptr,
                                   void **owner) {
  (void)bytes, (void)stream, (void)device_ptr, (void)owner;
  discard_then_fail *r = ud;
  r->discard_rc = ferry_discard(r->e, r->victim);
  return -1;
}

static int offload_everything(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                              ferry_decision *out) {
  (void)ud, (void)d, (void)ctx;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 0;
  return 0;
}

static ferry_tensor_desc bytes_desc(uint64_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = (int64_t)bytes;
  return d;
}

TEST(contract_unpack_discarded_by_a_failing_device_alloc) {
  const long buffers_before = test_buffers_live();
  discard_then_fail r = {0};
  ferry_config c = test_engine_config(&r.st);
  c.retain = test_device_retain_cb;
  c.decide = offload_everything;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 1;
  c.device_alloc = discard_then_fail_alloc;
  c.callback_ud = &r;
  CHECK_OK(ferry_engine_create(&c, &r.e, NULL, 0));
  ferry_tensor_desc d = bytes_desc(4096), dc = bytes_desc(2048);
  test_buffer *b = test_buffer_new(4096), *other = test_buffer_new(2048);
  atomic_fetch_add(&b->refs, 1); /* one reference for each pack */
  ferry_handle h1, h2, hc;
  CHECK_OK(ferry_pack(r.e, &d, b->ptr, b, NULL, &h1));
  CHECK_OK(ferry_pack(r.e, &d, b->ptr, b, NULL, &h2)); /* an alias: h1's entry stays */
  CHECK_OK(ferry_pack(r.e, &dc, other->ptr, other, NULL, &hc)); /* pushes b out */
  r.victim = h1; /* the handle being unpacked */
  void *ptr = NULL, *owner = NULL;
  CHECK_RC(ferry_unpack(r.e, h1, NULL, &ptr, &owner), FERRY_EHANDLE);
  CHECK_OK(r.discard_rc);
  CHECK(strstr(ferry_last_error(r.e), "stays valid") == NULL);
  CHECK_STR_CONTAINS(ferry_last_error(r.e), "discarded");
  CHECK_RC(ferry_unpack(r.e, h1, NULL, &ptr, &owner), FERRY_EHANDLE);
  CHECK_OK(ferry_discard(r.e, h2));
  CHECK_OK(ferry_discard(r.e, hc));
  CHECK_OK(ferry_step_end(r.e));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(r.e, &s, sizeof s));
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.alloc_failures, 1);
  ferry_engine_destroy(r.e);
  CHECK_EQ(test_buffers_live(), buffers_before);
  return 0;
}
