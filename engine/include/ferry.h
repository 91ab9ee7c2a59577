/*
 * ferry.h — the one public header of libferry, a tensor offload engine.
 *
 * ferry moves tensors saved for backward between device memory and a pinned
 * host arena. The embedder (a trainer hook, a C training loop, the trace
 * replayer) calls ferry_pack() when a tensor is saved and ferry_unpack() when
 * it is needed again; a policy decides per tensor whether to offload it.
 *
 * Conventions
 *   - Every function that can fail returns an int: 0 (FERRY_OK) on success, a
 *     negative FERRY_E* code on failure. ferry_last_error() gives the detailed
 *     message of the last failure on an engine (per engine, not per thread).
 *   - Handles are opaque; create/destroy come in pairs.
 *   - ABI: structs passed in carry their own size (struct_size); fields are
 *     only ever appended. Same major version = ABI compatible.
 *   - Ownership: the embedder hands the engine one reference ("owner token")
 *     to a device buffer in ferry_pack(); the engine gives exactly one
 *     reference back, either through ferry_unpack() or through the release
 *     callback. Nothing handed to ferry is ever lost.
 *   - A refused call (a negative return) changes nothing, unless its comment
 *     says otherwise.
 *   - Threads: every call on an engine may be made from any thread, at the
 *     same time as others (one lock per engine), except
 *     ferry_engine_destroy(), which must come after every other call on that
 *     engine has returned, and after which no call may start: ferry refuses
 *     a call (or a second destroy) on a destroyed engine with FERRY_ESTATE as
 *     long as it can tell it from a live one (the addresses of the last 16
 *     engines destroyed are not given to new ones), but cannot make a call
 *     that overlaps the destroy safe.
 *   - Callbacks run on the thread of the call that makes them. Where a call
 *     makes one, its comment below says which and whether the engine lock
 *     is held. Without the lock (device_alloc, release, host_reserve) a
 *     callback may call ferry on the same engine, except ferry_unpack() or
 *     ferry_prefetch() of the handle whose reload it is allocating for, and
 *     ferry_engine_destroy(). With the lock (decide, retain, host_ram) it must
 *     be quick and must not call ferry on that engine: it would deadlock.
 *   - Strings returned: static (never freed) unless the function says how
 *     long its string lives.
 */
#ifndef FERRY_H
#define FERRY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FERRY_API __declspec(dllexport)
#elif defined(__GNUC__)
#define FERRY_API __attribute__((visibility("default")))
#else
#define FERRY_API
#endif

/* ---- version ------------------------------------------------------------ */
#define FERRY_VERSION_MAJOR 0
#define FERRY_VERSION_MINOR 1
#define FERRY_VERSION_PATCH 0
#define FERRY_VERSION_HEX \
  ((FERRY_VERSION_MAJOR << 16) | (FERRY_VERSION_MINOR << 8) | FERRY_VERSION_PATCH)

/* Runtime version, FERRY_VERSION_HEX of the library actually loaded. */
FERRY_API unsigned ferry_version(void);
FERRY_API const char *ferry_version_string(void);

/* ---- errors ------------------------------------------------------------- */
/* One list generates the enum, the names and the messages. */
#define FERRY_ERRNO_MAP(X)                                                   \
  X(OK, 0, "success")                                                        \
  X(EINVAL, -1, "invalid argument")                                          \
  X(ENOMEM, -2, "out of host memory")                                        \
  X(ECAP, -3, "pinned host memory cap reached")                              \
  X(ENODEV, -4, "no usable device or driver for this backend")               \
  X(EBACKEND, -5, "backend operation failed")                                \
  X(EHANDLE, -6, "unknown, stale or already unpacked handle")                \
  X(EALLOC, -7, "device allocator callback failed")                          \
  X(ESTATE, -8, "call not valid in the engine's current state")              \
  X(ELEAK, -9, "handles still live at step end")                             \
  X(EPOLICY, -10, "policy error")                                            \
  X(EIO, -11, "input/output error")                                          \
  X(EUNSUPPORTED, -12, "not supported by this build or backend")             \
  X(EVERSION, -13, "struct or API version mismatch")                         \
  X(EPARSE, -14, "malformed input")                                          \
  X(ENOENT, -15, "no such file or policy")

typedef enum ferry_status {
#define FERRY_ENUM_(name, code, msg) FERRY_##name = code,
  FERRY_ERRNO_MAP(FERRY_ENUM_)
#undef FERRY_ENUM_
} ferry_status;

/* Static message for a code ("invalid argument"); never NULL. */
FERRY_API const char *ferry_strerror(int code);
/* Static name for a code ("FERRY_EINVAL"); never NULL. */
FERRY_API const char *ferry_err_name(int code);

/* ---- tensors ------------------------------------------------------------ */
#define FERRY_MAX_DIMS 8

/* Every dtype, once: X(ENUM, name, bytes per element, torch name, numpy
 * char). The enum, the names in traces and reports, the LuaJIT cdef, the
 * Python binding and the docs all come from this list; "" where numpy has
 * no such type. */
#define FERRY_DTYPE_LIST(X)                       \
  X(F32, "f32", 4, "float32", "f")                \
  X(F16, "f16", 2, "float16", "e")                \
  X(BF16, "bf16", 2, "bfloat16", "")              \
  X(F64, "f64", 8, "float64", "d")                \
  X(F8E4M3, "f8e4m3", 1, "float8_e4m3fn", "")     \
  X(F8E5M2, "f8e5m2", 1, "float8_e5m2", "")       \
  X(I64, "i64", 8, "int64", "q")                  \
  X(I32, "i32", 4, "int32", "i")                  \
  X(I16, "i16", 2, "int16", "h")                  \
  X(I8, "i8", 1, "int8", "b")                     \
  X(U8, "u8", 1, "uint8", "B")                    \
  X(BOOL, "bool", 1, "bool", "?")

