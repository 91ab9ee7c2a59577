/*
 * cuda_double.c — a TEST DOUBLE of the CUDA runtime on host threads.
 * What it models and which rules it enforces: cuda_double.h.
 *
 * One lock (g_lock) guards all state; the double favours being obviously
 * right over being fast. Each stream's worker sleeps on its own condition
 * variable until work arrives; everything that waits for work to complete
 * (host waits, stream waits on events) sleeps on g_done, broadcast whenever an
 * operation completes. Streams and events are never freed before exit, so a handle
 * used after its destroy is recognized instead of being reused memory.
 */
#include "cuda_double.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_DEVICES 8
#define MAX_INJECTIONS 16
#define MAX_COUNTED_CALLS 48
#define HANDLE_BUCKETS 4096u
#define HOST_PAGE 4096u
#define DEVICE_ALIGN 256u
#define DEFAULT_COPY_DELAY_US 50u
#define UNINITIALIZED_DEVICE_BYTE 0xA5 /* fresh cudaMalloc memory */

/* ---- objects --------------------------------------------------------------- */
typedef struct marker { /* completion of one cudaEventRecord */
  int refs;
  int done;
  long *clock; /* the recording stream's vector clock at the record */
  int clock_len;
} marker;

typedef enum { OP_COPY, OP_RECORD, OP_WAIT, OP_HOST_FUNC } op_kind;

typedef struct op {
  op_kind kind;
  long seq; /* position on its stream, from 1 */
  char *dst;
  const char *src;
  size_t bytes;
  unsigned delay_us;
  int by_caller; /* a synchronous copy the calling thread runs itself */
  marker *m; /* RECORD: completes it; WAIT: waits for it */
  cudaHostFn_t fn; /* HOST_FUNC: called on the stream's thread, in order */
  void *fn_ud;
  struct op *next;
} op;

struct CUstream_st {
  int destroyed;
  int internal; /* a default stream (legacy or per-thread): never destroyed */
  int device;
  int id;
  op *head, *tail;
  /* Vector clock: clock[id] counts this stream's ops; clock[other] is the
   * last op of `other` that every later op here is ordered after. */
  long *clock;
  int clock_len;
  pthread_t thread;
  pthread_cond_t work; /* the worker sleeps here while it has nothing to do */
  int exited, joined;
  struct CUstream_st *next_all;
};

struct CUevent_st {
  int destroyed;
  int device;
  marker *latest; /* NULL until first recorded */
  struct CUevent_st *next_all;
};

typedef enum { REG_DEVICE, REG_HOSTALLOC, REG_REGISTERED } region_kind;
typedef struct region {
  char *base;
  size_t size;
  region_kind kind;
  int device;
  struct region *next;
} region;

typedef enum { H_STREAM = 1, H_EVENT = 2 } handle_kind;
typedef struct handle_entry {
  const void *ptr;
  handle_kind kind;
  struct handle_entry *next;
} handle_entry;

/* ---- state ----------------------------------------------------------------- */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int g_no_driver;
static int g_device_count = 1;
static int g_register_supported = 1;
static unsigned g_default_delay_us = DEFAULT_COPY_DELAY_US;
static unsigned g_delay_us = DEFAULT_COPY_DELAY_US;
static int g_paused;
static int g_shutdown;

static long g_violations;
static char g_last_violation[512];

static region *g_regions;
static struct CUstream_st *g_streams;
static struct CUevent_st *g_events;
static int g_next_stream_id;
static struct CUstream_st *g_legacy[MAX_DEVICES];
static handle_entry *g_handles[HANDLE_BUCKETS];

static struct {
  char name[48];
  int countdown;
  cudaError_t err;
} g_inject[MAX_INJECTIONS];
static struct {
  const char *name;
  long count;
} g_calls[MAX_COUNTED_CALLS];

static _Thread_local int t_device;
/* Primary contexts made (per device, process-wide): by cudaSetDevice (as
 * since CUDA 12) and by what makes memory, streams or events on the current
 * device. Reported by cuDevicePrimaryCtxGetState through
 * cudaGetDriverEntryPointByVersion. */
static int g_primary[MAX_DEVICES];
static _Thread_local cudaError_t t_last_error;
static _Thread_local struct CUstream_st *t_per_thread[MAX_DEVICES];

static void lock(void) { pthread_mutex_lock(&g_lock); }
static void unlock(void) { pthread_mutex_unlock(&g_lock); }

/* ---- errors and violations ------------------------------------------------ */
static cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

/* Record a rule violation (g_lock held) and fail the call with e. */
static cudaError_t violation(cudaError_t e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_violation, sizeof g_last_violation, fmt, ap);
  va_end(ap);
  g_violations++;
  fprintf(stderr, "cuda double: VIOLATION: %s\n", g_last_violation);
  return fail(e);
}

