/*
 * ferry_tools.h — what ferry's own tools use of the engine beyond ferry.h:
 * the CLI, the Python extension, the LuaJIT module, the benchmarks and the
 * tests. Installed, but not a stable API: it changes with any release and
 * carries no ABI promise. Embedders use ferry.h alone.
 */
#ifndef FERRY_TOOLS_H
#define FERRY_TOOLS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ferry.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- enum names as traces, reports and policies write them */

/* "activation", "forward"; parsing returns -1 for an unknown name. */
FERRY_API const char *ferry_kind_name(int kind);
FERRY_API int ferry_kind_parse(const char *s);
FERRY_API const char *ferry_phase_name(int phase);
FERRY_API int ferry_phase_parse(const char *s);


/* ---- strict numbers: one parser for every flag, environment variable and
 * keyword. Rejects empty text, NaN, infinities, hex, trailing garbage,
 * values outside [min, max] (min excluded when min_open) and fractions where
 * a whole number is meant; the message names what, the text and what was
 * expected ("--host-cap 0.4: must be a whole number of bytes"). */
typedef enum ferry_number_kind {
  FERRY_NUMBER_COUNT,     /* a whole number: "8" */
  FERRY_NUMBER_REAL,      /* a plain number: "0.5" */
  FERRY_NUMBER_BYTES,     /* bytes: "4096", "512M", "16GiB"; K/M/G/T = KiB..TiB, KB..TB = 1000^n */
  FERRY_NUMBER_PERCENT,   /* "40%" gives 40 */
  FERRY_NUMBER_BANDWIDTH, /* bytes per second: "55GB/s", "12GiB/s" */
  FERRY_NUMBER_DURATION   /* microseconds: "300ns", "5us", "2ms", "1s" */
} ferry_number_kind;
FERRY_API int ferry_parse_number(const char *what, const char *text, int kind, double min,
                                 double max, int min_open, double *out, char *err,
                                 size_t errlen);

/* ---- host RAM from a meminfo file (ud: its path, NULL = /proc/meminfo):
 * the default ferry_host_ram_fn. A /proc/meminfo reading is reused for
 * 10 ms (it is asked at every step begin); a file named by ud is read at
 * every call. */
FERRY_API int ferry_host_ram_proc(void *ud, uint64_t *total_bytes, uint64_t *available_bytes);

/* ---- "did you mean": the name in names[0..n) within a typo's distance of
 * word (about a third of its letters), or NULL. */
FERRY_API const char *ferry_suggest(const char *word, const char *const *names, size_t n);

/* The folder of the rules library (require "ferry.rules") beside the
 * shipped policies (the folders ferry_policy_find searches); FERRY_ENOENT if
 * none has it. */
FERRY_API int ferry_policy_libdir(char *out, size_t outlen);

/* ---- the policy host: Lua policies (policy API v1) in a sandboxed LuaJIT state, one state per policy; a fault never propagates (the answer becomes FERRY_KEEP, counted, with "file:line: message")
 */

#define FERRY_POLICY_API_VERSION 1

typedef struct ferry_policy ferry_policy;

/* Engine knobs a policy may set at load (policy.knobs); a field is applied
 * only when its has_ flag is set. Validated at load. */
