/* test_policy.c — the Lua policy host: sandbox, faults, budgets, cache.
 * Policies are written to files in a temporary directory so that every
 * error message can be checked for its exact "file:line: message". */
#include <lauxlib.h>
#include <lua.h>
#include <math.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"

/* ---- helpers ------------------------------------------------------------ */
static char tmp_dir[64];

static const char *temp_dir(void) {
  if (!tmp_dir[0]) {
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/ferry-policy-XXXXXX");
    if (!mkdtemp(tmp_dir)) {
      perror("mkdtemp");
      abort();
    }
  }
  return tmp_dir;
}

/* Write `text` to DIR/name and return the path (static buffer per call
 * site is not needed: callers copy it). */
static void write_file(char *path, size_t n, const char *name, const char *text) {
  snprintf(path, n, "%s/%s", temp_dir(), name);
  FILE *f = fopen(path, "wb");
  if (!f) {
    perror(path);
    abort();
  }
  fputs(text, f);
  fclose(f);
}

static ferry_tensor_desc desc_of(const char *path, const char *cls, int kind, uint64_t bytes) {
  ferry_tensor_desc d = FERRY_TENSOR_DESC_INIT;
  d.bytes = bytes;
  d.dtype = FERRY_DTYPE_BF16;
  d.kind = kind;
  d.ndim = 2;
  d.shape[0] = 4;
  d.shape[1] = (int64_t)(bytes / 8);
  d.flags = FERRY_FLAG_CONTIGUOUS;
  d.layer = 3;
  d.layer_count = 8;
  d.phase = FERRY_PHASE_FORWARD;
  d.module_path = path;
  d.module_class = cls;
  return d;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Load a policy file that must fail; compare the whole message. */
static int expect_load_error(const char *name, const char *text, int trusted, int line,
                             const char *msg) {
  char path[256], err[1024], want[1024];
  write_file(path, sizeof path, name, text);
  ferry_policy *p = NULL;
  int rc = ferry_policy_create(path, NULL, trusted, &p, err, sizeof err);
  if (line)
    snprintf(want, sizeof want, "%s:%d: %s", path, line, msg);
  else
    snprintf(want, sizeof want, "%s: %s", path, msg);
  if (rc != FERRY_EPOLICY || p != NULL || strcmp(err, want) != 0) {
    fprintf(stderr, "%s: rc %d\n  got  \"%s\"\n  want \"%s\"\n", name, rc, err, want);
    ferry_policy_destroy(p);
    return 1;
  }
  return 0;
}

static ferry_policy *load_file(const char *name, const char *text, int trusted, char *path,
                               size_t pathlen) {
  write_file(path, pathlen, name, text);
  char err[1024];
  ferry_policy *p = NULL;
  if (ferry_policy_create(path, NULL, trusted, &p, err, sizeof err) != FERRY_OK)
    fprintf(stderr, "%s: unexpected load error: %s\n", name, err);
  return p;
}

/* last_error must be exactly "path:line: msg" */
static int expect_fault(ferry_policy *p, const char *path, int line, const char *msg) {
  char want[1024];
  snprintf(want, sizeof want, "%s:%d: %s", path, line, msg);
  if (strcmp(ferry_policy_last_error(p), want) != 0) {
    fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", ferry_policy_last_error(p), want);
    return 1;
  }
  return 0;
}

/* ---- tests -------------------------------------------------------------- */

/* Everything the contract promises a policy can see arrives intact, and
 * the answer comes back as given. */
TEST(policy_sees_descriptor_and_context) {
  char path[256];
  ferry_policy *p = load_file("fields.lua",
      "local seen = {}\n"
      "return { api = 1, name = 'fields',\n"
      "  knobs = { max_fwd_stash = 6, prefetch_distance = 3, min_offload_bytes = 2048 },\n"
      "  decide = function(t, ctx)\n"
      "    assert(type(t) == 'table' and type(ctx) == 'table')\n"
      "    assert(t.bytes == 2^40, 'bytes ' .. t.bytes)\n"
      "    assert(t.dtype == ferry.BF16 and t.dtype == ferry.DTYPE_BF16)\n"
      "    assert(t.kind == ferry.ACTIVATION and t.ndim == 3)\n"
      "    assert(t.shape[0] == 2 and t.shape[1] == 3 and t.shape[2] == 5 and t.shape[3] == nil)\n"
      "    assert(t.flags == ferry.VIEW + ferry.CONTIGUOUS)\n"
      "    assert(t.layer == 3 and t.layer_count == 8 and t.phase == ferry.RECOMPUTE)\n"
      "    assert(t.step == 41 and ctx.step == 41 and ctx.phase == ferry.BACKWARD)\n"
      "    assert(t:path() == 'model.layers.3.mlp.up_proj' and t:class() == 'Linear')\n"
      "    assert(ctx.host_ram_used_pct == 12.5 and ctx.arena_in_use == 1000)\n"
      "    assert(ctx.arena_cap == 2^33 and ctx.stash_depth == 2)\n"
      "    assert(ctx.bytes_in_flight == 77 and ctx.packed_this_step == 10)\n"
      "    assert(ctx.offloaded_this_step == 4 and ctx.bytes_offloaded_this_step == 4096)\n"
      "    assert(ctx:offloaded_in_layer(0) == 1 and ctx:offloaded_in_layer(2) == 9)\n"
      "    assert(ctx:offloaded_in_layer(3) == 0 and ctx:offloaded_in_layer(-1) == 0)\n"
      "    assert(ctx:offloaded_in_layer(1.5) == 0)\n"
      "    -- interned: the same Lua string object every call\n"
      "    seen[t:path()] = (seen[t:path()] or 0) + 1\n"
      "    return ferry.OFFLOAD, ferry.PREFETCH, 7, false\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  CHECK(strcmp(ferry_policy_name(p), "fields") == 0);
  ferry_policy_knobs k;
  ferry_policy_get_knobs(p, &k);
  CHECK(k.has_max_fwd_stash && k.max_fwd_stash == 6);
  CHECK(k.has_prefetch_distance && k.prefetch_distance == 3);
  CHECK(k.has_min_offload_bytes && k.min_offload_bytes == 2048);

  ferry_tensor_desc d = desc_of("model.layers.3.mlp.up_proj", "Linear", FERRY_KIND_ACTIVATION,
                                1ull << 40);
  d.ndim = 3;
  d.shape[0] = 2, d.shape[1] = 3, d.shape[2] = 5;
  d.flags = FERRY_FLAG_VIEW | FERRY_FLAG_CONTIGUOUS;
  d.phase = FERRY_PHASE_RECOMPUTE;
  uint32_t per_layer[3] = {1, 0, 9};
  ferry_context c = {.step = 41, .phase = FERRY_PHASE_BACKWARD, .host_ram_used_pct = 12.5,
                     .arena_in_use = 1000, .arena_cap = 1ull << 33, .stash_depth = 2,
                     .bytes_in_flight = 77, .packed_this_step = 10, .offloaded_this_step = 4,
                     .bytes_offloaded_this_step = 4096, .offloaded_per_layer = per_layer,
                     .layers_tracked = 3};
  for (int i = 0; i < 3; i++) {
    ferry_decision out;
    ferry_policy_decide(p, &d, &c, &out);
    if (ferry_policy_last_error(p)[0]) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
    CHECK_EQ(out.action, FERRY_OFFLOAD);
    CHECK_EQ(out.reload, FERRY_RELOAD_PREFETCH);
    CHECK_EQ(out.prefetch_distance, 7);
    CHECK_EQ(out.cacheable, 0);
  }
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 3);
  CHECK_EQ(s.errors, 0);
  ferry_policy_destroy(p);

  /* A shorter shape leaves no stale entries; no ctx reads as zeros. */
  p = load_file("short.lua",
      "return { api = 1, decide = function(t, ctx)\n"
      "  if t.ndim == 3 then return ferry.KEEP end\n"
      "  assert(t.ndim == 1 and t.shape[0] == 4 and t.shape[1] == nil and t.shape[2] == nil)\n"
      "  assert(ctx.step == 0 and ctx.arena_cap == 0 and ctx:offloaded_in_layer(0) == 0)\n"
      "  assert(t:path() == '' and t:class() == '')\n"
      "  return ferry.KEEP end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  CHECK(strcmp(ferry_policy_name(p), "short") == 0); /* from the file name */
  ferry_decision out;
  ferry_policy_decide(p, &d, &c, &out);
  ferry_tensor_desc d1 = desc_of(NULL, NULL, FERRY_KIND_ACTIVATION, 64);
  d1.ndim = 1;
  ferry_policy_decide(p, &d1, NULL, &out);
  CHECK(ferry_policy_last_error(p)[0] == '\0');
  CHECK_EQ(out.action, FERRY_KEEP);
  CHECK_EQ(out.prefetch_distance, -1); /* nil distance: the engine's default */
  ferry_policy_destroy(p);
  return 0;
}

/* Each way out of the sandbox, tried at line 2 of a policy, is refused with
 * its exact message. */
/* t and ctx are rewritten only where a field changed since the last call:
 * decisions in turn on tensors that differ in one field at a time, each
 * field coming back to an earlier value, see every field as it is. The
 * policy reads what to expect from the class and the path. */
TEST(policy_fields_follow_every_tensor) {
  char path[256];
  ferry_policy *p = load_file("follow.lua",
      "return { api = 1, decide = function(t, ctx)\n"
      "  local want = {}\n"
      "  for k, v in t:class():gmatch('(%a+)=(%-?%d+)') do want[k] = tonumber(v) end\n"
      "  assert(t.bytes == want.b and t.kind == want.k and t.dtype == want.d, t:class())\n"
      "  assert(t.ndim == want.n and t.flags == want.f and t.layer == want.l, t:class())\n"
      "  assert(t.layer_count == want.c and t.phase == want.p and t.step == want.s, t:class())\n"
      "  assert(ctx.step == want.s and ctx.packed_this_step == want.q, t:class())\n"
      "  assert(ctx.arena_in_use == want.a and ctx.phase == want.h, t:class())\n"
      "  assert(t:path() == 'm' .. want.b, t:path())\n"
      "  return ferry.OFFLOAD, ferry.ON_USE, nil, false end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  /* each row: bytes kind dtype ndim flags layer layer_count phase step packed arena ctx-phase */
  static const int64_t rows[][12] = {
      {4096, 0, 2, 2, 2, 3, 8, 0, 1, 0, 0, 0},   {4096, 1, 2, 2, 2, 3, 8, 0, 1, 1, 0, 0},
      {8192, 1, 2, 2, 2, 3, 8, 0, 1, 2, 0, 0},   {4096, 0, 2, 2, 2, 3, 8, 0, 1, 3, 0, 0},
      {4096, 0, 5, 1, 0, -1, 0, 1, 2, 0, 7, 1},  {4096, 0, 2, 2, 2, 3, 8, 0, 2, 1, 7, 1},
      {4096, 0, 2, 3, 2, 4, 8, 0, 2, 2, 9, 2},   {8192, 0, 2, 2, 2, 3, 8, 0, 1, 3, 0, 0},
  };
  char cls[8][160], paths[8][32];
  for (int round = 0; round < 2; round++)
    for (int i = 0; i < 8; i++) {
      const int64_t *r = rows[i];
      snprintf(cls[i], sizeof cls[i], "b=%lld k=%lld d=%lld n=%lld f=%lld l=%lld c=%lld p=%lld "
               "s=%lld q=%lld a=%lld h=%lld", (long long)r[0], (long long)r[1], (long long)r[2],
               (long long)r[3], (long long)r[4], (long long)r[5], (long long)r[6],
               (long long)r[7], (long long)r[8], (long long)r[9], (long long)r[10],
               (long long)r[11]);
      snprintf(paths[i], sizeof paths[i], "m%lld", (long long)r[0]);
      ferry_tensor_desc d = desc_of(paths[i], cls[i], (int)r[1], (uint64_t)r[0]);
      d.dtype = (int32_t)r[2];
      d.ndim = (int32_t)r[3];
      d.flags = (uint32_t)r[4];
      d.layer = (int32_t)r[5];
      d.layer_count = (int32_t)r[6];
      d.phase = (int32_t)r[7];
      ferry_context c = {.step = (uint64_t)r[8], .packed_this_step = (uint64_t)r[9],
                         .arena_in_use = (uint64_t)r[10], .phase = (int32_t)r[11]};
      ferry_decision out;
      ferry_policy_decide(p, &d, &c, &out);
      if (ferry_policy_last_error(p)[0]) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
      CHECK_EQ(out.action, FERRY_OFFLOAD);
    }
  ferry_policy_destroy(p);
  unlink(path);
  return 0;
}

TEST(policy_sandbox_refuses_escapes) {
  static const struct {
    const char *code, *msg;
  } cases[] = {
      {"io.open('/etc/passwd')", "unknown global 'io'"},
      {"os.execute('true')", "'os.execute' is not available to policies (only os.clock and os.time are)"},
      {"os.getenv('HOME')", "'os.getenv' is not available to policies (only os.clock and os.time are)"},
      {"require 'ffi'", "module 'ffi' is only available to trusted policies"},
      {"require 'io'", NULL}, /* message names the library dir, checked below */
      {"require '../../etc/passwd'", "module name '../../etc/passwd' is not valid (use names like ferry.rules)"},
      {"loadstring('return 1')", "unknown global 'loadstring'"},
      {"load('return 1')", "unknown global 'load'"},
      {"dofile('/etc/passwd')", "unknown global 'dofile'"},
      {"loadfile('/etc/passwd')", "unknown global 'loadfile'"},
      {"string.dump(string.len)", "'string.dump' is not available to policies"},
      {"local f = ('x').dump", "'string.dump' is not available to policies"},
      {"local f = getmetatable('').__index.dump", "attempt to index field '__index' (a nil value)"},
      {"debug.getinfo(1)", "unknown global 'debug'"},
      {"getfenv(1)", "unknown global 'getfenv'"},
      {"setfenv(1, {})", "unknown global 'setfenv'"},
      {"rawset(_G, 'x', 1)", "unknown global 'rawset'"},
      {"_G.x = 1", "unknown global '_G'"},
      {"x = 1", "unknown global 'x'"},
      {"local y = undefined_name", "unknown global 'undefined_name'"},
      {"collectgarbage()", "unknown global 'collectgarbage'"},
      {"jit.on()", "unknown global 'jit'"},
      {"newproxy(true)", "unknown global 'newproxy'"},
      {"coroutine.wrap(print)", "unknown global 'coroutine'"},
      {"module('m')", "unknown global 'module'"},
      {"print('hi')", "unknown global 'print'"},
      {"package.loaded.os.exit()", "unknown global 'package'"},
  };
  setenv("FERRY_POLICY_LIBDIR", temp_dir(), 1);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[512], msg[512];
    snprintf(text, sizeof text,
             "-- escape %zu\n%s\nreturn { api = 1, decide = function() return 0 end }\n", i,
             cases[i].code);
    if (cases[i].msg)
      snprintf(msg, sizeof msg, "%s", cases[i].msg);
    else
      snprintf(msg, sizeof msg,
               "module 'io' not found (policies may only require ferry's modules, from %s)",
               temp_dir());
    if (expect_load_error("escape.lua", text, 0, 2, msg)) {
      fprintf(stderr, "escape case %zu: %s\n", i, cases[i].code);
      unsetenv("FERRY_POLICY_LIBDIR");
      return 1;
    }
  }
  unsetenv("FERRY_POLICY_LIBDIR");

  /* The string metatable is hidden; what a policy gets is harmless. */
  char path[256];
  ferry_policy *p = load_file("meta.lua",
      "assert(getmetatable('') == 'string')\n"
      "assert(('abc'):upper() == 'ABC' and string.format('%d', 3) == '3')\n"
      "assert(type(os.clock()) == 'number' and type(os.time()) == 'number')\n"
      "assert(math.floor(2.5) == 2 and table.concat({'a', 'b'}) == 'ab')\n"
      "return { api = 1, decide = function(t, ctx)\n"
      "  local ok, e = pcall(function() t.bytes = 1 end)\n"
      "  assert(not ok and e:find('cannot assign t.bytes: t is read-only', 1, true), e)\n"
      "  ok, e = pcall(function() t.mine = 1 end)\n"
      "  assert(not ok and e:find('cannot assign t.mine: t is read-only', 1, true), e)\n"
      "  ok, e = pcall(function() ctx.step = 1 end)\n"
      "  assert(not ok and e:find('cannot assign ctx.step: ctx is read-only', 1, true), e)\n"
      "  assert(rawget(t, 'bytes') == nil and next(t) == nil and t.bytes == 4096)\n"
      "  ok, e = pcall(function() return t[100000] end)\n"
      "  assert(not ok and e:find(\"t has no field '100000'\", 1, true), e)\n"
      "  ok, e = pcall(function() return t + 1 end)\n"
      "  assert(not ok and e:find('attempt to perform arithmetic'), e)\n"
      "  ok, e = pcall(function() return ctx.offloaded_per_layer end)\n"
      "  assert(not ok and e:find(\"ctx has no field 'offloaded_per_layer'\", 1, true), e)\n"
      "  assert(getmetatable(t) == 'ferry.t' and getmetatable(ctx) == 'ferry.ctx')\n"
      "  local a, b, c2 = pcall(function(x, y) return x + y, 'z' end, 1, 2)\n"
      "  assert(a == true and b == 3 and c2 == 'z')\n"
      "  a, b = xpcall(function() error('in') end, function(m) return 'h:' .. m end)\n"
      "  assert(a == false and b:find('^h:.*meta.lua:%d+: in$'), b)\n"
      "  a, b, c2 = xpcall(function(x) return x * 2 end, type, 21)\n"
      "  assert(a == true and b == 42 and c2 == nil)\n"
      "  a = xpcall(function() error('in') end, function() error('again') end)\n"
      "  assert(a == false)\n"
      "  return ferry.OFFLOAD end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc d = desc_of("a", "B", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &d, NULL, &out);
  if (ferry_policy_last_error(p)[0]) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);

  return 0;
}

/* Writer for lua_dump into a FILE. */
static int dump_to_file(lua_State *L, const void *data, size_t n, void *ud) {
  (void)L;
  return fwrite(data, 1, n, ud) == n ? 0 : 1;
}

TEST(policy_refuses_bytecode) {
  char path[256];
  snprintf(path, sizeof path, "%s/bytecode.lua", temp_dir());
  lua_State *L = luaL_newstate();
  CHECK(luaL_loadstring(L, "return { api = 1, decide = function() return 1 end }") == 0);
  FILE *f = fopen(path, "wb");
  CHECK(f != NULL);
  CHECK(lua_dump(L, dump_to_file, f) == 0);
  fclose(f);
  lua_close(L);
  ferry_policy *p = NULL;
  char err[512];
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK(p == NULL);
  char want[512];
  snprintf(want, sizeof want, "%s: attempt to load chunk with wrong mode", path);
  CHECK(strcmp(err, want) == 0);
  return 0;
}

/* Runtime faults in decide: kept, counted, reported with file:line. */
TEST(policy_runtime_errors_carry_file_line) {
  char path[256];
  ferry_policy *p = load_file("errors.lua",
      "return { api = 1, decide = function(t)\n" /* line 1 */
      "  local p = t:path()\n"
      "  if p == 'boom' then error('boom') end\n" /* 3 */
      "  if p == 'level0' then error('no position', 0) end\n" /* 4 */
      "  if p == 'table' then error({}) end\n" /* 5 */
      "  if p == 'nil' then return nil + 1 end\n" /* 6 */
      "  if p == 'global' then return undefined_thing end\n" /* 7 */
      "  if p == 'setglobal' then leaked = 1 end\n" /* 8 */
      "  if p == 'assign' then t.bytes = 0 end\n" /* 9 */
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  static const struct {
    const char *site;
    int line;
    const char *msg;
  } cases[] = {
      {"boom", 3, "boom"},
      {"level0", 4, "no position"},
      {"table", 5, "error object is a table value"},
      {"nil", 6, "attempt to perform arithmetic on a nil value"},
      {"global", 7, "unknown global 'undefined_thing'"},
      {"setglobal", 8, "unknown global 'leaked'"},
      {"assign", 9, "cannot assign t.bytes: t is read-only"},
  };
  uint64_t n = sizeof cases / sizeof cases[0];
  for (uint64_t i = 0; i < n; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out = {FERRY_OFFLOAD, 1, 5, 1};
    ferry_policy_decide(p, &d, NULL, &out);
    CHECK_EQ(out.action, FERRY_KEEP);
    CHECK_EQ(out.cacheable, 0);
    if (expect_fault(p, path, cases[i].line, cases[i].msg)) return 1;
  }
  ferry_tensor_desc ok = desc_of("fine", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &ok, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, n);
  CHECK_EQ(s.calls, n + 1);
  CHECK_EQ(s.disabled, 0);
  ferry_policy_destroy(p);

  /* A policy given as source text is named "policy" in messages. */
  char err[512];
  CHECK_RC(ferry_policy_create(NULL, "\n\nlocal x = = 1\n", 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK(strcmp(err, "policy:3: unexpected symbol near '='") == 0);
  return 0;
}

/* Load-time errors: syntax, runtime, the shape of the returned table. */
TEST(policy_load_errors) {
  if (expect_load_error("syntax.lua", "return {\n  api = 1,\n  decide = function( end\n}\n", 0, 3,
                        "<name> or '...' expected near 'end'"))
    return 1;
  if (expect_load_error("runtime.lua", "local x = nil\nlocal y = x.field\n", 0, 2,
                        "attempt to index local 'x' (a nil value)"))
    return 1;
  if (expect_load_error("notable.lua", "local a = 1\nreturn 42\n", 0, 2,
                        "a policy must return a table { api = 1, decide = function(t, ctx) ... "
                        "end }, got number"))
    return 1;
  if (expect_load_error("noapi.lua", "local d = function() return 0 end\nreturn { decide = d }\n", 0,
                        2, "the policy table has no 'api' field (this ferry provides API version 1: "
                           "return { api = 1, ... })"))
    return 1;
  if (expect_load_error("nodecide.lua", "-- no decide\nreturn { api = 1 }\n", 0, 2,
                        "the policy table has no decide function (decide = function(t, ctx) ... end)"))
    return 1;
  if (expect_load_error("baddecide.lua", "return {\n  api = 1,\n  decide = 7,\n}\n", 0, 3,
                        "decide must be a function, got number"))
    return 1;
  if (expect_load_error("badname.lua", "return { api = 1,\n name = 5, decide = function() end }\n",
                        0, 2, "name must be a non-empty string shorter than 128 bytes, got 5"))
    return 1;
  char err[256];
  ferry_policy *p = NULL;
  CHECK_RC(ferry_policy_create("/nonexistent/dir/p.lua", NULL, 0, &p, err, sizeof err),
           FERRY_EPOLICY);
  CHECK(strcmp(err, "/nonexistent/dir/p.lua: cannot open the policy file: No such file or "
                    "directory") == 0);
  CHECK_RC(ferry_policy_create(NULL, NULL, 0, &p, err, sizeof err), FERRY_EINVAL);
  return 0;
}

TEST(policy_api_version_mismatch) {
  if (expect_load_error("api2.lua", "-- wants a newer ferry\nreturn {\n  api = 2,\n"
                        "  decide = function() return 0 end }\n", 0, 3,
                        "policy requires API version 2, this ferry provides 1"))
    return 1;
  if (expect_load_error("apistr.lua", "return { api = '1',\n decide = function() end }\n", 0, 1,
                        "api must be an integer, got string \"1\""))
    return 1;
  return 0;
}

TEST(policy_bad_knobs) {
  static const struct {
    const char *knobs;
    const char *msg;
  } cases[] = {
      {"max_stash = 4", "unknown knob 'max_stash' (known: max_fwd_stash, prefetch_distance, "
                        "min_offload_bytes, max_fwd_stash_bytes, release_when_copied, "
                        "max_tail_prefetch, sync_copies, one_copy_stream)"},
      {"sync_copies = 3", "knob 'sync_copies' must be within [0, 2], got 3"},
      {"release_when_copied = 2", "knob 'release_when_copied' must be within [0, 1], got 2"},
      {"max_fwd_stash = -1", "knob 'max_fwd_stash' must be within [0, 1048576], got -1"},
      {"max_fwd_stash = 2.5", "knob 'max_fwd_stash' must be an integer, got 2.5"},
      {"prefetch_distance = '2'", "knob 'prefetch_distance' must be an integer, got string \"2\""},
      {"prefetch_distance = 5000", "knob 'prefetch_distance' must be within [0, 4096], got 5000"},
      {"min_offload_bytes = 2^60", "knob 'min_offload_bytes' must be within [0, 1125899906842624], "
                                   "got 1.152921504606847e+18"},
      {"min_offload_bytes = 0/0", "knob 'min_offload_bytes' must be an integer, got nan"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[512];
    snprintf(text, sizeof text,
             "return {\n  api = 1,\n  knobs = {\n    %s,\n  },\n  decide = function() end }\n",
             cases[i].knobs);
    if (expect_load_error("knobs.lua", text, 0, 4, cases[i].msg)) return 1;
  }
  if (expect_load_error("knobtype2.lua", "return {\n api = 1,\n knobs = 3,\n decide = type }\n", 0,
                        3, "knobs must be a table, got number"))
    return 1;
  /* no knobs: nothing set */
  char path[256];
  ferry_policy *p = load_file("noknobs.lua", "return { api = 1, decide = function() end }\n", 0,
                              path, sizeof path);
  CHECK(p != NULL);
  ferry_policy_knobs k;
  ferry_policy_get_knobs(p, &k);
  CHECK(!k.has_max_fwd_stash && !k.has_prefetch_distance && !k.has_min_offload_bytes);
  ferry_policy_destroy(p);
  return 0;
}

/* Nonsense answers become KEEP, counted, with decide's file:line. */
TEST(policy_nonsense_answers_kept) {
  static const struct {
    const char *ret, *msg;
  } cases[] = {
      {"nil", "action: nil (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"'offload'", "action: string \"offload\" (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"7", "action: 7 (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"true", "action: true (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"{}", "action: table (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"0/0", "action: nan (expected ferry.KEEP or ferry.OFFLOAD)"},
      {"1, 2", "reload: 2 (expected ferry.ON_USE or ferry.PREFETCH)"},
      {"1, 1, -1", "prefetch distance: -1 (expected an integer in [0, 4096] or nil)"},
      {"1, 1, 0.5", "prefetch distance: 0.5 (expected an integer in [0, 4096] or nil)"},
      {"1, 1, 0/0", "prefetch distance: nan (expected an integer in [0, 4096] or nil)"},
      {"1, 1, 1e9", "prefetch distance: 1000000000 (expected an integer in [0, 4096] or nil)"},
      {"1, 1, 2, 'yes'", "cache flag: string \"yes\" (expected true, false or nil)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[512], path[256], msg[512];
    snprintf(text, sizeof text, "-- nonsense\n\nreturn { api = 1,\n decide = function(t, ctx)\n"
                                "  return %s\nend }\n", cases[i].ret);
    ferry_policy *p = load_file("nonsense.lua", text, 0, path, sizeof path);
    CHECK(p != NULL);
    ferry_tensor_desc d = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out;
    ferry_policy_decide(p, &d, NULL, &out);
    CHECK_EQ(out.action, FERRY_KEEP);
    CHECK_EQ(out.cacheable, 0);
    ferry_policy_stats s;
    ferry_policy_get_stats(p, &s);
    CHECK_EQ(s.errors, 1);
    snprintf(msg, sizeof msg, "decide returned a nonsense %s; the tensor was kept", cases[i].msg);
    if (expect_fault(p, path, 4, msg)) return 1;
    ferry_policy_destroy(p);
  }
  return 0;
}

/* Runaway loops are interrupted whatever their form, including a loop that
 * ran hot many times (would be JIT-compiled) before a later tensor made it
 * endless. */
TEST(policy_runaway_loops_interrupted) {
  char path[256];
  /* the instruction budget is under test: the wall clock must not win,
   * even under valgrind */
  setenv("FERRY_POLICY_DECISION_MS", "600000", 1);
  setenv("FERRY_POLICY_LOAD_MS", "600000", 1);
  ferry_policy *p = load_file("loops.lua",
      "local function spin(n) local s = 0 for i = 1, n do s = s + i end return s end\n" /* 1 */
      "local function tail(n) return tail(n + 1) end\n" /* 2 */
      "local function deep(n) return 1 + deep(n + 1) end\n" /* 3 */
      "local function swallow()\n" /* 4 */
      "  while true do pcall(function() while true do end end) end\n" /* 5 */
      "end\n"
      "local function handler() while true do end end\n" /* 7 */
      "return { api = 1, decide = function(t)\n" /* 8 */
      "  local p = t:path()\n"
      "  if p == 'while' then while true do end end\n" /* 10 */
      "  if p == 'repeat' then repeat until false end\n" /* 11 */
      "  if p == 'hot' then spin(t.bytes) end\n" /* 12 */
      "  if p == 'tail' then tail(0) end\n" /* 13 */
      "  if p == 'deep' then deep(0) end\n" /* 14 */
      "  if p == 'swallow' then swallow() end\n" /* 15 */
      "  if p == 'xpcall' then xpcall(function() while true do end end, handler) end\n" /* 16 */
      "  if p == 'gsub' then local function f(s) return (s:gsub('.', f)) end f('ab') end\n" /* 17 */
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  const char *budget = "interrupted after 10000000 VM instructions (runaway loop?)";
  /* 2000 calls of a 300-iteration loop: hot by any JIT threshold */
  ferry_tensor_desc hot = desc_of("hot", "X", FERRY_KIND_ACTIVATION, 300);
  for (int i = 0; i < 2000; i++) {
    ferry_decision out;
    ferry_policy_decide(p, &hot, NULL, &out);
    CHECK_EQ(out.action, FERRY_OFFLOAD);
  }
  static const struct {
    const char *site;
    uint64_t bytes;
    int line;
    int budget;
    const char *msg;
  } cases[] = {
      {"while", 1, 10, 1, NULL},
      {"repeat", 1, 11, 1, NULL},
      {"hot", 1ull << 50, 1, 1, NULL},
      {"tail", 1, 2, 1, NULL},
      {"deep", 1, 3, 0, "stack overflow"},
      {"swallow", 1, 5, 1, NULL},
      {"xpcall", 1, 16, 1, NULL},
      {"gsub", 1, 17, 0, "string.gsub nested too deeply (limit 64)"},
  };
  uint64_t n = sizeof cases / sizeof cases[0];
  for (uint64_t i = 0; i < n; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, cases[i].bytes);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    double t0 = now_ms();
    ferry_policy_decide(p, &d, NULL, &out);
    double ms = now_ms() - t0;
    CHECK_EQ(out.action, FERRY_KEEP);
    if (expect_fault(p, path, cases[i].line, cases[i].budget ? budget : cases[i].msg)) {
      fprintf(stderr, "runaway case '%s'\n", cases[i].site);
      return 1;
    }
    printf("  %-8s stopped after %.1f ms\n", cases[i].site, ms);
  }
  /* Still usable afterwards, the hot loop included. */
  ferry_decision out;
  ferry_policy_decide(p, &hot, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, n);
  ferry_policy_destroy(p);

  /* At load time too, with the load budget. */
  int rc = expect_load_error("loadloop.lua", "local x = 0\nwhile true do x = x + 1 end\n", 0, 2,
                             "interrupted after 100000000 VM instructions (runaway loop?)");
  unsetenv("FERRY_POLICY_DECISION_MS");
  unsetenv("FERRY_POLICY_LOAD_MS");
  return rc;
}

/* Time spent where the instruction count does not grow fast (a loop on
 * os.clock, ~0.5 s for the instruction budget) is stopped by the wall-clock
 * budget; the C functions the hook cannot interrupt (the pattern matcher,
 * table.sort) refuse work they could not finish quickly, with the caller's
 * file:line; ordinary patterns are untouched. */
TEST(policy_wall_clock_and_c_functions_bounded) {
  char path[256];
  setenv("FERRY_POLICY_DECISION_MS", "30", 1);
  ferry_policy *p = load_file("bounded.lua",
      "local big = string.rep('a', 3000)\n" /* 1 */
      "local bomb = string.rep('a*', 12) .. 'b' local x70k = {} for i = 1, 70000 do x70k[i] = -i end local ab2m = string.rep('ab', 1e6)\n" /* 2: built at load, slow under valgrind */
      "return { api = 1, decide = function(t)\n" /* 3 */
      "  local p = t:path()\n" /* 4 */
      "  if p == 'clock' then local t0 = os.clock() while os.clock() - t0 < 60 do end end\n" /* 5 */
      "  if p == 'find' then string.find(big, bomb) end\n" /* 6 */
      "  if p == 'method' then big:match(bomb) end\n" /* 7 */
      "  if p == 'gmatch' then for _ in big:gmatch('(a*)(a*)(a*)b') do end end\n" /* 8 */
      "  if p == 'gsub' then big:gsub('a-a-a-a-b', '') end\n" /* 9 */
      "  if p == 'plain' then string.find(ab2m, string.rep('ab', 100), 1, true) end\n" /* 10 */
      "  if p == 'sort' then table.sort(x70k) end\n" /* 11 */
      "  assert(('model.layers.12.mlp'):match('^model%.layers%.(%d+)%.') == '12')\n"
      "  assert(select(2, ('a.b.c'):gsub('%.', '/')) == 2)\n"
      "  assert(('x(y)'):find('(', 1, true) == 2 and ('a.b'):find('.', 2, true) == 2)\n"
      "  local n = 0 for w in ('decoder.layers.3.self_attn'):gmatch('[^.]+') do n = n + 1 end\n"
      "  assert(n == 4)\n"
      "  assert(('%s'):rep(3, '-') == '%s-%s-%s')\n"
      "  local s = {3, 1, 2} table.sort(s) assert(s[1] == 1 and s[3] == 3)\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  unsetenv("FERRY_POLICY_DECISION_MS");
  CHECK(p != NULL);
  static const struct {
    const char *site;
    int line;
    const char *msg;
  } cases[] = {
      {"clock", 5, "interrupted after 30 ms, the wall-clock budget of a decision "
                   "(FERRY_POLICY_DECISION_MS)"},
      {"find", 6, "string.find: pattern 'a*a*a*a*a*a*a*a*a*a*a*a*b' is too costly for a "
                  "3000-byte subject (up to 6.8e+37 matcher steps, the limit is 8e+06): "
                  "anchor it with '^', match a shorter string or use a shorter pattern with "
                  "fewer repetitions (*, +, -, ?)"},
      {"method", 7, "string.match: pattern 'a*a*a*a*a*a*a*a*a*a*a*a*b' is too costly for a "
                    "3000-byte subject (up to 6.8e+37 matcher steps, the limit is 8e+06): "
                    "anchor it with '^', match a shorter string or use a shorter pattern with "
                    "fewer repetitions (*, +, -, ?)"},
      {"gmatch", 8, "string.gmatch: pattern '(a*)(a*)(a*)b' is too costly for a 3000-byte "
                    "subject (up to 1.6e+14 matcher steps, the limit is 8e+06): anchor it "
                    "with '^', match a shorter string or use a shorter pattern with fewer "
                    "repetitions (*, +, -, ?)"},
      {"gsub", 9, "string.gsub: pattern 'a-a-a-a-b' is too costly for a 3000-byte subject "
                  "(up to 1.5e+17 matcher steps, the limit is 8e+06): anchor it with '^', "
                  "match a shorter string or use a shorter pattern with fewer repetitions "
                  "(*, +, -, ?)"},
      {"plain", 10, "string.find: pattern 'abababababababababababababababababababababababababab"
                    "abababab...' is too costly for a 2000000-byte subject (up to 4e+08 "
                    "byte comparisons, the limit is 4e+07): search a shorter string or for a "
                    "shorter one"},
      {"sort", 11, "table.sort: 70000 items, more than the limit of 65536"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    double t0 = now_ms();
    ferry_policy_decide(p, &d, NULL, &out);
    printf("  %-7s stopped after %.1f ms\n", cases[i].site, now_ms() - t0);
    CHECK_EQ(out.action, FERRY_KEEP);
    if (expect_fault(p, path, cases[i].line, cases[i].msg)) {
      fprintf(stderr, "bounded case '%s'\n", cases[i].site);
      return 1;
    }
  }
  ferry_tensor_desc ok = desc_of("ordinary", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &ok, NULL, &out);
  if (out.action != FERRY_OFFLOAD) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);

  /* a load has its own budget */
  setenv("FERRY_POLICY_LOAD_MS", "40", 1);
  int rc = expect_load_error("slowload.lua",
                             "local t0 = os.clock()\nwhile os.clock() - t0 < 60 do end\n", 0, 2,
                             "interrupted after 40 ms, the wall-clock budget of a policy load "
                             "(FERRY_POLICY_LOAD_MS)");
  unsetenv("FERRY_POLICY_LOAD_MS");
  return rc;
}

/* The policy host's environment variables go through the one strict
 * parser: a bad value fails the load with the variable, the value and what
 * was expected, instead of being ignored. */
TEST(policy_env_limits_are_strict) {
  static const struct {
    const char *var, *value, *msg;
  } cases[] = {
      {"FERRY_POLICY_DECISION_MS", "abc", "FERRY_POLICY_DECISION_MS abc: not a number; expected a whole number"},
      {"FERRY_POLICY_DECISION_MS", "0", "FERRY_POLICY_DECISION_MS 0: must be between 1 and 3600000"},
      {"FERRY_POLICY_DECISION_MS", "2.5", "FERRY_POLICY_DECISION_MS 2.5: must be a whole number"},
      {"FERRY_POLICY_LOAD_MS", "inf", "FERRY_POLICY_LOAD_MS inf: not a number; expected a whole number"},
      {"FERRY_POLICY_MEM_MB", "3", "FERRY_POLICY_MEM_MB 3: must be between 4 and 1048576"},
      {"FERRY_POLICY_MEM_MB", "64x", "FERRY_POLICY_MEM_MB 64x: unexpected \"x\"; expected a whole number"},
      {"FERRY_POLICY_ERROR_BUDGET", "-1", "FERRY_POLICY_ERROR_BUDGET -1: must be between 1 and 1073741824"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    setenv(cases[i].var, cases[i].value, 1);
    ferry_policy *p = NULL;
    char err[512] = "";
    int rc = ferry_policy_create(NULL, "return { api = 1, decide = function() return 0 end }", 0,
                                 &p, err, sizeof err);
    unsetenv(cases[i].var);
    if (rc != FERRY_EINVAL || p || strcmp(err, cases[i].msg) != 0) {
      fprintf(stderr, "%s=%s: rc %d\n  got  \"%s\"\n  want \"%s\"\n", cases[i].var,
              cases[i].value, rc, err, cases[i].msg);
      ferry_policy_destroy(p);
      return 1;
    }
  }
  return 0;
}

/* The sandbox's globals are an allow-list: any name added to what policy
 * code can reach must be added here (and to docs/security.md) on purpose. */
TEST(policy_sandbox_globals_are_the_allow_list) {
  char path[256];
  ferry_policy *p = load_file("globals.lua", "return { api = 1, decide = function() return 0 end }\n",
                              0, path, sizeof path);
  CHECK(p != NULL);
  char names[8192];
  size_t len = ferry_policy_globals(p, names, sizeof names);
  CHECK(len < sizeof names);
  static const char want[] =
      "assert,error,ferry,getmetatable,ipairs,"
      "math,math.abs,math.acos,math.asin,math.atan,math.atan2,math.ceil,math.cos,math.cosh,"
      "math.deg,math.exp,math.floor,math.fmod,math.frexp,math.huge,math.ldexp,math.log,"
      "math.log10,math.max,math.min,math.modf,math.pi,math.pow,math.rad,math.random,"
      "math.randomseed,math.sin,math.sinh,math.sqrt,math.tan,math.tanh,"
      "next,os,os.clock,os.time,pairs,pcall,rawequal,rawget,require,select,setmetatable,"
      "string,string.byte,string.char,string.find,string.format,string.gmatch,string.gsub,"
      "string.len,string.lower,string.match,string.rep,string.reverse,string.sub,string.upper,"
      "table,table.concat,table.foreach,table.foreachi,table.getn,table.insert,table.maxn,"
      "table.move,table.remove,table.sort,tonumber,tostring,type,unpack,xpcall";
  if (strcmp(names, want) != 0) fprintf(stderr, "  got  %s\n  want %s\n", names, want);
  CHECK(strcmp(names, want) == 0);
  ferry_policy_destroy(p);
  return 0;
}

/* An allocation bomb is stopped by the memory cap, counted, and the state
 * recovers its memory. */
TEST(policy_memory_bomb_stopped) {
  setenv("FERRY_POLICY_MEM_MB", "16", 1);
  setenv("FERRY_POLICY_DECISION_MS", "600000", 1); /* the memory cap is under test */
  char path[256];
  ferry_policy *p = load_file("bomb.lua",
      "local keep = {}\n"
      "return { api = 1, decide = function(t)\n"
      "  local p = t:path()\n"
      "  if p == 'table' then local x = {} for i = 1, 1e9 do x[i] = i end end\n" /* 4 */
      "  if p == 'strings' then for i = 1, 1e9 do keep[i] = ('x'):rep(64) .. i end end\n" /* 5 */
      "  if p == 'rep' then local s = ('x'):rep(2^30) end\n" /* 6 */
      "  if p == 'swallow' then pcall(function() local x = {} for i = 1, 1e9 do x[i] = {} end end) end\n" /* 7 */
      "  if p == 'clear' then keep = {} end\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  unsetenv("FERRY_POLICY_MEM_MB");
  unsetenv("FERRY_POLICY_DECISION_MS");
  CHECK(p != NULL);
  static const struct {
    const char *site;
    int line;
  } cases[] = {{"table", 4}, {"rep", 6}, {"swallow", 7}, {"strings", 5}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ferry_tensor_desc d = desc_of(cases[i].site, "X", FERRY_KIND_ACTIVATION, 4096);
    ferry_decision out = {FERRY_OFFLOAD, 0, 0, 1};
    ferry_policy_decide(p, &d, NULL, &out);
    CHECK_EQ(out.action, FERRY_KEEP);
    const char *e = ferry_policy_last_error(p);
    char want[300];
    snprintf(want, sizeof want, "%s:%d: policy memory limit of 16 MiB exceeded", path,
             cases[i].line);
    if (strncmp(e, want, strlen(want)) != 0) {
      fprintf(stderr, "bomb '%s':\n  got  \"%s\"\n  want \"%s...\"\n", cases[i].site, e, want);
      return 1;
    }
  }
  /* 'strings' left its garbage reachable: until the policy drops it, calls
   * that allocate may fail, but the host keeps answering. */
  ferry_tensor_desc clear = desc_of("clear", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &clear, NULL, &out);
  ferry_tensor_desc fine = desc_of("fine", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_policy_decide(p, &fine, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 4);
  ferry_policy_destroy(p);

  setenv("FERRY_POLICY_MEM_MB", "16", 1);
  int rc = expect_load_error("loadbomb.lua", "local t = {}\nfor i = 1, 1e9 do t[i] = i end\n", 0, 2,
                             "policy memory limit of 16 MiB exceeded (allocation of 16777224 bytes "
                             "refused)");
  unsetenv("FERRY_POLICY_MEM_MB");
  return rc;
}

/* After the error budget (100 faults) the policy is disabled: everything is
 * kept without calling Lua, and last_error says so. */
TEST(policy_error_budget_disables) {
  char path[256];
  ferry_policy *p = load_file("budget.lua",
      "return { api = 1, decide = function(t)\n"
      "  if t:path() == 'bad' then error('always wrong') end\n"
      "  return ferry.OFFLOAD\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc bad = desc_of("bad", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc good = desc_of("good", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  for (int i = 0; i < 99; i++) ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 99);
  CHECK_EQ(s.disabled, 0);
  ferry_policy_decide(p, &good, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 100);
  CHECK_EQ(s.disabled, 1);
  char want[512];
  snprintf(want, sizeof want,
           "%s:2: always wrong (policy disabled after 100 faults: every tensor is now kept)", path);
  CHECK(strcmp(ferry_policy_last_error(p), want) == 0);
  uint64_t calls = s.calls;
  ferry_policy_decide(p, &good, NULL, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, calls);
  ferry_policy_destroy(p);

  /* The budget can be lowered from the environment. */
  setenv("FERRY_POLICY_ERROR_BUDGET", "3", 1);
  p = load_file("budget.lua", "return { api = 1, decide = function() error('x') end }\n", 0, path,
                sizeof path);
  unsetenv("FERRY_POLICY_ERROR_BUDGET");
  CHECK(p != NULL);
  for (int i = 0; i < 5; i++) ferry_policy_decide(p, &bad, NULL, &out);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 3);
  CHECK_EQ(s.disabled, 1);
  ferry_policy_destroy(p);
  return 0;
}

/* cache=true answers are reused per site (path, class, shape, dtype, kind);
 * a hit gives exactly the uncached answer and does not call Lua. */
TEST(policy_site_cache) {
  char path[256];
  ferry_policy *p = load_file("cache.lua",
      "return { api = 1, decide = function(t)\n"
      "  if t:path() == 'nocache' then return ferry.OFFLOAD, ferry.ON_USE, nil, false end\n"
      "  if t:path():find('keep') then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "  return ferry.OFFLOAD, ferry.PREFETCH, t.shape[1] % 7, true\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc a = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision first, again;
  ferry_policy_decide(p, &a, NULL, &first);
  ferry_policy_decide(p, &a, NULL, &again);
  CHECK_EQ(first.action, FERRY_OFFLOAD);
  CHECK_EQ(first.reload, FERRY_RELOAD_PREFETCH);
  CHECK_EQ(first.prefetch_distance, 512 % 7);
  CHECK_EQ(first.cacheable, 1);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 1);
  CHECK_EQ(s.cache_hits, 1);

  /* Same content at another address: the same site. */
  char copy[32];
  strcpy(copy, "model.a");
  ferry_tensor_desc a2 = a;
  a2.module_path = copy;
  ferry_policy_decide(p, &a2, NULL, &again);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.cache_hits, 2);

  /* The same address with other content is another site, not a stale hit. */
  strcpy(copy, "model.keep");
  ferry_policy_decide(p, &a2, NULL, &again);
  CHECK_EQ(again.action, FERRY_KEEP);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 2);

  /* Any key field changing is another site. */
  ferry_tensor_desc v[4];
  for (int i = 0; i < 4; i++) v[i] = a;
  v[0].shape[1] = 9;
  v[1].dtype = FERRY_DTYPE_F32;
  v[2].kind = FERRY_KIND_OTHER;
  v[3].module_class = "Conv";
  for (int i = 0; i < 4; i++) ferry_policy_decide(p, &v[i], NULL, &again);
  CHECK_EQ(again.action, FERRY_OFFLOAD);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 6);
  CHECK_EQ(s.cache_hits, 2);
  /* ... while fields outside the key (layer, bytes) are not. */
  ferry_tensor_desc same = a;
  same.layer = 7;
  ferry_policy_decide(p, &same, NULL, &again);
  CHECK(memcmp(&first, &again, sizeof first) == 0);
  /* The phase is in the key: a recompute pack of the same op asks Lua
   * (a policy may keep it where it offloads the forward pack), then hits. */
  same.phase = FERRY_PHASE_RECOMPUTE;
  ferry_policy_decide(p, &same, NULL, &again);
  ferry_policy_decide(p, &same, NULL, &again);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 7);
  CHECK_EQ(s.cache_hits, 4);

  /* cache=false is never cached */
  ferry_tensor_desc nc = desc_of("nocache", "X", FERRY_KIND_ACTIVATION, 4096);
  ferry_policy_decide(p, &nc, NULL, &again);
  ferry_policy_decide(p, &nc, NULL, &again);
  CHECK_EQ(again.cacheable, 0);
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 9);
  CHECK_EQ(s.cache_hits, 4);
  ferry_policy_destroy(p);
  return 0;
}

TEST(policy_trusted_gets_ffi) {
  const char *text =
      "local ffi = require 'ffi'\n"
      "ffi.cdef 'int abs(int);'\n"
      "assert(ffi.C.abs(-3) == 3)\n"
      "return { api = 1, decide = function() return ferry.OFFLOAD end }\n";
  char path[256];
  ferry_policy *p = load_file("trusted.lua", text, 1, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc d = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &d, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);
  return expect_load_error("trusted.lua", text, 0, 1,
                           "module 'ffi' is only available to trusted policies");
}

/* require loads ferry's modules from the library dir, into the same
 * sandbox; errors inside a module carry the module's file:line. */
TEST(policy_require_library_modules) {
  char dir[256], mod[300], path[256];
  snprintf(dir, sizeof dir, "%s/ferry", temp_dir());
  mkdir(dir, 0700);
  snprintf(mod, sizeof mod, "ferry/helper.lua");
  write_file(path, sizeof path, mod,
             "local M = {}\nfunction M.big(t) return t.bytes >= 1024 end\n"
             "M.loads = (M.loads or 0) + 1\nreturn M\n");
  write_file(path, sizeof path, "ferry/evil.lua", "local M = {}\nio.write('x')\nreturn M\n");
  char evil[256];
  snprintf(evil, sizeof evil, "%s", path);
  write_file(path, sizeof path, "ferry/loop_a.lua", "local M = require 'ferry.loop_a'\nreturn M\n");
  setenv("FERRY_POLICY_LIBDIR", temp_dir(), 1);
  ferry_policy *p = load_file("usesmod.lua",
      "local H = require 'ferry.helper'\n"
      "assert(require 'ferry.helper' == H)\n"
      "return { api = 1, decide = function(t)\n"
      "  return H.big(t) and ferry.OFFLOAD or ferry.KEEP\n"
      "end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_tensor_desc big = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc small = desc_of("m", "M", FERRY_KIND_ACTIVATION, 16);
  ferry_decision out;
  ferry_policy_decide(p, &big, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &small, NULL, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_destroy(p);

  char err[1024], want[1024];
  write_file(path, sizeof path, "usesevil.lua",
             "local E = require 'ferry.evil'\nreturn { api = 1, decide = E }\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  snprintf(want, sizeof want, "%s:2: unknown global 'io'", evil);
  CHECK(strcmp(err, want) == 0);
  write_file(path, sizeof path, "usesloop.lua", "\nlocal L = require 'ferry.loop_a'\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  snprintf(want, sizeof want,
           "%s/ferry/loop_a.lua:1: module 'ferry.loop_a' requires itself (a require loop)",
           temp_dir());
  unsetenv("FERRY_POLICY_LIBDIR");
  if (strcmp(err, want) != 0) {
    fprintf(stderr, "  got  \"%s\"\n  want \"%s\"\n", err, want);
    return 1;
  }
  return 0;
}

/* Reloading: a policy that fails to load leaves the running one intact. */
TEST(policy_failed_reload_keeps_old) {
  char path[256], err[512];
  ferry_policy *p = load_file("reload.lua",
      "return { api = 1, decide = function() return ferry.OFFLOAD end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  write_file(path, sizeof path, "reload.lua", "return { api = 1, decide = function() return\n");
  ferry_policy *next = NULL;
  CHECK_RC(ferry_policy_create(path, NULL, 0, &next, err, sizeof err), FERRY_EPOLICY);
  CHECK(next == NULL);
  CHECK_STR_CONTAINS(err, "reload.lua:2:");
  ferry_tensor_desc d = desc_of("m", "M", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision out;
  ferry_policy_decide(p, &d, NULL, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);
  return 0;
}

/* The shipped default policy loads in the host and keeps what today's
 * offloaders keep (its rules are covered in detail by the busted specs). */
TEST(policy_shipped_default_loads) {
  char path[1024];
  const char *slash = strrchr(__FILE__, '/');
  CHECK(slash != NULL);
  snprintf(path, sizeof path, "%.*s/../policies/default.lua", (int)(slash - __FILE__), __FILE__);
  if (access(path, R_OK) != 0) {
    printf("  (no %s yet; skipped)\n", path);
    return 0;
  }
  char err[1024];
  ferry_policy *p = NULL;
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_OK);
  CHECK(strcmp(ferry_policy_name(p), "default") == 0);
  ferry_tensor_desc mlp = desc_of("model.layers.0.mlp.up_proj", "Linear", FERRY_KIND_ACTIVATION,
                                  1 << 20);
  ferry_tensor_desc head = desc_of("lm_head", "Linear", FERRY_KIND_ACTIVATION, 1 << 20);
  ferry_tensor_desc param = desc_of("model.layers.0.mlp.up_proj", "Linear",
                                    FERRY_KIND_PARAMETER, 1 << 20);
  ferry_tensor_desc tiny = desc_of("model.layers.0.mlp.up_proj", "Linear", FERRY_KIND_ACTIVATION,
                                   512);
  ferry_tensor_desc liger = desc_of("model.loss", "LigerFusedLinearCrossEntropy",
                                    FERRY_KIND_ACTIVATION, 1 << 20);
  ferry_context c = {.step = 1};
  ferry_decision out;
  ferry_policy_decide(p, &mlp, &c, &out);
  CHECK_EQ(out.action, FERRY_OFFLOAD);
  ferry_policy_decide(p, &head, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &param, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &tiny, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_decide(p, &liger, &c, &out);
  CHECK_EQ(out.action, FERRY_KEEP);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  if (s.errors) fprintf(stderr, "%s\n", ferry_policy_last_error(p));
  CHECK_EQ(s.errors, 0);
  ferry_policy_destroy(p);
  return 0;
}

/* `ferry check`: the CLI entry point, compiled into this runner. */
#include "../bindings/cli/cli_check.c"

TEST(policy_cli_check_exit_codes) {
  char good[256], bad[256], faulty[256];
  write_file(good, sizeof good, "check_good.lua",
             "return { api = 1, name = 'good', knobs = { max_fwd_stash = 2 },\n"
             "  decide = function(t) return t.bytes >= 1024 and ferry.OFFLOAD or ferry.KEEP,\n"
             "    ferry.ON_USE, nil, true end }\n");
  write_file(bad, sizeof bad, "check_bad.lua", "return { api = 1,\n  decide = function( }\n");
  write_file(faulty, sizeof faulty, "check_faulty.lua",
             "return { api = 1, decide = function(t)\n"
             "  if t:class() == 'SiLU' then error('no SiLU here') end\n"
             "  return ferry.KEEP end }\n");
  char *argv_good[] = {"check", "--quiet", "--layers", "2", good, NULL};
  CHECK_EQ(ferry_cli_check(5, argv_good), 0);
  char *argv_bad[] = {"check", "-q", bad, NULL};
  CHECK_EQ(ferry_cli_check(3, argv_bad), 1);
  char *argv_faulty[] = {"check", "-q", "-s", "1", faulty, NULL};
  CHECK_EQ(ferry_cli_check(5, argv_faulty), 1);
  char *argv_usage[] = {"check", NULL};
  CHECK_EQ(ferry_cli_check(1, argv_usage), 2);
  char *argv_badopt[] = {"check", "--layers", "0", good, NULL};
  CHECK_EQ(ferry_cli_check(4, argv_badopt), 2);
  return 0;
}

/* ---- reasons: ferry_policy_explain ---------------------------------------- */
/* why must name `rule`, at path:line (line 0: where must be ""). */
static int expect_reason(const ferry_policy_reason *why, const char *rule, const char *path,
                         int line) {
  char want[1024];
  if (line)
    snprintf(want, sizeof want, "%s:%d", path, line);
  else
    want[0] = '\0';
  if (strcmp(why->rule, rule) != 0 || strcmp(why->where, want) != 0) {
    fprintf(stderr, "  got  \"%s\" at \"%s\"\n  want \"%s\" at \"%s\"\n", why->rule, why->where,
            rule, want);
    return 1;
  }
  return 0;
}

/* A hand-written decide: the reason is "decide" at its first line, also
 * for an answer from the site cache; explain and decide give the same
 * answers and share the cache; a fault's reason is its position; a
 * policy's own explain is used by explain only, never by decide. */
TEST(policy_explain_hand_written) {
  char path[256];
  ferry_policy *p = load_file("why_decide.lua",
      "-- a hand-written decide\n"
      "return { api = 1,\n"
      "  decide = function(t)\n"
      "    if t.bytes < 1024 then return ferry.KEEP, ferry.ON_USE, nil, true end\n"
      "    if t:path() == 'bad' then error('no bad here') end\n"
      "    return ferry.OFFLOAD, ferry.PREFETCH, 3\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_context c = {.step = 1};
  ferry_tensor_desc big = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc small = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 512);
  ferry_tensor_desc bad = desc_of("bad", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision d, e;
  ferry_policy_reason why;
  ferry_policy_explain(p, &big, &c, &e, &why);
  ferry_policy_decide(p, &big, &c, &d);
  CHECK(memcmp(&d, &e, sizeof d) == 0);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK_EQ(e.prefetch_distance, 3);
  CHECK_EQ(why.from_cache, 0);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK_EQ(why.from_cache, 0);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &small, &c, &e, &why); /* from the cache, same reason */
  CHECK_EQ(why.from_cache, 1);
  CHECK(!expect_reason(&why, "decide", path, 3));
  ferry_policy_explain(p, &bad, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fault", path, 5));
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.calls, 4);
  CHECK_EQ(s.cache_hits, 1);
  CHECK_EQ(s.errors, 1);
  ferry_policy_explain(p, &big, &c, &e, NULL); /* why is optional */
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  ferry_policy_destroy(p);

  /* A policy's own explain: its rule, at its where or, without one, at
   * the policy's return; a nonsense answer is a fault at explain's line. */
  p = load_file("why_own.lua",
      "local n = 0\n"
      "return { api = 1,\n"
      "  decide = function() return ferry.KEEP end,\n"
      "  explain = function(t)\n"
      "    n = n + 1\n"
      "    if n == 1 then return ferry.OFFLOAD, 'mine' end\n"
      "    if n == 2 then return ferry.KEEP, 'theirs', 'elsewhere.lua:9' end\n"
      "    if n == 3 then return ferry.KEEP end\n"
      "    return 7\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_policy_decide(p, &big, &c, &d);
  CHECK_EQ(d.action, FERRY_KEEP); /* decide never runs explain */
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK_EQ(e.reload, FERRY_RELOAD_ON_USE);
  CHECK(!expect_reason(&why, "mine", path, 2));
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK(strcmp(why.rule, "theirs") == 0 && strcmp(why.where, "elsewhere.lua:9") == 0);
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK(!expect_reason(&why, "explain", path, 4));
  ferry_policy_explain(p, &big, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fault", path, 4));
  CHECK(!expect_fault(p, path, 4,
                      "explain returned a nonsense action: 7 (expected ferry.KEEP or "
                      "ferry.OFFLOAD); the tensor was kept"));
  ferry_policy_destroy(p);
  return expect_load_error("why_notfn.lua",
                           "return { api = 1, decide = function() end,\n  explain = 42 }\n", 0, 2,
                           "explain must be a function (explain = function(t, ctx) ... end), got "
                           "number");
}

/* A rules-library policy: each decision's reason is the rule that made it,
 * at the line of the policy file where the rule is written (a rule built
 * in a helper: the helper's line, unless the helper returns the rule's
 * constructor call, a tail call that leaves the helper's caller's line; a
 * call over two lines: its first); an
 * offload a selector chose is the selector's; one no rule kept, without a
 * selector, is "all rules passed" at the policy's return. */
TEST(policy_explain_rules_lines) {
  char path[256];
  ferry_policy *p = load_file("why_rules.lua",
      "local R = require 'ferry.rules'\n"
      "local function big() local r = R.min_bytes(2048); return r end\n"
      "\n"
      "return R.policy {\n"
      "  name = 'why',\n"
      "  R.exclude_params_and_buffers(),\n"
      "  big(),\n"
      "  R.exclude_modules(\n"
      "    'lm_head'),\n"
      "  R.fraction(0.5),\n"
      "}\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_context c = {.step = 1};
  ferry_tensor_desc param = desc_of("model.a", "Linear", FERRY_KIND_PARAMETER, 4096);
  ferry_tensor_desc small = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 1024);
  ferry_tensor_desc head = desc_of("lm_head", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_tensor_desc act = desc_of("model.a", "Linear", FERRY_KIND_ACTIVATION, 4096);
  ferry_decision e;
  ferry_policy_reason why;
  ferry_policy_step_begin(p, &c);
  ferry_policy_explain(p, &param, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "exclude_params_and_buffers()", path, 6));
  ferry_policy_explain(p, &param, &c, &e, &why);
  CHECK_EQ(why.from_cache, 1);
  CHECK(!expect_reason(&why, "exclude_params_and_buffers()", path, 6));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK(!expect_reason(&why, "min_bytes(2048)", path, 2));
  ferry_policy_explain(p, &head, &c, &e, &why);
  CHECK(!expect_reason(&why, "exclude_modules({under=lm_head})", path, 8));
  ferry_policy_explain(p, &act, &c, &e, &why); /* spread: the 1st of 2 goes */
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK(!expect_reason(&why, "fraction(0.5, first)", path, 10));
  ferry_policy_explain(p, &act, &c, &e, &why); /* the 2nd stays */
  CHECK_EQ(e.action, FERRY_KEEP);
  CHECK(!expect_reason(&why, "fraction(0.5, first)", path, 10));
  ferry_policy_destroy(p);

  p = load_file("why_passed.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy { R.min_bytes(2048) }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_policy_explain(p, &act, &c, &e, &why);
  CHECK_EQ(e.action, FERRY_OFFLOAD);
  CHECK(!expect_reason(&why, "all rules passed", path, 2));
  ferry_policy_explain(p, &small, &c, &e, &why);
  CHECK(!expect_reason(&why, "min_bytes(2048)", path, 2));
  ferry_policy_destroy(p);
  return 0;
}

/* ---- checkpoint snapshots: the policy's snapshot(e) function ------------- */
static ferry_snapshot_entry snap_entry(const char *key, const char *path, uint64_t bytes,
                                       int32_t index) {
  ferry_snapshot_entry e = {key, path, bytes, index, FERRY_DTYPE_F32, 1};
  return e;
}

/* The entry arrives intact; the answer (stage flag, order) comes back as
 * given; without the function everything is staged in traversal order. */
TEST(policy_snapshot_answers) {
  char path[256];
  ferry_policy *p = load_file("nosnap.lua",
      "return { api = 1, decide = function() return ferry.KEEP end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_snapshot(p), 0);
  ferry_snapshot_entry e = snap_entry("state_dict", "state_dict.w", 4096, 7);
  ferry_snapshot_choice c;
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 7.0);
  ferry_policy_destroy(p);

  p = load_file("snap.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  snapshot = function(e)\n"
      "    assert(e.path == e.key .. '.w', 'path ' .. e.path)\n"
      "    assert(e.dtype == ferry.DTYPE_F32 and e.device == true)\n"
      "    if e.key == 'optimizer_states' then return false, -e.index end\n"
      "    if e.bytes < 100 then return false end\n"
      "    return true, 1000 + e.index\n"
      "  end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_snapshot(p), 1);
  e = snap_entry("state_dict", "state_dict.w", 4096, 3);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 1003.0);
  e = snap_entry("optimizer_states", "optimizer_states.w", 1 << 20, 4);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == -4.0);
  e = snap_entry("lr_schedulers", "lr_schedulers.w", 8, 5);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == 5.0); /* no order given: the index */
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  if (s.errors) fprintf(stderr, "  %s\n", ferry_policy_last_error(p));
  CHECK_EQ(s.errors, 0);
  ferry_policy_destroy(p);
  return 0;
}

/* Faults and nonsense stage the entry in traversal order (nothing is left
 * out of a checkpoint) and are reported with file:line. */
TEST(policy_snapshot_faults_stage) {
  char path[256];
  ferry_policy *p = load_file("snapbad.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  snapshot = function(e)\n"
      "    if e.key == 'boom' then error('no such key') end\n"
      "    if e.key == 'yes' then return 'yes' end\n"
      "    if e.key == 'nan' then return false, 0/0 end\n"
      "    while e.key == 'loop' do end\n"
      "    return false, 1\n"
      "  end }\n", 0, path, sizeof path);
  CHECK(p != NULL);
  ferry_snapshot_choice c;
  ferry_snapshot_entry e = snap_entry("boom", "boom.w", 64, 2);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 2.0);
  CHECK(expect_fault(p, path, 3, "no such key") == 0);
  e = snap_entry("yes", "yes.w", 64, 3);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 3.0);
  CHECK(expect_fault(p, path, 2,
                     "snapshot returned a nonsense stage flag: string \"yes\" (expected true, "
                     "false or nil); the entry was staged") == 0);
  e = snap_entry("nan", "nan.w", 64, 4);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK(c.order == 4.0);
  CHECK(expect_fault(p, path, 2,
                     "snapshot returned a nonsense order: nan (expected a finite number or "
                     "nil); the entry was staged") == 0);
  e = snap_entry("loop", "loop.w", 64, 5);
  ferry_policy_snapshot(p, &e, &c);
  CHECK_EQ(c.stage, 1);
  CHECK_STR_CONTAINS(ferry_policy_last_error(p), "interrupted after");
  e = snap_entry("fine", "fine.w", 64, 6);
  ferry_policy_snapshot(p, &e, &c); /* the state is usable after a fault */
  CHECK_EQ(c.stage, 0);
  CHECK(c.order == 1.0);
  ferry_policy_stats s;
  ferry_policy_get_stats(p, &s);
  CHECK_EQ(s.errors, 4);
  ferry_policy_destroy(p);
  return expect_load_error("snapnotfn.lua",
                           "return { api = 1, decide = function() return 0 end,\n"
                           "  snapshot = 42 }\n",
                           0, 2, "snapshot must be a function (snapshot = function(e) ... end), "
                           "got number");
}

/* R.snapshot in the rules library, and the shipped default's snapshot. */
TEST(policy_snapshot_rules_and_default) {
  char path[1024];
  ferry_policy *p = load_file("snaprules.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy { name = 'snaprules', R.min_bytes(1024),\n"
      "  snapshot = R.snapshot { keys = { 'state_dict', 'optimizer_states' },\n"
      "                          exclude_keys = 'lr_schedulers', min_bytes = 512,\n"
      "                          order = { 'optimizer_states', 'state_dict' } } }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  ferry_snapshot_choice sd, opt, small, other;
  ferry_snapshot_entry e = snap_entry("state_dict", "state_dict.w", 4096, 0);
  ferry_policy_snapshot(p, &e, &sd);
  e = snap_entry("optimizer_states", "optimizer_states.w", 4096, 1);
  ferry_policy_snapshot(p, &e, &opt);
  e = snap_entry("state_dict", "state_dict.b", 100, 2);
  ferry_policy_snapshot(p, &e, &small);
  e = snap_entry("callbacks", "callbacks.x", 4096, 3);
  ferry_policy_snapshot(p, &e, &other);
  CHECK_EQ(sd.stage, 1);
  CHECK_EQ(opt.stage, 1);
  CHECK_EQ(small.stage, 0);  /* under min_bytes */
  CHECK_EQ(other.stage, 0);  /* not among keys */
  CHECK(opt.order < sd.order); /* optimizer_states first */
  CHECK(sd.order < small.order);
  CHECK(small.order < other.order); /* keys not in order come last */
  ferry_policy_destroy(p);

  char err[1024];
  write_file(path, sizeof path, "snaprulesbad.lua",
             "local R = require 'ferry.rules'\n"
             "return R.policy { snapshot = R.snapshot { min_byte = 3 } }\n");
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "snaprulesbad.lua:2: ferry.rules.snapshot: unknown option 'min_byte'");

  const char *slash = strrchr(__FILE__, '/');
  CHECK(slash != NULL);
  snprintf(path, sizeof path, "%.*s/../policies/default.lua", (int)(slash - __FILE__), __FILE__);
  CHECK_RC(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_OK);
  CHECK_EQ(ferry_policy_has_snapshot(p), 1);
  /* documented default: every key staged, in traversal order */
  ferry_snapshot_choice a, b;
  e = snap_entry("optimizer_states", "optimizer_states.0.state.0.exp_avg", 4, 0);
  ferry_policy_snapshot(p, &e, &a);
  e = snap_entry("anything", "anything", 1, 1);
  ferry_policy_snapshot(p, &e, &b);
  CHECK_EQ(a.stage, 1);
  CHECK_EQ(b.stage, 1);
  CHECK(a.order < b.order);
  ferry_policy_destroy(p);
  return 0;
}

/* ---- optimizer states and weights: the policy's resident(r) -------------- */
static ferry_resident_entry res_entry(int kind, const char *name, int layer, uint64_t bytes,
                                      uint64_t total, int index, int count) {
  ferry_resident_entry e = {.kind = kind, .dtype = FERRY_DTYPE_BF16, .name = name,
                            .module = name, .layer = layer, .layer_count = 4, .bytes = bytes,
                            .total_bytes = total, .index = index, .count = count};
  return e;
}

/* A hand-written resident(r): its answers, the fields it sees, its reasons,
 * and faults (an error, a nonsense answer) that leave the tensor on device. */
TEST(policy_resident_hand_written) {
  char path[256];
  ferry_policy *p = load_file("resident_hand.lua",
      "return { api = 1, decide = function() return ferry.KEEP end,\n"
      "  resident = function(r)\n"
      "    if r.name == 'boom' then error('no') end\n"
      "    if r.name == 'odd' then return 42 end\n"
      "    if r.kind == 'weights' then return r.layer < r.layer_count / 2, 'half' end\n"
      "    return r.index + 1 == r.count and r.total_bytes == 300 and r.bytes == 100\n"
      "  end }\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_resident(p), 1);
  ferry_policy_reason why;
  ferry_resident_entry e = res_entry(FERRY_RESIDENT_OPTIMIZER, "a", 0, 100, 300, 2, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 1);
  CHECK(!expect_reason(&why, "resident", path, 2));
  e.index = 1;
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  e = res_entry(FERRY_RESIDENT_WEIGHTS, "model.layers.1", 1, 10, 40, 0, 4);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 1);
  CHECK(!expect_reason(&why, "half", path, 1)); /* a name and no line: the table's */
  e.layer = 2;
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  ferry_policy_stats st;
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 0);
  e = res_entry(FERRY_RESIDENT_OPTIMIZER, "boom", 0, 100, 300, 2, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK(!expect_reason(&why, "fault", path, 3));
  e.name = "odd";
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK_EQ(strcmp(why.rule, "fault"), 0);
  CHECK_STR_CONTAINS(ferry_policy_last_error(p),
                     "resident returned a nonsense answer: 42 (expected true, false or nil)");
  ferry_policy_get_stats(p, &st);
  CHECK_EQ(st.errors, 2);
  ferry_policy_destroy(p);

  /* without the function: the device, said so */
  p = load_file("resident_none.lua", "return { api = 1, decide = function() end }\n", 0, path,
                sizeof path);
  CHECK(p != NULL);
  CHECK_EQ(ferry_policy_has_resident(p), 0);
  e = res_entry(FERRY_RESIDENT_OPTIMIZER, "a", 0, 100, 300, 0, 3);
  CHECK_EQ(ferry_policy_resident(p, &e, &why), 0);
  CHECK_EQ(strcmp(why.rule, "no resident function"), 0);
  ferry_policy_destroy(p);
  /* not a function: a load error naming the field */
  char err[512];
  write_file(path, sizeof path, "resident_bad.lua",
             "return { api = 1, decide = function() end, resident = 3 }\n");
  CHECK_EQ(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "resident must be a function (resident = function(r) ... end)");
  return 0;
}

/* The rules library's selectors: host_fraction picks, largest first, what
 * stays within the share (as ferry.torch.offload_optimizer's fraction=);
 * a list's first selector with an opinion decides; each names its line. */
TEST(policy_resident_rules) {
  char path[256];
  ferry_policy *p = load_file("resident_rules.lua",
      "local R = require 'ferry.rules'\n"
      "return R.policy {\n"
      "  optimizer = { R.device_below(64),\n"
      "                R.host_modules('mlp'),\n"
      "                R.host_fraction(0.5) },\n"
      "  weights = R.host_first_layers(1),\n"
      "}\n",
      0, path, sizeof path);
  CHECK(p != NULL);
  /* largest first: 400 (attn), 300 (mlp), 200, 70, 60 (mlp, small); total 1030 */
  static const struct { const char *name; uint64_t bytes; int host; const char *rule; int line; }
      want[] = {{"model.layers.0.attn.q", 400, 1, "host_fraction(0.5)", 5},
                {"model.layers.0.mlp.up", 300, 1, "host_modules({under=mlp})", 4},
                {"model.layers.1.attn.k", 200, 0, "host_fraction(0.5)", 5},
                {"model.layers.1.attn.v", 70, 1, "host_fraction(0.5)", 5},
                {"model.layers.1.mlp.norm", 60, 0, "device_below(64)", 3}};
  for (int round = 0; round < 2; round++) /* the share starts again at index 0 */
    for (int i = 0; i < 5; i++) {
      ferry_resident_entry e =
          res_entry(FERRY_RESIDENT_OPTIMIZER, want[i].name, i < 2 ? 0 : 1, want[i].bytes, 1030, i, 5);
      ferry_policy_reason why;
      CHECK_EQ(ferry_policy_resident(p, &e, &why), want[i].host);
      CHECK(!expect_reason(&why, want[i].rule, path, want[i].line));
    }
  for (int l = 0; l < 3; l++) {
    char name[32];
    snprintf(name, sizeof name, "model.layers.%d", l);
    ferry_resident_entry e = res_entry(FERRY_RESIDENT_WEIGHTS, name, l, 100, 300, l, 3);
    ferry_policy_reason why;
    CHECK_EQ(ferry_policy_resident(p, &e, &why), l == 0);
    CHECK(!expect_reason(&why, l == 0 ? "host_first_layers(1)" : "device by default",
                         path, l == 0 ? 6 : 2));
  }
  ferry_policy_destroy(p);
  /* a misspelt selector list fails at load with the policy's line */
  char err[512];
  write_file(path, sizeof path, "resident_rules_bad.lua",
             "local R = require 'ferry.rules'\n"
             "return R.policy { optimizer = { R.host_fraction(2) } }\n");
  CHECK_EQ(ferry_policy_create(path, NULL, 0, &p, err, sizeof err), FERRY_EPOLICY);
  CHECK_STR_CONTAINS(err, "resident_rules_bad.lua:2: ferry.rules.host_fraction: f must be within [0, 1]");
  return 0;
}