#define FERRY_DTYPE_ENUM_(e, name, bytes, torch, np) FERRY_DTYPE_##e,
typedef enum ferry_dtype {
  FERRY_DTYPE_UNKNOWN = 0,
  FERRY_DTYPE_LIST(FERRY_DTYPE_ENUM_)
  FERRY_DTYPE_COUNT_
} ferry_dtype;
#undef FERRY_DTYPE_ENUM_

/* "bf16" for FERRY_DTYPE_BF16, "unknown" for anything else; never NULL. */
FERRY_API const char *ferry_dtype_name(int dtype);
/* Bytes per element, 0 for FERRY_DTYPE_UNKNOWN or out of range. */
FERRY_API int ferry_dtype_size(int dtype);
/* The dtype named "bf16" (or torch's "bfloat16"), -1 if none is. */
FERRY_API int ferry_dtype_from_name(const char *name);

typedef enum ferry_kind {
  FERRY_KIND_ACTIVATION = 0,
  FERRY_KIND_PARAMETER = 1,
  FERRY_KIND_BUFFER = 2,
  FERRY_KIND_OTHER = 3
} ferry_kind;

typedef enum ferry_phase {
  FERRY_PHASE_FORWARD = 0,
  FERRY_PHASE_RECOMPUTE = 1, /* packed during backward by checkpointing */
  FERRY_PHASE_BACKWARD = 2
} ferry_phase;

enum ferry_tensor_flags {
  FERRY_FLAG_VIEW = 1u << 0,       /* a view of another tensor's storage */
  FERRY_FLAG_CONTIGUOUS = 1u << 1,
  /* The storage's owner may free or rewrite its bytes once ferry_pack
   * returns (FSDP frees all-gathered weights with resize_(0) while
   * references remain): an offload copy is waited for inside ferry_pack and
   * the device buffer released, so unpack reloads the bytes as packed. */
  FERRY_FLAG_RESIZABLE = 1u << 2
};

/*
 * What the engine and the policy know of a tensor. Plain data with a fixed
 * layout: policies read it as FFI cdata, nothing is copied per call.
 * Strings are borrowed for the duration of ferry_pack(); pass pointers from
 * ferry_intern() so that decisions can be cached per site without hashing.
 */
typedef struct ferry_tensor_desc {
  uint64_t bytes;
  int32_t dtype;  /* ferry_dtype */
  int32_t kind;   /* ferry_kind */
  int32_t ndim;
  uint32_t flags; /* ferry_tensor_flags */
  int64_t shape[FERRY_MAX_DIMS];
  int32_t layer;       /* index of the repeated block, -1 if none */
  int32_t layer_count; /* number of repeated blocks, 0 if unknown */
  int32_t phase;       /* ferry_phase */
  int32_t reserved0;
  const char *module_path;  /* "model.layers.3.mlp.up_proj", or NULL */
  const char *module_class; /* "Linear", or NULL */
} ferry_tensor_desc;

/* A descriptor of which nothing is known yet: no layer (-1), no layer count,
 * forward phase. Start from this, not from memset: zero would mean layer 0. */
#define FERRY_TENSOR_DESC_INIT {.layer = -1}

/* ---- decisions ---------------------------------------------------------- */
typedef enum ferry_action {
  FERRY_KEEP = 0,   /* leave on device; unpack gives the same buffer back */
  FERRY_OFFLOAD = 1 /* copy to the pinned arena, release the device buffer */
} ferry_action;

typedef enum ferry_reload {
  FERRY_RELOAD_ON_USE = 0,  /* copy back when unpacked */
  FERRY_RELOAD_PREFETCH = 1 /* also start reloads of earlier-packed tensors */
} ferry_reload;

typedef struct ferry_decision {
  int32_t action;            /* ferry_action */
  int32_t reload;            /* ferry_reload */
  int32_t prefetch_distance; /* tensors ahead, with FERRY_RELOAD_PREFETCH */
  int32_t cacheable;         /* the same site always gets this answer */
} ferry_decision;

/* What a policy may look at besides the tensor. Filled by the engine. */
typedef struct ferry_context {
  uint64_t step;
  int32_t phase;            /* ferry_phase of the engine */
  int32_t reserved0;
  /* host RAM in use, %, sampled once per step; NaN: not sampled (the
   * engine samples it only for a C decide callback or a policy that has
   * read it, which samples it itself at its first read in the step) */
  double host_ram_used_pct;
  uint64_t arena_in_use;
  uint64_t arena_cap;       /* 0 = no cap */
  uint64_t stash_depth;     /* device buffers held in the forward stash */
  uint64_t bytes_in_flight; /* copies issued and not yet complete */
  uint64_t packed_this_step;
  uint64_t offloaded_this_step;
  uint64_t bytes_offloaded_this_step;
  /* offloads so far this step by layer index, for layers < layers_tracked */
  const uint32_t *offloaded_per_layer;
  uint32_t layers_tracked;
  uint32_t reserved1;
} ferry_context;

/* The decision callback (the policy host replaces it when a policy is set).
 * Returns 0 and fills *out; any other return, or a nonsense answer, means
 * FERRY_KEEP and counts a policy error. Called from ferry_pack with the
 * engine lock held. */
typedef int (*ferry_decide_fn)(void *ud, const ferry_tensor_desc *desc,
                               const ferry_context *ctx, ferry_decision *out);

/* ---- embedder callbacks ------------------------------------------------- */
/* Host RAM in bytes: total and available now (MemAvailable); 0 on success.
 * Called with the engine lock held when a step starts (ferry_step_begin, or
 * the first ferry_pack, ferry_pack_cached_keep or ferry_backward_begin of a
 * step) and by a policy that reads host_ram_used_pct (inside decide, also
 * under the lock); without it in ferry_engine_create (host_cap_pct). */
