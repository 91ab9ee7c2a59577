--[[
ferry.lua — LuaJIT FFI binding of libferry (engine/include/ferry.h).

    local ferry = require "ferry"
    local dev = ferry.malloc_device()          -- "device" memory for the host backend
    local e = assert(ferry.engine { backend = "host", device = dev,
                                    policy_path = "policies/default.lua" })
    local d = e:desc { bytes = 4096, dtype = "BF16", shape = { 2048 },
                       path = "model.layers.0.mlp", class = "LlamaMLP", layer = 0 }
    local ptr, owner = dev:new_buffer(4096)
    local h = assert(e:pack(d, ptr, owner))
    e:backward_begin()
    local ptr2, owner2 = assert(e:unpack(h))
    dev:release(owner2)
    e:step_end()
    print(e:stats().tensors_offloaded)
    e:destroy()

Every call that can fail returns true (or its result) on success, and
nil, message, code on failure; message is ferry_strerror(code) followed by
ferry_last_error() of the engine. ferry.C is the raw library for anything
not wrapped.

Finding the library: $FERRY_LIB if set; else libferry.so on package.cpath
(each "?.so" entry tried as "lib?.so"); else build/lib/libferry.so of this
source tree; else the system's libferry.so (ffi.load "ferry").

The declarations come from ferry_cdef.lua, generated from ferry.h by
gen_cdef.sh (tests/lua/cdef_spec.lua fails when they drift).
]]
local ffi = require "ffi"

local here = (debug.getinfo(1, "S").source:match("^@(.*)[/\\]") or ".") .. "/"
local generated = dofile(here .. "ferry_cdef.lua")
ffi.cdef(generated.cdef)
ffi.cdef [[
void *malloc(size_t size);
void free(void *p);
]]

local M = {}

local function file_exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return false
end

local function find_library()
  local env = os.getenv("FERRY_LIB")
  if env and env ~= "" then return env end
  local cpath = package.cpath:gsub("%?%.so", "lib?.so")
  local found = package.searchpath("ferry", cpath)
  if found then return found end
  local in_tree = here .. "../../build/lib/libferry.so"
  if file_exists(in_tree) then return in_tree end
  return "ferry"
end

M.library_path = find_library()
local ok, lib = pcall(ffi.load, M.library_path)
if not ok then
  error("ferry: cannot load libferry from '" .. M.library_path .. "' (" .. tostring(lib) ..
    "); build it (cmake --build build) or set FERRY_LIB to its path", 2)
end
M.C = lib
local C = lib

for k, v in pairs(generated.macros) do M[k] = v end

-- Raises unless a library of version `hex` (FERRY_VERSION_HEX layout:
-- major << 16 | minor << 8 | patch) has the major version of the cdef this
-- binding was generated from (a different major is a different ABI) and is
-- at least its minor version (an older library lacks what the cdef declares:
-- functions, struct fields).
function M.check_library_version(hex, path)
  local major, minor = math.floor(hex / 65536), math.floor(hex / 256) % 256
  if major == M.VERSION_MAJOR and minor < M.VERSION_MINOR then
    error(string.format("ferry: libferry at '%s' is version %d.%d.%d, older than this binding " ..
      "(ferry_cdef.lua, %d.%d.%d): use a libferry at least as new as the binding", tostring(path),
      major, minor, hex % 256, M.VERSION_MAJOR, M.VERSION_MINOR, M.VERSION_PATCH), 2)
  end
  if major ~= M.VERSION_MAJOR then
    error(string.format("ferry: libferry at '%s' is version %d.%d.%d, but this binding " ..
      "(ferry_cdef.lua) is for major version %d (%d.%d.%d); ABIs of different major " ..
      "versions are incompatible", tostring(path), major, math.floor(hex / 256) % 256, hex % 256,
      M.VERSION_MAJOR, M.VERSION_MAJOR, M.VERSION_MINOR, M.VERSION_PATCH), 2)
  end
end
M.check_library_version(tonumber(C.ferry_version()), M.library_path)

-- ---------------------------------------------------------------------------
-- constants, from the enums of the header

local function enum_table(prefix, names)
  local t = {}
  for _, n in ipairs(names) do t[n] = tonumber(C[prefix .. n]) end
  return t
