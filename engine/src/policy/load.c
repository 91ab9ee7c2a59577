/*
 * policy_host.c — runs Lua policies (policy API v1) in a sandboxed LuaJIT
 * state, one state per policy instance.
 *
 * What a policy sees: `t` and `ctx` are FFI cdata of two structs this file
 * owns (struct value cdata created once at load, rewritten before each call,
 * const fields so Lua cannot write them). They hold only scalar fields:
 * arrays or pointers in cdata would let a policy read and write any address
 * (FFI pointer arithmetic and array indexing are not bounds-checked). So
 * t.shape is a Lua table rewritten per call, module path/class are methods
 * returning interned Lua strings, and ctx:offloaded_in_layer(i) is a C
 * function with a bounds check.
 *
 * Runaway loops: LuaJIT without LUAJIT_ENABLE_CHECKHOOK (Debian's build)
 * never runs hooks inside compiled traces, so `while true do end` cannot be
 * stopped once it is compiled. Policies therefore run with the JIT engine
 * off (luaJIT_setmode ENGINE|OFF, set before any policy code runs, so no
 * trace ever exists) and a count hook every HOOK_PERIOD VM instructions that
 * enforces an instruction budget per call. In the interpreter the hook
 * always fires, so the budget provably bounds every call. The cost (the
 * interpreter instead of traces, about 40 ns per cdata field read) is what
 * the per-site decision cache is for; bench/bench_policy.c measures both.
 *
 * Memory: lua_newstate with our allocator (works in LuaJIT 2.1 x86_64 GC64)
 * caps the state's bytes while policy code runs. A denied allocation raises
 * "not enough memory"; the allocator records where it happened first.
 *
 * Interrupts (budget, memory) must not be swallowed by the policy's own
 * pcall, so the sandbox's pcall/xpcall are C wrappers that re-raise them.
 * C functions that call back into Lua (pcall, xpcall, string.gsub) share a
 * nesting limit: gsub keeps an 8 KiB buffer on the C stack per level and
 * recursing through it would overflow the C stack before the Lua stack.
 */
#include "ferry_tools.h"
#include "util/util.h"

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
#define DECIDE_MAX_INSTRUCTIONS 10000000ull /* per decide call (~20 ms) */
#define LOAD_MAX_INSTRUCTIONS 100000000ull  /* loading the policy and its modules */
#define DEFAULT_MEM_CAP (64ull << 20)
#define DEFAULT_ERROR_BUDGET 100
#define MAX_POLICY_FILE (16u << 20)
#define MAX_C_NESTING 64      /* pcall/xpcall/gsub calls nested in each other */
#define MAX_LOG_LINES 1000    /* ferry.log lines per policy instance */
#define MAX_STRINGS (1u << 16) /* distinct module paths/classes interned */
#define PTR_CACHE_SIZE 4096    /* direct-mapped pointer -> string id cache */
#define SITE_CACHE_MAX 16384   /* cached sites */
#define MAX_PREFETCH_DISTANCE 4096
#define MSG_LEN 512

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
  SLOT_SHAPE,
  SLOT_STRINGS,
  SLOT_COUNT_ = SLOT_STRINGS
};

enum interrupt_kind { INTERRUPT_NONE = 0, INTERRUPT_BUDGET, INTERRUPT_MEMORY };

/* What Lua reads as `t` (cdef'd in sandbox.lua with the same layout; the
 * bootstrap checks each offset). Fields read most often come first: FFI
 * finds a field by a linear scan. */
typedef struct policy_tensor_view {
  double bytes;
  int32_t kind, dtype, ndim, flags, layer, layer_count, phase;
  double step;
} policy_tensor_view;

typedef struct policy_ctx_view {
  double step;
  double host_ram_used_pct;
  double arena_in_use, arena_cap, stash_depth, bytes_in_flight;
  double packed_this_step, offloaded_this_step, bytes_offloaded_this_step;
  int32_t phase;
} policy_ctx_view;

typedef struct interned {
  char *str;
  size_t len;
  uint64_t hash;
} interned;

typedef struct ptr_cache_entry {
  const char *ptr;
  uint32_t id;
} ptr_cache_entry;

typedef struct site_key {
  uint32_t path_id, class_id;
  int32_t dtype, kind, ndim;
  int64_t shape[FERRY_MAX_DIMS];
} site_key;

typedef struct site_entry {
  uint64_t hash; /* 0 = empty slot */
  site_key key;
  ferry_decision decision;
} site_entry;

struct ferry_policy {
  lua_State *L;
  char name[128];
  char chunk[MSG_LEN];        /* short name for messages: path or "policy" */
  char decide_where[MSG_LEN]; /* "file:line" of the decide function */
  char snapshot_where[MSG_LEN]; /* "file:line" of the snapshot function, if any */
  int has_snapshot;             /* the function is in the registry as "ferry.snapshot" */
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
  uint64_t ticks, tick_budget;
  int interrupt;
  char interrupt_msg[MSG_LEN];
  int c_nesting;
  unsigned log_lines;

  /* the call in progress */
  policy_tensor_view *tensor; /* payload of the `t` cdata */
  policy_ctx_view *ctx;       /* payload of the `ctx` cdata */
  const ferry_context *cur_ctx;
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

  char last_error[MSG_LEN];
};

/* ---- small helpers ------------------------------------------------------ */
static void copy_str(char *dst, size_t n, const char *src) {
  if (!n) return;
  snprintf(dst, n, "%s", src ? src : "");
}

static unsigned long long env_ull(const char *name, unsigned long long dflt, unsigned long long lo,
                                  unsigned long long hi) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || v < lo || v > hi) {
    fprintf(stderr, "ferry: ignoring %s=%s (expected an integer in [%llu, %llu])\n", name, s, lo,
            hi);
    return dflt;
  }
  return v;
}

static ferry_policy *policy_of(lua_State *L) {
  void *ud = NULL;
  lua_getallocf(L, &ud);
  return ud;
}

/* "file:line" of the innermost Lua function at or above `level` with a line. */
static void where(lua_State *L, int level, char *buf, size_t n) {
  lua_Debug ar;
  for (int lv = level; lv < level + 64 && lua_getstack(L, lv, &ar); lv++) {
    if (lua_getinfo(L, "Sl", &ar) && ar.currentline > 0) {
      snprintf(buf, n, "%s:%d", ar.short_src, ar.currentline);
      return;
    }
  }
  buf[0] = '\0';
}

/* Does msg already start with "something:<digits>:"? */
static int has_position(const char *msg) {
  const char *c = msg;
  while (*c && *c != ':' && *c != '\n') c++;
  if (*c != ':' || c == msg) return 0;
  const char *d = ++c;
  while (*d >= '0' && *d <= '9') d++;
  return d > c && *d == ':';
}

