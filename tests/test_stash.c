/* test_stash.c — the stash manager through the public API: round trips,
 * the forward-stash bound, prefetch, aliasing, the cap, leaks over many
 * steps, error paths and threads. Runs over whichever backend
 * FERRY_TEST_BACKEND names. The fixture: test_stash_fixture.h. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <valgrind/valgrind.h>

#include "test.h"
#include "test_device.h"
#include "test_stash_fixture.h"
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#else
#define UNDER_SANITIZER 0
#endif

/* ---- round trips ----------------------------------------------------------- */
TEST(stash_roundtrip_random) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  c.max_fwd_stash = 3;
  CHECK_OK(fixture_open(&f, &c));
  uint64_t rng = 7;
  enum { N = 3000, PER_STEP = 150 };
  ferry_handle hs[PER_STEP];
  uint64_t sums[PER_STEP];
  size_t sizes[PER_STEP];
  for (int step = 0; step < N / PER_STEP; step++) {
    CHECK_OK(ferry_step_begin(f.e));
    f.dec.reload = step % 2;
    f.dec.distance = step % 4;
    for (int i = 0; i < PER_STEP; i++) {
      uint64_t r = rng_next(&rng);
      sizes[i] = 1 + (size_t)(r % ((r >> 40) & 1 ? 300000 : 4096));
      hs[i] = pack_new(&f, sizes[i], r, &sums[i]);
      CHECK(hs[i] != 0);
    }
    CHECK_OK(ferry_backward_begin(f.e));
    for (int i = PER_STEP - 1; i >= 0; i--)
      if (unpack_check(&f, hs[i], sizes[i], sums[i])) return 1;
    CHECK_OK(ferry_backward_end(f.e));
    CHECK_OK(ferry_step_end(f.e));
    if (check_quiescent(&f)) return 1;
  }
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.tensors_packed, N);
  CHECK_EQ(s.tensors_unpacked, N);
  CHECK(s.tensors_offloaded > N / 4 && s.tensors_kept > N / 4);
  CHECK_EQ(s.tensors_offloaded + s.tensors_kept, N);
  CHECK(s.bytes_d2h > 0 && s.bytes_h2d > 0);
  CHECK(s.stash_hits > 0);
  ferry_engine_destroy(f.e);
  return 0;
}

/* Out-of-order unpacks and discards mixed in. */
TEST(stash_roundtrip_any_order) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  c.max_fwd_stash = 2;
  CHECK_OK(fixture_open(&f, &c));
  uint64_t rng = 99;
  enum { M = 400 };
  ferry_handle hs[M];
  uint64_t sums[M];
  size_t sizes[M];
  int order[M];
  for (int i = 0; i < M; i++) {
    sizes[i] = 1 + (size_t)(rng_next(&rng) % 20000);
    hs[i] = pack_new(&f, sizes[i], (uint64_t)i * 31, &sums[i]);
    CHECK(hs[i]);
    order[i] = i;
  }
  for (int i = M - 1; i > 0; i--) {
    int j = (int)(rng_next(&rng) % (uint64_t)(i + 1));
    int t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (int k = 0; k < M; k++) {
    int i = order[k];
    if (k % 5 == 0)
      CHECK_OK(ferry_discard(f.e, hs[i]));
    else if (unpack_check(&f, hs[i], sizes[i], sums[i]))
      return 1;
  }
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- forward stash ---------------------------------------------------------- */
static atomic_long poisoned;
static void poisoning_release_cb(void *ud, void *owner) {
  test_buffer *b = owner;
  /* Scribble before letting go: a copy still reading it would be caught. */
  if (atomic_load(&b->refs) == 1) {
    unsigned char *junk = malloc(b->bytes);
    memset(junk, 0xDB, b->bytes);
    test_dev_write(b->ptr, junk, b->bytes);
    free(junk);
    atomic_fetch_add(&poisoned, 1);
  }
  test_device_release_cb(ud, owner);
}

TEST(stash_fwd_bound_and_release_after_event) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 3;
  c.release = poisoning_release_cb;
  /* A slow link: copies queue up behind each other, so a release that did
   * not wait for its copy would poison bytes not yet copied. */
  c.link.d2h_bytes_per_s = 200e6;
  c.link.h2d_bytes_per_s = 200e6;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 12, SZ = 1 << 20 };
  ferry_handle hs[M];
  uint64_t sums[M];
  atomic_store(&poisoned, 0);
  for (int i = 0; i < M; i++) {
    hs[i] = pack_new(&f, SZ, (uint64_t)i + 1, &sums[i]);
    CHECK(hs[i]);
    ferry_stats s;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK(s.device_bytes_held <= 3ull * SZ);
    CHECK_EQ(atomic_load(&f.dev.releases), i + 1 > 3 ? i + 1 - 3 : 0);
  }
  CHECK_EQ(atomic_load(&poisoned), M - 3);
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.device_bytes_held_peak, 4ull * SZ); /* bound + the one being packed */
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.stash_hits, 3);
  CHECK_EQ(s.bytes_h2d, (uint64_t)(M - 3) * SZ);
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* A forward-stash buffer is released once its D2H copy has completed, at
 * the next pack, not only when the stash bound pushes it out: on a link
 * throttled to 100 MB/s a 1 MiB copy takes ~10 ms, so the buffer is still
 * held right after its pack and gone at the first pack after the copy
 * ended, with the stash (bound 100) nowhere near full. */
