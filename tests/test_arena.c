/* test_arena.c — the pinned host arena, both kinds (jemalloc and pool).
 *
 * The arena runs over a counting backend defined here: its host_alloc maps
 * fresh pages (test_pages_backend.h) and it counts calls and outstanding
 * bytes, so the tests can see every byte the arena takes from and gives
 * back to a backend. The test binary is linked with jemalloc, so both kinds
 * are available and each test forces each kind explicitly. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_pages_backend.h"

/* ---- counting backend ----------------------------------------------------- */

typedef struct counting_backend {
  ferry_backend base;
  atomic_long allocs, frees, bad_alignments;
  atomic_llong outstanding_bytes;
  atomic_int fail_allocs; /* host_alloc fails while set */
  /* The first CHUNK_LOG allocations, to check where arena blocks lie. */
  pthread_mutex_t log_lock;
  struct { uintptr_t addr; size_t bytes; } chunks[256];
  int n_chunks;
} counting_backend;

#define CHUNK_LOG 256

static int counting_host_alloc(ferry_backend *b, size_t bytes, size_t alignment,
                               void **out) {
  counting_backend *cb = (counting_backend *)b;
  atomic_fetch_add(&cb->allocs, 1);
  if (alignment == 0 || (alignment & (alignment - 1)) || alignment > ((size_t)2 << 20))
    atomic_fetch_add(&cb->bad_alignments, 1);
  if (atomic_load(&cb->fail_allocs)) {
    snprintf(b->err, sizeof b->err, "counting backend: failing on request");
    return FERRY_ENOMEM;
  }
  void *p = pages_map(bytes, alignment);
  if (!p) return FERRY_ENOMEM;
  atomic_fetch_add(&cb->outstanding_bytes, (long long)bytes);
  pthread_mutex_lock(&cb->log_lock);
  if (cb->n_chunks < CHUNK_LOG) {
    cb->chunks[cb->n_chunks].addr = (uintptr_t)p;
    cb->chunks[cb->n_chunks++].bytes = bytes;
  }
  pthread_mutex_unlock(&cb->log_lock);
  *out = p;
  return 0;
}

static int counting_host_free(ferry_backend *b, void *p, size_t bytes) {
  counting_backend *cb = (counting_backend *)b;
  atomic_fetch_add(&cb->frees, 1);
  atomic_fetch_sub(&cb->outstanding_bytes, (long long)bytes);
  pages_unmap(p, bytes);
  return 0;
}

static const ferry_backend_ops counting_ops = {
    .name = "counting",
    .host_alloc = counting_host_alloc,
    .host_free = counting_host_free,
};

static void counting_init(counting_backend *cb) {
  memset(cb, 0, sizeof *cb);
  cb->base.ops = &counting_ops;
  pthread_mutex_init(&cb->log_lock, NULL);
}

/* Whether [p, p + n) lies inside one logged backend allocation. */
static int in_one_chunk(counting_backend *cb, const void *p, size_t n) {
  uintptr_t a = (uintptr_t)p;
  for (int i = 0; i < cb->n_chunks; i++)
    if (a >= cb->chunks[i].addr && a + n <= cb->chunks[i].addr + cb->chunks[i].bytes)
      return 1;
  return 0;
}

/* ---- helpers -------------------------------------------------------------- */

static const char *kind_label(int kind) {
  return kind == FERRY_ARENA_JEMALLOC ? "jemalloc" : "pool";
}

/* Both kinds, also under the sanitizers: ASan and TSan replace malloc, and
 * the jemalloc arena only uses jemalloc's mallocx/mallctl, which still work
 * next to them. */
static int arena_kinds_to_test(int kinds[2]) {
  kinds[0] = FERRY_ARENA_JEMALLOC;
  kinds[1] = FERRY_ARENA_POOL;
  return 2;
}

static uint8_t pattern_byte(uint64_t seed, size_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 29;
  return (uint8_t)(x * 0xBF58476D1CE4E5B9ull >> 56);
}

static void fill_pattern(void *p, size_t n, uint64_t seed) {
  uint8_t *b = p;
  for (size_t i = 0; i < n; i++) b[i] = pattern_byte(seed, i);
}

