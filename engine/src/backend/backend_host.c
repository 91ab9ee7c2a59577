/*
 * backend_host.c — the host backend: CUDA stream/event semantics with real
 * threads, for tests, CPU-only runs and the PyTorch binding on CPU builds.
 * How it works: docs/internals.md#backend_hostc.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_setname_np */
#endif
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "util/errbuf.h"
#include "ferry_tools.h"
#include "backend/backend_internal.h"
#include "util/util.h"

/* Operations a stream can hold before a producer blocks (CUDA's launch queue
 * holds about a thousand). */
#define STREAM_RING_CAP 1024u
/* How long a worker polls for new work before sleeping, and how long a waiter
 * polls an event before sleeping: long enough to hide the wake-up cost of a
 * futex (tens of microseconds, more in a VM) behind a copy of a megabyte,
 * short enough not to burn a shared core. */
#define WORKER_POLL_S 50e-6
#define WAITER_POLL_S 200e-6
/* How long a waiting thread leaves an unstarted operation to a worker that
 * polls on another core (it notices new work within about a microsecond)
 * before it runs the operation itself. */
#define HELP_GRACE_S 3e-6
#define MAX_HOST_ALIGNMENT ((size_t)2 << 20)

#define EVENT_MAGIC 0x66657674u  /* "fevt" */

typedef enum { DIR_D2H = 0, DIR_H2D = 1 } copy_dir;

typedef enum { OP_COPY_D2H, OP_COPY_H2D, OP_WAIT } op_kind;

typedef struct host_stream host_stream;

typedef struct stream_op {
  op_kind kind;
  void *dst;
  const void *src;
  size_t bytes;
  host_stream *wait_stream; /* OP_WAIT: until this stream has executed */
  uint64_t wait_target;     /*          this many operations */
} stream_op;

typedef struct host_backend host_backend;

struct host_stream {
  host_backend *backend;
  pthread_t thread;
  bool thread_started;
  /* The lock guards the ring slots written by producers, `stopping`,
   * `worker_sleeping`, and the two condition variables. */
  pthread_mutex_t lock;
  pthread_cond_t work_cv; /* worker sleeps here when the ring is empty */
  pthread_cond_t done_cv; /* waiters on `executed` sleep here */
  stream_op *ring;
  _Atomic uint64_t enqueued; /* written under lock, read anywhere */
  /* Operation k runs on the thread that moves `claimed` from k to k + 1:
   * the worker, or a thread waiting for it (wait_helping). A thread claims
   * only while claimed == executed, so one operation runs at a time, in
   * order. */
  _Atomic uint64_t claimed;
  _Atomic uint64_t executed; /* written by the thread that ran the operation */
  _Atomic uint32_t waiters;  /* threads sleeping (or about to) on done_cv */
  /* The CPU the worker last polled on; -1 while it sleeps. Waiters read it
   * to tell whether the worker is about to take the next operation. */
  _Atomic int worker_cpu;
  bool worker_sleeping;
  bool stopping; /* stream_destroy called: no new work, drain and exit */
  atomic_bool destroyed; /* worker joined; the object stays for events */
  host_stream *next; /* backend's list of every stream ever created */
};

struct bk_event {
  uint32_t magic;
  pthread_mutex_t lock; /* guards (stream, target) as a pair */
  host_stream *stream;  /* NULL: complete (never recorded, or external) */
  uint64_t target;
  bk_event *prev, *next; /* backend's list, so destroy() frees leftovers */
};

/* A copy in progress on the modeled link. Lives on the worker's stack. */
typedef struct link_copy {
  copy_dir dir;
  double latency_left_s; /* fixed cost still to pay */
  double bytes_left;     /* bytes still to transfer */
  struct link_copy *prev, *next;
} link_copy;

typedef struct link_state {
  bool throttled;
  double bytes_per_s[2]; /* per direction; 0 = unlimited */
  double latency_s;
  double duplex;
  pthread_mutex_t lock;
  pthread_cond_t changed_cv; /* broadcast when a copy joins or leaves */
  link_copy *active;         /* copies in progress, both directions */
  unsigned active_count[2];
  double last_update_s;      /* time up to which progress is accounted */
} link_state;

struct host_backend {
  ferry_backend base;
  pthread_mutex_t lock; /* guards the stream and event lists */
  host_stream *streams;
  bk_event *events;
  link_state link;
  _Atomic uint64_t pinned_allocs;
  _Atomic uint64_t pinned_bytes;
  /* told of each copy (set_copy_listener): ud is stored before fn */
  _Atomic(bk_copy_listener) listener;
  void *_Atomic listener_ud;
};

