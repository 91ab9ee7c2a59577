/*
 * replayer.c — sim_replay (ferry_tools.h): drives a read trace through an
 * engine on the sim backend (virtual clock) or the host backend (wall
 * clock), calling ferry_pack/unpack/step/backward exactly as a trainer
 * would, for N steps, and sums up each step into a sim_result.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/errbuf.h"
#include "ferry_tools.h"
#include "core/core.h"
#include "util/u64map.h"
#include "util/util.h"


/* A device buffer of the replayed trainer; the owner token handed to ferry.
 * On the sim backend it has no memory (its address is the device pointer);
 * on the host backend it has real bytes, checked on every unpack. */
typedef struct sim_buf {
  uint64_t bytes;
  uint32_t refs;
  uint8_t counted; /* adds to device memory (not a parameter/buffer's own) */
  uint8_t *mem;
  struct sim_buf *next_free;
} sim_buf;

#define BUF_SLAB 1024

/* Optimizer-state offload (sim_config.optimizer_fraction; docs/simulator.md,
 * "Optimizer-state offload"): what ferry.torch.offload_optimizer does per
 * step, through the engine's resident buffers, on the engine's streams:
 *  - backward: the share's gradients go D2H a layer's worth at a time as
 *    backward passes that share of its compute (post-accumulate hooks);
 *  - step(): the host waits for them, then steps the share for
 *    params / cpu_adam while the device steps the rest (the compute after
 *    backward_end, scaled by 1 - fraction), and step() returns when both
 *    are done (serial: the host step first, then the device's);
 *  - the updated parameters go H2D after it, a layer's worth at a time;
 *    the next forward waits for each before the compute that needs it
 *    (serial: all are waited for before the step ends).
 * The share's optimizer states leave the device's resident memory. */
typedef struct opt_model {
  double fraction;
  uint32_t k;                    /* chunks: about a layer's parameters each */
  ferry_resident *state;         /* the share's optimizer states (host only) */
  ferry_resident **grad, **param; /* per chunk; NULL for a 0-byte chunk */
  char *dev;                     /* fake device addresses: grad j at dev + j,
                                    param j at dev + k + j (never touched) */
  bk_stream lane;                /* orders the H2D copies after `now` */
  bk_event *now_ev;
  double cpu_us;                 /* the host step */
  double *fwd_us, *bwd_us;       /* per trace step: forward, backward compute */
  uint8_t *pending;              /* per chunk: its H2D not waited for yet */
  uint32_t grads_issued;         /* this step */
  int synced;                    /* step() reached this step */
  double cpu_end;                /* when the host step ends (overlapped) */
  double stall, host_wait;       /* this step: exposed; of it, host waits */
} opt_model;

/* Weight offload (sim_config.weight_count; docs/simulator.md, "Weight
 * offload"): what ferry.torch.offload_weights does, through the engine's
 * resident buffers on its D2H and H2D streams, for the blocks first ..
 * first + count - 1, each `bytes` of weights:
 *  - after a block's forward (its last event of forward) its weights go D2H
 *    after the compute so far; the device bytes are freed when the copy
 *    completes;
 *  - before its backward (its first event of backward: before that event's
 *    compute when it is a compute event of the block, else right before the
 *    event) they come back H2D and the compute waits for them; double
 *    buffered, the previous chosen block's reload is issued then too, behind
 *    it on the H2D stream;
 *  - after backward they stay until the block's next forward ends; a block
 *    not on the device at its forward (step 1: offload_weights starts with
 *    every chosen block on the host) is reloaded before it, the next chosen
 *    block's reload issued behind it when double-buffered.
 * The chosen blocks' weights leave resident memory and count with the live
 * bytes while on the device, from a reload's issue to an offload's end. */
typedef struct w_layer {
  ferry_resident *buf;   /* the block's host copy */
  bk_event *d2h, *h2d;   /* recorded after its last offload, its last reload */
  uint8_t on;            /* its device copy is allocated (in live_bytes) */
  uint8_t loading;       /* a reload the compute has not waited for yet */
  uint8_t leaving;       /* an offload whose end frees the old device copy */
} w_layer;

typedef struct weight_model {
  int32_t first, count;  /* the chosen blocks */
  uint64_t bytes;        /* each one's weights */
  int dbl;               /* double-buffered */
  w_layer *l;            /* count entries */
  char *dev;             /* fake device addresses: block first + i at dev + i */
  bk_stream lane;        /* orders the H2D copies after `now` */
  bk_event *now_ev;
  uint32_t n_leaving;
  /* this trace step's events, per chosen block (-1: none): the first and
   * last of forward, the first of backward and whether that one is a
   * tensor event (its compute is the previous op's: the hook comes after it) */
  int64_t *fwd_first, *fwd_last, *bwd_first;
  uint8_t *bwd_after_gap;
  uint32_t table_step;   /* the trace step the tables are for, + 1 (0: none) */
  double stall, d2h, h2d; /* this step: exposed waits, bytes each way */
} weight_model;

typedef struct replay {
  const sim_trace *t;
  const sim_config *c;
  ferry_engine *e;
  ferry_backend *sim; /* NULL on the host backend */
  double host_t0_us, host_scale;
  double host_excluded_us; /* wall time spent filling and checking buffers */
  ferry_handle *handles;
  sim_buf **bufs;       /* per tensor, while packed */
  sim_buf **slabs;
  uint32_t n_slabs;
  sim_buf *free_bufs;
  uint64_t live_bytes, peak_live;
  uint64_t peak_steady, peak_first; /* over the steady steps; over step 1 */
  int steady, first;    /* replaying a steady step; step 1 */
  uint32_t warmup;
  double pinned_us;     /* pinning cost so far (sim) */
  int recording;
  sim_result *res;
  int alloc_failed;
  int bad_bytes;        /* host backend: an unpack gave different bytes */
  int host;             /* on the host backend */
  int last;             /* replaying the last step: it fills the layer rows */
  int32_t cur_layer;    /* the layer of the latest pack or unpack */
  double host_stall, host_wait; /* host backend: wall time inside ferry */
  char *err;            /* the caller's error buffer */
  size_t errlen;
  int err_written;      /* err holds the message already (not an engine error) */
  /* recording: which tensor a copy moves, and which offload a reload undoes */
  u64map dev_tensor;    /* a packed buffer's address -> tensor index + 1 */
  u64map host_offload;  /* an offload's host address -> its interval index + 1 */
  uint8_t *went;        /* per tensor: offloaded when packed; once unpacked, reloaded */
  uint64_t resident;    /* the trace's resident bytes less what the optimizer offload frees */
  double gap_scale;     /* compute multiplier (the device's share of the optimizer step) */
  opt_model *opt;       /* optimizer-state offload, NULL when off */
  weight_model *w;      /* weight offload, NULL when off */
} replay;

/* The least exposed stall any schedule of a step's copies could have with
 * the link at full speed, the engine's way: reloads start when backward
 * begins (reloading earlier would raise the peak the offloads lowered).
 *  - forward: at each pack the saved bytes on device, kept (K) plus
 *    offloaded (D) less those copied, are at most the step's peak P, so
 *    D + K - P bytes were copied within the compute since the first offload;
 *  - the same holds at backward's packs and transient allocations (the loss's
 *    gradients, where a step with offloading peaks): offloads still in flight
 *    when backward begins are on the device there, reloads not counted;
 *  - backward: the reloads a prefix of backward's unpacks needs (stash hits
 *    need none) arrive within the backward compute before the last of them.
 * A real schedule adds queueing, latency per copy, the duplex slowdown and
 * the stash bounds to it. */
typedef struct link_floor {
  double h2d_per_us, d2h_per_us;
  int in_backward;
  double fwd_compute, bwd_compute; /* µs: since the first offload; since backward began */
  double offloaded, kept;          /* forward bytes: offloaded; kept and still held */
  double fwd_bound;                /* max over forward packs of (D + K) / link - compute */
  double h2d_bytes, h2d_bound;     /* reloaded so far; max over unpacks */
  double late_bound;               /* max over backward's packs and allocations of
                                    * (D + K) / link - compute since the first offload */
  /* the same instants x with the reloads after them (floor_us): the max over
   * x of bound + backward compute by x + reloads by x / the faster link
   * (-inf before the first x), and the max over unpacks u of that + reloads
   * by u / the faster link - backward compute by u */
  double late_anchor, late_reload;
} link_floor;

static void floor_compute(link_floor *f, double us) {
  if (f->in_backward) f->bwd_compute += us;
  else if (f->offloaded > 0) f->fwd_compute += us;
}

/* After a pack, unpack or discard of a tensor of bytes: counted (it takes
 * device memory of its own), out (offloaded when it was packed), reloaded
 * (an unpack that copied it back; a stash hit does not). */
static void floor_tensor(link_floor *f, int type, int out, int reloaded, int counted,
                         double bytes) {
  if (type == TEV_PACK && out) {
    if (!f->in_backward) f->offloaded += bytes; /* (backward's own offloads: not counted) */
  } else if (counted && !out) {
    f->kept += type == TEV_PACK ? bytes : -bytes;
  }
  double fast = f->d2h_per_us > f->h2d_per_us ? f->d2h_per_us : f->h2d_per_us;
  if (type == TEV_PACK && f->offloaded > 0 && f->d2h_per_us > 0) {
    double b = (f->offloaded + f->kept) / f->d2h_per_us - f->fwd_compute - f->bwd_compute;
    double *bound = f->in_backward ? &f->late_bound : &f->fwd_bound;
    if (b > *bound) *bound = b;
    double a = b + f->bwd_compute + f->h2d_bytes / fast;
    if (f->in_backward && a > f->late_anchor) f->late_anchor = a;
  }
  if (f->in_backward && type == TEV_UNPACK && reloaded && f->h2d_per_us > 0) {
    f->h2d_bytes += bytes;
    double b = f->h2d_bytes / f->h2d_per_us - f->bwd_compute;
    if (b > f->h2d_bound) f->h2d_bound = b;
    double c = f->late_anchor + f->h2d_bytes / fast - f->bwd_compute;
    if (c > f->late_reload) f->late_reload = c;
  }
}

