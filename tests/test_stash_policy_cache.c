/* test_stash_policy_cache.c — the policy's cached answers in the stash:
 * ferry_pack_cached_keep (a kept answer without a handle, also from two
 * threads) and a policy swapped back by ferry_set_policy without a
 * reload. */
#include <pthread.h>
#include <unistd.h>

#include "test.h"
#include "test_device.h"
#include "test_stash_fixture.h"

/* ---- ferry_pack_cached_keep: a kept answer without a handle -------------- */
/* A test buffer of `bytes`, for a pack the engine does not take: freed by the caller. */
static int cached_keep(fixture *f, size_t bytes, int layer, const test_buffer *b) {
  ferry_tensor_desc d = desc_in_layer(bytes, layer);
  return ferry_pack_cached_keep(f->e, &d, b->ptr);
}

TEST(stash_cached_keep_without_handle) {
  enum { BIG = 8192, SMALL = 3000, TINY = 32 };
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.decide = NULL;
  c.policy_source = "return { api = 1, name = 'by-layer', decide = function(t, ctx)\n"
                    "  if t.layer == 3 then return ferry.KEEP end -- not cacheable\n"
                    "  if t.layer == 1 then return ferry.OFFLOAD, ferry.ON_USE, nil, true end\n"
                    "  return ferry.KEEP, ferry.ON_USE, nil, true end }\n";
  c.min_offload_bytes = 64;
  c.max_fwd_stash = 8; /* offloaded buffers stay stored in the stash */
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(ferry_step_begin(f.e));
  test_buffer *probe = test_buffer_new(BIG);
  /* nothing decided yet: the caller must pack */
  CHECK_EQ(cached_keep(&f, SMALL, 0, probe), 0);
  /* layer 0 kept, cacheable: the same site is answered without a handle */
  test_buffer *k = test_buffer_new(SMALL);
  fill(k, 1);
  uint64_t ksum = dev_checksum(k->ptr, SMALL);
  ferry_tensor_desc d = desc_in_layer(SMALL, 0);
  ferry_handle hk, hx, ha, h3;
  CHECK_OK(ferry_pack(f.e, &d, k->ptr, k, NULL, &hk));
  CHECK_EQ(cached_keep(&f, SMALL, 0, probe), 1);
  CHECK_EQ(cached_keep(&f, SMALL + 8, 0, probe), 0); /* another shape: another site */
  /* layer 1 offloaded, cacheable: never a cached keep */
  test_buffer *x = test_buffer_new(BIG);
  fill(x, 2);
  uint64_t xsum = dev_checksum(x->ptr, BIG);
  d = desc_in_layer(BIG, 1);
  test_device_retain_cb(&f.dev, x); /* ours: the engine releases its own once copied */
  CHECK_OK(ferry_pack(f.e, &d, x->ptr, x, NULL, &hx));
  CHECK_EQ(cached_keep(&f, BIG, 1, probe), 0);
  /* a keeping site, but the buffer is stored: ferry_pack aliases it */
  d = desc_in_layer(BIG, 0);
  test_buffer *y = test_buffer_new(BIG);
  fill(y, 3);
  uint64_t ysum = dev_checksum(y->ptr, BIG);
  ferry_handle hy;
  CHECK_OK(ferry_pack(f.e, &d, y->ptr, y, NULL, &hy)); /* caches (layer 0, BIG): keep */
  CHECK_EQ(cached_keep(&f, BIG, 0, probe), 1);
  CHECK_EQ(cached_keep(&f, BIG, 0, x), 0);
  test_device_retain_cb(&f.dev, x);
  CHECK_OK(ferry_pack(f.e, &d, x->ptr, x, NULL, &ha));
  /* a keep the policy did not let the engine cache */
  test_buffer *z = test_buffer_new(SMALL);
  d = desc_in_layer(SMALL, 3);
  CHECK_OK(ferry_pack(f.e, &d, z->ptr, z, NULL, &h3));
  CHECK_EQ(cached_keep(&f, SMALL, 3, probe), 0);
  /* under min_offload_bytes: the engine's own answer, the policy not asked */
  CHECK_EQ(cached_keep(&f, TINY, 1, probe), 1);

  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.tensors_kept_unheld, 3);
  CHECK_EQ(s.tensors_packed, 8);   /* 5 packs + 3 cached keeps */
  CHECK_EQ(s.tensors_aliased, 1);
  CHECK_EQ(s.tensors_kept, 3 + 3); /* k, y, z and the cached keeps */
  CHECK_EQ(s.live_handles, 5);
  CHECK_EQ(s.policy_calls, 4);
  CHECK_OK(ferry_backward_begin(f.e));
  CHECK_OK(ferry_discard(f.e, h3));
  if (unpack_check(&f, ha, BIG, xsum) || unpack_check(&f, hy, BIG, ysum) ||
      unpack_check(&f, hx, BIG, xsum) || unpack_check(&f, hk, SMALL, ksum))
    return 1;
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  test_device_release_cb(&f.dev, probe);
  test_device_release_cb(&f.dev, x);
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);

  /* while reasons are counted every pack must reach the engine */
  c = fixture_config(&f, 1);
  c.decide = NULL;
  c.policy_source = "return { api = 1, name = 'keep', decide = function(t, ctx)\n"
                    "  return ferry.KEEP, ferry.ON_USE, nil, true end }\n";
  c.count_reasons = 1;
  CHECK_OK(fixture_open(&f, &c));
  probe = test_buffer_new(SMALL);
  d = desc_in_layer(SMALL, 0);
  test_buffer *w = test_buffer_new(SMALL);
  CHECK_OK(ferry_pack(f.e, &d, w->ptr, w, NULL, &hk));
  CHECK_EQ(cached_keep(&f, SMALL, 0, probe), 0);
  CHECK_OK(ferry_discard(f.e, hk));
  CHECK_OK(ferry_step_end(f.e));
  test_device_release_cb(&f.dev, probe);
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- ferry_set_policy: a policy swapped back without a reload ------------- */
/* One step packing one tensor; 1 if it was offloaded. */
static int step_offloads(fixture *f) {
  ferry_stats s0, s1;
  uint64_t sum;
  CHECK_OK(ferry_get_stats(f->e, &s0, sizeof s0));
  CHECK_OK(ferry_step_begin(f->e));
  ferry_handle h = pack_new(f, 4096, 1, &sum);
  CHECK(h != 0);
  CHECK_OK(ferry_backward_begin(f->e));
  if (unpack_check(f, h, 4096, sum)) return -1;
  CHECK_OK(ferry_backward_end(f->e));
  CHECK_OK(ferry_step_end(f->e));
  CHECK_OK(ferry_get_stats(f->e, &s1, sizeof s1));
  return (int)(s1.tensors_offloaded - s0.tensors_offloaded);
}