TEST(stash_released_when_copy_completes) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 100;
  c.release_when_copied = 1;
  c.release = poisoning_release_cb;
  c.link.d2h_bytes_per_s = 100e6;
  c.link.h2d_bytes_per_s = 100e6;
  CHECK_OK(fixture_open(&f, &c));
  enum { SZ = 1 << 20 };
  atomic_store(&poisoned, 0);
  uint64_t sum_a, sum_b, sum_c;
  ferry_handle a = pack_new(&f, SZ, 11, &sum_a);
  CHECK(a);
  CHECK_EQ(atomic_load(&f.dev.releases), 0); /* its copy is still running */
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.device_bytes_held, (uint64_t)SZ);
  usleep(60000); /* the copy ends (~10.5 ms) */
  ferry_handle b = pack_new(&f, 4096, 12, &sum_b);
  CHECK(b);
  CHECK(atomic_load(&f.dev.releases) >= 1); /* a went: its bytes are on the host */
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK(s.device_bytes_held <= 4096);
  CHECK_EQ(s.waits, 0); /* nobody waited for a copy */
  usleep(20000);
  ferry_handle cc = pack_new(&f, 4096, 13, &sum_c);
  CHECK(cc);
  CHECK_OK(ferry_backward_begin(f.e));
  if (unpack_check(&f, cc, 4096, sum_c)) return 1;
  if (unpack_check(&f, b, 4096, sum_b)) return 1;
  if (unpack_check(&f, a, SZ, sum_a)) return 1; /* reloaded intact */
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- prefetch ----------------------------------------------------------------- */
TEST(stash_prefetch_explicit_and_ahead) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 0;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 10, SZ = 64 << 10 };
  ferry_handle hs[M];
  uint64_t sums[M];
  f.dec.reload = FERRY_RELOAD_ON_USE;
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i, &sums[i])));
  /* explicit: prefetch, then unpack finds it on device */
  CHECK_OK(ferry_prefetch(f.e, hs[M - 1], NULL));
  CHECK_OK(ferry_prefetch(f.e, hs[M - 1], NULL)); /* already reloading: no-op */
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.prefetches, 1);
  CHECK_EQ(s.bytes_h2d, SZ);
  if (unpack_check(&f, hs[M - 1], SZ, sums[M - 1])) return 1;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.bytes_h2d, SZ); /* no second copy */
  for (int i = M - 2; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));

  /* ahead: each unpack starts the reload of the 3 packed before it */
  f.dec.reload = FERRY_RELOAD_PREFETCH;
  f.dec.distance = 3;
  CHECK_OK(ferry_step_begin(f.e));
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i + 100, &sums[i])));
  if (unpack_check(&f, hs[M - 1], SZ, sums[M - 1])) return 1;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.prefetches, 1 + 3);
  CHECK_EQ(s.device_bytes_held, 3ull * SZ); /* the three prefetched */
  for (int i = M - 2; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.prefetches, 1 + (M - 1));
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  /* prefetch of an unknown handle */
  CHECK_RC(ferry_prefetch(f.e, hs[0], NULL), FERRY_EHANDLE);
  ferry_engine_destroy(f.e);
  return 0;
}

