-- binding_spec.lua — bindings/lua/ferry.lua over the built libferry.
local root = dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local ffi = require "ffi"
local ferry = require "ferry"
local H = require "harness"

describe("ferry binding", function()
  it("reports the library's version, matching the header", function()
    local hex, s = ferry.version()
    assert.equal(ferry.VERSION_MAJOR * 65536 + ferry.VERSION_MINOR * 256 + ferry.VERSION_PATCH, hex)
    assert.equal(string.format("%d.%d.%d", ferry.VERSION_MAJOR, ferry.VERSION_MINOR,
      ferry.VERSION_PATCH), s:match("^%d+%.%d+%.%d+"))
  end)

  it("refuses a libferry of another major version, naming both", function()
    local hex = (ferry.VERSION_MAJOR + 1) * 65536 + 2 * 256 + 3
    local ok, err = pcall(ferry.check_library_version, hex, "/x/libferry.so")
    assert.is_false(ok)
    assert.matches(string.format("libferry at '/x/libferry.so' is version %d.2.3", ferry.VERSION_MAJOR + 1),
      err, 1, true)
    assert.matches(string.format("major version %d (%d.%d.%d)", ferry.VERSION_MAJOR,
      ferry.VERSION_MAJOR, ferry.VERSION_MINOR, ferry.VERSION_PATCH), err, 1, true)
    -- the same major with another minor and patch is accepted
    ferry.check_library_version(ferry.VERSION_MAJOR * 65536 + 255 * 256 + 255, "x")
  end)

  it("names errors from the header's one list", function()
    assert.equal(-1, ferry.errors.EINVAL)
    assert.equal("invalid argument", ferry.strerror(ferry.errors.EINVAL))
    assert.equal("FERRY_EHANDLE", ferry.err_name(ferry.errors.EHANDLE))
  end)

  it("turns a failed engine creation into nil, message, code", function()
    local e, err, code = ferry.engine { backend = "host" } -- no device callbacks
    assert.is_nil(e)
    assert.equal(ferry.errors.EINVAL, code)
    assert.matches("invalid argument: config.device_alloc is required", err, 1, true)
    local dev = ferry.malloc_device()
    e, err, code = ferry.engine { backend = 7, device = dev }
    assert.is_nil(e)
    assert.equal(ferry.errors.EINVAL, code)
    assert.matches("config.backend 7 is not a ferry_backend_kind", err, 1, true)
    dev:free_callbacks()
  end)

  it("rejects unknown enum names in its own tables", function()
    local dev = ferry.malloc_device()
    assert.has_error(function() ferry.engine { backend = "tpu", device = dev } end,
      "ferry: unknown backend 'tpu'")
    dev:free_callbacks()
  end)

  it("creates a host engine, interns strings, gives stats as numbers", function()
    local s = H.session {}
    local e = s.e
    assert.equal("host", e:backend_name())
    assert.is_string(e:arena_name())
    local a, b = e:intern("model.layers.0"), e:intern("model.layers.0")
    assert.equal(ffi.cast("uintptr_t", a), ffi.cast("uintptr_t", b))
    assert.equal("model.layers.0", ffi.string(a))
    local st = e:stats()
    assert.equal("number", type(st.tensors_packed))
    assert.equal(0, st.tensors_packed)
    assert.is_not_nil(st.policy_disabled)
    s:close()
  end)

  it("packs and unpacks bit-identical with a Lua decide callback offloading all", function()
    local calls = 0
    local decide = ffi.cast("ferry_decide_fn", function(_, desc, ctx, out)
      calls = calls + 1
      out.action = ferry.OFFLOAD
      out.reload = ferry.ON_USE
      out.prefetch_distance = -1
      out.cacheable = 0
      return 0
    end)
    local s = H.session { decide = decide, max_fwd_stash = 1 }
    for i = 1, 6 do
      assert.equal("offload", s:pack { bytes = 4096 + i, path = "model.layers." .. i })
    end
    s:finish_step() -- checks every byte
    local st = s:stats()
    assert.equal(6, st.tensors_offloaded)
    assert.equal(6, st.tensors_unpacked)
    assert.equal(6, calls)
    assert.equal(1, st.steps)
    assert.equal(0, s.dev.live)
    s:close()
    decide:free()
  end)

  it("writes a Chrome trace of the run when given chrome_trace_path", function()
    local path = os.tmpname()
    local decide = ffi.cast("ferry_decide_fn", function(_, desc, ctx, out)
      out.action = ferry.OFFLOAD
      out.reload = ferry.ON_USE
      out.prefetch_distance = -1
      out.cacheable = 0
      return 0
    end)
    local s = H.session { decide = decide, max_fwd_stash = 1, chrome_trace_path = path }
    for i = 1, 6 do s:pack { bytes = 4096 + i, path = "model.layers." .. i } end
    s:finish_step()
    s:close()
    decide:free()
    local f = assert(io.open(path))
    local text = f:read("*a")
    f:close()
    os.remove(path)
    local function count(pat) return select(2, text:gsub(pat, "")) end
    assert.truthy(text:match('^{"displayTimeUnit":"ms","traceEvents":%['))
    assert.truthy(text:match("%]}\n$"))
    assert.equal(6, count('"cat":"offload"'))
    assert.equal(5, count('"cat":"reload"')) -- the last one packed is a stash hit
    assert.equal(5, count('"ph":"s"'))
    assert.equal(5, count('"ph":"f"'))
  end)

  it("turns handle errors into nil, message, code with the engine's detail", function()
    local s = H.session {}
    local e = s.e
    local ptr, owner = s.dev:new_buffer(2048)
    local h = assert(e:pack(e:desc { bytes = 2048 }, ptr, owner))
    assert.is_true(e:discard(h))
    local ok, err, code = e:discard(h)
    assert.is_nil(ok)
    assert.equal(ferry.errors.EHANDLE, code)
    assert.matches("unknown, stale or already unpacked handle: ferry_discard", err, 1, true)
    local p2, err2 = e:unpack(h)
    assert.is_nil(p2)
    assert.matches("ferry_unpack", err2, 1, true)
    assert.is_true(e:step_end())
    s:close()
  end)

  it("reports handles left at step end as ELEAK and keeps them valid", function()
    local s = H.session {}
    local e = s.e
    local ptr, owner = s.dev:new_buffer(1024)
    local h = assert(e:pack(e:desc { bytes = 1024 }, ptr, owner))
    local ok, err, code = e:step_end()
    assert.is_nil(ok)
    assert.equal(ferry.errors.ELEAK, code)
    assert.is_string(err)
    local p, o = assert(e:unpack(h))
    s.dev:release(o)
    s:close()
  end)

  it("reports a broken policy with nil and its file:line, keeping the engine usable", function()
    local s = H.session {}
    local ok, err, code = s.e:set_policy { source = "return {" }
    assert.is_nil(ok)
    assert.equal(ferry.errors.EPOLICY, code)
    assert.is_string(err)
    assert.equal("keep", s:pack { bytes = 4096 })
    s:finish_step()
    s:close()
  end)
end)