/* Forward's stall and backward's reload stall happen at different times and
 * add up. At a backward instant x the offloads not yet copied plus the
 * reloads already made (R) fit under the peak, so the stall before x is at
 * least late(x) + R / d2h link; the reloads after x up to an unpack u, what
 * u needs less R, take the stall after x beyond the compute between them.
 * Added, R drops out with both links at the faster one's speed: late(x) +
 * (reloads between x and u) / faster link - compute between them bounds
 * the total too. */
static double floor_us(const link_floor *f, double peak) {
  if (f->d2h_per_us <= 0) return f->h2d_bound > 0 ? f->h2d_bound : 0;
  double fwd = f->fwd_bound - peak / f->d2h_per_us;
  double late = f->late_bound - peak / f->d2h_per_us;
  double late_r = f->late_reload - peak / f->d2h_per_us;
  double sum = (fwd > 0 ? fwd : 0) + (f->h2d_bound > 0 ? f->h2d_bound : 0);
  if (late_r > late) late = late_r;
  return sum > late ? sum : late;
}

/* Per-step sums over the steady steps (all but the first, unless one). */
typedef struct step_sums {
  double step, stall, wait, d2h, h2d, packed, off, kept, pf, hits, pinned, floor;
  double opt_d2h, opt_h2d, opt_stall;
  double w_d2h, w_h2d, w_stall;
  uint32_t n_steady;
} step_sums;

/* The replay's clock: virtual on sim, scaled wall time (less the
 * trainer's own work) on host. */
static double replay_now(replay *r) {
  if (r->sim) return sim_backend_now(r->sim);
  return (util_now_us() - r->host_t0_us - r->host_excluded_us) / r->host_scale;
}