/* ---- allocator and hook ------------------------------------------------- */
static void *policy_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  ferry_policy *p = ud;
  size_t old = ptr ? osize : 0;
  if (nsize == 0) {
    free(ptr);
    p->mem_used -= old;
    return NULL;
  }
  if (p->enforce_cap && nsize > old && p->mem_used + (nsize - old) > p->mem_cap) {
    if (!p->interrupt) {
      /* The VM keeps its stack consistent across allocations (the GC walks
       * it), so the position of the allocating code can be read here. */
      char pos[MSG_LEN];
      where(p->L, 0, pos, sizeof pos);
      p->interrupt = INTERRUPT_MEMORY;
      snprintf(p->interrupt_msg, sizeof p->interrupt_msg,
               "%.400s: policy memory limit of %zu MiB exceeded (allocation of %zu bytes refused)",
               pos[0] ? pos : p->running ? p->running : p->chunk, p->mem_cap >> 20, nsize);
    }
    return NULL;
  }
  void *q = realloc(ptr, nsize);
  if (q) p->mem_used += nsize - old;
  return q;
}

static void policy_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  ferry_policy *p = policy_of(L);
  if (++p->ticks <= p->tick_budget && !p->interrupt) return;
  if (!p->interrupt) {
    char pos[MSG_LEN];
    where(L, 0, pos, sizeof pos);
    p->interrupt = INTERRUPT_BUDGET;
    snprintf(p->interrupt_msg, sizeof p->interrupt_msg,
             "%.400s: interrupted after %" PRIu64 " VM instructions (runaway loop?)",
             pos[0] ? pos : p->running ? p->running : p->chunk, p->tick_budget * HOOK_PERIOD);
  }
  /* Once interrupted, every hook raises again until the call is over. */
  p->enforce_cap = 0;
  lua_pushstring(L, p->interrupt_msg);
  lua_error(L);
}

/* Error handler of every protected call into policy code: give the message
 * a "file:line:" prefix when it has none. */
static int policy_msgh(lua_State *L) {
  ferry_policy *p = policy_of(L);
  p->enforce_cap = 0;
  if (p->interrupt) {
    lua_pushstring(L, p->interrupt_msg);
    return 1;
  }
  char pos[MSG_LEN];
  const char *msg = lua_type(L, 1) == LUA_TSTRING || lua_type(L, 1) == LUA_TNUMBER
                        ? lua_tostring(L, 1) : NULL;
  if (msg && has_position(msg)) {
    lua_settop(L, 1);
    return 1;
  }
  where(L, 1, pos, sizeof pos);
  if (msg)
    lua_pushfstring(L, "%s: %s", pos[0] ? pos : p->chunk, msg);
  else
    lua_pushfstring(L, "%s: error object is a %s value", pos[0] ? pos : p->chunk,
                    luaL_typename(L, 1));
  return 1;
}

/* ---- sandbox functions -------------------------------------------------- */
static int enter_nested(lua_State *L, ferry_policy *p, const char *what) {
  if (p->c_nesting >= MAX_C_NESTING)
    return luaL_error(L, "%s nested too deeply (limit %d)", what, MAX_C_NESTING);
  p->c_nesting++;
  return 0;
}

/* pcall/xpcall for policies: like Lua's, except that an interrupt (budget or
 * memory) is raised again instead of being caught. */
static int finish_pcall(lua_State *L, ferry_policy *p, int status, int nesting, int base) {
  p->c_nesting = nesting;
  if (status != 0 && p->interrupt) return lua_error(L); /* error object on top */
  lua_pushboolean(L, status == 0);
  lua_insert(L, base);
  return lua_gettop(L) - base + 1;
}

static int sandbox_pcall(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checkany(L, 1);
  int nesting = p->c_nesting;
  enter_nested(L, p, "pcall");
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  return finish_pcall(L, p, status, nesting, 1);
}

/* The handler xpcall installs: the policy's handler, except during an
 * interrupt (LuaJIT calls the handler again for an error raised inside it,
 * so a looping handler would otherwise be re-entered without end). */
static int xpcall_handler(lua_State *L) {
  ferry_policy *p = policy_of(L);
  if (p->interrupt) return 1; /* the error object, unchanged */
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, 1);
  return 1;
}

static int sandbox_xpcall(lua_State *L) {
  ferry_policy *p = policy_of(L);
  luaL_checkany(L, 1);
  luaL_checktype(L, 2, LUA_TFUNCTION);
  int nesting = p->c_nesting;
  enter_nested(L, p, "xpcall");
  /* stack: f, handler, args... -> wrapped handler, f, args... */
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 2);
  lua_pushcclosure(L, xpcall_handler, 1);
  lua_replace(L, 1);
  lua_replace(L, 2);
  int status = lua_pcall(L, lua_gettop(L) - 2, LUA_MULTRET, 1);
  lua_remove(L, 1); /* the handler */
  return finish_pcall(L, p, status, nesting, 1);
}

static int sandbox_gsub(lua_State *L) {
  ferry_policy *p = policy_of(L);
  int nesting = p->c_nesting;
  enter_nested(L, p, "string.gsub");
  lua_pushvalue(L, lua_upvalueindex(1)); /* the real gsub */
  lua_insert(L, 1);
  lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
  p->c_nesting = nesting;
  return lua_gettop(L);
}

static int sandbox_log(lua_State *L) {
  ferry_policy *p = policy_of(L);
  size_t len;
  const char *msg = luaL_checklstring(L, 1, &len);
  if (p->log_lines < MAX_LOG_LINES)
    fprintf(stderr, "ferry: policy %s: %.*s\n", p->name, (int)len, msg);
  else if (p->log_lines == MAX_LOG_LINES)
    fprintf(stderr, "ferry: policy %s: more than %d log lines, the rest are dropped\n", p->name,
            MAX_LOG_LINES);
  p->log_lines++;
  return 0;
}

static int tensor_path(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(2));
  lua_rawgeti(L, lua_upvalueindex(1), (int)p->cur_path_id);
  return 1;
}

static int tensor_class(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(2));
  lua_rawgeti(L, lua_upvalueindex(1), (int)p->cur_class_id);
  return 1;
}

static int ctx_offloaded_in_layer(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, lua_upvalueindex(1));
  lua_Number i = luaL_checknumber(L, 2);
  const ferry_context *c = p->cur_ctx;
  double n = 0;
  if (c && c->offloaded_per_layer && i >= 0 && i < (lua_Number)c->layers_tracked &&
      i == floor(i))
    n = c->offloaded_per_layer[(uint32_t)i];
  lua_pushnumber(L, n);
  return 1;
}

/* require, limited to ferry's own modules under the policy library dir
 * (and "ffi" for trusted policies). upvalues: loaded table, sandbox env. */
