/*
 * arena_jemalloc.c — the jemalloc kind of the pinned arena.
 * How it works: docs/internals.md#arena_jemallocc.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include <jemalloc/jemalloc.h>

#include "arena/arena_internal.h"
#include "util/util.h"
#include "util/log.h"

/* Where retained grows do happen (see je_hook_alloc), grow by no more than
 * this per backend call. jemalloc grows geometrically by default; capped at
 * one page, each grow is the size needed rounded to a page size class.
 * bench_arena, 300 tensors 4 KiB-64 MiB: reserved/peak 1.24 with jemalloc's
 * default, 1.14-1.17 with this limit, 1.08-1.10 with exact extents. */
#define JE_RETAIN_GROW_LIMIT ((size_t)4096)

typedef int (*je_mallctl_fn)(const char *, void *, size_t *, void *, size_t);
typedef void *(*je_mallocx_fn)(size_t, int);
typedef void (*je_dallocx_fn)(void *, int);

static struct {
  je_mallctl_fn mallctl;
  je_mallocx_fn mallocx;
  je_dallocx_fn dallocx;
  int available;
} je_api;
static pthread_once_t je_api_once = PTHREAD_ONCE_INIT;

static void je_api_lookup(void) {
  je_mallctl_fn ctl = (je_mallctl_fn)dlsym(RTLD_DEFAULT, "mallctl");
  je_mallocx_fn mx = (je_mallocx_fn)dlsym(RTLD_DEFAULT, "mallocx");
  je_dallocx_fn dx = (je_dallocx_fn)dlsym(RTLD_DEFAULT, "dallocx");
  if (!ctl || !mx || !dx) return;
  /* Make sure it is jemalloc, and one with extent hooks (5.x and later). */
  const char *version = NULL;
  size_t len = sizeof version;
  if (ctl("version", &version, &len, NULL, 0) != 0 || !version) return;
  if (atoi(version) < 5) return;
  je_api.mallctl = ctl;
  je_api.mallocx = mx;
  je_api.dallocx = dx;
  je_api.available = 1;
}

int ferry_arena_jemalloc_available(void) {
  pthread_once(&je_api_once, je_api_lookup);
  return je_api.available;
}

/* Per-arena state. The hooks table comes first: jemalloc hands each hook
 * the pointer it was given, which is then also a pointer to this struct. */
typedef struct je_arena {
  extent_hooks_t hooks;
  ferry_arena *owner;
  unsigned index;
  int flags; /* MALLOCX_ARENA(index) | MALLOCX_TCACHE_NONE */
  int created;
  /* 1 while this arena refuses jemalloc's rounded-up retained grows (see
   * je_hook_alloc); cleared if this jemalloc turns out not to retry. */
  atomic_int exact_extents;
  /* Extents jemalloc handed back through the dalloc hook (a purge, from
   * ferry_arena_release_free): ferry's now. The alloc hook serves from them
   * first; a trim gives each chunk they wholly cover back to the backend.
   * Under owner->lock. */
  arena_chunk *spare;
  uint32_t n_spare, spare_cap;
} je_arena;

/* Caller holds owner->lock. 0, or -1 when the list cannot grow. */
static int je_spare_add(je_arena *ja, uintptr_t addr, size_t size) {
  if (util_grow((void **)&ja->spare, &ja->spare_cap, sizeof *ja->spare, ja->n_spare + 1, 32))
    return -1;
  ja->spare[ja->n_spare++] = (arena_chunk){addr, size};
  return 0;
}

/* Carves `size` bytes at `alignment` out of a spare extent: first fit, the
 * bytes before and after stay spare. NULL when none fits (or the list
 * cannot grow for the bytes after). */