/* us microseconds of the trainer's compute. */
static void replay_compute(replay *r, double us) {
  if (!(us > 0)) return;
  if (r->sim) {
    sim_backend_advance(r->sim, us);
    return;
  }
  /* The host backend's compute stream is this thread. Sleep through most of
   * it, leaving the cores to the copy workers (a GPU computes without the
   * CPU), and spin the last 100 us to end on time. */
  double end = util_now_us() + us * r->host_scale;
  if (end - util_now_us() > 300) {
    double until = end - 100;
    struct timespec ts = {(time_t)(until / 1e6), (long)(fmod(until, 1e6) * 1e3)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
  }
  while (util_now_us() < end) {
  }
}

/* Appends an interval (compute or copy) to the timeline. */
static int timeline_push(sim_timeline *tl, sim_interval iv) {
  if (tl->n_iv == tl->cap_iv) {
    size_t n = tl->cap_iv ? tl->cap_iv * 2 : 1024;
    sim_interval *p = realloc(tl->iv, n * sizeof *p);
    if (!p) return -1;
    tl->iv = p;
    tl->cap_iv = n;
  }
  tl->iv[tl->n_iv++] = iv;
  return 0;
}

/* Samples device memory onto the timeline when it changed. */
static void mem_sample(replay *r) {
  if (!r->recording) return;
  sim_timeline *tl = &r->res->tl;
  double t = replay_now(r);
  uint64_t b = r->resident + r->live_bytes;
  if (tl->n_mem && tl->mem[tl->n_mem - 1].bytes == b) return;
  if (tl->n_mem == tl->cap_mem) {
    size_t n = tl->cap_mem ? tl->cap_mem * 2 : 1024;
    sim_mem_sample *p = realloc(tl->mem, n * sizeof *p);
    if (!p) return;
    tl->mem = p;
    tl->cap_mem = n;
  }
  tl->mem[tl->n_mem++] = (sim_mem_sample){t, b};
}

/* key -> val, replacing what key held (a buffer address reused); 0 or -1. */
static int map_set(u64map *m, const void *key, uint32_t val) {
  u64map_remove(m, (uint64_t)(uintptr_t)key);
  return u64map_insert(m, (uint64_t)(uintptr_t)key, val);
}

/* The sim backend's copy listener: each copy onto the timeline, with the
 * tensor it moves; a reload is paired with its offload by host address. */
static void on_copy(void *ud, int dir, double t0, double t1, uint64_t bytes, const void *dev,
                    const void *host) {
  replay *r = ud;
  if (!r->recording) return;
  sim_timeline *tl = &r->res->tl;
  sim_interval iv = {t0, t1, bytes, 1 + dir, -1, 0, 0, NULL, -1, -1};
  uint32_t v = 0;
  int weights = r->w && (const char *)dev >= r->w->dev && (const char *)dev < r->w->dev + r->w->count;
  if (dir == 0) {
    if (u64map_find(&r->dev_tensor, (uint64_t)(uintptr_t)dev, &v)) iv.tensor = v;
    /* a flow arrow pairs a tensor's offload with its reload; a block's
     * weights have no trace tensor and get none */
    if (!weights) map_set(&r->host_offload, host, (uint32_t)tl->n_iv + 1);
  } else if (!weights && u64map_find(&r->host_offload, (uint64_t)(uintptr_t)host, &v)) {
    u64map_remove(&r->host_offload, (uint64_t)(uintptr_t)host);
    iv.tensor = tl->iv[v - 1].tensor;
    iv.flow = tl->iv[v - 1].flow = v; /* only offloads reloaded get an arrow */
  }
  if (iv.tensor) { /* the trace's own desc: its strings outlive the engine */
    const ferry_tensor_desc *d = &r->t->tensors[iv.tensor - 1].desc;
    iv.layer = d->layer;
    /* named by its module path; at the model's root (""), such as Hugging
     * Face's loss, by the root module's class */
    iv.module_path = d->module_path && *d->module_path ? d->module_path : d->module_class;
  } else if (r->opt && (const char *)dev >= r->opt->dev &&
             (const char *)dev < r->opt->dev + 2 * r->opt->k) {
    iv.module_path = (const char *)dev < r->opt->dev + r->opt->k ? "optimizer: gradients"
                                                                : "optimizer: parameters";
  } else if (weights) {
    iv.module_path = "weights";
    iv.layer = r->w->first + (int32_t)((const char *)dev - r->w->dev);
  }
  timeline_push(tl, iv);
}

/* Device bytes in use besides resident memory (saved tensors and transient
 * allocations) grow by bytes: the peaks follow. */
static void live_add(replay *r, uint64_t bytes) {
  r->live_bytes += bytes;
  if (r->live_bytes > r->peak_live) r->peak_live = r->live_bytes;
  if (r->steady && r->live_bytes > r->peak_steady) r->peak_steady = r->live_bytes;
  if (r->first && r->live_bytes > r->peak_first) r->peak_first = r->live_bytes;
  mem_sample(r);
}

static void live_sub(replay *r, uint64_t bytes) {
  r->live_bytes -= bytes;
  mem_sample(r);
}

/* A trainer buffer (from a slab; real bytes on host), counted or not. */
static sim_buf *buf_new(replay *r, uint64_t bytes, int counted) {
  if (!r->free_bufs) {
    sim_buf *slab = calloc(BUF_SLAB, sizeof *slab);
    sim_buf **slabs = slab ? realloc(r->slabs, (r->n_slabs + 1) * sizeof *slabs) : NULL;
    if (!slabs) {
      free(slab);
      return NULL;
    }
    r->slabs = slabs;
    r->slabs[r->n_slabs++] = slab;
    for (int i = BUF_SLAB - 1; i >= 0; i--) {
      slab[i].next_free = r->free_bufs;
      r->free_bufs = &slab[i];
    }
  }
  sim_buf *b = r->free_bufs;
  if (!r->sim) {
    b->mem = malloc(bytes);
    if (!b->mem) return NULL;
  }
  r->free_bufs = b->next_free;
  b->bytes = bytes;
  b->refs = 1;
  b->counted = (uint8_t)counted;
  if (counted) live_add(r, bytes);
  return b;
}

/* Drops a reference; the last returns the buffer to the free list. */
static void buf_unref(replay *r, sim_buf *b) {
  if (--b->refs) return;
  if (b->counted) live_sub(r, b->bytes);
  free(b->mem);
  b->mem = NULL;
  b->next_free = r->free_bufs;
  r->free_bufs = b;
}

/* The device pointer ferry sees for a buffer. */
static void *buf_ptr(sim_buf *b) { return b->mem ? (void *)b->mem : (void *)b; }

/* ferry_config callbacks: allocate, release and retain trainer buffers. */
static int cb_alloc(void *ud, uint64_t bytes, void *stream, void **dev, void **owner) {
  replay *r = ud;
  sim_buf *b = buf_new(r, bytes, 1);
  if (!b) {
    r->alloc_failed = 1;
    return -1;
  }
  *dev = buf_ptr(b);
  *owner = b;
  return 0;
}

static void cb_release(void *ud, void *owner) { buf_unref(ud, owner); }
static void cb_retain(void *ud, void *owner) {
  (void)ud;
  ((sim_buf *)owner)->refs++;
}

_Static_assert(offsetof(trace_tensor, desc) == 0, "cb_recorded: a desc's address is its tensor's");

/* ferry_config.decide with recorded decisions: the trace's own. */
static int cb_recorded(void *ud, const ferry_tensor_desc *d, const ferry_context *ctx,
                       ferry_decision *out) {
  replay *r = ud;
  (void)ctx;
  size_t i = (size_t)((const trace_tensor *)(const void *)d - r->t->tensors);
  out->action = i < r->t->n_tensors ? r->t->tensors[i].decision : FERRY_KEEP;
  out->reload = FERRY_RELOAD_ON_USE;
  out->prefetch_distance = -1;
  out->cacheable = 0;
  return 0;
}

/* Tensors the engine offloaded so far. */
static uint64_t engine_offloaded(ferry_engine *e) {
  ferry_stats st;
  return ferry_get_stats(e, &st, sizeof st) ? 0 : st.tensors_offloaded;
}

/* The sim backend's stall so far (and host wait in *host_wait); 0 on host. */
static double sim_stall(replay *r, double *host_wait) {
  if (!r->sim) {
    *host_wait = 0;
    return 0;
  }
  sim_backend_stats st;
  sim_backend_get_stats(r->sim, &st);
  *host_wait = st.host_wait_us;
  return st.stall_us;
}

/* The file name of a path. */
static const char *base_name(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

void sim_result_free(sim_result *r) {
  if (!r) return;
  free(r->layers);
  free(r->tl.iv);
  free(r->tl.mem);
  free(r->tl.waits);
  free(r->tl.host);
  free(r->decisions);
  memset(r, 0, sizeof *r);
}

/* Host backend: the bytes a tensor's buffer holds. */
static uint8_t tensor_pattern(uint32_t ti) { return (uint8_t)(ti * 131u + 7u); }

/* Fill (on pack) or check (on unpack) a real buffer's bytes. */
static int buf_bytes_ok(const sim_buf *b, uint8_t pattern, int fill) {
  if (!b->mem) return 1;
  if (fill) {
    memset(b->mem, pattern, b->bytes);
    return 1;
  }
  for (uint64_t i = 0; i < b->bytes; i++)
    if (b->mem[i] != pattern) return 0;
  return 1;
}

/* The result's label: the config's, or one naming the policy. */
static void set_label(sim_result *out, const sim_config *c) {
  if (c->label) snprintf(out->label, sizeof out->label, "%s", c->label);
  else if (c->replay_decisions) snprintf(out->label, sizeof out->label, "recorded decisions");
  else if (c->policy_path) {
    snprintf(out->label, sizeof out->label, "%s", base_name(c->policy_path));
    char *dot = strrchr(out->label, '.');
    if (dot && !strcmp(dot, ".lua")) *dot = 0;
  } else if (c->policy_source) snprintf(out->label, sizeof out->label, "policy");
  else snprintf(out->label, sizeof out->label, "no offload");
}

/* Creates the engine the trainer talks to, with the replay's callbacks. */
/* ferry_config.host_ram: the simulated host's RAM, never the machine's
 * running the simulation; what is available is that less the pinned
 * memory the sim backend reserved. */
static int cb_host_ram(void *ud, uint64_t *total, uint64_t *available) {
  replay *r = ud;
  uint64_t t = r->c->host_ram_bytes ? r->c->host_ram_bytes : SIM_DEFAULT_HOST_RAM, used = 0;
  if (r->sim) {
    sim_backend_stats st;
    sim_backend_get_stats(r->sim, &st);
    used = st.host_reserved_bytes;
  }
  *total = t;
  *available = used < t ? t - used : 0;
  return 0;
}

static int replay_open_engine(replay *r) {
  const sim_config *c = r->c;
  ferry_config cfg = FERRY_CONFIG_INIT;
  cfg.backend = r->host ? FERRY_BACKEND_HOST : FERRY_BACKEND_SIM;
  cfg.arena = r->host ? FERRY_ARENA_AUTO : FERRY_ARENA_POOL;
  cfg.link = c->link;
  if (!(cfg.link.duplex > 0)) cfg.link.duplex = 1.0;
  cfg.host_cap_bytes = c->host_cap_bytes;
  cfg.device_alloc = cb_alloc;
  cfg.release = cb_release;
  cfg.retain = cb_retain;
  cfg.callback_ud = r;
  cfg.host_ram = cb_host_ram;
  cfg.release_when_copied = c->release_when_copied;
  cfg.prefetch_at_backward_begin = c->prefetch_at_backward_begin;
  cfg.host_ram_ud = r;
  r->res->host_ram_bytes = c->host_ram_bytes ? c->host_ram_bytes : SIM_DEFAULT_HOST_RAM;
  if (c->replay_decisions) {
    cfg.decide = cb_recorded;
    cfg.decide_ud = r;
  } else {
    cfg.policy_path = c->policy_path;
    cfg.policy_source = c->policy_path ? NULL : c->policy_source;
  }
  char msg[512] = "";
  int rc = ferry_engine_create(&cfg, &r->e, msg, sizeof msg);
  if (rc) return ferry_errbuf(r->err, r->errlen, rc, "%s: %s", r->res->label, msg);
  r->sim = r->host || !sim_backend_is(engine_backend(r->e)) ? NULL : engine_backend(r->e);
  if (!r->sim) return 0;
  sim_backend_set_listener(r->sim, on_copy, r);
  if ((rc = sim_backend_set_pinned_cost(r->sim, c->pinned_alloc_us, c->pinned_touch_bytes_per_s,
                                             !c->pinned_no_pool)))
    return ferry_errbuf(r->err, r->errlen, rc, "%s", r->sim->err);
  if ((c->duplex_d2h > 0 || c->duplex_h2d > 0) &&
      (rc = sim_backend_set_duplex(r->sim, c->duplex_d2h > 0 ? c->duplex_d2h : cfg.link.duplex,
                                   c->duplex_h2d > 0 ? c->duplex_h2d : cfg.link.duplex)))
    return ferry_errbuf(r->err, r->errlen, rc, "%s", r->sim->err);
  return 0;
}

/* Per-tensor tables and layer rows. The engine is handed the trace's own
 * descriptions: their strings are the trace's, deduplicated and alive for
 * the whole replay, as an engine needs (cb_recorded finds a tensor's index
 * from its description's address). */
static int replay_tables(replay *r) {
  const sim_trace *t = r->t;
  sim_result *out = r->res;
  int32_t max_layer = -1;
  r->handles = calloc(t->n_tensors ? t->n_tensors : 1, sizeof *r->handles);
  r->bufs = calloc(t->n_tensors ? t->n_tensors : 1, sizeof *r->bufs);
  r->went = calloc(t->n_tensors ? t->n_tensors : 1, 1);
  if (!r->handles || !r->bufs || !r->went)
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < t->n_tensors; i++)
    if (t->tensors[i].desc.layer > max_layer) max_layer = t->tensors[i].desc.layer;
  out->n_layers = (uint32_t)(max_layer + 2);
  out->layers = calloc(out->n_layers, sizeof *out->layers);
  if (!out->layers) return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  for (uint32_t i = 0; i < out->n_layers; i++) out->layers[i].layer = (int32_t)i - 1;
  return 0;
}

/* Whether ev's compute is timed on the simulated GPU: a rate is given and
 * the trace says how much work it is (FLOPs, or device-memory bytes). */
static int timed_from_work(const replay *r, const trace_ev *ev) {
  return r->c->tflops > 0 && (ev->flops >= 0 || ev->hbm_bytes >= 0);
}

/* ev's compute on the simulated GPU (timed_from_work): a roofline, the
 * larger of its FLOPs at the achieved rate and its device-memory bytes at
 * the achieved bandwidth, and at least its min_us (kernel launches). A
 * recorded event carries FLOPs only: flops / rate. */
static double work_us(const replay *r, const trace_ev *ev) {
  double us = ev->flops > 0 ? ev->flops / (r->c->tflops * 1e6) : 0;
  if (ev->hbm_bytes > 0) {
    double bw = r->c->hbm_bytes_per_s > 0 ? r->c->hbm_bytes_per_s : SIM_DEFAULT_HBM_BYTES_PER_S;
    double mem = ev->hbm_bytes / bw * 1e6;
    if (mem > us) us = mem;
  }
  return us > ev->min_us ? us : ev->min_us;
}

/* The compute time before ev: from its work at the simulated GPU's
 * achieved rates when both are known, else the trace's. */
static double event_gap(replay *r, const trace_ev *ev) {
  if (timed_from_work(r, ev)) {
    if (r->first) r->res->gaps_from_flops++;
    return work_us(r, ev);
  }
  if (r->first && ev->gap_us > 0) r->res->gaps_as_recorded++;
  return ev->gap_us;
}

/* The compute before event k, and on the timeline the layer it belongs to:
 * the event's own, or the next tensor event's. */
static double replay_gap(replay *r, const trace_step *ts, uint32_t k) {
  const sim_trace *t = r->t;
  const trace_ev *ev = &t->events[k];
  double a = replay_now(r), us = event_gap(r, ev) * r->gap_scale;
  replay_compute(r, us);
  if (!r->recording) return us;
  int32_t layer = r->cur_layer;
  const char *module = ev->type == TEV_COMPUTE ? ev->op : NULL;
  if (ev->type == TEV_COMPUTE && ev->layer >= 0) layer = ev->layer;
  else for (uint32_t j = k; j < ts->end && j < k + 64; j++)
    if (t->events[j].type == TEV_PACK || t->events[j].type == TEV_UNPACK) {
      const ferry_tensor_desc *d = &t->tensors[t->events[j].tensor].desc;
      layer = d->layer;
      if (ev->type != TEV_COMPUTE) module = d->module_path;
      break;
    }
  timeline_push(&r->res->tl, (sim_interval){a, replay_now(r), 0, 0, layer, 0, 0, module,
                                            ev->flops, ev->hbm_bytes});
  return us;
}

/* The trainer's buffer for a pack: its primary's for an alias, else a new
 * one (filled with the tensor's pattern on host); NULL out of memory. */
static sim_buf *pack_buffer(replay *r, uint32_t ti) {
  const trace_tensor *tt = &r->t->tensors[ti];
  const ferry_tensor_desc *d = &tt->desc;
  if (tt->alias_of >= 0) {
    sim_buf *b = r->bufs[tt->alias_of];
    b->refs++;
    return b;
  }
  int counted = d->kind != FERRY_KIND_PARAMETER && d->kind != FERRY_KIND_BUFFER;
  sim_buf *b = buf_new(r, d->bytes, counted);
  if (!b) {
    r->err_written = 1;
    ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory for a %llu-byte buffer",
                 (unsigned long long)d->bytes);
    return NULL;
  }
  if (r->host) {
    /* the trainer's work, not part of the modeled time */
    double w = util_now_us();
    buf_bytes_ok(b, tensor_pattern(ti), 1);
    r->host_excluded_us += util_now_us() - w;
  }
  /* The trainer holds it until its last alias is packed. */
  if (tt->last_alias >= 0) b->refs++;
  return b;
}

