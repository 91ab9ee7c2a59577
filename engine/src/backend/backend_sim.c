/*
 * backend_sim.c — the sim backend: CUDA stream/event semantics on a virtual
 * clock, for the dry-run simulator (the time model: docs/internals.md).
 * How it works: docs/internals.md#backend_simc.
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "ferry_tools.h"
#include "backend/backend_internal.h"

#define SIM_MAX_ALIGNMENT ((size_t)2 << 20)
#define SIM_EVENT_MAGIC 0x7369656du /* "siem" */
/* Slack when deciding that a copy has finished at a time: copies end at
 * times computed from sums of doubles. */
#define SIM_EPS_US 1e-9

typedef enum { OP_COPY, OP_WAIT_TIME, OP_WAIT_STREAM } sim_op_kind;

typedef struct sim_stream sim_stream;

typedef struct sim_op {
  uint8_t kind; /* sim_op_kind */
  uint8_t dir;  /* OP_COPY: 0 D2H, 1 H2D */
  uint64_t bytes;
  const void *dev, *host; /* OP_COPY: its two ends, for the listener */
  double t_us;         /* OP_WAIT_TIME: not before this time */
  sim_stream *other;   /* OP_WAIT_STREAM: until other has completed */
  uint64_t target;     /*                 this many operations */
} sim_op;

struct sim_stream {
  sim_op *ring;
  uint32_t cap, head, count; /* ring of queued operations, head first */
  uint64_t enqueued, completed;
  int active;          /* the head is a copy in progress */
  double latency_left; /* µs of fixed cost still to pay */
  double bytes_left;
  double start_us;
  int destroyed;
  sim_stream *next; /* every stream ever created, freed at destroy */
};

typedef enum { EV_NONE = 0, EV_TIME, EV_STREAM } sim_event_kind;

struct bk_event {
  uint32_t magic;
  int kind;
  double t_us;        /* EV_TIME */
  sim_stream *stream; /* EV_STREAM */
  uint64_t target;
};

typedef struct sim_backend {
  ferry_backend base;
  pthread_mutex_t lock;
  double bytes_per_us[2]; /* 0 = unlimited */
  double latency_us;
  double duplex[2]; /* factor on direction d while the other one is busy */
  double now;  /* the embedder's clock */
  double link; /* the link has been simulated up to here (<= now, except
                  right after a wait ran it to the copy's end) */
  /* link_run_to left the link at `link` with nothing more to do there, and
   * nothing has changed it since (link_step, a queued operation, a rate):
   * running it to `link` again changes nothing, so it is skipped. The
   * replay reads the counters several times an event at the same time. */
  int settled;
  unsigned active[2];
  unsigned foreign; /* other flows on each direction (sim_backend_share_link)... */
  double foreign_until; /* ...until then */
  sim_stream *streams;
  sim_backend_stats st;
  sim_copy_listener listener;
  void *listener_ud;
  double pin_alloc_us, pin_touch_bytes_per_us; /* pinning cost, 0 = free */
  int pin_on_host_alloc;                       /* host_alloc pays it */
  /* node sharing: host-memory bandwidth this GPU's copies of both
   * directions share (its part of the node's when all GPUs copy at once),
   * bytes/µs, 0 = unlimited */
  double host_mem_bytes_per_us;
  /* copy/compute contention: the device-memory bandwidth a copy's bytes
   * take their share of while a memory-bound kernel runs, bytes/µs, 0 = off */
  double contention_hbm_bytes_per_us;
} sim_backend;

static sim_backend *as_sim(ferry_backend *b) { return (sim_backend *)b; }

static int is_own_stream(sim_backend *sb, bk_stream s) {
  if (!s) return 0;
  for (sim_stream *x = sb->streams; x; x = x->next)
    if ((void *)x == s) return !x->destroyed;
  return 0;
}

/* ---- the link -------------------------------------------------------------- */

/* The bandwidth of direction d with the current copies in progress, bytes/µs
 * (0 = unlimited): the link's, times the duplex factor while the other
 * direction is busy. */
