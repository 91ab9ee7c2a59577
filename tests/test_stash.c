/* test_stash.c — the stash manager through the public API: round trips,
 * the forward-stash bound, prefetch, aliasing, the cap, leaks over many
 * steps, error paths, threads, and the trace recorder. Runs over whichever
 * backend FERRY_TEST_BACKEND names. */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <valgrind/valgrind.h>

#include "test.h"
#include "test_device.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define UNDER_SANITIZER 1
#else
#define UNDER_SANITIZER 0
#endif

/* ---- fixtures ---------------------------------------------------------- */
typedef struct decider {
  uint64_t rng;
  int mode; /* 0 keep, 1 offload, 2 random */
  int reload;
  int distance;
  atomic_long calls;
} decider;

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int decide_cb(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                     ferry_decision *out) {
  decider *x = ud;
  atomic_fetch_add(&x->calls, 1);
  out->action = x->mode == 2 ? (int)(rng_next(&x->rng) & 1) : x->mode;
  out->reload = x->reload;
  out->prefetch_distance = x->distance;
  out->cacheable = 0;
  return 0;
}

typedef struct fixture {
  ferry_engine *e;
  test_device_stats dev;
  decider dec;
} fixture;

static ferry_config fixture_config(fixture *f, int mode) {
  memset(f, 0, sizeof *f);
  f->dec.mode = mode;
  f->dec.rng = 42;
  f->dec.distance = -1;
  ferry_config c = FERRY_CONFIG_INIT;
  c.backend = test_backend_kind();
  c.arena = test_arena_kind();
  c.device_alloc = test_device_alloc_cb;
  c.release = test_device_release_cb;
  c.retain = test_device_retain_cb;
  c.callback_ud = &f->dev;
  c.decide = decide_cb;
  c.decide_ud = &f->dec;
  c.min_offload_bytes = 1;
  return c;
}

static int fixture_open(fixture *f, ferry_config *c) {
  char err[512] = "";
  int rc = ferry_engine_create(c, &f->e, err, sizeof err);
  if (rc) fprintf(stderr, "engine create failed: %s\n", err);
  return rc;
}

/* FNV-1a over 64-bit words, then the tail bytes: fast enough for MBs. */
static uint64_t fnv(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull, w;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    memcpy(&w, p + i, 8);
    h = (h ^ w) * 1099511628211ull;
  }
  for (; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void fill(test_buffer *b, uint64_t seed) {
  unsigned char *tmp = malloc(b->bytes);
  for (size_t i = 0; i < b->bytes; i += 8) {
    uint64_t r = rng_next(&seed);
    memcpy(tmp + i, &r, b->bytes - i < 8 ? b->bytes - i : 8);
  }
  test_dev_write(b->ptr, tmp, b->bytes);
  free(tmp);
}

static uint64_t dev_checksum(const void *dev, size_t bytes) {
  unsigned char *tmp = malloc(bytes);
  test_dev_read(tmp, dev, bytes);
  uint64_t h = fnv(tmp, bytes);
  free(tmp);
  return h;
}

static ferry_tensor_desc desc_of(size_t bytes, int layer) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_U8;
  d.kind = FERRY_KIND_ACTIVATION;
  d.ndim = 1;
  d.shape[0] = (int64_t)bytes;
  d.layer = layer;
  d.layer_count = 8;
  d.module_path = "model.layers.0.mlp";
  d.module_class = "MLP";
  return d;
}

/* Pack a fresh buffer of `bytes` filled from seed; hands our reference to
 * the engine. Returns the handle (0 on failure) and its checksum. */
static ferry_handle pack_new(fixture *f, size_t bytes, uint64_t seed, uint64_t *sum) {
  test_buffer *b = test_buffer_new(bytes);
  fill(b, seed);
  *sum = dev_checksum(b->ptr, bytes);
  ferry_tensor_desc d = desc_of(bytes, (int)(seed % 8));
  ferry_handle h = 0;
  if (ferry_pack(f->e, &d, b->ptr, b, NULL, &h) != FERRY_OK) {
    fprintf(stderr, "pack failed: %s\n", ferry_last_error(f->e));
    test_buffer_unref(b);
    return 0;
  }
  return h;
}