static void at_exit(void);

static void init_once(void) {
  const char *d = getenv("CUDA_DOUBLE_COPY_DELAY_US");
  if (d && *d) g_default_delay_us = (unsigned)strtoul(d, NULL, 10);
  g_delay_us = g_default_delay_us;
  atexit(at_exit);
}

static void count_call(const char *name) {
  for (int i = 0; i < MAX_COUNTED_CALLS; i++) {
    if (!g_calls[i].name) g_calls[i].name = name;
    if (g_calls[i].name == name || strcmp(g_calls[i].name, name) == 0) {
      g_calls[i].count++;
      return;
    }
  }
}

static cudaError_t injected(const char *name) {
  for (int i = 0; i < MAX_INJECTIONS; i++) {
    if (g_inject[i].countdown > 0 && strcmp(g_inject[i].name, name) == 0 &&
        --g_inject[i].countdown == 0)
      return g_inject[i].err;
  }
  return cudaSuccess;
}

/* Start of every entry point: count it, then the no-driver switch and
 * injected failures. Returns with g_lock held on success. */
static cudaError_t enter(const char *name) {
  pthread_once(&g_once, init_once);
  lock();
  count_call(name);
  cudaError_t e = g_no_driver ? cudaErrorInsufficientDriver : injected(name);
  if (e != cudaSuccess) {
    unlock();
    return fail(e);
  }
  return cudaSuccess;
}

#define ENTER(name)                                                          \
  do {                                                                       \
    cudaError_t enter_rc_ = enter(name);                                     \
    if (enter_rc_ != cudaSuccess) return enter_rc_;                          \
  } while (0)

/* Unlock and return: the common tail of entry points. */
static cudaError_t leave(cudaError_t e) {
  unlock();
  return e; /* on failure, fail()/violation() already set the last error */
}

/* ---- handles --------------------------------------------------------------- */
static unsigned handle_bucket(const void *p) {
  uintptr_t v = (uintptr_t)p;
  return (unsigned)((v >> 4) ^ (v >> 16)) & (HANDLE_BUCKETS - 1);
}

static int handle_add(const void *p, handle_kind kind) {
  handle_entry *h = malloc(sizeof *h);
  if (!h) return 0;
  h->ptr = p;
  h->kind = kind;
  unsigned b = handle_bucket(p);
  h->next = g_handles[b];
  g_handles[b] = h;
  return 1;
}

static int handle_known(const void *p, handle_kind kind) {
  for (handle_entry *h = g_handles[handle_bucket(p)]; h; h = h->next)
    if (h->ptr == p && h->kind == kind) return 1;
  return 0;
}

/* ---- markers and clocks ---------------------------------------------------- */
static void marker_release(marker *m) {
  if (m && --m->refs == 0) {
    free(m->clock);
    free(m);
  }
}

static long clock_get(const long *clock, int len, int id) {
  return id < len ? clock[id] : 0;
}

static int clock_grow(long **clock, int *len, int want) {
  if (want <= *len) return 1;
  long *c = realloc(*clock, (size_t)want * sizeof *c);
  if (!c) return 0;
  memset(c + *len, 0, (size_t)(want - *len) * sizeof *c);
  *clock = c;
  *len = want;
  return 1;
}

/* ---- streams --------------------------------------------------------------- */
static void *stream_worker(void *arg);

/* After a change every worker must look at (pause, shutdown). */
static void wake_all(void) {
  for (struct CUstream_st *s = g_streams; s; s = s->next_all)
    pthread_cond_signal(&s->work);
  pthread_cond_broadcast(&g_done);
}

static void join_finished_streams(void) {
  for (struct CUstream_st *s = g_streams; s; s = s->next_all)
    if (s->exited && !s->joined) {
      pthread_join(s->thread, NULL); /* already returned: does not block */
      s->joined = 1;
    }
}

static struct CUstream_st *stream_new(int device, int internal) {
  struct CUstream_st *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->device = device;
  s->internal = internal;
  s->id = g_next_stream_id++;
  pthread_cond_init(&s->work, NULL);
  if (!clock_grow(&s->clock, &s->clock_len, s->id + 1) || !handle_add(s, H_STREAM)) {
    free(s->clock);
    free(s);
    return NULL;
  }
  if (pthread_create(&s->thread, NULL, stream_worker, s) != 0) {
    /* The handle entry stays; the object is kept as destroyed. */
    s->destroyed = s->exited = s->joined = 1;
    s->next_all = g_streams;
    g_streams = s;
    return NULL;
  }
  s->next_all = g_streams;
  g_streams = s;
  return s;
}

static struct CUstream_st *legacy_stream(int device) {
  if (!g_legacy[device]) g_legacy[device] = stream_new(device, 1);
  return g_legacy[device];
}