/* The last step's layer row (and decision list) for a pack. */
static void count_pack(replay *r, const ferry_tensor_desc *d, int offloaded) {
  sim_result *out = r->res;
  sim_layer_row *row = &out->layers[d->layer + 1];
  row->packed++;
  row->saved_bytes += d->bytes;
  if (offloaded) {
    row->offloaded++;
    row->offloaded_bytes += d->bytes;
  }
  if (out->decisions) out->decisions[out->n_decisions++] = (uint8_t)offloaded;
}

/* A pack event: ferry_pack of the tensor's buffer. */
static int replay_pack(replay *r, uint32_t ti) {
  const sim_trace *t = r->t;
  const trace_tensor *tt = &t->tensors[ti];
  const ferry_tensor_desc *d = &tt->desc;
  r->cur_layer = d->layer;
  sim_buf *b = pack_buffer(r, ti);
  if (!b) return FERRY_ENOMEM;
  r->bufs[ti] = b;
  if (r->recording && tt->alias_of < 0)
    map_set(&r->dev_tensor, buf_ptr(b), ti + 1);
  uint64_t off0 = engine_offloaded(r->e);
  double a = r->host ? util_now_us() : 0;
  /* As ferry.torch packs: a site the policy keeps from its cache gets no
   * handle (the trainer holds the tensor), so its unpack starts no reload */
  int rc = 0;
  r->handles[ti] = 0;
  if (!ferry_pack_cached_keep(r->e, d, buf_ptr(b)))
    rc = ferry_pack(r->e, d, buf_ptr(b), b, NULL, &r->handles[ti]);
  if (r->host) r->host_wait += util_now_us() - a;
  if (rc) {
    buf_unref(r, b);
    return rc;
  }
  if (tt->alias_of >= 0 && t->tensors[tt->alias_of].last_alias == (int32_t)ti)
    buf_unref(r, r->bufs[tt->alias_of]); /* the trainer's reference */
  int offloaded = engine_offloaded(r->e) != off0;
  r->went[ti] = (uint8_t)offloaded;
  if (offloaded && r->sim && r->c->pinned_no_pool) sim_backend_pinned_alloc(r->sim, d->bytes);
  if (r->last) count_pack(r, d, offloaded);
  return 0;
}

/* An unpack event: ferry_unpack, its bytes checked on host, its stall counted. */
static int replay_unpack(replay *r, uint32_t ti) {
  const sim_trace *t = r->t;
  int host = r->host;
  r->cur_layer = t->tensors[ti].desc.layer;
  void *dev = NULL, *owner = NULL;
  double w, s_before = sim_stall(r, &w);
  ferry_stats st;
  /* a stash hit brings nothing back over the link: only asked of tensors
   * that went out (the stats are a copy of every counter under the lock) */
  uint64_t hits0 = r->went[ti] && !ferry_get_stats(r->e, &st, sizeof st) ? st.stash_hits : 0;
  double a = host ? util_now_us() : 0;
  int rc = 0;
  if (r->handles[ti]) {
    rc = ferry_unpack(r->e, r->handles[ti], NULL, &dev, &owner);
  } else { /* kept by ferry_pack_cached_keep: the trainer's own reference */
    owner = r->bufs[ti];
    dev = buf_ptr(owner);
  }
  double dt = host ? util_now_us() - a : 0;
  if (rc) return rc;
  r->host_stall += dt;
  /* from here on: whether its bytes came back over the link */
  if (r->went[ti] && !ferry_get_stats(r->e, &st, sizeof st) && st.stash_hits != hits0)
    r->went[ti] = 0;
  sim_buf *b = owner;
  /* an alias hands back its primary's buffer */
  uint32_t src = t->tensors[ti].alias_of >= 0 ? (uint32_t)t->tensors[ti].alias_of : ti;
  double wb = host ? util_now_us() : 0;
  if (!buf_bytes_ok(b, tensor_pattern(src), 0) || buf_ptr(b) != dev) r->bad_bytes++;
  if (host) r->host_excluded_us += util_now_us() - wb;
  if (r->last) {
    double s_after = sim_stall(r, &w);
    r->res->layers[r->cur_layer + 1].stall_us += host ? dt / r->host_scale : s_after - s_before;
  }
  buf_unref(r, b); /* backward used it and let it go */
  r->bufs[ti] = NULL;
  return 0;
}

/* A step_end event: ferry_step_end, timed on host. */
static int replay_step_end(replay *r) {
  double a = r->host ? util_now_us() : 0;
  int rc = ferry_step_end(r->e);
  if (r->host) r->host_wait += util_now_us() - a;
  if (rc) return rc;
  if (r->recording) {
    mem_sample(r);
    r->res->tl.t_end = replay_now(r);
  }
  return 0;
}

/* One event, as the trainer would call ferry; *t0 is the step's start. */
static int replay_event_call(replay *r, const trace_ev *ev, double *t0) {
  int rc;
  switch (ev->type) {
  case TEV_STEP_BEGIN:
    if ((rc = ferry_step_begin(r->e))) return rc;
    *t0 = replay_now(r);
    if (r->recording) {
      r->res->tl.t_begin = *t0;
      mem_sample(r);
    }
    return 0;
  case TEV_PACK: return replay_pack(r, ev->tensor);
  case TEV_UNPACK: return replay_unpack(r, ev->tensor);
  case TEV_DISCARD:
    if (!r->handles[ev->tensor]) buf_unref(r, r->bufs[ev->tensor]);
    else if ((rc = ferry_discard(r->e, r->handles[ev->tensor]))) return rc;
    r->bufs[ev->tensor] = NULL;
    return 0;
  case TEV_BACKWARD_BEGIN:
    if (r->recording) r->res->tl.t_backward = replay_now(r);
    return ferry_backward_begin(r->e);
  case TEV_BACKWARD_END: return ferry_backward_end(r->e);
  case TEV_STEP_END: return replay_step_end(r);
  /* transient memory: counted on the device, never seen by the engine (no
   * pack: the trainer frees it itself), so no buffer either */
  case TEV_ALLOC: live_add(r, r->t->allocs[ev->tensor].bytes); return 0;
  case TEV_FREE: live_sub(r, r->t->allocs[ev->tensor].bytes); return 0;
  default: return 0;
  }
}

/* The next capacity of a full timeline array of cap elements. */
static size_t grown(size_t cap) { return cap ? cap * 2 : 256; }

/* After an event of the recorded step: the waits it exposed (sim: the
 * clock moved only by them, from a; s0 the backend's counters before) and
 * the pinned host memory in use, onto the timeline. */
static void timeline_after_event(replay *r, double a, const sim_backend_stats *s0) {
  sim_timeline *tl = &r->res->tl;
  if (r->sim) {
    sim_backend_stats s1;
    sim_backend_get_stats(r->sim, &s1);
    double pin = s1.pinned_alloc_us - s0->pinned_alloc_us;
    double d[3] = {s1.stall_us - s0->stall_us, s1.host_wait_us - s0->host_wait_us - pin, pin};
    for (int32_t k = 0; k < 3; k++) {
      if (!(d[k] > 1e-9)) continue;
      if (tl->n_waits == tl->cap_waits) {
        sim_wait *p = realloc(tl->waits, grown(tl->cap_waits) * sizeof *p);
        if (!p) return;
        tl->waits = p;
        tl->cap_waits = grown(tl->cap_waits);
      }
      tl->waits[tl->n_waits++] = (sim_wait){a, a + d[k], k, r->cur_layer};
      a += d[k];
    }
  }
  ferry_stats st;
  if (ferry_get_stats(r->e, &st, sizeof st)) return;
  if (tl->n_host && tl->host[tl->n_host - 1].bytes == st.arena_in_use) return;
  if (tl->n_host == tl->cap_host) {
    sim_mem_sample *p = realloc(tl->host, grown(tl->cap_host) * sizeof *p);
    if (!p) return;
    tl->host = p;
    tl->cap_host = grown(tl->cap_host);
  }
  tl->host[tl->n_host++] = (sim_mem_sample){replay_now(r), st.arena_in_use};
}

/* replay_event_call, and when recording what the event made the trainer
 * wait for and the pinned memory after it. */
static int replay_event(replay *r, const trace_ev *ev, double *t0) {
  if (!r->recording) return replay_event_call(r, ev, t0);
  sim_backend_stats s0 = {0};
  if (r->sim) sim_backend_get_stats(r->sim, &s0);
  double a = replay_now(r);
  int rc = replay_event_call(r, ev, t0);
  if (!rc) timeline_after_event(r, a, &s0);
  return rc;
}

/* Before the last step: a fresh decision list and zeroed layer rows. */
static void begin_last_step(replay *r, const trace_step *ts) {
  sim_result *out = r->res;
  if (r->c->record_decisions) {
    free(out->decisions);
    out->decisions = malloc((size_t)(ts->end - ts->first) + 1);
    out->n_decisions = 0;
  }
  for (uint32_t k = 0; k < out->n_layers; k++) {
    int32_t l = out->layers[k].layer;
    memset(&out->layers[k], 0, sizeof out->layers[k]);
    out->layers[k].layer = l;
  }
}