static int sandbox_require(lua_State *L) {
  ferry_policy *p = policy_of(L);
  size_t len;
  const char *name = luaL_checklstring(L, 1, &len);
  lua_settop(L, 1);
  lua_getfield(L, lua_upvalueindex(1), name); /* stack: name, loaded[name] */
  if (lua_toboolean(L, -1)) {
    if (lua_islightuserdata(L, -1))
      return luaL_error(L, "module '%s' requires itself (a require loop)", name);
    return 1;
  }
  lua_pop(L, 1);
  if (!strcmp(name, "ffi")) {
    if (!p->trusted) return luaL_error(L, "module 'ffi' is only available to trusted policies");
    lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
    lua_getfield(L, -1, "ffi");
    return 1;
  }
  int valid = len > 0 && len < 200 && name[0] != '.' && name[len - 1] != '.';
  for (size_t i = 0; valid && i < len; i++) {
    char c = name[i];
    valid = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
            c == '_' || (c == '.' && name[i + 1] != '.');
  }
  if (!valid) return luaL_error(L, "module name '%s' is not valid (use names like ferry.rules)", name);
  if (!p->libdir[0])
    return luaL_error(L, "module '%s' not found: ferry's policy library dir is not set "
                         "(FERRY_POLICY_LIBDIR)", name);
  char file[1400];
  int n = snprintf(file, sizeof file, "%s/", p->libdir);
  for (size_t i = 0; i < len && n < (int)sizeof file - 5; i++) file[n++] = name[i] == '.' ? '/' : name[i];
  snprintf(file + n, sizeof file - (size_t)n, ".lua");
  FILE *f = fopen(file, "rb");
  if (!f)
    return luaL_error(L, "module '%s' not found (policies may only require ferry's modules, "
                         "from %s)", name, p->libdir);
  fclose(f);
  if (luaL_loadfilex(L, file, "t") != 0) return lua_error(L); /* message has file:line */
  lua_pushvalue(L, lua_upvalueindex(2));
  lua_setfenv(L, -2);
  lua_pushlightuserdata(L, p); /* mark as loading, to catch loops */
  lua_setfield(L, lua_upvalueindex(1), name);
  lua_pushvalue(L, 1);
  lua_call(L, 1, 1); /* stack: name, result */
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_pushboolean(L, 1);
  }
  lua_pushvalue(L, -1);
  lua_setfield(L, lua_upvalueindex(1), name);
  return 1;
}

/* ---- state setup -------------------------------------------------------- */
/* SANDBOX_LUA (policy/sandbox.lua, embedded at build time) runs once per state
 * with the full standard library, before any policy code, in a private
 * environment. Fills the sandbox env passed in. */
#include "policy/sandbox_lua.h"

typedef struct {
  const char *name;
  int value;
} named_const;

static const named_const FERRY_CONSTANTS[] = {
    {"API_VERSION", FERRY_POLICY_API_VERSION},
    {"KEEP", FERRY_KEEP},
    {"OFFLOAD", FERRY_OFFLOAD},
    {"ON_USE", FERRY_RELOAD_ON_USE},
    {"PREFETCH", FERRY_RELOAD_PREFETCH},
    {"ACTIVATION", FERRY_KIND_ACTIVATION},
    {"PARAMETER", FERRY_KIND_PARAMETER},
    {"BUFFER", FERRY_KIND_BUFFER},
    {"OTHER", FERRY_KIND_OTHER},
    {"FORWARD", FERRY_PHASE_FORWARD},
    {"RECOMPUTE", FERRY_PHASE_RECOMPUTE},
    {"BACKWARD", FERRY_PHASE_BACKWARD},
    {"VIEW", FERRY_FLAG_VIEW},
    {"CONTIGUOUS", FERRY_FLAG_CONTIGUOUS},
};

/* The dtypes, from the one dtype table in ferry.h; given to policies under
 * both spellings: ferry.BF16 and ferry.DTYPE_BF16. */
#define DTYPE_CONSTANT_(e, name, bytes, torch, np) {#e, FERRY_DTYPE_##e},
static const named_const DTYPE_CONSTANTS[] = {
    {"UNKNOWN", FERRY_DTYPE_UNKNOWN},
    FERRY_DTYPE_LIST(DTYPE_CONSTANT_)
};
#undef DTYPE_CONSTANT_

static void set_cfunc(lua_State *L, int table, const char *name, lua_CFunction f, int nup) {
  /* the nup upvalues are on top of the stack */
  lua_pushcclosure(L, f, nup);
  lua_setfield(L, table, name);
}

static void set_offset(lua_State *L, int table, const char *name, size_t off) {
  lua_pushnumber(L, (lua_Number)off);
  lua_setfield(L, table, name);
}

/* lua_cpcall body: open the libraries, build the sandbox. Leaves in the
 * registry: ferry.msgh, ferry.env, ferry.tensor, ferry.ctx, ferry.shape,
 * ferry.strings. */
static int setup_state(lua_State *L) {
  ferry_policy *p = lua_touserdata(L, 1);
  lua_settop(L, 0);
  luaL_openlibs(L);

  lua_newtable(L); /* 1: strings, id -> Lua string */
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_EMPTY);
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_SCRATCH_PATH);
  lua_pushliteral(L, "");
  lua_rawseti(L, 1, STR_SCRATCH_CLASS);
  lua_newtable(L); /* 2: sandbox env */
  lua_newtable(L); /* 3: loaded modules */

  if (luaL_loadbuffer(L, SANDBOX_LUA, sizeof SANDBOX_LUA - 1, "@sandbox.lua") != 0) return lua_error(L);
  /* 4: bootstrap */
  /* arg ffi (luaL_openlibs only preloads it); kept in _LOADED.ffi for
   * trusted policies' require */
  lua_pushcfunction(L, luaopen_ffi);
  lua_pushliteral(L, LUA_FFILIBNAME);
  lua_call(L, 1, 1);
  lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
  lua_pushvalue(L, -2);
  lua_setfield(L, -2, LUA_FFILIBNAME);
  lua_pop(L, 1);
  lua_pushvalue(L, 2); /* arg env */
  lua_newtable(L);     /* arg F */
  int F = lua_gettop(L);
  for (size_t i = 0; i < sizeof FERRY_CONSTANTS / sizeof FERRY_CONSTANTS[0]; i++) {
    lua_pushinteger(L, FERRY_CONSTANTS[i].value);
    lua_setfield(L, F, FERRY_CONSTANTS[i].name);
  }
  for (size_t i = 0; i < sizeof DTYPE_CONSTANTS / sizeof DTYPE_CONSTANTS[0]; i++) {
    lua_pushinteger(L, DTYPE_CONSTANTS[i].value);
    lua_setfield(L, F, DTYPE_CONSTANTS[i].name);
    lua_pushinteger(L, DTYPE_CONSTANTS[i].value);
    lua_pushfstring(L, "DTYPE_%s", DTYPE_CONSTANTS[i].name);
    lua_insert(L, -2);
    lua_settable(L, F);
  }
  lua_newtable(L); /* arg C */
  int C = lua_gettop(L);
  lua_pushvalue(L, 1);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "path", tensor_path, 2);
  lua_pushvalue(L, 1);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "class", tensor_class, 2);
  lua_pushlightuserdata(L, p);
  set_cfunc(L, C, "offloaded_in_layer", ctx_offloaded_in_layer, 1);
  set_cfunc(L, C, "pcall", sandbox_pcall, 0);
  set_cfunc(L, C, "xpcall", sandbox_xpcall, 0);
  set_cfunc(L, C, "log", sandbox_log, 0);
  lua_getglobal(L, "string");
  lua_getfield(L, -1, "gsub");
  lua_remove(L, -2);
  set_cfunc(L, C, "gsub", sandbox_gsub, 1);
  lua_pushvalue(L, 3);
  lua_pushvalue(L, 2);
  set_cfunc(L, C, "require", sandbox_require, 2);
  lua_newtable(L); /* arg offsets */
  int O = lua_gettop(L);
  set_offset(L, O, "ferry_policy_tensor.sizeof", sizeof(policy_tensor_view));
  set_offset(L, O, "ferry_policy_tensor.bytes", offsetof(policy_tensor_view, bytes));
  set_offset(L, O, "ferry_policy_tensor.kind", offsetof(policy_tensor_view, kind));
  set_offset(L, O, "ferry_policy_tensor.phase", offsetof(policy_tensor_view, phase));
  set_offset(L, O, "ferry_policy_tensor.step", offsetof(policy_tensor_view, step));
  set_offset(L, O, "ferry_policy_ctx.sizeof", sizeof(policy_ctx_view));
  set_offset(L, O, "ferry_policy_ctx.host_ram_used_pct", offsetof(policy_ctx_view, host_ram_used_pct));
  set_offset(L, O, "ferry_policy_ctx.bytes_offloaded_this_step",
             offsetof(policy_ctx_view, bytes_offloaded_this_step));
  set_offset(L, O, "ferry_policy_ctx.phase", offsetof(policy_ctx_view, phase));
  lua_pushboolean(L, p->trusted);
  lua_call(L, 6, 3); /* stack: strings, env, loaded, tensor, ctx, shape */

  p->tensor = (policy_tensor_view *)lua_topointer(L, 4);
  p->ctx = (policy_ctx_view *)lua_topointer(L, 5);
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.shape");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.ctx");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.tensor");
  lua_pop(L, 1); /* loaded lives on as an upvalue of require */
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.env");
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.strings");
  lua_pushcfunction(L, policy_msgh);
  lua_setfield(L, LUA_REGISTRYINDEX, "ferry.msgh");
  return 0;
}