static void write_policy_file(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  if (fp) {
    fputs(text, fp);
    fclose(fp);
  }
}

TEST(stash_policy_swapped_back_without_reload) {
  /* offloads at its second decision: its counter tells a reload apart */
  static const char *second =
      "local n = 0\n"
      "return { api = 1, name = 'second', decide = function(t, ctx)\n"
      "  n = n + 1\n"
      "  if n == 2 then return ferry.OFFLOAD end\n"
      "  return ferry.KEEP end }\n";
  char a[] = "/tmp/ferry-policy-XXXXXX.lua";
  int fd = mkstemps(a, 4);
  CHECK(fd >= 0);
  close(fd);
  write_policy_file(a, second);
  fixture f;
  ferry_config c = fixture_config(&f, 0);
  c.decide = NULL;
  c.policy_path = a;
  c.max_fwd_stash = 0;
  CHECK_OK(fixture_open(&f, &c));
  const char *keep = "return { api = 1, name = 'keep', decide = function() return ferry.KEEP end }\n";
  CHECK_EQ(step_offloads(&f), 0); /* n = 1 */
  CHECK_OK(ferry_set_policy(f.e, NULL, keep, 0));
  CHECK_EQ(step_offloads(&f), 0);
  CHECK_OK(ferry_set_policy(f.e, a, NULL, 0)); /* swapped back: n goes on */
  CHECK_EQ(step_offloads(&f), 1);              /* n = 2 */
  /* the file edited: loaded again, from n = 0 */
  CHECK_OK(ferry_set_policy(f.e, NULL, keep, 0));
  write_policy_file(a, "-- edited\n" "local n = 0\n"
                       "return { api = 1, name = 'second', decide = function(t, ctx)\n"
                       "  n = n + 1\n"
                       "  if n == 2 then return ferry.OFFLOAD end\n"
                       "  return ferry.KEEP end }\n");
  CHECK_OK(ferry_set_policy(f.e, a, NULL, 0));
  CHECK_EQ(step_offloads(&f), 0); /* n = 1 */
  CHECK_EQ(step_offloads(&f), 1); /* n = 2 */
  /* four other policies since: the oldest parked one is loaded again */
  char src[4][160];
  for (int i = 0; i < 4; i++) {
    snprintf(src[i], sizeof src[i],
             "return { api = 1, name = 'k%d', decide = function() return ferry.KEEP end }\n", i);
    CHECK_OK(ferry_set_policy(f.e, NULL, src[i], 0));
  }
  CHECK_OK(ferry_set_policy(f.e, NULL, keep, 0)); /* 'second' is pushed out */
  CHECK_OK(ferry_set_policy(f.e, a, NULL, 0));
  CHECK_EQ(step_offloads(&f), 0); /* n = 1 again */
  /* set during a step: refused, parked or not */
  CHECK_OK(ferry_step_begin(f.e));
  CHECK_EQ(ferry_set_policy(f.e, NULL, src[3], 0), FERRY_ESTATE);
  CHECK_EQ(ferry_set_policy(f.e, NULL, "return {", 0), FERRY_ESTATE); /* not even loaded */
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  unlink(a);
  return 0;
}