/* Adds a steady step's time, stall and engine counters to the sums. */
static void add_step(step_sums *s, double step_us, double stall, double wait, const ferry_stats *s0,
                     const ferry_stats *s1) {
  s->n_steady++;
  s->step += step_us;
  s->stall += stall;
  s->wait += wait;
  s->d2h += (double)(s1->bytes_d2h - s0->bytes_d2h);
  s->h2d += (double)(s1->bytes_h2d - s0->bytes_h2d);
  s->packed += (double)(s1->tensors_packed - s0->tensors_packed);
  s->off += (double)(s1->tensors_offloaded - s0->tensors_offloaded);
  s->kept += (double)(s1->tensors_kept - s0->tensors_kept);
  s->pf += (double)(s1->prefetches - s0->prefetches);
  s->hits += (double)(s1->stash_hits - s0->stash_hits);
}

/* Host time spent pinning memory so far (sim). */
static double pinned_us(replay *r) {
  if (!r->sim) return 0;
  sim_backend_stats st;
  sim_backend_get_stats(r->sim, &st);
  return st.pinned_alloc_us;
}

/* ---- optimizer-state offload (opt_model above) ------------------------------------ */

/* The compute before ev as event_gap times it, without counting it. */
static double gap_of(const replay *r, const trace_ev *ev) {
  if (timed_from_work(r, ev)) return work_us(r, ev);
  return ev->gap_us > 0 ? ev->gap_us : 0;
}

/* The trace's resident entry named what, or NULL. */
static const trace_resident *resident_named(const sim_trace *t, const char *what) {
  for (uint32_t i = 0; i < t->n_resident; i++)
    if (!strcmp(t->resident[i].what, what)) return &t->resident[i];
  return NULL;
}

/* A share of x bytes, rounded to the byte. */
static uint64_t share_of(double f, uint64_t x) { return (uint64_t)(f * (double)x + 0.5); }

/* The engine's last error as the replay's, naming the optimizer offload. */
static int opt_fail(replay *r, int rc, const char *what) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: optimizer offload: %s: %s", r->res->label, what,
                      ferry_last_error(r->e));
}

/* A resident buffer of bytes (none for 0). */
static int opt_buffer(replay *r, uint64_t bytes, ferry_resident **out) {
  *out = NULL;
  if (!bytes) return 0;
  int rc = ferry_resident_create(r->e, bytes, out);
  return rc ? opt_fail(r, rc, "a host buffer") : 0;
}

/* Validates the settings and, for a share > 0, takes the share's states off
 * the device, pins the host buffers and sizes the host step. */
static int opt_open(replay *r) {
  const sim_config *c = r->c;
  const sim_trace *t = r->t;
  sim_result *out = r->res;
  double f = c->optimizer_fraction;
  r->resident = t->resident_bytes + c->untracked_bytes;
  r->gap_scale = 1;
  if (!(f >= 0 && f <= 1))
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "optimizer fraction %g must be within 0..1", f);
  if (!(c->cpu_adam_params_per_s >= 0) || !isfinite(c->cpu_adam_params_per_s))
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "CPU Adam rate %g must be > 0 parameters/s (0: the default)",
                        c->cpu_adam_params_per_s);
  if (f == 0) return 0;
  if (!r->sim)
    return ferry_errbuf(r->err, r->errlen, FERRY_EUNSUPPORTED,
                        "optimizer offload is modeled on the sim backend only");
  const trace_resident *params = resident_named(t, "parameters");
  const trace_resident *grads = resident_named(t, "gradients");
  const trace_resident *states = resident_named(t, "optimizer states");
  const trace_resident *masters = resident_named(t, "master weights");
  if (!params || !grads || !states)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: optimizer offload needs the trace's resident memory named "
                        "\"parameters\", \"gradients\" and \"optimizer states\" (%s missing; "
                        "ferry_trace_resident declares them, synthesized traces have them)",
                        t->name, !params ? "\"parameters\"" : !grads ? "\"gradients\""
                                                                  : "\"optimizer states\"");
  opt_model *o = calloc(1, sizeof *o);
  if (!o) return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  r->opt = o;
  o->fraction = f;
  /* the parameters' element size: their resident line's dtype, else the
   * trace's parameter packs', else bf16 */
  int elem = params->dtype ? ferry_dtype_size(params->dtype) : 0;
  for (uint32_t i = 0; i < t->n_tensors && !elem; i++)
    if (t->tensors[i].desc.kind == FERRY_KIND_PARAMETER)
      elem = ferry_dtype_size(t->tensors[i].desc.dtype);
  if (elem <= 0) elem = 2;
  double rate = c->cpu_adam_params_per_s > 0 ? c->cpu_adam_params_per_s : SIM_DEFAULT_CPU_ADAM;
  out->opt_fraction = f;
  out->opt_params = f * (double)params->bytes / elem;
  out->opt_cpu_adam_params_per_s = rate;
  out->opt_serial = c->optimizer_serial != 0;
  o->cpu_us = out->opt_params / rate * 1e6;
  out->opt_device_bytes = share_of(f, states->bytes + (masters ? masters->bytes : 0));
  r->resident -= out->opt_device_bytes;
  uint64_t gbytes = share_of(f, grads->bytes), pbytes = share_of(f, params->bytes);
  out->opt_host_bytes = out->opt_device_bytes + gbytes + pbytes;
  o->k = t->layers > 0 ? (uint32_t)(t->layers < 1023 ? t->layers + 1 : 1024) : 1;
  o->grad = calloc(o->k, sizeof *o->grad);
  o->param = calloc(o->k, sizeof *o->param);
  o->pending = calloc(o->k, 1);
  o->dev = malloc(2 * (size_t)o->k);
  o->fwd_us = calloc(t->n_steps ? t->n_steps : 1, sizeof *o->fwd_us);
  o->bwd_us = calloc(t->n_steps ? t->n_steps : 1, sizeof *o->bwd_us);
  if (!o->grad || !o->param || !o->pending || !o->dev || !o->fwd_us || !o->bwd_us)
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  int rc = opt_buffer(r, out->opt_device_bytes, &o->state);
  for (uint32_t j = 0; j < o->k && !rc; j++) {
    uint64_t g = gbytes / o->k + (j + 1 == o->k ? gbytes % o->k : 0);
    uint64_t p = pbytes / o->k + (j + 1 == o->k ? pbytes % o->k : 0);
    if (!(rc = opt_buffer(r, g, &o->grad[j]))) rc = opt_buffer(r, p, &o->param[j]);
  }
  if (rc) return rc;
  ferry_backend *b = engine_backend(r->e);
  if ((rc = b->ops->stream_create(b, &o->lane)) || (rc = b->ops->event_create(b, &o->now_ev)))
    return ferry_errbuf(r->err, r->errlen, rc, "optimizer offload: %s", b->err);
  /* each trace step's forward and backward compute: the layers' shares */
  for (uint32_t s = 0; s < t->n_steps; s++) {
    int phase = 0;
    for (uint32_t k = t->steps[s].first; k < t->steps[s].end; k++) {
      const trace_ev *ev = &t->events[k];
      if (phase == 0) o->fwd_us[s] += gap_of(r, ev);
      else if (phase == 1) o->bwd_us[s] += gap_of(r, ev);
      if (ev->type == TEV_BACKWARD_BEGIN) phase = 1;
      else if (ev->type == TEV_BACKWARD_END) phase = 2;
    }
  }
  return 0;
}

static void opt_close(replay *r) {
  opt_model *o = r->opt;
  if (!o) return;
  for (uint32_t j = 0; j < o->k; j++) {
    if (o->grad && o->grad[j]) ferry_resident_destroy(o->grad[j]);
    if (o->param && o->param[j]) ferry_resident_destroy(o->param[j]);
  }
  if (o->state) ferry_resident_destroy(o->state);
  ferry_backend *b = r->e ? engine_backend(r->e) : NULL;
  if (b && o->now_ev) b->ops->event_destroy(b, o->now_ev);
  if (b && o->lane) b->ops->stream_destroy(b, o->lane);
  free(o->grad);
  free(o->param);
  free(o->pending);
  free(o->dev);
  free(o->fwd_us);
  free(o->bwd_us);
  free(o);
  r->opt = NULL;
}

/* The host waits for buffer x's last copy; the wait is the optimizer's. */
static int opt_wait(replay *r, ferry_resident *x) {
  double a = replay_now(r);
  int rc = ferry_resident_wait(x);
  if (rc) return opt_fail(r, rc, "waiting for a copy");
  double d = replay_now(r) - a;
  r->opt->stall += d;
  r->opt->host_wait += d;
  return 0;
}

/* Chunk j's gradients D2H, after the compute so far (the hook's copy). */
static int opt_grad(replay *r, uint32_t j) {
  opt_model *o = r->opt;
  int rc = o->grad[j] ? ferry_resident_to_host(o->grad[j], o->dev + j, NULL) : 0;
  return rc ? opt_fail(r, rc, "gradients to the host") : 0;
}

/* Chunk j's updated parameters H2D from now on, without the compute stream
 * waiting for them (it does so when the forward needs them). */
static int opt_param(replay *r, uint32_t j) {
  opt_model *o = r->opt;
  if (!o->param[j]) return 0;
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if ((rc = b->ops->event_record(b, o->now_ev, NULL)) ||
      (rc = b->ops->stream_wait_event(b, o->lane, o->now_ev)))
    return ferry_errbuf(r->err, r->errlen, rc, "optimizer offload: %s", b->err);
  if ((rc = ferry_resident_to_device(o->param[j], o->dev + o->k + j, o->lane)))
    return opt_fail(r, rc, "parameters to the device");
  o->pending[j] = 1;
  return 0;
}