static int policy_panic(lua_State *L) {
  fprintf(stderr, "ferry: unrecoverable error in a policy's Lua state: %s\n",
          lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
  abort();
}

/* ---- loading ------------------------------------------------------------ */
/* Line of the first occurrence of identifier `word` in src, 0 if none. */
static int source_line_of(const char *src, const char *word) {
  if (!src) return 0;
  size_t wl = strlen(word);
  int line = 1;
  for (const char *c = src; *c; c++) {
    if (*c == '\n') {
      line++;
      continue;
    }
    if (strncmp(c, word, wl) == 0) {
      char before = c == src ? ' ' : c[-1], after = c[wl];
      int ident_before = before == '_' || (before >= 'a' && before <= 'z') ||
                         (before >= 'A' && before <= 'Z') || (before >= '0' && before <= '9');
      int ident_after = after == '_' || (after >= 'a' && after <= 'z') ||
                        (after >= 'A' && after <= 'Z') || (after >= '0' && after <= '9');
      if (!ident_before && !ident_after) return line;
    }
  }
  return 0;
}

/* Line of the last statement starting with `return` (the policy table), 0 if none. */
static int last_return_line(const char *src) {
  int line = 1, found = 0;
  for (const char *c = src; c && *c; c++) {
    const char *s = c;
    while (*s == ' ' || *s == '\t') s++;
    if (!strncmp(s, "return", 6) && !(s[6] == '_' || (s[6] >= 'a' && s[6] <= 'z') ||
                                      (s[6] >= 'A' && s[6] <= 'Z') || (s[6] >= '0' && s[6] <= '9')))
      found = line;
    while (*c && *c != '\n') c++;
    if (!*c) break;
    line++;
  }
  return found;
}

/* Write "chunk:line: msg" (or "chunk: msg" without a line) into errbuf. */
static int load_fail(ferry_policy *p, const char *src, const char *word, char *errbuf,
                     size_t errlen, const char *fmt, ...) {
  char msg[MSG_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  int line = !word ? 0 : !strcmp(word, "return") ? last_return_line(src) : source_line_of(src, word);
  if (!line && word) line = last_return_line(src);
  if (errbuf && errlen) {
    if (line)
      snprintf(errbuf, errlen, "%s:%d: %s", p->chunk, line, msg);
    else
      snprintf(errbuf, errlen, "%s: %s", p->chunk, msg);
  }
  return FERRY_EPOLICY;
}

static const char *describe_value(lua_State *L, int idx, char *buf, size_t n) {
  switch (lua_type(L, idx)) {
  case LUA_TNUMBER:
    if (isnan(lua_tonumber(L, idx)))
      snprintf(buf, n, "nan");
    else
      snprintf(buf, n, "%.17g", lua_tonumber(L, idx));
    break;
  case LUA_TSTRING:
    snprintf(buf, n, "string \"%.40s\"", lua_tostring(L, idx));
    break;
  case LUA_TBOOLEAN:
    snprintf(buf, n, "%s", lua_toboolean(L, idx) ? "true" : "false");
    break;
  default:
    snprintf(buf, n, "%s", luaL_typename(L, idx));
  }
  return buf;
}

typedef struct knob_spec {
  const char *name;
  double max;
} knob_spec;

static const knob_spec KNOBS[] = {
    {"max_fwd_stash", KNOB_MAX_FWD_STASH},
    {"prefetch_distance", KNOB_MAX_PREFETCH_DISTANCE},
    {"min_offload_bytes", (double)KNOB_MAX_MIN_OFFLOAD_BYTES},
    {"max_fwd_stash_bytes", (double)KNOB_MAX_MIN_OFFLOAD_BYTES},
};

/* The policy table is at the top of the stack. Reads it with raw accesses
 * only (no policy code runs). */
static int validate_policy_table(ferry_policy *p, const char *src, char *errbuf, size_t errlen) {
  lua_State *L = p->L;
  int tbl = lua_gettop(L);
  char vb[96];
  if (!lua_istable(L, tbl))
    return load_fail(p, src, "return", errbuf, errlen,
                     "a policy must return a table { api = %d, decide = function(t, ctx) ... end }, "
                     "got %s", FERRY_POLICY_API_VERSION, luaL_typename(L, tbl));

  lua_pushliteral(L, "api");
  lua_rawget(L, tbl);
  if (lua_isnil(L, -1))
    return load_fail(p, src, "return", errbuf, errlen,
                     "the policy table has no 'api' field (this ferry provides API version %d: "
                     "return { api = %d, ... })", FERRY_POLICY_API_VERSION, FERRY_POLICY_API_VERSION);
  if (lua_type(L, -1) != LUA_TNUMBER || lua_tonumber(L, -1) != floor(lua_tonumber(L, -1)))
    return load_fail(p, src, "api", errbuf, errlen, "api must be an integer, got %s",
                     describe_value(L, -1, vb, sizeof vb));
  if (lua_tonumber(L, -1) != FERRY_POLICY_API_VERSION)
    return load_fail(p, src, "api", errbuf, errlen,
                     "policy requires API version %s, this ferry provides %d",
                     describe_value(L, -1, vb, sizeof vb), FERRY_POLICY_API_VERSION);
  lua_pop(L, 1);

  lua_pushliteral(L, "name");
  lua_rawget(L, tbl);
  if (!lua_isnil(L, -1)) {
    if (lua_type(L, -1) != LUA_TSTRING || lua_objlen(L, -1) == 0 || lua_objlen(L, -1) >= sizeof p->name)
      return load_fail(p, src, "name", errbuf, errlen,
                       "name must be a non-empty string shorter than %zu bytes, got %s",
                       sizeof p->name, describe_value(L, -1, vb, sizeof vb));
    copy_str(p->name, sizeof p->name, lua_tostring(L, -1));
  }
  lua_pop(L, 1);

  lua_pushliteral(L, "decide");
  lua_rawget(L, tbl);
  if (lua_isnil(L, -1))
    return load_fail(p, src, "return", errbuf, errlen,
                     "the policy table has no decide function (decide = function(t, ctx) ... end)");
  if (!lua_isfunction(L, -1))
    return load_fail(p, src, "decide", errbuf, errlen, "decide must be a function, got %s",
                     luaL_typename(L, -1));
  {
    lua_Debug ar;
    lua_pushvalue(L, -1);
    if (lua_getinfo(L, ">S", &ar) && ar.linedefined > 0)
      snprintf(p->decide_where, sizeof p->decide_where, "%s:%d", ar.short_src, ar.linedefined);
    else
      copy_str(p->decide_where, sizeof p->decide_where, p->chunk);
  }
  lua_pop(L, 1);

  /* Optional snapshot(e) (checkpoint entries): kept in the registry, so the
   * permanent stack of decide stays as it is. */
  lua_pushliteral(L, "snapshot");
  lua_rawget(L, tbl);
  if (!lua_isnil(L, -1)) {
    if (!lua_isfunction(L, -1))
      return load_fail(p, src, "snapshot", errbuf, errlen,
                       "snapshot must be a function (snapshot = function(e) ... end), got %s",
                       luaL_typename(L, -1));
    lua_Debug ar;
    lua_pushvalue(L, -1);
    if (lua_getinfo(L, ">S", &ar) && ar.linedefined > 0)
      snprintf(p->snapshot_where, sizeof p->snapshot_where, "%s:%d", ar.short_src,
               ar.linedefined);
    else
      copy_str(p->snapshot_where, sizeof p->snapshot_where, p->chunk);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, "ferry.snapshot");
    p->has_snapshot = 1;
  }
  lua_pop(L, 1);

  lua_pushliteral(L, "knobs");
  lua_rawget(L, tbl);
  int knobs = lua_gettop(L);
  if (!lua_isnil(L, knobs)) {
    if (!lua_istable(L, knobs))
      return load_fail(p, src, "knobs", errbuf, errlen, "knobs must be a table, got %s",
                       luaL_typename(L, knobs));
    lua_pushnil(L);
    while (lua_next(L, knobs)) { /* stack: ..., key, value */
      if (lua_type(L, -2) != LUA_TSTRING)
        return load_fail(p, src, "knobs", errbuf, errlen, "knob names must be strings, got a %s key",
                         luaL_typename(L, -2));
      const char *k = lua_tostring(L, -2);
      size_t which = 0;
      while (which < sizeof KNOBS / sizeof KNOBS[0] && strcmp(KNOBS[which].name, k)) which++;
      if (which == sizeof KNOBS / sizeof KNOBS[0])
        return load_fail(p, src, k, errbuf, errlen,
                         "unknown knob '%s' (known: max_fwd_stash, prefetch_distance, "
                         "min_offload_bytes, max_fwd_stash_bytes)", k);
      double v = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : NAN;
      if (lua_type(L, -1) != LUA_TNUMBER || v != floor(v))
        return load_fail(p, src, k, errbuf, errlen, "knob '%s' must be an integer, got %s", k,
                         describe_value(L, -1, vb, sizeof vb));
      if (v < 0 || v > KNOBS[which].max)
        return load_fail(p, src, k, errbuf, errlen, "knob '%s' must be within [0, %.0f], got %s",
                         k, KNOBS[which].max, describe_value(L, -1, vb, sizeof vb));
      if (which == 0) {
        p->knobs.has_max_fwd_stash = 1;
        p->knobs.max_fwd_stash = (uint32_t)v;
      } else if (which == 1) {
        p->knobs.has_prefetch_distance = 1;
        p->knobs.prefetch_distance = (uint32_t)v;
      } else if (which == 2) {
        p->knobs.has_min_offload_bytes = 1;
        p->knobs.min_offload_bytes = (uint64_t)v;
      } else {
        p->knobs.has_max_fwd_stash_bytes = 1;
        p->knobs.max_fwd_stash_bytes = (uint64_t)v;
      }
      lua_pop(L, 1);
    }
  }
  lua_pop(L, 1);
  return FERRY_OK;
}

static char *read_policy_file(const char *path, size_t *len, char *err, size_t errlen) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "%s: cannot open the policy file: %s", path, strerror(errno));
    return NULL;
  }
  char *buf = malloc(MAX_POLICY_FILE + 1);
  size_t n = buf ? fread(buf, 1, MAX_POLICY_FILE + 1, f) : 0;
  int bad = !buf || ferror(f);
  fclose(f);
  if (bad || n > MAX_POLICY_FILE) {
    snprintf(err, errlen, "%s: %s", path,
             !buf ? "out of memory" : bad ? "cannot read the policy file" :
                                           "policy file larger than 16 MiB");
    free(buf);
    return NULL;
  }
  buf[n] = '\0';
  *len = n;
  return buf;
}