/* ---- small helpers ------------------------------------------------------ */

static host_backend *as_host(ferry_backend *b) { return (host_backend *)b; }

/* The monotonic clock in seconds. */
static double now_s(void) { return util_now_us() * 1e-6; }

static struct timespec timespec_at(double t_s) {
  struct timespec ts;
  double whole = floor(t_s);
  ts.tv_sec = (time_t)whole;
  /* Round up so that waking at the deadline never lands before it. */
  long ns = (long)ceil((t_s - whole) * 1e9);
  if (ns >= 1000000000L) {
    ts.tv_sec += 1;
    ns -= 1000000000L;
  }
  ts.tv_nsec = ns;
  return ts;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Poll until *v >= want, for at most budget_s seconds. Each round yields the
 * CPU after a few checks: on an idle core sched_yield returns at once, and on
 * an oversubscribed machine (more runnable threads than cores) the poller
 * then does not hold up the very thread it waits for. Measured on 2 cores
 * with a third busy thread, a longer pure spin made a round trip to the
 * worker 5x slower. A worker passes its `worker_cpu` as cpu: each round
 * says where it runs. Returns whether *v reached want. */
static bool poll_at_least(_Atomic uint64_t *v, uint64_t want, double budget_s,
                          _Atomic int *cpu) {
  if (cpu) atomic_store_explicit(cpu, sched_getcpu(), memory_order_relaxed);
  for (int k = 0; k < 16; k++) {
    if (atomic_load_explicit(v, memory_order_acquire) >= want) return true;
    cpu_relax();
  }
  double deadline = now_s() + budget_s;
  do {
    sched_yield();
    if (cpu) atomic_store_explicit(cpu, sched_getcpu(), memory_order_relaxed);
    for (int k = 0; k < 16; k++) {
      if (atomic_load_explicit(v, memory_order_acquire) >= want) return true;
      cpu_relax();
    }
  } while (now_s() < deadline);
  return false;
}

static int cond_init_monotonic(pthread_cond_t *cv) {
  pthread_condattr_t attr;
  if (pthread_condattr_init(&attr) != 0) return -1;
  int rc = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  if (rc == 0) rc = pthread_cond_init(cv, &attr);
  pthread_condattr_destroy(&attr);
  return rc;
}

/* ---- waiting on a stream's progress ------------------------------------- */

static bool reached(host_stream *s, uint64_t target) {
  return atomic_load(&s->executed) >= target;
}

/* Wait, holding s->lock, until s has executed `target` operations.
 * Lost wake-ups are impossible: the waiter raises `waiters` before reading
 * `executed`, the worker publishes `executed` before reading `waiters`
 * (both sequentially consistent), and the worker broadcasts under the lock. */
static void wait_reached_locked(host_stream *s, uint64_t target) {
  if (reached(s, target)) return;
  atomic_fetch_add(&s->waiters, 1);
  while (!reached(s, target)) pthread_cond_wait(&s->done_cv, &s->lock);
  atomic_fetch_sub(&s->waiters, 1);
}

/* Wait without holding any lock: poll briefly (a copy is often about to
 * finish), then sleep on the stream's condition variable. cpu: as in
 * poll_at_least; -1 is stored there before sleeping. */
static void wait_reached(host_stream *s, uint64_t target, _Atomic int *cpu) {
  if (poll_at_least(&s->executed, target, WAITER_POLL_S, cpu)) return;
  if (cpu) atomic_store(cpu, -1);
  pthread_mutex_lock(&s->lock);
  wait_reached_locked(s, target);
  pthread_mutex_unlock(&s->lock);
  if (cpu) atomic_store(cpu, sched_getcpu());
}

static void run_claimed(host_stream *s, uint64_t k);

/* wait_reached for a thread that has nothing else to do until then (a
 * synchronize): an operation up to target that no thread has started it
 * runs itself. The case this is for: the scheduler put the worker on the
 * waiter's core, where both poll, and each copy waited for two context
 * switches (a 1 MiB copy and its synchronize ran at 0.81 of a memcpy;
 * bench/README.md, "Copy benchmarks"). But an operation before the last
 * one waited for is left to a worker polling on another core, unless it
 * does not take it within HELP_GRACE_S: back-to-back copies then stay in
 * that core's cache (a waiter taking every other one made 8 distinct
 * 1 MiB copies 35% slower in half of the runs). The last one it may as
 * well run: nothing of its own follows, and what it waits for is often in
 * its cache. */
static void wait_helping(host_stream *s, uint64_t target) {
  if (reached(s, target)) return; /* the common case: no thread-local read */
  if (backend_thread_waits_only) {
    wait_reached(s, target, NULL);
    return;
  }
  double give_up = 0; /* when the grace for operation `grace_for` ends */
  uint64_t grace_for = UINT64_MAX;
  for (;;) {
    uint64_t k = atomic_load(&s->executed);
    if (k >= target) return;
    if (atomic_load(&s->claimed) != k) { /* operation k is running */
      wait_reached(s, k + 1, NULL);
      continue;
    }
    /* A worker polling on another core takes operation k at once. */
    int w = atomic_load_explicit(&s->worker_cpu, memory_order_relaxed);
    if (k + 1 < target && w >= 0 && w != sched_getcpu()) {
      if (grace_for != k) grace_for = k, give_up = now_s() + HELP_GRACE_S;
      if (now_s() < give_up) {
        cpu_relax();
        continue;
      }
      /* It did not: it is not running, whatever CPU it last polled on.
       * Until it polls again, the next waiter need not wait for it. */
      atomic_compare_exchange_strong(&s->worker_cpu, &w, -1);
    }
    /* claimed == executed: nothing is running, so operation k is free. */
    uint64_t expect = k;
    if (atomic_compare_exchange_strong(&s->claimed, &expect, k + 1)) run_claimed(s, k);
  }
}

/* ---- the link model ----------------------------------------------------- */

/* Rate, in bytes/s, of one copy of direction d with the current set of
 * copies in progress. Called with link->lock held. 0 means unlimited. */
static double copy_rate(const link_state *l, copy_dir d) {
  double bw = l->bytes_per_s[d];
  if (bw <= 0) return 0;
  if (l->active_count[1 - d] > 0) bw *= l->duplex;
  return bw / (double)(l->active_count[d] ? l->active_count[d] : 1);
}

/* Account the progress of every copy in progress from the last update to t.
 * The rates are constant over that interval: they change only when a copy
 * joins or leaves, and both call this first. Called with link->lock held. */
static void link_advance(link_state *l, double t) {
  double dt = t - l->last_update_s;
  if (dt <= 0) return;
  l->last_update_s = t;
  for (link_copy *c = l->active; c; c = c->next) {
    double left = dt;
    if (c->latency_left_s > 0) {
      double paid = c->latency_left_s < left ? c->latency_left_s : left;
      c->latency_left_s -= paid;
      left -= paid;
    }
    if (left > 0 && c->bytes_left > 0) {
      double rate = copy_rate(l, c->dir);
      c->bytes_left = rate > 0 ? c->bytes_left - rate * left : 0;
    }
  }
}

/* Seconds the copy still needs at the current rates. link->lock held. */
static double copy_time_left(const link_state *l, const link_copy *c) {
  double t = c->latency_left_s > 0 ? c->latency_left_s : 0;
  if (c->bytes_left > 0) {
    double rate = copy_rate(l, c->dir);
    if (rate > 0) t += c->bytes_left / rate;
  }
  return t;
}

static void link_join(link_state *l, link_copy *c, size_t bytes, copy_dir d) {
  c->dir = d;
  c->latency_left_s = l->latency_s;
  c->bytes_left = l->bytes_per_s[d] > 0 ? (double)bytes : 0;
  pthread_mutex_lock(&l->lock);
  link_advance(l, now_s());
  c->prev = NULL;
  c->next = l->active;
  if (l->active) l->active->prev = c;
  l->active = c;
  l->active_count[d]++;
  /* The others now run slower: let them recompute their deadlines. */
  pthread_cond_broadcast(&l->changed_cv);
  pthread_mutex_unlock(&l->lock);
}

/* Wait until the modeled transfer of c is over, then leave the link. The
 * deadline moves when another copy joins or leaves, so the worker sleeps on
 * a CLOCK_MONOTONIC condition variable with an absolute deadline and is
 * woken to recompute it. */
static void link_finish(link_state *l, link_copy *c) {
  pthread_mutex_lock(&l->lock);
  for (;;) {
    double t = now_s();
    link_advance(l, t);
    double left = copy_time_left(l, c);
    if (left <= 0) break;
    struct timespec deadline = timespec_at(t + left);
    pthread_cond_timedwait(&l->changed_cv, &l->lock, &deadline);
  }
  if (c->prev) c->prev->next = c->next;
  else l->active = c->next;
  if (c->next) c->next->prev = c->prev;
  l->active_count[c->dir]--;
  /* The others now run faster. */
  pthread_cond_broadcast(&l->changed_cv);
  pthread_mutex_unlock(&l->lock);
}

/* ---- the worker --------------------------------------------------------- */

static void run_op(host_stream *s, const stream_op *op) {
  link_state *l = &s->backend->link;
  switch (op->kind) {
    case OP_COPY_D2H:
    case OP_COPY_H2D: {
      copy_dir d = op->kind == OP_COPY_D2H ? DIR_D2H : DIR_H2D;
      bk_copy_listener tell =
          atomic_load_explicit(&s->backend->listener, memory_order_acquire);
      double t0 = tell ? util_now_us() : 0;
      /* (A 0-byte copy may carry NULL pointers, which memcpy must not get.) */
      if (!l->throttled) {
        if (op->bytes) memcpy(op->dst, op->src, op->bytes);
      } else {
        /* An emulated link lands the bytes when the modeled transfer ends,
         * as a device copy is only complete at its event: a reader that
         * does not wait for it sees the old bytes, as it would on a GPU. */
        link_copy c;
        link_join(l, &c, op->bytes, d);
        link_finish(l, &c);
        if (op->bytes) memcpy(op->dst, op->src, op->bytes);
      }
      if (tell)
        tell(atomic_load_explicit(&s->backend->listener_ud, memory_order_relaxed), (int)d, t0,
             util_now_us(), op->bytes, d == DIR_D2H ? op->src : op->dst,
             d == DIR_D2H ? op->dst : op->src);
      break;
    }
    case OP_WAIT:
      wait_reached(op->wait_stream, op->wait_target, NULL);
      break;
  }
}

/* Run operation k, which this thread claimed, and publish it. k is below
 * `enqueued`, and the acquire load makes the slot's contents visible; the
 * producer does not reuse the slot until `executed` passes k. */
static void run_claimed(host_stream *s, uint64_t k) {
  (void)atomic_load_explicit(&s->enqueued, memory_order_acquire);
  stream_op op = s->ring[k % STREAM_RING_CAP];
  run_op(s, &op);
  atomic_store(&s->executed, k + 1);
  if (atomic_load(&s->waiters) > 0) {
    pthread_mutex_lock(&s->lock);
    pthread_cond_broadcast(&s->done_cv);
    pthread_mutex_unlock(&s->lock);
  }
}

static void *stream_worker(void *arg) {
  host_stream *s = arg;
  for (;;) {
    uint64_t done = atomic_load(&s->claimed);
    if (atomic_load(&s->executed) < done) {
      /* A waiter runs operation done - 1: wait for it like any waiter. */
      wait_reached(s, done, &s->worker_cpu);
      continue;
    }
    if (atomic_load_explicit(&s->enqueued, memory_order_acquire) == done) {
      /* Idle: poll for a while (the next copy usually follows at once),
       * then sleep until a producer signals. */
      if (!poll_at_least(&s->enqueued, done + 1, WORKER_POLL_S, &s->worker_cpu)) {
        atomic_store(&s->worker_cpu, -1);
        pthread_mutex_lock(&s->lock);
        while (atomic_load_explicit(&s->enqueued, memory_order_acquire) == done &&
               !s->stopping) {
          s->worker_sleeping = true;
          pthread_cond_wait(&s->work_cv, &s->lock);
          s->worker_sleeping = false;
        }
        bool exit_now =
            s->stopping &&
            atomic_load_explicit(&s->enqueued, memory_order_acquire) == done;
        pthread_mutex_unlock(&s->lock);
        if (exit_now) return NULL;
        atomic_store(&s->worker_cpu, sched_getcpu());
        continue;
      }
    }
    uint64_t expect = done;
    if (atomic_compare_exchange_strong(&s->claimed, &expect, done + 1)) run_claimed(s, done);
  }
}

/* ---- stream lookup ------------------------------------------------------ */

/* The backend's stream for handle h, or NULL if h is external (NULL or a
 * pointer the embedder owns). */
static host_stream *find_stream(host_backend *hb, bk_stream h) {
  if (!h) return NULL;
  pthread_mutex_lock(&hb->lock);
  host_stream *s = hb->streams;
  while (s && (void *)s != h) s = s->next;
  pthread_mutex_unlock(&hb->lock);
  return s;
}

/* The live engine stream for h, or an error naming what is wrong. */
static int engine_stream(host_backend *hb, bk_stream h, const char *what,
                         host_stream **out) {
  if (!h)
    return backend_fail(&hb->base, FERRY_EINVAL,
                "%s: the NULL stream cannot hold copies; pass a stream from "
                "stream_create",
                what);
  host_stream *s = find_stream(hb, h);
  if (!s)
    return backend_fail(&hb->base, FERRY_EINVAL,
                "%s: stream %p is not a stream of this host backend", what, h);
  if (s->destroyed)
    return backend_fail(&hb->base, FERRY_EINVAL, "%s: stream %p was destroyed", what,
                h);
  *out = s;
  return FERRY_OK;
}

/* Append op to s. Blocks while the ring is full. */
static int enqueue(host_backend *hb, host_stream *s, const stream_op *op,
                   const char *what) {
  pthread_mutex_lock(&s->lock);
  uint64_t n;
  for (;;) {
    if (s->stopping) {
      pthread_mutex_unlock(&s->lock);
      return backend_fail(&hb->base, FERRY_EINVAL, "%s: stream %p is being destroyed",
                  what, (void *)s);
    }
    n = atomic_load_explicit(&s->enqueued, memory_order_relaxed);
    if (n < STREAM_RING_CAP || reached(s, n - STREAM_RING_CAP + 1)) break;
    /* Full. Waiting releases the lock, so another producer may take the
     * freed slot first: look again after waking. */
    wait_reached_locked(s, n - STREAM_RING_CAP + 1);
  }
  s->ring[n % STREAM_RING_CAP] = *op;
  atomic_store_explicit(&s->enqueued, n + 1, memory_order_release);
  if (s->worker_sleeping) pthread_cond_signal(&s->work_cv);
  pthread_mutex_unlock(&s->lock);
  return FERRY_OK;
}

static int check_event(ferry_backend *b, bk_event *ev, const char *what) {
  if (!ev) return backend_fail(b, FERRY_EINVAL, "%s: event is NULL", what);
  if (ev->magic != EVENT_MAGIC)
    return backend_fail(b, FERRY_EINVAL, "%s: %p is not a live event", what,
                (void *)ev);
  return FERRY_OK;
}

/* The event's current target, read as one pair. */
static host_stream *event_target(bk_event *ev, uint64_t *target) {
  pthread_mutex_lock(&ev->lock);
  host_stream *s = ev->stream;
  *target = ev->target;
  pthread_mutex_unlock(&ev->lock);
  return s;
}

/* ---- the vtable --------------------------------------------------------- */

static int host_alloc(ferry_backend *b, size_t bytes, size_t alignment,
                      void **out) {
  host_backend *hb = as_host(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "host_alloc: out is NULL");
  *out = NULL;
  if (bytes == 0) return backend_fail(b, FERRY_EINVAL, "host_alloc: size is 0");
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (alignment == 0) alignment = page;
  if (alignment & (alignment - 1))
    return backend_fail(b, FERRY_EINVAL,
                "host_alloc: alignment %zu is not a power of two", alignment);
  if (alignment > MAX_HOST_ALIGNMENT)
    return backend_fail(b, FERRY_EINVAL,
                "host_alloc: alignment %zu is above the 2 MiB maximum",
                alignment);
  if (alignment < page) alignment = page;
  if (bytes > SIZE_MAX - 2 * alignment)
    return backend_fail(b, FERRY_ENOMEM, "host_alloc: size %zu is too large", bytes);
  size_t len = (bytes + page - 1) & ~(page - 1);
  /* Over-map by alignment - page, then trim both ends to the aligned span. */
  size_t map_len = len + alignment - page;
  char *base = mmap(NULL, map_len, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED)
    return backend_fail(b, FERRY_ENOMEM, "host_alloc: mmap of %zu bytes failed: %s",
                map_len, strerror(errno));
  uintptr_t start = ((uintptr_t)base + alignment - 1) & ~(uintptr_t)(alignment - 1);
  char *p = (char *)start;
  size_t head = (size_t)(p - base);
  size_t tail = map_len - head - len;
  if (head) munmap(base, head);
  if (tail) munmap(p + len, tail);
  /* "Pinned": lock the pages when RLIMIT_MEMLOCK allows; a failure only
   * means the pages may be swapped, which the host backend tolerates. */
  (void)mlock(p, len);
  atomic_fetch_add(&hb->pinned_allocs, 1);
  atomic_fetch_add(&hb->pinned_bytes, len);
  *out = p;
  return FERRY_OK;
}

static int host_free(ferry_backend *b, void *p, size_t bytes) {
  host_backend *hb = as_host(b);
  if (!p) return backend_fail(b, FERRY_EINVAL, "host_free: pointer is NULL");
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if ((uintptr_t)p & (page - 1))
    return backend_fail(b, FERRY_EINVAL,
                "host_free: %p is not page aligned, so not from host_alloc", p);
  if (bytes == 0) return backend_fail(b, FERRY_EINVAL, "host_free: size is 0");
  size_t len = (bytes + page - 1) & ~(page - 1);
  /* munmap also drops the mlock, if there was one. */
  if (munmap(p, len) != 0)
    return backend_fail(b, FERRY_EINVAL, "host_free: munmap(%p, %zu) failed: %s", p,
                len, strerror(errno));
  atomic_fetch_sub(&hb->pinned_bytes, len);
  return FERRY_OK;
}

static void stream_free(host_stream *s) {
  pthread_cond_destroy(&s->work_cv);
  pthread_cond_destroy(&s->done_cv);
  pthread_mutex_destroy(&s->lock);
  free(s->ring);
  free(s);
}

static int stream_create(ferry_backend *b, bk_stream *out) {
  host_backend *hb = as_host(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "stream_create: out is NULL");
  *out = NULL;
  host_stream *s = calloc(1, sizeof *s);
  if (!s) return backend_fail(b, FERRY_ENOMEM, "stream_create: out of memory");
  s->ring = calloc(STREAM_RING_CAP, sizeof *s->ring);
  if (!s->ring) {
    free(s);
    return backend_fail(b, FERRY_ENOMEM, "stream_create: out of memory");
  }
  s->backend = hb;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->work_cv, NULL);
  pthread_cond_init(&s->done_cv, NULL);
  atomic_init(&s->enqueued, 0);
  atomic_init(&s->claimed, 0);
  atomic_init(&s->executed, 0);
  atomic_init(&s->waiters, 0);
  atomic_init(&s->worker_cpu, -1);
  atomic_init(&s->destroyed, false);