/* The policy's knobs release_when_copied and max_tail_prefetch. A buffer
 * goes once its copy is done (1 MiB at 100 MB/s: ~10 ms) with the first, as
 * with config.release_when_copied, else it stays until the bound (100)
 * pushes it out and is a stash hit. The unpack of a tensor packed after the
 * step's last offload (the loss, kept) starts the distance's 3 reloads, or
 * max_tail_prefetch (1) of them; the first unpack of an offloaded tensor
 * then opens the whole window. variant: 0 no knob, 1 release, 2 both. */
TEST(stash_policy_knobs_release_and_tail_prefetch) {
  static const char *const knobs[3] = {
      "", ", release_when_copied = 1", ", release_when_copied = 1, max_tail_prefetch = 1"};
  for (int v = 0; v < 3; v++) {
    char src[512];
    snprintf(src, sizeof src,
             "return { api = 1, knobs = { max_fwd_stash = 100%s },"
             " decide = function(t, ctx)"
             "   if t.bytes >= 65536 then return ferry.OFFLOAD, ferry.PREFETCH, 3 end"
             "   return ferry.KEEP end }",
             knobs[v]);
    fixture f;
    ferry_config c = fixture_config(&f, 1);
    c.decide = NULL;
    c.policy_source = src;
    c.link.d2h_bytes_per_s = 100e6;
    c.link.h2d_bytes_per_s = 100e6;
    CHECK_OK(fixture_open(&f, &c));
    ferry_knobs k;
    CHECK_OK(ferry_get_knobs(f.e, &k, sizeof k));
    CHECK_EQ(k.release_when_copied, v > 0);
    CHECK_EQ(k.max_tail_prefetch, v == 2 ? 1u : UINT32_MAX);
    enum { M = 6, SZ = 1 << 20 };
    ferry_handle hs[M + 1];
    uint64_t sums[M + 1];
    for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i, &sums[i])));
    usleep(100000); /* the copies end (~63 ms) */
    CHECK((hs[M] = pack_new(&f, 4096, 99, &sums[M]))); /* the loss, kept */
    ferry_stats s;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.tensors_offloaded, M);
    CHECK_EQ(s.device_bytes_held, v ? 4096u : (uint64_t)M * SZ + 4096u);
    CHECK_OK(ferry_backward_begin(f.e));
    if (unpack_check(&f, hs[M], 4096, sums[M])) return 1;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.prefetches, v == 0 ? 0u : v == 1 ? 3u : 1u);
    if (unpack_check(&f, hs[M - 1], SZ, sums[M - 1])) return 1;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.prefetches, v == 0 ? 0u : 4u);
    for (int i = M - 2; i >= 0; i--)
      if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
    CHECK_OK(ferry_backward_end(f.e));
    CHECK_OK(ferry_step_end(f.e));
    if (check_quiescent(&f)) return 1;
    ferry_engine_destroy(f.e);
  }
  return 0;
}

