/* test_alias_key.c — issue 36's engine API, in C: ferry_pack_keyed aliases
 * a stored buffer only for the same storage and version (item 1), and
 * ferry_in_step is the engine's own step flag (item 4). */
#include <stdatomic.h>
#include <string.h>

#include "test.h"
#include "test_device.h"

enum { SZ = 64 << 10 };

static ferry_tensor_desc desc_bytes(uint64_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = (int64_t)bytes;
  return d;
}

/* Unpacks h and checks its first byte is `want`; gives the reference back. */
static int unpack_byte(ferry_engine *e, ferry_handle h, unsigned char want) {
  void *p = NULL, *o = NULL;
  CHECK_OK(ferry_unpack(e, h, NULL, &p, &o));
  unsigned char got = 0;
  test_dev_read(&got, p, 1);
  CHECK_EQ(got, want);
  test_buffer_unref(o);
  return 0;
}

TEST(pack_keyed_aliases_only_the_same_storage_and_version) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.retain = test_device_retain_cb;
  c.decide = test_decide_offload_on_use;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 8;
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  test_buffer *b = test_buffer_new(SZ);
  static unsigned char v0[SZ];
  memset(v0, 1, SZ);
  test_dev_write(b->ptr, v0, SZ);
  ferry_tensor_desc d = desc_bytes(SZ);
  atomic_fetch_add(&b->refs, 4); /* five references handed over */
  ferry_handle same1, same2, written, other_storage, plain;
  CHECK_OK(ferry_step_begin(e));
  CHECK_OK(ferry_pack_keyed(e, &d, b->ptr, b, NULL, 7, 0, &same1));
  CHECK_OK(ferry_pack_keyed(e, &d, b->ptr, b, NULL, 7, 0, &same2)); /* an alias */
  ferry_stats s;
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_aliased, 1);
  /* written in place: version 1 (other bytes, had they been written) */
  CHECK_OK(ferry_pack_keyed(e, &d, b->ptr, b, NULL, 7, 1, &written));
  /* another allocation at the same address (the first one freed) */
  CHECK_OK(ferry_pack_keyed(e, &d, b->ptr, b, NULL, 8, 1, &other_storage));
  /* ferry_pack matches no keyed entry: it has no key */
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &plain));
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_aliased, 1);
  CHECK_EQ(s.tensors_offloaded, 4);
  /* the newest keyed entry at the address is the one found */
  ferry_handle again;
  atomic_fetch_add(&b->refs, 1);
  CHECK_OK(ferry_pack_keyed(e, &d, b->ptr, b, NULL, 8, 1, &again));
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_aliased, 2);
  /* push the first four out of the stash: their unpacks reload */
  test_buffer *fill[8];
  ferry_handle fh[8];
  for (int i = 0; i < 8; i++) {
    fill[i] = test_buffer_new(SZ);
    CHECK_OK(ferry_pack_keyed(e, &d, fill[i]->ptr, fill[i], NULL, 100 + (uint64_t)i, 0, &fh[i]));
  }
  CHECK_OK(ferry_backward_begin(e));
  if (unpack_byte(e, same1, 1) || unpack_byte(e, same2, 1) || unpack_byte(e, written, 1) ||
      unpack_byte(e, other_storage, 1) || unpack_byte(e, plain, 1) || unpack_byte(e, again, 1))
    return 1;
  for (int i = 0; i < 8; i++) CHECK_OK(ferry_discard(e, fh[i]));
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

TEST(in_step_is_the_engines_own_flag) {
  ferry_config c = test_engine_config(NULL);
  ferry_engine *e = NULL;
  char err[256];
  CHECK_EQ(ferry_in_step(NULL), 0);
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  CHECK_EQ(ferry_in_step(e), 0);
  CHECK_OK(ferry_backward_begin(e)); /* outside a step: begins one */
  CHECK_EQ(ferry_in_step(e), 1);
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  CHECK_EQ(ferry_in_step(e), 0);
  test_buffer *b = test_buffer_new(SZ);
  ferry_tensor_desc d = desc_bytes(SZ);
  ferry_handle h;
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h)); /* begins one too */
  CHECK_EQ(ferry_in_step(e), 1);
  CHECK_OK(ferry_discard(e, h));
  CHECK_OK(ferry_step_end(e));
  CHECK_EQ(ferry_in_step(e), 0);
  ferry_engine_destroy(e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}