/* Run policy code: a function and nargs arguments on top of the stack,
 * with the cap and the instruction budget. Returns the lua_pcall status. */
static int run_protected(ferry_policy *p, int nargs, int nresults, int msgh, uint64_t max_instr) {
  p->ticks = 0;
  p->tick_budget = max_instr / HOOK_PERIOD;
  p->interrupt = INTERRUPT_NONE;
  p->c_nesting = 0;
  p->enforce_cap = 1;
  int status = lua_pcall(p->L, nargs, nresults, msgh);
  p->enforce_cap = 0;
  return status;
}

/* After a failed run: the message ("file:line: ..."), then recover memory. */
static void take_fault(ferry_policy *p, int status, char *out, size_t n) {
  lua_State *L = p->L;
  if (p->interrupt)
    copy_str(out, n, p->interrupt_msg);
  else if (status == LUA_ERRMEM)
    snprintf(out, n, "%s: out of memory", p->chunk);
  else if (lua_type(L, -1) == LUA_TSTRING && has_position(lua_tostring(L, -1)))
    copy_str(out, n, lua_tostring(L, -1));
  else if (lua_type(L, -1) == LUA_TSTRING) /* e.g. from the loader */
    snprintf(out, n, "%s: %s", p->chunk, lua_tostring(L, -1));
  else
    snprintf(out, n, "%s: error object is a %s value", p->chunk, luaL_typename(L, -1));
  lua_pop(L, 1);
  if (p->interrupt == INTERRUPT_MEMORY || status == LUA_ERRMEM) lua_gc(L, LUA_GCCOLLECT, 0);
  p->interrupt = INTERRUPT_NONE;
}