/* Unpack h, compare with sum, drop the reference we get. */
static int unpack_check(fixture *f, ferry_handle h, size_t bytes, uint64_t sum) {
  void *dev = NULL, *owner = NULL;
  int rc = ferry_unpack(f->e, h, NULL, &dev, &owner);
  if (rc) {
    fprintf(stderr, "unpack failed: %s\n", ferry_last_error(f->e));
    return 1;
  }
  test_buffer *b = owner;
  CHECK(b->ptr == dev);
  CHECK(b->bytes >= bytes);
  CHECK(dev_checksum(dev, bytes) == sum);
  test_device_release_cb(&f->dev, owner);
  return 0;
}

static int check_quiescent(fixture *f) {
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f->e, &s, sizeof s));
  CHECK_EQ(s.live_handles, 0);
  CHECK_EQ(s.arena_in_use, 0);
  CHECK_EQ(s.device_bytes_held, 0);
  CHECK_EQ(test_buffers_live(), 0);
  return 0;
}

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

/* ---- trace recorder ------------------------------------------------------------------------ */
TEST(trace_records_every_event) {
  fixture f;
  ferry_config c = fixture_config(&f, 2);
  char path[] = "/tmp/ferry-trace-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.trace_path = path;
  CHECK_OK(fixture_open(&f, &c));
  enum { M = 20 };
  ferry_handle hs[M];
  uint64_t sums[M];
  CHECK_OK(ferry_step_begin(f.e));
  for (int i = 0; i < M; i++) CHECK((hs[i] = pack_new(&f, 1000 + (size_t)i, (uint64_t)i, &sums[i])));
  CHECK_OK(ferry_backward_begin(f.e));
  for (int i = M - 1; i >= 1; i--)
    if (unpack_check(&f, hs[i], 1000 + (size_t)i, sums[i])) return 1;
  CHECK_OK(ferry_discard(f.e, hs[0]));
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  ferry_engine_destroy(f.e);

  FILE *in = fopen(path, "r");
  CHECK(in);
  char line[4096];
  int n = 0, packs = 0, unpacks = 0, discards = 0, offl = 0, steps = 0, bw = 0;
  double last_t = -1;
  while (fgets(line, sizeof line, in)) {
    cJSON *o = cJSON_Parse(line);
    CHECK(o);
    const char *ev = cJSON_GetStringValue(cJSON_GetObjectItem(o, "ev"));
    CHECK(ev);
    double t = cJSON_GetNumberValue(cJSON_GetObjectItem(o, "t_us"));
    CHECK(t >= last_t);
    last_t = t;
    if (n == 0) {
      CHECK(strcmp(ev, "header") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "format")), "ferry-trace") == 0);
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "version")), 1);
    } else if (!strcmp(ev, "pack")) {
      packs++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), packs);
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "bytes")), 1000 + packs - 1);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "module")), "model.layers.0.mlp") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "kind")), "activation") == 0);
      CHECK(strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "dtype")), "u8") == 0);
      CHECK(cJSON_GetArraySize(cJSON_GetObjectItem(o, "shape")) == 1);
      offl += !strcmp(cJSON_GetStringValue(cJSON_GetObjectItem(o, "decision")), "offload");
    } else if (!strcmp(ev, "unpack")) {
      unpacks++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), M - unpacks + 1);
    } else if (!strcmp(ev, "discard")) {
      discards++;
      CHECK_EQ(cJSON_GetNumberValue(cJSON_GetObjectItem(o, "id")), 1);
    } else if (!strcmp(ev, "step_begin") || !strcmp(ev, "step_end")) {
      steps++;
    } else if (!strcmp(ev, "backward_begin") || !strcmp(ev, "backward_end")) {
      bw++;
    } else {
      CHECK(!"unexpected event");
    }
    cJSON_Delete(o);
    n++;
  }
  fclose(in);
  unlink(path);
  CHECK_EQ(packs, M);
  CHECK_EQ(unpacks, M - 1);
  CHECK_EQ(discards, 1);
  CHECK_EQ(steps, 2);
  CHECK_EQ(bw, 2);
  CHECK_EQ(offl, (int)s.tensors_offloaded);
  return 0;
}

