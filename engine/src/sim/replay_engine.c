/*
 * replay_engine.c — the engine a replay drives and the device it runs on:
 * the timeline of intervals, device buffers (sim_buf) and their live bytes,
 * the allocator and recorder callbacks handed to ferry, and the engine's
 * creation on the sim or host backend. replayer.c drives it, step by step.
 */

#include "sim/replay_internal.h"
#include "util/log.h"

/* Appends an interval (compute or copy) to the timeline. */
int timeline_push(sim_timeline *tl, sim_interval iv) {
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
void mem_sample(replay *r) {
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
int map_set(u64map *m, const void *key, uint32_t val) {
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
  sim_interval iv = {t0, t1, bytes, 1 + dir, -1, 0, 0, NULL, -1, -1, 0};
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
  /* a saved tensor's reload goes on the offloads' stream under the knob
   * (stash_reload_stream); the weights' and the optimizer's have their own */
  if (dir == 1 && r->one_copy_stream && !weights && (iv.tensor || !iv.module_path))
    iv.one_stream = 1;
  timeline_push(tl, iv);
}

/* Device bytes in use besides resident memory (saved tensors and transient
 * allocations) grow by bytes: the peaks follow. */
void live_add(replay *r, uint64_t bytes) {
  r->live_bytes += bytes;
  if (r->last && r->live_bytes > r->step_peak) r->peak_ev = r->cur_ev, r->peak_phase = r->cur_phase;
  if (r->live_bytes > r->peak_live) r->peak_live = r->live_bytes;
  if (r->live_bytes > r->step_peak) r->step_peak = r->live_bytes;
  if (r->first && r->live_bytes > r->peak_first) r->peak_first = r->live_bytes;
  mem_sample(r);
}

void live_sub(replay *r, uint64_t bytes) {
  r->live_bytes -= bytes;
  mem_sample(r);
}

/* A trainer buffer (from a slab; real bytes on host), counted or not. */
sim_buf *buf_new(replay *r, uint64_t bytes, int counted) {
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
void buf_unref(replay *r, sim_buf *b) {
  if (--b->refs) return;
  if (b->counted) live_sub(r, b->bytes);
  free(b->mem);
  b->mem = NULL;
  b->next_free = r->free_bufs;
  r->free_bufs = b;
}

/* The device pointer ferry sees for a buffer. */
void *buf_ptr(sim_buf *b) { return b->mem ? (void *)b->mem : (void *)b; }

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

int replay_open_engine(replay *r) {
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
  ferry_knobs k;
  if (ferry_get_knobs(r->e, &k, sizeof k) == FERRY_OK) r->one_copy_stream = k.one_copy_stream != 0;
  r->res->tl.one_stream = r->one_copy_stream;
  sim_backend_set_listener(r->sim, on_copy, r);
  if ((rc = sim_backend_set_pinned_cost(r->sim, c->pinned_alloc_us, c->pinned_touch_bytes_per_s,
                                             !c->pinned_no_pool)))
    return ferry_errbuf(r->err, r->errlen, rc, "%s", r->sim->err);
  if ((c->host_mem_bytes_per_s > 0 || c->contention_hbm_bytes_per_s > 0) &&
      (rc = sim_backend_set_node(r->sim, c->host_mem_bytes_per_s, c->contention_hbm_bytes_per_s)))
    return ferry_errbuf(r->err, r->errlen, rc, "%s", r->sim->err);
  if ((c->duplex_d2h > 0 || c->duplex_h2d > 0) &&
      (rc = sim_backend_set_duplex(r->sim, c->duplex_d2h > 0 ? c->duplex_d2h : cfg.link.duplex,
                                   c->duplex_h2d > 0 ? c->duplex_h2d : cfg.link.duplex)))
    return ferry_errbuf(r->err, r->errlen, rc, "%s", r->sim->err);
  return 0;
}
