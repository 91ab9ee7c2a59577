/*
 * replayer.c — sim_replay (ferry_tools.h): drives a read trace through an
 * engine on the sim backend (virtual clock) or the host backend (wall
 * clock), calling ferry_pack/unpack/step/backward exactly as a trainer
 * would, for N steps, and sums up each step into a sim_result.
 */

#include "sim/replay_internal.h"
#include "util/log.h"

/* The replay's clock: virtual on sim, scaled wall time (less the
 * trainer's own work) on host. */
double replay_now(replay *r) {
  if (r->sim) return sim_backend_now(r->sim);
  return (util_now_us() - r->host_t0_us - r->host_excluded_us) / r->host_scale;
}

/* us microseconds of the trainer's compute. */
void replay_compute(replay *r, double us) {
  if (!(us > 0)) return;
  if (r->sim) {
    if (r->mem_bound) sim_backend_advance_memory_bound(r->sim, us);
    else sim_backend_advance(r->sim, us);
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

/* Tensors the engine offloaded so far: one counter read under the lock
 * (ferry_get_stats copies every counter and asks the arena and the policy;
 * this one is its tensors_offloaded, which they do not touch). */
static uint64_t engine_offloaded(ferry_engine *e) {
  engine_lock(e);
  uint64_t n = engine_stats(e)->tensors_offloaded;
  engine_unlock(e);
  return n;
}

/* The sim backend's stall so far (and host wait in *host_wait); 0 on host. */
static double sim_stall(replay *r, double *host_wait) {
  if (!r->sim) {
    *host_wait = 0;
    return 0;
  }
  double stall;
  sim_backend_waits(r->sim, &stall, host_wait);
  return stall;
}

/* The host's timeline (sim, with a host overhead): where the trainer's
 * thread stands when a pack or unpack call returns. It pays half the
 * per-tensor overhead at each; a wait of the host (an event, pinning: the
 * one clock moved for it, its host_wait_us grew past waits_before) brings
 * it up to the clock first. A reload stall makes only the GPU wait. */
static void host_after_call(replay *r, double waits_before) {
  double w;
  sim_stall(r, &w);
  if (w > waits_before && replay_now(r) > r->host_clock) r->host_clock = replay_now(r);
  r->host_clock += r->host_overhead_us / 2;
}

/* Before the GPU runs work the host issues (a kernel, or an event or wait
 * a ferry call records on the compute stream): it cannot start before the
 * host issued it, so while the host is behind the GPU idles. */
static void host_catch_up(replay *r) {
  if (!r->sim || !(r->host_overhead_us > 0)) return;
  double now = replay_now(r);
  if (r->host_clock <= now) return;
  sim_backend_advance(r->sim, r->host_clock - now);
  r->host_bound_us += r->host_clock - now;
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
int timed_from_work(const replay *r, const trace_ev *ev) {
  return r->c->tflops > 0 && (ev->flops >= 0 || ev->hbm_bytes >= 0);
}

/* ev's compute on the simulated GPU (timed_from_work): a roofline, the
 * larger of its FLOPs at the achieved rate and its device-memory bytes at
 * the achieved bandwidth, and at least its min_us (kernel launches). A
 * recorded event carries FLOPs only: flops / rate. */
double work_us(const replay *r, const trace_ev *ev) {
  double us = ev->flops > 0 ? ev->flops / (r->c->tflops * 1e6) : 0;
  if (ev->hbm_bytes > 0) {
    double bw = r->c->hbm_bytes_per_s > 0 ? r->c->hbm_bytes_per_s : SIM_DEFAULT_HBM_BYTES_PER_S;
    double mem = ev->hbm_bytes / bw * 1e6;
    if (mem > us) us = mem;
  }
  return us > ev->min_us ? us : ev->min_us;
}

/* Whether ev's compute is a memory-bound kernel: timed from its work, its
 * device-memory bytes setting its time (not its FLOPs or its least time). */
static int memory_bound(const replay *r, const trace_ev *ev) {
  if (!timed_from_work(r, ev) || !(ev->hbm_bytes > 0)) return 0;
  double bw = r->c->hbm_bytes_per_s > 0 ? r->c->hbm_bytes_per_s : SIM_DEFAULT_HBM_BYTES_PER_S;
  double mem = ev->hbm_bytes / bw * 1e6;
  double flops = ev->flops > 0 ? ev->flops / (r->c->tflops * 1e6) : 0;
  return mem >= flops && mem >= ev->min_us;
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
  /* the interval's start: only the recorded step's timeline asks */
  double a = r->recording ? replay_now(r) : 0, us = event_gap(r, ev) * r->gap_scale;
  r->mem_bound = memory_bound(r, ev);
  comm_compute(r, us);
  r->mem_bound = 0;
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
                                            ev->flops, ev->hbm_bytes, 0});
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
  /* tensors_offloaded moves only in ferry_pack (the offload of a pack),
   * which this function alone calls: as it stood after the last one */
  uint64_t off0 = r->offloaded;
  double a = r->host ? util_now_us() : 0, w0 = 0;
  int host_cost = r->sim && r->host_overhead_us > 0;
  if (host_cost) {
    host_catch_up(r); /* what the call records on the compute stream is where the host is */
    sim_stall(r, &w0);
  }
  /* As ferry.torch packs: a site the policy keeps from its cache gets no
   * handle (the trainer holds the tensor), so its unpack starts no reload */
  int rc = 0;
  r->handles[ti] = 0;
  if (!ferry_pack_cached_keep(r->e, d, buf_ptr(b)))
    rc = ferry_pack(r->e, d, buf_ptr(b), b, NULL, &r->handles[ti]);
  if (r->host) r->host_wait += util_now_us() - a;
  if (host_cost) host_after_call(r, w0);
  if (rc) {
    buf_unref(r, b);
    return rc;
  }
  if (tt->alias_of >= 0 && t->tensors[tt->alias_of].last_alias == (int32_t)ti)
    buf_unref(r, r->bufs[tt->alias_of]); /* the trainer's reference */
  r->offloaded = engine_offloaded(r->e);
  int offloaded = r->offloaded != off0;
  r->went[ti] = (uint8_t)offloaded;
  if (offloaded && r->sim && r->c->pinned_no_pool) sim_backend_pinned_alloc(r->sim, d->bytes);
  if (r->last) count_pack(r, d, offloaded);
  return 0;
}

/* The engine's stash hits so far: one counter read under the lock, where
 * ferry_get_stats copies every counter and asks the arena and the policy. */
static uint64_t stash_hits(ferry_engine *e) {
  engine_lock(e);
  uint64_t hits = engine_stats(e)->stash_hits;
  engine_unlock(e);
  return hits;
}

/* An unpack event: ferry_unpack, its bytes checked on host, its stall counted. */
static int replay_unpack(replay *r, uint32_t ti) {
  const sim_trace *t = r->t;
  int host = r->host;
  r->cur_layer = t->tensors[ti].desc.layer;
  void *dev = NULL, *owner = NULL;
  host_catch_up(r); /* the compute stream's wait is issued where the host is */
  double w, s_before = sim_stall(r, &w);
  /* a stash hit brings nothing back over the link: only asked of tensors
   * that went out */
  uint64_t hits0 = r->went[ti] ? stash_hits(r->e) : 0;
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
  if (r->sim && r->host_overhead_us > 0) host_after_call(r, w);
  /* from here on: whether its bytes came back over the link */
  if (r->went[ti] && stash_hits(r->e) != hits0) r->went[ti] = 0;
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
  /* its op's backward reads it: released after the next compute */
  if (r->n_pending == r->cap_pending) {
    uint32_t cap = r->cap_pending ? 2 * r->cap_pending : 64;
    sim_buf **p = realloc(r->pending, cap * sizeof *p);
    if (!p) {
      buf_unref(r, b);
      r->bufs[ti] = NULL;
      return 0;
    }
    r->pending = p, r->cap_pending = cap;
  }
  r->pending[r->n_pending++] = b;
  r->bufs[ti] = NULL;
  return 0;
}

/* The op's backward ran: autograd lets its saved tensors go. */
static void release_pending(replay *r) {
  for (uint32_t i = 0; i < r->n_pending; i++) buf_unref(r, r->pending[i]);
  r->n_pending = 0;
}

/* A step_end event: ferry_step_end, timed on host. */
static int replay_step_end(replay *r) {
  release_pending(r);
  host_catch_up(r); /* the step's end waits for the host too (.item(), the optimizer) */
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
  case TEV_STEP_END: comm_drain(r); return replay_step_end(r);
  /* transient memory: counted on the device, never seen by the engine (no
   * pack: the trainer frees it itself), so no buffer either */
  case TEV_ALLOC: live_add(r, opt_alloc_bytes(r, &r->t->allocs[ev->tensor])); return 0;
  case TEV_FREE: live_sub(r, opt_alloc_bytes(r, &r->t->allocs[ev->tensor])); return 0;
  case TEV_COLLECTIVE: comm_issue(r, ev->tensor); return 0;
  case TEV_COLLECTIVE_WAIT: comm_wait(r, ev->tensor); return 0;
  default: return 0;
  }
}

