-- resident_spec.lua — resident buffers through bindings/lua/ferry.lua.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local ffi = require "ffi"
local ferry = require "ferry"

local function same(a, b, n, from)
  a, b = ffi.cast("uint8_t *", a), ffi.cast("uint8_t *", b)
  for i = from or 0, n - 1 do
    if a[i] ~= b[i] then return false end
  end
  return true
end

describe("ferry resident buffers", function()
  it("round-trip bytes between a device buffer and the arena, counted in stats", function()
    local dev = ferry.malloc_device()
    local e = assert(ferry.engine { backend = "host", device = dev })
    local n = 4099
    local r = assert(e:resident(n))
    assert.equal(n, r:bytes())
    local src = dev:new_buffer(n)
    local dst = dev:new_buffer(n, function() return 0 end)
    assert(r:to_host(src, nil))
    assert(r:wait())
    assert.is_true(same(r:host_ptr(), src, n))
    r:host_ptr()[0] = 42 -- the host side is the truth between uses
    assert(r:to_device(dst, nil))
    assert(r:wait())
    assert.equal(42, ffi.cast("uint8_t *", dst)[0])
    assert.is_true(same(dst, src, n, 1))
    local st = e:stats()
    assert.equal(1, st.resident_buffers)
    assert.equal(n, st.resident_bytes)
    assert.equal(1, st.resident_to_host)
    assert.equal(1, st.resident_to_device)
    assert(r:destroy())
    assert.equal(0, e:stats().resident_buffers)
    dev:release(src)
    dev:release(dst)
    e:destroy()
    dev:free_callbacks()
  end)

  it("refuses more than the cap with the cap in the message", function()
    local dev = ferry.malloc_device()
    local e = assert(ferry.engine { backend = "host", device = dev, host_cap_bytes = 4 * 1048576 })
    local r, err, code = e:resident(64 * 1048576)
    assert.is_nil(r)
    assert.equal(ferry.errors.ECAP, code)
    assert.matches("ferry_resident_create", err, 1, true)
    e:destroy()
    dev:free_callbacks()
  end)
end)