typedef struct ferry_policy_knobs {
  int has_max_fwd_stash, has_prefetch_distance, has_min_offload_bytes;
  int has_max_fwd_stash_bytes, has_release_when_copied, has_max_tail_prefetch;
  uint32_t max_fwd_stash;
  uint32_t prefetch_distance;
  uint64_t min_offload_bytes;
  uint64_t max_fwd_stash_bytes;
  uint32_t release_when_copied; /* 0 or 1 */
  uint32_t max_tail_prefetch;
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
FERRY_API int ferry_policy_create(const char *path, const char *source, int trusted,
                        ferry_policy **out, char *errbuf, size_t errlen);
FERRY_API void ferry_policy_destroy(ferry_policy *p);
FERRY_API const char *ferry_policy_name(const ferry_policy *p);
FERRY_API void ferry_policy_get_knobs(const ferry_policy *p, ferry_policy_knobs *out);

/* Decide for one tensor. Never fails: any fault gives FERRY_KEEP. */
FERRY_API void ferry_policy_decide(ferry_policy *p, const ferry_tensor_desc *desc,
                         const ferry_context *ctx, ferry_decision *out);
/* The answer the site cache holds for desc (a cacheable decision made
 * before for the same site), without running the policy: 1 and *out, or 0
 * when the policy would have to be asked. Counts a cache hit. */
FERRY_API int ferry_policy_cached(ferry_policy *p, const ferry_tensor_desc *desc,
                                  ferry_decision *out);
/* Called by the engine at each step begin, ctx->step being the new step:
 * runs the policy's step(ctx), if any. */
FERRY_API void ferry_policy_step_begin(ferry_policy *p, const ferry_context *ctx);
/* Where the policy samples host RAM when its ctx says NaN (the engine
 * gives its config's host_ram); and whether it has read
 * ctx.host_ram_used_pct so far (then the engine samples it each step). */
FERRY_API void ferry_policy_set_host_ram(ferry_policy *p, ferry_host_ram_fn fn, void *ud);
FERRY_API int ferry_policy_reads_host_ram(const ferry_policy *p);

/* Why a policy decided what it did (ferry_policy_explain): the rule that
 * made the decision and where the policy wrote it. */
typedef struct ferry_policy_reason {
  /* The rule's name: a rules-library rule ("min_bytes(1024)", "all rules
   * passed" for an offload no rule kept and no selector chose), "decide"
   * (a policy without explain), "explain" (its explain named no rule),
   * "fault" (an error or a nonsense answer: the tensor was kept),
   * "disabled" (the error budget is spent), "site cache" (a cached answer
   * stored by decide, not by explain, whose reason is unknown). */
  char rule[512];
  /* "file:line" where the rule is written: the rule's line in the policy
   * file (rules library), the decide or explain function's first line, the
   * fault's position; "" when there is none. */
  char where[512];
  int from_cache; /* the answer came from the site cache (with its stored reason) */
} ferry_policy_reason;

/* ferry_policy_decide with the reason; for tools (`ferry check`), never
 * called by the engine, whose decide pays nothing for reasons. It takes the
 * place of a decide call (it runs the policy once, through the policy's
 * explain(t, ctx) when it has one, else decide) and shares the site cache,
 * the faults and the stats with decide; a cached answer comes back with the
 * reason stored when explain cached it. Contract: docs/policy-api.md,
 * "explain". why may be NULL. */
FERRY_API void ferry_policy_explain(ferry_policy *p, const ferry_tensor_desc *desc,
                                    const ferry_context *ctx, ferry_decision *out,
                                    ferry_policy_reason *why);

FERRY_API void ferry_policy_get_stats(const ferry_policy *p, ferry_policy_stats *out);
/* Last fault as "file:line: message", "" if none. */
FERRY_API const char *ferry_policy_last_error(const ferry_policy *p);
/* The names a policy's code can reach, sorted and comma-separated: the
 * sandbox's globals and the members of its string, table, math and os
 * libraries ("assert,error,...,os.clock,...,string.byte,..."). Writes at most
 * n bytes (truncated, NUL-terminated); returns the full length. For the
 * allow-list test and docs/security.md. */
FERRY_API size_t ferry_policy_globals(const ferry_policy *p, char *out, size_t n);

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
FERRY_API int ferry_policy_has_snapshot(const ferry_policy *p);
/* Decide for one checkpoint entry. Never fails (see above). */
FERRY_API void ferry_policy_snapshot(ferry_policy *p, const ferry_snapshot_entry *e,
                           ferry_snapshot_choice *out);


/* ---- optimizer states and weights: the policy's resident(r) --------------
 * A policy may have a `resident(r)` function beside `decide`: which
 * parameters' optimizer states are kept and stepped on the host
 * (ferry.torch.offload_optimizer), and which layers' weights live on the
 * host between uses (ferry.torch.offload_weights). The caller asks once per
 * candidate of a kind, largest first (ties in model order), with a Lua table
 * r = { kind = "optimizer" | "weights", name, module, layer, layer_count,
 * bytes, total_bytes, index, count, dtype } (index: the position in that
 * order, from 0; total_bytes, count: of every candidate of the kind). It
 * answers host [, rule [, where]]: true = on the host; false or nil = on the
 * device. A fault or a nonsense answer leaves it on the device, counted like
 * decide's. docs/optimizer-offload.md, "Choosing with a policy". */
typedef enum ferry_resident_kind {
  FERRY_RESIDENT_OPTIMIZER = 0, /* one parameter's optimizer state */
  FERRY_RESIDENT_WEIGHTS = 1    /* one layer's weights */
} ferry_resident_kind;

typedef struct ferry_resident_entry {
  int32_t kind;        /* ferry_resident_kind */
  int32_t dtype;       /* ferry_dtype of the parameter(s) */
  const char *name;    /* parameter name ("model.layers.3.mlp.up_proj.weight") or layer module */
  const char *module;  /* module path ("model.layers.3.mlp.up_proj"), "" if unknown */
  int32_t layer;       /* repeated block index, -1 outside the blocks */
  int32_t layer_count; /* number of repeated blocks, 0 if unknown */
  uint64_t bytes;      /* parameter bytes (a layer's: all of its parameters) */
  uint64_t total_bytes; /* of every candidate of this kind */
  int32_t index;       /* position in the order asked, from 0 */
  int32_t count;       /* candidates of this kind */
} ferry_resident_entry;

/* Whether the policy defines resident(r). */
FERRY_API int ferry_policy_has_resident(const ferry_policy *p);
/* 1: on the host; 0: on the device (also without the function, and on a
 * fault). why (may be NULL) gets the rule that answered and its file:line:
 * "resident" at the function's line when it names none, "fault" at the
 * fault's position, "no resident function" without one. Never fails. */
FERRY_API int ferry_policy_resident(ferry_policy *p, const ferry_resident_entry *e,
                                    ferry_policy_reason *why);

/* ---- backends: the interface every backend (host, cuda, sim) implements.
 * The semantics are CUDA's, so the cuda backend is a thin mapping:
 *   - a stream runs its operations in order; different streams are unordered
 *     unless one waits on an event;
 *   - event_record captures the work enqueued on the stream so far; an event
 *     never recorded counts as complete (cudaEventQuery semantics);
 *   - copies are asynchronous: the source stays valid and the destination
 *     untouched until an event recorded after the copy has completed;
 *   - external streams (the embedder's compute stream; NULL is the default
 *     one) are never created or destroyed by the engine.
 * Every function returns 0 or a negative FERRY_E* code and writes a message
 * into the backend's err buffer on failure. */

typedef struct ferry_backend ferry_backend;
typedef void *bk_stream; /* backend-defined; external streams pass through */
typedef struct bk_event bk_event;

/* ferry_backend_ops.flags */
enum {
  /* host_alloc hands out address space that must never be touched (sim):
   * the arena keeps its bookkeeping outside the blocks */
  BK_HOST_MEMORY_OPAQUE = 1u << 0,
};

/* Told of each copy a backend ran on one of its streams: dir 0 = D2H, 1 =
 * H2D; when it started and ended, in µs of CLOCK_MONOTONIC (the clock of the
 * engine's other timestamps); its bytes and its device and host addresses.
 * Called on the thread that ran the copy (the host backend's stream worker,
 * or a thread that waited for the copy and ran it: see below) while other
 * threads may hold the engine lock: it must not call into the engine or the
 * backend. */
typedef void (*bk_copy_listener)(void *ud, int dir, double start_us, double end_us,
                                 uint64_t bytes, const void *dev, const void *host);

typedef struct ferry_backend_ops {
  const char *name;
  unsigned flags;
  void (*destroy)(ferry_backend *b);

  /* Page-locked host memory. alignment is a power of two <= 2 MiB. Must
   * come from the OS or the driver (mmap, cudaHostAlloc), never from malloc:
   * the arena may hand it to a jemalloc arena, and heap pages there corrupt
   * the process allocator. */
  int (*host_alloc)(ferry_backend *b, size_t bytes, size_t alignment, void **out);
  int (*host_free)(ferry_backend *b, void *p, size_t bytes);

  /* Engine-owned streams. */
  int (*stream_create)(ferry_backend *b, bk_stream *out);
  int (*stream_destroy)(ferry_backend *b, bk_stream s);

  /* Asynchronous copies on an engine-owned stream. */
  int (*copy_d2h)(ferry_backend *b, void *dst_host, const void *src_dev,
                  size_t bytes, bk_stream s);
  int (*copy_h2d)(ferry_backend *b, void *dst_dev, const void *src_host,
                  size_t bytes, bk_stream s);

  int (*event_create)(ferry_backend *b, bk_event **out);
  int (*event_destroy)(ferry_backend *b, bk_event *ev);
  /* s may be an engine stream or an external one (NULL included). */
  int (*event_record)(ferry_backend *b, bk_event *ev, bk_stream s);
  /* 1 = complete, 0 = not yet, negative = error. */
  int (*event_query)(ferry_backend *b, bk_event *ev);
  int (*event_synchronize)(ferry_backend *b, bk_event *ev);
  /* Work enqueued on s after this call waits for ev. s may be external. */
  int (*stream_wait_event)(ferry_backend *b, bk_stream s, bk_event *ev);
  /* Blocks until every operation enqueued on engine stream s so far has
   * completed, whether or not an event was recorded after it: how a failed
   * issue (a copy enqueued, its event not recorded) is drained before its
   * buffers go back. */
  int (*stream_synchronize)(ferry_backend *b, bk_stream s);
  /* Optional (NULL: the backend cannot time its copies): from now on, fn
   * (NULL: none) is told of every copy that completes. Set it while no copy
   * is in flight; with none set, copies pay nothing for it. The engine sets
   * it when it records a Chrome trace (ferry_config.chrome_trace_path). */
  int (*set_copy_listener)(ferry_backend *b, bk_copy_listener fn, void *ud);
} ferry_backend_ops;

struct ferry_backend {
  const ferry_backend_ops *ops;
  char err[256]; /* message of the last failure */
};

/* Constructors. cfg is the engine's config (link model, device). On failure
 * they return a negative code and write a message into errbuf. */
FERRY_API int ferry_backend_host_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen);
FERRY_API int ferry_backend_cuda_create(const ferry_config *cfg, ferry_backend **out,
                              char *errbuf, size_t errlen);
