/* test_pages_backend.h — a host backend over mmap for the arena tests. Each
 * allocation is its own mapping, unmapped when the arena gives it back (so
 * a block handed out from released memory faults), and the backend counts
 * its calls and outstanding bytes. mmap, not malloc: memory from jemalloc's
 * own heap cannot back a jemalloc arena (its global extent map would hold
 * the pages twice). */
#ifndef FERRY_TEST_PAGES_BACKEND_H
#define FERRY_TEST_PAGES_BACKEND_H

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "ferry.h"

/* bytes of fresh pages at alignment (trimmed from a larger mapping when
 * alignment is over a page); NULL when mmap fails. */
static inline void *pages_map(size_t bytes, size_t alignment) {
  size_t page = 4096, len = (bytes + page - 1) / page * page;
  size_t slack = alignment > page ? alignment : 0;
  uint8_t *base = mmap(NULL, len + slack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return NULL;
  uint8_t *p = base;
  if (slack) { /* trim to the alignment */
    p = (uint8_t *)(((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1));
    if (p > base) munmap(base, (size_t)(p - base));
    if (p + len < base + len + slack) munmap(p + len, (size_t)(base + len + slack - (p + len)));
  }
  return p;
}

static inline void pages_unmap(void *p, size_t bytes) {
  munmap(p, (bytes + 4095) / 4096 * 4096);
}

typedef struct pages_backend {
  ferry_backend base;
  atomic_long allocs, frees;
  atomic_llong outstanding; /* bytes */
} pages_backend;

static inline int pages_host_alloc(ferry_backend *b, size_t bytes, size_t alignment,
                                   void **out) {
  pages_backend *pb = (pages_backend *)b;
  void *p = pages_map(bytes, alignment);
  if (!p) return FERRY_ENOMEM;
  atomic_fetch_add(&pb->allocs, 1);
  atomic_fetch_add(&pb->outstanding, (long long)bytes);
  *out = p;
  return 0;
}

static inline int pages_host_free(ferry_backend *b, void *p, size_t bytes) {
  pages_backend *pb = (pages_backend *)b;
  atomic_fetch_add(&pb->frees, 1);
  atomic_fetch_sub(&pb->outstanding, (long long)bytes);
  pages_unmap(p, bytes);
  return 0;
}

static inline void pages_backend_init(pages_backend *pb) {
  static const ferry_backend_ops ops = {
      .name = "pages-counting",
      .host_alloc = pages_host_alloc,
      .host_free = pages_host_free,
  };
  memset(pb, 0, sizeof *pb);
  pb->base.ops = &ops;
}

#endif
