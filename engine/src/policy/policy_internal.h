/*
 * policy_internal.h: what the policy host's files share (limits, the
 * ferry_policy struct, the string and site-cache types) and the few
 * functions one file defines and another calls. Private to engine/src/policy.
 */
#ifndef FERRY_POLICY_INTERNAL_H
#define FERRY_POLICY_INTERNAL_H

#include "ferry_tools.h"
#include "util/util.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ---- limits ------------------------------------------------------------- */
#define HOOK_PERIOD 1000                   /* VM instructions between hook calls */
/* One VM instruction or library call can take time linear in a string or
 * table (comparing two strings, .., string.upper, table.concat): while
 * blocks of BIG_BLOCK bytes or more are alive the hook runs more often,
 * every HOOK_PERIOD * BIG_BLOCK / (2 * size class) instructions, down to
 * every one, so that the instructions between two reads of the clock cost
 * about as much as HOOK_PERIOD instructions on BIG_BLOCK bytes. */
#define BIG_BLOCK_SHIFT 16                 /* 64 KiB */
#define BIG_CLASSES 11                     /* 64 KiB, 128 KiB, ... 64 MiB and more */
#define DECIDE_MAX_INSTRUCTIONS 10000000ull /* per decide call (~20 ms) */
#define LOAD_MAX_INSTRUCTIONS 100000000ull  /* loading the policy and its modules */
#define DEFAULT_DECIDE_MS 50                /* wall clock per decide/snapshot call */
#define DEFAULT_LOAD_MS 5000                /* wall clock for loading a policy */
/* The pattern functions' work grows faster than their data (the hook
 * period below covers the rest): it is estimated before they run, in steps
 * of a measured worst cost (bench/bench_policy_bounds.c); a call over
 * C_CALL_MAX_NS is refused, and the estimates are summed so that the clock
 * is read at least every WORK_CHECK_NS of estimated work. */
#define PATTERN_NS_PER_STEP 2.5             /* see pattern_steps (sandbox.c) */
#define PLAIN_NS_PER_BYTE 0.5               /* plain find: one byte compared */
#define C_CALL_MAX_NS 20000000.0            /* the most one accepted call may take */
#define GSUB_ESCAPE_NS 32.0                 /* gsub: one %0-%9 of the replacement, one match */
#define GSUB_STRING_MATCH_NS 32.0           /* gsub: one match with a string replacement */
#define GSUB_TABLE_MATCH_NS 100.0           /* gsub: one match looked up in a table */
#define MOVE_NS_PER_ITEM 20.0               /* table.insert: one element moved */
#define CONCAT_NS_PER_ITEM 20.0             /* table.concat: one element appended */
#define TABLE_CHUNK 65536                   /* elements between two charges of the work */
#define WORK_CHECK_NS 1000000.0             /* estimated C work between clock reads */
#define ALLOC_CHECK_BYTES (1u << 20)        /* bytes allocated between clock reads */
#define SORT_MAX_ITEMS (1 << 16)            /* table.sort: its comparisons run Lua code */
/* C stack: a policy call starts only with POLICY_MIN_STACK free on the
 * calling thread, and each nested C level (pcall, gsub, sort, tostring...)
 * only while NESTING_STACK_RESERVE is left: no thread overflows its stack,
 * whatever its size (docs/policy-api.md, "Limits"). */
#define POLICY_MIN_STACK (192u << 10)
#define NESTING_STACK_RESERVE (96u << 10)
#define DEFAULT_MEM_CAP (64ull << 20)
#define DEFAULT_ERROR_BUDGET 100
#define MAX_POLICY_FILE (16u << 20)
#define MAX_C_NESTING 64      /* C functions calling Lua (pcall, gsub, sort, tostring...) nested */
#define MAX_LOG_LINES 1000    /* ferry.log lines per policy instance */
#define MAX_STRINGS (1u << 16) /* distinct module paths/classes interned */
#define PTR_CACHE_BITS 12
#define PTR_CACHE_SIZE (1 << PTR_CACHE_BITS) /* direct-mapped pointer -> string id cache */
#define SITE_CACHE_MAX 16384   /* cached sites */
#define MAX_PREFETCH_DISTANCE 4096
#define MSG_LEN 512
/* the reserve of a state being made: 7x what a sandbox's set-up takes */
#define POLICY_SETUP_RESERVE (512u << 10)

/* Knob limits, the same as the engine's config validation. */
#define KNOB_MAX_FWD_STASH (1u << 20)
#define KNOB_MAX_PREFETCH_DISTANCE 4096u
#define KNOB_MAX_MIN_OFFLOAD_BYTES (1ull << 50)

