/*
 * backend_cuda.c — the backend vtable on the CUDA runtime API.
 * How it works: docs/internals.md#backend_cudac.
 */
#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "util/errbuf.h"
#include "ferry_tools.h"
#include "backend/backend_internal.h"
#include "util/util.h"

#define MAX_HOST_ALIGNMENT ((size_t)2 << 20)
#define HUGE_PAGE_BYTES ((size_t)2 << 20)
/* Header in front of a cudaHostAlloc block (fallback path only). */
#define HOSTALLOC_MAGIC 0x66636861u /* "fcha" */

/*
 * How pinned memory is obtained.
 *
 * PIN_REGISTER (the default): mmap, touch every page, cudaHostRegister. It is
 * 3-4x faster to obtain than cudaHostAlloc (docs/hardware.md: cudaHostAlloc costs
 * 0.25-0.5 s per GiB), the alignment is exact (the mapping is trimmed to the
 * aligned span, nothing wasted), and freeing is cudaHostUnregister + munmap.
 * The pages are touched before registering so the kernel populates them
 * (transparent huge pages where it can) before the driver pins them.
 *
 * PIN_HOSTALLOC: cudaHostAlloc, for devices whose
 * cudaDevAttrHostRegisterSupported is 0 (some Tegra parts). The block is
 * over-allocated by the alignment and a small header in front of the aligned
 * pointer remembers the block's start for cudaFreeHost.
 *
 * Both cudaHostUnregister and cudaFreeHost synchronize with the device; the
 * arena only gives memory back when it is destroyed, after every copy has
 * completed, so this never lands on the pack/unpack path.
 */
typedef enum { PIN_REGISTER = 0, PIN_HOSTALLOC = 1 } pin_method;

typedef struct hostalloc_header {
  uint32_t magic;
  uint32_t reserved;
  void *block; /* what cudaHostAlloc returned */
} hostalloc_header;

typedef struct cuda_backend {
  ferry_backend base;
  int device;
  pin_method pin;
  size_t page;
  /* told of each copy's start and end (set_copy_listener), NULL = none */
  bk_copy_listener listener;
  void *listener_ud;
  /* the driver's cuDevicePrimaryCtxGetState, or NULL (see has_context) */
  int (*ctx_state)(int device, unsigned int *flags, int *active);
} cuda_backend;

static cuda_backend *as_cuda(ferry_backend *b) { return (cuda_backend *)b; }

/* bk_event is an opaque name for a cudaEvent_t: no wrapper to allocate. */
static cudaEvent_t cuda_event(bk_event *ev) { return (cudaEvent_t)(void *)ev; }
static cudaStream_t cuda_stream(bk_stream s) { return (cudaStream_t)s; }

static int map_cuda_error(cudaError_t e) {
  switch (e) {
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver:
  case cudaErrorStubLibrary:
  case cudaErrorInvalidDevice:
  case cudaErrorDevicesUnavailable:
  case cudaErrorSystemDriverMismatch:
  case cudaErrorCompatNotSupportedOnDevice:
  case cudaErrorInitializationError:
    return FERRY_ENODEV;
  case cudaErrorMemoryAllocation:
    return FERRY_ENOMEM;
  default:
    return FERRY_EBACKEND;
  }
}

/* Describe a failed CUDA call into buf and return the ferry code. */
static int describe_cuda_error(cudaError_t e, const char *call, char *buf,
                               size_t len) {
  /* The failed call left e in this thread's last-error slot; clear it so the
   * embedder's next cudaGetLastError() does not report ferry's failure. */
  if (cudaPeekAtLastError() == e) (void)cudaGetLastError();
  if (buf && len)
    snprintf(buf, len, "%s: %s (%s)", call, cudaGetErrorString(e),
             cudaGetErrorName(e));
  return map_cuda_error(e);
}

static int cuda_check(cuda_backend *cb, cudaError_t e, const char *call) {
  if (e == cudaSuccess) return FERRY_OK;
  return describe_cuda_error(e, call, cb->base.err, sizeof cb->base.err);
}

/* CUDA_CALL(cb, cudaXxx, (args)) calls cudaXxx(args) through cuda_check. */
#define CUDA_CALL(cb, fn, args) cuda_check((cb), fn args, #fn)

/* ---- device guard --------------------------------------------------------
 * Calls that make things on a device (pinned memory, streams, events) or
 * name the legacy default stream need the engine's device current; the
 * guard switches to it and back. Back only where the thread's device has a
 * primary context already: cudaSetDevice makes one (since CUDA 12), several
 * hundred MB of that GPU, so a thread that never used its device (device 0
 * by default) stays on the engine's device rather than have every rank
 * touch GPU 0. Records and waits on a stream of the engine's device need no
 * guard at all: the stream names its device. */
