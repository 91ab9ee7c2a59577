/*
 * chrome_recorder.c — the Chrome trace (Perfetto) of a real run
 * (ferry_config.chrome_trace_path), in the schema `ferry sim --chrome-trace`
 * writes and through the same writer (util/chrome_trace.h):
 *
 *   - one process (the real pid), lanes: each thread that calls the engine
 *     ("compute thread TID (NAME)": pack, unpack, discard and step-end
 *     slices, with the host's waits nested in them), then "D2H copies" and
 *     "H2D copies" (the copy streams); with the one_copy_stream knob the
 *     reloads run on the D2H stream and are drawn there, its lane named
 *     "copies (one stream)";
 *   - copies named by their tensor's module path, with the start and end
 *     the backend observed (the host backend's worker: when it began and
 *     finished the copy; bk_copy_listener), args tensor (the pack number, the
 *     JSONL trace's id when both are recorded), bytes, layer, module,
 *     decision, reload mode and queued_us (issue to start);
 *   - a flow arrow from each offload to the reload of the same tensor;
 *   - counters: device bytes of saved tensors held, pinned host bytes in
 *     use, forward stash depth, sampled after each engine call;
 *   - instants at step begin, backward and step end (args: step).
 *
 * Timestamps are µs since the trace opened. Everything is written under
 * the recorder's own lock, a leaf: the engine calls in with its lock held
 * (an observer of the stash, engine_internal.h), the backend's copy threads
 * without it. With no trace open the engine pays one branch per call. A backend that cannot time copies
 * (no set_copy_listener) gets copy slices from issue to the moment the
 * engine first saw their event complete, marked "timing": "observed".
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/engine_internal.h"
#include "util/chrome_trace.h"
#include "util/log.h"
#include "util/u64map.h"
#include "util/util.h"

enum { LANE_D2H = 1, LANE_H2D = 2, LANE_FIRST_THREAD = 3 };
static const char *const LANE_NAME[2] = {"D2H copies", "H2D copies"};

/* A copy issued and not yet seen complete, or an offload done whose reload
 * may come (for the flow arrow). */
typedef struct ct_copy {
  uint64_t tensor;      /* pack number */
  uint64_t bytes;
  const char *module;   /* interned by the engine, NULL if none */
  int32_t layer;
  uint8_t prefetch;     /* reload: started ahead of its unpack */
  uint8_t one_stream;   /* reload: issued on the D2H stream (one_copy_stream) */
  double issued_us;     /* when the engine issued it */
  double start_us;      /* offload done: its slice's start */
  uint32_t next_free;
} ct_copy;

typedef struct ct_recorder {
  pthread_mutex_t lock;
  ct_writer w;
  int pid;
  double t0_us;
  uint64_t gen;          /* tells this recorder's lanes from an earlier one's */
  int next_lane;
  int timed;             /* the backend tells copy times */
  int one_stream_named;  /* the D2H lane is named for both directions */
  char error[160];       /* first write error, reported at close */
  ct_copy *copies;
  uint32_t n_copies, cap_copies, free_head; /* free list through next_free, 0 = none */
  u64map pending[2];     /* host address -> copy slot + 1, per direction */
  u64map offloaded;      /* host address -> slot + 1 of the last offload into it */
  u64map lanes;          /* OS thread id -> its lane */
  uint64_t dev, ino;     /* the file, in the registry of open traces */
  /* last counter values written, -1 = none yet */
  double last_device, last_pinned, last_depth;
} ct_recorder;

static _Atomic uint64_t recorder_gens = 1;
/* the calling thread's lane in the recorder it used last (a cache of
 * ct_recorder.lanes), and its OS id */
static _Thread_local struct {
  uint64_t gen;
  int lane;
  long tid;
} this_thread;

/* Files being written by this process's recorders (device, inode): a second
 * engine given the same file is refused rather than truncating it. */
static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static struct open_file {
  uint64_t dev, ino;
} *open_files;
static uint32_t n_open, cap_open;

static int open_find(uint64_t dev, uint64_t ino) {
  for (uint32_t i = 0; i < n_open; i++)
    if (open_files[i].dev == dev && open_files[i].ino == ino) return (int)i;
  return -1;
}

static double rel(const ct_recorder *r, double abs_us) { return abs_us - r->t0_us; }