/* ---- aliasing --------------------------------------------------------------------- */
TEST(stash_alias_stored_once) {
  for (int mode = 0; mode <= 1; mode++) {
    fixture f;
    ferry_config c = fixture_config(&f, mode);
    c.max_fwd_stash = 1;
    CHECK_OK(fixture_open(&f, &c));
    enum { SZ = 100000 };
    test_buffer *b = test_buffer_new(SZ);
    fill(b, 5);
    uint64_t sum = dev_checksum(b->ptr, SZ);
    ferry_tensor_desc d = desc_of(SZ, 0);
    ferry_handle h1, h2, h3;
    atomic_fetch_add(&b->refs, 2); /* three references handed over */
    CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &h1));
    CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &h2));
    CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &h3));
    CHECK(h1 != h2 && h2 != h3);
    ferry_stats s;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.tensors_aliased, 2);
    CHECK_EQ(s.bytes_d2h, mode ? SZ : 0);
    CHECK_EQ(s.tensors_offloaded, mode);
    CHECK_EQ(atomic_load(&b->refs), 1); /* the engine holds one, not three */
    /* a second tensor pushes the first out of the forward stash */
    uint64_t sum2;
    ferry_handle other = pack_new(&f, 3000, 8, &sum2);
    CHECK(other);
    if (unpack_check(&f, h2, SZ, sum)) return 1;
    CHECK_RC(ferry_unpack(f.e, h2, NULL, &(void *){0}, &(void *){0}), FERRY_EHANDLE);
    if (unpack_check(&f, h1, SZ, sum)) return 1;
    if (unpack_check(&f, h3, SZ, sum)) return 1;
    if (unpack_check(&f, other, 3000, sum2)) return 1;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.bytes_h2d, mode ? SZ : 0); /* reloaded once for all three */
    CHECK_OK(ferry_step_end(f.e));
    if (check_quiescent(&f)) return 1;
    ferry_engine_destroy(f.e);
  }
  return 0;
}

/* What the policy is told about the step so far is exact, the size
 * threshold is exact, and an alias must match in size as well as address
 * (saving r[0] then r: the second is not the first's bytes). */
typedef struct ctx_log {
  int calls;
  ferry_context seen[8];
} ctx_log;

static int offload_and_log(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                           ferry_decision *out) {
  (void)d;
  ctx_log *l = ud;
  if (l->calls < 8) l->seen[l->calls] = *ctx;
  l->calls++;
  out->action = FERRY_OFFLOAD;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 0;
  return 0;
}