static int check_pattern(const void *p, size_t n, uint64_t seed) {
  const uint8_t *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != pattern_byte(seed, i)) return 0;
  return 1;
}

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Log-uniform size in [lo, hi]. */
static size_t log_uniform(uint64_t *rng, size_t lo, size_t hi) {
  double u = (double)(rng_next(rng) >> 11) / 9007199254740992.0;
  double v = (double)lo * pow((double)hi / (double)lo, u);
  size_t s = (size_t)v;
  return s < lo ? lo : s > hi ? hi : s;
}

static int create_arena(counting_backend *cb, int kind, uint64_t cap, ferry_arena **a) {
  char err[256] = "";
  int rc = ferry_arena_create(&cb->base, kind, cap, a, err, sizeof err);
  if (rc != FERRY_OK)
    fprintf(stderr, "ferry_arena_create(%s): %s\n", kind_label(kind), err);
  return rc;
}

/* ---- tests ---------------------------------------------------------------- */

TEST(arena_kind_selection) {
  counting_backend cb;
  counting_init(&cb);
  ferry_arena *a = NULL;
  char err[256] = "";

  /* The test binary is linked with jemalloc: AUTO picks it. */
  CHECK_EQ(ferry_arena_jemalloc_available(), 1);
  CHECK_OK(ferry_arena_create(&cb.base, FERRY_ARENA_AUTO, 0, &a, err, sizeof err));
  CHECK(strcmp(ferry_arena_kind_name(a), "jemalloc") == 0);
  ferry_arena_destroy(a);
  CHECK_OK(ferry_arena_create(&cb.base, FERRY_ARENA_POOL, 0, &a, err, sizeof err));
  CHECK(strcmp(ferry_arena_kind_name(a), "pool") == 0);
  ferry_arena_destroy(a);

  /* Bad input gets an error that names the problem. */
  a = (ferry_arena *)&cb; /* must be reset to NULL on failure */
  CHECK_RC(ferry_arena_create(&cb.base, 7, 0, &a, err, sizeof err), FERRY_EINVAL);
  CHECK(a == NULL);
  CHECK_STR_CONTAINS(err, "unknown arena kind 7");
  CHECK_RC(ferry_arena_create(NULL, FERRY_ARENA_POOL, 0, &a, err, sizeof err), FERRY_EINVAL);
  CHECK_STR_CONTAINS(err, "host_alloc");
  CHECK_RC(ferry_arena_create(&cb.base, FERRY_ARENA_POOL, 0, NULL, NULL, 0), FERRY_EINVAL);

  /* No pinned memory is taken before the first allocation. */
  CHECK_EQ(atomic_load(&cb.allocs), 0);
  CHECK(ferry_mem_total_bytes() > ((uint64_t)64 << 20));
  return 0;
}

