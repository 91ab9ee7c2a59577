/*
 * arena_pool.c — the pool kind of the pinned arena: ferry's own allocator,
 * used where jemalloc is not the process's allocator (a plain `python3`).
 * How it works: docs/internals.md#arena_poolc.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena/arena_internal.h"
#include "util/log.h"

#define POOL_GRANULE_SHIFT 8 /* 256-byte blocks, the alignment copies like */
#define POOL_GRANULE ((size_t)1 << POOL_GRANULE_SHIFT)
#define POOL_SMALL_CLASSES 8 /* 256 B .. 2 KiB in 256 B steps */
#define POOL_CLASSES_PER_DOUBLING 8
#define POOL_MAX_UNITS_LOG2 40 /* largest block: 2^40 granules = 256 TiB */
#define POOL_NCLASSES \
  (POOL_SMALL_CLASSES + POOL_CLASSES_PER_DOUBLING * (POOL_MAX_UNITS_LOG2 - 3))
#define POOL_BITMAP_WORDS ((POOL_NCLASSES + 63) / 64)
#define POOL_CHUNK_BYTES ((size_t)4 << 20)
#define POOL_OWN_CHUNK_BYTES ((size_t)1 << 20)

typedef struct pool_block pool_block;
struct pool_block {
  uintptr_t addr;
  size_t size;                /* a multiple of POOL_GRANULE */
  size_t requested;           /* bytes asked for, while in use */
  pool_block *next_in_chunk;  /* the next block by address, same chunk */
  pool_block *next_free;      /* bin list, while free */
  pool_block *prev_free;
  unsigned bin;
  int is_free;
};

typedef struct pool_state {
  pool_block *bins[POOL_NCLASSES];
  uint64_t bin_nonempty[POOL_BITMAP_WORDS];
  pool_block **chunk_heads; /* first block of each chunk (never changes) */
  size_t n_heads, heads_cap;
  pool_block **live; /* blocks in use, open addressing by address */
  size_t live_mask, live_count;
  size_t frees_since_coalesce;
} pool_state;

/* ---- size classes --------------------------------------------------------- */

/* Class of a request of `units` granules (units >= 1). */
static unsigned pool_class_of(size_t units) {
  if (units <= POOL_SMALL_CLASSES) return (unsigned)(units - 1);
  unsigned k = 63u - (unsigned)__builtin_clzll((unsigned long long)(units - 1));
  unsigned step_shift = k - 3; /* 2^k < units <= 2^(k+1), 8 steps between */
  size_t j = (units - ((size_t)1 << k) + ((size_t)1 << step_shift) - 1) >> step_shift;
  return POOL_SMALL_CLASSES + POOL_CLASSES_PER_DOUBLING * (k - 3) + (unsigned)(j - 1);
}

static size_t pool_class_units(unsigned c) {
  if (c < POOL_SMALL_CLASSES) return (size_t)c + 1;
  unsigned k = 3 + (c - POOL_SMALL_CLASSES) / POOL_CLASSES_PER_DOUBLING;
  size_t j = (c - POOL_SMALL_CLASSES) % POOL_CLASSES_PER_DOUBLING + 1;
  return ((size_t)1 << k) + (j << (k - 3));
}

/* The bin of a free block: the largest class not bigger than it, so every
 * block in bin c can serve a request of class c. */
static unsigned pool_bin_of(size_t bytes) {
  size_t units = bytes >> POOL_GRANULE_SHIFT;
  unsigned c = pool_class_of(units);
  if (pool_class_units(c) > units) c--;
  return c;
}

/* ---- bins ----------------------------------------------------------------- */

static void bin_push(pool_state *s, pool_block *b) {
  unsigned c = pool_bin_of(b->size);
  b->bin = c;
  b->is_free = 1;
  b->prev_free = NULL;
  b->next_free = s->bins[c];
  if (s->bins[c]) s->bins[c]->prev_free = b;
  s->bins[c] = b;
  s->bin_nonempty[c / 64] |= (uint64_t)1 << (c % 64);
}

static void bin_remove(pool_state *s, pool_block *b) {
  unsigned c = b->bin;
  if (b->prev_free)
    b->prev_free->next_free = b->next_free;
  else
    s->bins[c] = b->next_free;
  if (b->next_free) b->next_free->prev_free = b->prev_free;
  if (!s->bins[c]) s->bin_nonempty[c / 64] &= ~((uint64_t)1 << (c % 64));
  b->is_free = 0;
}

/* A free block that fits class c: from bin c, else the smallest non-empty
 * bin above it. Removed from its bin. NULL when none. */
static pool_block *bin_take_fit(pool_state *s, unsigned c) {
  for (unsigned w = c / 64; w < POOL_BITMAP_WORDS; w++) {
    uint64_t bits = s->bin_nonempty[w];
    if (w == c / 64) bits &= ~(uint64_t)0 << (c % 64);
    if (!bits) continue;
    pool_block *b = s->bins[w * 64 + (unsigned)__builtin_ctzll(bits)];
    bin_remove(s, b);
    return b;
  }
  return NULL;
}