TEST(stash_context_thresholds_and_alias_sizes) {
  enum { SZ = 100000 };
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  ctx_log log = {0};
  c.decide = offload_and_log;
  c.decide_ud = &log;
  c.max_fwd_stash = 0;
  c.min_offload_bytes = 4096;
  CHECK_OK(fixture_open(&f, &c));
  uint64_t sums[3];
  ferry_handle hs[3];
  for (int i = 0; i < 3; i++) CHECK((hs[i] = pack_new(&f, SZ, 10 + (uint64_t)i, &sums[i])));
  CHECK_EQ(log.calls, 3);
  CHECK_EQ(log.seen[2].offloaded_this_step, 2);
  CHECK_EQ(log.seen[2].bytes_offloaded_this_step, 2 * SZ);
  CHECK_EQ(log.seen[2].arena_in_use, 2 * SZ);
  CHECK_EQ(log.seen[2].packed_this_step, 2);
  /* below the threshold: kept without asking; at it: asked */
  uint64_t s_small, s_at;
  ferry_handle small = pack_new(&f, 4095, 20, &s_small), at = pack_new(&f, 4096, 21, &s_at);
  CHECK(small && at);
  CHECK_EQ(log.calls, 4);
  CHECK_EQ(log.seen[3].bytes_offloaded_this_step, 3 * SZ);
  CHECK_OK(ferry_backward_begin(f.e));
  if (unpack_check(&f, small, 4095, s_small) || unpack_check(&f, at, 4096, s_at)) return 1;
  for (int i = 2; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);

  /* r[:half] saved first (held in the forward stash), then r at the same
   * address, then another tensor that pushes them out: r must come back
   * whole, not as the half the first copy holds */
  c = fixture_config(&f, 1);
  c.max_fwd_stash = 1;
  CHECK_OK(fixture_open(&f, &c));
  test_buffer *r = test_buffer_new(SZ);
  fill(r, 30);
  uint64_t whole = dev_checksum(r->ptr, SZ), half = dev_checksum(r->ptr, SZ / 2), s_next;
  ferry_tensor_desc dh = desc_of(SZ / 2, 0), dw = desc_of(SZ, 0);
  ferry_handle hh = 0, hw = 0;
  atomic_fetch_add(&r->refs, 1);
  CHECK_OK(ferry_pack(f.e, &dh, r->ptr, r, NULL, &hh));
  CHECK_OK(ferry_pack(f.e, &dw, r->ptr, r, NULL, &hw));
  ferry_handle next = pack_new(&f, SZ, 31, &s_next);
  CHECK(next);
  ferry_stats st;
  CHECK_OK(ferry_get_stats(f.e, &st, sizeof st));
  CHECK_EQ(st.tensors_aliased, 0);
  CHECK_OK(ferry_backward_begin(f.e));
  if (unpack_check(&f, next, SZ, s_next) || unpack_check(&f, hw, SZ, whole) ||
      unpack_check(&f, hh, SZ / 2, half))
    return 1;
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- the cap ------------------------------------------------------------------------ */
TEST(stash_cap_keeps_on_device) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.host_cap_bytes = 1 << 20;
  c.max_fwd_stash = 1;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 16, SZ = 200000 };
  ferry_handle hs[M];
  uint64_t sums[M];
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, SZ, (uint64_t)i, &sums[i])));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK(s.cap_fallbacks > 0);
  CHECK(s.tensors_offloaded > 0);
  CHECK_EQ(s.tensors_offloaded + s.cap_fallbacks, M);
  CHECK_EQ(s.tensors_kept, s.cap_fallbacks);
  CHECK(s.arena_reserved <= (1u << 20));
  CHECK(s.arena_in_use <= (1u << 20));
  CHECK_EQ(s.arena_cap, 1u << 20);
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], SZ, sums[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);

  /* percent of MemTotal: a tiny percentage caps just as hard */
  c = fixture_config(&f, 1);
  c.host_cap_pct = 0.0001; /* ~24 KB of 24 GiB */
  CHECK_OK(fixture_open(&f, &c));
  ferry_handle h = pack_new(&f, 1 << 20, 3, &sums[0]);
  CHECK(h);
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.cap_fallbacks, 1);
  CHECK(s.arena_cap > 0 && s.arena_cap < (1u << 20));
  if (unpack_check(&f, h, 1 << 20, sums[0])) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- many steps ---------------------------------------------------------------------- */
TEST(stash_no_leak_10000_steps) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  c.max_fwd_stash = 2;
  CHECK_OK(fixture_open(&f, &c));
  const char *env = getenv("FERRY_TEST_STEPS"); /* valgrind runs fewer */
  int steps = env ? atoi(env) : 10000;
  enum { PER = 8 };
  static const size_t sizes[PER] = {4096, 65536, 12288, 32768, 4096, 100000, 8192, 65536};
  uint64_t allocs_after_warmup = 0;
  for (int step = 0; step < steps; step++) {
    ferry_handle hs[PER];
    uint64_t sums[PER];
    CHECK_OK(ferry_step_begin(f.e));
    f.dec.rng = 1234; /* the same decisions every step, as a policy would */
    for (int i = 0; i < PER; i++) CHECK((hs[i] = pack_new(&f, sizes[i], (uint64_t)(step * PER + i), &sums[i])));
    for (int i = PER - 1; i >= 0; i--)
      if (unpack_check(&f, hs[i], sizes[i], sums[i])) return 1;
    CHECK_OK(ferry_step_end(f.e));
    ferry_stats s;
    CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
    CHECK_EQ(s.live_handles, 0);
    CHECK_EQ(s.arena_in_use, 0);
    if (step == 0) allocs_after_warmup = s.backend_pinned_allocs;
    CHECK_EQ(s.backend_pinned_allocs, allocs_after_warmup);
  }
  if (check_quiescent(&f)) return 1;
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.steps, (uint64_t)steps);
  ferry_engine_destroy(f.e);
  return 0;
}