static double dir_bandwidth(const sim_backend *sb, int d) {
  double bw = sb->bytes_per_us[d];
  if (bw <= 0) return 0;
  if (sb->active[1 - d] || sb->foreign) bw *= sb->duplex[d];
  return bw;
}

/* bytes/µs rate of a copy of direction d with the current copies in
 * progress; 0 means unlimited. Copies of one direction share its bandwidth
 * with any foreign flow (a collective crossing the PCIe link); both
 * directions together get no more than this GPU's share of the host's
 * memory bandwidth (node sharing), scaled down alike. */
static double rate_of(const sim_backend *sb, int d) {
  double bw = dir_bandwidth(sb, d);
  if (bw <= 0) return 0;
  if (sb->host_mem_bytes_per_us > 0) {
    double both = bw + (sb->active[1 - d] ? dir_bandwidth(sb, 1 - d) : 0);
    if (both > sb->host_mem_bytes_per_us) bw *= sb->host_mem_bytes_per_us / both;
  }
  int flows = sb->active[d] + sb->foreign;
  return bw / (double)(flows ? flows : 1);
}

static double copy_time_left(const sim_backend *sb, const sim_stream *s, int d) {
  double t = s->latency_left > 0 ? s->latency_left : 0;
  if (s->bytes_left > 0) {
    double r = rate_of(sb, d);
    if (r > 0) t += s->bytes_left / r;
  }
  return t;
}

/* One pass over the streams for start_ready: whether anything started or
 * completed. */
static int start_ready_pass(sim_backend *sb) {
  int changed = 0;
  for (sim_stream *s = sb->streams; s; s = s->next) {
    while (!s->active && s->count) {
      sim_op *op = &s->ring[s->head];
      if (op->kind == OP_WAIT_TIME) {
        if (op->t_us > sb->link) break;
      } else if (op->kind == OP_WAIT_STREAM) {
        if (op->other->completed < op->target) break;
      } else {
        s->active = 1;
        s->latency_left = sb->latency_us;
        s->bytes_left = sb->bytes_per_us[op->dir] > 0 ? (double)op->bytes : 0;
        s->start_us = sb->link;
        sb->active[op->dir]++;
        changed = 1;
        break;
      }
      /* a satisfied wait completes at once */
      s->head = (s->head + 1) % s->cap;
      s->count--;
      s->completed++;
      changed = 1;
    }
  }
  return changed;
}

/* Start what can start at link time on idle streams, until nothing more
 * can: a wait that completes on a stream later in the list may let an
 * earlier one go. Returns whether anything changed. */
static int start_ready(sim_backend *sb) {
  int changed = 0;
  while (start_ready_pass(sb)) changed = 1;
  return changed;
}

static void finish_copy(sim_backend *sb, sim_stream *s) {
  sim_op *op = &s->ring[s->head];
  int d = op->dir;
  sb->active[d]--;
  s->active = 0;
  s->head = (s->head + 1) % s->cap;
  s->count--;
  s->completed++;
  sb->st.copies[d]++;
  sb->st.bytes[d] += op->bytes;
  if (sb->listener)
    sb->listener(sb->listener_ud, d, s->start_us, sb->link, op->bytes, op->dev, op->host);
}

/* One step of the link: start what can start, then run to the next change
 * (a copy ends, a timed wait opens) or to `until`, whichever is first.
 * Returns 1 if the link moved or changed, 0 if it is idle up to `until`,
 * -1 if it is stuck for ever (until infinite and nothing can happen). */
