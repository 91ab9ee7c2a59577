/*
 * arena.c — the pinned host arena: kind selection, stats, and the ledger of
 * backend allocations shared by the jemalloc and pool kinds.
 * How it works: docs/internals.md#arenac.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/errbuf.h"
#include "util/log.h"
#include "arena/arena_internal.h"

/* ---- ledger --------------------------------------------------------------- */

/* Index of the first chunk whose address is > addr. Caller holds a->lock. */
static size_t ledger_upper_bound(const ferry_arena *a, uintptr_t addr) {
  size_t lo = 0, hi = a->n_chunks;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a->chunks[mid].addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Caller holds a->lock. Returns 0, or -1 when the ledger cannot grow. */
static int ledger_insert(ferry_arena *a, uintptr_t addr, size_t size) {
  if (a->n_chunks == a->chunks_cap) {
    size_t cap = a->chunks_cap ? a->chunks_cap * 2 : 64;
    arena_chunk *grown = realloc(a->chunks, cap * sizeof *grown);
    if (!grown) return -1;
    a->chunks = grown;
    a->chunks_cap = cap;
  }
  size_t at = ledger_upper_bound(a, addr);
  memmove(&a->chunks[at + 1], &a->chunks[at],
          (a->n_chunks - at) * sizeof a->chunks[0]);
  a->chunks[at].addr = addr;
  a->chunks[at].size = size;
  a->n_chunks++;
  return 0;
}

void *arena_backend_reserve(ferry_arena *a, size_t bytes, size_t alignment,
                            int *cap_refused) {
  *cap_refused = 0;
  if (bytes == 0 || alignment > ARENA_MAX_BACKEND_ALIGN) return NULL;

  /* Count the bytes as reserved before calling the backend so that two
   * threads growing at once cannot both squeeze under the cap. */
  pthread_mutex_lock(&a->lock);
  uint64_t cap = a->stats.cap;
  if (cap && (bytes > cap || a->stats.reserved > cap - bytes)) {
    pthread_mutex_unlock(&a->lock);
    *cap_refused = 1;
    return NULL;
  }
  a->stats.reserved += bytes;
  pthread_mutex_unlock(&a->lock);

  /* The shared budget, outside the lock: it may take a process-wide one. */
  if (a->reserve && a->reserve(a->reserve_ud, bytes, 0) != 0) {
    pthread_mutex_lock(&a->lock);
    a->stats.reserved -= bytes;
    pthread_mutex_unlock(&a->lock);
    *cap_refused = 1;
    return NULL;
  }
  void *p = NULL;
  int rc = a->bk->ops->host_alloc(a->bk, bytes, alignment, &p);

  pthread_mutex_lock(&a->lock);
  a->stats.backend_allocs++;
  if (rc == 0 && p && ledger_insert(a, (uintptr_t)p, bytes) == 0) {
    pthread_mutex_unlock(&a->lock);
    return p;
  }
  a->stats.reserved -= bytes;
  pthread_mutex_unlock(&a->lock);
  /* A chunk we cannot record would leak at destroy: give it back now. */
  if (rc == 0 && p) a->bk->ops->host_free(a->bk, p, bytes);
  if (a->reserve) a->reserve(a->reserve_ud, bytes, 1);
  return NULL;
}

uint64_t arena_backend_release(ferry_arena *a, uintptr_t addr, size_t size) {
  pthread_mutex_lock(&a->lock);
  size_t at = ledger_upper_bound(a, addr);
  if (at == 0 || a->chunks[at - 1].addr != addr || a->chunks[at - 1].size != size) {
    pthread_mutex_unlock(&a->lock);
    util_log(FERRY_LOG_ERROR, "pinned arena: trim of %#zx (%zu bytes), which is not a whole "
             "backend allocation; kept", (size_t)addr, size);
    return 0;
  }
  at--;
  memmove(&a->chunks[at], &a->chunks[at + 1], (a->n_chunks - at - 1) * sizeof a->chunks[0]);
  a->n_chunks--;
  a->stats.reserved -= size;
  pthread_mutex_unlock(&a->lock);
  ARENA_UNPOISON(addr, size);
  a->bk->ops->host_free(a->bk, (void *)addr, size);
  if (a->reserve) a->reserve(a->reserve_ud, size, 1);
  return size;
}

uint64_t arena_release_chunks(ferry_arena *a, arena_chunk *gone, size_t n) {
  uint64_t released = 0;
  for (size_t i = 0; i < n; i++) released += arena_backend_release(a, gone[i].addr, gone[i].size);
  free(gone);
  return released;
}

const arena_chunk *arena_ledger_find_locked(ferry_arena *a, uintptr_t addr) {
  size_t at = ledger_upper_bound(a, addr);
  if (at == 0) return NULL;
  const arena_chunk *c = &a->chunks[at - 1];
  return addr - c->addr < c->size ? c : NULL;
}

void ferry_arena_set_reserve_hook(ferry_arena *a, ferry_reserve_fn fn, void *ud) {
  a->reserve = fn;
  a->reserve_ud = ud;
}

int arena_ledger_same_chunk(ferry_arena *a, const void *p, size_t n) {
  uintptr_t addr = (uintptr_t)p;
  int same = 0;
  pthread_mutex_lock(&a->lock);
  size_t at = ledger_upper_bound(a, addr);
  if (at > 0) {
    const arena_chunk *c = &a->chunks[at - 1];
    same = addr - c->addr <= c->size && n <= c->size - (addr - c->addr);
  }
  pthread_mutex_unlock(&a->lock);
  return same;
}

/* ---- the interface -------------------------------------------------------- */

int ferry_arena_create(ferry_backend *bk, int kind, uint64_t cap_bytes,
                       ferry_arena **out, char *errbuf, size_t errlen) {
  if (out) *out = NULL;
  if (!out) {
    ferry_errbuf(errbuf, errlen, 0, "ferry_arena_create: out is NULL");
    return FERRY_EINVAL;
  }
  if (!bk || !bk->ops || !bk->ops->host_alloc || !bk->ops->host_free) {
    ferry_errbuf(errbuf, errlen, 0,
                    "ferry_arena_create: backend has no host_alloc/host_free");
    return FERRY_EINVAL;
  }
  if (kind == FERRY_ARENA_AUTO)
    kind = ferry_arena_jemalloc_available() ? FERRY_ARENA_JEMALLOC : FERRY_ARENA_POOL;
  if (kind != FERRY_ARENA_JEMALLOC && kind != FERRY_ARENA_POOL) {
    ferry_errbuf(errbuf, errlen, 0,
                    "ferry_arena_create: unknown arena kind %d (expected "
                    "FERRY_ARENA_AUTO, _JEMALLOC or _POOL)", kind);
    return FERRY_EINVAL;
  }
  if (kind == FERRY_ARENA_JEMALLOC && !ferry_arena_jemalloc_available()) {
    ferry_errbuf(errbuf, errlen, 0,
                    "jemalloc is not loaded in this process; preload "
                    "libjemalloc.so.2 or use the pool arena");
    return FERRY_EUNSUPPORTED;
  }

  ferry_arena *a = calloc(1, sizeof *a);
  if (!a) {
    ferry_errbuf(errbuf, errlen, 0, "ferry_arena_create: out of host memory");
    return FERRY_ENOMEM;
  }
  if (pthread_mutex_init(&a->lock, NULL) != 0) {
    free(a);
    ferry_errbuf(errbuf, errlen, 0, "ferry_arena_create: pthread_mutex_init failed");
    return FERRY_ENOMEM;
  }
  a->bk = bk;
  a->stats.cap = cap_bytes;

  int rc = kind == FERRY_ARENA_JEMALLOC ? arena_jemalloc_init(a, errbuf, errlen)
                                        : arena_pool_init(a, errbuf, errlen);
  if (rc != FERRY_OK) {
    ferry_arena_destroy(a);
    return rc;
  }
  *out = a;
  return FERRY_OK;
}

void ferry_arena_destroy(ferry_arena *a) {
  if (!a) return;
  if (a->kind) a->kind->destroy(a);
  for (size_t i = 0; i < a->n_chunks; i++) {
    ARENA_UNPOISON(a->chunks[i].addr, a->chunks[i].size);
    a->bk->ops->host_free(a->bk, (void *)a->chunks[i].addr, a->chunks[i].size);
  }
  uint64_t held = a->stats.reserved;
  free(a->chunks);
  pthread_mutex_destroy(&a->lock);
  if (a->reserve && held) a->reserve(a->reserve_ud, held, 1);
  free(a);
}

void *ferry_arena_alloc(ferry_arena *a, size_t bytes) {
  if (!a) return NULL;
  int cap_refused = 0;
  void *p = a->kind->alloc(a, bytes, &cap_refused);
  pthread_mutex_lock(&a->lock);
  if (p) {
    a->stats.in_use += bytes;
    if (a->stats.in_use > a->stats.peak) a->stats.peak = a->stats.in_use;
  } else if (cap_refused) {
    a->stats.cap_refusals++;
  }
  pthread_mutex_unlock(&a->lock);
  return p;
}

void ferry_arena_free(ferry_arena *a, void *p, size_t bytes) {
  if (!a || !p) return;
  size_t requested = a->kind->free(a, p, bytes);
  pthread_mutex_lock(&a->lock);
  a->stats.in_use -= requested <= a->stats.in_use ? requested : a->stats.in_use;
  pthread_mutex_unlock(&a->lock);
}

uint64_t ferry_arena_release_free(ferry_arena *a, uint64_t keep_bytes) {
  if (!a || !a->kind || !a->kind->trim) return 0;
  return a->kind->trim(a, keep_bytes);
}

void ferry_arena_get_stats(ferry_arena *a, ferry_arena_stats *out) {
  if (!out) return;
  if (!a) {
    memset(out, 0, sizeof *out);
    return;
  }
  pthread_mutex_lock(&a->lock);
  *out = a->stats;
  pthread_mutex_unlock(&a->lock);
}

const char *ferry_arena_kind_name(const ferry_arena *a) {
  return a && a->kind ? a->kind->name : "none";
}

uint64_t ferry_mem_total_bytes(void) {
  uint64_t total = 0, avail;
  return ferry_host_ram_proc(NULL, &total, &avail) ? 0 : total;
}
