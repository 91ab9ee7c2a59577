/*
 * stash.c — the stash manager: pack, unpack, prefetch, discard and step
 * boundaries.
 * How it works: docs/internals.md#stashc.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/engine_internal.h"
#include "util/u64map.h"
#include "util/util.h"

#define HANDLE_INDEX_MASK 0xffffffffull
#define MAX_TENSOR_BYTES (1ull << 50) /* 1 PiB: anything larger is a bug */
#define MAX_LAYER_INDEX 1000000
#define RELEASE_BATCH 16

/* ---- small containers ------------------------------------------------------ */
/* Room for need elements in a stash array (64 at first). */
static int grow(void **arr, uint32_t *cap, size_t elem, uint32_t need) {
  return util_grow(arr, cap, elem, need, 64);
}

/* ---- entries ---------------------------------------------------------------- */
static inline ferry_handle make_handle(const ferry_engine *e, uint32_t idx) {
  return ((uint64_t)e->entries[idx].gen << 32) | (uint64_t)(idx + 1);
}

/* Index of a live, not yet consumed handle, or -1. */
static int64_t lookup(const ferry_engine *e, ferry_handle h) {
  uint64_t low = h & HANDLE_INDEX_MASK;
  if (!low || low > e->n_entries) return -1;
  uint32_t idx = (uint32_t)(low - 1);
  const stash_entry *s = &e->entries[idx];
  if (s->gen != (uint32_t)(h >> 32) || s->state == ENTRY_FREE || s->consumed) return -1;
  return idx;
}

static int entry_new(ferry_engine *e, uint32_t *idx) {
  if (e->n_free) {
    *idx = e->free_slots[--e->n_free];
  } else {
    if (e->n_entries == UINT32_MAX - 1) return FERRY_ENOMEM;
    uint32_t old_cap = e->cap_entries;
    /* each entry on its own cache line (stash_entry is 64 bytes) */
    if (util_grow_aligned((void **)&e->entries, &e->cap_entries, sizeof *e->entries,
                          e->n_entries + 1, 64, 64))
      return FERRY_ENOMEM;
    if (e->cap_entries != old_cap) {
      stash_cold *c = realloc(e->cold, (size_t)e->cap_entries * sizeof *c);
      if (!c) {
        e->cap_entries = old_cap; /* entries stays larger: harmless */
        return FERRY_ENOMEM;
      }
      e->cold = c;
    }
    /* free_slots can never hold more than cap_entries indices */
    uint32_t fcap = e->cap_entries;
    uint32_t *f = realloc(e->free_slots, (size_t)fcap * sizeof *f);
    if (!f) return FERRY_ENOMEM;
    e->free_slots = f;
    *idx = e->n_entries++;
    e->entries[*idx].gen = 1;
  }
  stash_entry *s = &e->entries[*idx];
  uint32_t gen = s->gen;
  memset(s, 0, sizeof *s);
  memset(&e->cold[*idx], 0, sizeof e->cold[*idx]);
  s->gen = gen;
  s->layer = -1;
  s->offload_index = UINT32_MAX;
  e->stats.live_handles++;
  return FERRY_OK;
}

static void entry_free(ferry_engine *e, uint32_t idx) {
  stash_entry *s = &e->entries[idx];
  s->state = ENTRY_FREE;
  s->gen = s->gen + 1 ? s->gen + 1 : 1;
  e->free_slots[e->n_free++] = idx;
}

/* ---- forward stash ------------------------------------------------------------ */
static int fwd_push(ferry_engine *e, uint32_t idx) {
  if (e->fwd_count == e->fwd_cap) {
    uint32_t ncap = e->fwd_cap ? e->fwd_cap * 2 : 64;
    uint64_t *n = malloc((size_t)ncap * sizeof *n);
    if (!n) return -1;
    for (uint32_t i = 0; i < e->fwd_count; i++) n[i] = e->fwd[(e->fwd_head + i) % e->fwd_cap];
    free(e->fwd);
    e->fwd = n;
    e->fwd_cap = ncap;
    e->fwd_head = 0;
  }
  e->fwd[(e->fwd_head + e->fwd_count) % e->fwd_cap] = ((uint64_t)e->entries[idx].gen << 32) | idx;
  e->fwd_count++;
  return 0;
}

/* Release a STASHED entry's device buffer once its D2H copy completed.
 * Returns the owner the caller must release after unlocking. */
static void *stash_release(ferry_engine *e, uint32_t idx) {
  stash_entry *s = &e->entries[idx];
  if (e->bk->ops->event_query(e->bk, s->ev) != 1) {
    double t0 = obs_calls(e) ? util_now_us() : 0;
    e->stats.waits++;
    e->bk->ops->event_synchronize(e->bk, s->ev);
    if (obs_calls(e)) obs_wait(e, "wait for offload (stash bound)", t0);
  }
  if (obs_calls(e)) obs_copy(e, OBS_COPY_OBSERVED, 0, s, s->host, 0);
  void *owner = cold_of(e, s)->owner;
  if (s->in_alias_map) u64map_remove(&e->aliases, (uintptr_t)s->dev_ptr);
  s->in_alias_map = 0;
  cold_of(e, s)->owner = NULL;
  s->dev_ptr = NULL;
  s->state = ENTRY_OFFLOADED;
  e->stats.device_bytes_held -= s->bytes;
  e->ctx.stash_depth--;
  e->fwd_bytes -= s->bytes;
  e->bytes_in_flight -= s->bytes;
  return owner;
}

static int fwd_over_bound(const ferry_engine *e) {
  return e->ctx.stash_depth > e->max_fwd_stash ||
         (e->max_fwd_stash_bytes && e->fwd_bytes > e->max_fwd_stash_bytes);
}

/* Whether the oldest stash slot can go without waiting: a stale slot, or
 * an entry whose D2H copy has completed (copies complete in issue order on
 * the D2H stream, so the head is the first to finish). */