/* ferry_pack_cached_keep on one thread while another packs and unpacks
 * through the same engine (run under TSan by the test command). */
typedef struct cached_keep_ctx {
  fixture *f;
  test_buffer *probe;
  long kept;
} cached_keep_ctx;

static void *cached_keep_thread(void *arg) {
  cached_keep_ctx *c = arg;
  for (int i = 0; i < 2000; i++) c->kept += cached_keep(c->f, 4096, 0, c->probe);
  return NULL;
}

TEST(stash_cached_keep_on_two_threads) {
  fixture f;
  ferry_config c = fixture_config(&f, 0);
  c.decide = NULL;
  c.policy_source = "return { api = 1, name = 'keep', decide = function(t, ctx)\n"
                    "  return ferry.KEEP, ferry.ON_USE, nil, true end }\n";
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(ferry_step_begin(f.e));
  test_buffer *first = test_buffer_new(4096);
  ferry_tensor_desc d = desc_in_layer(4096, 0);
  ferry_handle h;
  CHECK_OK(ferry_pack(f.e, &d, first->ptr, first, NULL, &h)); /* the site's answer, cached */
  cached_keep_ctx ck = {&f, test_buffer_new(4096), 0};
  pthread_t t;
  pthread_create(&t, NULL, cached_keep_thread, &ck);
  int failures = 0;
  for (int i = 0; i < 500; i++) { /* another site: the policy is asked */
    uint64_t sum;
    ferry_handle x = pack_new(&f, 3000 + (size_t)i, (uint64_t)i, &sum);
    if (!x || unpack_check(&f, x, 3000 + (size_t)i, sum)) failures++;
  }
  pthread_join(t, NULL);
  CHECK_EQ(failures, 0);
  CHECK_EQ(ck.kept, 2000);
  CHECK_OK(ferry_discard(f.e, h));
  CHECK_OK(ferry_step_end(f.e));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.tensors_kept_unheld, 2000);
  CHECK_EQ(s.tensors_packed, 1 + 500 + 2000);
  test_device_release_cb(&f.dev, ck.probe);
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}