typedef int (*primary_ctx_state_fn)(int device, unsigned int *flags, int *active);

/* cuDevicePrimaryCtxGetState through the runtime (no libcuda link); NULL
 * where this runtime cannot give it (then every device counts as having a
 * context: the thread's device is always restored). */
static primary_ctx_state_fn primary_ctx_state(void) {
#if CUDART_VERSION >= 12050
  void *fn = NULL;
  enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                       cudaEnableDefault, &found) == cudaSuccess &&
      found == cudaDriverEntryPointSuccess)
    return (primary_ctx_state_fn)fn;
  (void)cudaGetLastError();
#endif
  return NULL;
}

static int has_context(primary_ctx_state_fn state, int device) {
  unsigned int flags = 0;
  int active = 1;
  if (state && state(device, &flags, &active) != 0) return 1;
  return active;
}

typedef struct device_guard {
  int previous;
  int switched;
} device_guard;

static int guard_enter(cuda_backend *cb, device_guard *g) {
  g->switched = 0;
  int current = -1;
  int rc = CUDA_CALL(cb, cudaGetDevice, (&current));
  if (rc) return rc;
  if (current == cb->device) return FERRY_OK;
  if ((rc = CUDA_CALL(cb, cudaSetDevice, (cb->device)))) return rc;
  g->previous = current;
  g->switched = 1;
  return FERRY_OK;
}

/* Restore the thread's device. A failure here is reported only when the
 * guarded call itself succeeded (its own error is the more useful one). */
static int guard_leave(cuda_backend *cb, device_guard *g, int rc) {
  if (!g->switched || !has_context(cb->ctx_state, g->previous)) return rc;
  cudaError_t e = cudaSetDevice(g->previous);
  if (e == cudaSuccess) return rc;
  if (rc) {
    if (cudaPeekAtLastError() == e) (void)cudaGetLastError();
    return rc;
  }
  return cuda_check(cb, e, "cudaSetDevice");
}

/* ---- pinned host memory -------------------------------------------------- */
static int check_alignment(cuda_backend *cb, size_t bytes, size_t *alignment) {
  size_t a = *alignment ? *alignment : cb->page;
  if (a & (a - 1))
    return backend_fail(&cb->base, FERRY_EINVAL,
                "host_alloc: alignment %zu is not a power of two", a);
  if (a > MAX_HOST_ALIGNMENT)
    return backend_fail(&cb->base, FERRY_EINVAL,
                "host_alloc: alignment %zu is above the 2 MiB maximum", a);
  if (a < cb->page) a = cb->page;
  if (bytes > SIZE_MAX - 2 * a - sizeof(hostalloc_header))
    return backend_fail(&cb->base, FERRY_ENOMEM, "host_alloc: size %zu is too large",
                bytes);
  *alignment = a;
  return FERRY_OK;
}