static void chunk_display_name(ferry_policy *p, const char *path) {
  if (!path) {
    copy_str(p->chunk, sizeof p->chunk, "policy");
    return;
  }
  /* what LuaJIT prints for "@path": the tail of long paths after "..." */
  size_t len = strlen(path), max = LUA_IDSIZE - 1;
  if (len <= max)
    copy_str(p->chunk, sizeof p->chunk, path);
  else
    snprintf(p->chunk, sizeof p->chunk, "...%s", path + len - (max - 3));
}

static void default_name(ferry_policy *p, const char *path) {
  if (!path) {
    copy_str(p->name, sizeof p->name, "policy");
    return;
  }
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  copy_str(p->name, sizeof p->name, base);
  size_t l = strlen(p->name);
  if (l > 4 && !strcmp(p->name + l - 4, ".lua")) p->name[l - 4] = '\0';
}

int ferry_policy_create(const char *path, const char *source, int trusted, ferry_policy **out,
                        char *errbuf, size_t errlen) {
  char scratch_err[8];
  if (!errbuf || !errlen) {
    errbuf = scratch_err;
    errlen = sizeof scratch_err;
  }
  errbuf[0] = '\0';
  if (!out || (!path && !source)) {
    snprintf(errbuf, errlen, "ferry_policy_create: no path or source given");
    return FERRY_EINVAL;
  }
  *out = NULL;
  ferry_policy *p = calloc(1, sizeof *p);
  if (!p) {
    snprintf(errbuf, errlen, "out of memory creating a policy");
    return FERRY_ENOMEM;
  }
  p->trusted = trusted != 0;
  p->mem_cap = (size_t)env_ull("FERRY_POLICY_MEM_MB", DEFAULT_MEM_CAP >> 20, 4, 1 << 20) << 20;
  p->error_budget = (unsigned)env_ull("FERRY_POLICY_ERROR_BUDGET", DEFAULT_ERROR_BUDGET, 1, 1u << 30);
  const char *libdir = getenv("FERRY_POLICY_LIBDIR");
#ifdef FERRY_POLICY_LIBDIR
  if (!libdir || !*libdir) libdir = FERRY_POLICY_LIBDIR;
#endif
  copy_str(p->libdir, sizeof p->libdir, libdir);
  chunk_display_name(p, path);
  default_name(p, path);
  p->cap_strings = 64;
  p->strings = calloc(p->cap_strings, sizeof *p->strings);
  p->by_content_mask = 127;
  p->by_content = calloc(p->by_content_mask + 1, sizeof *p->by_content);
  p->n_strings = STR_FIRST;

  char *file_src = NULL;
  size_t src_len = 0;
  int rc = FERRY_EPOLICY;
  if (path) {
    file_src = read_policy_file(path, &src_len, errbuf, errlen);
    if (!file_src) goto fail;
  } else {
    src_len = strlen(source);
  }
  const char *src = file_src ? file_src : source;

  if (!p->strings || !p->by_content || !(p->L = lua_newstate(policy_alloc, p))) {
    snprintf(errbuf, errlen, "%s: out of memory creating its Lua state", p->chunk);
    rc = FERRY_ENOMEM;
    goto fail;
  }
  lua_State *L = p->L;
  lua_atpanic(L, policy_panic);
  if (lua_cpcall(L, setup_state, p) != 0) {
    snprintf(errbuf, errlen, "%s: cannot set up the policy sandbox: %s", p->chunk,
               lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
    goto fail;
  }
  /* No trace may exist before policy code runs: see the top of this file. */
  luaJIT_setmode(L, 0, LUAJIT_MODE_ENGINE | LUAJIT_MODE_OFF);
  lua_sethook(L, policy_hook, LUA_MASKCOUNT, HOOK_PERIOD);

  lua_settop(L, 0);
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.msgh"); /* 1 */
  /* A '#' first line (shebang) is skipped, as lua does; the newline stays so
   * line numbers match the file. */
  const char *code = src;
  if (code[0] == '#')
    while (*code && *code != '\n') code++;
  char chunkname[1100];
  if (path)
    snprintf(chunkname, sizeof chunkname, "@%s", path);
  else
    copy_str(chunkname, sizeof chunkname, "=policy");
  p->enforce_cap = 1;
  int status = luaL_loadbufferx(L, code, src_len - (size_t)(code - src), chunkname, "t");
  p->enforce_cap = 0;
  if (status) {
    take_fault(p, status, errbuf, errlen);
    goto fail;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.env");
  lua_setfenv(L, -2);
  status = run_protected(p, 0, 1, 1, LOAD_MAX_INSTRUCTIONS);
  if (status) {
    take_fault(p, status, errbuf, errlen);
    goto fail;
  }
  if ((rc = validate_policy_table(p, src, errbuf, errlen))) goto fail;

  /* the permanent stack: see SLOT_* */
  lua_pushliteral(L, "decide");
  lua_rawget(L, 2); /* stack: msgh, table, decide */
  lua_remove(L, 2);
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.tensor");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.ctx");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.shape");
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.strings");
  if (lua_gettop(L) != SLOT_COUNT_) {
    snprintf(errbuf, errlen, "%s: internal error laying out the policy state", p->chunk);
    goto fail;
  }
  lua_gc(L, LUA_GCCOLLECT, 0); /* start decide calls with the load garbage gone */
  free(file_src);
  *out = p;
  return FERRY_OK;

fail:
  free(file_src);
  ferry_policy_destroy(p);
  return rc;
}

void ferry_policy_destroy(ferry_policy *p) {
  if (!p) return;
  if (p->L) lua_close(p->L);
  for (uint32_t i = STR_FIRST; i < p->n_strings; i++) free(p->strings[i].str);
  free(p->strings);
  free(p->by_content);
  free(p->sites);
  free(p);
}

const char *ferry_policy_name(const ferry_policy *p) { return p ? p->name : ""; }

void ferry_policy_get_knobs(const ferry_policy *p, ferry_policy_knobs *out) {
  if (!out) return;
  if (!p) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = p->knobs;
}

void ferry_policy_get_stats(const ferry_policy *p, ferry_policy_stats *out) {
  if (!out) return;
  if (!p) {
    memset(out, 0, sizeof *out);
    return;
  }
  *out = p->stats;
}

const char *ferry_policy_last_error(const ferry_policy *p) { return p ? p->last_error : ""; }

void ferry_policy_step_begin(ferry_policy *p, uint64_t step) {
  if (p) p->step = step;
}

/* ---- interning ---------------------------------------------------------- */
static uint64_t hash_bytes(const char *s, size_t *len) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  const char *c = s;
  for (; *c; c++) h = (h ^ (unsigned char)*c) * 1099511628211ull;
  *len = (size_t)(c - s);
  return h | 1; /* never 0 */
}

static int grow_content_index(ferry_policy *p) {
  uint32_t cap = (p->by_content_mask + 1) * 2;
  uint32_t *idx = calloc(cap, sizeof *idx);
  if (!idx) return -1;
  for (uint32_t id = STR_FIRST; id < p->n_strings; id++) {
    uint32_t s = (uint32_t)p->strings[id].hash & (cap - 1);
    while (idx[s]) s = (s + 1) & (cap - 1);
    idx[s] = id;
  }
  free(p->by_content);
  p->by_content = idx;
  p->by_content_mask = cap - 1;
  return 0;
}