/* ---- Chrome trace of the run (chrome_recorder.c) ------------------------------------------- */
/* The trace file parsed (NULL if it does not parse); the caller frees it. */
static cJSON *chrome_load(const char *path) {
  FILE *in = fopen(path, "r");
  if (!in) return NULL;
  fseek(in, 0, SEEK_END);
  long n = ftell(in);
  fseek(in, 0, SEEK_SET);
  char *text = malloc((size_t)n + 1);
  size_t got = text ? fread(text, 1, (size_t)n, in) : 0;
  fclose(in);
  if (!text) return NULL;
  text[got] = 0;
  cJSON *root = cJSON_Parse(text);
  free(text);
  return root;
}

static const char *ev_str(const cJSON *e, const char *key) {
  return cJSON_GetStringValue(cJSON_GetObjectItem(e, key));
}
static double ev_num(const cJSON *e, const char *key) {
  return cJSON_GetNumberValue(cJSON_GetObjectItem(e, key));
}
static double ev_arg(const cJSON *e, const char *key) {
  return cJSON_GetNumberValue(cJSON_GetObjectItem(cJSON_GetObjectItem(e, "args"), key));
}

/* Counts events with phase ph (and name, when not NULL). */
static int chrome_count(const cJSON *events, const char *ph, const char *name) {
  int n = 0;
  const cJSON *e;
  cJSON_ArrayForEach(e, events)
    n += !strcmp(ev_str(e, "ph"), ph) && (!name || !strcmp(ev_str(e, "name"), name));
  return n;
}

/* Two steps of offloads over a slow host link (the CUDA double's copies are
 * slow too): the trace parses after each step end; its copies are the
 * engine's (count, bytes each way); a stream's copies do not overlap and, on
 * the host link, each lasts at least its bytes at the link's rate (the
 * worker's times, not the issuing call's); every arrow joins an offload to
 * the reload of the same tensor. An unwritable path fails creation. */