static int link_step(sim_backend *sb, double until) {
  sb->settled = 0;
  int changed = start_ready(sb);
  double next = until;
  if (sb->foreign && sb->foreign_until <= sb->link) sb->foreign = 0; /* that traffic ended */
  if (sb->foreign && sb->foreign_until < next) next = sb->foreign_until; /* the rates change */
  int any_active = sb->active[0] + sb->active[1] > 0;
  for (sim_stream *s = sb->streams; s; s = s->next) {
    if (s->active) {
      double t = sb->link + copy_time_left(sb, s, s->ring[s->head].dir);
      if (t < next) next = t;
    } else if (s->count && s->ring[s->head].kind == OP_WAIT_TIME) {
      double t = s->ring[s->head].t_us;
      if (t < next) next = t;
    }
  }
  if (isinf(next)) return changed ? 1 : -1;
  if (next <= sb->link && !any_active) return changed;
  double dt = next - sb->link;
  if (dt < 0) dt = 0;
  /* Integrate every copy in progress at the current (constant) rates. */
  double dtd[2] = {0, 0};
  for (sim_stream *s = sb->streams; s; s = s->next) {
    if (!s->active) continue;
    int d = s->ring[s->head].dir;
    double left = dt;
    if (s->latency_left > 0) {
      double paid = s->latency_left < left ? s->latency_left : left;
      s->latency_left -= paid;
      left -= paid;
    }
    if (left > 0 && s->bytes_left > 0) {
      double r = rate_of(sb, d);
      s->bytes_left = r > 0 ? s->bytes_left - r * left : 0;
    }
    dtd[d] = dt;
  }
  for (int d = 0; d < 2; d++) sb->st.busy_us[d] += dtd[d];
  sb->link = next;
  /* Finish the copies that are done; their rates were computed with the
   * same set in progress, so ending them together is exact. */
  for (sim_stream *s = sb->streams; s; s = s->next) {
    if (!s->active) continue;
    int d = s->ring[s->head].dir;
    /* Done when what is left is below the clock's resolution. */
    double left = copy_time_left(sb, s, d);
    if (left <= SIM_EPS_US || sb->link + left <= sb->link * (1 + 1e-15)) {
      finish_copy(sb, s);
      changed = 1;
    }
  }
  return changed || dt > 0;
}

/* Run the link up to t (inclusive of what ends exactly at t). */
static void link_run_to(sim_backend *sb, double t) {
  if (t < sb->link || (sb->settled && t == sb->link)) return;
  while (link_step(sb, t) > 0) {
  }
  /* the last step found nothing to start, end or integrate at `link`: a
   * step there again would find the same (see settled) */
  sb->settled = 1;
}

/* Run the link until stream s has completed `target` operations; the link
 * then stands at the time that happened. 0, or -1 if it never will. */
static int link_run_until(sim_backend *sb, sim_stream *s, uint64_t target) {
  while (s->completed < target) {
    /* Ops issued later cannot start before now: run to now first. */
    if (sb->link < sb->now) {
      if (link_step(sb, sb->now) <= 0) sb->link = sb->now;
      continue;
    }
    if (link_step(sb, INFINITY) < 0) return -1;
  }
  return 0;
}

/* ---- copy/compute contention ----------------------------------------------- */

/* The least progress a memory-bound kernel makes beside copies (copies
 * cannot take the whole of device memory's bandwidth; a guard against a
 * contention bandwidth set below the link's). */
#define SIM_MIN_PROGRESS 0.05

/* bytes/µs the copies in progress move now (their latency paid). */
static double link_copy_rate(const sim_backend *sb) {
  double r = 0;
  for (const sim_stream *s = sb->streams; s; s = s->next)
    if (s->active && !(s->latency_left > 0) && s->bytes_left > 0)
      r += rate_of(sb, s->ring[s->head].dir);
  return r;
}

/* The next instant after the link's time at which the copies' rates may
 * change (a latency paid, a copy done, a timed wait opening); INFINITY if
 * none. */
static double link_next_change(const sim_backend *sb) {
  double next = INFINITY;
  for (const sim_stream *s = sb->streams; s; s = s->next) {
    double t = INFINITY;
    if (s->active)
      t = sb->link + (s->latency_left > 0 ? s->latency_left
                                          : copy_time_left(sb, s, s->ring[s->head].dir));
    else if (s->count && s->ring[s->head].kind == OP_WAIT_TIME && s->ring[s->head].t_us > sb->link)
      t = s->ring[s->head].t_us;
    if (t < next) next = t;
  }
  return next;
}