/* ---- copy slots ---------------------------------------------------------------- */
static uint32_t slot_new(ct_recorder *r) {
  if (r->free_head) {
    uint32_t i = r->free_head - 1;
    r->free_head = r->copies[i].next_free;
    return i + 1;
  }
  if (util_grow((void **)&r->copies, &r->cap_copies, sizeof *r->copies, r->n_copies + 1, 64))
    return 0;
  return ++r->n_copies;
}

static void slot_free(ct_recorder *r, uint32_t s) {
  r->copies[s - 1].next_free = r->free_head;
  r->free_head = s;
}

/* Remove host's slot from m and return it (0: none). */
static uint32_t take(u64map *m, const void *host) {
  uint32_t s;
  if (!host || !u64map_find(m, (uintptr_t)host, &s)) return 0;
  u64map_remove(m, (uintptr_t)host);
  return s;
}

/* ---- lanes ---------------------------------------------------------------------- */
/* The calling thread's lane, declared on first sight. Recorder lock held. */
static int thread_lane(ct_recorder *r) {
  if (this_thread.gen == r->gen) return this_thread.lane;
  if (!this_thread.tid) this_thread.tid = (long)syscall(SYS_gettid);
  long tid = this_thread.tid;
  uint32_t lane;
  if (!u64map_find(&r->lanes, (uint64_t)tid, &lane)) {
    lane = (uint32_t)r->next_lane++;
    if (u64map_insert(&r->lanes, (uint64_t)tid, lane)) return (int)lane; /* not cached */
    char name[16] = "", label[64];
#if defined(__GLIBC__)
    pthread_getname_np(pthread_self(), name, sizeof name);
#endif
    if (name[0]) snprintf(label, sizeof label, "compute thread %ld (%s)", tid, name);
    else snprintf(label, sizeof label, "compute thread %ld", tid);
    ct_thread(&r->w, r->pid, (int)lane, label, (int)lane - LANE_FIRST_THREAD);
  }
  this_thread.gen = r->gen;
  this_thread.lane = (int)lane;
  return (int)lane;
}

static void note_error(ct_recorder *r) {
  if (r->w.error && !r->error[0]) ct_flush(&r->w, r->error, sizeof r->error);
}

/* ---- copies ---------------------------------------------------------------------- */
/* The lane of copy c of direction dir: its stream's. A reload on the D2H
 * stream renames that lane (once) for the two directions it carries. */
static int copy_lane(ct_recorder *r, int dir, const ct_copy *c) {
  if (!dir) return LANE_D2H;
  if (!c->one_stream) return LANE_H2D;
  if (!r->one_stream_named) {
    ct_thread(&r->w, r->pid, LANE_D2H, CT_LANE_ONE_STREAM, 100);
    r->one_stream_named = 1;
  }
  return LANE_D2H;
}

static void copy_slice(ct_recorder *r, int dir, const ct_copy *c, double start, double end,
                       int observed) {
  const char *name = c->module && *c->module ? c->module : dir ? "reload" : "offload";
  cJSON *e = ct_slice(name, dir ? "reload" : "offload", r->pid, copy_lane(r, dir, c),
                      rel(r, start), end - start);
  cJSON *a = ct_args(e);
  if (a) {
    ct_add_count(a, "tensor", (double)c->tensor);
    ct_add_count(a, "bytes", (double)c->bytes);
    if (c->layer >= 0) ct_add_count(a, "layer", c->layer);
    if (c->module && *c->module) ct_add_str(a, "module", c->module);
    ct_add_str(a, "decision", "offload");
    if (dir) ct_add_str(a, "reload", c->prefetch ? "prefetch" : "on use");
    ct_add_us(a, "queued_us", start > c->issued_us ? start - c->issued_us : 0);
    if (observed) ct_add_str(a, "timing", "observed");
  }
  ct_emit(&r->w, e);
}

/* A copy completed (start..end, absolute µs): its slice, and for a reload
 * the arrow from the offload that wrote the same host buffer. Lock held. */