typedef int (*ferry_host_ram_fn)(void *ud, uint64_t *total_bytes, uint64_t *available_bytes);

/* Allocate a device buffer of `bytes` usable in the order of `stream` (the
 * compute stream passed to the call that needs it; NULL from
 * ferry_backward_begin). Returns 0 and sets the buffer and an owner token
 * holding one reference to it. Called with no engine lock held, from
 * ferry_unpack and ferry_prefetch (the tensor asked for, and tensors
 * prefetched ahead of it) and from ferry_backward_begin (its prefetch, with
 * config.prefetch_at_backward_begin). It may ferry_discard any handle,
 * that of the tensor it allocates for included (the call that reloads it
 * then gives the new buffer back and fails with FERRY_EHANDLE, or, for a
 * prefetch, only starts no copy). */
typedef int (*ferry_alloc_fn)(void *ud, uint64_t bytes, void *stream,
                              void **device_ptr, void **owner);
/* Drop the reference held by an owner token. Called with no engine lock
 * held: from ferry_pack (a buffer the stash bound pushes out; the second
 * reference of a buffer packed twice), ferry_unpack and ferry_prefetch (a
 * reload that failed after device_alloc), ferry_discard, and
 * ferry_engine_destroy (every buffer still held; no ferry call on that
 * engine from there). */
typedef void (*ferry_release_fn)(void *ud, void *owner);
/* Add a reference to an owner token (optional; enables storing a buffer
 * that is packed twice only once). Called with the engine lock held, from
 * ferry_unpack of a handle whose buffer other handles still share. */
typedef void (*ferry_retain_fn)(void *ud, void *owner);
/* Around a wait for another thread's reload of the same tensor (optional;
 * see ferry_config.wait_begin). */
typedef void *(*ferry_wait_begin_fn)(void *ud);
typedef void (*ferry_wait_end_fn)(void *ud, void *token);

/* ---- engine ------------------------------------------------------------- */
typedef struct ferry_engine ferry_engine;
typedef uint64_t ferry_handle; /* 0 is never a valid handle */

typedef enum ferry_backend_kind {
  FERRY_BACKEND_HOST = 0, /* worker threads emulate streams and events */
  FERRY_BACKEND_CUDA = 1, /* the CUDA runtime */
  FERRY_BACKEND_SIM = 2   /* virtual clock, memory only counted */
} ferry_backend_kind;

typedef enum ferry_arena_kind {
  FERRY_ARENA_AUTO = 0,     /* jemalloc when in the process, else pool */
  FERRY_ARENA_JEMALLOC = 1, /* fail at creation if jemalloc is absent */
  FERRY_ARENA_POOL = 2      /* ferry's own size-class pool */
} ferry_arena_kind;

/* A copy link model for the host backend (0 = unthrottled) and the sim. */
typedef struct ferry_link {
  double d2h_bytes_per_s;
  double h2d_bytes_per_s;
  double latency_us; /* fixed cost per copy */
  double duplex;     /* fraction of bandwidth each way when both run, (0,1] */
} ferry_link;

/* Consulted before the pinned arena takes `bytes` more from the backend
 * (release = 0; nonzero return refuses it, as the cap would) and when it
 * gives them back (release = 1): lets several processes share one node-wide
 * host budget. Never called with an engine lock held: from ferry_pack (an
 * offload that grows the arena), ferry_resident_create,
 * ferry_snapshot_start and ferry_engine_destroy (release). */
#define FERRY_HAVE_RESERVE_FN 1
typedef int (*ferry_reserve_fn)(void *ud, uint64_t bytes, int release);

typedef struct ferry_config {
  uint32_t struct_size; /* sizeof(ferry_config) of the caller */
  uint32_t version;     /* FERRY_VERSION_HEX of the caller's header */
  int32_t backend;      /* ferry_backend_kind */
  int32_t device;       /* CUDA device ordinal; -1 = the current device */
  int32_t arena;        /* ferry_arena_kind */
  uint32_t max_fwd_stash;     /* offloaded device buffers kept alive */
  uint64_t host_cap_bytes;    /* pinned arena hard cap; 0 = none */
  double host_cap_pct;        /* cap as % of MemTotal; 0 = none; min wins */
  uint64_t min_offload_bytes; /* smaller tensors are always kept */
  uint32_t prefetch_distance; /* default distance for FERRY_RELOAD_PREFETCH */
  uint32_t reserved0;
  ferry_link link;
  /* device memory */
  ferry_alloc_fn device_alloc;
  ferry_release_fn release;
  ferry_retain_fn retain;
  void *callback_ud;
  /* decisions: a C callback, or a policy (see the policy host) */
  ferry_decide_fn decide;
  void *decide_ud;
  const char *policy_path;   /* Lua policy file */
  const char *policy_source; /* or Lua source text */
  int32_t policy_trusted;    /* allow FFI in the policy */
  int32_t reserved1;
  /* JSONL trace of every pack/unpack/step event (docs/trace-format.md) */
  const char *trace_path;
  /* optional shared host budget (e.g. all ranks of a node) */
  ferry_reserve_fn host_reserve;
  void *host_reserve_ud;
  /* also bound the forward stash by bytes (0 = by count only): a count is a
   * poor proxy when tensor sizes vary by orders of magnitude */
  uint64_t max_fwd_stash_bytes;
  /* tests and soak runs only: fail backend calls at random, seeded,
   * "seed=N,copy=P,event=P,alloc=P" (docs/security.md); NULL = never */
  const char *faults;
  /* host RAM as the engine sees it, for host_cap_pct and the policies'
   * host_ram_used_pct: NULL reads /proc/meminfo; the simulator gives its
   * hardware's, tests fixed numbers */
  ferry_host_ram_fn host_ram;
  void *host_ram_ud;
  /* 1: a forward-stash buffer is released at the first pack after its D2H
   * copy completed, not only when max_fwd_stash(_bytes) pushes it out: less
   * device memory at the end of forward, but the last tensors packed
   * (backward's first) are reloaded instead of found in the stash. 0
   * (default): the stash keeps them (docs/simulator.md) */
  int32_t release_when_copied;
  /* 1: at ferry_backward_begin, start the reloads backward needs first (the
   * last offloaded tensors, up to their prefetch distance) when the policy
   * asked for prefetching, instead of at the first unpack */
  int32_t prefetch_at_backward_begin;
  /* FERRY_KNOB_* bits: knobs the caller set on purpose, whose config value
   * wins over the policy's (a trainer's keyword argument over the policy
   * file's knob); ferry_get_knobs reports the conflicts in `overruled` */
  uint32_t knobs_fixed;
  uint32_t reserved2;
  /* Chrome trace (Perfetto) of the run: a lane per calling thread and per
   * copy stream, copies with their observed times, offload -> reload arrows,
   * device/pinned/stash counters (docs/pytorch.md#perfetto-traces); NULL =
   * none. Valid JSON after every step end. */
  const char *chrome_trace_path;
  /* 1: count each saved tensor by the rule that decided it and by layer
   * (ferry_get_breakdown). Every decision then goes through the policy's
   * explain, which also names the rule and its file:line: slower than
   * decide, so off by default. */
  int32_t count_reasons;
  uint32_t reserved3;
  /* Called with callback_ud before the calling thread blocks until another
   * thread's reload of the same tensor is done (an unpack or discard of it;
   * the engine lock not held), and after it (wait_begin's return goes to
   * wait_end): an embedder whose callbacks take a global lock its callers
   * hold (Python's GIL: device_alloc runs torch, which lets the GIL go and
   * takes it back) drops that lock meanwhile, or the reloading thread could
   * never finish. NULL = none. */
  ferry_wait_begin_fn wait_begin;
  ferry_wait_end_fn wait_end;
} ferry_config;