static struct CUstream_st *per_thread_stream(int device) {
  if (!t_per_thread[device]) t_per_thread[device] = stream_new(device, 1);
  return t_per_thread[device];
}

/* Resolve a cudaStream_t (g_lock held). */
static cudaError_t resolve_stream(cudaStream_t h, const char *call,
                                  struct CUstream_st **out) {
  *out = NULL;
  if (h == NULL || h == cudaStreamLegacy || h == cudaStreamPerThread) {
    *out = h == cudaStreamPerThread ? per_thread_stream(t_device)
                                    : legacy_stream(t_device);
    return *out ? cudaSuccess : fail(cudaErrorMemoryAllocation);
  }
  if (!handle_known(h, H_STREAM))
    return violation(cudaErrorInvalidResourceHandle,
                     "%s: %p is not a stream created by cudaStreamCreateWithFlags",
                     call, (void *)h);
  if (h->destroyed)
    return violation(cudaErrorInvalidResourceHandle,
                     "%s: stream %p (#%d) used after cudaStreamDestroy", call,
                     (void *)h, h->id);
  *out = h;
  return cudaSuccess;
}

static cudaError_t resolve_event(cudaEvent_t h, const char *call) {
  if (!h || !handle_known(h, H_EVENT))
    return violation(cudaErrorInvalidResourceHandle,
                     "%s: %p is not an event created by cudaEventCreateWithFlags",
                     call, (void *)h);
  if (h->destroyed)
    return violation(cudaErrorInvalidResourceHandle,
                     "%s: event %p used after cudaEventDestroy", call, (void *)h);
  return cudaSuccess;
}

static op *enqueue(struct CUstream_st *s, op_kind kind) {
  op *o = calloc(1, sizeof *o);
  if (!o) return NULL;
  o->kind = kind;
  o->seq = ++s->clock[s->id];
  if (s->tail)
    s->tail->next = o;
  else
    s->head = o;
  s->tail = o;
  pthread_cond_signal(&s->work);
  return o;
}