/* ---- live map ------------------------------------------------------------- */

static size_t live_home(const pool_state *s, uintptr_t addr) {
  uint64_t h = (uint64_t)(addr >> POOL_GRANULE_SHIFT) * 0x9E3779B97F4A7C15ull;
  return (size_t)(h ^ (h >> 29)) & s->live_mask;
}

static void live_put(pool_state *s, pool_block *b) {
  size_t i = live_home(s, b->addr);
  while (s->live[i]) i = (i + 1) & s->live_mask;
  s->live[i] = b;
  s->live_count++;
}

/* Room for one more entry at load <= 1/2. Returns 0, or -1 out of memory. */
static int live_reserve(pool_state *s) {
  if ((s->live_count + 1) * 2 <= s->live_mask + 1) return 0;
  size_t old_size = s->live_mask + 1, new_size = old_size * 2;
  pool_block **old = s->live;
  pool_block **grown = calloc(new_size, sizeof *grown);
  if (!grown) return -1;
  s->live = grown;
  s->live_mask = new_size - 1;
  s->live_count = 0;
  for (size_t i = 0; i < old_size; i++)
    if (old[i]) live_put(s, old[i]);
  free(old);
  return 0;
}

/* Removes and returns the live block at addr, or NULL. Backward-shift
 * deletion keeps every probe chain unbroken without tombstones. */
static pool_block *live_take(pool_state *s, uintptr_t addr) {
  size_t i = live_home(s, addr);
  while (s->live[i] && s->live[i]->addr != addr) i = (i + 1) & s->live_mask;
  pool_block *found = s->live[i];
  if (!found) return NULL;
  size_t hole = i, j = i;
  for (;;) {
    j = (j + 1) & s->live_mask;
    if (!s->live[j]) break;
    size_t home = live_home(s, s->live[j]->addr);
    /* Entry j may move into the hole unless its home lies in (hole, j]. */
    int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    s->live[hole] = s->live[j];
    hole = j;
  }
  s->live[hole] = NULL;
  s->live_count--;
  return found;
}

/* ---- blocks --------------------------------------------------------------- */

/* Turn free block b (already out of its bin) into a live allocation of
 * `need` bytes; the rest of it becomes a free block. 0, or -1 when out of
 * host memory (b is then unchanged). */
static int pool_carve(pool_state *s, pool_block *b, size_t need, size_t requested) {
  if (live_reserve(s) != 0) return -1;
  if (b->size > need) {
    pool_block *rest = calloc(1, sizeof *rest);
    if (!rest) return -1;
    rest->addr = b->addr + need;
    rest->size = b->size - need;
    rest->next_in_chunk = b->next_in_chunk;
    b->next_in_chunk = rest;
    b->size = need;
    bin_push(s, rest);
  }
  b->is_free = 0;
  b->requested = requested;
  live_put(s, b);
  ARENA_UNPOISON(b->addr, requested);
  return 0;
}

/* Merge runs of neighbouring free blocks inside each chunk. */
static void pool_coalesce(pool_state *s) {
  for (size_t h = 0; h < s->n_heads; h++) {
    for (pool_block *b = s->chunk_heads[h]; b; b = b->next_in_chunk) {
      pool_block *next = b->next_in_chunk;
      if (!b->is_free || !next || !next->is_free) continue;
      bin_remove(s, b);
      while (next && next->is_free) {
        bin_remove(s, next);
        b->size += next->size;
        b->next_in_chunk = next->next_in_chunk;
        free(next);
        next = b->next_in_chunk;
      }
      bin_push(s, b);
    }
  }
  s->frees_since_coalesce = 0;
}

/* ---- the kind --------------------------------------------------------------- */