#define FERRY_CONFIG_INIT                                          \
  {                                                                \
    .struct_size = sizeof(ferry_config), .version = FERRY_VERSION_HEX, \
    .backend = FERRY_BACKEND_HOST, .device = -1,                   \
    .arena = FERRY_ARENA_AUTO, .max_fwd_stash = 4,                 \
    .min_offload_bytes = 1024, .prefetch_distance = 2,             \
    .link = {0, 0, 0, 1.0}                                         \
  }

/* ---- node budget: one host cap shared by the processes of a node -------- */
/* A POSIX shared-memory segment /name holds the cap and one slot per
 * process; a process that dies (even by SIGKILL) has its share reclaimed on
 * the next reservation of any other. Plug it into an engine with
 *   cfg.host_reserve = ferry_node_budget_reserve; cfg.host_reserve_ud = b; */
typedef struct ferry_node_budget ferry_node_budget;

typedef struct ferry_node_budget_stats {
  uint64_t cap;       /* bytes, the same for every process */
  uint64_t total;     /* held by the live processes */
  uint64_t mine;      /* held by this handle */
  uint64_t mine_peak;
  uint64_t reclaimed; /* taken back from dead processes, ever */
  uint64_t refusals;  /* reservations refused by the cap, ever */
  uint32_t processes; /* live handles on the segment */
  uint32_t reserved0;
} ferry_node_budget_stats;

/* Open (or create) the budget `name` (1-100 characters, no '/') with a cap
 * of cap_bytes > 0, which must match the cap it was created with. Takes a
 * slot for this process. On failure *out is NULL and errbuf says why. */
FERRY_API int ferry_node_budget_open(const char *name, uint64_t cap_bytes,
                                     ferry_node_budget **out, char *errbuf,
                                     size_t errlen);
/* Gives this handle's bytes back and frees its slot. Safe on NULL. The
 * segment stays (see ferry_node_budget_unlink). */
FERRY_API void ferry_node_budget_close(ferry_node_budget *b);
/* A ferry_reserve_fn, ud = the ferry_node_budget: 0 = reserved, 1 = refused
 * (the cap would be exceeded); release != 0 gives bytes back. */
FERRY_API int ferry_node_budget_reserve(void *budget, uint64_t bytes,
                                        int release);
/* Usage after sweeping dead processes; the first `max` live processes' pids
 * and bytes go to pids/bytes when not NULL. */
FERRY_API int ferry_node_budget_get_stats(ferry_node_budget *b,
                                          ferry_node_budget_stats *out,
                                          int32_t *pids, uint64_t *bytes,
                                          uint32_t max);
/* Remove the segment /name (absent is not an error). */
FERRY_API int ferry_node_budget_unlink(const char *name, char *errbuf,
                                       size_t errlen);

/* ---- the engine's messages (process-wide) ------------------------------- */
/* Policy ferry.log() lines, warnings and errors go to stderr ("ferry: ..."),
 * or to a file: each line with time, pid and level; when the next line would
 * take it past max_bytes (>= 4096) it is renamed path.1 (path.1 to path.2 ...,
 * keep (0-100) old files) and a new one started. "%p" in path is the pid: one
 * file per process, as ranks must not rotate one file. A message equal to the
 * previous one is counted and written once with the count. path NULL =
 * stderr. Without a call, FERRY_LOG_FILE, FERRY_LOG_MAX_BYTES (16M),
 * FERRY_LOG_KEEP (3) and FERRY_LOG_LEVEL (error|warning|info) set it. A path
 * that is not a regular file is refused (FERRY_EINVAL). */
enum { FERRY_LOG_ERROR = 0, FERRY_LOG_WARNING = 1, FERRY_LOG_INFO = 2 };
FERRY_API int ferry_log_open(const char *path, uint64_t max_bytes, uint32_t keep,
                             int level, char *errbuf, size_t errlen);