FERRY_API int ferry_backend_sim_create(const ferry_config *cfg, ferry_backend **out,
                             char *errbuf, size_t errlen);


/* The backend an engine copies with (tests: streams and pinned memory of the
 * engine's own backend, e.g. an asynchronous compute stream). */
FERRY_API ferry_backend *ferry_engine_backend(ferry_engine *e);
/* On the host backend, a thread that waits for a stream (event_synchronize,
 * stream_synchronize, stream_wait_event on an external stream) runs the
 * operations it waits for that no thread has started yet, instead of
 * waiting for the stream's worker to get a core. On by default; a thread
 * that runs below the priority of the threads that may wait for the same
 * copies (the niced snapshot writer) turns it off for itself, or a
 * copy it took would hold them up. Other backends ignore it. */
FERRY_API void ferry_backend_thread_runs_waited_copies(int yes);

/* A backend that wraps inner (taking it over) and fails copies, event
 * records, stream waits and pinned allocations at random (ferry_config.faults
 * syntax); the number of faults injected so far. */
FERRY_API int ferry_backend_faults_wrap(ferry_backend *inner, const char *spec,
                                        ferry_backend **out, char *err, size_t errlen);
FERRY_API uint64_t ferry_backend_faults_injected(const ferry_backend *b);
/* ... of an engine created with config.faults (0 otherwise). */
FERRY_API uint64_t ferry_faults_injected(ferry_engine *e);

/* ---- the sim backend's virtual clock, stall counters and copy listener (docs/simulator.md)
 */

typedef struct sim_backend_stats {
  double now_us;        /* the compute clock */
  double stall_us;      /* compute stream waited on a copy (reload not ready) */
  double host_wait_us;  /* the host waited on an event (stash bound, step end) */
  double busy_us[2];    /* time with a copy in progress, [0] D2H, [1] H2D */
  uint64_t copies[2];   /* copies finished, per direction */
  uint64_t bytes[2];    /* bytes of the finished copies */
  uint64_t host_reserved_bytes; /* address space handed out by host_alloc */
  uint64_t pinned_allocs;  /* host_alloc calls and sim_backend_pinned_alloc charges */
  double pinned_alloc_us;  /* host time they cost (also counted in host_wait_us) */
} sim_backend_stats;

/* dir: 0 = D2H, 1 = H2D; times in µs of the virtual clock; dev and host:
 * the copy's device and host addresses (an offload's host address is its
 * reload's source: that pairs them). */
typedef void (*sim_copy_listener)(void *ud, int dir, double start_us, double end_us,
                                  uint64_t bytes, const void *dev, const void *host);

/* Whether b is a sim backend (an engine's: engine_backend in core.h). */
FERRY_API int sim_backend_is(const ferry_backend *b);

/* The embedder's thread computes for us µs (us >= 0). */
FERRY_API void sim_backend_advance(ferry_backend *b, double us);
FERRY_API double sim_backend_now(ferry_backend *b);
/* Runs the link up to now, so that copies finished by now are counted. */
FERRY_API void sim_backend_get_stats(ferry_backend *b, sim_backend_stats *out);
FERRY_API void sim_backend_set_listener(ferry_backend *b, sim_copy_listener fn, void *ud);
/* Direction-dependent duplex (links where one direction suffers more when
 * both run, e.g. A100: H2D drops to ~48%, D2H to ~96%). */
FERRY_API int sim_backend_set_duplex(ferry_backend *b, double d2h, double h2d);
/* Cost of pinning host memory (docs/hardware.md): a pinned allocation
 * blocks the host for alloc_us plus its bytes at touch_bytes_per_s (first
 * touch and registration; 0 = free); on_host_alloc: every host_alloc (the
 * engine's arena growing) pays it. Off (both 0) until set. */
FERRY_API int sim_backend_set_pinned_cost(ferry_backend *b, double alloc_us,
                                          double touch_bytes_per_s, int on_host_alloc);
/* Charges one pinned allocation of `bytes` the engine's arena did not make
 * (a trainer without a pinned pool: a fresh cudaHostAlloc per offload, every
 * step): the per-allocation time only. The per-byte first-touch rate is
 * what new memory costs (the arena growing); a trainer that allocates and
 * frees every step gets recycled pages, and PyTorch measured ~3 ms per
 * tensor whatever its size (docs/hardware.md). */
FERRY_API void sim_backend_pinned_alloc(ferry_backend *b, uint64_t bytes);


/* ---- the pinned host arena: jemalloc or pool kind, hard cap, thread-safe
 */

typedef struct ferry_arena ferry_arena;

typedef struct ferry_arena_stats {
  uint64_t in_use;         /* bytes handed out by arena_alloc, as requested */
  uint64_t peak;           /* max of in_use */
  uint64_t reserved;       /* bytes obtained from the backend and held */
  uint64_t cap;            /* 0 = none */
  uint64_t backend_allocs; /* calls to the backend's host_alloc */
  uint64_t cap_refusals;   /* arena_alloc calls refused by the cap */
} ferry_arena_stats;

/* kind: ferry_arena_kind. cap_bytes 0 = no cap. */
FERRY_API int ferry_arena_create(ferry_backend *bk, int kind, uint64_t cap_bytes,
                       ferry_arena **out, char *errbuf, size_t errlen);