static int event_done(sim_backend *sb, const bk_event *ev) {
  switch (ev->kind) {
  case EV_TIME: return ev->t_us <= sb->now;
  case EV_STREAM:
    if (ev->stream->completed >= ev->target) return 1;
    link_run_to(sb, sb->now);
    return ev->stream->completed >= ev->target;
  default: return 1;
  }
}

/* Block the embedder's clock until ev is complete; returns the µs waited
 * (>= 0) or -1 if the event can never complete. */
static double wait_event(sim_backend *sb, const bk_event *ev) {
  if (event_done(sb, ev)) return 0;
  double before = sb->now, end = sb->now;
  if (ev->kind == EV_TIME) {
    end = ev->t_us;
  } else {
    if (link_run_until(sb, ev->stream, ev->target)) return -1;
    end = sb->link;
  }
  if (end > sb->now) sb->now = end;
  return sb->now - before;
}

/* ---- vtable ----------------------------------------------------------------- */

/* The host blocks while memory is pinned (cudaHostAlloc: allocation,
 * first touch, registration): the one clock moves on, copies in flight go
 * on meanwhile. Under sb->lock. */
static void charge_pinning(sim_backend *sb, uint64_t bytes, int first_touch) {
  double us = sb->pin_alloc_us;
  if (first_touch && sb->pin_touch_bytes_per_us > 0) us += (double)bytes / sb->pin_touch_bytes_per_us;
  if (!(us > 0)) return;
  sb->now += us;
  sb->st.pinned_allocs++;
  sb->st.pinned_alloc_us += us;
  sb->st.host_wait_us += us;
}