  /* The worker must not take the embedder's signals: start it with all
   * signals blocked (it inherits the mask). */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&s->thread, NULL, stream_worker, s);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    stream_free(s);
    return backend_fail(b, FERRY_EBACKEND, "stream_create: pthread_create failed: %s",
                strerror(rc));
  }
  s->thread_started = true;
#if defined(__GLIBC__)
  pthread_setname_np(s->thread, "ferry-stream");
#endif
  pthread_mutex_lock(&hb->lock);
  s->next = hb->streams;
  hb->streams = s;
  pthread_mutex_unlock(&hb->lock);
  *out = s;
  return FERRY_OK;
}

/* Drain and join the worker; the object stays on the list for events. */
static void stream_stop(host_stream *s) {
  pthread_mutex_lock(&s->lock);
  s->stopping = true;
  pthread_cond_signal(&s->work_cv);
  pthread_mutex_unlock(&s->lock);
  if (s->thread_started) pthread_join(s->thread, NULL);
  s->thread_started = false;
  free(s->ring);
  s->ring = NULL;
  s->destroyed = true;
}

static int stream_destroy(ferry_backend *b, bk_stream h) {
  host_backend *hb = as_host(b);
  host_stream *s;
  int rc = engine_stream(hb, h, "stream_destroy", &s);
  if (rc) return rc;
  pthread_mutex_lock(&s->lock);
  bool already = s->stopping;
  pthread_mutex_unlock(&s->lock);
  if (already)
    return backend_fail(b, FERRY_EINVAL, "stream_destroy: stream %p is already being "
                "destroyed", h);
  stream_stop(s);
  return FERRY_OK;
}