/* The next capacity of a full timeline array of cap elements. */
size_t grown(size_t cap) { return cap ? cap * 2 : 256; }

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


/* Host time spent pinning memory so far (sim). */
static double pinned_us(replay *r) {
  if (!r->sim) return 0;
  sim_backend_stats st;
  sim_backend_get_stats(r->sim, &st);
  return st.pinned_alloc_us;
}

/* Compute time added by contention so far (sim). */
static double contention_us(replay *r) {
  if (!r->sim) return 0;
  sim_backend_stats st;
  sim_backend_get_stats(r->sim, &st);
  return st.contention_us;
}

/* The offloads' stall so far as a step reports it: reload stalls and host
 * waits, less the optimizer offload's own waits. */
static double offload_stall(replay *r) {
  double w, st = sim_stall(r, &w);
  return st + w - (r->opt ? r->opt->host_wait : 0);
}

/* The stall floor's time to hide copies behind (docs/sim-model.md, "Stall
 * floor") since at = {clock, offload_stall}: the clock's advance less the
 * offloads' stall in it. The link copies through compute and through the
 * GPU's other waits (for the host, a collective, the weights) alike. */
static void floor_clock(replay *r, link_floor *fl, double at[2]) {
  double now = replay_now(r);
  /* a stall or wait moves the clock with it: none here, so nothing to add */
  if (now == at[0]) return;
  double st = offload_stall(r);
  double us = (now - at[0]) - (st - at[1]);
  if (us > 0) floor_compute(fl, us);
  at[0] = now, at[1] = st;
}