static int fwd_head_done(ferry_engine *e) {
  uint64_t slot = e->fwd[e->fwd_head];
  const stash_entry *s = &e->entries[(uint32_t)slot];
  if (s->gen != (uint32_t)(slot >> 32) || s->state != ENTRY_STASHED) return 1;
  return e->bk->ops->event_query(e->bk, s->ev) == 1;
}

/* Pop the oldest stashed entries until the bounds (count, bytes) hold, and
 * with release_when_copied (config or policy knob) then those whose copies have completed:
 * in the forward pass a device buffer goes at the first pack after its
 * bytes are on the host, not only when the bound pushes it out, so it is
 * off the device at the peak (the end of forward); the price is that the
 * last-packed tensors are no longer stash hits in backward. Nothing is
 * released at backward_begin: the tensors still
 * stashed then are the last packed, the first backward needs, and
 * releasing them only adds reloads (3x the stall in
 * sim_replay_matches_hand_computed_times). */
static uint32_t fwd_enforce_bound(ferry_engine *e, void **owners, uint32_t max_owners) {
  uint32_t n = 0;
  while (e->fwd_count && n < max_owners &&
         (fwd_over_bound(e) || (e->release_when_copied && fwd_head_done(e)))) {
    uint64_t slot = e->fwd[e->fwd_head];
    uint32_t idx = (uint32_t)slot;
    e->fwd_head = (e->fwd_head + 1) % e->fwd_cap;
    e->fwd_count--;
    /* Entries unpacked while stashed are skipped lazily; their slot may
     * already hold a newer entry, which its own ring position stands for. */
    if (e->entries[idx].gen != (uint32_t)(slot >> 32) || e->entries[idx].state != ENTRY_STASHED)
      continue;
    owners[n++] = stash_release(e, idx);
  }
  if (!e->ctx.stash_depth) e->fwd_head = e->fwd_count = 0;
  return n;
}

static void release_all(ferry_engine *e, void **owners, uint32_t n) {
  for (uint32_t i = 0; i < n; i++) e->cfg.release(e->cfg.callback_ud, owners[i]);
}

/* ---- steps -------------------------------------------------------------------- */
/* Percent of host RAM in use (not available), 0 if it cannot be read. */
static double host_ram_used_pct(ferry_engine *e) {
  uint64_t total = 0, avail = 0;
  if (e->cfg.host_ram(e->cfg.host_ram_ud, &total, &avail) || !total || avail > total) return 0;
  return 100.0 * (double)(total - avail) / (double)total;
}

static void step_begin_locked(ferry_engine *e) {
  e->in_step = 1;
  e->step++;
  e->stats.steps++;
  e->phase = FERRY_PHASE_FORWARD;
  e->ctx.step = e->step;
  e->ctx.packed_this_step = 0;
  e->ctx.offloaded_this_step = 0;
  e->ctx.bytes_offloaded_this_step = 0;
  /* read only for whom reads it: a C decide callback, or a policy that has
   * read it before (a policy's first read samples it itself) */
  e->ctx.host_ram_used_pct =
      e->cfg.decide || ferry_policy_reads_host_ram(e->policy) ? host_ram_used_pct(e) : NAN;
  if (e->layer_counts) memset(e->layer_counts, 0, e->cap_layers * sizeof *e->layer_counts);
  e->n_offloads = 0;
  e->prefetch_lo = e->prefetch_hi = 0;
  if (e->policy) ferry_policy_step_begin(e->policy, &e->ctx);
  if (e->n_obs) stash_notify(e, &(obs_event){.kind = OBS_STEP_BEGIN});
}

int ferry_step_begin(ferry_engine *e) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  if (e->in_step)
    rc = engine_fail(e, FERRY_ESTATE, "ferry_step_begin: step %llu has not ended",
                     (unsigned long long)e->step);
  else
    step_begin_locked(e);
  pthread_mutex_unlock(&e->lock);
  return rc;
}

/* Handles packed in this step and still live, and the arena bytes of this
 * step's packs they hold. Handles of earlier steps used or left meanwhile do
 * not count: a count net of them would hide a leak behind a discard. */
static uint64_t step_leaks(const ferry_engine *e, uint64_t *arena_bytes) {
  uint64_t n = 0, bytes = 0;
  if (!e->stats.live_handles) return *arena_bytes = 0;
  for (uint32_t i = 0; i < e->n_entries; i++) {
    const stash_entry *s = &e->entries[i];
    if (s->state == ENTRY_FREE || s->step != e->step) continue;
    n += !s->consumed; /* an alias slot is freed when used */
    if (s->state != ENTRY_ALIAS && s->host) bytes += s->bytes;
  }
  *arena_bytes = bytes;
  return n;
}

int ferry_step_end(ferry_engine *e) {
  int rc = engine_check(e);
  if (rc) return rc;
  double t0 = obs_calls(e) ? util_now_us() : 0;
  pthread_mutex_lock(&e->lock);
  if (!e->in_step) {
    rc = engine_fail(e, FERRY_ESTATE, "ferry_step_end: no step in progress");
  } else {
    pending_drain(e);
    e->in_step = 0;
    e->phase = FERRY_PHASE_FORWARD;
    if (e->n_obs) stash_notify(e, &(obs_event){.kind = OBS_STEP_END, .t0 = t0});
    uint64_t leaked_bytes, n = step_leaks(e, &leaked_bytes);
    if (n)
      rc = engine_fail(e, FERRY_ELEAK,
                       "step %llu ended with %llu handle(s) neither unpacked nor discarded; "
                       "they stay valid and hold %llu arena bytes",
                       (unsigned long long)e->step, (unsigned long long)n,
                       (unsigned long long)leaked_bytes);
  }
  pthread_mutex_unlock(&e->lock);
  return rc;
}

static void prefetch_next(ferry_engine *e, uint32_t mark, uint64_t step, void *compute_stream);