static int sim_host_alloc(ferry_backend *b, size_t bytes, size_t alignment, void **out) {
  sim_backend *sb = as_sim(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "sim host_alloc: out is NULL");
  *out = NULL;
  if (!bytes) return backend_fail(b, FERRY_EINVAL, "sim host_alloc: 0 bytes");
  if (alignment == 0 || (alignment & (alignment - 1)) || alignment > SIM_MAX_ALIGNMENT)
    return backend_fail(b, FERRY_EINVAL,
                "sim host_alloc: alignment %zu is not a power of two <= 2 MiB", alignment);
  /* Address space only: the simulator counts host memory and never reads or
   * writes it, so a 70B model's arena costs no RAM. PROT_NONE turns any
   * access into a crash instead of a silent cost. */
  size_t extra = alignment > 4096 ? alignment : 0;
  size_t len = bytes + extra;
  void *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return backend_fail(b, FERRY_ENOMEM, "sim host_alloc: cannot reserve %zu bytes of address space: %s",
                bytes, strerror(errno));
  uintptr_t a = (uintptr_t)p;
  if (extra) {
    uintptr_t aligned = (a + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (aligned > a) munmap(p, aligned - a);
    size_t tail = (a + len) - (aligned + bytes);
    size_t page = 4096;
    size_t keep = (bytes + page - 1) & ~(page - 1);
    if (tail > keep - bytes) munmap((void *)(aligned + keep), (a + len) - (aligned + keep));
    a = aligned;
  }
  pthread_mutex_lock(&sb->lock);
  sb->st.host_reserved_bytes += bytes;
  if (sb->pin_on_host_alloc) charge_pinning(sb, bytes, 1);
  pthread_mutex_unlock(&sb->lock);
  *out = (void *)a;
  return FERRY_OK;
}

static int sim_host_free(ferry_backend *b, void *p, size_t bytes) {
  sim_backend *sb = as_sim(b);
  if (!p) return FERRY_OK;
  size_t page = 4096;
  munmap(p, (bytes + page - 1) & ~(page - 1));
  pthread_mutex_lock(&sb->lock);
  sb->st.host_reserved_bytes -= bytes < sb->st.host_reserved_bytes ? bytes
                                                                     : sb->st.host_reserved_bytes;
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

static int sim_stream_create(ferry_backend *b, bk_stream *out) {
  sim_backend *sb = as_sim(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "sim stream_create: out is NULL");
  sim_stream *s = calloc(1, sizeof *s);
  if (!s) return backend_fail(b, FERRY_ENOMEM, "sim stream_create: out of memory");
  s->cap = 64;
  s->ring = malloc(s->cap * sizeof *s->ring);
  if (!s->ring) {
    free(s);
    return backend_fail(b, FERRY_ENOMEM, "sim stream_create: out of memory");
  }
  pthread_mutex_lock(&sb->lock);
  /* Appended, so streams are visited in creation order (deterministic). */
  sim_stream **tail = &sb->streams;
  while (*tail) tail = &(*tail)->next;
  *tail = s;
  sb->settled = 0;
  pthread_mutex_unlock(&sb->lock);
  *out = s;
  return FERRY_OK;
}

static int sim_stream_destroy(ferry_backend *b, bk_stream s) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  if (!is_own_stream(sb, s)) {
    pthread_mutex_unlock(&sb->lock);
    return backend_fail(b, FERRY_EINVAL, "sim stream_destroy: %p is not a live stream of this backend", s);
  }
  sim_stream *x = s;
  /* Like cudaStreamDestroy: queued work still runs; the clock does not
   * move for it, nobody is waiting. */
  link_run_until(sb, x, x->enqueued);
  x->destroyed = 1;
  sb->settled = 0;
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

static int enqueue(sim_backend *sb, sim_stream *s, sim_op op) {
  if (s->count == s->cap) {
    uint32_t ncap = s->cap * 2;
    sim_op *n = malloc((size_t)ncap * sizeof *n);
    if (!n) return FERRY_ENOMEM;
    for (uint32_t i = 0; i < s->count; i++) n[i] = s->ring[(s->head + i) % s->cap];
    free(s->ring);
    s->ring = n;
    s->cap = ncap;
    s->head = 0;
  }
  s->ring[(s->head + s->count) % s->cap] = op;
  s->count++;
  s->enqueued++;
  sb->settled = 0;
  return FERRY_OK;
}

static int sim_copy(ferry_backend *b, int dir, void *dst, const void *src, size_t bytes,
                    bk_stream s) {
  sim_backend *sb = as_sim(b);
  const char *name = dir ? "copy_h2d" : "copy_d2h";
  if (!dst || !src) return backend_fail(b, FERRY_EINVAL, "sim %s: NULL %s", name, !dst ? "dst" : "src");
  pthread_mutex_lock(&sb->lock);
  int rc = FERRY_OK;
  if (!is_own_stream(sb, s)) {
    rc = backend_fail(b, FERRY_EINVAL, "sim %s: copies need an engine stream, got %p", name, s);
  } else {
    sim_op op = {.kind = OP_COPY, .dir = (uint8_t)dir, .bytes = bytes, .dev = dir ? dst : src,
                 .host = dir ? src : dst};
    if (enqueue(sb, s, op)) rc = backend_fail(b, FERRY_ENOMEM, "sim %s: out of memory", name);
  }
  pthread_mutex_unlock(&sb->lock);
  return rc;
}

static int sim_copy_d2h(ferry_backend *b, void *dst_host, const void *src_dev, size_t bytes,
                        bk_stream s) {
  return sim_copy(b, 0, dst_host, src_dev, bytes, s);
}

static int sim_copy_h2d(ferry_backend *b, void *dst_dev, const void *src_host, size_t bytes,
                        bk_stream s) {
  return sim_copy(b, 1, dst_dev, src_host, bytes, s);
}

static int sim_event_create(ferry_backend *b, bk_event **out) {
  if (!out) return backend_fail(b, FERRY_EINVAL, "sim event_create: out is NULL");
  bk_event *ev = calloc(1, sizeof *ev);
  if (!ev) return backend_fail(b, FERRY_ENOMEM, "sim event_create: out of memory");
  ev->magic = SIM_EVENT_MAGIC;
  *out = ev;
  return FERRY_OK;
}

static int check_event(ferry_backend *b, const bk_event *ev, const char *fn) {
  if (!ev || ev->magic != SIM_EVENT_MAGIC)
    return backend_fail(b, FERRY_EINVAL, "sim %s: %p is not an event of the sim backend", fn,
                (const void *)ev);
  return FERRY_OK;
}

static int sim_event_destroy(ferry_backend *b, bk_event *ev) {
  int rc = check_event(b, ev, "event_destroy");
  if (rc) return rc;
  ev->magic = 0;
  free(ev);
  return FERRY_OK;
}

static int sim_event_record(ferry_backend *b, bk_event *ev, bk_stream s) {
  sim_backend *sb = as_sim(b);
  int rc = check_event(b, ev, "event_record");
  if (rc) return rc;
  pthread_mutex_lock(&sb->lock);
  if (is_own_stream(sb, s)) {
    sim_stream *x = s;
    ev->kind = EV_STREAM;
    ev->stream = x;
    ev->target = x->enqueued;
  } else {
    /* An external stream is the embedder's clock: its work so far ends now. */
    ev->kind = EV_TIME;
    ev->t_us = sb->now;
  }
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

static int sim_event_query(ferry_backend *b, bk_event *ev) {
  sim_backend *sb = as_sim(b);
  int rc = check_event(b, ev, "event_query");
  if (rc) return rc;
  pthread_mutex_lock(&sb->lock);
  int done = event_done(sb, ev);
  pthread_mutex_unlock(&sb->lock);
  return done;
}

static int sim_event_synchronize(ferry_backend *b, bk_event *ev) {
  sim_backend *sb = as_sim(b);
  int rc = check_event(b, ev, "event_synchronize");
  if (rc) return rc;
  pthread_mutex_lock(&sb->lock);
  double waited = wait_event(sb, ev);
  if (waited > 0) sb->st.host_wait_us += waited;
  pthread_mutex_unlock(&sb->lock);
  if (waited < 0) return backend_fail(b, FERRY_EBACKEND, "sim event_synchronize: the event can never complete");
  return FERRY_OK;
}

static int sim_stream_synchronize(ferry_backend *b, bk_stream s) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  if (!is_own_stream(sb, s)) {
    pthread_mutex_unlock(&sb->lock);
    return backend_fail(b, FERRY_EINVAL, "sim stream_synchronize: %p is not an engine stream", s);
  }
  bk_event all = {.magic = SIM_EVENT_MAGIC, .kind = EV_STREAM, .stream = s,
                  .target = ((sim_stream *)s)->enqueued};
  double waited = wait_event(sb, &all);
  if (waited > 0) sb->st.host_wait_us += waited;
  pthread_mutex_unlock(&sb->lock);
  if (waited < 0) return backend_fail(b, FERRY_EBACKEND, "sim stream_synchronize: the stream never drains");
  return FERRY_OK;
}

static int sim_stream_wait_event(ferry_backend *b, bk_stream s, bk_event *ev) {
  sim_backend *sb = as_sim(b);
  int rc = check_event(b, ev, "stream_wait_event");
  if (rc) return rc;
  pthread_mutex_lock(&sb->lock);
  if (is_own_stream(sb, s)) {
    sim_op op = {0};
    if (ev->kind == EV_TIME) {
      op.kind = OP_WAIT_TIME;
      op.t_us = ev->t_us;
    } else if (ev->kind == EV_STREAM && ev->stream != (sim_stream *)s) {
      op.kind = OP_WAIT_STREAM;
      op.other = ev->stream;
      op.target = ev->target;
    } else {
      pthread_mutex_unlock(&sb->lock); /* never recorded, or own stream: in order anyway */
      return FERRY_OK;
    }
    rc = enqueue(sb, s, op);
    pthread_mutex_unlock(&sb->lock);
    return rc ? backend_fail(b, rc, "sim stream_wait_event: out of memory") : FERRY_OK;
  }
  /* The compute stream waits: whatever is left of the copy is exposed. */
  double waited = wait_event(sb, ev);
  if (waited > 0) sb->st.stall_us += waited;
  pthread_mutex_unlock(&sb->lock);
  if (waited < 0) return backend_fail(b, FERRY_EBACKEND, "sim stream_wait_event: the event can never complete");
  return FERRY_OK;
}

static void sim_destroy(ferry_backend *b) {
  sim_backend *sb = as_sim(b);
  if (!sb) return;
  sim_stream *s = sb->streams;
  while (s) {
    sim_stream *n = s->next;
    free(s->ring);
    free(s);
    s = n;
  }
  pthread_mutex_destroy(&sb->lock);
  free(sb);
}

static const ferry_backend_ops sim_ops = {
    .name = "sim",
    .flags = BK_HOST_MEMORY_OPAQUE,
    .destroy = sim_destroy,
    .host_alloc = sim_host_alloc,
    .host_free = sim_host_free,
    .stream_create = sim_stream_create,
    .stream_destroy = sim_stream_destroy,
    .copy_d2h = sim_copy_d2h,
    .copy_h2d = sim_copy_h2d,
    .event_create = sim_event_create,
    .event_destroy = sim_event_destroy,
    .event_record = sim_event_record,
    .event_query = sim_event_query,
    .event_synchronize = sim_event_synchronize,
    .stream_synchronize = sim_stream_synchronize,
    .stream_wait_event = sim_stream_wait_event,
};

int ferry_backend_sim_create(const ferry_config *cfg, ferry_backend **out, char *errbuf,
                             size_t errlen) {
  *out = NULL;
  const ferry_link *l = &cfg->link;
  if (!(l->d2h_bytes_per_s >= 0 && l->h2d_bytes_per_s >= 0 && l->latency_us >= 0) ||
      !isfinite(l->d2h_bytes_per_s) || !isfinite(l->h2d_bytes_per_s) || !isfinite(l->latency_us) ||
      !(l->duplex > 0 && l->duplex <= 1)) {
    if (errbuf && errlen)
      snprintf(errbuf, errlen,
               "sim backend: link bandwidths and latency must be finite and >= 0, duplex in "
               "(0, 1]");
    return FERRY_EINVAL;
  }
  sim_backend *sb = calloc(1, sizeof *sb);
  if (!sb) {
    if (errbuf && errlen) snprintf(errbuf, errlen, "sim backend: out of memory");
    return FERRY_ENOMEM;
  }
  sb->base.ops = &sim_ops;
  pthread_mutex_init(&sb->lock, NULL);
  sb->bytes_per_us[0] = l->d2h_bytes_per_s / 1e6;
  sb->bytes_per_us[1] = l->h2d_bytes_per_s / 1e6;
  sb->latency_us = l->latency_us;
  sb->duplex[0] = sb->duplex[1] = l->duplex;
  *out = &sb->base;
  return FERRY_OK;
}

/* ---- simulator API (ferry_tools.h) ------------------------------------------- */

int sim_backend_is(const ferry_backend *b) { return b && b->ops == &sim_ops; }

void sim_backend_advance(ferry_backend *b, double us) {
  sim_backend *sb = as_sim(b);
  if (!(us > 0)) return;
  pthread_mutex_lock(&sb->lock);
  sb->now += us;
  pthread_mutex_unlock(&sb->lock);
}

void sim_backend_advance_memory_bound(ferry_backend *b, double us) {
  sim_backend *sb = as_sim(b);
  if (!(us > 0)) return;
  pthread_mutex_lock(&sb->lock);
  double left = us; /* µs of the kernel's work at full bandwidth */
  while (left > 0) {
    link_run_to(sb, sb->now);
    double p = 1;
    if (sb->contention_hbm_bytes_per_us > 0)
      p = 1 - link_copy_rate(sb) / sb->contention_hbm_bytes_per_us;
    if (p < SIM_MIN_PROGRESS) p = SIM_MIN_PROGRESS;
    double next = p < 1 ? link_next_change(sb) : INFINITY;
    if (sb->now + left / p <= next) {
      sb->st.contention_us += left / p - left;
      sb->now += left / p;
      break;
    }
    double dt = next - sb->now;
    if (dt < SIM_EPS_US) dt = SIM_EPS_US; /* a change at now: the link takes it next turn */
    left -= dt * p;
    sb->st.contention_us += dt * (1 - p);
    sb->now += dt;
  }
  pthread_mutex_unlock(&sb->lock);
}

int sim_backend_set_node(ferry_backend *b, double host_mem_bytes_per_s,
                         double contention_hbm_bytes_per_s) {
  sim_backend *sb = as_sim(b);
  if (!(host_mem_bytes_per_s >= 0) || !isfinite(host_mem_bytes_per_s) ||
      !(contention_hbm_bytes_per_s >= 0) || !isfinite(contention_hbm_bytes_per_s))
    return backend_fail(b, FERRY_EINVAL,
                        "sim node: host-memory and device-memory bandwidths must be finite and "
                        ">= 0, got %g and %g", host_mem_bytes_per_s, contention_hbm_bytes_per_s);
  pthread_mutex_lock(&sb->lock);
  link_run_to(sb, sb->now);
  sb->host_mem_bytes_per_us = host_mem_bytes_per_s / 1e6;
  sb->contention_hbm_bytes_per_us = contention_hbm_bytes_per_s / 1e6;
  sb->settled = 0;
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

double sim_backend_now(ferry_backend *b) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  double t = sb->now;
  pthread_mutex_unlock(&sb->lock);
  return t;
}

void sim_backend_get_stats(ferry_backend *b, sim_backend_stats *out) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  link_run_to(sb, sb->now);
  *out = sb->st;
  out->now_us = sb->now;
  pthread_mutex_unlock(&sb->lock);
}

void sim_backend_waits(ferry_backend *b, double *stall_us, double *host_wait_us) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  link_run_to(sb, sb->now); /* as sim_backend_get_stats: the same link, the same copies seen */
  *stall_us = sb->st.stall_us;
  *host_wait_us = sb->st.host_wait_us;
  pthread_mutex_unlock(&sb->lock);
}

