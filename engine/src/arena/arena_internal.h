/*
 * arena_internal.h — what arena.c shares with its two implementations
 * (arena_jemalloc.c, arena_pool.c). Not part of any public interface.
 *
 * arena.c owns the parts both kinds need: the ledger of backend allocations
 * (so destroy can give every pinned byte back, and so the cap is enforced in
 * one place), the stats, and the dispatch of ferry_arena_* to the kind.
 */
#ifndef FERRY_ARENA_INTERNAL_H
#define FERRY_ARENA_INTERNAL_H

#include <pthread.h>

#include "ferry_tools.h"

/* Under AddressSanitizer the pool marks free and slack bytes of pinned
 * chunks unaddressable, so the engine's out-of-bounds or use-after-free
 * accesses to host buffers are caught; arena.c clears the marks before a
 * chunk goes back to the backend. */
#if defined(__SANITIZE_ADDRESS__)
#define ARENA_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ARENA_ASAN 1
#endif
#endif
#ifdef ARENA_ASAN
#include <sanitizer/asan_interface.h>
#define ARENA_POISON(p, n) ASAN_POISON_MEMORY_REGION((void *)(p), (n))
#define ARENA_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((void *)(p), (n))
#else
#define ARENA_POISON(p, n) ((void)(p), (void)(n))
#define ARENA_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* Alignment asked of the backend for every pinned chunk. */
#define ARENA_CHUNK_ALIGN ((size_t)4096)
/* The backend accepts alignments up to this (backend.h). */
#define ARENA_MAX_BACKEND_ALIGN ((size_t)2 << 20)

/* One allocation obtained from the backend. */
typedef struct arena_chunk {
  uintptr_t addr;
  size_t size;
} arena_chunk;

typedef struct arena_kind_ops {
  const char *name;
  /* Returns NULL on failure; sets *cap_refused when the cap was the reason. */
  void *(*alloc)(ferry_arena *a, size_t bytes, int *cap_refused);
  /* Returns the requested size of the allocation being freed (for in_use),
   * or 0 when p was not a live allocation (already reported). */
  size_t (*free)(ferry_arena *a, void *p, size_t bytes);
  /* Drops the kind's own state; arena.c then frees every chunk. */
  void (*destroy)(ferry_arena *a);
  /* Gives every wholly free chunk back to the backend (arena_backend_release)
   * while reserved stays >= keep_bytes; returns the bytes given back. */
  uint64_t (*trim)(ferry_arena *a, uint64_t keep_bytes);
} arena_kind_ops;

struct ferry_arena {
  const arena_kind_ops *kind;
  void *kind_state;
  ferry_backend *bk;
  /* Guards stats, the ledger and the pool's structures. Never held while
   * calling into jemalloc (its hooks take it) or into the backend. */
  pthread_mutex_t lock;
  ferry_arena_stats stats;
  arena_chunk *chunks; /* sorted by address */
  size_t n_chunks, chunks_cap;
  ferry_reserve_fn reserve; /* shared budget, or NULL */
  void *reserve_ud;
};

/* Obtains `bytes` of pinned memory from the backend and records it in the
 * ledger, unless that would take reserved past the cap (then NULL and
 * *cap_refused = 1) or the backend fails (NULL, *cap_refused = 0).
 * Call without a->lock held. */
void *arena_backend_reserve(ferry_arena *a, size_t bytes, size_t alignment,
                            int *cap_refused);
/* Gives the backend allocation at addr (a whole ledger chunk the kind no
 * longer uses) back: out of the ledger and reserved, then host_free and the
 * shared budget told. Returns its size, 0 when addr is not a chunk's start
 * or size is not its size (logged). Call without a->lock held. */
uint64_t arena_backend_release(ferry_arena *a, uintptr_t addr, size_t size);
/* A trim's end: gives each of gone[0..n) back (arena_backend_release), frees
 * gone and returns the bytes given back. Call without a->lock held. */
uint64_t arena_release_chunks(ferry_arena *a, arena_chunk *gone, size_t n);
/* The ledger chunk holding addr, or NULL. Caller holds a->lock; the pointer
 * is valid until the ledger changes. */
const arena_chunk *arena_ledger_find_locked(ferry_arena *a, uintptr_t addr);
/* Whether [p, p + n) lies inside a single backend allocation.
 * Call without a->lock held. */
int arena_ledger_same_chunk(ferry_arena *a, const void *p, size_t n);

/* Set up a->kind and a->kind_state. On failure return a FERRY_E* code and
 * write a message into errbuf (may be NULL). */
int arena_jemalloc_init(ferry_arena *a, char *errbuf, size_t errlen);
int arena_pool_init(ferry_arena *a, char *errbuf, size_t errlen);

#endif