static int set_phase(ferry_engine *e, int phase, const char *ev, void *compute_stream) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  /* Refused before a step is started: a refused call changes nothing. */
  if ((e->in_step ? e->phase : FERRY_PHASE_FORWARD) == phase) {
    rc = engine_fail(e, FERRY_ESTATE, "ferry_%s: %s", ev,
                     phase == FERRY_PHASE_BACKWARD ? "already in backward"
                                                   : "without ferry_backward_begin");
    pthread_mutex_unlock(&e->lock);
    return rc;
  }
  if (!e->in_step) step_begin_locked(e);
  e->phase = phase;
  e->ctx.phase = phase;
  if (e->n_obs) stash_notify(e, &(obs_event){.kind = OBS_PHASE, .what = ev});
  /* Backward needs the last offloaded tensors first: with the policy's
   * prefetch, their reloads start now rather than at the first unpack. */
  if (phase == FERRY_PHASE_BACKWARD && e->cfg.prefetch_at_backward_begin)
    prefetch_next(e, e->n_offloads, e->step, compute_stream);
  pthread_mutex_unlock(&e->lock);
  return FERRY_OK;
}

int ferry_backward_begin(ferry_engine *e) {
  return set_phase(e, FERRY_PHASE_BACKWARD, "backward_begin", NULL);
}
int ferry_backward_begin_on(ferry_engine *e, void *compute_stream) {
  return set_phase(e, FERRY_PHASE_BACKWARD, "backward_begin", compute_stream);
}
int ferry_backward_end(ferry_engine *e) {
  return set_phase(e, FERRY_PHASE_FORWARD, "backward_end", NULL);
}

/* ---- pack --------------------------------------------------------------------- */
static int desc_invalid(ferry_engine *e, const ferry_tensor_desc *d) {
  if (d->bytes == 0) return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.bytes is 0");
  if (d->bytes > MAX_TENSOR_BYTES)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.bytes %llu is absurd (max 2^50)",
                       (unsigned long long)d->bytes);
  if (d->ndim < 0 || d->ndim > FERRY_MAX_DIMS)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.ndim %d is outside [0, %d]", d->ndim,
                       FERRY_MAX_DIMS);
  if (d->kind < FERRY_KIND_ACTIVATION || d->kind > FERRY_KIND_OTHER)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.kind %d is not a ferry_kind", d->kind);
  if (d->dtype < 0 || d->dtype >= FERRY_DTYPE_COUNT_)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.dtype %d is not a ferry_dtype",
                       d->dtype);
  if (d->phase < FERRY_PHASE_FORWARD || d->phase > FERRY_PHASE_BACKWARD)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.phase %d is not a ferry_phase",
                       d->phase);
  if (d->layer < -1 || d->layer > MAX_LAYER_INDEX)
    return engine_fail(e, FERRY_EINVAL, "ferry_pack: desc.layer %d is outside [-1, %d]",
                       d->layer, MAX_LAYER_INDEX);
  return FERRY_OK;
}

/* ---- what the stash tells its observers (engine_internal.h) ---------------- */
static inline int want_reasons(const ferry_engine *e) {
  return __builtin_expect((e->obs_wants & OBS_REASONS) != 0, 0);
}

/* the reason of an engine-level outcome (no policy call, or overruled) */
static void reason_set(ferry_engine *e, const char *rule) {
  snprintf(e->why.rule, sizeof e->why.rule, "%s", rule);
  e->why.where[0] = 0;
}

/* when a call began (out of line: the untraced path holds no clock code) */
__attribute__((cold, noinline)) static double now_cold(void) { return util_now_us(); }

/* A pack's slice, once the stash bound's releases are done (they are part
 * of the call): the handle at entry idx is not back to its caller yet, so
 * the entry is still there. Takes the lock. */
__attribute__((cold, noinline)) static void pack_done(ferry_engine *e, double t0, uint32_t idx) {
  pthread_mutex_lock(&e->lock);
  stash_notify(e, &(obs_event){.kind = OBS_PACK_DONE, .idx = idx, .t0 = t0});
  pthread_mutex_unlock(&e->lock);
}

/* what an unpack's slice says of primary entry p, before it is consumed */
__attribute__((cold, noinline)) static void unpack_info(const ferry_engine *e, uint32_t p,
                                                        uint64_t tensor, obs_tensor *t,
                                                        const char **found) {
  const stash_entry *s = &e->entries[p];
  *t = obs_tensor_of(e, s, tensor);
  *found = s->state == ENTRY_KEPT       ? "kept"
           : s->state == ENTRY_STASHED  ? "stash hit"
           : s->state == ENTRY_RELOADED ? "prefetched"
                                        : "reloaded";
}

static int decision_valid(const ferry_decision *d) {
  return (d->action == FERRY_KEEP || d->action == FERRY_OFFLOAD) &&
         (d->reload == FERRY_RELOAD_ON_USE || d->reload == FERRY_RELOAD_PREFETCH) &&
         d->prefetch_distance >= -1 && d->prefetch_distance <= 4096;
}

static void decide(ferry_engine *e, const ferry_tensor_desc *desc, ferry_decision *d) {
  d->action = FERRY_KEEP;
  d->reload = FERRY_RELOAD_ON_USE;
  d->prefetch_distance = -1;
  d->cacheable = 0;
  if (desc->bytes < e->min_offload_bytes) {
    if (want_reasons(e)) reason_set(e, "min_offload_bytes");
    return;
  }
  e->ctx.bytes_in_flight = e->bytes_in_flight;
  e->ctx.offloaded_per_layer = e->layer_counts;
  e->ctx.layers_tracked = e->cap_layers;
  if (e->policy) {
    /* never fail; explain also names the rule (config.count_reasons) */
    if (want_reasons(e))
      ferry_policy_explain(e->policy, desc, &e->ctx, d, &e->why);
    else
      ferry_policy_decide(e->policy, desc, &e->ctx, d);
  } else {
    if (want_reasons(e)) reason_set(e, e->decide ? "decide callback" : "no policy");
    if (e->decide && (e->decide(e->decide_ud, desc, &e->ctx, d) != 0 || !decision_valid(d))) {
      e->stats.policy_errors++;
      d->action = FERRY_KEEP;
      if (want_reasons(e)) reason_set(e, "fault");
    }
  }
  if (!decision_valid(d)) {
    e->stats.policy_errors++;
    d->action = FERRY_KEEP;
    if (want_reasons(e)) reason_set(e, "fault");
  }
}

