/* test_arena_trim_stress.c — trims racing allocations, both arena kinds:
 * threads allocate, fill, verify and free pinned blocks while another
 * thread trims in a loop. The backend munmaps what a trim gives back, so
 * a block handed out from released memory (or a chunk released under a
 * live block) faults or fails its byte check; ASan and TSan see the rest. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_pages_backend.h"

enum { SLOTS = 48, ROUNDS = 1500 };

typedef struct worker {
  ferry_arena *a;
  uint64_t rng;
  int failed;
} worker;

static uint64_t next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Mostly small and page-sized blocks, some of several MiB (their own extents
 * and chunks), so trims find whole chunks free while others are in use. */
static size_t pick_size(uint64_t *s) {
  uint64_t r = next(s);
  switch (r % 4) {
  case 0: return 16 + (size_t)(r >> 8) % 3000;
  case 1: return 4096 * (1 + (size_t)(r >> 8) % 16);
  case 2: return ((size_t)1 << 20) + (size_t)(r >> 8) % ((size_t)3 << 20);
  default: return 64 + (size_t)(r >> 8) % 60000;
  }
}

/* Writes a pattern keyed by the block's tag at a few places (every byte of
 * several MiB would make the race window tiny), reads it back later. */
static void stamp(uint8_t *p, size_t n, uint64_t tag) {
  for (size_t off = 0; off + 1 < n; off += 1021) p[off] = (uint8_t)(tag + off);
  p[n - 1] = (uint8_t)(tag * 7);
}

static int intact(const uint8_t *p, size_t n, uint64_t tag) {
  for (size_t off = 0; off + 1 < n; off += 1021)
    if (p[off] != (uint8_t)(tag + off)) return 0;
  return p[n - 1] == (uint8_t)(tag * 7);
}

static void *work(void *arg) {
  worker *w = arg;
  uint8_t *blk[SLOTS] = {0};
  size_t len[SLOTS] = {0};
  uint64_t tag[SLOTS] = {0};
  for (int r = 0; r < ROUNDS && !w->failed; r++) {
    int i = (int)(next(&w->rng) % SLOTS);
    if (blk[i]) {
      if (!intact(blk[i], len[i], tag[i])) w->failed = 1;
      ferry_arena_free(w->a, blk[i], len[i]);
      blk[i] = NULL;
      continue;
    }
    len[i] = pick_size(&w->rng);
    tag[i] = next(&w->rng);
    blk[i] = ferry_arena_alloc(w->a, len[i]);
    if (!blk[i]) {
      w->failed = 2;
      break;
    }
    stamp(blk[i], len[i], tag[i]);
  }
  for (int i = 0; i < SLOTS; i++) {
    if (!blk[i]) continue;
    if (!intact(blk[i], len[i], tag[i])) w->failed = 1;
    ferry_arena_free(w->a, blk[i], len[i]);
  }
  return NULL;
}

typedef struct trimmer {
  ferry_arena *a;
  atomic_int stop;
  long trims;
  uint64_t released;
} trimmer;

static void *trim_loop(void *arg) {
  trimmer *t = arg;
  /* STRESS_NO_TRIM=1: the same load without trims (the byte checks alone). */
  if (getenv("STRESS_NO_TRIM")) return NULL;
  while (!atomic_load(&t->stop)) {
    t->released += ferry_arena_release_free(t->a, (t->trims % 3) ? 0 : ((uint64_t)4 << 20));
    t->trims++;
  }
  return NULL;
}

TEST(arena_trim_while_threads_allocate) {
  static const int kinds[2] = {FERRY_ARENA_JEMALLOC, FERRY_ARENA_POOL};
  for (int k = 0; k < 2; k++) {
    if (kinds[k] == FERRY_ARENA_JEMALLOC && !ferry_arena_jemalloc_available()) continue;
    pages_backend sb;
    pages_backend_init(&sb);
    ferry_arena *a = NULL;
    char err[256] = "";
    int rc = ferry_arena_create(&sb.base, kinds[k], 0, &a, err, sizeof err);
    if (rc) fprintf(stderr, "%s\n", err);
    CHECK_OK(rc);

    enum { WORKERS = 3 };
    worker w[WORKERS];
    pthread_t wt[WORKERS], tt;
    trimmer t = {.a = a};
    CHECK_EQ(pthread_create(&tt, NULL, trim_loop, &t), 0);
    for (int i = 0; i < WORKERS; i++) {
      w[i] = (worker){.a = a, .rng = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1 + 10 * k)};
      CHECK_EQ(pthread_create(&wt[i], NULL, work, &w[i]), 0);
    }
    for (int i = 0; i < WORKERS; i++) pthread_join(wt[i], NULL);
    atomic_store(&t.stop, 1);
    pthread_join(tt, NULL);
    printf("  %s arena: %ld trims gave back %llu bytes\n", ferry_arena_kind_name(a), t.trims,
           (unsigned long long)t.released);
    for (int i = 0; i < WORKERS; i++) CHECK_EQ(w[i].failed, 0);
    CHECK(t.trims > 0);

    /* All free now: one more trim empties the arena, which still works. */
    ferry_arena_release_free(a, 0);
    ferry_arena_stats st;
    ferry_arena_get_stats(a, &st);
    CHECK_EQ(st.in_use, 0);
    CHECK_EQ((long long)st.reserved, atomic_load(&sb.outstanding));
    worker again = {.a = a, .rng = 12345};
    work(&again);
    CHECK_EQ(again.failed, 0);
    ferry_arena_destroy(a);
    CHECK_EQ(atomic_load(&sb.outstanding), 0);
  }
  return 0;
}