end
-- dtypes as the header's FERRY_DTYPE_LIST expands them into the enum
local DTYPE_NAMES = {}
for name in generated.cdef:match("enum ferry_dtype {(.-)}"):gmatch("FERRY_DTYPE_([%w_]+)") do
  if name ~= "COUNT_" then DTYPE_NAMES[#DTYPE_NAMES + 1] = name end
end
M.dtype = enum_table("FERRY_DTYPE_", DTYPE_NAMES)
M.kind = enum_table("FERRY_KIND_", { "ACTIVATION", "PARAMETER", "BUFFER", "OTHER" })
M.phase = enum_table("FERRY_PHASE_", { "FORWARD", "RECOMPUTE", "BACKWARD" })
M.backend = enum_table("FERRY_BACKEND_", { "HOST", "CUDA", "SIM" })
M.arena = enum_table("FERRY_ARENA_", { "AUTO", "JEMALLOC", "POOL" })
M.flag = enum_table("FERRY_FLAG_", { "VIEW", "CONTIGUOUS" })
M.KEEP, M.OFFLOAD = tonumber(C.FERRY_KEEP), tonumber(C.FERRY_OFFLOAD)
M.ON_USE, M.PREFETCH = tonumber(C.FERRY_RELOAD_ON_USE), tonumber(C.FERRY_RELOAD_PREFETCH)

-- error codes by name: M.errors.EINVAL == -1
M.errors = {}
for name in generated.cdef:match("enum ferry_status {(.-)}"):gmatch("FERRY_(%u+)") do
  M.errors[name] = tonumber(C["FERRY_" .. name])
end

-- stats field names, in header order
local STATS_FIELDS = {}
for field in generated.cdef:match("typedef struct ferry_stats {(.-)}"):gmatch("uint64_t ([%w_]+);") do
  STATS_FIELDS[#STATS_FIELDS + 1] = field
end

-- ---------------------------------------------------------------------------
-- library-wide functions

function M.version()
  return tonumber(C.ferry_version()), ffi.string(C.ferry_version_string())
end

function M.strerror(code) return ffi.string(C.ferry_strerror(code)) end
function M.err_name(code) return ffi.string(C.ferry_err_name(code)) end

-- ---------------------------------------------------------------------------
-- "device" memory from malloc, for the host and sim backends (there the
-- device is host memory). Owners are the buffer pointers; the callbacks run
-- on the thread that calls into the engine (engine/src/core/stash.c), which is
-- what LuaJIT callbacks require.

local Device = {}
Device.__index = Device

function M.malloc_device()
  local dev = setmetatable({ live = 0, allocs = 0, releases = 0, fail_next = 0 }, Device)
  dev.alloc_cb = ffi.cast("ferry_alloc_fn", function(_, bytes, _, pptr, powner)
    if dev.fail_next > 0 then
      dev.fail_next = dev.fail_next - 1
      return -1
    end
    local p = C.malloc(bytes > 0 and bytes or 1)
    if p == nil then return -1 end
    dev.live, dev.allocs = dev.live + 1, dev.allocs + 1
    pptr[0], powner[0] = p, p
    return 0
  end)
  dev.release_cb = ffi.cast("ferry_release_fn", function(_, owner)
    dev.live, dev.releases = dev.live - 1, dev.releases + 1
    C.free(owner)
  end)
  return dev
end

-- A buffer of `bytes` filled with `fill(i)` (i = 0-based byte index) or a
-- repeating pattern; returns pointer and owner (the same pointer).
function Device:new_buffer(bytes, fill)
  local p = C.malloc(bytes > 0 and bytes or 1)
  assert(p ~= nil, "malloc failed")
  self.live = self.live + 1
  local b = ffi.cast("uint8_t *", p)
  for i = 0, bytes - 1 do b[i] = fill and fill(i) or (i * 131 + 7) % 251 end
  return p, p
end

function Device:release(owner)
  self.live, self.releases = self.live - 1, self.releases + 1
  C.free(owner)
end

function Device:free_callbacks()
  if self.alloc_cb then self.alloc_cb:free(); self.alloc_cb = nil end
  if self.release_cb then self.release_cb:free(); self.release_cb = nil end
end

-- ---------------------------------------------------------------------------
-- engine

local Engine = {}
Engine.__index = Engine

local function enum_value(what, map, v, default)
  if v == nil then return default end
  if type(v) == "number" then return v end
  local n = map[tostring(v):upper()]
  if n == nil then error("ferry: unknown " .. what .. " '" .. tostring(v) .. "'", 3) end
  return n
end

local function fail(e, code)
  local msg = M.strerror(code)
  if e and e.ptr ~= nil then
    local detail = ffi.string(C.ferry_last_error(e.ptr))
    if detail ~= "" then msg = msg .. ": " .. detail end
  end
  return nil, msg, code
end

local function check(e, rc)
  if rc < 0 then return fail(e, rc) end
  return true
end

-- Residents collected and not destroyed yet. A finalizer may run inside any
-- callback, also one that holds the engine lock (decide, retain, host_ram),
-- where ferry_resident_destroy, which takes that lock, would deadlock: it
-- only queues the resident, and the binding's next calls that create or
-- destroy engines or residents, begin or end a step or read the stats
-- destroy it (ferry.destroy_collected_residents() too).
local collected_residents = {}

local function collect_resident_cell(cell)
  local p = cell[0]
  if p ~= nil then
    cell[0] = nil
    collected_residents[#collected_residents + 1] = p
  end
end

local function destroy_collected_residents()
  if #collected_residents == 0 then return end
  local list = collected_residents
  collected_residents = {}
  for i = 1, #list do C.ferry_resident_destroy(list[i]) end
end
M.destroy_collected_residents = destroy_collected_residents

-- The finalizer of an engine's cell (below): it gets the cell, nothing else.
local function destroy_engine_cell(cell)
  local p = cell[0]
  if p ~= nil then
    cell[0] = nil
    C.ferry_engine_destroy(p)
  end
end
jit.off(destroy_engine_cell) -- it may call the Lua release callback

--[[ ferry.engine(opts) -> engine | nil, err, code
opts: backend ("host"|"cuda"|"sim"), arena ("auto"|"jemalloc"|"pool"),
device_index, max_fwd_stash, host_cap_bytes, host_cap_pct,
min_offload_bytes, prefetch_distance, link = { d2h_bytes_per_s,
h2d_bytes_per_s, latency_us, duplex }, device (from ferry.malloc_device())
or device_alloc/release/retain (ferry_*_fn cdata), decide (ferry_decide_fn),
policy_path, policy_source, policy_trusted, trace_path, chrome_trace_path
(a Chrome trace of the run, docs/pytorch.md#perfetto-traces), node_budget
(from ferry.node_budget()).]]
function M.engine(opts)
  destroy_collected_residents()
  opts = opts or {}
  local cfg = ffi.new("ferry_config")
  -- the library writes only the bytes of this binding's ferry_config
  assert(C.ferry_config_init_sized(cfg, ffi.sizeof(cfg)) == 0)
  cfg.backend = enum_value("backend", M.backend, opts.backend, cfg.backend)
  cfg.arena = enum_value("arena", M.arena, opts.arena, cfg.arena)
  if opts.device_index then cfg.device = opts.device_index end
  for _, k in ipairs({ "max_fwd_stash", "host_cap_bytes", "host_cap_pct",
    "min_offload_bytes", "prefetch_distance" }) do
    if opts[k] ~= nil then cfg[k] = opts[k] end
  end
  if opts.link then
    for k, v in pairs(opts.link) do cfg.link[k] = v end
  end
  local dev = opts.device
  cfg.device_alloc = opts.device_alloc or (dev and dev.alloc_cb) or nil
  cfg.release = opts.release or (dev and dev.release_cb) or nil
  cfg.retain = opts.retain or nil
  cfg.decide = opts.decide or nil
  -- strings stay referenced by the engine object for its whole life
  local keep = { opts.policy_path, opts.policy_source, opts.trace_path, opts.chrome_trace_path }
  cfg.policy_path = opts.policy_path
  cfg.policy_source = opts.policy_source
  cfg.policy_trusted = opts.policy_trusted and 1 or 0
  cfg.trace_path = opts.trace_path
  cfg.chrome_trace_path = opts.chrome_trace_path
  if opts.node_budget then -- a ferry.node_budget(): share its cap
    cfg.host_reserve = C.ferry_node_budget_reserve
    cfg.host_reserve_ud = opts.node_budget.ptr
    keep[#keep + 1] = opts.node_budget
  end
  local out = ffi.new("ferry_engine *[1]")
  local errbuf = ffi.new("char[512]")
  local rc = C.ferry_engine_create(cfg, out, errbuf, 512)
  if rc < 0 then
    local detail = ffi.string(errbuf)
    return nil, M.strerror(rc) .. (detail ~= "" and (": " .. detail) or ""), rc
  end
  -- Destroyed on collection too, so a dropped engine is not leaked: the
  -- cell holds the pointer and is what the finalizer gets. The finalizer
  -- must not refer to the engine table, which holds the cell: LuaJIT never
  -- collects a table its own cdata's finalizer refers to.
  local cell = ffi.gc(ffi.new("ferry_engine *[1]", out[0]), destroy_engine_cell)
  local e = setmetatable({ ptr = out[0], cell = cell, device = dev, keep = keep, strings = {},
    handle_out = ffi.new("ferry_handle[1]"), ptr_out = ffi.new("void *[1]"),
    owner_out = ffi.new("void *[1]") }, Engine)
  return e
end

--[[ A host cap shared by the processes of a node (ferry_node_budget_*):
ferry.node_budget(name, cap_bytes) -> b or nil, message, code. b:reserve(n)
-> true/false, b:release(n), b:stats() -> table, b:close().]]
local NodeBudget = {}
NodeBudget.__index = NodeBudget

function M.node_budget(name, cap_bytes)
  local out = ffi.new("ferry_node_budget *[1]")
  local errbuf = ffi.new("char[512]")
  local rc = C.ferry_node_budget_open(name, cap_bytes, out, errbuf, 512)
  if rc < 0 then return nil, ffi.string(errbuf), rc end
  return setmetatable({ ptr = ffi.gc(out[0], C.ferry_node_budget_close) }, NodeBudget)
end

function M.node_budget_unlink(name)
  local errbuf = ffi.new("char[512]")
  local rc = C.ferry_node_budget_unlink(name, errbuf, 512)
  if rc < 0 then return nil, ffi.string(errbuf), rc end
  return true
end

function NodeBudget:reserve(n) return C.ferry_node_budget_reserve(self.ptr, n, 0) == 0 end
function NodeBudget:release(n) C.ferry_node_budget_reserve(self.ptr, n, 1) end

function NodeBudget:stats()
  local st = ffi.new("ferry_node_budget_stats")
  assert(C.ferry_node_budget_get_stats(self.ptr, st, nil, nil, 0) == 0)
  local t = {}
  for _, k in ipairs({ "cap", "total", "mine", "mine_peak", "reclaimed", "refusals" }) do
    t[k] = tonumber(st[k])
  end
  t.processes = st.processes
  return t
end

function NodeBudget:close()
  if self.ptr ~= nil then
    C.ferry_node_budget_close(ffi.gc(self.ptr, nil))
    self.ptr = nil
  end
end

function Engine:destroy()
  destroy_collected_residents()
  if self.ptr ~= nil then
    self.ptr = nil
    destroy_engine_cell(self.cell)
  end
end

function Engine:last_error() return ffi.string(C.ferry_last_error(self.ptr)) end
function Engine:backend_name() return ffi.string(C.ferry_backend_name(self.ptr)) end
function Engine:arena_name() return ffi.string(C.ferry_arena_name(self.ptr)) end

-- A stable C string owned by the engine; equal strings give equal pointers.
function Engine:intern(s)
  local p = self.strings[s]
  if p == nil then
    p = C.ferry_intern(self.ptr, s)
    if p == nil then return fail(self, M.errors.ENOMEM) end
    self.strings[s] = p
  end
  return p
end

--[[ A ferry_tensor_desc from a table: bytes, dtype (number or name such as
"BF16"), kind (number or "ACTIVATION"...), shape (list; default { bytes /
element size }), flags, layer (-1), layer_count (0), phase (number or
"FORWARD"...), path, class (interned through the engine).]]
function Engine:desc(o)
  local d = ffi.new("ferry_tensor_desc")
  d.bytes = o.bytes or 0
  d.dtype = enum_value("dtype", M.dtype, o.dtype, M.dtype.BF16)
  d.kind = enum_value("kind", M.kind, o.kind, M.kind.ACTIVATION)
  d.phase = enum_value("phase", M.phase, o.phase, M.phase.FORWARD)
  d.flags = o.flags or M.flag.CONTIGUOUS
  d.layer = o.layer or -1
  d.layer_count = o.layer_count or 0
  local shape = o.shape
  if not shape then
    local size = math.max(C.ferry_dtype_size(d.dtype), 1)
    shape = { math.floor(tonumber(d.bytes) / size) }
  end
  -- shape[] has MAX_DIMS slots: more would write over the fields after it
  if #shape > M.MAX_DIMS then
    error(string.format("ferry: desc: shape has %d dims, at most %d (FERRY_MAX_DIMS)", #shape,
      M.MAX_DIMS), 2)
  end
  d.ndim = #shape
  for i = 1, #shape do d.shape[i - 1] = shape[i] end
  if o.path then d.module_path = assert(self:intern(o.path)) end
  if o.class then d.module_class = assert(self:intern(o.class)) end
  return d
end

-- pack(desc, device_ptr, owner [, stream]) -> handle (uint64 cdata)
function Engine:pack(desc, device_ptr, owner, stream)
  local rc = C.ferry_pack(self.ptr, desc, device_ptr, owner, stream, self.handle_out)
  if rc < 0 then return fail(self, rc) end
  return self.handle_out[0]
end

-- unpack(handle [, stream]) -> device_ptr, owner (the caller now owns owner)
function Engine:unpack(h, stream)
  local rc = C.ferry_unpack(self.ptr, h, stream, self.ptr_out, self.owner_out)
  if rc < 0 then return fail(self, rc) end
  return self.ptr_out[0], self.owner_out[0]
end

function Engine:prefetch(h, stream) return check(self, C.ferry_prefetch(self.ptr, h, stream)) end
function Engine:discard(h) return check(self, C.ferry_discard(self.ptr, h)) end
function Engine:step_begin()
  destroy_collected_residents()
  return check(self, C.ferry_step_begin(self.ptr))
end
function Engine:step_end()
  destroy_collected_residents()
  return check(self, C.ferry_step_end(self.ptr))
end
function Engine:backward_begin() return check(self, C.ferry_backward_begin(self.ptr)) end
function Engine:backward_end() return check(self, C.ferry_backward_end(self.ptr)) end

--[[ set_policy(path) or set_policy { path = ..., source = ..., trusted = bool }
The message of a failure carries the policy's file:line.]]
function Engine:set_policy(p)
  if type(p) == "string" then p = { path = p } end
  local rc = C.ferry_set_policy(self.ptr, p.path, p.source, p.trusted and 1 or 0)
  if rc < 0 then return fail(self, rc) end
  self.keep.policy = p
  return true
end

function Engine:policy_last_error()
  return ffi.string(C.ferry_last_policy_error(self.ptr))
end

-- stats() -> { steps = n, tensors_packed = n, ... } (Lua numbers)
function Engine:stats()
  destroy_collected_residents()
  local s = ffi.new("ferry_stats")
  local rc = C.ferry_get_stats(self.ptr, s, ffi.sizeof(s))
  if rc < 0 then return fail(self, rc) end
  local t = {}
  for _, k in ipairs(STATS_FIELDS) do t[k] = tonumber(s[k]) end
  return t
end

-- Calls that may run the embedder's callbacks (Lua callbacks here) must not
-- be JIT-compiled: LuaJIT cannot re-enter from a compiled FFI call.
for _, name in ipairs({ "pack", "unpack", "prefetch", "discard", "step_begin", "step_end",
  "backward_begin", "backward_end", "destroy", "set_policy" }) do
  jit.off(Engine[name])
end
jit.off(Device.new_buffer)

-- ---------------------------------------------------------------------------
-- resident buffers (docs/optimizer-offload.md)

local Resident = {}
Resident.__index = Resident

local function destroy_resident_cell(cell)
  local p = cell[0]
  if p == nil then return 0 end
  cell[0] = nil
  return C.ferry_resident_destroy(p)
end

-- e:resident(bytes) -> buffer | nil, err, code. Pinned arena bytes that move
-- to and from the device at chosen points: r:to_host(dev_ptr, stream),
-- r:to_device(dev_ptr, stream), r:wait(), r:host_ptr() (uint8_t *, after
-- wait), r:bytes(), r:destroy() (also once collected, at a later binding
-- call: see collected_residents).
function Engine:resident(bytes)
  destroy_collected_residents()
  local out = ffi.new("ferry_resident *[1]")
  local rc = C.ferry_resident_create(self.ptr, bytes, out)
  if rc < 0 then return fail(self, rc) end
  -- destroyed on collection too: a cell, as for engines (ferry.engine)
  local cell = ffi.gc(ffi.new("ferry_resident *[1]", out[0]), collect_resident_cell)
  return setmetatable({ ptr = out[0], cell = cell, e = self }, Resident)
end

function Resident:to_host(dev_ptr, stream)
  return check(self.e, C.ferry_resident_to_host(self.ptr, dev_ptr, stream))
end
function Resident:to_device(dev_ptr, stream)
  return check(self.e, C.ferry_resident_to_device(self.ptr, dev_ptr, stream))
end
function Resident:wait() return check(self.e, C.ferry_resident_wait(self.ptr)) end
function Resident:host_ptr() return ffi.cast("uint8_t *", C.ferry_resident_host_ptr(self.ptr)) end
function Resident:bytes() return tonumber(C.ferry_resident_bytes(self.ptr)) end
function Resident:destroy()
  destroy_collected_residents()
  if self.ptr ~= nil then
    self.ptr = nil
    local rc = destroy_resident_cell(self.cell)
    if rc < 0 then return fail(nil, rc) end
  end
  return true
end
M.Resident = Resident

M.Engine = Engine
return M