static void count_layer(ferry_engine *e, int32_t layer) {
  if (layer < 0) return;
  if ((uint32_t)layer >= e->cap_layers) {
    uint32_t ncap = e->cap_layers ? e->cap_layers : 64;
    while (ncap <= (uint32_t)layer) ncap *= 2;
    uint32_t *n = realloc(e->layer_counts, ncap * sizeof *n);
    if (!n) return;
    memset(n + e->cap_layers, 0, (ncap - e->cap_layers) * sizeof *n);
    e->layer_counts = n;
    e->cap_layers = ncap;
  }
  e->layer_counts[layer]++;
}

/* Issue the D2H copy of entry idx. 0, or a backend error (nothing issued
 * that could still touch the buffers if the copy itself failed). */
static int issue_d2h(ferry_engine *e, stash_entry *s, void *compute_stream) {
  const ferry_backend_ops *o = e->bk->ops;
  int rc;
  if (!(rc = o->event_record(e->bk, e->ev_scratch, compute_stream)) &&
      !(rc = o->stream_wait_event(e->bk, e->d2h, e->ev_scratch))) {
    if (obs_calls(e)) obs_copy(e, OBS_COPY_ISSUE, 0, s, s->host, 0);
    rc = o->copy_d2h(e->bk, s->host, s->dev_ptr, s->bytes, e->d2h);
    if (rc && obs_calls(e)) obs_copy(e, OBS_COPY_UNISSUE, 0, s, s->host, 0);
    if (!rc) rc = o->event_record(e->bk, s->ev, e->d2h);
    if (!rc) rc = stash_sync_copy(e, s->ev, compute_stream);
  }
  if (rc) {
    engine_fail(e, rc, "offload copy failed, tensor kept on device: %s", e->bk->err);
    /* The copy may be enqueued without an event after it: drain the stream
     * before the host buffer goes back. */
    o->stream_synchronize(e->bk, e->d2h);
    return rc;
  }
  return FERRY_OK;
}

/* Pack of a buffer already stored (retain): an alias entry of its primary,
 * one copy for both handles. Called locked. */
static int pack_alias(ferry_engine *e, const ferry_tensor_desc *desc, uint32_t pidx,
                      ferry_handle *out) {
  uint32_t idx;
  int rc = entry_new(e, &idx);
  if (rc) return rc;
  stash_entry *a = &e->entries[idx];
  a->state = ENTRY_ALIAS;
  a->primary = pidx;
  a->bytes = desc->bytes;
  a->step = e->step;
  if (e->obs_wants & OBS_NUMBERS) e->cold[idx].trace_id = ++e->trace_seq;
  e->entries[pidx].refs++;
  e->stats.tensors_packed++;
  e->stats.tensors_aliased++;
  e->ctx.packed_this_step++;
  *out = make_handle(e, idx);
  if (e->n_obs)
    stash_notify(e, &(obs_event){.kind = OBS_PACK, .idx = idx, .desc = desc, .aliased = 1,
                                 .entry = &e->entries[pidx]});
  return FERRY_OK;
}

/* A decision to offload entry idx: arena buffer, D2H copy, forward stash.
 * On any failure nothing is lost: the tensor stays on device (KEPT). */
static void pack_offload(ferry_engine *e, uint32_t idx, const ferry_decision *d,
                         void *compute_stream) {
  stash_entry *s = &e->entries[idx];
  if (e->cfg.host_reserve) {
    /* The arena may grow, which asks host_reserve: never with the engine
     * lock held (ferry.h). The entry has no handle out yet; other threads
     * may move the entries array meanwhile. */
    uint64_t bytes = s->bytes;
    pthread_mutex_unlock(&e->lock);
    void *host = ferry_arena_alloc(e->arena, (size_t)bytes);
    pthread_mutex_lock(&e->lock);
    s = &e->entries[idx];
    s->host = host;
  } else {
    s->host = ferry_arena_alloc(e->arena, (size_t)s->bytes);
  }
  if (!s->host) {
    e->stats.cap_fallbacks++;
  } else if (event_get(e, &s->ev) || issue_d2h(e, s, compute_stream) || fwd_push(e, idx) ||
             grow((void **)&e->offload_order, &e->cap_offloads, sizeof *e->offload_order,
                  e->n_offloads + 1)) {
    /* A copy that was issued may still read the device buffer and write
     * the host one. */
    e->ctx.arena_in_use += s->bytes;
    host_buffer_drop(e, s, 1);
  } else {
    s->state = ENTRY_STASHED;
    s->reload = (uint8_t)d->reload;
    s->prefetch_distance = (uint16_t)(d->prefetch_distance >= 0 ? (uint32_t)d->prefetch_distance
                                                                 : e->prefetch_distance);
    s->offload_index = e->n_offloads;
    e->offload_order[e->n_offloads++] = idx;
    e->ctx.arena_in_use += s->bytes;
    e->ctx.stash_depth++;
    e->fwd_bytes += s->bytes;
    e->ctx.offloaded_this_step++;
    e->ctx.bytes_offloaded_this_step += s->bytes;
    e->bytes_in_flight += s->bytes;
    e->stats.tensors_offloaded++;
    e->stats.bytes_d2h += s->bytes;
    count_layer(e, s->layer);
  }
}

/* ferry_pack_keyed's identity of the packed bytes; NULL for ferry_pack. */
typedef struct alias_key { uint64_t storage; int64_t version; } alias_key;

/* Whether a pack of desc's bytes (key: NULL for ferry_pack) is primary
 * p's bytes: a keyed pack must also name p's storage and version, so an
 * address that was written in place, or freed and reused, is not aliased. */
