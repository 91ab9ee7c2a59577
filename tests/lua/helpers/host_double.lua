--[[ host_double.lua — a TEST DOUBLE of the C policy host, for the pure-Lua
unit specs of the rules library (tests/lua/rules_unit_spec.lua) and for
quick benchmarks. It gives a policy what the real host gives it: a `ferry`
global with the API v1 constants, a descriptor as FFI cdata with :path()
and :class(), and a context as FFI cdata. It does not sandbox anything:
the real host does (engine/src/policy_host.c), and the specs that drive
libferry (policies_spec.lua, rules_engine_spec.lua) test through it. ]]
local ffi = require "ffi"

local M = {}

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
M.root = here .. "../../../"

ffi.cdef [[
typedef struct ferry_double_desc {
  double bytes;
  int32_t dtype, kind, ndim, flags;
  int64_t shape[8];
  int32_t layer, layer_count, phase, step;
  int32_t path_id, class_id;
} ferry_double_desc;
typedef struct ferry_double_ctx {
  double step;
  int32_t phase;
  double host_ram_used_pct;
  double arena_in_use, arena_cap, stash_depth, bytes_in_flight;
  double packed_this_step, offloaded_this_step, bytes_offloaded_this_step;
} ferry_double_ctx;
]]

-- Strings are interned once, as the real host does; :path() returns the
-- same Lua string for the same id without allocating.
local strings, ids = {}, {}
local function intern(s)
  s = s or ""
  local id = ids[s]
  if not id then
    id = #strings + 1
    strings[id], ids[s] = s, id
  end
  return id
end

ffi.metatype("ferry_double_desc", {
  __index = {
    path = function(t) return strings[t.path_id] end,
    class = function(t) return strings[t.class_id] end,
  },
})
ffi.metatype("ferry_double_ctx", { __index = {
  offloaded_in_layer = function() return 0 end } })

M.ferry = {
  KEEP = 0, OFFLOAD = 1, ON_USE = 0, PREFETCH = 1,
  ACTIVATION = 0, PARAMETER = 1, BUFFER = 2, OTHER = 3,
  FORWARD = 0, RECOMPUTE = 1, BACKWARD = 2,
  DTYPE_UNKNOWN = 0, DTYPE_F32 = 1, DTYPE_F16 = 2, DTYPE_BF16 = 3,
  log = function() end,
}

-- A descriptor from a table {bytes=, kind=, path=, class=, layer=, ...}.
function M.desc(o)
  local d = ffi.new("ferry_double_desc")
  d.bytes = o.bytes or 4096
  d.dtype = o.dtype or 3
  d.kind = o.kind or 0
  d.layer = o.layer or -1
  d.layer_count = o.layer_count or 0
  d.phase = o.phase or 0
  local shape = o.shape or { (o.bytes or 4096) / 2 }
  d.ndim = #shape
  for i = 1, #shape do d.shape[i - 1] = shape[i] end
  d.path_id = intern(o.path)
  d.class_id = intern(o.class)
  return d
end

function M.ctx(o)
  local c = ffi.new("ferry_double_ctx")
  o = o or {}
  for k, v in pairs(o) do c[k] = v end
  return c
end

-- Load a policy file (relative to the repo root) or source text with the
-- ferry global and require path set up; returns the policy table.
function M.load(file_or_source, is_source)
  rawset(_G, "ferry", M.ferry)
  local lib = M.root .. "policies/lib/?.lua"
  if not package.path:find(lib, 1, true) then package.path = lib .. ";" .. package.path end
  -- a fresh copy of ferry's modules, as the host's one state per policy has
  -- (code shared with an earlier load would carry its JIT traces along)
  for name in pairs(package.loaded) do
    if name:sub(1, 6) == "ferry." then package.loaded[name] = nil end
  end
  local chunk, err
  if is_source then
    chunk, err = loadstring(file_or_source, "=policy")
  else
    chunk, err = loadfile(M.root .. file_or_source)
  end
  assert(chunk, err)
  return chunk()
end

return M