/* Before `gap` µs of forward compute, `done` µs into this step's `total`:
 * the parameters of the chunks it reaches must be on the device. */
static int opt_forward(replay *r, double done, double gap, double total) {
  opt_model *o = r->opt;
  for (uint32_t j = 0; j < o->k; j++) {
    if (!o->pending[j]) continue;
    if ((double)j * total / o->k >= done + gap - 1e-9 * total) break;
    o->pending[j] = 0;
    int rc = opt_wait(r, o->param[j]);
    if (rc) return rc;
  }
  return 0;
}

/* Every parameter chunk still pending, waited for. */
static int opt_params_all(replay *r) {
  for (uint32_t j = 0; j < r->opt->k; j++)
    if (r->opt->pending[j]) {
      r->opt->pending[j] = 0;
      int rc = opt_wait(r, r->opt->param[j]);
      if (rc) return rc;
    }
  return 0;
}

/* `done` µs into this step's backward of `total`: the chunks whose share of
 * backward has passed have their gradients; they go to the host. */
static int opt_backward(replay *r, double done, double total) {
  opt_model *o = r->opt;
  while (o->grads_issued < o->k &&
         (double)(o->grads_issued + 1) * total / o->k <= done + 1e-9 * total) {
    int rc = opt_grad(r, o->grads_issued++);
    if (rc) return rc;
  }
  return 0;
}

/* step(): the remaining gradients go, the host waits for all of them, and
 * the host step starts (serial: runs now, before the device's). */
static int opt_sync(replay *r) {
  opt_model *o = r->opt;
  int rc;
  while (o->grads_issued < o->k)
    if ((rc = opt_grad(r, o->grads_issued++))) return rc;
  for (uint32_t j = 0; j < o->k; j++)
    if (o->grad[j] && (rc = opt_wait(r, o->grad[j]))) return rc;
  o->synced = 1;
  if (r->c->optimizer_serial) {
    replay_compute(r, o->cpu_us);
    o->stall += o->cpu_us;
  } else {
    o->cpu_end = replay_now(r) + o->cpu_us;
  }
  return 0;
}

/* At step_end: step() returns once the host step is done; serial, the
 * updated parameters are on the device before the step ends. */
static int opt_step_end(replay *r) {
  opt_model *o = r->opt;
  int rc;
  if ((rc = opt_params_all(r))) return rc; /* a step without backward_begin */
  if (!o->synced && (rc = opt_sync(r))) return rc;
  if (!r->c->optimizer_serial) {
    double d = o->cpu_end - replay_now(r);
    if (d > 0) {
      replay_compute(r, d);
      o->stall += d;
    }
    return 0;
  }
  for (uint32_t j = 0; j < o->k; j++)
    if ((rc = opt_param(r, j))) return rc;
  return opt_params_all(r);
}

/* After step_end (overlapped): the updated parameters start for the next
 * forward. */
static int opt_after_step(replay *r) {
  int rc = 0;
  if (!r->c->optimizer_serial)
    for (uint32_t j = 0; j < r->opt->k && !rc; j++) rc = opt_param(r, j);
  return rc;
}

/* ---- weight offload (weight_model above) ------------------------------------------ */

/* The engine's last error as the replay's, naming the weight offload. */
static int w_fail(replay *r, int rc, const char *what) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: weight offload: %s: %s", r->res->label, what,
                      ferry_last_error(r->e));
}

static int w_backend_fail(replay *r, int rc) {
  return ferry_errbuf(r->err, r->errlen, rc, "%s: weight offload: %s", r->res->label,
                      engine_backend(r->e)->err);
}

/* Validates the settings and, with blocks chosen, takes their weights out of
 * resident memory and pins their host copies (offload_weights copies them
 * to the host when it wraps the model: step 1 starts with them there). */
static int w_open(replay *r) {
  const sim_config *c = r->c;
  const sim_trace *t = r->t;
  sim_result *out = r->res;
  if (c->weight_count == 0) return 0;
  if (c->weight_count < 0 || c->weight_first < 0)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "weight layers: first %d and count %d must be >= 0", c->weight_first,
                        c->weight_count);
  if (!r->sim)
    return ferry_errbuf(r->err, r->errlen, FERRY_EUNSUPPORTED,
                        "weight offload is modeled on the sim backend only");
  int32_t last = (int32_t)((int64_t)c->weight_first + c->weight_count - 1);
  if (t->layers <= 0 || (int64_t)c->weight_first + c->weight_count > t->layers)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight layers %d..%d: the trace has %d repeated block(s)%s", t->name,
                        c->weight_first, last, t->layers,
                        t->layers > 0 ? "" : " (its packs name no \"layers\")");
  const trace_resident *params = resident_named(t, "parameters");
  if (!params || !params->bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight offload needs the trace's resident \"parameters\" (%s; "
                        "ferry_trace_resident declares them, synthesized traces have them)",
                        t->name, params ? "0 bytes" : "missing");
  uint64_t each = params->layer_bytes;
  int estimated = each == 0;
  if (estimated) each = params->bytes / (uint64_t)t->layers;
  if (!each || each * (uint64_t)c->weight_count > params->bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EINVAL,
                        "%s: weight offload: %d block(s) of %llu bytes are more than the %llu "
                        "bytes of \"parameters\"", t->name, c->weight_count,
                        (unsigned long long)each, (unsigned long long)params->bytes);
  weight_model *w = calloc(1, sizeof *w);
  if (!w) return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  r->w = w;
  w->first = c->weight_first;
  w->count = c->weight_count;
  w->bytes = each;
  w->dbl = !c->weight_single_buffer;
  size_t n = (size_t)w->count;
  w->l = calloc(n, sizeof *w->l);
  w->dev = malloc(n);
  w->fwd_first = malloc(n * sizeof *w->fwd_first);
  w->fwd_last = malloc(n * sizeof *w->fwd_last);
  w->bwd_first = malloc(n * sizeof *w->bwd_first);
  w->bwd_after_gap = calloc(n, 1);
  if (!w->l || !w->dev || !w->fwd_first || !w->fwd_last || !w->bwd_first || !w->bwd_after_gap)
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "out of memory");
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if ((rc = b->ops->stream_create(b, &w->lane)) || (rc = b->ops->event_create(b, &w->now_ev)))
    return w_backend_fail(r, rc);
  for (size_t i = 0; i < n; i++) {
    if ((rc = ferry_resident_create(r->e, each, &w->l[i].buf)))
      return w_fail(r, rc, "a host buffer");
    if ((rc = b->ops->event_create(b, &w->l[i].d2h)) || (rc = b->ops->event_create(b, &w->l[i].h2d)))
      return w_backend_fail(r, rc);
  }
  r->resident -= each * n;
  out->w_first = w->first;
  out->w_count = w->count;
  out->w_double_buffer = w->dbl;
  out->w_estimated = estimated;
  out->w_layer_bytes = each;
  out->w_device_bytes = out->w_host_bytes = each * n;
  return 0;
}

static void w_close(replay *r) {
  weight_model *w = r->w;
  if (!w) return;
  ferry_backend *b = r->e ? engine_backend(r->e) : NULL;
  for (int32_t i = 0; w->l && i < w->count; i++) {
    if (w->l[i].buf) ferry_resident_destroy(w->l[i].buf);
    if (b && w->l[i].d2h) b->ops->event_destroy(b, w->l[i].d2h);
    if (b && w->l[i].h2d) b->ops->event_destroy(b, w->l[i].h2d);
  }
  if (b && w->now_ev) b->ops->event_destroy(b, w->now_ev);
  if (b && w->lane) b->ops->stream_destroy(b, w->lane);
  free(w->l);
  free(w->dev);
  free(w->fwd_first);
  free(w->fwd_last);
  free(w->bwd_first);
  free(w->bwd_after_gap);
  free(w);
  r->w = NULL;
}

/* The block an event belongs to: a compute event's, a pack's or unpack's
 * tensor's; -1 for the others. */
static int32_t event_layer(const replay *r, const trace_ev *ev) {
  if (ev->type == TEV_COMPUTE) return ev->layer;
  if (ev->type == TEV_PACK || ev->type == TEV_UNPACK) return r->t->tensors[ev->tensor].desc.layer;
  return -1;
}

/* The chosen block's index of an event, or -1. */
static int32_t w_index(const replay *r, const trace_ev *ev) {
  int32_t l = event_layer(r, ev);
  return l >= r->w->first && l - r->w->first < r->w->count ? l - r->w->first : -1;
}

/* Where trace step `tsi`'s chosen blocks begin and end forward and begin
 * backward. */
static void w_tables(replay *r, uint32_t tsi) {
  weight_model *w = r->w;
  if (w->table_step == tsi + 1) return;
  w->table_step = tsi + 1;
  for (int32_t i = 0; i < w->count; i++) {
    w->fwd_first[i] = w->fwd_last[i] = w->bwd_first[i] = -1;
    w->bwd_after_gap[i] = 0;
  }
  const trace_step *ts = &r->t->steps[tsi];
  int phase = 0;
  for (uint32_t k = ts->first; k < ts->end; k++) {
    const trace_ev *ev = &r->t->events[k];
    int32_t i = w_index(r, ev);
    if (i >= 0 && phase == 0) {
      if (w->fwd_first[i] < 0) w->fwd_first[i] = k;
      w->fwd_last[i] = k;
    } else if (i >= 0 && phase == 1 && w->bwd_first[i] < 0) {
      w->bwd_first[i] = k;
      w->bwd_after_gap[i] = ev->type != TEV_COMPUTE;
    }
    if (ev->type == TEV_BACKWARD_BEGIN) phase = 1;
    else if (ev->type == TEV_BACKWARD_END) phase = 2;
  }
}