static int copy_common(ferry_backend *b, op_kind kind, void *dst,
                       const void *src, size_t bytes, bk_stream h,
                       const char *what) {
  host_backend *hb = as_host(b);
  if (bytes > 0 && (!dst || !src))
    return backend_fail(b, FERRY_EINVAL, "%s: %s pointer is NULL", what,
                !dst ? "destination" : "source");
  host_stream *s;
  int rc = engine_stream(hb, h, what, &s);
  if (rc) return rc;
  stream_op op = {.kind = kind, .dst = dst, .src = src, .bytes = bytes};
  return enqueue(hb, s, &op, what);
}

static int copy_d2h(ferry_backend *b, void *dst_host, const void *src_dev,
                    size_t bytes, bk_stream s) {
  return copy_common(b, OP_COPY_D2H, dst_host, src_dev, bytes, s, "copy_d2h");
}

static int copy_h2d(ferry_backend *b, void *dst_dev, const void *src_host,
                    size_t bytes, bk_stream s) {
  return copy_common(b, OP_COPY_H2D, dst_dev, src_host, bytes, s, "copy_h2d");
}

static int event_create(ferry_backend *b, bk_event **out) {
  host_backend *hb = as_host(b);
  if (!out) return backend_fail(b, FERRY_EINVAL, "event_create: out is NULL");
  bk_event *ev = calloc(1, sizeof *ev);
  if (!ev) {
    *out = NULL;
    return backend_fail(b, FERRY_ENOMEM, "event_create: out of memory");
  }
  ev->magic = EVENT_MAGIC;
  pthread_mutex_init(&ev->lock, NULL);
  pthread_mutex_lock(&hb->lock);
  ev->next = hb->events;
  if (hb->events) hb->events->prev = ev;
  hb->events = ev;
  pthread_mutex_unlock(&hb->lock);
  *out = ev;
  return FERRY_OK;
}