FERRY_API void ferry_arena_destroy(ferry_arena *a);
/* A shared budget consulted before every backend reservation (and told of
 * each release); set right after creation, before any allocation. */
FERRY_API void ferry_arena_set_reserve_hook(ferry_arena *a, ferry_reserve_fn fn, void *ud);
/* NULL when the cap (or the backend) refuses; never blocks on copies. */
FERRY_API void *ferry_arena_alloc(ferry_arena *a, size_t bytes);
FERRY_API void ferry_arena_free(ferry_arena *a, void *p, size_t bytes);
FERRY_API void ferry_arena_get_stats(ferry_arena *a, ferry_arena_stats *out);
FERRY_API const char *ferry_arena_kind_name(const ferry_arena *a); /* "jemalloc"/"pool" */
/* Whether jemalloc's API is present in this process. */
FERRY_API int ferry_arena_jemalloc_available(void);
/* MemTotal from /proc/meminfo in bytes, 0 if unknown. */
FERRY_API uint64_t ferry_mem_total_bytes(void);


/* ---- traces (docs/trace-format.md): reading, validated with "FILE:LINE: message", and replay through a real engine on the sim or host backend
 */

/* ---- the trace in memory ----------------------------------------------------- */
typedef enum trace_ev_type {
  TEV_STEP_BEGIN = 0,
  TEV_STEP_END,
  TEV_PACK,
  TEV_UNPACK,
  TEV_DISCARD,
  TEV_BACKWARD_BEGIN,
  TEV_BACKWARD_END,
  TEV_COMPUTE,
  TEV_ALLOC, /* transient device memory: allocated... */
  TEV_FREE   /* ...and freed (docs/trace-format.md, "alloc") */
} trace_ev_type;

typedef struct trace_ev {
  uint8_t type;    /* trace_ev_type */
  int32_t layer;   /* compute: its optional "layer", else -1 */
  uint32_t tensor; /* pack/unpack/discard: index into sim_trace.tensors;
                      alloc/free: index into sim_trace.allocs */
  const char *op;  /* compute: its optional "op" name (owned by the trace) */
  double gap_us;   /* compute time before this event */
  double flops;    /* floating-point operations of that compute, -1 unknown */
  double hbm_bytes; /* compute: bytes it reads and writes in device memory, -1 unknown */
  double min_us;   /* compute: the least it takes on any GPU (kernel launches), 0 none */
} trace_ev;

typedef struct trace_tensor {
  ferry_tensor_desc desc; /* strings are owned by the trace */
  uint64_t id;
  int32_t alias_of;    /* tensor whose buffer this pack shares, or -1 */
  int32_t last_alias;  /* last tensor that aliases this one, or -1 */
  uint8_t decision;    /* recorded: FERRY_KEEP or FERRY_OFFLOAD */
  uint32_t line;
} trace_tensor;

typedef struct trace_step {
  uint32_t first, end; /* events [first, end): step_begin .. step_end */
  uint64_t number;
} trace_step;

typedef struct trace_resident {
  char *what;
  uint64_t bytes;
  int dtype; /* its optional "dtype": the element type; FERRY_DTYPE_UNKNOWN if not given */
  /* its optional "layer_bytes": of these bytes, what each repeated block
   * holds (the "parameters" line: a block's weights, what weight offload
   * moves per layer); 0 if not given */
  uint64_t layer_bytes;
} trace_resident;

/* Transient device memory of a step (an "alloc" event to its "free"):
 * counted in the device's bytes in use, never packed, so no policy can
 * offload it. */
typedef struct trace_alloc {
  uint64_t id;
  uint64_t bytes;
  const char *what; /* owned by the trace */
  uint32_t line;
} trace_alloc;

typedef struct sim_trace {
  char *name;
  trace_ev *events;
  uint32_t n_events;
  trace_tensor *tensors;
  uint32_t n_tensors;
  trace_step *steps;
  uint32_t n_steps;
  trace_resident *resident;
  uint32_t n_resident;
  uint64_t resident_bytes;
  trace_alloc *allocs;
  uint32_t n_allocs;
  int has_compute; /* synthesized: time comes from compute events */
  char backend[16]; /* the header's "backend": where it was recorded */
  uint32_t n_flops; /* events that carry "flops" */
  uint32_t n_hbm;   /* compute events that carry "hbm_bytes" */
  int32_t layers;  /* largest `layers` seen, 0 if none */
  /* "device_peak" events (recorded on a GPU): how many, and the largest */
  uint32_t n_device_peaks;
  uint64_t device_peak;
  char **strings;  /* owned strings (module paths, classes) */
  size_t n_strings, cap_strings;
} sim_trace;

/* Read a trace file. On failure *out is NULL and err holds "FILE:LINE: ...". */
FERRY_API int sim_trace_load(const char *path, sim_trace **out, char *err, size_t errlen);
/* What the reader takes before it gives up with "FILE:LINE: ..." (limits in
 * docs/trace-format.md): the longest line, the deepest nesting of a line,
 * the largest file. sim_trace_load uses SIM_TRACE_LIMITS_DEFAULT. */
typedef struct sim_trace_limits {
  size_t max_line_bytes;
  int max_depth;
  uint64_t max_file_bytes;
} sim_trace_limits;
#define SIM_TRACE_LIMITS_DEFAULT {(size_t)1 << 20, 32, (uint64_t)1 << 34}
FERRY_API int sim_trace_load_limited(const char *path, const sim_trace_limits *limits,
                                     sim_trace **out, char *err, size_t errlen);
/* The same from memory; name is used in messages. data need not end in 0. */
FERRY_API int sim_trace_parse(const char *name, const char *data, size_t len, sim_trace **out, char *err,
                    size_t errlen);
FERRY_API void sim_trace_free(sim_trace *t);

/* ---- replay ------------------------------------------------------------------- */
/* A DGX H100's 2 TB of system memory (NVIDIA DGX H100 datasheet) */
#define SIM_DEFAULT_HOST_RAM 2000000000000ull
/* DeepSpeed's CPU-Adam: 11.6e9 parameters stepped in 8.2 s by one process
 * on a node (DeepSpeed PR #735, docs/hardware.md), shared by the node's 8
 * GPUs: parameters per second per rank */
#define SIM_DEFAULT_CPU_ADAM (11.6e9 / 8.2 / 8)