static void sleep_us(unsigned us) {
  struct timespec ts = {(time_t)(us / 1000000u), (long)(us % 1000000u) * 1000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
}

static void *stream_worker(void *arg) {
  struct CUstream_st *s = arg;
  lock();
  for (;;) {
    op *o = s->head;
    if (!o) {
      if (s->destroyed || g_shutdown) break;
      pthread_cond_wait(&s->work, &g_lock);
      continue;
    }
    if (g_paused && !s->internal) {
      pthread_cond_wait(&s->work, &g_lock);
      continue;
    }
    if ((o->kind == OP_WAIT && !o->m->done) || o->by_caller) {
      pthread_cond_wait(&g_done, &g_lock);
      continue;
    }
    if (o->kind == OP_RECORD) o->m->done = 1;
    if (o->kind == OP_COPY) {
      /* Stays at the head (in flight) while the bytes move. */
      unlock();
      if (o->delay_us) sleep_us(o->delay_us);
      memcpy(o->dst, o->src, o->bytes);
      lock();
    }
    if (o->kind == OP_HOST_FUNC) { /* as CUDA: the stream waits for it */
      unlock();
      o->fn(o->fn_ud);
      lock();
    }
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    marker_release(o->m);
    free(o);
    pthread_cond_broadcast(&g_done);
  }
  s->exited = 1;
  pthread_cond_broadcast(&g_done);
  unlock();
  return NULL;
}

/* ---- memory regions -------------------------------------------------------- */
static region *region_containing(const void *p, size_t n, unsigned kinds) {
  const char *c = p;
  for (region *r = g_regions; r; r = r->next)
    if ((kinds & (1u << r->kind)) && c >= r->base && n <= r->size &&
        (size_t)(c - r->base) <= r->size - n)
      return r;
  return NULL;
}

static int ranges_overlap(const char *a, size_t an, const char *b, size_t bn) {
  return an && bn && a < b + bn && b < a + an;
}

static region *region_overlapping(const void *p, size_t n, unsigned kinds) {
  for (region *r = g_regions; r; r = r->next)
    if ((kinds & (1u << r->kind)) && ranges_overlap(p, n, r->base, r->size))
      return r;
  return NULL;
}

static int region_add(void *base, size_t size, region_kind kind) {
  region *r = malloc(sizeof *r);
  if (!r) return 0;
  r->base = base;
  r->size = size;
  r->kind = kind;
  r->device = t_device;
  r->next = g_regions;
  g_regions = r;
  return 1;
}

static void region_remove(region *target) {
  for (region **pp = &g_regions; *pp; pp = &(*pp)->next)
    if (*pp == target) {
      *pp = target->next;
      free(target);
      return;
    }
}

#define KIND_BIT(k) (1u << (k))
#define PINNED_KINDS (KIND_BIT(REG_HOSTALLOC) | KIND_BIT(REG_REGISTERED))

/* A copy, queued or running, that touches [p, p+n); NULL if none. */
static op *copy_in_flight(const char *p, size_t n, struct CUstream_st **on) {
  for (struct CUstream_st *s = g_streams; s; s = s->next_all)
    for (op *o = s->head; o; o = o->next)
      if (o->kind == OP_COPY && (ranges_overlap(p, n, o->dst, o->bytes) ||
                                 ranges_overlap(p, n, o->src, o->bytes))) {
        *on = s;
        return o;
      }
  return NULL;
}

static cudaError_t check_free_while_copying(const char *call, region *r) {
  struct CUstream_st *s = NULL;
  op *o = copy_in_flight(r->base, r->size, &s);
  if (!o) return cudaSuccess;
  return violation(cudaErrorIllegalState,
                   "%s(%p): copy #%ld on stream #%d still %s these bytes; free "
                   "only after an event recorded after the copy has completed",
                   call, (void *)r->base, o->seq, s->id,
                   ranges_overlap(r->base, r->size, o->dst, o->bytes) ? "writes"
                                                                      : "reads");
}

/* Rule 9: a new copy on s against copies in flight on other streams. */
static cudaError_t check_unordered(struct CUstream_st *s, const char *call,
                                   const char *dst, const char *src, size_t n) {
  for (struct CUstream_st *t = g_streams; t; t = t->next_all) {
    if (t == s) continue;
    long ordered_upto = clock_get(s->clock, s->clock_len, t->id);
    for (op *o = t->head; o; o = o->next) {
      if (o->kind != OP_COPY || o->seq <= ordered_upto) continue;
      int conflict = ranges_overlap(dst, n, o->dst, o->bytes) ||
                     ranges_overlap(dst, n, o->src, o->bytes) ||
                     ranges_overlap(src, n, o->dst, o->bytes);
      if (conflict)
        return violation(
            cudaErrorIllegalState,
            "%s on stream #%d: [%p, +%zu) <- [%p, +%zu) races with copy #%ld on "
            "stream #%d ([%p, +%zu) <- [%p, +%zu)), still in flight, and nothing "
            "orders the two (missing cudaStreamWaitEvent on an event recorded "
            "after that copy?)",
            call, s->id, (void *)dst, n, (const void *)src, n, o->seq, t->id,
            (void *)o->dst, o->bytes, (const void *)o->src, o->bytes);
    }
  }
  return cudaSuccess;
}

static cudaError_t bad_direction(const char *call, enum cudaMemcpyKind kind,
                                 int async) {
  return violation(cudaErrorInvalidMemcpyDirection,
                   "%s: direction %d; the double implements DeviceToHost and "
                   "HostToDevice%s (ferry states its directions explicitly)",
                   call, (int)kind, async ? "" : " and DeviceToDevice");
}

/* Rules 1-3: the two sides of a copy. */
static cudaError_t check_copy_sides(const char *call, const void *dst,
                                    const void *src, size_t n,
                                    enum cudaMemcpyKind kind, int async) {
  const void *dev[2] = {NULL, NULL};
  const void *host = NULL;
  const char *host_role = "";
  switch (kind) {
  case cudaMemcpyDeviceToHost:
    dev[0] = src, host = dst, host_role = "destination";
    break;
  case cudaMemcpyHostToDevice:
    dev[0] = dst, host = src, host_role = "source";
    break;
  case cudaMemcpyDeviceToDevice: /* tests only: ferry never copies on device */
    if (!async) {
      dev[0] = src, dev[1] = dst;
      break;
    }
    return bad_direction(call, kind, async);
  default:
    return bad_direction(call, kind, async);
  }
  for (int i = 0; i < 2 && dev[i]; i++)
    if (!region_containing(dev[i], n, KIND_BIT(REG_DEVICE)))
      return violation(cudaErrorInvalidValue,
                       "%s: device %s [%p, +%zu) is not inside a cudaMalloc block",
                       call, dev[i] == src ? "source" : "destination", dev[i], n);
  if (async && !region_containing(host, n, PINNED_KINDS))
    return violation(cudaErrorInvalidValue,
                     "%s: host %s [%p, +%zu) is not pinned (not from cudaHostAlloc "
                     "or cudaHostRegister); CUDA would run it as a synchronous "
                     "staged copy, with no overlap",
                     call, host_role, host, n);
  return cudaSuccess;
}

/* The CUDA runtime's entry points and the double's own API, in files of
 * their own but in this translation unit (see their heads). */
#include "cuda_double_runtime.c"
#include "cuda_double_control.c"