static int alloc_registered(cuda_backend *cb, size_t bytes, size_t alignment,
                            void **out) {
  size_t page = cb->page;
  size_t len = (bytes + page - 1) & ~(page - 1);
  /* Over-map by alignment - page, then trim both ends to the aligned span. */
  size_t map_len = len + alignment - page;
  char *base = mmap(NULL, map_len, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED)
    return backend_fail(&cb->base, FERRY_ENOMEM,
                "host_alloc: mmap of %zu bytes failed: %s", map_len,
                strerror(errno));
  uintptr_t start = ((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1);
  char *p = (char *)start;
  size_t head = (size_t)(p - base);
  size_t tail = map_len - head - len;
  if (head) munmap(base, head);
  if (tail) munmap(p + len, tail);
  /* Huge pages make both the touch and the pinning cheaper; advisory only. */
  if (len >= HUGE_PAGE_BYTES) (void)madvise(p, len, MADV_HUGEPAGE);
  for (size_t off = 0; off < len; off += page) ((volatile char *)p)[off] = 0;
  int rc = CUDA_CALL(cb, cudaHostRegister, (p, len, cudaHostRegisterPortable));
  if (rc) {
    munmap(p, len);
    return rc;
  }
  *out = p;
  return FERRY_OK;
}

static int alloc_hostalloc(cuda_backend *cb, size_t bytes, size_t alignment,
                           void **out) {
  size_t total = bytes + alignment + sizeof(hostalloc_header);
  void *block = NULL;
  int rc = CUDA_CALL(cb, cudaHostAlloc, (&block, total, cudaHostAllocPortable));
  if (rc) return rc;
  uintptr_t first = (uintptr_t)block + sizeof(hostalloc_header);
  char *p = (char *)((first + alignment - 1) & ~(uintptr_t)(alignment - 1));
  hostalloc_header *h = (hostalloc_header *)(void *)(p - sizeof *h);
  h->magic = HOSTALLOC_MAGIC;
  h->reserved = 0;
  h->block = block;
  *out = p;
  return FERRY_OK;
}

static int host_alloc(ferry_backend *b, size_t bytes, size_t alignment,
                      void **out) {
  cuda_backend *cb = as_cuda(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "host_alloc: out is NULL");
  *out = NULL;
  if (bytes == 0) return backend_fail(b, FERRY_EINVAL, "host_alloc: size is 0");
  int rc = check_alignment(cb, bytes, &alignment);
  if (rc) return rc;
  device_guard g;
  if ((rc = guard_enter(cb, &g))) return rc;
  rc = cb->pin == PIN_REGISTER ? alloc_registered(cb, bytes, alignment, out)
                               : alloc_hostalloc(cb, bytes, alignment, out);
  return guard_leave(cb, &g, rc);
}

static int host_free(ferry_backend *b, void *p, size_t bytes) {
  cuda_backend *cb = as_cuda(b);
  if (!p) return backend_fail(b, FERRY_EINVAL, "host_free: pointer is NULL");
  if (bytes == 0) return backend_fail(b, FERRY_EINVAL, "host_free: size is 0");
  if ((uintptr_t)p & (cb->page - 1))
    return backend_fail(b, FERRY_EINVAL,
                "host_free: %p is not page aligned, so not from host_alloc", p);
  device_guard g;
  int rc = guard_enter(cb, &g);
  if (rc) return rc;
  if (cb->pin == PIN_REGISTER) {
    size_t len = (bytes + cb->page - 1) & ~(cb->page - 1);
    rc = CUDA_CALL(cb, cudaHostUnregister, (p));
    if (!rc && munmap(p, len) != 0)
      rc = backend_fail(b, FERRY_EINVAL, "host_free: munmap(%p, %zu) failed: %s", p,
                len, strerror(errno));
  } else {
    hostalloc_header *h = (hostalloc_header *)(void *)((char *)p - sizeof *h);
    if (h->magic != HOSTALLOC_MAGIC)
      rc = backend_fail(b, FERRY_EINVAL, "host_free: %p was not allocated by host_alloc", p);
    else {
      h->magic = 0;
      rc = CUDA_CALL(cb, cudaFreeHost, (h->block));
    }
  }
  return guard_leave(cb, &g, rc);
}

/* ---- streams ------------------------------------------------------------- */
static int stream_create(ferry_backend *b, bk_stream *out) {
  cuda_backend *cb = as_cuda(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "stream_create: out is NULL");
  *out = NULL;
  device_guard g;
  int rc = guard_enter(cb, &g);
  if (rc) return rc;
  cudaStream_t s = NULL;
  rc = CUDA_CALL(cb, cudaStreamCreateWithFlags, (&s, cudaStreamNonBlocking));
  if (!rc) *out = (bk_stream)s;
  return guard_leave(cb, &g, rc);
}

static int stream_destroy(ferry_backend *b, bk_stream s) {
  if (!s)
    return backend_fail(b, FERRY_EINVAL,
                "stream_destroy: NULL is the default stream, not an engine stream");
  /* Returns at once; CUDA releases the stream when its queued work is done. */
  return CUDA_CALL(as_cuda(b), cudaStreamDestroy, (cuda_stream(s)));
}

static int copy_args(ferry_backend *b, const char *what, const void *dst,
                     const void *src, bk_stream s) {
  if (!dst || !src)
    return backend_fail(b, FERRY_EINVAL, "%s: %s pointer is NULL", what,
                dst ? "source" : "destination");
  if (!s)
    return backend_fail(b, FERRY_EINVAL,
                "%s: copies run on an engine stream, not the default stream", what);
  return FERRY_OK;
}

/* ---- copy timing (set_copy_listener) --------------------------------------
 * With a listener, a copy is bracketed by two host functions on its stream
 * (cudaLaunchHostFunc): the first runs when the stream reaches the copy
 * (what was before it, waits included, is done) and stamps the start; the
 * second runs when the copy is done, stamps the end and tells the listener.
 * The stream waits for each, a few µs per copy, paid only while a Chrome
 * trace is recorded. A bracket that cannot be enqueued leaves the copy
 * untimed (the engine then times it as it observes it). */
typedef struct copy_timing {
  bk_copy_listener fn; /* NULL: the copy failed, only free */
  void *ud;
  int dir;
  uint64_t bytes;
  const void *dev, *host;
  double start_us;
} copy_timing;

static void CUDART_CB timing_start(void *p) { ((copy_timing *)p)->start_us = util_now_us(); }

static void CUDART_CB timing_end(void *p) {
  copy_timing *t = p;
  if (t->fn) t->fn(t->ud, t->dir, t->start_us, util_now_us(), t->bytes, t->dev, t->host);
  free(t);
}

/* No device guard on copies: the CUDA programming guide ("Stream and Event
 * Behavior") says a memory copy succeeds when issued to a stream of another
 * device than the current one (only kernel launches fail), so a writer or
 * backward thread sitting on device 0 may enqueue them as they are. */
static int copy_async(cuda_backend *cb, int dir, void *dst, const void *src, size_t bytes,
                      bk_stream s) {
  copy_timing *t = NULL;
  if (cb->listener && (t = malloc(sizeof *t))) {
    *t = (copy_timing){cb->listener, cb->listener_ud, dir, bytes, dir ? dst : src,
                       dir ? src : dst, 0};
    if (cudaLaunchHostFunc(cuda_stream(s), timing_start, t) != cudaSuccess) {
      (void)cudaGetLastError();
      free(t);
      t = NULL;
    }
  }
  int rc = CUDA_CALL(cb, cudaMemcpyAsync,
                     (dst, src, bytes, dir ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                      cuda_stream(s)));
  if (t) {
    if (rc) t->fn = NULL;
    /* (if this fails, the start function may still run: t is left to it) */
    if (cudaLaunchHostFunc(cuda_stream(s), timing_end, t) != cudaSuccess)
      (void)cudaGetLastError();
  }
  return rc;
}

static int copy_d2h(ferry_backend *b, void *dst_host, const void *src_dev,
                    size_t bytes, bk_stream s) {
  if (bytes == 0) return FERRY_OK;
  int rc = copy_args(b, "copy_d2h", dst_host, src_dev, s);
  if (rc) return rc;
  return copy_async(as_cuda(b), 0, dst_host, src_dev, bytes, s);
}

static int copy_h2d(ferry_backend *b, void *dst_dev, const void *src_host,
                    size_t bytes, bk_stream s) {
  if (bytes == 0) return FERRY_OK;
  int rc = copy_args(b, "copy_h2d", dst_dev, src_host, s);
  if (rc) return rc;
  return copy_async(as_cuda(b), 1, dst_dev, src_host, bytes, s);
}

static int set_copy_listener(ferry_backend *b, bk_copy_listener fn, void *ud) {
  cuda_backend *cb = as_cuda(b);
  cb->listener = fn;
  cb->listener_ud = ud;
  return FERRY_OK;
}

/* ---- events -------------------------------------------------------------- */
static int event_create(ferry_backend *b, bk_event **out) {
  cuda_backend *cb = as_cuda(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "event_create: out is NULL");
  *out = NULL;
  device_guard g;
  int rc = guard_enter(cb, &g);
  if (rc) return rc;
  cudaEvent_t ev = NULL;
  rc = CUDA_CALL(cb, cudaEventCreateWithFlags, (&ev, cudaEventDisableTiming));
  if (!rc) *out = (bk_event *)(void *)ev;
  return guard_leave(cb, &g, rc);
}

static int event_destroy(ferry_backend *b, bk_event *ev) {
  if (!ev) return backend_fail(b, FERRY_EINVAL, "event_destroy: event is NULL");
  return CUDA_CALL(as_cuda(b), cudaEventDestroy, (cuda_event(ev)));
}

static int event_record(ferry_backend *b, bk_event *ev, bk_stream s) {
  cuda_backend *cb = as_cuda(b);
  if (!ev) return backend_fail(b, FERRY_EINVAL, "event_record: event is NULL");
  if (s) return CUDA_CALL(cb, cudaEventRecord, (cuda_event(ev), cuda_stream(s)));
  /* The guard makes a NULL stream mean the engine device's default stream. */
  device_guard g;
  int rc = guard_enter(cb, &g);
  if (rc) return rc;
  rc = CUDA_CALL(cb, cudaEventRecord, (cuda_event(ev), cuda_stream(s)));
  return guard_leave(cb, &g, rc);
}

static int event_query(ferry_backend *b, bk_event *ev) {
  if (!ev) return backend_fail(b, FERRY_EINVAL, "event_query: event is NULL");
  cudaError_t e = cudaEventQuery(cuda_event(ev));
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) {
    /* "Not yet" is not a failure; do not leave it in the last-error slot. */
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    return 0;
  }
  return cuda_check(as_cuda(b), e, "cudaEventQuery");
}