/* Only the level (e.g. a tool's -q), the destination kept; returns the
 * previous level, or -1 if level is not a FERRY_LOG_*. */
FERRY_API int ferry_log_level(int level);

/* Fill the first `size` bytes of *cfg with the defaults of FERRY_CONFIG_INIT
 * and set cfg->struct_size = size: pass the size of the caller's own
 * ferry_config (sizeof, ffi.sizeof), which may be an older, smaller one than
 * this library's; nothing past it is written (a newer, larger one gets its
 * unknown tail zeroed). FERRY_EINVAL, nothing written, for NULL or a size
 * no release's ferry_config has: smaller than any, over 4096 bytes, or not
 * a multiple of _Alignof(ferry_config) (it would end inside a field).
 * ferry_engine_create refuses such a struct_size (FERRY_EVERSION) without
 * reading past it. In C use ferry_config_init(cfg),
 * which passes the size of the header's ferry_config. */
FERRY_API int ferry_config_init_sized(ferry_config *cfg, size_t size);
#define ferry_config_init(cfg) ferry_config_init_sized((cfg), sizeof(ferry_config))

/* Create an engine. On failure *out is NULL, and if errbuf is not NULL a
 * message naming the problem is written there. Reads only cfg->struct_size
 * bytes of *cfg (an older caller's fields are the defaults here), and keeps
 * none of its strings. Calls host_ram (host_cap_pct), no other callback. */
FERRY_API int ferry_engine_create(const ferry_config *cfg, ferry_engine **out,
                                  char *errbuf, size_t errlen);
/* Waits for outstanding copies, releases every owner still held (release,
 * no lock held), frees the arena (host_reserve, release = 1). Safe on NULL,
 * and a no-op on an engine destroyed already while ferry can tell (see
 * Threads at the top): no other call on e may overlap it or follow it. */
FERRY_API void ferry_engine_destroy(ferry_engine *e);

/* Detailed message of the last failure on this engine ("" if none; "not a
 * live ferry engine" for NULL or a destroyed one). The message is per
 * engine, not per thread: read it right after the call that failed. The
 * string is the calling thread's copy of it: valid until the same thread
 * calls ferry_last_error again (for any engine) or exits. */
FERRY_API const char *ferry_last_error(ferry_engine *e);
/* "host", "cuda" or "sim"; "jemalloc" or "pool" ("none" for no live
 * engine); static. */
FERRY_API const char *ferry_backend_name(ferry_engine *e);
FERRY_API const char *ferry_arena_name(ferry_engine *e);
/* Give pinned memory back to the OS: every backend allocation of the arena
 * with nothing in use in it is unpinned and freed (host: munlock and
 * munmap; cuda: cudaFreeHost), as long as the arena keeps at least
 * keep_bytes reserved. Memory in use (stashed tensors, resident buffers, a
 * snapshot still writing) stays. *released (may be NULL): the bytes given
 * back. Later allocations pin memory again, at the cost of a first growth.
 * Callbacks: host_reserve (release = 1), no lock held. */
FERRY_API int ferry_arena_trim(ferry_engine *e, uint64_t keep_bytes, uint64_t *released);

/* Return a stable copy of s owned by the engine, valid until the engine is
 * destroyed; equal strings give equal pointers. NULL on allocation failure. */
FERRY_API const char *ferry_intern(ferry_engine *e, const char *s);

/* ---- the stash ---------------------------------------------------------- */
/* Save a tensor. The engine takes the reference `owner`. `compute_stream` is
 * the embedder's stream that produced the buffer (a cudaStream_t for the
 * cuda backend; NULL = the legacy default stream, or the calling thread on
 * the host backend). On error nothing was taken: the caller keeps owner.
 * desc->bytes 0 is refused (FERRY_EINVAL): a tensor without bytes has
 * nothing to save, keep it yourself; so are more than FERRY_MAX_DIMS dims.
 * Callbacks: decide and host_ram (a step starts) under the engine lock;
 * host_reserve (the arena grows) and release (the stash bound, a buffer
 * packed twice) without it. */
FERRY_API int ferry_pack(ferry_engine *e, const ferry_tensor_desc *desc,
                         void *device_ptr, void *owner, void *compute_stream,
                         ferry_handle *out);
/* ferry_pack for an embedder that can name the bytes it packs. A pack of a
 * buffer the engine still stores becomes an alias of it (one copy, two
 * handles; needs cfg.retain) only when device_ptr, bytes, storage and
 * version all match: bytes changed in place since (a new version), or an
 * allocation freed and another made at the same address (a new storage),
 * are stored anew, where ferry_pack, matching by address and size alone,
 * would hand back the old bytes. storage: an identity of the allocation that
 * no other allocation takes while the engine holds owner (torch: its
 * StorageImpl); version: a counter bumped by every write (torch: the
 * tensor's version counter). */
FERRY_API int ferry_pack_keyed(ferry_engine *e, const ferry_tensor_desc *desc,
                               void *device_ptr, void *owner, void *compute_stream,
                               uint64_t storage, int64_t version, ferry_handle *out);
/* A pack the policy has answered before, decided without a handle: when the
 * policy's site cache keeps desc's site on device (FERRY_KEEP, cacheable),
 * or desc is under min_offload_bytes, and the engine does not already store
 * the buffer at device_ptr, the tensor is counted as packed and kept
 * (tensors_kept_unheld) and 1 is returned: the caller keeps the tensor
 * itself; there is nothing to unpack or discard. 0: call ferry_pack(). Always
 * 0 while a trace, a Chrome trace or reasons are recorded (they see every
 * pack) and for an engine without a policy. Never runs the policy. Callback:
 * host_ram under the engine lock, when it starts a step. */
