-- sandbox.lua: runs once per policy state with the full standard library,
-- before any policy code, in a private environment; fills the sandbox env.
local ffi, env, F, C, offsets, trusted = ...
ffi.cdef[[
typedef struct ferry_policy_tensor {
  const double bytes;
  const int32_t kind, dtype, ndim, flags, layer, layer_count, phase;
  const double step;
} ferry_policy_tensor;
typedef struct ferry_policy_ctx {
  const double step;
  const double host_ram_used_pct;
  const double arena_in_use, arena_cap, stash_depth, bytes_in_flight;
  const double packed_this_step, offloaded_this_step, bytes_offloaded_this_step;
  const int32_t phase;
} ferry_policy_ctx;
]]
for field, off in pairs(offsets) do
  local ct, f = field:match('^(.-)%.(.*)$')
  if f == 'sizeof' then assert(ffi.sizeof(ct) == off, field)
  else assert(ffi.offsetof(ct, f) == off, field) end
end
local shape = {}
ffi.metatype('ferry_policy_tensor', { __index = { path = C.path, class = C.class,
  shape = shape } })
ffi.metatype('ferry_policy_ctx', { __index = {
  offloaded_in_layer = C.offloaded_in_layer } })
local function copy(src, skip)
  local t = {}
  for k, v in pairs(src) do if not (skip and skip[k]) then t[k] = v end end
  return t
end
local sstring = copy(string, { dump = true })
for _, f in ipairs{ 'find', 'match', 'gmatch', 'gsub' } do sstring[f] = C[f] end
setmetatable(sstring, { __index = function(_, k)
  if k == 'dump' then error("'string.dump' is not available to policies", 2) end
end })
local smt = debug.getmetatable('')
smt.__index = sstring
smt.__metatable = 'string'
local sos = { clock = os.clock, time = os.time }
setmetatable(sos, { __index = function(_, k)
  error("'os." .. tostring(k) .. "' is not available to policies "
    .. '(only os.clock and os.time are)', 2)
end })
F.log = C.log
F.forget_cached = C.forget_cached
local stable = copy(table)
stable.sort = C.sort
local allowed = { string = sstring, table = stable, math = copy(math), os = sos,
  ferry = F, pairs = pairs, ipairs = ipairs, next = next, select = select,
  type = type, tostring = tostring, tonumber = tonumber, error = error,
  assert = assert, pcall = C.pcall, xpcall = C.xpcall,
  setmetatable = setmetatable, getmetatable = getmetatable, rawget = rawget,
  rawequal = rawequal, unpack = unpack, require = C.require }
for k, v in pairs(allowed) do env[k] = v end
local function unknown(_, k)
  error("unknown global '" .. tostring(k) .. "'", 2)
end
setmetatable(env, { __index = unknown, __newindex = unknown, __metatable = false })
return ffi.new('ferry_policy_tensor'), ffi.new('ferry_policy_ctx'), shape