static int event_destroy(ferry_backend *b, bk_event *ev) {
  host_backend *hb = as_host(b);
  int rc = check_event(b, ev, "event_destroy");
  if (rc) return rc;
  pthread_mutex_lock(&hb->lock);
  if (ev->prev) ev->prev->next = ev->next;
  else hb->events = ev->next;
  if (ev->next) ev->next->prev = ev->prev;
  pthread_mutex_unlock(&hb->lock);
  /* Waits already enqueued hold their own (stream, target) copy, so the
   * event can go while they are pending (as in CUDA). */
  ev->magic = 0;
  pthread_mutex_destroy(&ev->lock);
  free(ev);
  return FERRY_OK;
}

static int event_record(ferry_backend *b, bk_event *ev, bk_stream h) {
  host_backend *hb = as_host(b);
  int rc = check_event(b, ev, "event_record");
  if (rc) return rc;
  host_stream *s = find_stream(hb, h);
  if (s && s->destroyed)
    return backend_fail(b, FERRY_EINVAL, "event_record: stream %p was destroyed", h);
  /* Engine stream: the event covers every operation enqueued so far.
   * External stream (the calling thread): complete now. */
  uint64_t target = s ? atomic_load(&s->enqueued) : 0;
  pthread_mutex_lock(&ev->lock);
  ev->stream = s;
  ev->target = target;
  pthread_mutex_unlock(&ev->lock);
  return FERRY_OK;
}