static int alias_matches(const ferry_engine *e, const stash_entry *p,
                         const ferry_tensor_desc *desc, const alias_key *key) {
  if (p->bytes != desc->bytes || p->keyed != (key != NULL)) return 0;
  const stash_cold *c = cold_of(e, p);
  return !key || (c->alias_storage == key->storage && c->alias_version == key->version);
}

/* A new primary entry for a pack, decided and (if so) offloaded; its
 * counters and alias-map slot. Called locked. */
static int pack_new(ferry_engine *e, const ferry_tensor_desc *desc, void *device_ptr, void *owner,
                    void *compute_stream, const alias_key *key, uint32_t *out_idx) {
  ferry_decision d;
  decide(e, desc, &d);
  uint32_t idx, pidx;
  int rc = entry_new(e, &idx);
  if (rc) return rc;
  stash_entry *s = &e->entries[idx];
  s->bytes = desc->bytes;
  s->dev_ptr = device_ptr;
  e->cold[idx].owner = owner;
  s->layer = desc->layer;
  s->step = e->step;
  s->refs = 1;
  if (e->obs_wants & OBS_NUMBERS) {
    e->cold[idx].trace_id = ++e->trace_seq;
    if (obs_calls(e) && desc->module_path)
      e->cold[idx].module_path = intern_get(&e->interned, desc->module_path);
  }
  if (key) {
    s->keyed = 1;
    e->cold[idx].alias_storage = key->storage;
    e->cold[idx].alias_version = key->version;
  }
  s->state = ENTRY_KEPT;
  s->offloads_before = e->n_offloads;
  const uint64_t cap_fallbacks = e->stats.cap_fallbacks;
  if (d.action == FERRY_OFFLOAD) {
    pack_offload(e, idx, &d, compute_stream);
    s = &e->entries[idx]; /* it may drop the lock */
  }
  if (s->state == ENTRY_KEPT) e->stats.tensors_kept++;
  if (e->n_obs)
    stash_notify(e, &(obs_event){.kind = OBS_PACK, .idx = idx, .desc = desc, .entry = s,
                                 .decision = &d, .cap_fallbacks_before = cap_fallbacks});
  e->stats.tensors_packed++;
  e->ctx.packed_this_step++;
  e->stats.device_bytes_held += s->bytes;
  if (e->stats.device_bytes_held > e->stats.device_bytes_held_peak)
    e->stats.device_bytes_held_peak = e->stats.device_bytes_held;
  if (e->cfg.retain && key && u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx)) {
    /* the address holds other bytes now (ferry_pack_keyed saw no match): a
     * later pack of these bytes finds this entry, not the stale one */
    u64map_remove(&e->aliases, (uintptr_t)device_ptr);
    e->entries[pidx].in_alias_map = 0;
  }
  if (e->cfg.retain && !u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx) &&
      u64map_insert(&e->aliases, (uintptr_t)device_ptr, idx) == 0)
    e->entries[idx].in_alias_map = 1;
  *out_idx = idx;
  return FERRY_OK;
}

/* Releases the owners the forward stash bound pushes out, in batches, the
 * lock dropped around the embedder's release callback. Called locked;
 * returns unlocked. */
static void release_over_bound(ferry_engine *e) {
  void *owners[RELEASE_BATCH];
  uint32_t n;
  do {
    n = fwd_enforce_bound(e, owners, RELEASE_BATCH);
    pthread_mutex_unlock(&e->lock);
    release_all(e, owners, n);
    if (n == RELEASE_BATCH) pthread_mutex_lock(&e->lock);
  } while (n == RELEASE_BATCH);
}

static int pack_impl(ferry_engine *e, const ferry_tensor_desc *desc, void *device_ptr,
                     void *owner, void *compute_stream, const alias_key *key,
                     ferry_handle *out) {
  int rc = engine_check(e);
  if (rc) return rc;
  const int traced = obs_calls(e);
  double t0 = traced ? now_cold() : 0;
  pthread_mutex_lock(&e->lock);
  if (!out || !desc || !device_ptr || !owner) {
    rc = engine_fail(e, FERRY_EINVAL, "ferry_pack: %s is NULL",
                     !out ? "out" : !desc ? "desc" : !device_ptr ? "device_ptr" : "owner");
    goto unlock;
  }
  *out = 0;
  if ((rc = desc_invalid(e, desc))) goto unlock;
  if (!e->in_step) step_begin_locked(e);
  pending_poll(e);

  uint32_t idx, pidx;
  /* The same buffer packed again while stored: one copy, two handles. */
  if (e->cfg.retain && u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx) &&
      alias_matches(e, &e->entries[pidx], desc, key)) {
    if ((rc = pack_alias(e, desc, pidx, out))) goto oom;
    pthread_mutex_unlock(&e->lock);
    e->cfg.release(e->cfg.callback_ud, owner); /* the engine holds one already */
    if (traced) pack_done(e, t0, (uint32_t)(*out & HANDLE_INDEX_MASK) - 1);
    return FERRY_OK;
  }
  if ((rc = pack_new(e, desc, device_ptr, owner, compute_stream, key, &idx))) goto oom;
  stash_entry *s = &e->entries[idx];
  *out = make_handle(e, idx);
  /* its owner may free the bytes once we return (FSDP): copied, let go */
  int resizable = (desc->flags & FERRY_FLAG_RESIZABLE) && s->state == ENTRY_STASHED;
  void *copied = resizable ? stash_release(e, idx) : NULL;
  release_over_bound(e);
  if (copied) e->cfg.release(e->cfg.callback_ud, copied);
  if (traced) pack_done(e, t0, idx);
  return FERRY_OK;

oom:
  rc = engine_fail(e, FERRY_ENOMEM, "ferry_pack: out of memory for the handle table");
unlock:
  pthread_mutex_unlock(&e->lock);
  return rc;
}

