/*
 * engine_internal.h — the engine's state, shared by the files of core/:
 * engine.c (lifecycle, config, stats, interning), engine_base.c (registry,
 * errors, events, observers), stash.c (the stash manager) and the recorders
 * that observe it. Everything here is guarded by ferry_engine.lock unless a
 * comment says otherwise.
 */
#ifndef FERRY_ENGINE_INTERNAL_H
#define FERRY_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "ferry_tools.h"
#include "core/core.h"
#include "ferry.h"
#include "util/intern.h"
#include "util/u64map.h"

/* Where a saved tensor is. */
typedef enum entry_state {
  ENTRY_FREE = 0,
  ENTRY_KEPT,      /* on device, untouched */
  ENTRY_STASHED,   /* D2H issued (ev), device buffer still held */
  ENTRY_OFFLOADED, /* bytes only in the arena; D2H complete */
  ENTRY_RELOADING, /* a thread is in the allocator callback for it */
  ENTRY_RELOADED,  /* H2D issued (ev) into a fresh device buffer */
  ENTRY_ALIAS      /* a second handle to `primary` */
} entry_state;

/* A saved tensor's record, one cache line (64 bytes, checked below; the
 * array is 64-byte aligned, util_grow_aligned): what
 * pack, unpack and prefetch read of every tensor. What they read rarely
 * (the owner, at release; the pack number and module, with a recorder; the
 * storage and version of a keyed pack, at an alias) is in its stash_cold,
 * at the same index of ferry_engine.cold. */
typedef struct stash_entry {
  uint32_t gen;      /* bumped when the slot is freed: stale handles fail */
  uint8_t state;     /* entry_state */
  uint8_t consumed : 1; /* this handle was unpacked (primary awaiting aliases) */
  uint8_t reload : 1;   /* ferry_reload */
  uint8_t in_alias_map : 1;
  uint8_t keyed : 1;    /* packed by ferry_pack_keyed: aliases must match the key */
  uint16_t prefetch_distance; /* at most 4096 (the decision's and knob's bound) */
  uint32_t refs;     /* primary: live handles (itself + aliases) */
  union {
    uint32_t primary;       /* alias: index of the primary entry */
    uint32_t offload_index; /* primary: position in the step's offload order,
                               offloaded only (UINT32_MAX: none) */
  };
  int32_t layer;
  uint32_t offloads_before; /* offloads packed before this entry in its step */
  uint64_t step;
  uint64_t bytes;
  void *dev_ptr;
  void *host;        /* arena buffer */
  bk_event *ev;      /* last copy issued for this entry */
} stash_entry;
_Static_assert(sizeof(stash_entry) == 64, "a stash entry is one cache line");

typedef struct stash_cold {
  void *owner;
  uint64_t trace_id; /* pack number in the trace(s), 0 when not tracing */
  const char *module_path; /* interned; set only while recording a Chrome trace */
  uint64_t alias_storage;  /* ferry_pack_keyed's storage and version */
  int64_t alias_version;
} stash_cold;

/* An arena buffer that a copy may still touch: freed once ev completes. */
typedef struct pending_free {
  void *host;
  uint64_t bytes;
  bk_event *ev;
} pending_free;




/* What a loaded policy came from: its file (the path ferry_policy_find
 * resolved, with the file's identity and modification time, so an edited
 * file is loaded again) or its source text; and whether it is trusted. */
typedef struct policy_key {
  char *path, *source; /* owned; one of them NULL */
  int trusted;
  uint64_t dev, ino, size;
  int64_t mtime_ns;
} policy_key;
#define PARKED_POLICIES 4

struct ferry_engine {
  ferry_config cfg; /* the caller's config, strings not retained */
  ferry_backend *bk;
  ferry_arena *arena;
  bk_stream d2h, h2d;
  bk_event *ev_scratch; /* recorded on a compute stream, waited on at once */

  pthread_mutex_t lock;
  pthread_cond_t reload_done; /* an ENTRY_RELOADING entry left that state */
  char last_error[512];

  /* decisions */
  ferry_policy *policy;
  policy_key policy_from; /* what the policy was loaded from */
  /* policies swapped out by ferry_set_policy, kept to swap back without a
   * reload while their file (or source) is unchanged; oldest out first */
  struct parked_policy {
    ferry_policy *p;
    policy_key key;
    uint64_t parked_at;
  } parked[PARKED_POLICIES];
  uint64_t park_clock;
  ferry_decide_fn decide;
  void *decide_ud;
  uint32_t max_fwd_stash;
  uint32_t prefetch_distance;
  uint64_t min_offload_bytes;
  uint64_t max_fwd_stash_bytes; /* 0 = no byte bound */
  int release_when_copied;    /* the config's, or turned on by the policy's knob */
  uint32_t max_tail_prefetch; /* the policy's knob only (UINT32_MAX: no cap) */
  uint32_t sync_copies;       /* FERRY_SYNC_*: the policy's knob only */
  uint32_t one_copy_stream;   /* reloads on the D2H stream: the policy's knob only */
  uint32_t knobs_overruled;      /* FERRY_KNOB_* the policy lost to config.knobs_fixed */
  uint64_t fwd_bytes;           /* bytes of the STASHED entries */

