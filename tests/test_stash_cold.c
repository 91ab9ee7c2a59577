/* test_stash_cold.c — issue 38 review: a saved tensor's rarely read fields
 * (owner, pack number, module, alias key) live in ferry_engine.cold, a
 * parallel array of the entries. It must grow with them (several times past
 * the first 256), be cleared when a freed slot is reused, and give every
 * entry its own key and owner, with both recorders reading it. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "test_device.h"

enum { N = 700, SZ = 256 };

static ferry_tensor_desc desc_of(char *module, int i) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = SZ;
  d.dtype = FERRY_DTYPE_U8;
  d.ndim = 1;
  d.shape[0] = SZ;
  snprintf(module, 32, "model.m%d", i);
  d.module_path = module;
  return d;
}

/* one step: N keyed primaries, N aliases of them (same key), N packs of a
 * newer version (no alias); every unpack reads its own buffer's bytes */
static int one_step(ferry_engine *e, test_buffer **b, uint64_t step) {
  static ferry_handle h[3][N];
  char module[32];
  CHECK_OK(ferry_step_begin(e));
  for (int k = 0; k < 3; k++)
    for (int i = 0; i < N; i++) {
      ferry_tensor_desc d = desc_of(module, i);
      atomic_fetch_add(&b[i]->refs, 1);
      CHECK_OK(ferry_pack_keyed(e, &d, b[i]->ptr, b[i], NULL, 1000 + (uint64_t)i,
                                k == 2 ? (int64_t)step + 1 : (int64_t)step, &h[k][i]));
    }
  ferry_stats s;
  CHECK_OK(ferry_get_stats(e, &s, sizeof s));
  CHECK_EQ(s.tensors_aliased, (uint64_t)N * step);
  CHECK_OK(ferry_backward_begin(e));
  for (int k = 2; k >= 0; k--)
    for (int i = N - 1; i >= 0; i--) {
      void *p = NULL, *o = NULL;
      CHECK_OK(ferry_unpack(e, h[k][i], NULL, &p, &o));
      CHECK(o == b[i]); /* the entry's own owner */
      unsigned char got = 0;
      test_dev_read(&got, p, 1);
      CHECK_EQ(got, (unsigned char)i);
      test_buffer_unref(o);
    }
  CHECK_OK(ferry_backward_end(e));
  CHECK_OK(ferry_step_end(e));
  return 0;
}

TEST(stash_cold_fields_follow_growth_and_reuse) {
  char jsonl[] = "/tmp/ferry-cold-XXXXXX", chrome[] = "/tmp/ferry-cold-ct-XXXXXX";
  int fd1 = mkstemp(jsonl), fd2 = mkstemp(chrome);
  CHECK(fd1 >= 0 && fd2 >= 0);
  close(fd1);
  close(fd2);
  for (int traced = 0; traced < 2; traced++) {
    test_device_stats st = {0};
    ferry_config c = test_engine_config(&st);
    c.retain = test_device_retain_cb;
    c.decide = test_decide_offload_on_use;
    c.min_offload_bytes = 0;
    c.max_fwd_stash = 4 * N; /* every copy stays on the device: aliases match */
    if (traced) {
      c.trace_path = jsonl;
      c.chrome_trace_path = chrome;
      c.count_reasons = 1;
    }
    ferry_engine *e = NULL;
    char err[256];
    CHECK_OK(ferry_engine_create(&c, &e, err, sizeof err));
    static test_buffer *b[N];
    for (int i = 0; i < N; i++) {
      b[i] = test_buffer_new(SZ);
      unsigned char v[SZ];
      memset(v, i & 0xff, SZ);
      test_dev_write(b[i]->ptr, v, SZ);
    }
    /* step 1 grows the tables to 3N; step 2 reuses freed slots */
    if (one_step(e, b, 1) || one_step(e, b, 2)) return 1;
    for (int i = 0; i < N; i++) test_buffer_unref(b[i]);
    ferry_engine_destroy(e);
    CHECK_EQ(test_buffers_live(), 0);
  }
  unlink(jsonl);
  unlink(chrome);
  return 0;
}