/* String ids: 0 is "" (also NULL), 1 and 2 are scratch slots used for the
 * path and class once MAX_STRINGS distinct strings have been seen. */
enum { STR_EMPTY = 0, STR_SCRATCH_PATH = 1, STR_SCRATCH_CLASS = 2, STR_FIRST = 3 };

/* Permanent slots of the main Lua stack while a policy is loaded. */
enum {
  SLOT_MSGH = 1,
  SLOT_DECIDE,
  SLOT_TENSOR,
  SLOT_CTX,
  SLOT_TENSOR_FIELDS, /* what t reads (sandbox.lua) */
  SLOT_CTX_FIELDS,    /* what ctx reads */
  SLOT_SHAPE,
  SLOT_STRINGS,
  SLOT_COUNT_ = SLOT_STRINGS
};

enum interrupt_kind { INTERRUPT_NONE = 0, INTERRUPT_BUDGET, INTERRUPT_MEMORY };

/* The numbers t and ctx show, in the order of decide.c's field names: the
 * values last written into their Lua tables, so that only those that
 * changed are written again (all of them at first). */
enum { TENSOR_FIELDS = 9, CTX_FIELDS = 9 };

typedef struct interned {
  char *str;
  size_t len;
  uint64_t hash;
} interned;

typedef struct ptr_cache_entry {
  const char *ptr;
  uint32_t id;
} ptr_cache_entry;


/* A site: where a tensor is saved (module, class, dtype, kind, shape) and in
 * which phase, so a policy may answer a recompute pack otherwise than the
 * forward pack of the same op and still be cached. */
typedef struct site_key {
  uint32_t path_id, class_id;
  int32_t dtype, kind, ndim, phase;
  int64_t shape[FERRY_MAX_DIMS];
} site_key;

typedef struct site_entry {
  uint64_t hash; /* 0 = empty slot */
  site_key key;
  ferry_decision decision;
} site_entry;

/* The reason stored with a cached answer, for ferry_policy_explain only
 * (the engine's decide never reads or writes these): site -> index into
 * ferry_policy.reasons. */
typedef struct reason_entry {
  uint64_t hash; /* 0 = empty slot; the site's hash */
  site_key key;
  uint32_t reason;
} reason_entry;

struct ferry_policy {
  lua_State *L;
  char name[128];
  char chunk[MSG_LEN];        /* short name for messages: path or "policy" */
  char decide_where[MSG_LEN]; /* "file:line" of the decide function */
  char snapshot_where[MSG_LEN]; /* "file:line" of the snapshot function, if any */
  int has_snapshot;             /* the function is in the registry as "ferry.snapshot" */
  char step_where[MSG_LEN];     /* "file:line" of the step function, if any */
  int has_step;                 /* the function is in the registry as "ferry.step" */
  char explain_where[MSG_LEN];  /* "file:line" of the explain function, if any */
  int has_explain;              /* the function is in the registry as "ferry.explain" */
  char resident_where[MSG_LEN]; /* "file:line" of the resident function, if any */
  int has_resident;             /* the function is in the registry as "ferry.resident" */
  char table_where[MSG_LEN];    /* "file:line" of the policy's top-level `return` (its table) */
  const char *running;        /* where the running call is, when nothing better is known */
  char libdir[1024];
  int trusted;
  ferry_policy_knobs knobs;
  ferry_policy_stats stats;
  unsigned error_budget;
  uint64_t step;

  /* sandbox enforcement */
  size_t mem_used, mem_cap;
  int enforce_cap;
  /* LuaJIT crashes when an allocation fails inside lua_newstate, or during
   * the sandbox's set-up and then in lua_close, and a failure in an
   * unprotected call aborts (policy_panic): what the C allocator refuses
   * while a policy is loaded, outside its own (capped, protected) code, is
   * served from this block, taken before (policy_alloc); freed with the
   * state, or at the end of the load if unused */
  char *reserve;
  size_t reserve_used;
  int reserve_open; /* ferry_policy_create is running */
  uint64_t ticks, tick_budget;      /* VM instructions run and allowed, this call */
  uint32_t big_live[BIG_CLASSES];    /* live blocks per size class, 64 KiB and more */
  uint32_t big_total;                /* their sum: 0 on the hot path */
  int hook_period;                   /* the count hook's period now */
  uint64_t deadline_ns;              /* wall clock of the call in progress */
  int loading;                       /* that call is a load, not a decision */
  uint64_t decide_budget_ns, load_budget_ns;
  int interrupt;
  char interrupt_msg[MSG_LEN];
  int c_nesting;
  double work_ns;                    /* estimated C work since the clock was last read */
  size_t alloc_unchecked;            /* bytes allocated since then */
  unsigned log_lines;