int ferry_pack(ferry_engine *e, const ferry_tensor_desc *desc, void *device_ptr, void *owner,
               void *compute_stream, ferry_handle *out) {
  return pack_impl(e, desc, device_ptr, owner, compute_stream, NULL, out);
}

int ferry_pack_keyed(ferry_engine *e, const ferry_tensor_desc *desc, void *device_ptr,
                     void *owner, void *compute_stream, uint64_t storage, int64_t version,
                     ferry_handle *out) {
  alias_key key = {storage, version};
  return pack_impl(e, desc, device_ptr, owner, compute_stream, &key, out);
}

int ferry_pack_cached_keep(ferry_engine *e, const ferry_tensor_desc *desc,
                           const void *device_ptr) {
  /* a recorder (fixed for the engine's life) counts every pack */
  if (engine_check(e) || !desc || !device_ptr || e->n_obs || desc->bytes == 0 ||
      desc->bytes > MAX_TENSOR_BYTES || desc->ndim < 0 || desc->ndim > FERRY_MAX_DIMS)
    return 0;
  pthread_mutex_lock(&e->lock);
  ferry_decision d;
  uint32_t pidx;
  /* a policy-less engine has no cache */
  int keep = e->policy &&
             (!e->cfg.retain || !u64map_find(&e->aliases, (uintptr_t)device_ptr, &pidx)) &&
             (desc->bytes < e->min_offload_bytes ||
              (ferry_policy_cached(e->policy, desc, &d) && d.action == FERRY_KEEP));
  if (keep) {
    if (!e->in_step) step_begin_locked(e);
    e->stats.tensors_packed++;
    e->stats.tensors_kept++;
    e->stats.tensors_kept_unheld++;
    e->ctx.packed_this_step++;
  }
  pthread_mutex_unlock(&e->lock);
  return keep;
}

/* ---- reload -------------------------------------------------------------------- */
static void *consume(ferry_engine *e, uint32_t p, int hand_out, void **to_release);

/* Every handle of entry idx was discarded while its device_alloc ran
 * (ferry_discard does not wait for a reload, which may be its own caller's):
 * give the new buffer back and free the entry. Called and returns locked. */
static int reload_orphaned(ferry_engine *e, uint32_t idx, int arc, void *owner) {
  stash_entry *s = &e->entries[idx];
  if (arc != 0) e->stats.alloc_failures++;
  s->state = ENTRY_OFFLOADED;
  s->refs = 1;
  void *none;
  consume(e, idx, 0, &none);
  pthread_cond_broadcast(&e->reload_done);
  if (arc == 0 && owner) {
    pthread_mutex_unlock(&e->lock);
    e->cfg.release(e->cfg.callback_ud, owner);
    pthread_mutex_lock(&e->lock);
  }
  return engine_fail(e, FERRY_EHANDLE,
                     "the tensor was discarded while it was being reloaded; nothing to unpack");
}

/* Bring an OFFLOADED entry back to a fresh device buffer, ordered after
 * compute_stream. Called and returns with the lock held; drops it around the
 * allocator callback, so the entries array may move: use indices. */
static int reload(ferry_engine *e, uint32_t idx, void *compute_stream, int prefetch) {
  stash_entry *s = &e->entries[idx];
  s->state = ENTRY_RELOADING;
  uint64_t bytes = s->bytes;
  pthread_mutex_unlock(&e->lock);
  void *dev = NULL, *owner = NULL;
  int arc = e->cfg.device_alloc(e->cfg.callback_ud, bytes, compute_stream, &dev, &owner);
  pthread_mutex_lock(&e->lock);
  s = &e->entries[idx];
  if (s->refs == 0) return reload_orphaned(e, idx, arc, owner);
  int rc = FERRY_OK;
  if (arc != 0 || !dev) {
    e->stats.alloc_failures++;
    s->state = ENTRY_OFFLOADED;
    rc = engine_fail(e, FERRY_EALLOC,
                     "device allocator callback failed (returned %d) for %llu bytes; the "
                     "tensor stays in host memory and its handle stays valid",
                     arc, (unsigned long long)bytes);
    if (arc == 0 && owner) {
      pthread_mutex_unlock(&e->lock);
      e->cfg.release(e->cfg.callback_ud, owner);
      pthread_mutex_lock(&e->lock);
    }
  } else {
    const ferry_backend_ops *o = e->bk->ops;
    bk_stream copy_stream = stash_reload_stream(e);
    if (!(rc = o->event_record(e->bk, e->ev_scratch, compute_stream)) &&
        !(rc = o->stream_wait_event(e->bk, copy_stream, e->ev_scratch))) {
      if (obs_calls(e)) obs_copy(e, OBS_COPY_ISSUE, 1, s, s->host, prefetch);
      rc = o->copy_h2d(e->bk, dev, s->host, s->bytes, copy_stream);
      if (rc && obs_calls(e)) obs_copy(e, OBS_COPY_UNISSUE, 1, s, s->host, prefetch);
      if (!rc) rc = o->event_record(e->bk, s->ev, copy_stream);
      if (!rc) rc = stash_sync_copy(e, s->ev, compute_stream);
    }
    if (rc) {
      rc = engine_fail(e, rc, "reload copy failed; the handle stays valid: %s", e->bk->err);
      /* A failed issue may have left a copy running into dev, with no event
       * after it: drain the stream before dev goes back. */
      o->stream_synchronize(e->bk, copy_stream);
      s->state = ENTRY_OFFLOADED;
      pthread_mutex_unlock(&e->lock);
      e->cfg.release(e->cfg.callback_ud, owner);
      pthread_mutex_lock(&e->lock);
      s = &e->entries[idx];
    } else {
      s->state = ENTRY_RELOADED;
      s->dev_ptr = dev;
      cold_of(e, s)->owner = owner;
      e->stats.bytes_h2d += s->bytes;
      e->stats.device_bytes_held += s->bytes;
      if (e->stats.device_bytes_held > e->stats.device_bytes_held_peak)
        e->stats.device_bytes_held_peak = e->stats.device_bytes_held;
    }
  }
  pthread_cond_broadcast(&e->reload_done);
  return rc;
}