TEST(arena_round_trip_and_stats) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));

    enum { N = 64 };
    void *ptrs[N];
    size_t sizes[N];
    uint64_t rng = 0x1234 + (uint64_t)k, expect_in_use = 0, expect_peak = 0;
    for (int i = 0; i < N; i++) {
      sizes[i] = i == 0 ? 0 : i == 1 ? 1 : log_uniform(&rng, 100, (size_t)3 << 20);
      ptrs[i] = ferry_arena_alloc(a, sizes[i]);
      CHECK(ptrs[i] != NULL);
      fill_pattern(ptrs[i], sizes[i], (uint64_t)i);
      expect_in_use += sizes[i];
      if (expect_in_use > expect_peak) expect_peak = expect_in_use;
      ferry_arena_stats st;
      ferry_arena_get_stats(a, &st);
      CHECK_EQ(st.in_use, expect_in_use);
      CHECK_EQ(st.peak, expect_peak);
      CHECK(st.reserved >= st.in_use);
    }
    /* No two live allocations overlap, and each still holds its bytes. */
    for (int i = 0; i < N; i++) {
      CHECK(check_pattern(ptrs[i], sizes[i], (uint64_t)i));
      for (int j = i + 1; j < N; j++) {
        uintptr_t pi = (uintptr_t)ptrs[i], pj = (uintptr_t)ptrs[j];
        CHECK(pi + sizes[i] <= pj || pj + sizes[j] <= pi || !sizes[i] || !sizes[j]);
      }
    }
    /* Free every other one, reallocate, and check the survivors. */
    for (int i = 0; i < N; i += 2) {
      ferry_arena_free(a, ptrs[i], sizes[i]);
      expect_in_use -= sizes[i];
    }
    for (int i = 0; i < N; i += 2) {
      ptrs[i] = ferry_arena_alloc(a, sizes[i]);
      CHECK(ptrs[i] != NULL);
      fill_pattern(ptrs[i], sizes[i], (uint64_t)i + 1000);
      expect_in_use += sizes[i];
    }
    for (int i = 0; i < N; i++)
      CHECK(check_pattern(ptrs[i], sizes[i], (uint64_t)i + (i % 2 ? 0 : 1000)));
    ferry_arena_stats st;
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.in_use, expect_in_use);
    CHECK_EQ(st.peak, expect_peak);
    CHECK_EQ(st.backend_allocs, atomic_load(&cb.allocs));
    CHECK_EQ(st.reserved, atomic_load(&cb.outstanding_bytes));
    CHECK_EQ(st.cap, 0);
    CHECK_EQ(st.cap_refusals, 0);
    for (int i = 0; i < N; i++) ferry_arena_free(a, ptrs[i], sizes[i]);
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.in_use, 0);
    /* Pinned memory is held until destroy. */
    CHECK_EQ(atomic_load(&cb.frees), 0);
    CHECK_EQ(st.reserved, atomic_load(&cb.outstanding_bytes));
    CHECK_EQ(atomic_load(&cb.bad_alignments), 0);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.frees), atomic_load(&cb.allocs));
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  return 0;
}

TEST(arena_cap_is_hard) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  /* a cap just under a whole number of blocks too: the last reservation
   * would overshoot it by 2 KiB, which must be refused as well */
  for (int tight = 0; tight < 2; tight++)
  for (int k = 0; k < nk; k++) {
    const uint64_t cap = ((uint64_t)24 << 20) - (tight ? 2048 : 0);
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], cap, &a));

    enum { MAXN = 256 };
    void *ptrs[MAXN];
    const size_t block = (size_t)3 << 20;
    int n = 0;
    ferry_arena_stats st;
    while (n < MAXN) {
      void *p = ferry_arena_alloc(a, block);
      ferry_arena_get_stats(a, &st);
      CHECK(st.reserved <= cap);
      CHECK(atomic_load(&cb.outstanding_bytes) <= (long long)cap);
      if (!p) break;
      fill_pattern(p, block, (uint64_t)n);
      ptrs[n++] = p;
    }
    /* The cap, not the test's array, ended the loop, and it was counted. */
    CHECK(n < MAXN);
    CHECK(n >= 4); /* 24 MiB holds several 3 MiB blocks */
    CHECK_EQ(st.cap_refusals, 1);
    CHECK_EQ(st.in_use, (uint64_t)n * block);
    CHECK_EQ(st.cap, cap);
    /* A request larger than the cap itself is refused too. */
    CHECK(ferry_arena_alloc(a, (size_t)cap + 1) == NULL);
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.cap_refusals, 2);

    /* Freed memory is reusable without asking the backend again. */
    long allocs_before = atomic_load(&cb.allocs);
    ferry_arena_free(a, ptrs[n - 1], block);
    void *again = ferry_arena_alloc(a, block);
    CHECK(again != NULL);
    fill_pattern(again, block, 999);
    CHECK_EQ(atomic_load(&cb.allocs), allocs_before);
    for (int i = 0; i < n - 1; i++) CHECK(check_pattern(ptrs[i], block, (uint64_t)i));
    CHECK(check_pattern(again, block, 999));
    ferry_arena_free(a, again, block);
    for (int i = 0; i < n - 1; i++) ferry_arena_free(a, ptrs[i], block);

    /* Smaller sizes fit in what was freed, still under the cap. */
    void *small[64];
    int ns = 0;
    for (; ns < 64; ns++) {
      small[ns] = ferry_arena_alloc(a, (size_t)300 << 10);
      if (!small[ns]) break;
    }
    ferry_arena_get_stats(a, &st);
    CHECK(st.reserved <= cap);
    CHECK(ns >= 40); /* at least 2/3 of the cap serves 300 KiB blocks */
    for (int i = 0; i < ns; i++) ferry_arena_free(a, small[i], (size_t)300 << 10);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  return 0;
}

