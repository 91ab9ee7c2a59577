/*
 * ferry_tools.h — what ferry's own tools use of the engine beyond ferry.h:
 * the CLI, the Python extension, the LuaJIT module, the benchmarks and the
 * tests. Installed, but not a stable API: it changes with any release and
 * carries no ABI promise. Embedders use ferry.h alone. The simulator's
 * declarations are in ferry_sim.h, included at the end.
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
  int has_max_fwd_stash_bytes, has_release_when_copied, has_max_tail_prefetch, has_sync_copies;
  int has_one_copy_stream;
  uint32_t max_fwd_stash;
  uint32_t prefetch_distance;
  uint64_t min_offload_bytes;
  uint64_t max_fwd_stash_bytes;
  uint32_t release_when_copied; /* 0 or 1 */
  uint32_t max_tail_prefetch;
  uint32_t sync_copies; /* FERRY_SYNC_* */
  uint32_t one_copy_stream; /* 0 or 1 (ferry_knobs.one_copy_stream) */
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

/* ---- the sim backend's virtual clock, stall counters and copy listener (docs/sim-model.md)
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
  /* compute time added by copies beside memory-bound kernels (in now_us) */
  double contention_us;
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
/* The same for a memory-bound kernel of us µs alone: while copies run it
 * progresses at 1 - (their bytes/µs) / (the contention bandwidth), the
 * share of device memory's bandwidth the copies take (sim_backend_set_node;
 * none while that is 0). */
FERRY_API void sim_backend_advance_memory_bound(ferry_backend *b, double us);
/* Node sharing and contention (docs/sim-model.md, "Time model"): the
 * host-memory bandwidth this GPU's copies of both directions share, bytes/s
 * (0 = unlimited), and the device-memory bandwidth that copies take their
 * share of from memory-bound kernels, bytes/s (0 = no contention). */
FERRY_API int sim_backend_set_node(ferry_backend *b, double host_mem_bytes_per_s,
                                   double contention_hbm_bytes_per_s);
FERRY_API double sim_backend_now(ferry_backend *b);
/* Runs the link up to now, so that copies finished by now are counted. */
FERRY_API void sim_backend_get_stats(ferry_backend *b, sim_backend_stats *out);
/* Its stall_us and host_wait_us alone (the link run up to now alike): what
 * the replay reads at each event, without copying the rest. */
FERRY_API void sim_backend_waits(ferry_backend *b, double *stall_us, double *host_wait_us);
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
/* Other traffic on the link (a NIC behind the GPU's PCIe switch: GPUDirect
 * RDMA crosses it): from now on until `until_us` (the backend's clock; the
 * caller's estimate of when that traffic ends, INFINITY: until told again),
 * `flows` transfers besides the copies share each direction, as copies
 * share it, and count as that direction busy for the duplex factor; a wait
 * inside the backend that outlasts `until_us` sees the link free of them
 * from then on. Returns the copies in progress now per direction
 * (active[0] D2H, active[1] H2D; may be NULL), which the caller needs to
 * know its own share (docs/sim-model.md, "Collectives"). */
FERRY_API void sim_backend_share_link(ferry_backend *b, unsigned flows, double until_us,
                                      unsigned active[2]);


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
/* Gives every backend allocation with nothing in use in it back to the
 * backend (unpinned and unmapped), as long as reserved stays >= keep_bytes;
 * returns the bytes given back. Live allocations are untouched; later
 * allocations grow the arena again. */
FERRY_API uint64_t ferry_arena_release_free(ferry_arena *a, uint64_t keep_bytes);
FERRY_API const char *ferry_arena_kind_name(const ferry_arena *a); /* "jemalloc"/"pool" */
/* Whether jemalloc's API is present in this process. */
FERRY_API int ferry_arena_jemalloc_available(void);
/* MemTotal from /proc/meminfo in bytes, 0 if unknown. */
FERRY_API uint64_t ferry_mem_total_bytes(void);


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

/* fd: a new, empty file opened for writing (not closed by the writer). fd
 * -1: memory mode, for a caller that lays the file out itself (checkpoint
 * staging's file image): the headers, descriptors and end records gather in
 * z->buf (z->buf_len bytes, at archive offset z->offset - z->buf_len); the
 * caller takes them and sets buf_len to 0. */
FERRY_API int zipw_init(zip_writer *z, int fd);
/* Frees the writer's memory; does not close fd. */
FERRY_API void zipw_free(zip_writer *z);
FERRY_API int zipw_begin_entry(zip_writer *z, const char *name, uint64_t size);
FERRY_API int zipw_write(zip_writer *z, const void *data, size_t n);
/* n bytes of the open entry's data that the caller placed at the archive's
 * offset itself (memory mode): counted, checksummed from data (NULL: not
 * checksummed, for a layout computed ahead), not emitted. */
FERRY_API int zipw_place(zip_writer *z, const void *data, size_t n);
/* EINVAL if fewer or more bytes than declared were written. */
FERRY_API int zipw_end_entry(zip_writer *z);
/* Central directory and end records; everything is in the file afterwards. */
FERRY_API int zipw_finish(zip_writer *z);

/* Values at or above this threshold are written as ZIP64 (default
 * 0xffffffff, the spec's). Tests lower it to exercise the ZIP64 paths with
 * small files; it applies to archives begun after the call. */
FERRY_API void zipw_set_zip64_threshold(uint64_t threshold);
/* How checkpoint staging writes its file image (tests; applies to snapshots
 * whose writer starts after the call): AUTO (O_DIRECT where the file system
 * takes it, the default), OFF (buffered write()s, as before O_DIRECT), or
 * REFUSED (as AUTO, but the first direct write behaves as if the kernel
 * refused it with EINVAL: the fallback path on any file system). */
enum { FERRY_SNAP_DIO_AUTO = 0, FERRY_SNAP_DIO_OFF = 1, FERRY_SNAP_DIO_REFUSED = 2 };
FERRY_API void ferry_snapshot_set_direct_io(int mode);
/* Where checkpoint staging writes its windows (tests; read, as
 * FERRY_SNAPSHOT_WRITE_THREAD, by each snapshot's writer when it begins
 * the file, so set it while no snapshot runs): 1, the default, on a write thread of each
 * snapshot, so that the writer checksums the next window while the disk
 * takes this one; 0 on the writer thread, one after the other (as does
 * FERRY_SNAPSHOT_WRITE_THREAD=0). The window hook, when set, is called on
 * the writer thread with FERRY_SNAP_WINDOW_FILLED when a window is handed on
 * to be written, and with FERRY_SNAP_WINDOW_WRITE just before a window is
 * written (on the thread that writes it); a nonzero return there fails that
 * write with it as the errno. NULL: none. */
enum { FERRY_SNAP_WINDOW_FILLED = 0, FERRY_SNAP_WINDOW_WRITE = 1 };
typedef int (*ferry_snapshot_window_hook)(void *ud, int event, uint64_t off, size_t len);
FERRY_API void ferry_snapshot_set_write_thread(int on);
FERRY_API void ferry_snapshot_set_window_hook(ferry_snapshot_window_hook fn, void *ud);
/* The CRC-32 of the archives (zlib's: crc32(crc32(0, a), b) = crc32(0, ab)),
 * computed by libdeflate where libdeflate.so.0 is found, else zlib; which
 * one: "libdeflate" or "zlib" (FERRY_CRC32=zlib forces zlib). */
FERRY_API uint32_t zipw_crc32(uint32_t crc, const void *data, size_t n);
FERRY_API const char *zipw_crc32_impl(void);


#ifdef __cplusplus
}
#endif

#include "ferry_sim.h"

#endif
