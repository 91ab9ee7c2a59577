-- contract_spec.lua — what bindings/lua/ferry.lua promises beyond the C API:
-- engines and residents dropped without :destroy() are destroyed when
-- collected, descriptors cannot overflow, the library is at least as new as
-- the binding's declarations.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local ferry = require "ferry"

local function threads()
  for line in io.lines("/proc/self/status") do
    local n = line:match("^Threads:%s*(%d+)")
    if n then return tonumber(n) end
  end
end

describe("ferry binding contract", function()
  it("destroys engines dropped without :destroy() when they are collected", function()
    local dev = ferry.malloc_device()
    local threads_before = threads()
    -- more than the 64 engines a process may have live at once
    for i = 1, 100 do
      local e, err = ferry.engine { backend = "host", device = dev, min_offload_bytes = 0 }
      assert(e, "engine " .. i .. ": " .. tostring(err))
      local ptr, owner = dev:new_buffer(4096)
      assert(e:pack(e:desc { bytes = 4096, dtype = "U8" }, ptr, owner))
      e = nil -- dropped with a live handle: the finalizer's destroy releases it
      collectgarbage()
      collectgarbage()
    end
    assert.equal(0, dev.live) -- every packed buffer given back
    assert.is_true(threads() <= threads_before + 8, "threads: " .. threads() .. " after, " ..
      threads_before .. " before")
  end)

  it("destroys a resident buffer dropped without :destroy() when it is collected", function()
    local dev = ferry.malloc_device()
    local e = assert(ferry.engine { backend = "host", device = dev })
    for _ = 1, 3 do
      local r = assert(e:resident(65536))
      r = nil
      collectgarbage()
      collectgarbage()
    end
    assert.equal(0, e:stats().resident_buffers)
    -- destroyed explicitly first, collected later: destroyed once
    local r = assert(e:resident(4096))
    assert(r:destroy())
    r = nil
    collectgarbage()
    assert.equal(0, e:stats().resident_buffers)
    e:destroy()
    e:destroy() -- a second :destroy() is a no-op
    collectgarbage()
  end)

  it("never destroys a collected resident inside a callback that holds the engine lock", function()
    -- A GC step inside decide (which runs under the engine lock) finalizes
    -- a dropped resident of that engine: destroying it there would wait for
    -- the lock forever. Run in a child so that a deadlock fails, not hangs.
    local root = debug.getinfo(1, "S").source:match("^@(.-)tests/lua/[^/]*$") or "./"
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write(([[
package.path = %q .. "bindings/lua/?.lua;" .. package.path
local ffi = require "ffi"
local ferry = require "ferry"
local dev = ferry.malloc_device()
local in_decide = 0
local decide = ffi.cast("ferry_decide_fn", function(_, desc, ctx, out)
  collectgarbage() -- as any allocation in the callback may
  in_decide = in_decide + 1
  out.action = ferry.KEEP
  return 0
end)
local e = assert(ferry.engine { backend = "host", device = dev, decide = decide })
local r = assert(e:resident(4096))
r = nil
local ptr, owner = dev:new_buffer(4096)
local h = assert(e:pack(e:desc { bytes = 4096, dtype = "U8" }, ptr, owner))
assert(in_decide == 1)
assert(e:discard(h))
assert(e:step_end())
assert(e:stats().resident_buffers == 0, "the collected resident was destroyed after the call")
e:destroy()
print("ok")
]]):format(root))
    f:close()
    local p = io.popen("timeout 30 luajit " .. script .. " 2>&1; echo \"exit $?\"")
    local out = p:read("*a")
    p:close()
    os.remove(script)
    assert.matches("ok\nexit 0", out, 1, true)
  end)

  it("refuses a shape of more than FERRY_MAX_DIMS dims instead of writing past it", function()
    local dev = ferry.malloc_device()
    local e = assert(ferry.engine { backend = "host", device = dev })
    local eight = { 1, 1, 1, 1, 1, 1, 1, 4096 }
    local d = e:desc { bytes = 4096, dtype = "U8", shape = eight, layer = 3, path = "m.x" }
    assert.equal(8, d.ndim)
    assert.equal(3, d.layer)
    for _, n in ipairs({ 9, 12, 40 }) do
      local shape = {}
      for i = 1, n do shape[i] = 1 end
      local ok, err = pcall(e.desc, e, { bytes = 4096, dtype = "U8", shape = shape })
      assert.is_false(ok)
      assert.matches(string.format("shape has %d dims, at most %d", n, ferry.MAX_DIMS), err, 1, true)
    end
    e:destroy()
  end)

  it("refuses a libferry older than its declarations", function()
    local major, minor = ferry.VERSION_MAJOR, ferry.VERSION_MINOR
    if minor > 0 then
      local ok, err = pcall(ferry.check_library_version, major * 65536 + (minor - 1) * 256, "/x/l.so")
      assert.is_false(ok)
      assert.matches("older than this binding", err, 1, true)
    end
    ferry.check_library_version(major * 65536 + minor * 256, "x")
    ferry.check_library_version(major * 65536 + (minor + 1) * 256, "x")
  end)
end)