/* Offloads whose copy has completed free their device copy. */
static int w_poll(replay *r) {
  weight_model *w = r->w;
  if (!w->n_leaving) return 0;
  ferry_backend *b = engine_backend(r->e);
  for (int32_t i = 0; i < w->count && w->n_leaving; i++) {
    if (!w->l[i].leaving) continue;
    int q = b->ops->event_query(b, w->l[i].d2h);
    if (q < 0) return w_backend_fail(r, q);
    if (!q) continue;
    w->l[i].leaving = 0;
    w->n_leaving--;
    live_sub(r, w->bytes);
  }
  return 0;
}

/* The compute stream waited d µs from a for block i's weights: a reload
 * stall, on the timeline and the block's row. */
static void w_waited(replay *r, int32_t i, double a, double d) {
  int32_t layer = r->w->first + i;
  r->w->stall += d;
  if (r->last) r->res->layers[layer + 1].stall_us += d;
  if (!r->recording) return;
  sim_timeline *tl = &r->res->tl;
  if (tl->n_waits == tl->cap_waits) {
    sim_wait *p = realloc(tl->waits, grown(tl->cap_waits) * sizeof *p);
    if (!p) return;
    tl->waits = p;
    tl->cap_waits = grown(tl->cap_waits);
  }
  tl->waits[tl->n_waits++] = (sim_wait){a, a + d, SIM_WAIT_RELOAD, layer};
}

/* Block i's weights onto the device (a reload from now on, unless there),
 * and with `wait` the compute waits for them. */
static int w_load(replay *r, int32_t i, int wait) {
  weight_model *w = r->w;
  w_layer *x = &w->l[i];
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if (!x->on) {
    if ((rc = b->ops->event_record(b, w->now_ev, NULL)) ||
        (rc = b->ops->stream_wait_event(b, w->lane, w->now_ev)))
      return w_backend_fail(r, rc);
    if ((rc = ferry_resident_to_device(x->buf, w->dev + i, w->lane)))
      return w_fail(r, rc, "weights to the device");
    if ((rc = b->ops->event_record(b, x->h2d, engine_h2d_stream(r->e))))
      return w_backend_fail(r, rc);
    live_add(r, w->bytes); /* the reload's destination is allocated now */
    x->on = x->loading = 1;
    w->h2d += (double)w->bytes;
  }
  if (wait && x->loading) {
    double a = replay_now(r);
    if ((rc = b->ops->stream_wait_event(b, NULL, x->h2d))) return w_backend_fail(r, rc);
    x->loading = 0;
    double d = replay_now(r) - a;
    if (d > 0) w_waited(r, i, a, d);
  }
  return 0;
}

/* Block i's weights to the host after the compute so far; its device copy
 * is freed when the copy completes (w_poll). */
static int w_offload(replay *r, int32_t i) {
  weight_model *w = r->w;
  w_layer *x = &w->l[i];
  ferry_backend *b = engine_backend(r->e);
  int rc;
  if (!x->on) return 0;
  if ((rc = w_load(r, i, 1))) return rc; /* its reload first (offload_weights' wait()) */
  if ((rc = w_poll(r))) return rc;
  if (x->leaving) { /* the previous offload still copying: the host waits for it */
    if ((rc = b->ops->event_synchronize(b, x->d2h))) return w_backend_fail(r, rc);
    if ((rc = w_poll(r))) return rc;
  }
  if ((rc = ferry_resident_to_host(x->buf, w->dev + i, NULL)))
    return w_fail(r, rc, "weights to the host");
  if ((rc = b->ops->event_record(b, x->d2h, engine_d2h_stream(r->e)))) return w_backend_fail(r, rc);
  x->on = 0;
  x->leaving = 1;
  w->n_leaving++;
  w->d2h += (double)w->bytes;
  return 0;
}

/* A block's pre-forward (dir +1) or pre-backward (dir -1) hook: its weights
 * on the device and waited for; double-buffered, its neighbour's reload
 * (the next chosen block in forward, the previous in backward) issued. */
static int w_hook(replay *r, int32_t i, int dir) {
  int rc = w_poll(r);
  if (!rc) rc = w_load(r, i, 1);
  if (!rc && r->w->dbl && i + dir >= 0 && i + dir < r->w->count) rc = w_load(r, i + dir, 0);
  return rc;
}

/* Before event k's compute, in phase (0 forward, 1 backward). */
static int w_before_gap(replay *r, uint32_t k, int phase) {
  weight_model *w = r->w;
  int32_t i = w_index(r, &r->t->events[k]);
  if (i < 0) return 0;
  if (phase == 0 && w->fwd_first[i] == (int64_t)k) return w_hook(r, i, +1);
  if (phase == 1 && w->bwd_first[i] == (int64_t)k && !w->bwd_after_gap[i]) return w_hook(r, i, -1);
  return 0;
}

/* After event k's compute, before the event: completed offloads free their
 * bytes before anything is allocated; a backward hook on a tensor event. */
static int w_before_event(replay *r, uint32_t k, int phase) {
  weight_model *w = r->w;
  int rc = w_poll(r);
  if (rc) return rc;
  int32_t i = w_index(r, &r->t->events[k]);
  if (i >= 0 && phase == 1 && w->bwd_first[i] == (int64_t)k && w->bwd_after_gap[i])
    return w_hook(r, i, -1);
  return 0;
}

/* After event k: the end of a chosen block's forward offloads its weights. */
static int w_after_event(replay *r, uint32_t k, int phase) {
  int32_t i = w_index(r, &r->t->events[k]);
  if (i >= 0 && phase == 0 && r->w->fwd_last[i] == (int64_t)k) return w_offload(r, i);
  return 0;
}

/* Replays step si of steps (the trace's steps in a loop) and sums it up. */
static int replay_step(replay *r, uint32_t si, uint32_t steps, step_sums *sums) {
  const sim_trace *t = r->t;
  const trace_step *ts = &t->steps[si % t->n_steps];
  r->last = si + 1 == steps;
  r->recording = r->last && r->c->timeline;
  r->first = si == 0;
  r->steady = si >= r->warmup || steps <= r->warmup;
  if (r->steady && !r->peak_steady) r->peak_steady = r->live_bytes;
  if (r->last) begin_last_step(r, ts);
  ferry_stats s0, s1;
  ferry_get_stats(r->e, &s0, sizeof s0);
  double w0, st0 = sim_stall(r, &w0);
  double hs0 = r->host_stall, hw0 = r->host_wait;
  double pin0 = pinned_us(r);
  double t0 = 0;
  int rc;
  r->cur_layer = -1;
  link_floor fl = {.late_anchor = -INFINITY};
  fl.h2d_per_us = r->c->link.h2d_bytes_per_s / 1e6;
  fl.d2h_per_us = r->c->link.d2h_bytes_per_s / 1e6;
  opt_model *o = r->opt;
  weight_model *w = r->w;
  uint32_t tsi = si % t->n_steps;
  if (w) {
    w_tables(r, tsi);
    w->stall = w->d2h = w->h2d = 0;
  }
  int phase = 0; /* forward, backward, after backward_end */
  double done = 0; /* compute so far in this phase */
  if (o) {
    o->grads_issued = 0;
    o->synced = 0;
    o->stall = o->host_wait = 0;
  }
  for (uint32_t k = ts->first; k < ts->end; k++) {
    const trace_ev *ev = &t->events[k];
    if (w && phase < 2 && (rc = w_before_gap(r, k, phase))) return rc;
    if (ev->gap_us > 0 || (timed_from_work(r, ev) && work_us(r, ev) > 0)) {
      if (o && phase == 0 && (rc = opt_forward(r, done, gap_of(r, ev), o->fwd_us[tsi])))
        return rc;
      r->gap_scale = o && phase == 2 ? 1 - o->fraction : 1;
      double us = replay_gap(r, ts, k);
      r->gap_scale = 1;
      floor_compute(&fl, us);
      done += us;
      if (o && phase == 1 && (rc = opt_backward(r, done, o->bwd_us[tsi]))) return rc;
    }
    r->res->events++;
    if (w && (rc = w_before_event(r, k, phase))) return rc;
    if (o && ev->type == TEV_BACKWARD_BEGIN && (rc = opt_params_all(r))) return rc;
    if (o && ev->type == TEV_STEP_END && (rc = opt_step_end(r))) return rc;
    /* whether the tensor went out when packed: read before an unpack, which
     * rewrites it (reloaded or not), and after a pack, which sets it */
    int out = ev->type == TEV_UNPACK || ev->type == TEV_DISCARD ? r->went[ev->tensor] : 0;
    if ((rc = replay_event(r, ev, &t0))) return rc;
    if (w && phase == 0 && (rc = w_after_event(r, k, phase))) return rc;
    if (ev->type == TEV_BACKWARD_BEGIN || ev->type == TEV_BACKWARD_END) {
      phase = ev->type == TEV_BACKWARD_BEGIN ? 1 : 2;
      done = 0;
    }
    if (o && ev->type == TEV_BACKWARD_END && (rc = opt_sync(r))) return rc;
    if (o && ev->type == TEV_STEP_END && (rc = opt_after_step(r))) return rc;
    if (ev->type == TEV_BACKWARD_BEGIN) fl.in_backward = 1;
    if (ev->type == TEV_PACK || ev->type == TEV_UNPACK || ev->type == TEV_DISCARD) {
      const ferry_tensor_desc *d = &t->tensors[ev->tensor].desc;
      int counted = t->tensors[ev->tensor].alias_of < 0 && d->kind != FERRY_KIND_PARAMETER &&
                    d->kind != FERRY_KIND_BUFFER;
      if (ev->type == TEV_PACK) out = r->went[ev->tensor];
      floor_tensor(&fl, ev->type, out, ev->type == TEV_UNPACK && r->went[ev->tensor], counted,
                   (double)d->bytes);
    } else if (ev->type == TEV_ALLOC || ev->type == TEV_FREE) {
      /* transient bytes count as kept ones: on device, never copied */
      floor_tensor(&fl, ev->type == TEV_ALLOC ? TEV_PACK : TEV_DISCARD, 0, 0, 1,
                   (double)t->allocs[ev->tensor].bytes);
    }
  }
  double step_us = replay_now(r) - t0;
  ferry_get_stats(r->e, &s1, sizeof s1);
  double w1, st1 = sim_stall(r, &w1);
  if (r->host) {
    st0 = hs0 / r->host_scale;
    st1 = r->host_stall / r->host_scale;
    w0 = hw0 / r->host_scale;
    w1 = r->host_wait / r->host_scale;
  }
  if (si == 0) r->res->first_step_us = step_us;
  if (r->steady) {
    /* the optimizer's host waits are its own figure, not the activations' */
    add_step(sums, step_us, st1 - st0, w1 - w0 - (o ? o->host_wait : 0), &s0, &s1);
    /* resident-buffer copies: the weights' are counted by the model */
    double wd2h = w ? w->d2h : 0, wh2d = w ? w->h2d : 0;
    if (o) {
      sums->opt_d2h += (double)(s1.resident_bytes_d2h - s0.resident_bytes_d2h) - wd2h;
      sums->opt_h2d += (double)(s1.resident_bytes_h2d - s0.resident_bytes_h2d) - wh2d;
      sums->opt_stall += o->stall;
    }
    if (w) { /* in the step's bytes and stall too */
      sums->d2h += wd2h;
      sums->h2d += wh2d;
      sums->w_d2h += wd2h;
      sums->w_h2d += wh2d;
      sums->w_stall += w->stall;
    }
    sums->pinned += pinned_us(r) - pin0;
    sums->floor += r->host ? 0 : floor_us(&fl, (double)r->peak_steady);
  }
  return 0;
}