/* Replays step si of steps (the trace's steps in a loop) and sums it up. */
static int replay_step(replay *r, uint32_t si, uint32_t steps, step_sums *sums) {
  memset(sums, 0, sizeof *sums);
  const sim_trace *t = r->t;
  const trace_step *ts = &t->steps[si % t->n_steps];
  r->last = si + 1 == steps;
  r->recording = r->last && r->c->timeline;
  r->first = si == 0;
  r->step_peak = r->live_bytes;
  r->peak_ev = UINT32_MAX;
  if (r->last) begin_last_step(r, ts);
  ferry_stats s0, s1;
  ferry_get_stats(r->e, &s0, sizeof s0);
  double w0, st0 = sim_stall(r, &w0);
  double hs0 = r->host_stall, hw0 = r->host_wait;
  double pin0 = pinned_us(r), cont0 = contention_us(r), hb0 = r->host_bound_us;
  r->host_clock = replay_now(r);
  const comm_model *cm = r->comm;
  const double cm0[4] = {cm ? cm->count : 0, cm ? cm->bytes : 0, cm ? cm->busy_us : 0,
                         cm ? cm->exposed_us : 0};
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
  double fl_at[2] = {replay_now(r), offload_stall(r)};
  for (uint32_t k = ts->first; k < ts->end; k++) {
    const trace_ev *ev = &t->events[k];
    r->cur_ev = k, r->cur_phase = phase;
    if (w && phase < 2 && (rc = w_before_gap(r, k, phase))) return rc;
    if (ev->gap_us > 0 || (timed_from_work(r, ev) && work_us(r, ev) > 0)) {
      if (o && phase == 0 && (rc = opt_forward(r, done, gap_of(r, ev), o->fwd_us[tsi])))
        return rc;
      r->gap_scale = o && phase == 2 ? 1 - o->fraction : 1;
      host_catch_up(r);
      double us = replay_gap(r, ts, k);
      r->gap_scale = 1;
      release_pending(r);
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
    floor_clock(r, &fl, fl_at);
    if (ev->type == TEV_BACKWARD_BEGIN) fl.in_backward = 1;
    if (ev->type == TEV_PACK || ev->type == TEV_UNPACK || ev->type == TEV_DISCARD) {
      const ferry_tensor_desc *d = &t->tensors[ev->tensor].desc;
      int counted = t->tensors[ev->tensor].alias_of < 0 && d->kind != FERRY_KIND_PARAMETER &&
                    d->kind != FERRY_KIND_BUFFER;
      if (ev->type == TEV_PACK) out = r->went[ev->tensor];
      floor_tensor(&fl, ev->type, out, ev->type == TEV_UNPACK && r->went[ev->tensor], counted,
                   (double)d->bytes);
    } else if (ev->type == TEV_ALLOC || ev->type == TEV_FREE) {
      /* transient bytes count as kept ones: on device, never copied; as
       * many as the device holds (the optimizer offload's share of the
       * optimizer step's own is on the host) */
      fl.no_instant = fl.in_backward && fl.bwd_out_unpacks > 0;
      floor_tensor(&fl, ev->type == TEV_ALLOC ? TEV_PACK : TEV_DISCARD, 0, 0, 1,
                   (double)opt_alloc_bytes(r, &t->allocs[ev->tensor]));
      fl.no_instant = 0;
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
  {
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
    if (cm) {
      sums->comm_n = cm->count - cm0[0];
      sums->comm_bytes = cm->bytes - cm0[1];
      sums->comm_us = cm->busy_us - cm0[2];
      sums->comm_exposed = cm->exposed_us - cm0[3];
    }
    sums->contention += contention_us(r) - cont0;
    sums->host_bound += r->host_bound_us - hb0;
    sums->floor += r->host ? 0 : floor_us(&fl, (double)r->step_peak);
  }
  sums->peak = r->step_peak;
  sums->grew = s1.arena_reserved > s0.arena_reserved;
  if (r->last) peak_where(r);
  return 0;
}

/* Destroys the engine and frees the buffers the trainer still held (an
 * error stopped the step midway) and the tables. */
static void replay_close(replay *r) {
  comm_close(r);
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
  free(r->pending);
  free(r->per_step);
  u64map_free(&r->dev_tensor);
  u64map_free(&r->host_offload);
}

/* All steps: an engine error names the label and the trace. */
static int replay_steps(replay *r, uint32_t steps) {
  step_sums sums;
  memset(&sums, 0, sizeof sums);
  double t_start = util_now_us();
  r->host_t0_us = t_start;
  if (!(r->per_step = calloc(steps, sizeof *r->per_step)))
    return ferry_errbuf(r->err, r->errlen, FERRY_ENOMEM, "%s: out of memory", r->res->label);
  for (uint32_t si = 0; si < steps; si++) {
    int rc = replay_step(r, si, steps, &r->per_step[si]);
    if (rc && r->err_written) return rc;
    if (rc)
      return ferry_errbuf(r->err, r->errlen, rc, "%s: %s (replaying %s)", r->res->label,
                          ferry_last_error(r->e), r->t->name);
    if (r->c->progress) r->c->progress(r->c->progress_ud, si + 1, steps);
  }
  r->res->wall_s = (util_now_us() - t_start) / 1e6;
  r->recording = 0; /* copies finishing at teardown are not the last step's */
  steady_sums(r, steps, &sums);
  finish_result(r, &sums);
  if (r->bad_bytes)
    return ferry_errbuf(r->err, r->errlen, FERRY_EBACKEND,
                        "%s: %d unpack(s) gave back different bytes", r->res->label, r->bad_bytes);
  return 0;
}

/* The same replay at the compute rate x (1 -+ mfu_sensitivity): the two
 * steady step times into out->sens_*. Each is a full replay (the overheads
 * are not linear in the rate: what hides behind compute at one rate is
 * exposed at a faster one), its policy's log lines and warnings muted: the
 * first replay has said them. */
static int replay_sensitivity(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
                              size_t errlen) {
  int was_quiet = util_log_quiet(1);
  int rc = 0;
  for (int k = 0; k < 2 && !rc; k++) {
    sim_config cc = *c;
    cc.mfu_sensitivity = 0;
    cc.timeline = cc.record_decisions = 0;
    cc.progress = NULL;
    cc.tflops = c->tflops * (k ? 1 + c->mfu_sensitivity : 1 - c->mfu_sensitivity);
    sim_result r;
    rc = sim_replay(t, &cc, &r, err, errlen);
    if (rc) break;
    out->sens_tflops[k] = cc.tflops;
    out->sens_step_us[k] = r.step_us;
    out->replays += r.replays;
    sim_result_free(&r);
  }
  util_log_quiet(was_quiet);
  return rc;
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
  if (c->policy_path || c->policy_source || c->replay_decisions)
    r.host_overhead_us = c->host_overhead_us > 0 ? c->host_overhead_us : 0;
  int rc = replay_open_engine(&r);
  if (!rc) rc = replay_tables(&r);
  if (!rc) rc = opt_open(&r);
  if (!rc) rc = w_open(&r);
  if (!rc) rc = comm_open(&r);
  if (!rc) {
    out->resident_bytes = r.resident;
    out->untracked_bytes = c->untracked_bytes;
    out->steps = c->steps ? c->steps : t->n_steps;
    rc = replay_steps(&r, out->steps);
  }
  replay_close(&r);
  if (!rc) out->replays = 1;
  if (!rc && c->mfu_sensitivity > 0 && c->mfu_sensitivity < 1 && c->tflops > 0 &&
      out->gaps_from_flops > 0)
    rc = replay_sensitivity(t, c, out, err, errlen);
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