typedef struct sim_config {
  ferry_link link;
  double duplex_d2h, duplex_h2d; /* sim: per-direction duplex, 0 = link.duplex */
  uint32_t steps;          /* steps to replay, cycling the trace's; 0 = the trace's */
  const char *policy_path; /* policy under test; both NULL = keep everything */
  const char *policy_source;
  const char *label;       /* name in reports; default: policy file name or "no offload" */
  int replay_decisions;    /* answer with the decisions recorded in the trace */
  uint64_t host_cap_bytes; /* 0 = none */
  int host_backend;        /* 0: the sim backend; 1: the host backend */
  /* host backend only: wall µs per trace µs of compute (e.g. 100 to slow
   * the trace down as the link was scaled down), and real buffers whose
   * contents are checked on every unpack */
  double host_time_scale;
  int timeline;            /* record the last step's timeline */
  int record_decisions;    /* record the last step's decision per pack */
  /* steps left out of the steady-state figures (step time, stall, bytes,
   * peak): 0 = the default, 1; negative = none */
  int32_t warmup;
  /* achieved TFLOP/s of the simulated GPU: compute that carries FLOPs in
   * the trace takes flops / this (a synthesized event, which also carries
   * its device-memory bytes and a least time, takes the largest of
   * flops / this, hbm_bytes / hbm_bytes_per_s and min_us: a roofline);
   * 0 = the trace's own times (a synthesized trace: the synthesizer's) */
  double tflops;
  /* achieved device-memory bandwidth for that roofline, bytes/s; 0 =
   * SIM_DEFAULT_HBM_BYTES_PER_S. Unused while tflops is 0. */
  double hbm_bytes_per_s;
  /* the simulated host's RAM for host_cap_pct and the policies'
   * host_ram_used_pct (available = this less the pinned bytes the sim
   * reserved); 0 = SIM_DEFAULT_HOST_RAM. Never the machine running it. */
  uint64_t host_ram_bytes;
  /* sim: the cost of pinning host memory (sim_backend_set_pinned_cost),
   * both 0 = free; and whether the trainer has a pinned pool (the engine's
   * arena: pays once, when it grows) or not (pinned_no_pool: every offload
   * pays a fresh allocation of its bytes, every step) */
  double pinned_alloc_us, pinned_touch_bytes_per_s;
  int pinned_no_pool;
  int release_when_copied; /* ferry_config.release_when_copied */
  int prefetch_at_backward_begin; /* ferry_config.prefetch_at_backward_begin */
  /* sim: optimizer-state offload (docs/simulator.md, "Optimizer-state
   * offload"), as ferry.torch.offload_optimizer does it: the share of the
   * trace's resident "optimizer states" (and "master weights") kept on the
   * host, 0..1 (0 = none); the host's Adam rate in parameters per second
   * per rank (0 = SIM_DEFAULT_CPU_ADAM); optimizer_serial: the host step
   * after the device share's and the updated parameters waited for before
   * the step ends (overlap=False), else overlapped (the default) */
  double optimizer_fraction;
  double cpu_adam_params_per_s;
  int optimizer_serial;
  /* sim: weight offload (docs/simulator.md, "Weight offload"), as
   * ferry.torch.offload_weights does it: the weights of the repeated blocks
   * weight_first .. weight_first + weight_count - 1 (weight_count 0 = none)
   * go to the host after each forward and come back before their backward,
   * the next forward keeping them; weight_single_buffer: no reload of the
   * neighbour ahead (double_buffer=False), else double-buffered */
  int32_t weight_first, weight_count;
  int weight_single_buffer;
  /* device memory the trace does not hold (never saved for backward: the
   * loss's transients, workspaces), counted in every peak as resident
   * memory is; sim_untracked_bytes learns it from a recorded run */
  uint64_t untracked_bytes;
  /* progress, called after each step (may be NULL) */
  void (*progress)(void *ud, uint32_t step, uint32_t steps);
  void *progress_ud;
} sim_config;

typedef struct sim_layer_row {
  int32_t layer;            /* -1: outside the repeated blocks */
  uint64_t saved_bytes;     /* activations and others packed in the step */
  uint64_t offloaded_bytes;
  uint32_t packed, offloaded;
  double stall_us;          /* compute waits on its reloads */
} sim_layer_row;

typedef struct sim_interval {
  double t0, t1;
  uint64_t bytes; /* copies */
  int32_t lane;   /* 0 compute, 1 D2H, 2 H2D */
  int32_t layer;  /* compute: layer of the next tensor event, -1 if none;
                     copies: the tensor's */
  uint32_t tensor; /* copies: the trace's tensor index + 1, 0 = unknown */
  uint32_t flow;   /* an offload and its reload share a nonzero id */
  const char *module_path; /* copies: the tensor's (the trace's string) */
} sim_interval;

typedef struct sim_mem_sample {
  double t;
  uint64_t bytes; /* device bytes in use (resident + saved) */
} sim_mem_sample;

/* What the trainer waited for (sim backend): the compute stream for a
 * reload (the unpack's exposed stall), the host for copies (the forward
 * stash bound, the step end draining them), the host pinning memory. */
enum { SIM_WAIT_RELOAD = 0, SIM_WAIT_COPIES = 1, SIM_WAIT_PINNING = 2 };

typedef struct sim_wait {
  double t0, t1; /* the clock stood still for compute meanwhile */
  int32_t kind;  /* SIM_WAIT_* */
  int32_t layer; /* the layer of the event that waited, -1 outside blocks */
} sim_wait;

typedef struct sim_timeline {
  double t_begin, t_end; /* the recorded step */
  double t_backward;     /* its backward_begin, 0 if none */
  sim_interval *iv;
  size_t n_iv, cap_iv;
  sim_mem_sample *mem;
  size_t n_mem, cap_mem;
  /* the exposed waits, in time order (their sum is the step's stall_us +
   * host_wait_us), and the pinned host memory in use (the arena's, resident
   * buffers included) after each event that changed it */
  sim_wait *waits;
  size_t n_waits, cap_waits;
  sim_mem_sample *host;
  size_t n_host, cap_host;
} sim_timeline;

