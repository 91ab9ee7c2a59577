-- cdef_spec.lua — the binding's FFI declarations are what ferry.h says.
local root = dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")

describe("bindings/lua/ferry_cdef.lua", function()
  it("is what gen_cdef.sh generates from engine/include/ferry.h", function()
    local p = io.popen("sh " .. root .. "bindings/lua/gen_cdef.sh --check 2>&1; echo \"rc=$?\"")
    local out = p:read("*a")
    p:close()
    assert.matches("rc=0\n$", out)
  end)

  it("declares every function the header exports", function()
    local f = assert(io.open(root .. "engine/include/ferry.h"))
    local header = f:read("*a")
    f:close()
    local cdef = dofile(root .. "bindings/lua/ferry_cdef.lua").cdef
    local n = 0
    for name in header:gmatch("FERRY_API[^;]-%f[%w_](ferry_[%w_]+)%s*%(") do
      n = n + 1
      assert.truthy(cdef:find("%f[%w_]" .. name .. "%("), name .. " missing from the cdef")
    end
    assert.is_true(n > 20)
  end)
end)