TEST(arena_backend_failure_is_not_a_cap_refusal) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));
    atomic_store(&cb.fail_allocs, 1);
    CHECK(ferry_arena_alloc(a, (size_t)8 << 20) == NULL);
    ferry_arena_stats st;
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.cap_refusals, 0);
    CHECK_EQ(st.reserved, 0);
    CHECK_EQ(st.in_use, 0);
    atomic_store(&cb.fail_allocs, 0);
    void *p = ferry_arena_alloc(a, (size_t)8 << 20);
    CHECK(p != NULL);
    ferry_arena_free(a, p, (size_t)8 << 20);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  return 0;
}

/* One "training step": a fixed list of sizes allocated in forward order and
 * freed in reverse, as backward would. */
#define STEP_TENSORS 120
static int run_step(ferry_arena *a, const size_t *sizes, int step) {
  void *ptrs[STEP_TENSORS];
  for (int i = 0; i < STEP_TENSORS; i++) {
    ptrs[i] = ferry_arena_alloc(a, sizes[i]);
    if (!ptrs[i]) return 1;
    /* Touch the ends only: the test is about bookkeeping, not bandwidth. */
    ((uint8_t *)ptrs[i])[0] = (uint8_t)step;
    ((uint8_t *)ptrs[i])[sizes[i] - 1] = (uint8_t)i;
  }
  for (int i = STEP_TENSORS - 1; i >= 0; i--) {
    if (((uint8_t *)ptrs[i])[0] != (uint8_t)step ||
        ((uint8_t *)ptrs[i])[sizes[i] - 1] != (uint8_t)i)
      return 1;
    ferry_arena_free(a, ptrs[i], sizes[i]);
  }
  return 0;
}

TEST(arena_steady_state_has_no_backend_calls) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  size_t sizes[STEP_TENSORS];
  uint64_t rng = 42, total = 0;
  for (int i = 0; i < STEP_TENSORS; i++) {
    sizes[i] = log_uniform(&rng, (size_t)4 << 10, (size_t)16 << 20);
    total += sizes[i];
  }
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));
    CHECK_OK(run_step(a, sizes, 0));
    ferry_arena_stats first;
    ferry_arena_get_stats(a, &first);
    CHECK_EQ(first.peak, total);
    for (int step = 1; step < 20; step++) CHECK_OK(run_step(a, sizes, step));
    ferry_arena_stats st;
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.backend_allocs, first.backend_allocs);
    CHECK_EQ(st.reserved, first.reserved);
    CHECK_EQ(st.in_use, 0);
    CHECK_EQ(st.peak, total);
    /* Far from the 2x of power-of-two pinned caches. */
    printf("  %s: reserved/peak %.3f after %" PRIu64 " backend allocations\n",
           kind_label(kinds[k]), (double)st.reserved / (double)st.peak,
           st.backend_allocs);
    CHECK((double)st.reserved <= 1.3 * (double)st.peak);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  return 0;
}

typedef struct thread_job {
  ferry_arena *a;
  uint64_t seed;
  int failures;
} thread_job;

/* Allocate, fill, check and free random sizes, keeping up to 16 live. */
static void *thread_churn(void *arg) {
  thread_job *job = arg;
  enum { LIVE = 16 };
  void *ptrs[LIVE] = {0};
  size_t sizes[LIVE] = {0};
  uint64_t rng = job->seed;
  for (int iter = 0; iter < 1500; iter++) {
    int slot = (int)(rng_next(&rng) % LIVE);
    if (ptrs[slot]) {
      if (!check_pattern(ptrs[slot], sizes[slot], job->seed + (uint64_t)slot))
        job->failures++;
      ferry_arena_free(job->a, ptrs[slot], sizes[slot]);
      ptrs[slot] = NULL;
    } else {
      sizes[slot] = log_uniform(&rng, 64, (size_t)256 << 10);
      ptrs[slot] = ferry_arena_alloc(job->a, sizes[slot]);
      if (!ptrs[slot]) {
        job->failures++;
        continue;
      }
      fill_pattern(ptrs[slot], sizes[slot], job->seed + (uint64_t)slot);
    }
  }
  for (int s = 0; s < LIVE; s++)
    if (ptrs[s]) {
      if (!check_pattern(ptrs[s], sizes[s], job->seed + (uint64_t)s)) job->failures++;
      ferry_arena_free(job->a, ptrs[s], sizes[s]);
    }
  return NULL;
}