static void copy_done(ct_recorder *r, int dir, double start, double end, const void *host,
                      int observed) {
  uint32_t s = take(&r->pending[dir], host);
  if (!s) {
    /* not a saved tensor's: a resident buffer's or a checkpoint's copy */
    cJSON *e = ct_slice("other copy", "other", r->pid, dir ? LANE_H2D : LANE_D2H, rel(r, start),
                        end - start);
    ct_emit(&r->w, e);
    return;
  }
  ct_copy *c = &r->copies[s - 1];
  copy_slice(r, dir, c, start, end, observed);
  if (!dir) {
    c->start_us = start;
    uint32_t old = take(&r->offloaded, host);
    if (old) slot_free(r, old);
    if (u64map_insert(&r->offloaded, (uintptr_t)host, s)) slot_free(r, s);
    return;
  }
  uint32_t o = take(&r->offloaded, host);
  if (o && r->copies[o - 1].tensor == c->tensor) {
    ct_flow(&r->w, 1, "offload -> reload", (double)c->tensor, r->pid, LANE_D2H,
            rel(r, r->copies[o - 1].start_us));
    ct_flow(&r->w, 0, "offload -> reload", (double)c->tensor, r->pid, copy_lane(r, 1, c),
            rel(r, start));
  }
  if (o) slot_free(r, o);
  slot_free(r, s);
}

static void on_copy(void *ud, int dir, double start_us, double end_us, uint64_t bytes,
                    const void *dev, const void *host) {
  (void)bytes;
  (void)dev;
  ct_recorder *r = ud;
  pthread_mutex_lock(&r->lock);
  copy_done(r, dir ? 1 : 0, start_us, end_us, host, 0);
  note_error(r);
  pthread_mutex_unlock(&r->lock);
}

static void copy_issue(ct_recorder *r, int dir, const stash_entry *s, const stash_cold *c,
                       const void *host, int prefetch, int one_stream) {
  pthread_mutex_lock(&r->lock);
  uint32_t old = take(&r->pending[dir], host), slot = old ? old : slot_new(r);
  if (slot) {
    r->copies[slot - 1] = (ct_copy){.tensor = c->trace_id,
                                    .bytes = s->bytes,
                                    .module = c->module_path,
                                    .layer = s->layer,
                                    .prefetch = (uint8_t)prefetch,
                                    .one_stream = (uint8_t)(dir && one_stream),
                                    .issued_us = util_now_us()};
    if (u64map_insert(&r->pending[dir], (uintptr_t)host, slot)) slot_free(r, slot);
  }
  pthread_mutex_unlock(&r->lock);
}

static void copy_unissue(ct_recorder *r, int dir, const void *host) {
  pthread_mutex_lock(&r->lock);
  uint32_t s = take(&r->pending[dir], host);
  if (s) slot_free(r, s);
  pthread_mutex_unlock(&r->lock);
}

static void copy_observed(ct_recorder *r, int dir, const void *host) {
  if (r->timed) return;
  pthread_mutex_lock(&r->lock);
  uint32_t s;
  if (host && u64map_find(&r->pending[dir], (uintptr_t)host, &s))
    copy_done(r, dir, r->copies[s - 1].issued_us, util_now_us(), host, 1);
  pthread_mutex_unlock(&r->lock);
}

/* ---- counters and calls ----------------------------------------------------------- */
static void counter(ct_recorder *r, const char *name, const char *key, double *last, double v,
                    double t) {
  if (v == *last) return;
  *last = v;
  ct_counter(&r->w, name, r->pid, t, key, v);
}

/* Samples after each call; only what changed is written. Both locks held. */
static void counters(ferry_engine *e, ct_recorder *r, double t) {
  ferry_arena_stats as;
  ferry_arena_get_stats(e->arena, &as);
  counter(r, "device bytes held (saved tensors)", "bytes", &r->last_device,
          (double)e->stats.device_bytes_held, t);
  counter(r, "pinned host bytes in use", "bytes", &r->last_pinned, (double)as.in_use, t);
  counter(r, "forward stash depth", "tensors", &r->last_depth, (double)e->ctx.stash_depth, t);
}

static void call_slice(ct_recorder *r, ferry_engine *e, const char *what, double t0,
                       const obs_tensor *t, const char *found) {
  pthread_mutex_lock(&r->lock);
  double now = util_now_us();
  cJSON *ev = ct_slice(what, "engine", r->pid, thread_lane(r), rel(r, t0), now - t0);
  cJSON *a = t || found ? ct_args(ev) : NULL;
  if (a && t) {
    if (t->tensor) ct_add_count(a, "tensor", (double)t->tensor);
    ct_add_count(a, "bytes", (double)t->bytes);
    if (t->layer >= 0) ct_add_count(a, "layer", t->layer);
    if (t->module && *t->module) ct_add_str(a, "module", t->module);
    ct_add_str(a, "decision", t->decision == FERRY_OFFLOAD ? "offload" : "keep");
    if (t->alias_of) ct_add_count(a, "alias_of", (double)t->alias_of);
  }
  if (a && found) ct_add_str(a, "found", found);
  ct_emit(&r->w, ev);
  counters(e, r, rel(r, now));
  note_error(r);
  pthread_mutex_unlock(&r->lock);
}