/* ---- error paths ------------------------------------------------------------------------ */
TEST(stash_error_paths_lose_nothing) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.max_fwd_stash = 0;
  CHECK_OK(fixture_open(&f, &c));
  uint64_t sum;
  ferry_handle h = pack_new(&f, 5000, 1, &sum);
  CHECK(h);
  void *dev, *owner;

  /* allocator callback fails: error, handle stays valid */
  atomic_store(&f.dev.alloc_failures_to_inject, 1);
  CHECK_RC(ferry_unpack(f.e, h, NULL, &dev, &owner), FERRY_EALLOC);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "allocator callback failed");
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.alloc_failures, 1);
  if (unpack_check(&f, h, 5000, sum)) return 1;

  /* double unpack, unknown handles */
  CHECK_RC(ferry_unpack(f.e, h, NULL, &dev, &owner), FERRY_EHANDLE);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "unknown, stale or already used");
  CHECK_RC(ferry_unpack(f.e, 0, NULL, &dev, &owner), FERRY_EHANDLE);
  CHECK_RC(ferry_unpack(f.e, 0xdeadbeef00000001ull, NULL, &dev, &owner), FERRY_EHANDLE);
  CHECK_RC(ferry_discard(f.e, h), FERRY_EHANDLE);

  /* bad descriptors: rejected, the owner is not taken */
  test_buffer *b = test_buffer_new(64);
  ferry_tensor_desc d = desc_of(64, 0);
  ferry_handle out = 77;
  d.bytes = 0;
  CHECK_RC(ferry_pack(f.e, &d, b->ptr, b, NULL, &out), FERRY_EINVAL);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "desc.bytes");
  CHECK_EQ(out, 0);
  d = desc_of(64, 0);
  d.ndim = 9;
  CHECK_RC(ferry_pack(f.e, &d, b->ptr, b, NULL, &out), FERRY_EINVAL);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "desc.ndim");
  d = desc_of(64, 0);
  d.kind = 17;
  CHECK_RC(ferry_pack(f.e, &d, b->ptr, b, NULL, &out), FERRY_EINVAL);
  d = desc_of(64, 0);
  CHECK_RC(ferry_pack(f.e, &d, NULL, b, NULL, &out), FERRY_EINVAL);
  CHECK_RC(ferry_pack(f.e, NULL, b->ptr, b, NULL, &out), FERRY_EINVAL);
  CHECK_RC(ferry_pack(f.e, &d, b->ptr, b, NULL, NULL), FERRY_EINVAL);
  CHECK_EQ(atomic_load(&b->refs), 1);

  /* a nonsense decision from the callback is kept and counted */
  f.dec.mode = 5;
  ferry_handle hk;
  atomic_fetch_add(&b->refs, 1);
  CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &hk));
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  CHECK_EQ(s.policy_errors, 1);
  CHECK_EQ(s.tensors_kept, 1);
  CHECK_OK(ferry_unpack(f.e, hk, NULL, &dev, &owner));
  CHECK(owner == b && dev == b->ptr);
  test_buffer_unref(b);

  /* step misuse */
  CHECK_OK(ferry_step_end(f.e));
  CHECK_RC(ferry_step_end(f.e), FERRY_ESTATE);
  CHECK_OK(ferry_step_begin(f.e));
  CHECK_RC(ferry_step_begin(f.e), FERRY_ESTATE);
  CHECK_OK(ferry_step_end(f.e));

  /* calls on a destroyed engine */
  ferry_engine *dead = f.e;
  ferry_engine_destroy(f.e);
  CHECK_RC(ferry_pack(dead, &d, b->ptr, b, NULL, &out), FERRY_ESTATE);
  CHECK_RC(ferry_unpack(dead, h, NULL, &dev, &owner), FERRY_ESTATE);
  CHECK_RC(ferry_step_begin(dead), FERRY_ESTATE);
  CHECK_STR_CONTAINS(ferry_last_error(dead), "not a live ferry engine");
  CHECK_RC(ferry_pack(NULL, &d, b->ptr, b, NULL, &out), FERRY_EINVAL);
  test_buffer_unref(b);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