/* Says where the compute times come from, plainly when they are not the
 * simulated GPU's. */
static void compute_note(replay *r) {
  sim_result *out = r->res;
  const sim_trace *t = r->t;
  const char *where = t->backend[0] ? t->backend : "unknown";
  double bw = r->c->hbm_bytes_per_s > 0 ? r->c->hbm_bytes_per_s : SIM_DEFAULT_HBM_BYTES_PER_S;
  if (out->gaps_as_recorded == 0 && out->gaps_from_flops > 0 && t->n_hbm > 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "each op timed on the simulated GPU (roofline): its FLOPs at %.1f TFLOP/s, its "
             "bytes at %.0f GB/s of device memory", r->c->tflops, bw / 1e9);
  else if (out->gaps_as_recorded == 0 && out->gaps_from_flops > 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute timed from the trace's FLOPs at %.0f TFLOP/s", r->c->tflops);
  else if (t->has_compute && out->gaps_from_flops == 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute times as synthesized (the synthesizer's --tflops and --hbm: no GPU speed "
             "given)");
  else if (out->gaps_from_flops == 0)
    snprintf(out->compute_note, sizeof out->compute_note,
             "compute times are the recording machine's (backend %s), not the simulated GPU's: "
             "the trace has no FLOPs%s", where,
             !strcmp(where, "host") ? "; recorded on a CPU, so step times and overheads are "
                                      "not this GPU's" : "");
  else
    snprintf(out->compute_note, sizeof out->compute_note,
             "%u compute gaps timed from FLOPs at %.0f TFLOP/s, %u as recorded (backend %s)",
             out->gaps_from_flops, r->c->tflops, out->gaps_as_recorded, where);
}

/* The result: the steady steps' means, peaks, and the engine's counters. */
static void finish_result(replay *r, const step_sums *s) {
  sim_result *out = r->res;
  double n = s->n_steady ? s->n_steady : 1;
  out->step_us = s->step / n;
  out->stall_us = s->stall / n;
  out->host_wait_us = s->wait / n;
  out->bytes_d2h = s->d2h / n;
  out->bytes_h2d = s->h2d / n;
  out->tensors_packed = s->packed / n;
  out->tensors_offloaded = s->off / n;
  out->tensors_kept = s->kept / n;
  out->prefetches = s->pf / n;
  out->stash_hits = s->hits / n;
  out->pinned_alloc_us = s->pinned / n;
  out->stall_floor_us = s->floor / n;
  if (r->opt) {
    out->opt_bytes_d2h = s->opt_d2h / n;
    out->opt_bytes_h2d = s->opt_h2d / n;
    out->opt_stall_us = s->opt_stall / n;
    out->opt_cpu_us = r->opt->cpu_us;
  }
  if (r->w) {
    out->w_bytes_d2h = s->w_d2h / n;
    out->w_bytes_h2d = s->w_h2d / n;
    out->w_stall_us = s->w_stall / n;
  }
  compute_note(r);
  out->warmup = r->warmup;
  out->peak_saved_bytes = r->peak_steady;
  out->peak_device_bytes = r->resident + r->peak_steady;
  out->first_step_peak_device_bytes = r->resident + r->peak_first;
  ferry_stats fs;
  ferry_get_stats(r->e, &fs, sizeof fs);
  out->peak_host_bytes = fs.arena_peak;
  out->host_reserved_bytes = fs.arena_reserved;
  out->policy_errors = fs.policy_errors;
  out->policy_calls = fs.policy_calls;
  out->policy_cache_hits = fs.policy_cache_hits;
  out->cap_fallbacks = fs.cap_fallbacks;
  snprintf(out->policy_error, sizeof out->policy_error, "%s", ferry_last_policy_error(r->e));
}

/* Destroys the engine and frees the buffers the trainer still held (an
 * error stopped the step midway) and the tables. */
static void replay_close(replay *r) {
  w_close(r);
  opt_close(r);
  if (r->e) ferry_engine_destroy(r->e);
  for (uint32_t i = 0; i < r->n_slabs; i++) {
    for (int k = 0; k < BUF_SLAB; k++) free(r->slabs[i][k].mem);
    free(r->slabs[i]);
  }
  free(r->slabs);
  free(r->handles);
  free(r->bufs);
  free(r->went);
  u64map_free(&r->dev_tensor);
  u64map_free(&r->host_offload);
}

/* All steps: an engine error names the label and the trace. */
static int replay_steps(replay *r, uint32_t steps) {
  step_sums sums;
  memset(&sums, 0, sizeof sums);
  double t_start = util_now_us();
  r->host_t0_us = t_start;
  for (uint32_t si = 0; si < steps; si++) {
    int rc = replay_step(r, si, steps, &sums);
    if (rc && r->err_written) return rc;
    if (rc)
      return ferry_errbuf(r->err, r->errlen, rc, "%s: %s (replaying %s)", r->res->label,
                          ferry_last_error(r->e), r->t->name);
    if (r->c->progress) r->c->progress(r->c->progress_ud, si + 1, steps);
  }
  r->res->wall_s = (util_now_us() - t_start) / 1e6;
  r->recording = 0; /* copies finishing at teardown are not the last step's */
  finish_result(r, &sums);
  if (r->bad_bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EBACKEND,
                        "%s: %d unpack(s) gave back different bytes", r->res->label, r->bad_bytes);
  return 0;
}

int sim_replay(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
               size_t errlen) {
  memset(out, 0, sizeof *out);
  if (err && errlen) err[0] = 0;
  if (!t || !c) return ferry_errbuf(err, errlen, FERRY_EINVAL, "sim_replay: NULL trace or config");
  replay r;
  memset(&r, 0, sizeof r);
  r.t = t;
  r.c = c;
  r.res = out;
  r.err = err;
  r.errlen = errlen;
  r.host = c->host_backend != 0;
  r.host_scale = c->host_time_scale > 0 ? c->host_time_scale : 1;
  r.warmup = c->warmup < 0 ? 0 : c->warmup == 0 ? 1 : (uint32_t)c->warmup;
  set_label(out, c);
  snprintf(out->backend, sizeof out->backend, "%s", r.host ? "host" : "sim");
  r.gap_scale = 1;
  int rc = replay_open_engine(&r);
  if (!rc) rc = replay_tables(&r);
  if (!rc) rc = opt_open(&r);
  if (!rc) rc = w_open(&r);
  if (!rc) {
    out->resident_bytes = r.resident;
    out->untracked_bytes = c->untracked_bytes;
    out->steps = c->steps ? c->steps : t->n_steps;
    rc = replay_steps(&r, out->steps);
  }
  replay_close(&r);
  if (rc && rc != FERRY_EBACKEND) sim_result_free(out);
  return rc;
}

int sim_untracked_bytes(const sim_trace *t, const sim_config *c, uint64_t *out,
                        uint64_t *replayed, char *err, size_t errlen) {
  *out = 0;
  if (replayed) *replayed = 0;
  if (!t || !c) return ferry_errbuf(err, errlen, FERRY_EINVAL, "sim_untracked_bytes: NULL argument");
  if (!t->n_device_peaks) return 0;
  /* the recorded run itself: its decisions, its steps, every step's peak,
   * no policy's knobs, nothing added */
  sim_config rc = *c;
  rc.replay_decisions = 1;
  rc.policy_path = rc.policy_source = NULL;
  rc.label = "recorded";
  rc.steps = 0;
  rc.warmup = -1;
  rc.untracked_bytes = 0;
  rc.timeline = rc.record_decisions = 0;
  rc.progress = NULL;
  sim_result r;
  int e = sim_replay(t, &rc, &r, err, errlen);
  if (e) return e;
  uint64_t peak = r.peak_device_bytes > r.first_step_peak_device_bytes
                      ? r.peak_device_bytes : r.first_step_peak_device_bytes;
  sim_result_free(&r);
  if (replayed) *replayed = peak;
  *out = t->device_peak > peak ? t->device_peak - peak : 0;
  return 0;
}