TEST(arena_threads_allocate_and_free_concurrently) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));
    enum { THREADS = 4 };
    pthread_t th[THREADS];
    thread_job jobs[THREADS];
    for (int t = 0; t < THREADS; t++) {
      jobs[t] = (thread_job){a, 1000003u * (uint64_t)(t + 1), 0};
      CHECK(pthread_create(&th[t], NULL, thread_churn, &jobs[t]) == 0);
    }
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < THREADS; t++) CHECK_EQ(jobs[t].failures, 0);
    ferry_arena_stats st;
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.in_use, 0);
    CHECK(st.peak > 0);
    CHECK_EQ(st.reserved, atomic_load(&cb.outstanding_bytes));
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.frees), atomic_load(&cb.allocs));
  }
  return 0;
}

TEST(arena_destroy_frees_live_allocations) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));
    uint64_t rng = 7;
    for (int i = 0; i < 50; i++) {
      size_t n = log_uniform(&rng, 1000, (size_t)6 << 20);
      void *p = ferry_arena_alloc(a, n);
      CHECK(p != NULL);
      if (i % 3 == 0) ferry_arena_free(a, p, n); /* the rest stay live */
    }
    CHECK(atomic_load(&cb.allocs) > 0);
    CHECK_EQ(atomic_load(&cb.frees), 0);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.frees), atomic_load(&cb.allocs));
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  /* A fresh arena after a destroyed one starts from nothing. */
  counting_backend cb;
  counting_init(&cb);
  ferry_arena *a = NULL;
  CHECK_OK(create_arena(&cb, kinds[0], 0, &a));
  ferry_arena_stats st;
  ferry_arena_get_stats(a, &st);
  CHECK_EQ(st.reserved, 0);
  CHECK_EQ(st.backend_allocs, 0);
  ferry_arena_destroy(a);
  return 0;
}

/* A pinned region is one backend allocation: a block spanning two of them
 * (adjacent by chance) could not be copied as one pinned buffer. */
TEST(arena_blocks_never_straddle_backend_allocations) {
  int kinds[2], nk = arena_kinds_to_test(kinds);
  for (int k = 0; k < nk; k++) {
    counting_backend cb;
    counting_init(&cb);
    ferry_arena *a = NULL;
    CHECK_OK(create_arena(&cb, kinds[k], 0, &a));
    /* Many same-size blocks, each large enough for its own backend
     * allocation; mmap tends to place them next to each other. */
    enum { N = 24 };
    const size_t small = ((size_t)1 << 20) + 4096, big = (size_t)5 << 20;
    void *ptrs[N];
    for (int i = 0; i < N; i++) {
      ptrs[i] = ferry_arena_alloc(a, small);
      CHECK(ptrs[i] != NULL);
      CHECK(in_one_chunk(&cb, ptrs[i], small));
    }
    int adjacent = 0;
    for (int i = 0; i < cb.n_chunks; i++)
      for (int j = 0; j < cb.n_chunks; j++)
        adjacent += cb.chunks[i].addr + ((cb.chunks[i].bytes + 4095) & ~(size_t)4095) ==
                    cb.chunks[j].addr;
    for (int i = 0; i < N; i++) ferry_arena_free(a, ptrs[i], small);
    /* Blocks bigger than any one backend allocation so far. */
    for (int i = 0; i < 4; i++) {
      ptrs[i] = ferry_arena_alloc(a, big);
      CHECK(ptrs[i] != NULL);
      fill_pattern(ptrs[i], big, (uint64_t)i);
      CHECK(in_one_chunk(&cb, ptrs[i], big));
    }
    for (int i = 0; i < 4; i++) {
      CHECK(check_pattern(ptrs[i], big, (uint64_t)i));
      ferry_arena_free(a, ptrs[i], big);
    }
    printf("  %s: %d adjacent backend allocations\n", kind_label(kinds[k]), adjacent);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&cb.outstanding_bytes), 0);
  }
  return 0;
}