/* The backend's pinned allocator really fails (address-space limit in a
 * child process): the offload falls back to keeping, nothing is lost. */
TEST(stash_backend_alloc_failure_keeps) {
  if (UNDER_SANITIZER || RUNNING_ON_VALGRIND || test_backend_kind() != FERRY_BACKEND_HOST) {
    printf("skipped: RLIMIT_AS cannot be used under a sanitizer's or valgrind's address space\n");
    return 0;
  }
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    fixture f;
    ferry_config c = fixture_config(&f, 1);
    if (fixture_open(&f, &c)) _exit(10);
    enum { SZ = 256 << 20 };
    test_buffer *b = test_buffer_new(SZ);
    if (!b) _exit(11);
    fill(b, 9);
    uint64_t sum = dev_checksum(b->ptr, SZ);
    ferry_tensor_desc d = desc_of(SZ, 0);
    FILE *st = fopen("/proc/self/statm", "r");
    unsigned long pages = 0;
    if (!st || fscanf(st, "%lu", &pages) != 1) _exit(12);
    fclose(st);
    struct rlimit rl = {(rlim_t)pages * 4096 + (64u << 20), (rlim_t)pages * 4096 + (64u << 20)};
    if (setrlimit(RLIMIT_AS, &rl)) _exit(13);
    ferry_handle h;
    if (ferry_pack(f.e, &d, b->ptr, b, NULL, &h)) _exit(14);
    ferry_stats s;
    ferry_get_stats(f.e, &s, sizeof s);
    if (s.cap_fallbacks != 1 || s.tensors_kept != 1) _exit(15);
    void *dev, *owner;
    if (ferry_unpack(f.e, h, NULL, &dev, &owner) || owner != b) _exit(16);
    if (dev_checksum(dev, SZ) != sum) _exit(17);
    _exit(0);
  }
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status));
  CHECK_EQ(WEXITSTATUS(status), 0);
  return 0;
}

TEST(stash_step_end_reports_leaks) {
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  CHECK_OK(fixture_open(&f, &c));
  uint64_t sum;
  CHECK_OK(ferry_step_begin(f.e));
  ferry_handle h = pack_new(&f, 10000, 3, &sum);
  CHECK_RC(ferry_step_end(f.e), FERRY_ELEAK);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "1 handle(s) neither unpacked nor discarded");
  if (unpack_check(&f, h, 10000, sum)) return 1; /* still valid */
  CHECK_OK(ferry_step_begin(f.e));
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  /* destroy with live handles gives every owner back */
  h = pack_new(&f, 10000, 4, &sum);
  CHECK(h);
  ferry_engine_destroy(f.e);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

/* ---- threads ---------------------------------------------------------------------------- */
typedef struct channel {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  ferry_handle h[512];
  uint64_t sum[512];
  size_t size[512];
  int head, tail, done;
} channel;

typedef struct thread_ctx {
  fixture *f;
  channel *ch;
  int failures;
  int count;
} thread_ctx;