FERRY_API int ferry_pack_cached_keep(ferry_engine *e, const ferry_tensor_desc *desc,
                                     const void *device_ptr);
/* Get a saved tensor back for use on compute_stream. Consumes the handle.
 * device_ptr and owner receive a buffer with the same bytes as packed and one
 * reference the caller now owns (set only on success). The compute stream is
 * ordered after any reload copy; the host is not blocked where the backend
 * can avoid it. Callbacks: device_alloc (the reload, and the prefetches it
 * starts) and release (a reload that failed) without the engine lock,
 * retain under it. FERRY_EALLOC: device_alloc failed; the handle stays
 * valid. FERRY_EHANDLE also when the handle was discarded while it was
 * being reloaded (by device_alloc, say), whether or not that failed. */
FERRY_API int ferry_unpack(ferry_engine *e, ferry_handle h,
                           void *compute_stream, void **device_ptr,
                           void **owner);
/* Start reloading h now (no-op if it is on device or already reloading).
 * Callbacks: device_alloc, release (a reload that failed), no lock held. */
FERRY_API int ferry_prefetch(ferry_engine *e, ferry_handle h,
                             void *compute_stream);
/* Drop a handle without unpacking it (the saved tensor was freed). Never
 * waits for a reload of its tensor (device_alloc may call it). Callback:
 * release, no lock held. */
FERRY_API int ferry_discard(ferry_engine *e, ferry_handle h);

/* Step boundaries. ferry_step_end() waits for outstanding copies, frees their
 * host buffers and fails with FERRY_ELEAK if handles packed in this step are
 * still live (they stay valid; the message counts them and the arena bytes
 * this step's packs of them hold; earlier steps' handles do not count); the
 * step has ended all the same. FERRY_ESTATE: no step in progress.
 * ferry_step_begin: FERRY_ESTATE while a step is in progress; calls host_ram
 * under the engine lock. ferry_backward_begin starts a step if none is in
 * progress (host_ram), and with config.prefetch_at_backward_begin starts
 * reloads (device_alloc and release, without the lock).
 * ferry_backward_begin in backward and ferry_backward_end outside it are
 * refused (FERRY_ESTATE) and change nothing: they start no step. */
FERRY_API int ferry_step_begin(ferry_engine *e);
FERRY_API int ferry_step_end(ferry_engine *e);
FERRY_API int ferry_backward_begin(ferry_engine *e);
FERRY_API int ferry_backward_end(ferry_engine *e);
/* ferry_backward_begin for backward on compute_stream: the reloads
 * prefetch_at_backward_begin starts now are written into buffers allocated
 * for, and ordered after, that stream. ferry_backward_begin() orders them
 * after the legacy default stream (NULL), which orders nothing against a
 * non-blocking stream: an embedder computing on one passes it here. */
FERRY_API int ferry_backward_begin_on(ferry_engine *e, void *compute_stream);
/* 1 while a step is in progress, 0 between steps (and for NULL). A pack, an
 * unpack or ferry_backward_begin outside a step begins one by itself, so an
 * embedder that ends steps must ask here, not keep its own flag. */
FERRY_API int ferry_in_step(ferry_engine *e);

/* Trace recording (config.trace_path; both are no-ops without a trace).
 * ferry_trace_resident: device memory held for the whole run outside the
 * saved tensors (parameters, gradients, optimizer states), once per `what`
 * before the first step; a replay counts it in the device peak.
 * ferry_trace_flops: floating-point operations the trainer ran since the
 * last traced event; the next event carries their sum as "flops", so a
 * replay can time that compute on another GPU (docs/trace-format.md). */
FERRY_API int ferry_trace_resident(ferry_engine *e, const char *what, uint64_t bytes);
FERRY_API int ferry_trace_flops(ferry_engine *e, double flops);
/* ferry_trace_device_peak: the most device memory the trainer's allocator
 * had in use during the step just ended (PyTorch's max_memory_allocated),
 * between steps. A replay compares it with its own peak under the recorded
 * decisions to learn the memory a trace does not hold (what autograd never
 * saves: the loss's transients, workspaces) and adds it to every peak
 * (docs/trace-format.md, docs/simulator.md). */
FERRY_API int ferry_trace_device_peak(ferry_engine *e, uint64_t bytes);
/* ferry_trace_flops_all(e, 1): the trainer counts the FLOPs of all its
 * compute, so from the next event on every traced event carries "flops", 0
 * where ferry_trace_flops added none: a replay times every gap from FLOPs,
 * and work the trainer does not count (elementwise ops, the optimizer) has
 * no time of its own (it is inside the achieved rate, ferry sim --mfu).
 * 0 (the default): only the events after ferry_trace_flops calls carry
 * "flops"; the others keep their recorded gaps. A no-op without a trace. */
FERRY_API int ferry_trace_flops_all(ferry_engine *e, int on);

/* ---- policies ----------------------------------------------------------- */
/* Load a Lua policy (file, or source text when path is NULL) and make it the
 * engine's decision maker, replacing any decide callback. Call between
 * steps (FERRY_ESTATE during one, before anything is loaded). On failure
 * the previous policy stays in force and the message, with file:line, is in
 * ferry_last_error(). The policy replaced is kept (the last four): setting
 * one of them again, from the same unchanged file (same inode, size and
 * modification time) or the same source, brings it back as it was, its
 * Lua state and site cache included, without a reload; setting the policy
 * in force again reloads it. */
FERRY_API int ferry_set_policy(ferry_engine *e, const char *path,
                               const char *source, int trusted);
/* The file of a policy given by name ("default": a shipped policy, found in
 * $FERRY_POLICY_DIR, then <prefix>/share/ferry/policies beside the installed
 * library, then the source tree it was built from) or by path (anything with
 * a '/' or ".lua"). FERRY_ENOENT names the shipped policies and the closest
 * one to a mistyped name. */