TEST(chrome_trace_times_copies_and_joins_them) {
  enum { STEPS = 2, M = 24 };
  const double rate = 200e6; /* B/s */
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  char path[] = "/tmp/ferry-chrome-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  c.chrome_trace_path = path;
  c.link = (ferry_link){rate, rate, 0, 1.0};
  CHECK_OK(fixture_open(&f, &c));
  for (int step = 0; step < STEPS; step++) {
    ferry_handle hs[M];
    uint64_t sums[M];
    CHECK_OK(ferry_step_begin(f.e));
    for (int i = 0; i < M; i++)
      CHECK((hs[i] = pack_new(&f, 4096 + 64 * (size_t)i, (uint64_t)(step * M + i), &sums[i])));
    CHECK_OK(ferry_backward_begin(f.e));
    for (int i = M - 1; i >= 1; i--)
      if (unpack_check(&f, hs[i], 4096 + 64 * (size_t)i, sums[i])) return 1;
    CHECK_OK(ferry_discard(f.e, hs[0]));
    CHECK_OK(ferry_step_end(f.e));
    cJSON *mid = chrome_load(path); /* whole at every step end */
    CHECK(mid);
    CHECK_EQ(chrome_count(cJSON_GetObjectItem(mid, "traceEvents"), "i", "step end"), step + 1);
    cJSON_Delete(mid);
  }
  if (check_quiescent(&f)) return 1;
  ferry_stats s;
  CHECK_OK(ferry_get_stats(f.e, &s, sizeof s));
  ferry_engine_destroy(f.e);

  cJSON *root = chrome_load(path);
  CHECK(root);
  const cJSON *events = cJSON_GetObjectItem(root, "traceEvents"), *e;
  double bytes[2] = {0, 0}, end[2] = {0, 0};
  int copies[2] = {0, 0}, slow = 0, overlap = 0, joined = 0;
  cJSON_ArrayForEach(e, events) {
    const char *cat = ev_str(e, "cat");
    if (strcmp(ev_str(e, "ph"), "X") || !cat) continue;
    int dir = !strcmp(cat, "offload") ? 0 : !strcmp(cat, "reload") ? 1 : -1;
    if (dir < 0) continue;
    double ts = ev_num(e, "ts"), dur = ev_num(e, "dur"), b = ev_arg(e, "bytes");
    CHECK_EQ(ev_num(e, "tid"), dir + 1); /* "D2H copies", "H2D copies" */
    CHECK(strcmp(ev_str(e, "name"), "model.layers.0.mlp") == 0);
    copies[dir]++;
    bytes[dir] += b;
    overlap += ts + 0.002 < end[dir]; /* written in completion order */
    end[dir] = ts + dur;
    slow += test_backend_kind() == FERRY_BACKEND_HOST && dur < b / rate * 1e6 * 0.95;
    if (dir == 0) continue;
    /* the arrow into this reload starts on the offload of its tensor */
    const cJSON *g, *h;
    cJSON_ArrayForEach(g, events) {
      if (strcmp(ev_str(g, "ph"), "f") || ev_num(g, "ts") != ts) continue;
      cJSON_ArrayForEach(h, events) {
        if (strcmp(ev_str(h, "ph"), "s") || ev_num(h, "id") != ev_num(g, "id")) continue;
        const cJSON *o;
        cJSON_ArrayForEach(o, events)
          joined += !strcmp(ev_str(o, "ph"), "X") && ev_str(o, "cat") &&
                    !strcmp(ev_str(o, "cat"), "offload") && ev_num(o, "ts") == ev_num(h, "ts") &&
                    ev_arg(o, "tensor") == ev_arg(e, "tensor") &&
                    ev_num(o, "ts") + ev_num(o, "dur") <= ts + 0.002;
      }
    }
  }
  CHECK_EQ(copies[0], s.tensors_offloaded);
  CHECK_EQ(bytes[0], s.bytes_d2h);
  CHECK_EQ(bytes[1], s.bytes_h2d);
  CHECK(copies[1] > 0);
  CHECK_EQ(overlap, 0);
  CHECK_EQ(slow, 0);
  CHECK_EQ(joined, copies[1]); /* every reload here follows its offload */
  CHECK_EQ(chrome_count(events, "s", NULL), copies[1]);
  CHECK_EQ(chrome_count(events, "f", NULL), copies[1]);
  CHECK_EQ(chrome_count(events, "X", "pack"), STEPS * M);
  CHECK_EQ(chrome_count(events, "i", "backward"), STEPS);
  cJSON_Delete(root);
  unlink(path);

  c = fixture_config(&f, 1);
  c.chrome_trace_path = "/nonexistent-dir/trace.json";
  char err[512] = "";
  ferry_engine *e2 = NULL;
  CHECK_RC(ferry_engine_create(&c, &e2, err, sizeof err), FERRY_EIO);
  CHECK_STR_CONTAINS(err, "/nonexistent-dir/trace.json");
  return 0;
}

/* Two engines on one thread, calls interleaved: each file has one lane for
 * the thread (not one per switch). A second engine given a file another
 * engine is writing is refused (it would truncate it); once that engine is
 * gone the file may be used again. */