/* The id of string s, interning it on first sight. scratch is the slot used
 * when the table is full (then the Lua string is pushed for this call). */
static uint32_t intern_content(ferry_policy *p, const char *s, uint32_t scratch) {
  size_t len;
  uint64_t h = hash_bytes(s, &len);
  uint32_t slot = (uint32_t)h & p->by_content_mask;
  for (uint32_t id; (id = p->by_content[slot]); slot = (slot + 1) & p->by_content_mask) {
    const interned *e = &p->strings[id];
    if (e->hash == h && e->len == len && !memcmp(e->str, s, len)) return id;
  }
  lua_State *L = p->L;
  int full = p->n_strings >= MAX_STRINGS;
  if (!full) {
    void *strings = p->strings;
    if (util_grow(&strings, &p->cap_strings, sizeof *p->strings, p->n_strings + 1, 0) == 0)
      p->strings = strings;
    else
      full = 1;
  }
  char *copy = full ? NULL : malloc(len + 1);
  if (full || !copy || ((p->n_strings + 1) * 2 > p->by_content_mask + 1 && grow_content_index(p))) {
    free(copy);
    lua_pushlstring(L, s, len);
    lua_rawseti(L, SLOT_STRINGS, (int)scratch);
    return scratch;
  }
  memcpy(copy, s, len + 1);
  uint32_t id = p->n_strings++;
  p->strings[id] = (interned){copy, len, h};
  slot = (uint32_t)h & p->by_content_mask;
  while (p->by_content[slot]) slot = (slot + 1) & p->by_content_mask;
  p->by_content[slot] = id;
  lua_pushlstring(L, s, len);
  lua_rawseti(L, SLOT_STRINGS, (int)id);
  return id;
}

/* Pointers from ferry_intern() are stable, so a pointer cache answers most
 * lookups; the content is still compared, since any pointer may be passed
 * and a freed string's address may be reused for another. */
static uint32_t intern(ferry_policy *p, const char *s, uint32_t scratch) {
  if (!s || !*s) return STR_EMPTY;
  ptr_cache_entry *c = &p->ptr_cache[util_mix64((uintptr_t)s) & (PTR_CACHE_SIZE - 1)];
  if (c->ptr == s && !strcmp(s, p->strings[c->id].str)) return c->id;
  uint32_t id = intern_content(p, s, scratch);
  if (id >= STR_FIRST) {
    c->ptr = s;
    c->id = id;
  }
  return id;
}

/* ---- site cache --------------------------------------------------------- */
static uint64_t site_hash(const site_key *k) {
  uint64_t h = util_mix64(((uint64_t)k->path_id << 32) | k->class_id);
  h = util_mix64(h ^ (((uint64_t)(uint32_t)k->dtype << 40) | ((uint64_t)(uint32_t)k->kind << 8) |
                 (uint32_t)k->ndim));
  for (int i = 0; i < k->ndim; i++) h = util_mix64(h ^ (uint64_t)k->shape[i]);
  return h | 1;
}