FERRY_API int ferry_policy_find(const char *name, char *path, size_t pathlen, char *err,
                                size_t errlen);
/* The last policy fault (runtime error, timeout, nonsense answer) of the
 * policy in force, as "file:line: message", or "" if none. The string is the
 * calling thread's copy: valid until the same thread calls
 * ferry_last_policy_error again (for any engine) or exits, whatever policy
 * is set meanwhile. */
FERRY_API const char *ferry_last_policy_error(ferry_engine *e);

/* The knobs in force: the config's, overridden by the policy's, except
 * those in config.knobs_fixed. */
#define FERRY_KNOB_MAX_FWD_STASH 0x1u
#define FERRY_KNOB_PREFETCH_DISTANCE 0x2u
#define FERRY_KNOB_MIN_OFFLOAD_BYTES 0x4u
#define FERRY_KNOB_MAX_FWD_STASH_BYTES 0x8u
typedef struct ferry_knobs {
  uint32_t max_fwd_stash;
  uint32_t prefetch_distance;
  uint64_t min_offload_bytes;
  uint64_t max_fwd_stash_bytes; /* 0 = no byte bound */
  uint32_t overruled; /* FERRY_KNOB_* the policy sets to another value than
                         the config's fixed one (the config's won) */
  /* Appended: set by the policy's knobs of the same names (no config field
   * but config.release_when_copied, which either one turns on). */
  uint32_t release_when_copied; /* 0 or 1 */
  uint32_t max_tail_prefetch;   /* UINT32_MAX: no cap */
  /* FERRY_SYNC_*: who waits for each copy right after the engine issues
   * it (the policy's knob sync_copies; no config field). Was `reserved`
   * (0), so the size is unchanged. */
  uint32_t sync_copies;
  /* Appended: 1 when one copy stream carries both directions, reloads in
   * issue order behind the offloads still on it (the policy's knob
   * one_copy_stream; torchtune's and TRL's OffloadActivations, axolotl's
   * hidden_states offload and PyTorch's ao::offload/reload ops each use one
   * side stream); 0: a stream each way (ferry's own). */
  uint32_t one_copy_stream;
} ferry_knobs;
/* ferry_knobs.sync_copies. ASYNC: copies overlap compute (ferry's own).
 * COMPUTE: the compute stream waits for each copy right after it is issued,
 * the host runs on (a copy on the compute stream: save_on_cpu(pin_memory=
 * True) in torch 2.x, compilers that wait on each copy at issue). HOST: the
 * host waits too (a blocking copy: save_on_cpu()'s .cpu() and .to(device)). */
#define FERRY_SYNC_ASYNC 0u
#define FERRY_SYNC_COMPUTE 1u
#define FERRY_SYNC_HOST 2u
/* The first ferry_knobs (without max_fwd_stash_bytes); a smaller size is refused. */
#define FERRY_KNOBS_SIZE_V1 16
/* Fills at most size bytes of out (pass sizeof *out); FERRY_EINVAL if size is
 * smaller than FERRY_KNOBS_SIZE_V1. */
FERRY_API int ferry_get_knobs(ferry_engine *e, ferry_knobs *out, size_t size);

/* ---- checkpoint staging --------------------------------------------------
 * Snapshot training state into the pinned arena on the D2H stream and write
 * it to disk on a writer thread while training goes on. The file is a zip
 * archive (stored, ZIP64) of named records in the given order — the layout
 * torch.save uses, so a caller that supplies the pickle record gets a file
 * torch.load reads. Written to a temporary file beside path, fsynced, then
 * renamed: a crash leaves any previous file at path intact. The writer
 * thread resolves path first: a symbolic link to a regular file is followed;
 * anything else that exists and is not a regular file is refused
 * (FERRY_EINVAL), the snapshot's error like every I/O error. */
typedef struct ferry_snapshot ferry_snapshot;

typedef struct ferry_snapshot_record {
  const char *name;       /* entry name in the archive, e.g. "archive/data/0" */
  const void *host_data;  /* small host bytes, copied at start (pickles), or */
  const void *device_ptr; /* device bytes, staged through the arena */
  uint64_t bytes;
} ferry_snapshot_record;

/* Start a snapshot of n records. Device records are copied after the work
 * already enqueued on compute_stream; nothing is added to device memory.
 * The arena stages the file itself (the records at their offsets in the
 * archive, headers and host records included), written with O_DIRECT where
 * the file system takes it (docs/checkpoints.md). If the arena cannot hold
 * it all under its cap, it is staged in windows as the writer drains them. */
FERRY_API int ferry_snapshot_start(ferry_engine *e, const char *path,
                                   const ferry_snapshot_record *records,
                                   size_t n, void *compute_stream,
                                   ferry_snapshot **out);
/* Order compute_stream after every device copy of the snapshot: call before
 * the next in-place update of those tensors (the optimizer step). Blocks the
 * host only while chunked staging has copies left to issue. */
FERRY_API int ferry_snapshot_fence(ferry_snapshot *s, void *compute_stream);
/* FERRY_OK when the file is durable at path; 1 while in progress; else the
 * error (also in ferry_snapshot_error). */
FERRY_API int ferry_snapshot_poll(ferry_snapshot *s);
FERRY_API int ferry_snapshot_wait(ferry_snapshot *s);
/* The snapshot's error ("" while it runs or when it succeeded); valid until
 * ferry_snapshot_free(s). */
FERRY_API const char *ferry_snapshot_error(ferry_snapshot *s);
/* Waits for the snapshot to finish, then frees it. */
FERRY_API void ferry_snapshot_free(ferry_snapshot *s);

