/*
 * policy_host.h — runs Lua policies (policy API v1) in a sandboxed LuaJIT
 * state, one state per policy instance, and answers ferry_decide_fn calls.
 *
 * The engine serializes calls into one policy instance (it holds its lock
 * around ferry_policy_decide), so the host needs no lock of its own for the
 * Lua state. A policy fault never propagates: the answer becomes FERRY_KEEP,
 * the fault is counted and its "file:line: message" kept.
 */
#ifndef FERRY_POLICY_HOST_H
#define FERRY_POLICY_HOST_H

#include <stddef.h>
#include <stdint.h>

#include "ferry.h"

#define FERRY_POLICY_API_VERSION 1

typedef struct ferry_policy ferry_policy;

/* Engine knobs a policy may set at load (policy.knobs); a field is applied
 * only when its has_ flag is set. Validated at load. */
typedef struct ferry_policy_knobs {
  int has_max_fwd_stash, has_prefetch_distance, has_min_offload_bytes;
  int has_max_fwd_stash_bytes;
  uint32_t max_fwd_stash;
  uint32_t prefetch_distance;
  uint64_t min_offload_bytes;
  uint64_t max_fwd_stash_bytes;
} ferry_policy_knobs;

typedef struct ferry_policy_stats {
  uint64_t calls;      /* decide calls that ran Lua */
  uint64_t cache_hits; /* decide calls answered from the site cache */
  uint64_t errors;     /* faults: errors, timeouts, memory, nonsense */
  int disabled;        /* error budget exhausted: everything kept */
} ferry_policy_stats;

/* Load from a file (path) or from source text (path NULL; chunk name
 * "=policy"). trusted allows the FFI. On failure returns FERRY_EPOLICY and
 * writes "file:line: message" into errbuf. */
int ferry_policy_create(const char *path, const char *source, int trusted,
                        ferry_policy **out, char *errbuf, size_t errlen);
void ferry_policy_destroy(ferry_policy *p);
const char *ferry_policy_name(const ferry_policy *p);
void ferry_policy_get_knobs(const ferry_policy *p, ferry_policy_knobs *out);

/* Decide for one tensor. Never fails: any fault gives FERRY_KEEP. */
void ferry_policy_decide(ferry_policy *p, const ferry_tensor_desc *desc,
                         const ferry_context *ctx, ferry_decision *out);
/* Called by the engine at each step begin (cache epochs, ctx sampling). */
void ferry_policy_step_begin(ferry_policy *p, uint64_t step);

void ferry_policy_get_stats(const ferry_policy *p, ferry_policy_stats *out);
/* Last fault as "file:line: message", "" if none. */
const char *ferry_policy_last_error(const ferry_policy *p);

/* ---- checkpoint snapshots -------------------------------------------------
 * A policy may have a `snapshot(e)` function beside `decide`: called once
 * per tensor of a checkpoint (ferry.torch.snapshot) with a Lua table
 * e = { key, path, bytes, index, dtype, device }, it answers
 *   stage [, order]
 * stage: true (or nil) = staged through the pinned arena while training goes
 * on; false = copied by the caller when the snapshot starts (torch.save's
 * way). order: a number; entries are written in ascending order, ties in
 * traversal order (nil = index). Without the function every entry is
 * staged in traversal order. A fault or a nonsense answer stages the entry
 * in traversal order (nothing is ever left out), counted like decide's. */
typedef struct ferry_snapshot_entry {
  const char *key;   /* top-level key of the checkpoint ("state_dict"), "" if none */
  const char *path;  /* dotted path from the top: "optimizer_states.0.state.3.exp_avg" */
  uint64_t bytes;
  int32_t index;     /* position in traversal order, from 0 */
  int32_t dtype;     /* ferry_dtype */
  int32_t on_device; /* 1: device memory; 0: already in host memory */
} ferry_snapshot_entry;

typedef struct ferry_snapshot_choice {
  int stage;    /* 1: stage through the arena; 0: copy when the snapshot starts */
  double order; /* ascending write order */
} ferry_snapshot_choice;

/* Whether the policy defines snapshot(e). */
int ferry_policy_has_snapshot(const ferry_policy *p);
/* Decide for one checkpoint entry. Never fails (see above). */
void ferry_policy_snapshot(ferry_policy *p, const ferry_snapshot_entry *e,
                           ferry_snapshot_choice *out);

#endif