/* Start reloads of the offloaded entries at positions [pos - distance, pos).
 * Positions in [prefetch_lo, prefetch_hi) were looked at already this step
 * and are skipped, so a position is looked at once: O(1) amortized per
 * tensor whatever the distance (a layers policy asks for a whole layer).
 * Recompute packs land above that range and are still looked at. An entry
 * still in the forward stash when looked at is reloaded on use instead. */
static void prefetch_ahead(ferry_engine *e, uint32_t pos, uint32_t distance, uint64_t step,
                           void *compute_stream) {
  uint32_t lo = distance < pos ? pos - distance : 0;
  uint32_t seen_lo = e->prefetch_lo, seen_hi = e->prefetch_hi;
  /* record the scan before reload drops the lock: grow the range it
   * touches, or start a new one */
  if (seen_lo < seen_hi && lo <= seen_hi && pos >= seen_lo) {
    e->prefetch_lo = lo < seen_lo ? lo : seen_lo;
    e->prefetch_hi = pos > seen_hi ? pos : seen_hi;
  } else {
    e->prefetch_lo = lo;
    e->prefetch_hi = pos;
  }
  uint32_t q = pos;
  while (q > lo) {
    q--;
    if (q >= seen_lo && q < seen_hi) {
      q = seen_lo; /* below the range looked at before */
      continue;
    }
    uint32_t j = e->offload_order[q];
    stash_entry *t = &e->entries[j];
    if (t->state != ENTRY_OFFLOADED || t->step != step || t->offload_index != q) continue;
    if (reload(e, j, compute_stream, 1) == FERRY_OK) e->stats.prefetches++;
    if (pos > e->n_offloads) return; /* the step ended meanwhile */
  }
}

/* Backward consumes tensors in reverse pack order: once the entry packed
 * after `mark` offloads is unpacked, the next offloaded tensor needed is the
 * one at position mark - 1. If the policy asked for it to be prefetched,
 * start it and the ones before it, up to its prefetch distance. Kept tensors
 * (with a handle) carry a mark too, so an unpack of a kept one starts the
 * reloads of the offloaded ones packed before it. */
static void prefetch_next(ferry_engine *e, uint32_t mark, uint64_t step, void *compute_stream) {
  if (step != e->step || mark == 0 || mark > e->n_offloads) return;
  const stash_entry *next = &e->entries[e->offload_order[mark - 1]];
  /* a slot reused meanwhile: an alias's union holds its primary instead */
  if (next->state == ENTRY_ALIAS || next->step != step || next->offload_index != mark - 1 ||
      next->reload != FERRY_RELOAD_PREFETCH)
    return;
  /* Tensors packed after the step's last offload (the tail: the loss) are
   * unpacked first; while the loss's backward holds the step's peak a
   * reload adds to it: the policy's max_tail_prefetch caps those. */
  uint32_t distance = next->prefetch_distance;
  if (mark == e->n_offloads && distance > e->max_tail_prefetch) distance = e->max_tail_prefetch;
  prefetch_ahead(e, mark, distance, step, compute_stream);
}


/* Drop one handle of primary p. Returns the owner reference to hand out
 * (retained if other handles remain), and frees the entry with the last. */
static void *consume(ferry_engine *e, uint32_t p, int hand_out, void **to_release) {
  stash_entry *s = &e->entries[p];
  *to_release = NULL;
  if (--s->refs > 0) {
    if (hand_out) e->cfg.retain(e->cfg.callback_ud, cold_of(e, s)->owner);
    return hand_out ? cold_of(e, s)->owner : NULL;
  }
  void *owner = cold_of(e, s)->owner;
  if (s->in_alias_map) u64map_remove(&e->aliases, (uintptr_t)s->dev_ptr);
  if (!hand_out && owner && s->ev && e->bk->ops->event_query(e->bk, s->ev) != 1) {
    /* Discarded while a copy still touches the device buffer: the embedder
     * may free it as soon as it gets the release. */
    e->stats.waits++;
    e->bk->ops->event_synchronize(e->bk, s->ev);
  }
  if (s->state == ENTRY_STASHED) {
    e->ctx.stash_depth--;
    e->fwd_bytes -= s->bytes;
    e->bytes_in_flight -= s->bytes;
  }
  if (owner) e->stats.device_bytes_held -= s->bytes;
  host_buffer_drop(e, s, s->state == ENTRY_STASHED || s->state == ENTRY_RELOADED);
  if (!hand_out) *to_release = owner;
  entry_free(e, p);
  return hand_out ? owner : NULL;
}

static int resolve(ferry_engine *e, ferry_handle h, const char *fn, uint32_t *slot,
                   uint32_t *primary) {
  int64_t i = lookup(e, h);
  if (i < 0)
    return engine_fail(e, FERRY_EHANDLE, "%s: handle 0x%llx is unknown, stale or already used",
                       fn, (unsigned long long)h);
  *slot = (uint32_t)i;
  *primary = e->entries[i].state == ENTRY_ALIAS ? e->entries[i].primary : (uint32_t)i;
  return FERRY_OK;
}

/* Mark handle slot used; frees alias slots. */
static void retire_slot(ferry_engine *e, uint32_t slot, uint32_t primary) {
  if (slot != primary)
    entry_free(e, slot);
  else
    e->entries[slot].consumed = 1;
  e->stats.live_handles--;
}