/* ---- stats -------------------------------------------------------------- */
typedef struct ferry_stats {
  uint64_t steps;
  uint64_t tensors_packed;
  uint64_t tensors_offloaded;
  uint64_t tensors_kept;
  uint64_t tensors_aliased;   /* packs that found the buffer already stored */
  uint64_t tensors_unpacked;
  uint64_t stash_hits;        /* offloaded, unpacked before release: no copy */
  uint64_t prefetches;        /* reloads started ahead of their unpack */
  uint64_t bytes_d2h;
  uint64_t bytes_h2d;
  uint64_t live_handles;
  uint64_t device_bytes_held; /* kept + stashed buffers the engine holds */
  uint64_t device_bytes_held_peak;
  uint64_t arena_in_use;
  uint64_t arena_peak;
  uint64_t arena_reserved;
  uint64_t arena_cap;
  uint64_t backend_pinned_allocs; /* calls to the backend's pinned allocator */
  uint64_t waits;          /* host waits on an event (stash bound, step end) */
  uint64_t cap_fallbacks;  /* offload decisions kept because of the cap */
  uint64_t alloc_failures; /* device allocator callback failures */
  uint64_t policy_errors;
  uint64_t policy_calls;
  uint64_t policy_cache_hits;
  uint64_t policy_disabled; /* 1 once the error budget disabled the policy */
  /* Resident buffers (below); appended. */
  uint64_t resident_buffers;   /* live ferry_resident handles */
  uint64_t resident_bytes;     /* arena bytes they hold */
  uint64_t resident_to_host;   /* D2H copies into resident buffers */
  uint64_t resident_to_device; /* H2D copies out of them */
  uint64_t resident_bytes_d2h;
  uint64_t resident_bytes_h2d;
  /* Appended: packs kept by ferry_pack_cached_keep (also in tensors_packed
   * and tensors_kept), never held by the engine. */
  uint64_t tensors_kept_unheld;
  /* Appended: bytes of snapshot files written with O_DIRECT (from the
   * staged file image, no copy into the page cache) and with buffered
   * writes (tmpfs, a file system that refused O_DIRECT, host records only). */
  uint64_t snapshot_bytes_direct;
  uint64_t snapshot_bytes_buffered;
} ferry_stats;

/* Copy at most `size` bytes of the stats (pass sizeof(ferry_stats)). No
 * callbacks: callable from those that run without the engine lock. */
FERRY_API int ferry_get_stats(ferry_engine *e, ferry_stats *out, size_t size);

/* Saved tensors by the rule that decided them and by layer, since the
 * engine was created (config.count_reasons). One row per (rule, where,
 * layer); packs that found their buffer already stored (aliases) are not
 * counted again. Engine-level outcomes have rules of their own:
 * "min_offload_bytes" (too small to ask the policy), "host cap" (an offload
 * the arena could not hold), "copy failed", "decide callback" (a C
 * callback, which gives no reason), "no policy". */
typedef struct ferry_breakdown_row {
  const char *rule;  /* the rule's name, as ferry check prints it */
  const char *where; /* "file:line" where the policy wrote it, "" if none */
  int32_t layer;     /* -1: outside the repeated blocks */
  uint32_t reserved;
  uint64_t tensors_offloaded, bytes_offloaded;
  uint64_t tensors_kept, bytes_kept;
} ferry_breakdown_row;
/* Called once per row, in first-seen order; the strings live until fn returns. */
typedef void (*ferry_breakdown_fn)(void *ud, const ferry_breakdown_row *row);
/* FERRY_ESTATE if the engine was created without config.count_reasons. */
FERRY_API int ferry_get_breakdown(ferry_engine *e, ferry_breakdown_fn fn, void *ud);

/* ---- resident buffers ----------------------------------------------------
 * Long-lived buffers in the pinned arena for state that lives on the host
 * between uses and moves both ways at chosen points (optimizer states and
 * weights offloaded for a whole step, docs/optimizer-offload.md), beside the
 * saved-tensor path. Same arena and cap, same engine streams and events.
 * One handle is used by one thread at a time. */
typedef struct ferry_resident ferry_resident;

/* Take `bytes` of the arena. FERRY_ECAP (with a message naming the cap) when
 * the arena cannot hold them. */
FERRY_API int ferry_resident_create(ferry_engine *e, uint64_t bytes, ferry_resident **out);
/* Copy r's bytes from device_ptr into the host buffer on the engine's D2H
 * stream, after the work already enqueued on compute_stream (NULL = the
 * legacy default stream, or the calling thread on the host backend) and
 * after r's previous copy. Asynchronous: ferry_resident_wait before reading
 * the host bytes. */
FERRY_API int ferry_resident_to_host(ferry_resident *r, const void *device_ptr,
                                     void *compute_stream);
/* Copy the host buffer to device_ptr on the engine's H2D stream, after the
 * work enqueued on compute_stream and r's previous copy; work enqueued on
 * compute_stream afterwards sees the bytes. Do not write the host bytes
 * until ferry_resident_wait. */
FERRY_API int ferry_resident_to_device(ferry_resident *r, void *device_ptr,
                                       void *compute_stream);
/* Block until r's last copy is complete. */
FERRY_API int ferry_resident_wait(ferry_resident *r);
/* The pinned host bytes (valid to read or write after ferry_resident_wait)
 * and their size; NULL / 0 for a bad or detached handle. */
FERRY_API void *ferry_resident_host_ptr(ferry_resident *r);
FERRY_API uint64_t ferry_resident_bytes(ferry_resident *r);
/* Wait for r's copies and give its memory back. FERRY_EHANDLE for a handle
 * that is not live (NULL, already destroyed). After ferry_engine_destroy the
 * handle is detached (its memory freed with the arena; copies and host_ptr
 * fail with FERRY_ESTATE) and must still be destroyed. */
FERRY_API int ferry_resident_destroy(ferry_resident *r);

#ifdef __cplusplus
}
#endif
#endif /* FERRY_H */