static void wait_slice(ct_recorder *r, const char *what, double t0) {
  pthread_mutex_lock(&r->lock);
  double now = util_now_us();
  ct_emit(&r->w, ct_slice(what, "wait", r->pid, thread_lane(r), rel(r, t0), now - t0));
  pthread_mutex_unlock(&r->lock);
}

static void mark(ct_recorder *r, ferry_engine *e, const char *what) {
  pthread_mutex_lock(&r->lock);
  double now = rel(r, util_now_us());
  cJSON *ev = ct_instant(what, r->pid, thread_lane(r), now, 'p');
  ct_add_count(ct_args(ev), "step", (double)e->step);
  ct_emit(&r->w, ev);
  counters(e, r, now);
  /* the file is whole at each step's end */
  if (!strcmp(what, "step end")) ct_flush(&r->w, NULL, 0);
  note_error(r);
  pthread_mutex_unlock(&r->lock);
}

/* ---- lifecycle ---------------------------------------------------------------------- */
/* path with each %p replaced by the process id (one file per rank), %% by %. */
static int expand_path(const char *path, char *out, size_t outlen) {
  size_t n = 0;
  for (const char *p = path; *p; p++) {
    char pid[24];
    const char *piece = pid;
    if (p[0] == '%' && p[1] == 'p') snprintf(pid, sizeof pid, "%d", (int)getpid()), p++;
    else if (p[0] == '%' && p[1] == '%') piece = "%", p++;
    else pid[0] = *p, pid[1] = 0;
    size_t k = strlen(piece);
    if (n + k >= outlen) return -1;
    memcpy(out + n, piece, k);
    n += k;
  }
  out[n] = 0;
  return 0;
}

static void ctrace_close(void *self, ferry_engine *e);
static void ctrace_on(void *self, ferry_engine *e, const obs_event *ev);

int ctrace_open(ferry_engine *e, const char *path_spec) {
  char path[4096];
  if (expand_path(path_spec, path, sizeof path))
    return engine_fail(e, FERRY_EINVAL, "chrome trace path is too long: %.100s...", path_spec);
  struct stat st;
  pthread_mutex_lock(&open_lock);
  int taken = stat(path, &st) == 0 && open_find((uint64_t)st.st_dev, (uint64_t)st.st_ino) >= 0;
  pthread_mutex_unlock(&open_lock);
  if (taken)
    return engine_fail(e, FERRY_EINVAL,
                       "chrome trace %s is being written by another engine of this process: "
                       "give each engine its own file",
                       path);
  ct_recorder *r = calloc(1, sizeof *r);
  if (!r) return engine_fail(e, FERRY_ENOMEM, "out of memory opening the Chrome trace");
  char err[4200];
  if (ct_open(&r->w, path, err, sizeof err)) {
    free(r);
    return engine_fail(e, FERRY_EIO, "chrome trace: %s", err);
  }
  int bad = u64map_grow(&r->pending[0]) || u64map_grow(&r->pending[1]) ||
            u64map_grow(&r->offloaded) || u64map_grow(&r->lanes) || fstat(r->w.fd, &st);
  if (!bad) {
    pthread_mutex_lock(&open_lock);
    bad = util_grow((void **)&open_files, &cap_open, sizeof *open_files, n_open + 1, 4);
    if (!bad) open_files[n_open++] = (struct open_file){(uint64_t)st.st_dev, (uint64_t)st.st_ino};
    pthread_mutex_unlock(&open_lock);
    r->dev = (uint64_t)st.st_dev;
    r->ino = (uint64_t)st.st_ino;
  }
  if (bad) {
    ct_close(&r->w, err, sizeof err);
    u64map_free(&r->pending[0]);
    u64map_free(&r->pending[1]);
    u64map_free(&r->offloaded);
    u64map_free(&r->lanes);
    free(r);
    return engine_fail(e, FERRY_ENOMEM, "out of memory opening the Chrome trace");
  }
  pthread_mutex_init(&r->lock, NULL);
  r->pid = (int)getpid();
  r->t0_us = util_now_us();
  r->gen = atomic_fetch_add(&recorder_gens, 1);
  r->next_lane = LANE_FIRST_THREAD;
  r->last_device = r->last_pinned = r->last_depth = -1;
  char name[160];
  snprintf(name, sizeof name, "ferry: %s (%s backend)",
           e->policy ? ferry_policy_name(e->policy) : e->decide ? "decide callback" : "no policy",
           e->bk->ops->name);
  ct_process(&r->w, r->pid, name, 0);
  /* the D2H lane carries the reloads too under the one_copy_stream knob (a
   * policy swapped in later with it renames the lane at its first reload) */
  r->one_stream_named = e->one_copy_stream != 0;
  for (int d = 0; d < 2; d++)
    ct_thread(&r->w, r->pid, LANE_D2H + d,
              d == 0 && r->one_stream_named ? CT_LANE_ONE_STREAM : LANE_NAME[d], 100 + d);
  if (e->bk->ops->set_copy_listener &&
      e->bk->ops->set_copy_listener(e->bk, on_copy, r) == FERRY_OK)
    r->timed = 1;
  ct_flush(&r->w, r->error, sizeof r->error);
  if (engine_observe(e, ctrace_on, ctrace_close, r, OBS_NUMBERS | OBS_CALLS)) {
    ctrace_close(r, e);
    return engine_fail(e, FERRY_ENOMEM, "out of memory opening the Chrome trace");
  }
  return FERRY_OK;
}

