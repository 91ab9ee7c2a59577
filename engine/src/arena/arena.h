/*
 * arena.h — the pinned host arena.
 *
 * All offloaded bytes live here. Memory is obtained from the backend's
 * pinned allocator only, never returned to it before the arena is destroyed
 * (pinning is expensive: docs/hardware.md), and never beyond the hard cap.
 * Two implementations behind one interface:
 *   - jemalloc: a dedicated arena (arenas.create with extent hooks that call
 *     the backend), used when jemalloc is the process's allocator; its
 *     symbols are looked up at run time so libferry never links jemalloc
 *     (a Python process cannot dlopen it: docs/hardware.md);
 *   - pool: ferry's own size-class free lists over the same backend calls.
 * Thread-safe: pack and unpack come from different threads.
 */
#ifndef FERRY_ARENA_H
#define FERRY_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

typedef struct ferry_arena ferry_arena;

typedef struct ferry_arena_stats {
  uint64_t in_use;         /* bytes handed out by arena_alloc, as requested */
  uint64_t peak;           /* max of in_use */
  uint64_t reserved;       /* bytes obtained from the backend and held */
  uint64_t cap;            /* 0 = none */
  uint64_t backend_allocs; /* calls to the backend's host_alloc */
  uint64_t cap_refusals;   /* arena_alloc calls refused by the cap */
} ferry_arena_stats;

/* kind: ferry_arena_kind. cap_bytes 0 = no cap. */
int ferry_arena_create(ferry_backend *bk, int kind, uint64_t cap_bytes,
                       ferry_arena **out, char *errbuf, size_t errlen);
void ferry_arena_destroy(ferry_arena *a);
/* A shared budget consulted before every backend reservation (and told of
 * each release); set right after creation, before any allocation. */
void ferry_arena_set_reserve_hook(ferry_arena *a, ferry_reserve_fn fn, void *ud);
/* NULL when the cap (or the backend) refuses; never blocks on copies. */
void *ferry_arena_alloc(ferry_arena *a, size_t bytes);
void ferry_arena_free(ferry_arena *a, void *p, size_t bytes);
void ferry_arena_get_stats(ferry_arena *a, ferry_arena_stats *out);
const char *ferry_arena_kind_name(const ferry_arena *a); /* "jemalloc"/"pool" */
/* Whether jemalloc's API is present in this process. */
int ferry_arena_jemalloc_available(void);
/* MemTotal from /proc/meminfo in bytes, 0 if unknown. */
uint64_t ferry_mem_total_bytes(void);

#endif