static int event_query(ferry_backend *b, bk_event *ev) {
  int rc = check_event(b, ev, "event_query");
  if (rc) return rc;
  uint64_t target;
  host_stream *s = event_target(ev, &target);
  return !s || reached(s, target) ? 1 : 0;
}

static int event_synchronize(ferry_backend *b, bk_event *ev) {
  int rc = check_event(b, ev, "event_synchronize");
  if (rc) return rc;
  uint64_t target;
  host_stream *s = event_target(ev, &target);
  if (s) wait_helping(s, target);
  return FERRY_OK;
}

static int stream_synchronize(ferry_backend *b, bk_stream h) {
  host_stream *s;
  int rc = engine_stream(as_host(b), h, "stream_synchronize", &s);
  if (rc) return rc;
  wait_helping(s, atomic_load(&s->enqueued));
  return FERRY_OK;
}

static int stream_wait_event(ferry_backend *b, bk_stream h, bk_event *ev) {
  host_backend *hb = as_host(b);
  int rc = check_event(b, ev, "stream_wait_event");
  if (rc) return rc;
  host_stream *s = find_stream(hb, h);
  if (s && s->destroyed)
    return backend_fail(b, FERRY_EINVAL, "stream_wait_event: stream %p was destroyed",
                h);
  /* The wait is on the event's record at the time of this call. */
  uint64_t target;
  host_stream *on = event_target(ev, &target);
  if (!on || reached(on, target)) return FERRY_OK; /* nothing to wait for */
  if (!s) {
    /* External stream = the calling thread: its later work must come after
     * the event, so block here. */
    wait_helping(on, target);
    return FERRY_OK;
  }
  if (on == s) return FERRY_OK; /* a stream is already in order with itself */
  stream_op op = {.kind = OP_WAIT, .wait_stream = on, .wait_target = target};
  return enqueue(hb, s, &op, "stream_wait_event");
}