static int event_synchronize(ferry_backend *b, bk_event *ev) {
  if (!ev) return backend_fail(b, FERRY_EINVAL, "event_synchronize: event is NULL");
  return CUDA_CALL(as_cuda(b), cudaEventSynchronize, (cuda_event(ev)));
}

static int stream_synchronize(ferry_backend *b, bk_stream s) {
  bk_event *ev;
  int rc = event_create(b, &ev);
  if (rc) return rc;
  if (!(rc = event_record(b, ev, s))) rc = event_synchronize(b, ev);
  int rc2 = event_destroy(b, ev);
  return rc ? rc : rc2;
}

static int stream_wait_event(ferry_backend *b, bk_stream s, bk_event *ev) {
  cuda_backend *cb = as_cuda(b);
  if (!ev) return backend_fail(b, FERRY_EINVAL, "stream_wait_event: event is NULL");
  if (s) return CUDA_CALL(cb, cudaStreamWaitEvent, (cuda_stream(s), cuda_event(ev), 0));
  device_guard g;
  int rc = guard_enter(cb, &g);
  if (rc) return rc;
  rc = CUDA_CALL(cb, cudaStreamWaitEvent, (cuda_stream(s), cuda_event(ev), 0));
  return guard_leave(cb, &g, rc);
}

