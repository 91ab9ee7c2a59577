/*
 * backend.h — the interface every backend (host, cuda, sim) implements.
 *
 * The semantics are CUDA's, so the cuda backend is a thin mapping and the
 * other two emulate it:
 *   - a stream runs its operations in order; operations on different streams
 *     are unordered unless a stream waits on an event;
 *   - event_record captures all work enqueued on the stream so far; a later
 *     record re-arms the event; an event never recorded counts as complete
 *     (cudaEventQuery semantics);
 *   - copies are asynchronous: the source must stay valid and the destination
 *     untouched until an event recorded after the copy has completed;
 *   - streams passed by the embedder ("external", e.g. the compute stream)
 *     are never created or destroyed by the engine. NULL is the default
 *     stream; on the host backend it is the calling thread, where work is
 *     already complete when the call is made, and waiting means blocking.
 *
 * Every function returns 0 or a negative FERRY_E* code and, on failure,
 * writes a message into the backend's err buffer.
 */
#ifndef FERRY_BACKEND_H
#define FERRY_BACKEND_H

#include "ferry.h"

typedef struct ferry_backend ferry_backend;
typedef void *bk_stream; /* backend-defined; external streams pass through */
typedef struct bk_event bk_event;

/* ferry_backend_ops.flags */
enum {
  /* host_alloc hands out address space that must never be touched (sim):
   * the arena keeps its bookkeeping outside the blocks */
  BK_HOST_MEMORY_OPAQUE = 1u << 0,
};

typedef struct ferry_backend_ops {
  const char *name;
  unsigned flags;
  void (*destroy)(ferry_backend *b);

  /* Page-locked host memory. alignment is a power of two <= 2 MiB. Must
   * come from the OS or the driver (mmap, cudaHostAlloc), never from malloc:
   * the arena may hand it to a jemalloc arena, and heap pages there corrupt
   * the process allocator. */
  int (*host_alloc)(ferry_backend *b, size_t bytes, size_t alignment, void **out);
  int (*host_free)(ferry_backend *b, void *p, size_t bytes);

  /* Engine-owned streams. */
  int (*stream_create)(ferry_backend *b, bk_stream *out);
  int (*stream_destroy)(ferry_backend *b, bk_stream s);

  /* Asynchronous copies on an engine-owned stream. */
  int (*copy_d2h)(ferry_backend *b, void *dst_host, const void *src_dev,
                  size_t bytes, bk_stream s);
  int (*copy_h2d)(ferry_backend *b, void *dst_dev, const void *src_host,
                  size_t bytes, bk_stream s);

  int (*event_create)(ferry_backend *b, bk_event **out);
  int (*event_destroy)(ferry_backend *b, bk_event *ev);
  /* s may be an engine stream or an external one (NULL included). */
  int (*event_record)(ferry_backend *b, bk_event *ev, bk_stream s);
  /* 1 = complete, 0 = not yet, negative = error. */
  int (*event_query)(ferry_backend *b, bk_event *ev);
  int (*event_synchronize)(ferry_backend *b, bk_event *ev);
  /* Work enqueued on s after this call waits for ev. s may be external. */
  int (*stream_wait_event)(ferry_backend *b, bk_stream s, bk_event *ev);
} ferry_backend_ops;

struct ferry_backend {
  const ferry_backend_ops *ops;
  char err[256]; /* message of the last failure */
};

/* Constructors. cfg is the engine's config (link model, device). On failure
 * they return a negative code and write a message into errbuf. */
int ferry_backend_host_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen);
int ferry_backend_cuda_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen);
int ferry_backend_sim_create(const ferry_config *cfg, ferry_backend **out,
                             char *errbuf, size_t errlen);

#endif
