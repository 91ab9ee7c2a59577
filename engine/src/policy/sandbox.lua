-- sandbox.lua: runs once per policy state with the full standard library,
-- before any policy code, in a private environment; fills the sandbox env.
local ffi, env, F, C, trusted = ...
-- t and ctx: empty tables whose fields the host writes, before each call,
-- into tables the policy cannot reach (the index hop from t). So writing
-- t.bytes is an error, and so is reading a field that does not exist.
-- Plain tables because policies run in the interpreter (see load.c), where
-- a table field costs a tenth of an FFI cdata field.
-- lazy: fields computed when read (a C function each), not written per call
local function view(what, fields, lazy)
  setmetatable(fields, { __index = function(_, k)
    local f = lazy and lazy[k]
    if f then return f() end
    error(what .. " has no field '" .. tostring(k) .. "'", 2)
  end })
  return setmetatable({}, { __index = fields, __metatable = "ferry." .. what,
    __newindex = function(_, k)
      error("cannot assign " .. what .. "." .. tostring(k) .. ": " .. what .. " is read-only", 2)
    end }), fields
end
local shape = {}
-- the host's field names (decide.c); every field exists from the start
local tensor, tensor_fields = view("t", { bytes = 0, kind = 0, dtype = 0, ndim = 0,
  flags = 0, layer = 0, layer_count = 0, phase = 0, step = 0, shape = shape,
  path = C.path, class = C.class })
-- host_ram_used_pct is sampled (/proc/meminfo) only for a policy that reads
-- it, once per step: default.lua and the like never pay for it
local ctx, ctx_fields = view("ctx", { step = 0, phase = 0,
  arena_in_use = 0, arena_cap = 0, stash_depth = 0, bytes_in_flight = 0,
  packed_this_step = 0, offloaded_this_step = 0, bytes_offloaded_this_step = 0,
  offloaded_in_layer = C.offloaded_in_layer }, { host_ram_used_pct = C.host_ram_used_pct })
local function copy(src, skip)
  local t = {}
  for k, v in pairs(src) do if not (skip and skip[k]) then t[k] = v end end
  return t
end
local sstring = copy(string, { dump = true })
for _, f in ipairs{ 'find', 'match', 'gmatch', 'gsub', 'format' } do sstring[f] = C[f] end
setmetatable(sstring, { __index = function(_, k)
  if k == 'dump' then error("'string.dump' is not available to policies", 2) end
end })
local smt = debug.getmetatable('')
smt.__index = sstring
smt.__metatable = 'string'
local sos = { clock = os.clock, time = C.time }
setmetatable(sos, { __index = function(_, k)
  error("'os." .. tostring(k) .. "' is not available to policies "
    .. '(only os.clock and os.time are)', 2)
end })
F.log = C.log
F.forget_cached = C.forget_cached
local stable = copy(table)
stable.sort = C.sort
stable.insert = C.insert
stable.concat = C.concat
local allowed = { string = sstring, table = stable, math = copy(math), os = sos,
  ferry = F, pairs = pairs, ipairs = ipairs, next = next, select = select,
  type = type, tostring = C.tostring, tonumber = tonumber, error = error,
  assert = assert, pcall = C.pcall, xpcall = C.xpcall,
  setmetatable = setmetatable, getmetatable = getmetatable, rawget = rawget,
  rawequal = rawequal, unpack = unpack, require = C.require }
for k, v in pairs(allowed) do env[k] = v end
local function unknown(_, k)
  error("unknown global '" .. tostring(k) .. "'", 2)
end
setmetatable(env, { __index = unknown, __newindex = unknown, __metatable = false })
return tensor, tensor_fields, ctx, ctx_fields, shape