static void destroy(ferry_backend *b) { free(b); }

static const ferry_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = destroy,
    .host_alloc = host_alloc,
    .host_free = host_free,
    .stream_create = stream_create,
    .stream_destroy = stream_destroy,
    .copy_d2h = copy_d2h,
    .copy_h2d = copy_h2d,
    .event_create = event_create,
    .event_destroy = event_destroy,
    .event_record = event_record,
    .event_query = event_query,
    .event_synchronize = event_synchronize,
    .stream_synchronize = stream_synchronize,
    .stream_wait_event = stream_wait_event,
    .set_copy_listener = set_copy_listener,
};

/* ---- creation ------------------------------------------------------------ */
#define CREATE_CALL(fn, args) create_check(fn args, #fn, errbuf, errlen)

static int create_check(cudaError_t e, const char *call, char *errbuf,
                        size_t errlen) {
  if (e == cudaSuccess) return FERRY_OK;
  return describe_cuda_error(e, call, errbuf, errlen);
}

int ferry_backend_cuda_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen) {
  if (errbuf && errlen) errbuf[0] = '\0';
  if (!out) return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "out is NULL");
  *out = NULL;
  if (!cfg) return ferry_errbuf(errbuf, errlen, FERRY_EINVAL, "config is NULL");

  /* Probe the driver first: with none, this is where creation stops. */
  int count = 0;
  int rc = CREATE_CALL(cudaGetDeviceCount, (&count));
  if (rc) return rc;
  if (count <= 0)
    return ferry_errbuf(errbuf, errlen, FERRY_ENODEV,
                       "cudaGetDeviceCount: no CUDA device is visible");
  int current = -1;
  if ((rc = CREATE_CALL(cudaGetDevice, (&current)))) return rc;
  int device = cfg->device >= 0 ? cfg->device : current;
  if (device >= count)
    return ferry_errbuf(errbuf, errlen, FERRY_ENODEV,
                       "config.device %d does not exist: %d CUDA device%s visible",
                       device, count, count == 1 ? " is" : "s are");

  /* Make the device's context now, so an unusable device (exclusive mode,
   * busy, wrong driver) fails here rather than on the first pack. Then give
   * the thread its device back. */
  if ((rc = CREATE_CALL(cudaSetDevice, (device)))) return rc;
  int register_supported = 0;
  rc = CREATE_CALL(cudaDeviceGetAttribute,
                   (&register_supported, cudaDevAttrHostRegisterSupported, device));
  primary_ctx_state_fn ctx_state = primary_ctx_state();
  if (device != current && has_context(ctx_state, current)) {
    cudaError_t e = cudaSetDevice(current);
    if (!rc && e != cudaSuccess) rc = create_check(e, "cudaSetDevice", errbuf, errlen);
  }
  if (rc) return rc;

  cuda_backend *cb = calloc(1, sizeof *cb);
  if (!cb) return ferry_errbuf(errbuf, errlen, FERRY_ENOMEM, "out of memory");
  cb->base.ops = &cuda_ops;
  cb->device = device;
  cb->ctx_state = ctx_state;
  cb->pin = register_supported ? PIN_REGISTER : PIN_HOSTALLOC;
  cb->page = (size_t)sysconf(_SC_PAGESIZE);
  *out = &cb->base;
  return FERRY_OK;
}