typedef struct sim_result {
  char label[128];
  char backend[16];
  uint32_t steps;
  /* peaks over all steps */
  uint64_t peak_device_bytes;  /* resident + saved tensors on device */
  uint64_t resident_bytes;     /* untracked_bytes included */
  uint64_t untracked_bytes;    /* sim_config.untracked_bytes */
  uint64_t peak_saved_bytes;   /* saved tensors alone */
  uint64_t peak_host_bytes;    /* pinned arena in use */
  uint64_t host_reserved_bytes;
  /* per step: the mean over the steady steps (after the warmup ones; step 1
   * warms caches and learns); the peaks above are over the steady steps too
   * (over all when no step is steady) */
  double step_us, stall_us, host_wait_us;
  double first_step_us;
  uint64_t first_step_peak_device_bytes; /* step 1 alone */
  uint32_t warmup;                       /* steps left out */
  double pinned_alloc_us;                /* per steady step: pinning host memory */
  /* per steady step: the least exposed stall any schedule of the same
   * copies could have at this peak, the link at full speed (replayer.c,
   * link_floor); 0 on the host backend */
  double stall_floor_us;
  uint64_t host_ram_bytes;               /* the simulated host's RAM */
  /* compute time: gaps (per replayed trace pass) timed from FLOPs at
   * sim_config.tflops, gaps kept as the trace has them; and a plain
   * sentence saying where the compute times come from */
  uint32_t gaps_from_flops, gaps_as_recorded;
  char compute_note[256];
  double bytes_d2h, bytes_h2d;
  double tensors_packed, tensors_offloaded, tensors_kept;
  double prefetches, stash_hits;
  uint64_t policy_errors, policy_calls, policy_cache_hits, cap_fallbacks;
  char policy_error[256];
  /* the last step, per layer: index 0 is layer -1, then layer k at k + 1 */
  sim_layer_row *layers;
  uint32_t n_layers;
  sim_timeline tl;
  uint8_t *decisions; /* last step, per pack event, if record_decisions */
  uint32_t n_decisions;
  uint64_t events;    /* trace events replayed */
  double wall_s;      /* wall time of the replay loop */
  /* optimizer-state offload (all 0 when off): the share, the parameters
   * stepped on the host per rank, the device memory it frees (in
   * resident_bytes and the peaks already), the pinned host memory it holds
   * (states, gradient and parameter buffers: in peak_host_bytes too), the
   * host's rate, whether serial; per steady step: the share's gradients
   * D2H and updated parameters H2D, the host step, and the time the step
   * is longer for it (waiting for gradients, for the host step, for
   * parameters; not in stall_us) */
  double opt_fraction, opt_params, opt_cpu_adam_params_per_s;
  uint64_t opt_device_bytes, opt_host_bytes;
  int opt_serial;
  double opt_bytes_d2h, opt_bytes_h2d, opt_cpu_us, opt_stall_us;
  /* weight offload (all 0 when off): the blocks (first, count), each one's
   * weight bytes (the trace's "layer_bytes", or estimated: w_estimated 1,
   * the "parameters" bytes over the layers), double-buffered or not, the
   * device bytes taken out of resident_bytes (w_count x w_layer_bytes; on
   * the device they count in peak_saved_bytes while there), the pinned host
   * bytes (in peak_host_bytes too); per steady step the bytes each way and
   * the exposed wait for them (all three also in bytes_d2h, bytes_h2d and
   * stall_us) */
  int32_t w_first, w_count;
  int w_double_buffer, w_estimated;
  uint64_t w_layer_bytes, w_device_bytes, w_host_bytes;
  double w_bytes_d2h, w_bytes_h2d, w_stall_us;
} sim_result;

/* Replay t under c. On failure err names the problem. */
FERRY_API int sim_replay(const sim_trace *t, const sim_config *c, sim_result *out, char *err,
               size_t errlen);
/* The device memory a recorded trace does not hold: its "device_peak" (the
 * trainer's own peak) less the peak of a replay of its recorded decisions
 * under c, 0 if that is larger or the trace has no device_peak. *replayed
 * (may be NULL) gets that replay's peak. */
FERRY_API int sim_untracked_bytes(const sim_trace *t, const sim_config *c, uint64_t *out,
                                  uint64_t *replayed, char *err, size_t errlen);
FERRY_API void sim_result_free(sim_result *r);


/* ---- the trace synthesizer: a decoder-only transformer's training step from its shape (docs/simulator.md)
 */

enum { SYNTH_LLAMA = 0, SYNTH_GPT = 1 };
/* Activation checkpointing (docs/simulator.md, "Activation checkpointing"):
 * none; full (every ckpt_every-th block keeps only its input and is
 * recomputed before its backward); selective (Megatron-LM's: the groups in
 * `recompute` are dropped and recomputed); selective-op (torchtitan's
 * per-op policy: matmul outputs except every second one and attention's
 * outputs kept, the rest recomputed). */
enum {
  SYNTH_CKPT_OFF = 0,
  SYNTH_CKPT_FULL = 1,
  SYNTH_CKPT_SELECTIVE = 2,
  SYNTH_CKPT_SELECTIVE_OP = 3
};
/* The loss (docs/simulator.md, "The loss working set"): full is Hugging
 * Face's (lm_head's bf16 logits, their fp32 copy, log-softmax + NLL);
 * chunked a fused linear cross-entropy (Liger's): the logits exist a chunk
 * of tokens at a time and the gradients are computed in forward. */
enum { SYNTH_LOSS_FULL = 0, SYNTH_LOSS_CHUNKED = 1 };
/* Training state on the device (docs/simulator.md, "Resident memory"):
 * the optimizer's state bytes per trainable parameter and whether an fp32
 * master copy is kept (auto: when the parameters are 16-bit). */
enum {
  SYNTH_OPT_ADAMW = 0,    /* two states in the stepped copy's dtype: 8 B with fp32 */
  SYNTH_OPT_ADAMW_8BIT,   /* bitsandbytes: two uint8 states + fp32 absmax per 256 */
  SYNTH_OPT_SGD,          /* none */
  SYNTH_OPT_SGD_MOMENTUM, /* one, in the stepped copy's dtype */
  SYNTH_OPT_NONE          /* no optimizer step at all */
};
enum { SYNTH_MASTER_AUTO = 0, SYNTH_MASTER_ON = 1, SYNTH_MASTER_OFF = 2 };
/* What an RMSNorm saves (docs/simulator.md, "Saved tensors per op"): fused,
 * one kernel (torch's _fused_rms_norm, Liger's RMSNorm: the input, its rstd
 * and the weight); eager, Hugging Face's LlamaRMSNorm as written, op by op
 * (the fp32 input, rstd, the normalized tensor: what a CPU run or a GPU run
 * without fused kernels saves). */
enum { SYNTH_NORM_FUSED = 0, SYNTH_NORM_EAGER = 1 };
/* What selective checkpointing recomputes (bit mask). */
enum {
  SYNTH_RECOMPUTE_ATTN_CORE = 1u << 0, /* softmax & co: the s^2 tensors */
  SYNTH_RECOMPUTE_MLP_ACT = 1u << 1    /* the MLP activation's output */
};