void sim_backend_set_listener(ferry_backend *b, sim_copy_listener fn, void *ud) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  sb->listener = fn;
  sb->listener_ud = ud;
  pthread_mutex_unlock(&sb->lock);
}

int sim_backend_set_duplex(ferry_backend *b, double d2h, double h2d) {
  sim_backend *sb = as_sim(b);
  if (!(d2h > 0 && d2h <= 1) || !(h2d > 0 && h2d <= 1))
    return backend_fail(b, FERRY_EINVAL, "sim duplex factors must be within (0, 1], got %g and %g", d2h, h2d);
  pthread_mutex_lock(&sb->lock);
  link_run_to(sb, sb->now);
  sb->duplex[0] = d2h;
  sb->duplex[1] = h2d;
  sb->settled = 0;
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

int sim_backend_set_pinned_cost(ferry_backend *b, double alloc_us, double touch_bytes_per_s,
                                int on_host_alloc) {
  sim_backend *sb = as_sim(b);
  if (!(alloc_us >= 0) || !isfinite(alloc_us) || !(touch_bytes_per_s >= 0) ||
      !isfinite(touch_bytes_per_s))
    return backend_fail(b, FERRY_EINVAL,
                        "sim pinned cost: allocation time and touch rate must be finite and >= 0");
  pthread_mutex_lock(&sb->lock);
  sb->pin_alloc_us = alloc_us;
  sb->pin_touch_bytes_per_us = touch_bytes_per_s / 1e6;
  sb->pin_on_host_alloc = on_host_alloc != 0;
  pthread_mutex_unlock(&sb->lock);
  return FERRY_OK;
}

void sim_backend_pinned_alloc(ferry_backend *b, uint64_t bytes) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  charge_pinning(sb, bytes, 0);
  pthread_mutex_unlock(&sb->lock);
}

void sim_backend_share_link(ferry_backend *b, unsigned flows, double until_us,
                            unsigned active[2]) {
  sim_backend *sb = as_sim(b);
  pthread_mutex_lock(&sb->lock);
  link_run_to(sb, sb->now); /* the copies so far at the old share */
  sb->foreign = until_us > sb->link ? flows : 0;
  sb->foreign_until = until_us;
  sb->settled = 0;
  if (active) {
    active[0] = sb->active[0];
    active[1] = sb->active[1];
  }
  pthread_mutex_unlock(&sb->lock);
}
