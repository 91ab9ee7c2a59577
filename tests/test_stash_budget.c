/* test_stash_budget.c — the stash's bounds from outside the policy: a
 * host budget shared through the reserve hook, the forward stash bounded
 * in bytes, and fixed knobs that win over the policy's. */
#include <stdatomic.h>

#include "test.h"
#include "test_device.h"
#include "test_stash_fixture.h"

/* ---- a shared host budget ------------------------------------------------------------------- */
typedef struct budget {
  atomic_long used, limit, refusals, calls;
} budget;

static int budget_cb(void *ud, uint64_t bytes, int release) {
  budget *b = ud;
  atomic_fetch_add(&b->calls, 1);
  if (release) {
    atomic_fetch_sub(&b->used, (long)bytes);
    return 0;
  }
  if (atomic_fetch_add(&b->used, (long)bytes) + (long)bytes > atomic_load(&b->limit)) {
    atomic_fetch_sub(&b->used, (long)bytes);
    atomic_fetch_add(&b->refusals, 1);
    return 1;
  }
  return 0;
}

TEST(stash_shared_budget_hook) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  budget b;
  atomic_init(&b.used, 0);
  atomic_init(&b.limit, 3 << 20);
  atomic_init(&b.refusals, 0);
  atomic_init(&b.calls, 0);
  c.host_reserve = budget_cb;
  c.host_reserve_ud = &b;
  c.max_fwd_stash = 1;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 12, SZ = 1 << 20 };
  ferry_handle hs[M];
  uint64_t sums[M];
  for (int i = 0; i < M; i++) {
    CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i, &sums[i])));
    CHECK(atomic_load(&b.used) <= 3 << 20);
  }
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK(atomic_load(&b.calls) > 0);
  CHECK(atomic_load(&b.refusals) > 0);
  CHECK(s.cap_fallbacks > 0);
  CHECK_EQ((long)s.arena_reserved, atomic_load(&b.used));
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  ferry_knobs k;
  CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
  CHECK_EQ(k.max_fwd_stash, 1);
  CHECK_EQ(k.min_offload_bytes, 1);
  ferry_engine_destroy(f.e);
  CHECK_EQ(atomic_load(&b.used), 0); /* everything given back at destroy */
  return 0;
}

/* The forward stash bounded by bytes as well as by count. */
TEST(stash_fwd_bound_in_bytes) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 100;
  c.max_fwd_stash_bytes = 3u << 20;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 10, SZ = 1 << 20 };
  ferry_handle hs[M];
  uint64_t sums[M];
  for (int i = 0; i < M; i++) {
    CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i + 7, &sums[i])));
    ferry_stats s;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK(s.device_bytes_held <= 3ull * SZ);
    CHECK_EQ(atomic_load(&f.dev.releases), i + 1 > 3 ? i + 1 - 3 : 0);
  }
  ferry_knobs k;
  CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
  CHECK_EQ(k.max_fwd_stash_bytes, 3u << 20);
  /* a size short of the first ferry_knobs is refused; the first version's
   * size fills only its fields; a larger (newer caller's) size works */
  CHECK_EQ(ferry_get_knobs(f.e, &k, FERRY_KNOBS_SIZE_V1 - 1), FERRY_EINVAL);
  ferry_knobs v1 = {0};
  v1.max_fwd_stash_bytes = 7;
  CHECK_OK(ferry_get_knobs(f.e, &v1, FERRY_KNOBS_SIZE_V1));
  CHECK_EQ(v1.max_fwd_stash_bytes, 7);
  CHECK_EQ(v1.min_offload_bytes, k.min_offload_bytes);
  struct {
    ferry_knobs k;
    uint64_t later_field;
  } bigger = {{0}, 9};
  CHECK_OK(ferry_get_knobs(f.e, &bigger.k, sizeof bigger));
  CHECK_EQ(bigger.k.max_fwd_stash_bytes, 3u << 20);
  CHECK_EQ(bigger.later_field, 9);
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;

  /* a policy knob overrides the config */
  CHECK_OK(ferry_set_policy(f.e, NULL,
                            "return { api = 1, knobs = { max_fwd_stash_bytes = 1048576 },"
                            " decide = function(t, ctx) return ferry.OFFLOAD end }",
                            0));
  CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
  CHECK_EQ(k.max_fwd_stash_bytes, 1u << 20);
  for (int i = 0; i < 4; i++) CHECK((hs[i] = pack_new(&f, SZ / 2, (uint64_t)i, &sums[i])));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK(s.device_bytes_held <= 1u << 20);
  for (int i = 3; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ / 2, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* Knobs the caller fixed win over the policy's; a policy setting one to
 * another value is reported as overruled, the same value is no conflict. */
TEST(stash_fixed_knobs_win_over_the_policy) {
  static const char *policy =
      "return { api = 1, knobs = { max_fwd_stash = 0, prefetch_distance = 2,"
      " min_offload_bytes = 4096 }, decide = function(t, ctx) return ferry.OFFLOAD end }";
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 7;
  c.prefetch_distance = 2;
  c.knobs_fixed = FERRY_KNOB_MAX_FWD_STASH | FERRY_KNOB_PREFETCH_DISTANCE;
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(ferry_set_policy(f.e, NULL, policy, 0));
  ferry_knobs k;
  CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
  CHECK_EQ(k.max_fwd_stash, 7);             /* fixed: the config's */
  CHECK_EQ(k.prefetch_distance, 2);         /* fixed, same value */
  CHECK_EQ(k.min_offload_bytes, 4096);      /* not fixed: the policy's */
  CHECK_EQ(k.overruled, FERRY_KNOB_MAX_FWD_STASH);
  /* the stash really holds 7: none of 7 packed tensors is released */
  enum { SZ = 1 << 16 };
  ferry_handle hs[7];
  uint64_t sums[7];
  for (int i = 0; i < 7; i++) CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i, &sums[i])));
  CHECK_EQ(atomic_load(&f.dev.releases), 0);
  for (int i = 6; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  /* a policy without knobs: nothing overruled any more */
  CHECK_OK(ferry_set_policy(f.e, NULL, "return { api = 1, decide = function() end }", 0));
  CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
  CHECK_EQ(k.overruled, 0);
  CHECK_EQ(k.max_fwd_stash, 7);
  ferry_engine_destroy(f.e);
  /* unknown bits are refused, naming the field */
  c.knobs_fixed = 0x100;
  char err[256] = "";
  ferry_engine *e = NULL;
  CHECK_EQ(ferry_engine_create(&c, &e, err, sizeof err), FERRY_EINVAL);
  CHECK(strstr(err, "config.knobs_fixed") != NULL);
  return 0;
}
