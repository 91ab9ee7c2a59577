-- rules_engine_spec.lua — every rule of ferry.rules through libferry: the
-- policy is loaded by the real policy host (ferry_set_policy), tensors are
-- packed through the engine and the decisions read from its stats.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local H = require "harness"

local function session(rules, opts)
  local s = H.session(opts)
  local ok, err = s.e:set_policy { source = "local R = require 'ferry.rules'\n" ..
    "return R.policy { " .. rules .. " }" }
  assert(ok, err)
  return s
end

-- decisions for specs, one step
local function decide(rules, specs, opts)
  local s = session(rules, opts)
  local d = s:step(specs)
  local st = s:stats()
  s:close()
  return d, st
end

local K, O = "keep", "offload"

describe("rules through the engine", function()
  it("min_bytes: the knob keeps small tensors before Lua is called", function()
    local d, st = decide("R.min_bytes(8192)", { { bytes = 8191 }, { bytes = 8192 }, { bytes = 2048 } })
    assert.same({ K, O, K }, d)
    assert.equal(1, st.policy_calls + st.policy_cache_hits)
    assert.equal(0, st.policy_errors)
  end)

  it("min_elements", function()
    local d = decide("R.min_elements(2048)", { { bytes = 4096, dtype = "BF16" },
      { bytes = 4096, dtype = "F32" } })
    assert.same({ O, K }, d)
  end)

  it("kinds, exclude_kinds, activations_only, exclude_params_and_buffers", function()
    local specs = { { kind = "ACTIVATION" }, { kind = "PARAMETER" }, { kind = "BUFFER" },
      { kind = "OTHER" } }
    assert.same({ O, K, K, O }, (decide("R.exclude_params_and_buffers()", specs)))
    assert.same({ O, K, K, K }, (decide("R.activations_only()", specs)))
    assert.same({ K, O, K, K }, (decide("R.kinds(ferry.PARAMETER)", specs)))
    assert.same({ O, O, O, K }, (decide("R.exclude_kinds(ferry.OTHER)", specs)))
  end)

  it("dtypes and exclude_dtypes use the header's dtype numbers", function()
    local specs = { { dtype = "F32" }, { dtype = "BF16" }, { dtype = "BOOL" } }
    assert.same({ K, O, O }, (decide("R.exclude_dtypes(ferry.DTYPE_F32)", specs)))
    assert.same({ K, K, O }, (decide("R.dtypes(ferry.DTYPE_BOOL)", specs)))
  end)

  it("exclude_modules(HEAD, LIGER) and only_modules", function()
    local specs = { { path = "lm_head" }, { path = "model.norm" },
      { path = "model.layers.0.mlp.liger_fused", layer = 0 },
      { path = "model.layers.0.mlp", class = "LigerSwiGLUMLP", layer = 0 },
      { path = "model.layers.0.self_attn.q_proj", layer = 0 },
      { path = "model.layers.0.output", layer = 0 } }
    assert.same({ K, K, O, O, O, O },
      (decide("R.exclude_modules(R.HEAD)", specs)))
    assert.same({ O, O, K, K, O, O },
      (decide("R.exclude_modules(R.LIGER)", specs)))
    assert.same({ K, K, K, K, O, K },
      (decide("R.only_modules(R.QKV)", specs)))
  end)

  it("first_layers and keep_last_layers", function()
    local specs = {}
    for l = -1, 3 do specs[#specs + 1] = { path = "m.layers." .. l, layer = l, layer_count = 4 } end
    assert.same({ K, O, O, K, K }, (decide("R.first_layers(2)", specs)))
    assert.same({ O, O, O, O, K }, (decide("R.keep_last_layers(1)", specs)))
    assert.same({ K, O, O, O, K }, (decide("R.first_layers(9), R.keep_last_layers(1)", specs)))
  end)

  it("forward_only keeps recompute-phase tensors", function()
    assert.same({ O, K }, (decide("R.forward_only()", { { phase = "FORWARD" },
      { phase = "RECOMPUTE" } })))
  end)

  it("when: a user predicate", function()
    assert.same({ K, O }, (decide("R.when(function(t) return t.ndim > 1 end)",
      { { bytes = 4096 }, { bytes = 4096, shape = { 32, 64 } } })))
  end)

  it("ram_cap reads the host's RAM use", function()
    local specs = { {}, {} }
    assert.same({ K, K }, (decide("R.ram_cap(0)", specs)))
    assert.same({ O, O }, (decide("R.ram_cap(100)", specs)))
  end)

  it("in_flight_cap: one copy at a time on a slow link", function()
    local slow = { link = { d2h_bytes_per_s = 50e3, h2d_bytes_per_s = 1e9 } }
    assert.same({ O, K }, (decide("R.in_flight_cap(4096)", { {}, {} }, slow)))
    assert.same({ O, O }, (decide("R.in_flight_cap(8192)", { {}, {} }, slow)))
  end)

  it("arena_cap leaves headroom under the pinned cap", function()
    local specs = { {}, {}, {} }
    assert.same({ O, O, K }, (decide("R.arena_cap(50)", specs, { host_cap_bytes = 16384 })))
  end)

  it("fraction: spread in the first step, the first ceil(f*n) after", function()
    local s = session("R.fraction(0.5)")
    local specs = {}
    for i = 1, 6 do specs[i] = { path = "m.layers." .. i } end
    assert.same({ O, K, O, K, O, K }, s:step(specs))
    assert.same({ O, O, O, K, K, K }, s:step(specs))
    s:close()
  end)

  it("budget keeps the last-packed tensors that fit", function()
    local s = session("R.budget { bytes = 8192 }")
    local specs = {}
    for i = 1, 6 do specs[i] = { path = "m.t" .. i } end
    assert.same({ O, O, O, O, O, O }, s:step(specs))
    assert.same({ O, O, O, O, K, K }, s:step(specs))
    s:close()
  end)

  it("site rules are cached: the second step never calls Lua", function()
    local s = session("R.exclude_modules(R.HEAD), R.min_bytes(1024)")
    local specs = { { path = "lm_head" }, { path = "m.layers.0", layer = 0 } }
    assert.same({ K, O }, s:step(specs))
    local calls = s:stats().policy_calls
    assert.same({ K, O }, s:step(specs))
    local st = s:stats()
    assert.equal(calls, st.policy_calls)
    assert.equal(2, st.policy_cache_hits)
    s:close()
  end)

  it("selectors: Lua decides until two steps repeat, then the engine caches; a new site thaws",
    function()
    local s = session("R.fraction(0.5)")
    local specs = {}
    for i = 1, 4 do specs[i] = { path = "m.layers." .. (i - 1) .. ".mlp", layer = i - 1 } end
    assert.same({ O, K, O, K }, s:step(specs)) -- the first step spreads
    assert.same({ O, O, K, K }, s:step(specs)) -- then the first half
    local calls = s:stats().policy_calls
    assert.same({ O, O, K, K }, s:step(specs)) -- repeats the second: Lua decides
    assert.equal(calls + 4, s:stats().policy_calls)
    calls = s:stats().policy_calls
    assert.same({ O, O, K, K }, s:step(specs)) -- frozen: Lua answers from its table
    assert.equal(calls + 4, s:stats().policy_calls)
    calls = s:stats().policy_calls
    assert.same({ O, O, K, K }, s:step(specs)) -- and the engine caches those answers
    assert.equal(calls, s:stats().policy_calls)
    -- a fifth site: the cache is forgotten and the rule counts again
    local grown = { specs[1], specs[2], specs[3], specs[4], { path = "m.head", layer = -1 } }
    s:step(grown)
    assert.is_true(s:stats().policy_calls > calls)
    -- that step was counted only from the new site on: the next one learns nothing from
    -- it (n is still 4), and the one after counts the five
    assert.same({ O, O, K, K, K }, s:step(grown))
    assert.same({ O, O, O, K, K }, s:step(grown))
    s:close()
  end)

  it("reload: on_use never prefetches, prefetch(d) does", function()
    local specs = {}
    for i = 1, 8 do specs[i] = { path = "m.t" .. i } end
    local _, st = decide("reload = R.on_use()", specs, { max_fwd_stash = 1 })
    assert.equal(0, st.prefetches)
    _, st = decide("reload = R.prefetch(3)", specs, { max_fwd_stash = 1 })
    assert.is_true(st.prefetches > 0)
  end)

  it("prefetch_layers learns the distance in the first step", function()
    local s = session("reload = R.prefetch_layers(1)", { max_fwd_stash = 1 })
    local specs = {}
    for l = 0, 3 do
      for j = 1, 3 do specs[#specs + 1] = { path = "m.layers." .. l .. ".t" .. j, layer = l } end
    end
    s:step(specs)
    s:step(specs)
    local st = s:stats()
    assert.is_true(st.prefetches > 0)
    s:close()
  end)

  it("max_stash sets the engine's forward stash", function()
    local specs = {}
    for i = 1, 6 do specs[i] = { path = "m.t" .. i } end
    local _, small = decide("R.max_stash(1)", specs)
    local _, large = decide("R.max_stash(6)", specs)
    assert.is_true(large.stash_hits > small.stash_hits)
    assert.equal(6, large.stash_hits)
  end)

  it("max_stash_bytes bounds the forward stash by bytes too", function()
    local specs = {}
    for i = 1, 6 do specs[i] = { path = "m.t" .. i, bytes = 4096 } end
    local _, by_count = decide("R.max_stash(6)", specs)
    local _, by_bytes = decide("R.max_stash(6), R.max_stash_bytes(8192)", specs)
    assert.equal(6, by_count.stash_hits)
    assert.equal(2, by_bytes.stash_hits)
  end)
end)