typedef struct synth_model {
  char name[64];
  int arch;        /* SYNTH_LLAMA or SYNTH_GPT */
  int layers, hidden, heads, kv_heads, ffn, vocab;
  int seq, micro_batch;
  int dtype;       /* ferry_dtype of activations and weights */
  int flash;       /* FlashAttention: no s^2 tensors */
  int checkpoint;  /* SYNTH_CKPT_* */
  unsigned recompute; /* SYNTH_RECOMPUTE_* for selective */
  int shard;       /* data-parallel sharding degree (FSDP / ZeRO-3), >= 1 */
  double tflops;   /* achieved matmul throughput, TFLOP/s */
  double hbm_gbps; /* achieved memory bandwidth of element-wise kernels, GB/s */
  int steps;       /* steps in the trace */
  int ckpt_every;  /* full:K: the blocks whose 1-based index is a multiple of K (1: all) */
  int head_dim;    /* 0: hidden / heads */
  int qk_norm;     /* Qwen3: RMSNorm over head_dim on q and k */
  int experts, top_k, expert_ffn; /* MoE (llama arch): 0 = dense; expert_ffn 0 = ffn */
  int tie_embeddings; /* the head shares the embedding's weight */
  int loss;           /* SYNTH_LOSS_* */
  int loss_chunk;     /* chunked: tokens per chunk; 0 = Liger's rule (synth_loss_chunk) */
  int param_dtype;    /* stored parameters; FERRY_DTYPE_UNKNOWN (0) = dtype */
  int grad_dtype;     /* gradients; 0 = the parameters' */
  int master_weights; /* SYNTH_MASTER_* */
  int optimizer;      /* SYNTH_OPT_* */
  double lora;        /* trainable share of the parameters (LoRA); 0 = all */
  int tp;             /* Megatron tensor parallelism degree; 0 or 1 = none */
  int sp;             /* sequence parallelism (needs tp > 1) */
  int norm;           /* SYNTH_NORM_*: the RMSNorms' kernels (llama arch) */
} synth_model;

/* The resident bytes per GPU, by part (synth_resident_parts). */
typedef struct synth_resident {
  uint64_t local_params; /* parameters per tensor-parallel rank, before sharding */
  uint64_t trainable;    /* of them, trained (LoRA: the share) */
  uint64_t params, grads, master, states, gathered; /* bytes per GPU */
  uint64_t total;
  /* of params, one repeated block's (its linears and norms; the trace's
   * "layer_bytes", what weight offload moves per layer) */
  uint64_t layer_params;
} synth_resident;

/* Fill *m with a preset (synth_preset_names()) and the defaults (seq 8192,
 * micro-batch 1, bf16, flash on, no checkpointing, shard 8, 400 TFLOP/s,
 * 2000 GB/s, 1 step). -1 if unknown. */
FERRY_API int synth_preset(const char *name, synth_model *m);
/* Names of the presets, for help texts. */
FERRY_API const char *synth_preset_names(void);
/* 0, or -1 with a message naming the bad field (or the checkpointing mode
 * that would change nothing: selective with FlashAttention). */
FERRY_API int synth_validate(const synth_model *m, char *err, size_t errlen);
/* Write the trace; 0, or -1 with a message (I/O error). */
FERRY_API int synth_write(const synth_model *m, FILE *f, char *err, size_t errlen);

/* Bytes of the distinct activation buffers one layer's ops save in the
 * forward pass without checkpointing (no parameters; a buffer saved by
 * several ops counts once; the model-wide rotary tables included, which
 * only the first layer that saves packs: synth_layer_saved_bytes). */
FERRY_API uint64_t synth_layer_activation_bytes(const synth_model *m);
/* What layer `layer` keeps from its forward pass to its backward under
 * m's checkpointing (the trace's forward-phase activation packs). */
FERRY_API uint64_t synth_layer_saved_bytes(const synth_model *m, int layer);
/* Tokens per chunk of the chunked loss: m->loss_chunk, or Liger's rule
 * next_pow2(ceil(tokens / ceil(vocab / hidden))); at most the tokens. */
FERRY_API int64_t synth_loss_chunk(const synth_model *m);
/* The layers m's checkpointing applies to (full:K: layers / K). */
FERRY_API int synth_checkpointed_layers(const synth_model *m);
/* Parameters of the model (MoE: all experts; active: the router and top_k
 * experts per layer), and the resident bytes per GPU (parameters,
 * gradients, optimizer states, sharded by m->shard). */
FERRY_API uint64_t synth_param_count(const synth_model *m);
FERRY_API uint64_t synth_active_param_count(const synth_model *m);
FERRY_API uint64_t synth_resident_bytes(const synth_model *m);
/* The same by part: stored parameters (all, sharded), gradients, fp32
 * master weights and optimizer states (the trainable ones), the gathered
 * blocks of sharded training; per tensor-parallel rank. */
FERRY_API void synth_resident_parts(const synth_model *m, synth_resident *out);
/* Bytes an optimizer keeps per trainable parameter (the 8-bit states'
 * block scales apart: synth_resident_parts counts them). */
FERRY_API double synth_optimizer_state_bytes(const synth_model *m);
/* "adamw", "adamw8bit", "sgd", "sgd-momentum", "none"; parse: -1 if unknown. */
FERRY_API const char *synth_optimizer_name(int optimizer);
FERRY_API int synth_optimizer_parse(const char *name);


/* ---- "what fits?" (sim_fit.c): a policy template's knobs searched for the
 * lowest step time whose steady peak fits the device and whose pinned host
 * memory fits the host budget (docs/simulator.md, `ferry sim --fit`) */
typedef struct sim_fit_setting {
  uint64_t host_bytes;  /* HOST_BYTES: offloaded bytes per step, at most */
  int keep_last;        /* KEEP_LAST: layers kept on device */
  int fwd_stash;        /* FWD_STASH: forward stash depth */
  int prefetch_layers;  /* PREFETCH_LAYERS: reload distance in backward */
  double step_us;       /* steady-state step time */
  uint64_t peak_device_bytes, host_reserved_bytes;
  int fits;
} sim_fit_setting;

typedef struct sim_fit_config {
  const char *policy_template; /* Lua source with those four `local` lines
                                  (policies/host_budget.lua) */
  sim_config replay;           /* link, steps, warmup, host RAM, pinned cost */
  uint64_t device_bytes;       /* the device memory to fit in */
  uint64_t host_bytes;         /* pinned host budget per rank */
} sim_fit_config;

typedef struct sim_fit_result {
  sim_fit_setting *settings; /* every setting tried, in search order */
  uint32_t n;
  int best; /* index of the chosen one, -1 if none fits */
  uint64_t span_bytes; /* HOST_BYTES goes 0..this in sixteenths: the budget,
                          or the step's offloadable bytes if fewer */
} sim_fit_result;