  /* the call in progress */
  uint64_t tensor_seen[TENSOR_FIELDS]; /* as the engine's integers (decide.c, show) */
  uint64_t ctx_seen[CTX_FIELDS];
  int tensor_seen_valid, ctx_seen_valid; /* 0: write every field at the next call */
  const ferry_context *cur_ctx;
  /* ctx.host_ram_used_pct read lazily: where to sample it, the step it was
   * last sampled for and its value, and whether the policy ever read it */
  ferry_host_ram_fn host_ram;
  void *host_ram_ud;
  uint64_t ram_step;
  double ram_pct;
  int reads_ram;
  uint32_t cur_path_id, cur_class_id;
  int shape_len; /* entries of the shape table currently set */

  /* interned strings */
  interned *strings;
  uint32_t n_strings, cap_strings;
  uint32_t *by_content; /* open addressing on content hash, 0 = empty */
  uint32_t by_content_mask;
  ptr_cache_entry ptr_cache[PTR_CACHE_SIZE];

  /* per-site decision cache */
  site_entry *sites;
  uint32_t n_sites, sites_mask;
  int forget; /* ferry.forget_cached() was called: empty the cache when the call returns */

  /* reasons of cached answers (ferry_policy_explain only) */
  reason_entry *reason_sites;
  uint32_t n_reason_sites, reason_sites_mask;
  ferry_policy_reason *reasons; /* distinct reasons, in order of first sight */
  uint32_t n_reasons, cap_reasons;

  char last_error[MSG_LEN];
};

/* ---- shared functions --------------------------------------------------- */
static inline ferry_policy *policy_of(lua_State *L) {
  void *ud = NULL;
  lua_getallocf(L, &ud);
  return ud;
}

/* sandbox.c */
int enter_nested(lua_State *L, ferry_policy *p, const char *what);
void charge_work(lua_State *L, ferry_policy *p, double ns);
size_t stack_left(void);
/* Sets the hook's period for the largest live block (or for at least the
 * size class min_class); only ever shortens it within a call. */
void set_hook_period(ferry_policy *p, int min_class);
/* bounded.c: the wrapped tostring, string.format, table.insert/maxn/concat,
 * tonumber and os.time, into the table at index C */
void push_bounded_functions(lua_State *L, int C);
void copy_str(char *dst, size_t n, const char *src);
int env_count(const char *name, unsigned long long dflt, unsigned long long lo,
              unsigned long long hi, unsigned long long *out, char *err, size_t errlen);
int has_position(const char *msg);
void *policy_alloc(void *ud, void *ptr, size_t osize, size_t nsize);
void policy_hook(lua_State *L, lua_Debug *ar);
int setup_state(lua_State *L);
int policy_panic(lua_State *L);
const char *describe_value(lua_State *L, int idx, char *buf, size_t n);
void take_fault(ferry_policy *p, int status, char *out, size_t n);

/* Run policy code: a function and nargs arguments on top of the stack,
 * with the cap, the instruction budget and the wall-clock budget of a
 * decision (or, when loading, of a load). Returns the lua_pcall status. */
static inline int run_protected(ferry_policy *p, int nargs, int nresults, int msgh, int loading) {
  size_t left = stack_left();
  if (left < POLICY_MIN_STACK) {
    lua_pop(p->L, nargs + 1);
    /* take_fault prefixes the chunk when there is no file:line */
    lua_pushfstring(p->L, "%s%snot run: the calling thread has %d KiB of C stack left, a "
                    "policy call needs %d KiB", p->running && !loading ? p->running : "",
                    p->running && !loading ? ": " : "", (int)(left >> 10),
                    (int)(POLICY_MIN_STACK >> 10));
    return LUA_ERRRUN;
  }
  p->ticks = 0;
  p->work_ns = 0;
  p->alloc_unchecked = 0;
  set_hook_period(p, -1);
  p->tick_budget = loading ? LOAD_MAX_INSTRUCTIONS : DECIDE_MAX_INSTRUCTIONS;
  p->loading = loading;
  p->deadline_ns = util_now_ns() + (loading ? p->load_budget_ns : p->decide_budget_ns);
  p->interrupt = INTERRUPT_NONE;
  p->c_nesting = 0;
  p->enforce_cap = 1;
  int status = lua_pcall(p->L, nargs, nresults, msgh);
  p->enforce_cap = 0;
  return status;
}

#endif