  /* entries; index + 1 and gen form a handle; cold: the same index's
   * rarely read fields (as many as entries: cap_entries) */
  stash_entry *entries;
  stash_cold *cold;
  uint32_t n_entries, cap_entries;
  uint32_t *free_slots;
  uint32_t n_free;
  u64map aliases; /* device pointer -> entry index of its primary pack */

  /* forward stash: FIFO ring of (gen << 32 | index) of STASHED entries in
   * pack order; entries unpacked meanwhile are skipped lazily by their gen */
  uint64_t *fwd;
  uint32_t fwd_head, fwd_count, fwd_cap;

  /* offloaded entries of this step in pack order, for prefetch */
  uint32_t *offload_order;
  uint32_t n_offloads, cap_offloads;
  uint32_t prefetch_lo, prefetch_hi; /* offload positions looked at for prefetch this step */

  pending_free *pending;
  uint32_t n_pending, cap_pending;

  bk_event **event_pool;
  uint32_t n_event_pool, cap_event_pool;

  /* step state */
  int in_step;
  int phase; /* ferry_phase */
  uint64_t step;
  ferry_context ctx; /* per-step counters live here */
  uint32_t *layer_counts;
  uint32_t cap_layers;
  uint64_t bytes_in_flight;

  ferry_stats stats;
  intern_table interned;

  /* the recorders observing the stash (stash_observer below), fixed once
   * the engine is created; obs_wants: the OBS_* they asked for, together */
  struct stash_observer *obs;
  uint32_t n_obs;
  unsigned obs_wants;
  uint64_t trace_seq; /* the last pack number (OBS_NUMBERS) */
  ferry_policy_reason why; /* the reason of the pack being decided (OBS_REASONS) */

  /* hooks of the rooms above the core (core.h), newest last */
  struct shutdown_hook {
    engine_shutdown_fn fn;
    void *ud;
  } *shutdown_hooks;
  uint32_t n_shutdown_hooks;
};

/* engine_base.c (also engine_fail, engine_check, event_get/put: core.h):
 * the live-engine registry (registry_add: 0, or -1 when full; registry_remove:
 * 1 when it took e off the list) and the quarantine of destroyed engines'
 * memory */
#define MAX_ENGINES 64
int registry_add(ferry_engine *e);
int registry_remove(ferry_engine *e);
void quarantine_push(void *mem);

/* stash.c */
int stash_init(ferry_engine *e);
void stash_destroy(ferry_engine *e); /* waits for copies, releases owners */

/* ---- recorders: observers of the stash ------------------------------------
 * The JSONL trace (trace_recorder.c), the Chrome trace (chrome_recorder.c)
 * and the breakdown by reason (breakdown.c) each register one observer when
 * the engine is created (engine.c) and are told what happens through one
 * callback, with the engine lock held (but the copy listener's calls, from
 * a backend's copy thread). A recorder reads the engine's state it needs and
 * calls nothing in core/ above engine_base.c: core/ has no circle, and a new
 * recorder is one file and a line in engine.c. With no observer the stash
 * pays a test of obs_wants per call. */
typedef enum obs_kind {
  OBS_STEP_BEGIN,    /* a step began */
  OBS_PHASE,         /* what: "backward_begin" or "backward_end" */
  OBS_STEP_END,      /* t0: when the ferry_step_end call began */
  OBS_PACK,          /* entry idx packed (aliased: a second handle of its
                        primary's bytes), with desc; a new entry also has its
                        decision and the cap fallbacks counted before it */
  OBS_PACK_DONE,     /* the pack call of entry idx returns (its releases done) */
  OBS_UNPACK,        /* handle id unpacked; tensor, found */
  OBS_DISCARD,       /* handle id discarded; tensor (NULL: while reloading) */
  OBS_WAIT,          /* the host waited from t0 until now (what) */
  OBS_COPY_ISSUE,    /* a copy (dir 0: D2H, 1: H2D) of entry through host is
                        about to be issued (prefetch: ahead of its unpack) */
  OBS_COPY_UNISSUE,  /* its issue failed */
  OBS_COPY_OBSERVED, /* the engine saw it complete */
} obs_kind;