static int set_copy_listener(ferry_backend *b, bk_copy_listener fn, void *ud) {
  host_backend *hb = as_host(b);
  atomic_store_explicit(&hb->listener_ud, ud, memory_order_relaxed);
  atomic_store_explicit(&hb->listener, fn, memory_order_release);
  return FERRY_OK;
}

static void host_destroy(ferry_backend *b) {
  host_backend *hb = as_host(b);
  if (!hb) return;
  /* Stop every live stream first: a stream may be waiting on another. */
  for (host_stream *s = hb->streams; s; s = s->next)
    if (!s->destroyed) stream_stop(s);
  while (hb->streams) {
    host_stream *s = hb->streams;
    hb->streams = s->next;
    stream_free(s);
  }
  while (hb->events) {
    bk_event *ev = hb->events;
    hb->events = ev->next;
    ev->magic = 0;
    pthread_mutex_destroy(&ev->lock);
    free(ev);
  }
  pthread_mutex_destroy(&hb->link.lock);
  pthread_cond_destroy(&hb->link.changed_cv);
  pthread_mutex_destroy(&hb->lock);
  free(hb);
}

static const ferry_backend_ops host_ops = {
    .name = "host",
    .destroy = host_destroy,
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

static bool bad_rate(double v) { return !isfinite(v) || v < 0; }

int ferry_backend_host_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen) {
  if (!out)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: out is NULL");
  *out = NULL;
  if (!cfg)
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: config is NULL");
  const ferry_link *ln = &cfg->link;
  if (bad_rate(ln->d2h_bytes_per_s))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: link.d2h_bytes_per_s must be finite and "
                       ">= 0 (0 = unthrottled), got %g", ln->d2h_bytes_per_s);
  if (bad_rate(ln->h2d_bytes_per_s))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: link.h2d_bytes_per_s must be finite and "
                       ">= 0 (0 = unthrottled), got %g", ln->h2d_bytes_per_s);
  if (bad_rate(ln->latency_us))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: link.latency_us must be finite and >= 0, "
                       "got %g", ln->latency_us);
  bool throttled = ln->d2h_bytes_per_s > 0 || ln->h2d_bytes_per_s > 0 ||
                   ln->latency_us > 0;
  if (throttled && !(ln->duplex > 0 && ln->duplex <= 1))
    return ferry_errbuf(errbuf, errlen, FERRY_EINVAL,
                       "host backend: link.duplex must be in (0, 1], got %g",
                       ln->duplex);

  host_backend *hb = calloc(1, sizeof *hb);
  if (!hb)
    return ferry_errbuf(errbuf, errlen, FERRY_ENOMEM,
                       "host backend: out of memory");
  hb->base.ops = &host_ops;
  pthread_mutex_init(&hb->lock, NULL);
  link_state *l = &hb->link;
  l->throttled = throttled;
  l->bytes_per_s[DIR_D2H] = ln->d2h_bytes_per_s;
  l->bytes_per_s[DIR_H2D] = ln->h2d_bytes_per_s;
  l->latency_s = ln->latency_us * 1e-6;
  l->duplex = throttled ? ln->duplex : 1.0;
  pthread_mutex_init(&l->lock, NULL);
  if (cond_init_monotonic(&l->changed_cv) != 0) {
    pthread_mutex_destroy(&l->lock);
    pthread_mutex_destroy(&hb->lock);
    free(hb);
    return ferry_errbuf(errbuf, errlen, FERRY_EBACKEND,
                       "host backend: cannot create a CLOCK_MONOTONIC "
                       "condition variable");
  }
  l->last_update_s = now_s();
  atomic_init(&hb->pinned_allocs, 0);
  atomic_init(&hb->pinned_bytes, 0);
  atomic_init(&hb->listener, NULL);
  atomic_init(&hb->listener_ud, NULL);
  *out = &hb->base;
  return FERRY_OK;
}