int ferry_unpack(ferry_engine *e, ferry_handle h, void *compute_stream, void **device_ptr,
                 void **owner) {
  int rc = engine_check(e);
  if (rc) return rc;
  const int ct = obs_calls(e);
  double t0 = ct ? now_cold() : 0;
  obs_tensor t;
  const char *found = NULL;
  pthread_mutex_lock(&e->lock);
  if (!device_ptr || !owner) {
    rc = engine_fail(e, FERRY_EINVAL, "ferry_unpack: %s is NULL", !device_ptr ? "device_ptr" : "owner");
    goto unlock;
  }
  uint32_t slot = 0, p = 0;
  if ((rc = resolve(e, h, "ferry_unpack", &slot, &p))) goto unlock;
  stash_wait_reloading(e, p);
  /* Another thread may have consumed this handle while we waited. */
  if (lookup(e, h) < 0) {
    rc = engine_fail(e, FERRY_EHANDLE, "ferry_unpack: handle 0x%llx was used concurrently",
                     (unsigned long long)h);
    goto unlock;
  }
  pending_poll(e);
  stash_entry *s = &e->entries[p];
  uint32_t mark = s->offloads_before;
  uint64_t step = s->step;
  if (ct) unpack_info(e, p, e->cold[slot].trace_id, &t, &found);
  if (s->state == ENTRY_STASHED) {
    /* Stash hit: no copy back, but the D2H copy may still be reading the
     * buffer, which the caller is free to overwrite or free once it has it:
     * its stream waits for the copy (a host wait only on the host backend's
     * calling-thread stream). */
    e->stats.stash_hits++;
    if ((rc = e->bk->ops->stream_wait_event(e->bk, compute_stream, s->ev))) {
      rc = engine_fail(e, rc, "ferry_unpack: compute stream cannot wait for the offload copy: %s",
                       e->bk->err);
      goto unlock;
    }
  } else if (s->state == ENTRY_OFFLOADED) {
    rc = reload(e, p, compute_stream, 0);
    /* a failed reload leaves the handle valid, unless it was discarded
     * meanwhile (device_alloc may): then that, not "stays valid", is told */
    if (rc && rc != FERRY_EHANDLE && lookup(e, h) < 0)
      rc = engine_fail(e, FERRY_EHANDLE, "ferry_unpack: handle 0x%llx was discarded while it was "
                       "being reloaded (and the reload failed); nothing to unpack",
                       (unsigned long long)h);
    if (rc) goto unlock;
    if (lookup(e, h) < 0) { /* consumed while the lock was dropped */
      rc = engine_fail(e, FERRY_EHANDLE, "ferry_unpack: handle 0x%llx was used concurrently",
                       (unsigned long long)h);
      goto unlock;
    }
    s = &e->entries[p];
  }
  if (s->state == ENTRY_RELOADED) {
    /* on the host backend the calling thread is the compute stream: it
     * waits here for a reload still running (the stall) */
    double tw = ct && e->bk->ops->event_query(e->bk, s->ev) != 1 ? util_now_us() : 0;
    if ((rc = e->bk->ops->stream_wait_event(e->bk, compute_stream, s->ev))) {
      rc = engine_fail(e, rc, "ferry_unpack: compute stream cannot wait for the reload: %s",
                       e->bk->err);
      goto unlock;
    }
    if (ct) {
      if (tw > 0) obs_wait(e, "wait for reload", tw);
      obs_copy(e, OBS_COPY_OBSERVED, 1, s, s->host, 0);
    }
  }
  *device_ptr = s->dev_ptr;
  uint64_t tid = e->cold[slot].trace_id;
  retire_slot(e, slot, p);
  void *unused;
  *owner = consume(e, p, 1, &unused);
  e->stats.tensors_unpacked++;
  prefetch_next(e, mark, step, compute_stream);
  if (e->n_obs)
    stash_notify(e, &(obs_event){.kind = OBS_UNPACK, .id = tid, .t0 = t0,
                                 .tensor = ct ? &t : NULL, .found = found});
unlock:
  pthread_mutex_unlock(&e->lock);
  return rc;
}

int ferry_prefetch(ferry_engine *e, ferry_handle h, void *compute_stream) {
  int rc = engine_check(e);
  if (rc) return rc;
  pthread_mutex_lock(&e->lock);
  uint32_t slot = 0, p = 0;
  if ((rc = resolve(e, h, "ferry_prefetch", &slot, &p)) == FERRY_OK &&
      e->entries[p].state == ENTRY_OFFLOADED) {
    rc = reload(e, p, compute_stream, 1);
    if (rc == FERRY_OK) e->stats.prefetches++;
  }
  pthread_mutex_unlock(&e->lock);
  return rc;
}

int ferry_discard(ferry_engine *e, ferry_handle h) {
  int rc = engine_check(e);
  if (rc) return rc;
  double t0 = obs_calls(e) ? util_now_us() : 0;
  pthread_mutex_lock(&e->lock);
  uint32_t slot = 0, p = 0;
  void *to_release = NULL;
  if ((rc = resolve(e, h, "ferry_discard", &slot, &p)) == FERRY_OK) {
    if (e->entries[p].state == ENTRY_RELOADING) {
      /* No wait for the reload: it may be this thread's own, from inside
       * device_alloc (a framework freeing the other saved copy of the
       * buffer). The last handle leaves the entry to the reload to free. */
      uint64_t tid = e->cold[slot].trace_id;
      retire_slot(e, slot, p);
      if (e->entries[p].refs > 1)
        consume(e, p, 0, &to_release);
      else
        e->entries[p].refs = 0; /* reload_orphaned */
      if (e->n_obs) stash_notify(e, &(obs_event){.kind = OBS_DISCARD, .id = tid});
    } else {
      uint64_t tid = e->cold[slot].trace_id;
      obs_tensor t = {0};
      if (obs_calls(e)) t = obs_tensor_of(e, &e->entries[p], tid);
      retire_slot(e, slot, p);
      consume(e, p, 0, &to_release);
      if (e->n_obs)
        stash_notify(e, &(obs_event){.kind = OBS_DISCARD, .id = tid, .t0 = t0,
                                     .tensor = obs_calls(e) ? &t : NULL});
    }
  }
  pthread_mutex_unlock(&e->lock);
  if (to_release) e->cfg.release(e->cfg.callback_ud, to_release);
  return rc;
}

