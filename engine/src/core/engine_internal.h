/*
 * engine_internal.h — the engine's state, shared by engine.c (lifecycle,
 * config, stats, interning), stash.c (the stash manager) and
 * trace_recorder.c. Everything here is guarded by ferry_engine.lock unless
 * a comment says otherwise.
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

typedef struct stash_entry {
  uint32_t gen;      /* bumped when the slot is freed: stale handles fail */
  uint8_t state;     /* entry_state */
  uint8_t consumed;  /* this handle was unpacked (primary awaiting aliases) */
  uint8_t reload;    /* ferry_reload */
  uint8_t in_alias_map;
  uint8_t keyed;     /* packed by ferry_pack_keyed: aliases must match the key */
  uint32_t refs;     /* primary: live handles (itself + aliases) */
  uint32_t primary;  /* alias: index of the primary entry */
  uint32_t prefetch_distance;
  int32_t layer;
  uint32_t offload_index;  /* position in the step's offload order, offloaded only */
  uint32_t offloads_before; /* offloads packed before this entry in its step */
  uint64_t step;
  uint64_t bytes;
  void *dev_ptr;
  void *owner;
  void *host;        /* arena buffer */
  bk_event *ev;      /* last copy issued for this entry */
  uint64_t trace_id; /* pack number in the trace(s), 0 when not tracing */
  const char *module_path; /* interned; set only while recording a Chrome trace */
  uint64_t alias_storage;  /* ferry_pack_keyed's storage and version */
  int64_t alias_version;
} stash_entry;

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
  uint32_t knobs_overruled;      /* FERRY_KNOB_* the policy lost to config.knobs_fixed */
  uint64_t fwd_bytes;           /* bytes of the STASHED entries */

  /* entries; index + 1 and gen form a handle */
  stash_entry *entries;
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

  /* trace recorder (trace_recorder.c) */
  FILE *trace;
  double trace_t0_us;
  uint64_t trace_seq;
  double trace_flops; /* FLOPs since the last traced event (ferry_trace_flops) */
  int trace_flops_all; /* every traced event carries "flops" (ferry_trace_flops_all) */
  /* Chrome trace of the run (chrome_recorder.c), NULL when not recording */
  struct ct_recorder *ct;
  int number_packs; /* a trace (JSONL, Chrome) is recorded: packs get trace_id */
  /* saved tensors by rule and layer (breakdown.c), NULL unless
   * config.count_reasons */
  struct breakdown *bd;

  /* hooks of the rooms above the core (core.h), newest last */
  struct shutdown_hook {
    engine_shutdown_fn fn;
    void *ud;
  } *shutdown_hooks;
  uint32_t n_shutdown_hooks;
};

/* engine.c (engine_fail, engine_check, event_get/put: core.h) */

/* stash.c */
int stash_init(ferry_engine *e);
void stash_destroy(ferry_engine *e); /* waits for copies, releases owners */

/* breakdown.c: called with the lock held, only when e->bd is set */
int breakdown_open(ferry_engine *e);
void breakdown_close(ferry_engine *e);
/* where the policy's explain writes the reason of the decision to count */
ferry_policy_reason *breakdown_reason(ferry_engine *e);
/* the reason of an engine-level outcome (no policy call, or overruled) */
void breakdown_set(ferry_engine *e, const char *rule, const char *where);
/* counts a new pack of `bytes` in layer under the current reason */
void breakdown_count(ferry_engine *e, int32_t layer, uint64_t bytes, int offloaded);
/* counts pack entry s by its reason: an offload the engine could not make is
 * kept for an engine-level reason (cold: only with config.count_reasons) */
void count_reason(ferry_engine *e, const stash_entry *s, const ferry_decision *d,
                  uint64_t cap_fallbacks_before) __attribute__((cold));

/* trace_recorder.c */
int trace_open(ferry_engine *e, const char *path);
void trace_close(ferry_engine *e);
/* Both are no-ops when no trace is open; called with the lock held. */
void trace_pack(ferry_engine *e, uint32_t idx, const ferry_tensor_desc *d, int decision,
                int aliased);
void trace_event(ferry_engine *e, const char *ev, uint64_t id);

/* chrome_recorder.c: the Chrome trace of a real run. Every call but open and
 * close needs e->ct (callers test it: nothing is paid without a trace) and
 * is made with the engine lock held. t0: when the call began (util_now_us). */
typedef struct ct_recorder ct_recorder;
/* what a call's slice says of its tensor, taken while its entry exists */
typedef struct ct_tensor {
  uint64_t tensor, alias_of, bytes; /* pack numbers (alias_of 0: none) */
  const char *module;
  int32_t layer;
  int decision; /* FERRY_KEEP or FERRY_OFFLOAD */
} ct_tensor;
static inline ct_tensor ctrace_tensor(const stash_entry *s, uint64_t tensor) {
  return (ct_tensor){.tensor = tensor, .bytes = s->bytes, .module = s->module_path,
                     .layer = s->layer,
                     .decision = s->state == ENTRY_KEPT ? FERRY_KEEP : FERRY_OFFLOAD};
}
int ctrace_open(ferry_engine *e, const char *path);
void ctrace_close(ferry_engine *e); /* once the copy streams are gone */
/* when a call began (out of line: the untraced path holds no clock code) */
double ctrace_now(void) __attribute__((cold));
/* a call's slice on the calling thread's lane (what: "pack", "unpack",
 * "discard", "step end"), with its tensor (NULL: none) and, for an unpack,
 * how it was found; then the counters */
void ctrace_call(ferry_engine *e, const char *what, double t0, const ct_tensor *t,
                 const char *found);
/* the host waited (a slice nested in the call's) */
void ctrace_wait(ferry_engine *e, const char *what, double t0);
/* an instant ("step begin", "backward", "step end": the file is flushed) */
void ctrace_mark(ferry_engine *e, const char *what);
/* a copy of entry s through host buffer host, dir 0 = D2H, 1 = H2D: about
 * to be issued; its issue failed; seen complete by the engine (backends that
 * do not time their copies only) */
void ctrace_copy_issue(ferry_engine *e, int dir, const stash_entry *s, const void *host,
                       int prefetch);
void ctrace_copy_unissue(ferry_engine *e, int dir, const void *host);
void ctrace_copy_observed(ferry_engine *e, int dir, const void *host);
/* stash.c's side of pack and unpack, out of their hot paths. A pack's slice,
 * once the stash bound's releases are done (they are part of the call): the
 * handle at entry idx is not back to its caller yet, so the entry is still
 * there. Takes the lock. */
void ctrace_pack_done(ferry_engine *e, double t0, uint32_t idx) __attribute__((cold));
/* what an unpack's slice says of primary entry p, before it is consumed */
void ctrace_unpack_info(const ferry_engine *e, uint32_t p, uint64_t tensor, ct_tensor *t,
                        const char **found) __attribute__((cold));

/* pending_frees.c, called with the lock held: retire a few completed
 * copies; retire all, waiting; give an entry's arena buffer back, now or
 * once its last copy (copy_may_run) completed. */
void pending_poll(ferry_engine *e);
void pending_drain(ferry_engine *e);
void host_buffer_drop(ferry_engine *e, stash_entry *s, int copy_may_run);

/* reload_wait.c: wait, lock held, until entry idx is not RELOADING. */
void stash_wait_reloading(ferry_engine *e, uint32_t idx);

#endif