TEST(chrome_trace_one_file_per_engine) {
  fixture f, g;
  ferry_config c = fixture_config(&f, 1), d = fixture_config(&g, 1);
  char p1[] = "/tmp/ferry-chrome-XXXXXX", p2[] = "/tmp/ferry-chrome-XXXXXX";
  int fd1 = mkstemp(p1), fd2 = mkstemp(p2);
  CHECK(fd1 >= 0 && fd2 >= 0);
  close(fd1);
  close(fd2);
  c.chrome_trace_path = p1;
  d.chrome_trace_path = p2;
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(fixture_open(&g, &d));
  enum { M = 6 };
  ferry_handle hf[M], hg[M];
  uint64_t sf[M], sg[M];
  for (int i = 0; i < M; i++) {
    CHECK((hf[i] = pack_new(&f, 2048, (uint64_t)i, &sf[i])));
    CHECK((hg[i] = pack_new(&g, 2048, (uint64_t)i + 100, &sg[i])));
  }
  for (int i = M - 1; i >= 0; i--)
    if (unpack_check(&f, hf[i], 2048, sf[i]) || unpack_check(&g, hg[i], 2048, sg[i])) return 1;
  CHECK_OK(ferry_step_end(f.e));
  CHECK_OK(ferry_step_end(g.e));
  fixture h;
  ferry_config twice = fixture_config(&h, 1);
  twice.chrome_trace_path = p1;
  char err[512] = "";
  ferry_engine *e3 = NULL;
  CHECK_RC(ferry_engine_create(&twice, &e3, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "another engine");
  ferry_engine_destroy(f.e);
  ferry_engine_destroy(g.e);
  for (int k = 0; k < 2; k++) {
    cJSON *root = chrome_load(k ? p2 : p1);
    CHECK(root);
    const cJSON *events = cJSON_GetObjectItem(root, "traceEvents");
    CHECK_EQ(chrome_count(events, "M", "thread_name"), 3); /* D2H, H2D, this thread */
    CHECK_EQ(chrome_count(events, "X", "pack"), M);
    cJSON_Delete(root);
  }
  CHECK_OK(ferry_engine_create(&twice, &e3, err, sizeof err)); /* free again */
  ferry_engine_destroy(e3);
  unlink(p1);
  unlink(p2);
  return 0;
}

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

/* ---- config.count_reasons: saved tensors by rule and layer -------------- */

typedef struct bd_rows {
  int n;
  char rule[8][64], where[8][64];
  ferry_breakdown_row row[8];
} bd_rows;

static void collect_row(void *ud, const ferry_breakdown_row *r) {
  bd_rows *b = ud;
  if (b->n >= 8) return;
  snprintf(b->rule[b->n], sizeof b->rule[0], "%s", r->rule);
  snprintf(b->where[b->n], sizeof b->where[0], "%s", r->where);
  b->row[b->n++] = *r;
}

/* the row of (rule, where, layer); fails the test when absent */
static const ferry_breakdown_row *bd_row(const bd_rows *b, const char *rule, const char *where,
                                         int layer) {
  for (int i = 0; i < b->n; i++)
    if (!strcmp(b->rule[i], rule) && !strcmp(b->where[i], where) && b->row[i].layer == layer)
      return &b->row[i];
  fprintf(stderr, "  no row (%s, %s, layer %d) among %d:\n", rule, where, layer, b->n);
  for (int i = 0; i < b->n; i++)
    fprintf(stderr, "    (%s, %s, layer %d)\n", b->rule[i], b->where[i], b->row[i].layer);
  return NULL;
}

#define CHECK_ROW(b, rule, where, layer, t_off, b_off, t_kept, b_kept)      \
  do {                                                                     \
    const ferry_breakdown_row *r_ = bd_row((b), (rule), (where), (layer)); \
    CHECK(r_ != NULL);                                                     \
    CHECK_EQ(r_->tensors_offloaded, (uint64_t)(t_off));                    \
    CHECK_EQ(r_->bytes_offloaded, (uint64_t)(b_off));                      \
    CHECK_EQ(r_->tensors_kept, (uint64_t)(t_kept));                        \
    CHECK_EQ(r_->bytes_kept, (uint64_t)(b_kept));                          \
  } while (0)

/* desc_of's tensor in a module of its own layer, as real module paths are */
static ferry_tensor_desc desc_in_layer(size_t bytes, int layer) {
  static char paths[8][32];
  snprintf(paths[layer], sizeof paths[layer], "model.layers.%d.mlp", layer);
  ferry_tensor_desc d = desc_of(bytes, layer);
  d.module_path = paths[layer];
  return d;
}

TEST(stash_breakdown_by_rule_and_layer) {
  enum { BIG = 8192, SMALL = 3000, TINY = 100 };
  fixture f;
  ferry_config c = fixture_config(&f, 1);
  c.decide = NULL;
  c.policy_source = "local R = require 'ferry.rules'\n"
                    "return R.policy {\n"
                    "  R.when(function(t) return t.bytes >= 4096 end, { name = 'big' }),\n"
                    "  R.first_layers(2),\n"
                    "}\n";
  c.min_offload_bytes = 1024;
  c.max_fwd_stash = 0;
  c.host_cap_bytes = 3 * BIG; /* the fourth offload finds the arena full */
  c.count_reasons = 1;
  CHECK_OK(fixture_open(&f, &c));
  CHECK_OK(ferry_step_begin(f.e));
  /* (bytes, layer): what the policy and the engine make of each */
  const struct { size_t bytes; int layer; } packs[] = {
      {BIG, 0}, {BIG, 1}, {BIG, 1}, /* offloaded: every rule passed */
      {BIG, 0},                     /* offload asked, the arena is full */
      {BIG, 5}, {BIG, 7},           /* first_layers(2) keeps */
      {SMALL, 0},                   /* the policy's 'big' keeps */
      {SMALL, 5},                   /* first_layers runs first (rule stages) */
      {TINY, 1},                    /* under min_offload_bytes: Lua is not asked */
  };
  enum { N = sizeof packs / sizeof packs[0] };
  ferry_handle hs[N];
  uint64_t sums[N];
  for (int i = 0; i < N; i++) {
    test_buffer *b = test_buffer_new(packs[i].bytes);
    fill(b, (uint64_t)i);
    sums[i] = dev_checksum(b->ptr, packs[i].bytes);
    ferry_tensor_desc d = desc_in_layer(packs[i].bytes, packs[i].layer);
    CHECK_OK(ferry_pack(f.e, &d, b->ptr, b, NULL, &hs[i]));
  }
  CHECK_OK(ferry_backward_begin(f.e));
  for (int i = N - 1; i >= 0; i--)
    if (unpack_check(&f, hs[i], packs[i].bytes, sums[i])) return 1;
  CHECK_OK(ferry_backward_end(f.e));
  CHECK_OK(ferry_step_end(f.e));
  bd_rows b = {0};
  CHECK_OK(ferry_get_breakdown(f.e, collect_row, &b));
  CHECK_EQ(b.n, 7);
  CHECK_ROW(&b, "all rules passed", "policy:2", 0, 1, BIG, 0, 0);
  CHECK_ROW(&b, "all rules passed", "policy:2", 1, 2, 2 * BIG, 0, 0);
  CHECK_ROW(&b, "host cap", "", 0, 0, 0, 1, BIG);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 5, 0, 0, 2, BIG + SMALL);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 7, 0, 0, 1, BIG);
  CHECK_ROW(&b, "when(big)", "policy:3", 0, 0, 0, 1, SMALL);
  CHECK_ROW(&b, "min_offload_bytes", "", 1, 0, 0, 1, TINY);
  /* a second step: the site cache answers, with the same reasons */
  CHECK_OK(ferry_step_begin(f.e));
  test_buffer *again = test_buffer_new(BIG);
  fill(again, 99);
  uint64_t sum = dev_checksum(again->ptr, BIG);
  ferry_tensor_desc d = desc_in_layer(BIG, 5);
  ferry_handle h;
  CHECK_OK(ferry_pack(f.e, &d, again->ptr, again, NULL, &h));
  if (unpack_check(&f, h, BIG, sum)) return 1;
  CHECK_OK(ferry_step_end(f.e));
  memset(&b, 0, sizeof b);
  CHECK_OK(ferry_get_breakdown(f.e, collect_row, &b));
  CHECK_EQ(b.n, 7);
  CHECK_ROW(&b, "first_layers(2)", "policy:4", 5, 0, 0, 3, 2 * BIG + SMALL);
  if (check_quiescent(&f)) return 1;
  ferry_engine_destroy(f.e);

  /* without count_reasons: refused, naming the field */
  c = fixture_config(&f, 1);
  CHECK_OK(fixture_open(&f, &c));
  CHECK_EQ(ferry_get_breakdown(f.e, collect_row, &b), FERRY_ESTATE);
  CHECK_STR_CONTAINS(ferry_last_error(f.e), "config.count_reasons");
  ferry_engine_destroy(f.e);
  return 0;
}

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