/* After the copy streams are gone: no listener call can come. */
static void ctrace_close(void *self, ferry_engine *e) {
  (void)e;
  ct_recorder *r = self;
  char err[256] = "";
  if (ct_close(&r->w, err, sizeof err) == 0 && r->error[0]) snprintf(err, sizeof err, "%s", r->error);
  if (err[0]) util_log(FERRY_LOG_ERROR, "chrome trace: %s", err);
  pthread_mutex_lock(&open_lock);
  int i = open_find(r->dev, r->ino);
  if (i >= 0) open_files[i] = open_files[--n_open];
  pthread_mutex_unlock(&open_lock);
  u64map_free(&r->pending[0]);
  u64map_free(&r->pending[1]);
  u64map_free(&r->offloaded);
  u64map_free(&r->lanes);
  free(r->copies);
  pthread_mutex_destroy(&r->lock);
  free(r);
}

/* ---- what the stash tells (engine_internal.h), its lock held ---------- */
static void ctrace_on(void *self, ferry_engine *e, const obs_event *ev) {
  ct_recorder *r = self;
  switch (ev->kind) {
  case OBS_STEP_BEGIN: mark(r, e, "step begin"); break;
  case OBS_PHASE:
    if (e->phase == FERRY_PHASE_BACKWARD) mark(r, e, "backward");
    break;
  case OBS_STEP_END:
    call_slice(r, e, "step end", ev->t0, NULL, NULL);
    mark(r, e, "step end");
    break;
  case OBS_PACK_DONE: {
    /* the handle is not back to its caller yet: the entry is still there */
    const stash_entry *s = &e->entries[ev->idx];
    const stash_entry *p = s->state == ENTRY_ALIAS ? &e->entries[s->primary] : s;
    obs_tensor t = obs_tensor_of(e, p, cold_of(e, s)->trace_id);
    if (p != s) t.alias_of = cold_of(e, p)->trace_id;
    call_slice(r, e, "pack", ev->t0, &t, NULL);
    break;
  }
  case OBS_UNPACK: call_slice(r, e, "unpack", ev->t0, ev->tensor, ev->found); break;
  case OBS_DISCARD:
    if (ev->tensor) call_slice(r, e, "discard", ev->t0, ev->tensor, NULL);
    break;
  case OBS_WAIT: wait_slice(r, ev->what, ev->t0); break;
  case OBS_COPY_ISSUE:
    /* the engine's lock is held: the knob is the one this copy was issued under */
    copy_issue(r, ev->dir, ev->entry, cold_of(e, ev->entry), ev->host, ev->prefetch,
               e->one_copy_stream != 0);
    break;
  case OBS_COPY_UNISSUE: copy_unissue(r, ev->dir, ev->host); break;
  case OBS_COPY_OBSERVED: copy_observed(r, ev->dir, ev->host); break;
  case OBS_PACK: break;
  }
}
