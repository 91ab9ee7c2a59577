/* test_misuse.c — every public function refuses NULL, stale, foreign and
 * out-of-order arguments with FERRY_EINVAL/FERRY_ESTATE/FERRY_EHANDLE and a
 * message, and a refused call changes nothing (run under ASan in make test). */
#include <string.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_device.h"

static ferry_config misuse_config(test_device_stats *st) {
  ferry_config c = test_engine_config(st);
  c.min_offload_bytes = 0;
  return c;
}

/* rc is code and ferry_last_error(e) mentions needle. */
#define CHECK_REFUSED(e, expr, code, needle)                                   \
  do {                                                                       \
    CHECK_RC((expr), (code));                                                \
    CHECK_STR_CONTAINS(ferry_last_error(e), (needle));                       \
  } while (0)

TEST(api_refuses_null_and_bad_arguments) {
  /* no engine at all */
  ferry_handle h = 0;
  void *p = NULL, *o = NULL;
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 4096;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = 4096;
  CHECK_RC(ferry_pack(NULL, &d, &d, &d, NULL, &h), FERRY_EINVAL);
  CHECK_RC(ferry_unpack(NULL, 1, NULL, &p, &o), FERRY_EINVAL);
  CHECK_RC(ferry_prefetch(NULL, 1, NULL), FERRY_EINVAL);
  CHECK_RC(ferry_discard(NULL, 1), FERRY_EINVAL);
  CHECK_RC(ferry_step_begin(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_step_end(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_backward_begin(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_backward_end(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_set_policy(NULL, "default", NULL, 0), FERRY_EINVAL);
  ferry_stats stats;
  CHECK_RC(ferry_get_stats(NULL, &stats, sizeof stats), FERRY_EINVAL);
  CHECK(strcmp(ferry_last_error(NULL), "") != 0 || ferry_last_error(NULL) != NULL);
  CHECK(ferry_intern(NULL, "x") == NULL);
  CHECK(ferry_backend_name(NULL) != NULL && ferry_arena_name(NULL) != NULL);
  CHECK(ferry_last_policy_error(NULL) != NULL);
  ferry_engine_destroy(NULL); /* a no-op */
  ferry_snapshot *s = NULL;
  CHECK_RC(ferry_snapshot_start(NULL, "/tmp/x", NULL, 0, NULL, &s), FERRY_EINVAL);
  CHECK_RC(ferry_snapshot_poll(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_snapshot_wait(NULL), FERRY_EINVAL);
  CHECK_RC(ferry_snapshot_fence(NULL, NULL), FERRY_EINVAL);
  CHECK(ferry_snapshot_error(NULL) != NULL);
  ferry_snapshot_free(NULL);
  ferry_config_init(NULL);
  CHECK(ferry_dtype_name(-1) != NULL && ferry_dtype_size(999) == 0);
  CHECK_EQ(ferry_dtype_from_name(NULL), -1);

  /* a config of another size or version */
  test_device_stats st = {0};
  ferry_config c = misuse_config(&st);
  ferry_engine *e = NULL;
  char err[256] = "";
  CHECK_RC(ferry_engine_create(NULL, &e, err, sizeof err), FERRY_EINVAL);
  CHECK_RC(ferry_engine_create(&c, NULL, err, sizeof err), FERRY_EINVAL);
  c.struct_size = 8;
  CHECK(ferry_engine_create(&c, &e, err, sizeof err) < 0);
  CHECK(e == NULL && strstr(err, "struct_size"));
  c = misuse_config(&st);

  /* arguments of a live engine */
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  void *buf = test_dev_malloc(4096);
  test_buffer *owner = test_buffer_new(1);
  CHECK_REFUSED(e, ferry_pack(e, NULL, buf, owner, NULL, &h), FERRY_EINVAL, "desc is NULL");
  CHECK_REFUSED(e, ferry_pack(e, &d, NULL, owner, NULL, &h), FERRY_EINVAL, "device_ptr is NULL");
  CHECK_REFUSED(e, ferry_pack(e, &d, buf, NULL, NULL, &h), FERRY_EINVAL, "owner is NULL");
  CHECK_REFUSED(e, ferry_pack(e, &d, buf, owner, NULL, NULL), FERRY_EINVAL, "out is NULL");
  ferry_tensor_desc bad = d;
  bad.dtype = 99;
  CHECK_REFUSED(e, ferry_pack(e, &bad, buf, owner, NULL, &h), FERRY_EINVAL, "desc.dtype 99");
  CHECK_REFUSED(e, ferry_unpack(e, 12345, NULL, &p, &o), FERRY_EHANDLE, "ferry_unpack");
  CHECK_REFUSED(e, ferry_unpack(e, 0, NULL, &p, &o), FERRY_EHANDLE, "ferry_unpack");
  CHECK_REFUSED(e, ferry_discard(e, 12345), FERRY_EHANDLE, "ferry_discard");
  CHECK_REFUSED(e, ferry_prefetch(e, 12345, NULL), FERRY_EHANDLE, "ferry_prefetch");
  CHECK_REFUSED(e, ferry_get_stats(e, NULL, sizeof stats), FERRY_EINVAL, "NULL");
  CHECK_REFUSED(e, ferry_set_policy(e, NULL, NULL, 0), FERRY_EINVAL, "no path or source");
  CHECK_REFUSED(e, ferry_snapshot_start(e, NULL, NULL, 0, NULL, &s), FERRY_EINVAL, "path");
  CHECK(test_buffers_live() >= 1); /* nothing was taken: the owner is still ours */
  test_buffer_unref(owner);
  test_dev_free(buf);
  ferry_engine_destroy(e);
  return 0;
}

TEST(api_refuses_out_of_order_calls) {
  test_device_stats st = {0};
  ferry_config c = misuse_config(&st);
  ferry_engine *e = NULL;
  char err[256] = "";
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  CHECK_OK(ferry_step_begin(e));
  CHECK_REFUSED(e, ferry_backward_end(e), FERRY_ESTATE, "without ferry_backward_begin");
  CHECK_OK(ferry_backward_begin(e));
  CHECK_REFUSED(e, ferry_backward_begin(e), FERRY_ESTATE, "already in backward");
  CHECK_OK(ferry_backward_end(e));
  CHECK_REFUSED(e, ferry_backward_end(e), FERRY_ESTATE, "without ferry_backward_begin");

  /* a handle unpacked twice, discarded after unpack, from another engine */
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = 4096;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = 4096;
  test_buffer *b = test_buffer_new(4096);
  ferry_handle h = 0;
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h));
  void *p = NULL, *o = NULL;
  CHECK_OK(ferry_unpack(e, h, NULL, &p, &o));
  test_buffer_unref(o);
  CHECK_REFUSED(e, ferry_unpack(e, h, NULL, &p, &o), FERRY_EHANDLE, "ferry_unpack");
  CHECK_REFUSED(e, ferry_discard(e, h), FERRY_EHANDLE, "ferry_discard");
  ferry_engine *other = NULL;
  CHECK_OK(ferry_engine_create(&c, &other, err, sizeof err));
  test_buffer *b2 = test_buffer_new(4096);
  ferry_handle h2 = 0;
  CHECK_OK(ferry_pack(other, &d, b2->ptr, b2, NULL, &h2));
  /* a foreign handle is either unknown here or names another slot's
   * generation: never another engine's tensor */
  int rc = ferry_unpack(e, h2 + 0x100000000ull * 77, NULL, &p, &o);
  CHECK_EQ(rc, FERRY_EHANDLE);
  CHECK_OK(ferry_unpack(other, h2, NULL, &p, &o));
  test_buffer_unref(o);
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(other);

  /* use after destroy: detected through the registry of live engines */
  ferry_engine_destroy(e);
  CHECK_RC(ferry_step_begin(e), FERRY_ESTATE);
  CHECK_RC(ferry_pack(e, &d, &d, &d, NULL, &h), FERRY_ESTATE);
  CHECK(strcmp(ferry_backend_name(e), "none") == 0);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}
