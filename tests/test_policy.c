/* test_policy.c — the Lua policy host: what a policy sees, the sandbox
 * (its escapes refused, bytecode refused, its globals an allow-list),
 * errors that carry their file:line, load errors, bad knobs and nonsense
 * answers. Policies are written to files in a temporary
 * directory (test_policy_temp.h) so that every error message can be
 * checked for its exact "file:line: message". */
#include <lauxlib.h>
#include <lua.h>
#include <unistd.h>

#include "ferry_tools.h"
#include "test.h"
#include "test_policy_temp.h"

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
