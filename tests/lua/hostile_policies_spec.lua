-- hostile_policies_spec.lua — the hostile policies of issue 40 through the
-- policy host's C API (ferry_tools.h): each ends as a fault naming the
-- problem, in decide and at load, within twice its budget. The C suite
-- (tests/test_policy_hostile.c) runs the same kinds of policy on 1 MiB and
-- 8 MiB thread stacks, in child processes.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local ffi = require "ffi"
local ferry = require "ferry"
local C = ffi.load(ferry.library_path)

ffi.cdef [[
typedef struct ferry_policy ferry_policy;
int ferry_policy_create(const char *path, const char *source, int trusted, ferry_policy **out,
                        char *errbuf, size_t errlen);
void ferry_policy_destroy(ferry_policy *p);
void ferry_policy_decide(ferry_policy *p, const ferry_tensor_desc *desc, const ferry_context *ctx,
                         ferry_decision *out);
const char *ferry_policy_last_error(const ferry_policy *p);
size_t ferry_policy_globals(const ferry_policy *p, char *out, size_t n);
int setenv(const char *name, const char *value, int overwrite);
int unsetenv(const char *name);
]]

local DECISION_MS, LOAD_MS = 200, 600

local function now_ms() return os.clock() * 1e3 end -- CPU time: these loops are CPU-bound

local function create(src)
  local out, err = ffi.new("ferry_policy *[1]"), ffi.new("char[1024]")
  local rc = C.ferry_policy_create(nil, src, 0, out, err, 1024)
  local p = rc == 0 and ffi.gc(out[0], C.ferry_policy_destroy) or nil
  return p, ffi.string(err), rc
end

-- setup, then body in decide: the fault and the milliseconds of the call
local function in_decide(setup, body)
  local p, err = create(setup .. "\nreturn { api = 1, decide = function(t)\n" .. body ..
    "\nreturn ferry.OFFLOAD end }")
  assert(p, err)
  local d = ffi.new("ferry_tensor_desc")
  d.bytes, d.module_path = 4096, "model.layers.0.mlp"
  local out = ffi.new("ferry_decision")
  out.action = 1
  local t0 = now_ms()
  C.ferry_policy_decide(p, d, nil, out)
  local ms = now_ms() - t0
  assert.equal(0, out.action) -- kept: a fault
  return ffi.string(C.ferry_policy_last_error(p)), ms
end

local function at_load(setup, body)
  local t0 = now_ms()
  local p, err = create(setup .. "\n" .. body ..
    "\nreturn { api = 1, decide = function() return ferry.OFFLOAD end }")
  local ms = now_ms() - t0
  assert.is_nil(p)
  return err, ms
end

local function hostile(setup, body, fault)
  local msg, ms = in_decide(setup, body)
  assert.truthy(msg:find(fault, 1, true), msg)
  assert.truthy(ms <= 2 * DECISION_MS, ("decide took %.0f ms"):format(ms))
  msg, ms = at_load(setup, body)
  assert.truthy(msg:find(fault, 1, true), msg)
  assert.truthy(ms <= 2 * LOAD_MS, ("the load took %.0f ms"):format(ms))
end

describe("hostile policies", function()
  setup(function()
    C.setenv("FERRY_POLICY_DECISION_MS", tostring(DECISION_MS), 1)
    C.setenv("FERRY_POLICY_LOAD_MS", tostring(LOAD_MS), 1)
  end)
  teardown(function()
    C.unsetenv("FERRY_POLICY_DECISION_MS")
    C.unsetenv("FERRY_POLICY_LOAD_MS")
  end)

  it("1: __tostring = tostring is a nesting error, not an endless loop", function()
    local o = "local o = setmetatable({}, { __tostring = tostring })"
    hostile(o, "tostring(o)", "tostring nested too deeply (limit 64)")
    hostile(o, "string.format('%s', o)", "tostring nested too deeply (limit 64)")
  end)

  it("2: table.sort refuses a C comparator", function()
    hostile("local items = {} for i = 1, 6 do items[i] = ('.'):rep(16000) .. i end",
      "table.sort(items, string.find)",
      "table.sort: the comparator must be a Lua function, got a C function")
  end)

  it("3: table.insert refuses a position outside [1, #t + 1]", function()
    hostile("", "table.insert({}, -2^31 + 1, 0)",
      "bad argument #2 to 'insert' (position -2147483647 out of bounds [1, 1])")
  end)

  it("4: the pattern estimate counts the whole pattern; the clock is read between calls", function()
    hostile("local X = ('.'):rep(16000) .. '%z'", "X:find(X)",
      "is too costly for a 16002-byte subject")
    hostile("local X = ('.'):rep(900) .. '%z'", "while true do X:find(X) end",
      "interrupted after")
  end)

  it("5: C functions calling Lua nest at most 64 deep", function()
    hostile("local o = {} setmetatable(o, { __tostring = function() return string.format('%s', o) end })",
      "tostring(o)", "nested too deeply (limit 64)")
    hostile("local function less(a, b) table.sort({3, 2, 1}, less) return a < b end",
      "table.sort({3, 2, 1}, less)", "table.sort nested too deeply (limit 64)")
    hostile("local d = {} setmetatable(d, { __index = function() return os.time(d) end })",
      "os.time(d)", "os.time nested too deeply (limit 64)")
  end)

  it("6: ferry_policy_globals after `string = nil` lists what is left", function()
    local p, err = create("string = nil\nreturn { api = 1, decide = function() return ferry.OFFLOAD end }")
    assert(p, err)
    local buf = ffi.new("char[8192]")
    C.ferry_policy_globals(p, buf, 8192)
    local names = ffi.string(buf)
    assert.truthy(names:find("math.floor", 1, true), names)
    assert.falsy(names:find("string.find", 1, true), names)
  end)

  it("more: comparing or concatenating big strings in a loop is stopped by the budget", function()
    hostile("local a = ('x'):rep(16e6) .. 'a' local b = ('x'):rep(16e6) .. 'b'",
      "while true do local _ = a < b end", "interrupted after")
    hostile("local a = ('x'):rep(16e6) local b = a .. 'y'",
      "while true do local _ = a .. 'y' end", "interrupted after")
    hostile("local s = ('x'):rep(1e5)", "s:gsub('.', string.upper)",
      "string.gsub: the replacement must be a string, a table or a Lua function")
  end)
end)