FERRY_API int sim_fit(const sim_trace *t, const sim_fit_config *c, sim_fit_result *out, char *err,
                      size_t errlen);
FERRY_API void sim_fit_result_free(sim_fit_result *r);
/* The template with the setting's knobs written in (malloc'd; NULL if a
 * knob line is missing). */
FERRY_API char *sim_fit_source(const char *tmpl, const sim_fit_setting *s);
/* src with its line `local KNOB = ...` set to value; NULL if none. */
FERRY_API char *sim_policy_set_knob(const char *src, const char *knob, const char *value);

/* ---- simulator reports: hardware presets, link syntax, tables, JSON, Chrome trace, SVG
 */

typedef struct sim_hw {
  const char *name;
  const char *description;
  ferry_link link;
  double duplex_d2h, duplex_h2d; /* per direction, as measured */
  double device_bytes;           /* HBM capacity */
  const char *source;
  double host_ram_bytes;         /* host RAM per GPU: the node's / GPUs per node */
  double peak_tflops;            /* dense BF16 tensor-core peak, TFLOP/s */
  double hbm_bytes_per_s;        /* device-memory (HBM) bandwidth, datasheet */
} sim_hw;
/* The default sustained fraction of peak (--mfu): 0.40, Llama 3's 38-43%
 * BF16 MFU on H100 (docs/simulator.md). */
#define SIM_DEFAULT_MFU 0.40
/* The fraction of the datasheet HBM bandwidth memory-bound ops reach
 * (--hbm overrides): 0.60, the synthesizer's 2000 GB/s on H100's 3.35 TB/s
 * (docs/hardware.md: a modelling choice, not a measurement). */
#define SIM_DEFAULT_HBM_FRACTION 0.60
/* sim_config.hbm_bytes_per_s when 0: the synthesizer's default, 2000 GB/s. */
#define SIM_DEFAULT_HBM_BYTES_PER_S 2e12

/* The share of a device's memory a training run cannot count on: the CUDA
 * context (~0.3 GiB with lazy module loading, over 1 GiB before CUDA 11.7)
 * and the caching allocator's reserved-but-unallocated blocks (1.83 GiB with
 * 78.09 GiB in use in one published OOM, 2.3%), which the sim does not
 * model: 5% (docs/hardware.md, "Device memory headroom"). */
#define SIM_DEVICE_HEADROOM 0.05
/* What a run may peak at on hw: its device memory less SIM_DEVICE_HEADROOM
 * (`ferry sim`'s "fits", `--fit device`). */
FERRY_API double sim_hw_usable_bytes(const sim_hw *hw);

/* NULL if unknown. */
FERRY_API const sim_hw *sim_hw_preset(const char *name);
FERRY_API const char *sim_hw_names(void);
/* "h2d=55GB/s,d2h=55GB/s,latency=5us,duplex=0.9" over *hw (fields not
 * named keep their values). 0, or -1 with a message. */
FERRY_API int sim_parse_link(const char *spec, sim_hw *hw, char *err, size_t errlen);

typedef struct sim_run_info {
  const char *trace_path;
  const sim_trace *trace;
  const sim_hw *hw;
  /* device memory the trace does not hold, in every run's peak
   * (sim_config.untracked_bytes): given (ferry sim --untracked BYTES), or
   * the trace's device_peak (observed) less its recorded decisions'
   * replayed peak */
  uint64_t untracked_bytes, untracked_observed, untracked_replayed;
  int untracked_given;
} sim_run_info;

/* rs[0] is the baseline (no offload), rs[1..n-1] the policies. */
FERRY_API void sim_print_table(FILE *f, const sim_run_info *info, const sim_result *rs, int n);
FERRY_API void sim_print_layers(FILE *f, const sim_result *rs, int n);
FERRY_API int sim_write_json(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                   char *err, size_t errlen);
FERRY_API int sim_write_chrome_trace(const char *path, const sim_result *rs, int n, char *err,
                           size_t errlen);
/* Device memory over the last step per run (left axis), pinned host memory
 * in use (right axis), the exposed waits, backward's start and the peaks
 * (sim_plot.c; docs/simulator.md, "Outputs"). Needs sim_config.timeline. */
FERRY_API int sim_write_svg(const char *path, const sim_run_info *info, const sim_result *rs, int n,
                  char *err, size_t errlen);
/* One self-contained page (no script, font or URL loaded): the comparison
 * table, the text report, the SVG inline and per-layer bars of bytes
 * offloaded and kept per policy. */
FERRY_API int sim_write_html(const char *path, const sim_run_info *info, const sim_result *rs,
                             int n, char *err, size_t errlen);


/* ---- the zip writer of checkpoint snapshots (stored entries, ZIP64, 64-byte aligned data); errors are errno values
 */

#define ZIP_MAX_NAME 0xffff /* the name length field is 16 bits */

typedef struct zip_entry_info {
  uint64_t header_offset;
  uint64_t size;
  uint32_t crc;
  uint16_t name_len;
  int zip64; /* a ZIP64 extra field in the local header: 64-bit descriptor sizes */
  char *name;
} zip_entry_info;

typedef struct zip_writer {
  int fd;
  uint64_t offset;         /* bytes of the archive produced so far */
  uint64_t flushed;        /* bytes of it already in the file */
  unsigned char *buf;      /* small writes are gathered here */
  size_t buf_len, buf_cap;
  zip_entry_info *entries;
  size_t n_entries, cap_entries;
  uint64_t written_in_entry; /* data bytes of the open entry so far */
  uint32_t crc;              /* running CRC-32 of the open entry */
  int open;                  /* an entry is between begin and end */
  const char *failed_op;     /* "write", "pwrite", ... after an error */
} zip_writer;

/* fd: a new, empty file opened for writing (not closed by the writer). */
FERRY_API int zipw_init(zip_writer *z, int fd);
/* Frees the writer's memory; does not close fd. */
FERRY_API void zipw_free(zip_writer *z);
FERRY_API int zipw_begin_entry(zip_writer *z, const char *name, uint64_t size);
FERRY_API int zipw_write(zip_writer *z, const void *data, size_t n);
/* EINVAL if fewer or more bytes than declared were written. */
FERRY_API int zipw_end_entry(zip_writer *z);
/* Central directory and end records; everything is in the file afterwards. */
FERRY_API int zipw_finish(zip_writer *z);

/* Values at or above this threshold are written as ZIP64 (default
 * 0xffffffff, the spec's). Tests lower it to exercise the ZIP64 paths with
 * small files; it applies to archives begun after the call. */
FERRY_API void zipw_set_zip64_threshold(uint64_t threshold);


#ifdef __cplusplus
}
#endif

#endif