static int site_equal(const site_key *a, const site_key *b) {
  if (a->path_id != b->path_id || a->class_id != b->class_id || a->dtype != b->dtype ||
      a->kind != b->kind || a->ndim != b->ndim)
    return 0;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static const site_entry *site_find(const ferry_policy *p, const site_key *k, uint64_t h) {
  if (!p->sites) return NULL;
  for (uint32_t s = (uint32_t)h & p->sites_mask;; s = (s + 1) & p->sites_mask) {
    const site_entry *e = &p->sites[s];
    if (!e->hash) return NULL;
    if (e->hash == h && site_equal(&e->key, k)) return e;
  }
}

static void site_insert(ferry_policy *p, const site_key *k, uint64_t h, const ferry_decision *d) {
  if (p->n_sites >= SITE_CACHE_MAX) return;
  if (!p->sites || (p->n_sites + 1) * 2 > p->sites_mask + 1) {
    uint32_t cap = p->sites ? (p->sites_mask + 1) * 2 : 256;
    site_entry *grown = calloc(cap, sizeof *grown);
    if (!grown) return;
    for (uint32_t i = 0; p->sites && i <= p->sites_mask; i++) {
      if (!p->sites[i].hash) continue;
      uint32_t s = (uint32_t)p->sites[i].hash & (cap - 1);
      while (grown[s].hash) s = (s + 1) & (cap - 1);
      grown[s] = p->sites[i];
    }
    free(p->sites);
    p->sites = grown;
    p->sites_mask = cap - 1;
  }
  uint32_t s = (uint32_t)h & p->sites_mask;
  while (p->sites[s].hash) s = (s + 1) & p->sites_mask;
  p->sites[s] = (site_entry){h, *k, *d};
  p->n_sites++;
}

/* ---- deciding ----------------------------------------------------------- */
static void count_fault(ferry_policy *p, const char *msg) {
  p->stats.errors++;
  if (p->stats.errors >= p->error_budget) {
    p->stats.disabled = 1;
    snprintf(p->last_error, sizeof p->last_error,
             "%.400s (policy disabled after %u faults: every tensor is now kept)", msg,
             p->error_budget);
  } else {
    copy_str(p->last_error, sizeof p->last_error, msg);
  }
}

static void nonsense(ferry_policy *p, const char *what, const char *expected, int idx) {
  char vb[96], msg[MSG_LEN];
  snprintf(msg, sizeof msg, "%.300s: decide returned a nonsense %s: %s (expected %s); the tensor was kept",
           p->decide_where, what, describe_value(p->L, idx, vb, sizeof vb), expected);
  count_fault(p, msg);
}

/* Read decide's answer at stack slots first..first+3 into *d. */
static int read_answer(ferry_policy *p, int first, ferry_decision *d) {
  lua_State *L = p->L;
  int a = first, r = first + 1, dist = first + 2, c = first + 3;
  lua_Number v;
  if (lua_type(L, a) != LUA_TNUMBER || ((v = lua_tonumber(L, a)) != FERRY_KEEP && v != FERRY_OFFLOAD))
    return nonsense(p, "action", "ferry.KEEP or ferry.OFFLOAD", a), -1;
  d->action = (int32_t)v;
  if (lua_isnil(L, r)) {
    d->reload = FERRY_RELOAD_ON_USE;
  } else if (lua_type(L, r) != LUA_TNUMBER ||
             ((v = lua_tonumber(L, r)) != FERRY_RELOAD_ON_USE && v != FERRY_RELOAD_PREFETCH)) {
    return nonsense(p, "reload", "ferry.ON_USE or ferry.PREFETCH", r), -1;
  } else {
    d->reload = (int32_t)v;
  }
  if (lua_isnil(L, dist)) {
    d->prefetch_distance = -1; /* the engine's default */
  } else if (lua_type(L, dist) != LUA_TNUMBER || !((v = lua_tonumber(L, dist)) >= 0) ||
             v > MAX_PREFETCH_DISTANCE || v != floor(v)) {
    return nonsense(p, "prefetch distance", "an integer in [0, 4096] or nil", dist), -1;
  } else {
    d->prefetch_distance = (int32_t)v;
  }
  if (lua_isnil(L, c) || lua_type(L, c) == LUA_TBOOLEAN)
    d->cacheable = lua_toboolean(L, c);
  else
    return nonsense(p, "cache flag", "true, false or nil", c), -1;
  return 0;
}

void ferry_policy_decide(ferry_policy *p, const ferry_tensor_desc *desc, const ferry_context *ctx,
                         ferry_decision *out) {
  static const ferry_decision keep = {FERRY_KEEP, FERRY_RELOAD_ON_USE, -1, 0};
  *out = keep;
  if (!p || !desc || p->stats.disabled) return;

  site_key key;
  key.path_id = intern(p, desc->module_path, STR_SCRATCH_PATH);
  key.class_id = intern(p, desc->module_class, STR_SCRATCH_CLASS);
  key.dtype = desc->dtype;
  key.kind = desc->kind;
  key.ndim = desc->ndim < 0 ? 0 : desc->ndim > FERRY_MAX_DIMS ? FERRY_MAX_DIMS : desc->ndim;
  for (int i = 0; i < key.ndim; i++) key.shape[i] = desc->shape[i];
  int site_cacheable = key.path_id != STR_SCRATCH_PATH && key.class_id != STR_SCRATCH_CLASS;
  uint64_t h = 0;
  if (site_cacheable && p->n_sites) {
    h = site_hash(&key);
    const site_entry *e = site_find(p, &key, h);
    if (e) {
      *out = e->decision;
      p->stats.cache_hits++;
      return;
    }
  }

  lua_State *L = p->L;
  policy_tensor_view *t = p->tensor;
  t->bytes = (double)desc->bytes;
  t->kind = desc->kind;
  t->dtype = desc->dtype;
  t->ndim = key.ndim;
  t->flags = (int32_t)desc->flags;
  t->layer = desc->layer;
  t->layer_count = desc->layer_count;
  t->phase = desc->phase;
  t->step = (double)(ctx ? ctx->step : p->step);
  policy_ctx_view *c = p->ctx;
  if (ctx) {
    c->step = (double)ctx->step;
    c->phase = ctx->phase;
    c->host_ram_used_pct = ctx->host_ram_used_pct;
    c->arena_in_use = (double)ctx->arena_in_use;
    c->arena_cap = (double)ctx->arena_cap;
    c->stash_depth = (double)ctx->stash_depth;
    c->bytes_in_flight = (double)ctx->bytes_in_flight;
    c->packed_this_step = (double)ctx->packed_this_step;
    c->offloaded_this_step = (double)ctx->offloaded_this_step;
    c->bytes_offloaded_this_step = (double)ctx->bytes_offloaded_this_step;
  } else {
    memset(c, 0, sizeof *c);
    c->step = (double)p->step;
  }
  p->cur_ctx = ctx;
  p->cur_path_id = key.path_id;
  p->cur_class_id = key.class_id;
  for (int i = 0; i < key.ndim; i++) {
    lua_pushnumber(L, (lua_Number)desc->shape[i]);
    lua_rawseti(L, SLOT_SHAPE, i);
  }
  for (int i = key.ndim; i < p->shape_len; i++) {
    lua_pushnil(L);
    lua_rawseti(L, SLOT_SHAPE, i);
  }
  p->shape_len = key.ndim;

  p->stats.calls++;
  lua_pushvalue(L, SLOT_DECIDE);
  lua_pushvalue(L, SLOT_TENSOR);
  lua_pushvalue(L, SLOT_CTX);
  p->running = p->decide_where;
  int status = run_protected(p, 2, 4, SLOT_MSGH, DECIDE_MAX_INSTRUCTIONS);
  p->running = NULL;
  p->cur_ctx = NULL;
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
  } else {
    ferry_decision d;
    if (read_answer(p, SLOT_COUNT_ + 1, &d) == 0) {
      *out = d;
      if (d.cacheable && site_cacheable) {
        if (!h) h = site_hash(&key);
        site_insert(p, &key, h, &d);
      }
    }
  }
  lua_settop(L, SLOT_COUNT_);
}

/* ---- checkpoint snapshots ----------------------------------------------- */
int ferry_policy_has_snapshot(const ferry_policy *p) { return p && p->has_snapshot; }

static void snapshot_nonsense(ferry_policy *p, const char *what, const char *expected, int idx) {
  char vb[96], msg[MSG_LEN];
  snprintf(msg, sizeof msg,
           "%.300s: snapshot returned a nonsense %s: %s (expected %s); the entry was staged",
           p->snapshot_where, what, describe_value(p->L, idx, vb, sizeof vb), expected);
  count_fault(p, msg);
}

static void set_string_field(lua_State *L, const char *name, const char *value) {
  lua_pushstring(L, value ? value : "");
  lua_setfield(L, -2, name);
}

static void set_number_field(lua_State *L, const char *name, lua_Number value) {
  lua_pushnumber(L, value);
  lua_setfield(L, -2, name);
}

void ferry_policy_snapshot(ferry_policy *p, const ferry_snapshot_entry *e,
                           ferry_snapshot_choice *out) {
  if (!out) return;
  out->stage = 1;
  out->order = e ? (double)e->index : 0;
  if (!p || !e || !p->has_snapshot || p->stats.disabled) return;
  lua_State *L = p->L;
  /* Snapshots are rare (every N steps) and have few entries: a fresh table
   * per call keeps the Lua side simple. */
  lua_getfield(L, LUA_REGISTRYINDEX, "ferry.snapshot");
  lua_createtable(L, 0, 6); /* stack: ..., snapshot, e */
  set_string_field(L, "key", e->key);
  set_string_field(L, "path", e->path);
  set_number_field(L, "bytes", (lua_Number)e->bytes);
  set_number_field(L, "index", e->index);
  set_number_field(L, "dtype", e->dtype);
  lua_pushboolean(L, e->on_device != 0);
  lua_setfield(L, -2, "device");
  p->stats.calls++;
  p->running = p->snapshot_where;
  int status = run_protected(p, 1, 2, SLOT_MSGH, DECIDE_MAX_INSTRUCTIONS);
  p->running = NULL;
  if (status) {
    char msg[MSG_LEN];
    take_fault(p, status, msg, sizeof msg);
    count_fault(p, msg);
  } else {
    int st = SLOT_COUNT_ + 1, ord = SLOT_COUNT_ + 2;
    if (!lua_isnil(L, st) && lua_type(L, st) != LUA_TBOOLEAN) {
      snapshot_nonsense(p, "stage flag", "true, false or nil", st);
    } else if (!lua_isnil(L, ord) &&
               (lua_type(L, ord) != LUA_TNUMBER || !isfinite(lua_tonumber(L, ord)))) {
      snapshot_nonsense(p, "order", "a finite number or nil", ord);
    } else {
      out->stage = lua_isnil(L, st) || lua_toboolean(L, st);
      if (!lua_isnil(L, ord)) out->order = lua_tonumber(L, ord);
    }
  }
  lua_settop(L, SLOT_COUNT_);
}