/* What a call's slice says of its tensor, taken while its entry exists
 * (OBS_CALLS only). */
typedef struct obs_tensor {
  uint64_t tensor, alias_of, bytes; /* pack numbers (alias_of 0: none) */
  const char *module;
  int32_t layer;
  int decision; /* FERRY_KEEP or FERRY_OFFLOAD */
} obs_tensor;
static inline stash_cold *cold_of(const ferry_engine *e, const stash_entry *s) {
  return &e->cold[s - e->entries];
}
static inline obs_tensor obs_tensor_of(const ferry_engine *e, const stash_entry *s,
                                       uint64_t tensor) {
  return (obs_tensor){.tensor = tensor, .bytes = s->bytes, .module = cold_of(e, s)->module_path,
                      .layer = s->layer,
                      .decision = s->state == ENTRY_KEPT ? FERRY_KEEP : FERRY_OFFLOAD};
}

typedef struct obs_event {
  obs_kind kind;
  const char *what;
  double t0; /* util_now_us when the call began (OBS_CALLS only) */
  uint32_t idx;
  uint64_t id;
  int aliased, dir, prefetch;
  const ferry_tensor_desc *desc;
  const ferry_decision *decision;
  uint64_t cap_fallbacks_before;
  const stash_entry *entry;
  const void *host;
  const obs_tensor *tensor;
  const char *found; /* an unpack's: "kept", "stash hit", "prefetched", "reloaded" */
} obs_event;

/* What an observer asks of the stash: pack numbers (trace_id), call times,
 * tensor snapshots, module paths, waits and copies (costly, so only on
 * request), the reason of each decision (the policy's explain). */
enum { OBS_NUMBERS = 1, OBS_CALLS = 2, OBS_REASONS = 4 };

typedef void (*obs_fn)(void *self, ferry_engine *e, const obs_event *ev);
typedef struct stash_observer {
  obs_fn on;
  void (*close)(void *self, ferry_engine *e); /* after the backend is gone */
  void *self;
  unsigned wants;
} stash_observer;

/* engine_base.c: adds an observer (while the engine is created); 0 or
 * FERRY_ENOMEM. The self of the observer whose callback is on, or NULL.
 * Closes every observer, newest first. */
int engine_observe(ferry_engine *e, obs_fn on, void (*close)(void *, ferry_engine *), void *self,
                   unsigned wants);
void *engine_observer(const ferry_engine *e, obs_fn on);
void engine_observers_close(ferry_engine *e);

static inline void stash_notify(ferry_engine *e, const obs_event *ev) {
  for (uint32_t i = 0; i < e->n_obs; i++) e->obs[i].on(e->obs[i].self, e, ev);
}
/* Whether the observers want call slices, waits and copies (OBS_CALLS);
 * fixed for the engine's life. */
static inline int obs_calls(const ferry_engine *e) {
  return __builtin_expect((e->obs_wants & OBS_CALLS) != 0, 0);
}
static inline void obs_wait(ferry_engine *e, const char *what, double t0) {
  obs_event ev = {.kind = OBS_WAIT, .what = what, .t0 = t0};
  stash_notify(e, &ev);
}
static inline void obs_copy(ferry_engine *e, obs_kind kind, int dir, const stash_entry *s,
                            const void *host, int prefetch) {
  obs_event ev = {.kind = kind, .dir = dir, .entry = s, .host = host, .prefetch = prefetch};
  stash_notify(e, &ev);
}

/* The recorders' openers (engine.c opens those the config asks for); each
 * registers its observer, or fails with the message in e->last_error. */
int trace_open(ferry_engine *e, const char *path);
int ctrace_open(ferry_engine *e, const char *path);
int breakdown_open(ferry_engine *e);

/* pending_frees.c, called with the lock held: retire a few completed
 * copies; retire all, waiting; give an entry's arena buffer back, now or
 * once its last copy (copy_may_run) completed. */
void pending_poll(ferry_engine *e);
void pending_drain(ferry_engine *e);
void host_buffer_drop(ferry_engine *e, stash_entry *s, int copy_may_run);

/* reload_wait.c: wait, lock held, until entry idx is not RELOADING. */
void stash_wait_reloading(ferry_engine *e, uint32_t idx);
/* sync_copies.c: with the sync_copies knob, make the compute stream (or the
 * host) wait for the copy just issued, whose completion ev records. */
int stash_sync_copy(ferry_engine *e, bk_event *ev, void *compute_stream);
/* The stream activation reloads go on: the H2D stream, or with the
 * one_copy_stream knob the D2H stream, behind the offloads on it. */
bk_stream stash_reload_stream(ferry_engine *e);

#endif