static void *je_spare_take(je_arena *ja, size_t size, size_t alignment) {
  ferry_arena *a = ja->owner;
  void *p = NULL;
  pthread_mutex_lock(&a->lock);
  for (uint32_t i = 0; i < ja->n_spare && !p; i++) {
    arena_chunk sp = ja->spare[i];
    uintptr_t start = (sp.addr + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (start - sp.addr > sp.size || sp.size - (start - sp.addr) < size) continue;
    uintptr_t end = start + size, sp_end = sp.addr + sp.size;
    int before = start > sp.addr, after = end < sp_end;
    if (before && after) {
      if (je_spare_add(ja, end, sp_end - end) != 0) continue;
      ja->spare[i].size = start - sp.addr;
    } else if (before) {
      ja->spare[i].size = start - sp.addr;
    } else if (after) {
      ja->spare[i] = (arena_chunk){end, sp_end - end};
    } else {
      ja->spare[i] = ja->spare[--ja->n_spare];
    }
    p = (void *)start;
  }
  pthread_mutex_unlock(&a->lock);
  return p;
}

/* What the alloc hook did during one mallocx, read by je_alloc on the same
 * thread (hooks run on the allocating thread). */
static _Thread_local ferry_arena *je_cap_refused_by;
static _Thread_local int je_grow_refused, je_exact_requested;

static void *je_hook_alloc(extent_hooks_t *hooks, void *new_addr, size_t size,
                           size_t alignment, bool *zero, bool *commit,
                           unsigned arena_ind) {
  je_arena *ja = (je_arena *)hooks;
  /* Extending an extent in place needs memory at a given address, which the
   * backend cannot promise. */
  if (new_addr != NULL) return NULL;
  /* jemalloc 5.3 first tries to grow its retained region, asking for the
   * needed extent rounded up to the next page size class (*commit false on
   * entry); when that fails it asks for the exact extent (*commit true).
   * A large extent is its size class plus a page, so the rounding adds up
   * to 25% of pinned memory that later requests only partly reuse. Taking
   * only exact requests keeps reserved near the bytes in use. */
  if (!*commit && atomic_load_explicit(&ja->exact_extents, memory_order_relaxed)) {
    je_grow_refused = 1;
    return NULL;
  }
  je_exact_requested = 1;
  if (alignment < ARENA_CHUNK_ALIGN) alignment = ARENA_CHUNK_ALIGN;
  void *p = je_spare_take(ja, size, alignment); /* memory a trim kept */
  int cap_refused = 0;
  if (!p) p = arena_backend_reserve(ja->owner, size, alignment, &cap_refused);
  if (!p) {
    if (cap_refused) je_cap_refused_by = ja->owner;
    return NULL;
  }
  if (*zero) memset(p, 0, size);
  *commit = true;
  return p;
}

static bool je_hook_dalloc(extent_hooks_t *hooks, void *addr, size_t size,
                           bool committed, unsigned arena_ind) {
  /* Called for free extents when a trim purges the arena (decay is off),
   * and by arena.<i>.destroy, which purges before it discards.
   * Taken as spare: opting out would leave the extent in jemalloc's
   * retained list, which no later purge hands back, so its chunk could
   * never be released. Opt out only when it cannot be recorded. */
  je_arena *ja = (je_arena *)hooks;
  pthread_mutex_lock(&ja->owner->lock);
  int rc = je_spare_add(ja, (uintptr_t)addr, size);
  pthread_mutex_unlock(&ja->owner->lock);
  return rc != 0;
}

static void je_hook_destroy(extent_hooks_t *hooks, void *addr, size_t size,
                            bool committed, unsigned arena_ind) {
  /* The backend allocation is freed from the ledger at arena destroy. */
}

static bool je_hook_commit(extent_hooks_t *hooks, void *addr, size_t size,
                           size_t offset, size_t length, unsigned arena_ind) {
  return false; /* pinned pages are always committed */
}

static bool je_hook_split(extent_hooks_t *hooks, void *addr, size_t size,
                          size_t size_a, size_t size_b, bool committed,
                          unsigned arena_ind) {
  return false; /* both halves stay in the same backend allocation */
}

static bool je_hook_merge(extent_hooks_t *hooks, void *addr_a, size_t size_a,
                          void *addr_b, size_t size_b, bool committed,
                          unsigned arena_ind) {
  je_arena *ja = (je_arena *)hooks;
  /* jemalloc only merges neighbours (addr_b == addr_a + size_a). */
  return !arena_ledger_same_chunk(ja->owner, addr_a, size_a + size_b);
}

static int je_ctl_arena_write(const je_arena *ja, const char *leaf, void *value,
                              size_t len) {
  char name[64];
  snprintf(name, sizeof name, "arena.%u.%s", ja->index, leaf);
  return je_api.mallctl(name, NULL, NULL, value, len);
}

static void *je_alloc(ferry_arena *a, size_t bytes, int *cap_refused) {
  je_arena *ja = a->kind_state;
  je_cap_refused_by = NULL;
  je_grow_refused = je_exact_requested = 0;
  /* mallocx(0) is undefined; a zero-byte allocation still gets an address. */
  size_t n = bytes ? bytes : 1;
  void *p = je_api.mallocx(n, ja->flags);
  if (!p && je_grow_refused && !je_exact_requested) {
    /* This jemalloc does not follow a refused grow with an exact request:
     * let it grow its retained region (bounded by retain_grow_limit). */
    atomic_store(&ja->exact_extents, 0);
    p = je_api.mallocx(n, ja->flags);
  }
  if (!p && je_cap_refused_by == a) *cap_refused = 1;
  return p;
}

static size_t je_free(ferry_arena *a, void *p, size_t bytes) {
  je_arena *ja = a->kind_state;
  je_api.dallocx(p, ja->flags);
  return bytes;
}

static int cmp_spare(const void *x, const void *y) {
  uintptr_t a = ((const arena_chunk *)x)->addr, b = ((const arena_chunk *)y)->addr;
  return a < b ? -1 : a > b;
}

/* Hands every free extent to the dalloc hook (arena.<i>.purge: all dirty
 * extents, whatever the decay time), merges neighbouring spares of one
 * chunk, and releases the chunks a spare now covers whole. */
static uint64_t je_trim(ferry_arena *a, uint64_t keep_bytes) {
  je_arena *ja = a->kind_state;
  if (je_ctl_arena_write(ja, "purge", NULL, 0) != 0)
    util_log(FERRY_LOG_WARNING, "jemalloc arena.%u.purge failed; trimming the spare extents only",
             ja->index);
  pthread_mutex_lock(&a->lock);
  arena_chunk *gone = ja->n_spare ? malloc(ja->n_spare * sizeof *gone) : NULL;
  size_t n_gone = 0;
  if (gone) {
    qsort(ja->spare, ja->n_spare, sizeof *ja->spare, cmp_spare);
    uint32_t n = 0;
    for (uint32_t i = 0; i < ja->n_spare; i++) {
      arena_chunk sp = ja->spare[i];
      const arena_chunk *c = arena_ledger_find_locked(a, sp.addr);
      if (n && c && ja->spare[n - 1].addr + ja->spare[n - 1].size == sp.addr &&
          c == arena_ledger_find_locked(a, sp.addr - 1))
        ja->spare[n - 1].size += sp.size;
      else
        ja->spare[n++] = sp;
    }
    ja->n_spare = n;
    uint64_t reserved = a->stats.reserved;
    n = 0;
    for (uint32_t i = 0; i < ja->n_spare; i++) {
      arena_chunk sp = ja->spare[i];
      const arena_chunk *c = arena_ledger_find_locked(a, sp.addr);
      if (c && c->addr == sp.addr && c->size == sp.size && reserved >= sp.size &&
          reserved - sp.size >= keep_bytes) {
        gone[n_gone++] = sp;
        reserved -= sp.size;
      } else {
        ja->spare[n++] = sp;
      }
    }
    ja->n_spare = n;
  }
  pthread_mutex_unlock(&a->lock);
  return arena_release_chunks(a, gone, n_gone);
}

static void je_destroy(ferry_arena *a) {
  je_arena *ja = a->kind_state;
  if (!ja) return;
  /* Discards every allocation (live ones included) and the arena's
   * metadata; hooks may still run during this call, so ja outlives it. */
  if (ja->created && je_ctl_arena_write(ja, "destroy", NULL, 0) != 0)
    util_log(FERRY_LOG_ERROR, "jemalloc arena.%u.destroy failed; its pinned memory is freed "
             "anyway", ja->index);
  free(ja->spare); /* destroy purges first: the free extents came back as spares */
  free(ja);
  a->kind_state = NULL;
}

static const arena_kind_ops je_kind_ops = {
    .name = "jemalloc",
    .alloc = je_alloc,
    .free = je_free,
    .destroy = je_destroy,
    .trim = je_trim,
};

/* Mirrors jemalloc 5.3's arena_config_t, written by
 * experimental.arenas_create_ext. */
typedef struct je_arena_config {
  extent_hooks_t *extent_hooks;
  bool metadata_use_hooks;
} je_arena_config;

int arena_jemalloc_init(ferry_arena *a, char *errbuf, size_t errlen) {
  if (!ferry_arena_jemalloc_available()) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen, "jemalloc is not loaded in this process; "
                               "preload libjemalloc.so.2 or use the pool arena");
    return FERRY_EUNSUPPORTED;
  }
  je_arena *ja = calloc(1, sizeof *ja);
  if (!ja) {
    if (errbuf && errlen) snprintf(errbuf, errlen, "ferry_arena_create: out of host memory");
    return FERRY_ENOMEM;
  }
  ja->hooks = (extent_hooks_t){
      .alloc = je_hook_alloc,
      .dalloc = je_hook_dalloc,
      .destroy = je_hook_destroy,
      .commit = je_hook_commit,
      .decommit = NULL,
      .purge_lazy = NULL,
      .purge_forced = NULL,
      .split = je_hook_split,
      .merge = je_hook_merge,
  };
  ja->owner = a;
  atomic_init(&ja->exact_extents, 1);
  a->kind = &je_kind_ops;
  a->kind_state = ja;

  /* Prefer keeping jemalloc's metadata out of pinned memory (it would count
   * against the cap); older jemallocs lack this control, then arenas.create
   * puts it in the hooks' memory. */
  unsigned index = 0;
  size_t len = sizeof index;
  je_arena_config config = {&ja->hooks, false};
  int rc = je_api.mallctl("experimental.arenas_create_ext", &index, &len,
                          &config, sizeof config);
  if (rc != 0) {
    extent_hooks_t *hooks_ptr = &ja->hooks;
    len = sizeof index;
    rc = je_api.mallctl("arenas.create", &index, &len, &hooks_ptr, sizeof hooks_ptr);
  }
  if (rc != 0) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen, "jemalloc arenas.create failed (error %d)%s", rc,
               a->stats.cap ? "; the cap may be too small for jemalloc's metadata" : "");
    return FERRY_ENOMEM;
  }
  ja->index = index;
  ja->created = 1;
  ja->flags = MALLOCX_ARENA(index) | MALLOCX_TCACHE_NONE;

  /* Never purge: decay would only try to madvise pinned pages (refused by
   * the hooks) and move them to retained; reusing dirty extents is cheaper. */
  ssize_t never = -1;
  size_t grow_limit = JE_RETAIN_GROW_LIMIT;
  if (je_ctl_arena_write(ja, "dirty_decay_ms", &never, sizeof never) != 0 ||
      je_ctl_arena_write(ja, "muzzy_decay_ms", &never, sizeof never) != 0) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen, "jemalloc: cannot disable decay on arena %u", index);
    return FERRY_EBACKEND;
  }
  /* Only meaningful with opt.retain (the Linux default); harmless otherwise. */
  (void)je_ctl_arena_write(ja, "retain_grow_limit", &grow_limit, sizeof grow_limit);
  return FERRY_OK;
}
