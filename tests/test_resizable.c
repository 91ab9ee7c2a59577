/* test_resizable.c — FERRY_FLAG_RESIZABLE (issue 36 item 2): the owner of a
 * saved buffer may free or rewrite its bytes as soon as ferry_pack returns
 * (FSDP's resize_(0) of all-gathered weights), so an offloaded pack waits
 * for its copy, lets the buffer go, and its unpack reloads the packed bytes
 * rather than handing the buffer back as a stash hit. */
#include <stdatomic.h>
#include <string.h>

#include "test.h"
#include "test_device.h"

enum { RSZ = 64 << 10 };

TEST(resizable_pack_copies_before_it_returns) {
  test_device_stats st = {0};
  ferry_config c = test_engine_config(&st);
  c.decide = test_decide_offload_on_use;
  c.min_offload_bytes = 0;
  c.max_fwd_stash = 8;               /* room to stay stashed: no bound pushes it out */
  c.link.d2h_bytes_per_s = 4e6;      /* on the host backend: a 16 ms copy, read late */
  ferry_engine *e = NULL;
  char err[256];
  CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
  test_buffer *b = test_buffer_new(RSZ), *plain = test_buffer_new(RSZ);
  static unsigned char packed[RSZ], other[RSZ], got[RSZ];
  memset(packed, 0x5a, RSZ);
  memset(other, 0x11, RSZ);
  test_dev_write(b->ptr, packed, RSZ);
  test_dev_write(plain->ptr, packed, RSZ);
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = RSZ;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = RSZ;
  d.kind = FERRY_KIND_PARAMETER;
  d.flags = FERRY_FLAG_CONTIGUOUS | FERRY_FLAG_RESIZABLE;
  ferry_handle h, hp;
  atomic_fetch_add(&b->refs, 1); /* ours stays, as FSDP's parameter does */
  CHECK_OK(ferry_pack(e, &d, b->ptr, b, NULL, &h));
  CHECK_EQ(atomic_load(&b->refs), 1); /* the engine let its reference go */
  test_dev_write(b->ptr, other, RSZ); /* the owner reuses the bytes at once */
  d.flags = FERRY_FLAG_CONTIGUOUS;    /* not resizable: stays stashed (a hit) */
  atomic_fetch_add(&plain->refs, 1);
  CHECK_OK(ferry_pack(e, &d, plain->ptr, plain, NULL, &hp));
  CHECK_EQ(atomic_load(&plain->refs), 2);
  CHECK_OK(ferry_backward_begin(e));
  void *p = NULL, *o = NULL;
  CHECK_OK(ferry_unpack(e, h, NULL, &p, &o));
  CHECK(o != b); /* a reload, not the rewritten buffer */
  test_dev_read(got, p, RSZ);
  CHECK(memcmp(got, packed, RSZ) == 0);
  test_buffer_unref(o);
  CHECK_OK(ferry_unpack(e, hp, NULL, &p, &o));
  CHECK(o == plain);
  test_buffer_unref(o);
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  ferry_engine_destroy(e);
  test_buffer_unref(b);
  test_buffer_unref(plain);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}