static void *producer(void *arg) {
  thread_ctx *t = arg;
  uint64_t rng = 555;
  for (int i = 0; i < t->count; i++) {
    size_t sz = 1 + (size_t)(rng_next(&rng) % 50000);
    uint64_t sum;
    ferry_handle h = pack_new(t->f, sz, rng, &sum);
    if (!h) t->failures++;
    pthread_mutex_lock(&t->ch->mu);
    while (t->ch->tail - t->ch->head == 512) pthread_cond_wait(&t->ch->cv, &t->ch->mu);
    int k = t->ch->tail++ % 512;
    t->ch->h[k] = h;
    t->ch->sum[k] = sum;
    t->ch->size[k] = sz;
    pthread_cond_broadcast(&t->ch->cv);
    pthread_mutex_unlock(&t->ch->mu);
  }
  pthread_mutex_lock(&t->ch->mu);
  t->ch->done = 1;
  pthread_cond_broadcast(&t->ch->cv);
  pthread_mutex_unlock(&t->ch->mu);
  return NULL;
}

static void *consumer(void *arg) {
  thread_ctx *t = arg;
  for (;;) {
    pthread_mutex_lock(&t->ch->mu);
    while (t->ch->tail == t->ch->head && !t->ch->done) pthread_cond_wait(&t->ch->cv, &t->ch->mu);
    if (t->ch->tail == t->ch->head) {
      pthread_mutex_unlock(&t->ch->mu);
      return NULL;
    }
    int k = t->ch->head++ % 512;
    ferry_handle h = t->ch->h[k];
    uint64_t sum = t->ch->sum[k];
    size_t sz = t->ch->size[k];
    pthread_cond_broadcast(&t->ch->cv);
    pthread_mutex_unlock(&t->ch->mu);
    if (h && unpack_check(t->f, h, sz, sum)) t->failures++;
  }
}

TEST(stash_pack_unpack_on_two_threads) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  c.max_fwd_stash = 4;
  CHECK_OK(fixture_open(&f, &c));
  f.dec.reload = FERRY_RELOAD_PREFETCH;
  f.dec.distance = 2;
  channel ch;
  memset(&ch, 0, sizeof ch);
  pthread_mutex_init(&ch.mu, NULL);
  pthread_cond_init(&ch.cv, NULL);
  thread_ctx tp = {&f, &ch, 0, 3000}, tc = {&f, &ch, 0, 0};
  pthread_t a, b;
  CHECK_OK(ferry_step_begin(f.e));
  pthread_create(&a, NULL, producer, &tp);
  pthread_create(&b, NULL, consumer, &tc);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  CHECK_EQ(tp.failures, 0);
  CHECK_EQ(tc.failures, 0);
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  pthread_mutex_destroy(&ch.mu);
  pthread_cond_destroy(&ch.cv);
  return 0;
}

/* Backward unpacks while a "recompute" thread packs (activation
 * checkpointing): both directions at once, on two threads. */
typedef struct recompute_ctx {
  fixture *f;
  int failures;
} recompute_ctx;

static void *recompute_thread(void *arg) {
  recompute_ctx *r = arg;
  for (int i = 0; i < 500; i++) {
    uint64_t sum;
    ferry_handle h = pack_new(r->f, 3000 + (size_t)i * 7, (uint64_t)i, &sum);
    if (!h || unpack_check(r->f, h, 3000 + (size_t)i * 7, sum)) r->failures++;
  }
  return NULL;
}

TEST(stash_recompute_during_backward) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  c.max_fwd_stash = 1;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 500 };
  ferry_handle hs[M];
  uint64_t sums[M];
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, 2000 + (size_t)i, (uint64_t)i, &sums[i])));
  CHECK_OK(ferry_backward_begin(f.e));
  recompute_ctx r = {&f, 0};
  pthread_t t;
  pthread_create(&t, NULL, recompute_thread, &r);
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], 2000 + (size_t)i, sums[i])) return 1;
  pthread_join(t, NULL);
  CHECK_EQ(r.failures, 0);
  CHECK_OK(ferry_step_end(f.e));
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);
  return 0;
}