static void *pool_alloc(ferry_arena *a, size_t bytes, int *cap_refused) {
  pool_state *s = a->kind_state;
  if (bytes > ((size_t)1 << (POOL_MAX_UNITS_LOG2 + POOL_GRANULE_SHIFT - 1))) return NULL;
  size_t units = bytes ? (bytes + POOL_GRANULE - 1) >> POOL_GRANULE_SHIFT : 1;
  unsigned c = pool_class_of(units);
  size_t need = pool_class_units(c) << POOL_GRANULE_SHIFT;

  pthread_mutex_lock(&a->lock);
  /* No block of this class: before splitting a bigger one (or asking the
   * backend), merge what was freed since the last miss. Splitting blocks
   * that could have been whole again is what fragments a pool when sizes
   * vary from step to step (bench: reserved/peak 1.5 -> 1.18). */
  if (!s->bins[c] && s->frees_since_coalesce) pool_coalesce(s);
  pool_block *b = bin_take_fit(s, c);
  if (b) {
    if (pool_carve(s, b, need, bytes) != 0) {
      bin_push(s, b);
      b = NULL;
    }
    pthread_mutex_unlock(&a->lock);
    return b ? (void *)b->addr : NULL;
  }
  pthread_mutex_unlock(&a->lock);

  /* A new chunk. Its descriptor first, so a failure leaves nothing behind. */
  pool_block *head = calloc(1, sizeof *head);
  if (!head) return NULL;
  size_t chunk = need >= POOL_OWN_CHUNK_BYTES ? need : POOL_CHUNK_BYTES;
  void *mem = arena_backend_reserve(a, chunk, ARENA_CHUNK_ALIGN, cap_refused);
  if (!mem && *cap_refused && chunk > need) {
    chunk = need; /* the cap may still allow the block itself */
    mem = arena_backend_reserve(a, chunk, ARENA_CHUNK_ALIGN, cap_refused);
  }
  if (!mem) {
    free(head);
    return NULL;
  }
  head->addr = (uintptr_t)mem;
  head->size = chunk;
  ARENA_POISON(mem, chunk);

  pthread_mutex_lock(&a->lock);
  int registered = 0, carved = 0;
  if (s->n_heads == s->heads_cap) {
    size_t cap = s->heads_cap ? s->heads_cap * 2 : 64;
    pool_block **grown = realloc(s->chunk_heads, cap * sizeof *grown);
    if (grown) {
      s->chunk_heads = grown;
      s->heads_cap = cap;
    }
  }
  if (s->n_heads < s->heads_cap) {
    s->chunk_heads[s->n_heads++] = head;
    registered = 1;
    carved = pool_carve(s, head, need, bytes) == 0;
    if (!carved) bin_push(s, head); /* usable by a later request */
  }
  pthread_mutex_unlock(&a->lock);
  /* Unregistered, the chunk stays in the ledger unused until destroy. */
  if (!registered) free(head);
  if (!carved) return NULL;
  return mem;
}

static size_t pool_free(ferry_arena *a, void *p, size_t bytes) {
  pool_state *s = a->kind_state;
  pthread_mutex_lock(&a->lock);
  pool_block *b = live_take(s, (uintptr_t)p);
  if (!b) {
    pthread_mutex_unlock(&a->lock);
    util_log(FERRY_LOG_ERROR, "pinned arena free of %p, which is not a live allocation of "
             "this arena (double free?); ignored", p);
    return 0;
  }
  size_t requested = b->requested;
  ARENA_POISON(b->addr, b->size);
  bin_push(s, b);
  s->frees_since_coalesce++;
  pthread_mutex_unlock(&a->lock);
  if (bytes != requested)
    util_log(FERRY_LOG_ERROR, "pinned arena free of %p with size %zu, but it was allocated "
             "with %zu bytes", p, bytes, requested);
  return requested;
}

static void pool_destroy(ferry_arena *a) {
  pool_state *s = a->kind_state;
  if (!s) return;
  for (size_t h = 0; h < s->n_heads; h++) {
    pool_block *b = s->chunk_heads[h];
    while (b) {
      pool_block *next = b->next_in_chunk;
      free(b);
      b = next;
    }
  }
  free(s->chunk_heads);
  free(s->live);
  free(s);
  a->kind_state = NULL;
}

/* A chunk whose blocks are all free is one free block once coalesced: its
 * head, with nothing after it. Such chunks leave the pool under the lock
 * (no allocation can take them), then go back to the backend. */
static uint64_t pool_trim(ferry_arena *a, uint64_t keep_bytes) {
  pool_state *s = a->kind_state;
  pthread_mutex_lock(&a->lock);
  arena_chunk *gone = s->n_heads ? malloc(s->n_heads * sizeof *gone) : NULL;
  size_t n_gone = 0;
  if (gone) {
    pool_coalesce(s);
    uint64_t reserved = a->stats.reserved;
    for (size_t h = 0; h < s->n_heads;) {
      pool_block *b = s->chunk_heads[h];
      if (b->is_free && !b->next_in_chunk && reserved >= b->size &&
          reserved - b->size >= keep_bytes) {
        bin_remove(s, b);
        gone[n_gone++] = (arena_chunk){b->addr, b->size};
        reserved -= b->size;
        free(b);
        s->chunk_heads[h] = s->chunk_heads[--s->n_heads]; /* their order is not used */
        continue;
      }
      h++;
    }
  }
  pthread_mutex_unlock(&a->lock);
  return arena_release_chunks(a, gone, n_gone);
}

static const arena_kind_ops pool_kind_ops = {
    .name = "pool",
    .alloc = pool_alloc,
    .free = pool_free,
    .destroy = pool_destroy,
    .trim = pool_trim,
};

int arena_pool_init(ferry_arena *a, char *errbuf, size_t errlen) {
  pool_state *s = calloc(1, sizeof *s);
  size_t live_slots = 256;
  pool_block **live = calloc(live_slots, sizeof *live);
  if (!s || !live) {
    free(s);
    free(live);
    if (errbuf && errlen) snprintf(errbuf, errlen, "ferry_arena_create: out of host memory");
    return FERRY_ENOMEM;
  }
  s->live = live;
  s->live_mask = live_slots - 1;
  a->kind = &pool_kind_ops;
  a->kind_state = s;
  return FERRY_OK;
}
