-- policies_spec.lua — the shipped policies (policies/*.lua) through
-- libferry and the real policy host, on a small Llama-like model.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local H = require "harness"

local LAYERS = 4

-- the model's saved tensors plus what default.lua must leave alone
local function model()
  local specs = H.transformer(LAYERS)
  table.insert(specs, 3, { path = "model.layers.0.self_attn.q_proj", kind = "PARAMETER",
    layer = 0, layer_count = LAYERS })
  table.insert(specs, 4, { path = "model.rotary_emb", kind = "BUFFER" })
  table.insert(specs, 5, { path = "model.layers.0.mlp.liger_swiglu", class = "LigerSwiGLUMLP",
    layer = 0, layer_count = LAYERS })
  table.insert(specs, 6, { path = "model.layers.0.mlp.small", bytes = 512, layer = 0,
    layer_count = LAYERS })
  return specs
end

local function read(path)
  local f = assert(io.open(H.root .. path))
  local s = f:read("*a")
  f:close()
  return s
end

-- expected decisions from a predicate over the specs
local function expect(specs, offload)
  local out = {}
  for i, s in ipairs(specs) do out[i] = offload(s, i) and "offload" or "keep" end
  return out
end

local function is_default_eligible(s)
  return (s.kind == nil or s.kind == "ACTIVATION") and (s.bytes or 4096) >= 1024
    and s.path ~= "lm_head" and s.path ~= "model.norm" and not s.path:lower():find("liger")
    and not (s.class or ""):lower():find("liger")
end

local function host_ram_pct()
  local f = io.open("/proc/meminfo")
  if not f then return nil end
  local m = f:read("*a")
  f:close()
  local total, avail = m:match("MemTotal:%s+(%d+)"), m:match("MemAvailable:%s+(%d+)")
  if not total or not avail then return nil end
  return 100 * (1 - tonumber(avail) / tonumber(total))
end

describe("policies/default.lua", function()
  it("offloads activations >= 1024 bytes, not params, buffers, head or Liger; cached", function()
    local s = H.session { policy_path = "policies/default.lua" }
    local specs = model()
    local want = expect(specs, is_default_eligible)
    assert.same(want, s:step(specs))
    local calls = s:stats().policy_calls
    assert.same(want, s:step(specs))
    local st = s:stats()
    assert.equal(calls, st.policy_calls)
    assert.is_true(st.policy_cache_hits > 0)
    assert.equal(0, st.prefetches)
    assert.equal(0, st.policy_errors)
    s:close()
  end)
end)

describe("policies/layers.lua", function()
  it("offloads the first N layers and prefetches a layer ahead", function()
    local s = H.session { policy_path = "policies/layers.lua", max_fwd_stash = 1 }
    local specs = model()
    local function first_two(x)
      return x.layer ~= nil and x.layer >= 0 and x.layer < 2 and (x.kind == nil)
        and (x.bytes or 4096) >= 1024
    end
    local want = expect(specs, first_two)
    assert.same(want, s:step(specs))
    assert.same(want, s:step(specs))
    local st = s:stats()
    assert.is_true(st.prefetches > 0)
    assert.equal(0, st.policy_errors)
    s:close()
  end)

  it("N is the line users edit", function()
    local src = read("policies/layers.lua"):gsub("local N = 2", "local N = 3")
    local s = H.session {}
    assert(s.e:set_policy { source = src })
    local specs = H.transformer(LAYERS)
    -- N = 3 of 4 layers: layers 0..2 (the last layer is never offloaded)
    assert.same(expect(specs, function(x) return x.layer >= 0 and x.layer < 3 end), s:step(specs))
    s:close()
  end)
end)

describe("policies/host_budget.lua", function()
  local function with_budget(bytes)
    local src = read("policies/host_budget.lua"):gsub("local HOST_BYTES = 16 %* 2%^30",
      "local HOST_BYTES = " .. bytes)
    assert(src:find("HOST_BYTES = " .. bytes, 1, true))
    local s = H.session {}
    assert(s.e:set_policy { source = src })
    return s
  end

  it("with room for everything: every eligible activation but the last layer's", function()
    local s = with_budget(2^30)
    local specs = model()
    local want = expect(specs, function(x)
      return is_default_eligible(x) and x.layer ~= LAYERS - 1 or x.path == "lm_head"
        or x.path == "model.norm"
    end)
    assert.same(want, s:step(specs))
    assert.same(want, s:step(specs))
    local st = s:stats()
    assert.equal(0, st.policy_errors)
    s:close()
  end)

  it("a small budget takes the largest tensors first, then from the cache", function()
    -- lm_head's input (16 KiB) first, then the earliest-packed 4 KiB tensors
    -- while they fit: 16 KiB + 2 x 4 KiB = the embedding and layer 0's norm
    local s = with_budget(16384 + 2 * 4096)
    local specs = model()
    s:step(specs)
    local want = expect(specs, function(x)
      return x.path == "lm_head" or x.path == "model.embed_tokens"
        or x.path == "model.layers.0.input_layernorm"
    end)
    assert.same(want, s:step(specs))
    local hits = s:stats().policy_cache_hits
    assert.same(want, s:step(specs))
    assert.is_true(s:stats().policy_cache_hits - hits >= #specs - 2)
    s:close()
  end)
end)

describe("policies/fraction.lua", function()
  it("offloads the first half of the selected module kinds, last layer kept", function()
    local s = H.session { policy_path = "policies/fraction.lua" }
    local specs = model()
    local selected = {}
    for i, x in ipairs(specs) do
      local own = x.path:match("[^.]+$")
      selected[i] = x.kind == nil and (x.bytes or 4096) >= 1024 and x.layer ~= nil
        and x.layer >= 0 and x.layer < LAYERS - 1
        and (own == "self_attn" or own == "o_proj" or own == "up_proj")
    end
    local n = 0
    for _, v in ipairs(selected) do if v then n = n + 1 end end
    assert.equal(9, n)
    -- first step: every other eligible tensor (ceil(k/2) of the first k)
    local k = 0
    local want1 = expect(specs, function(_, i)
      if not selected[i] then return false end
      k = k + 1
      return k % 2 == 1
    end)
    assert.same(want1, s:step(specs))
    -- later steps: the first ceil(0.5 * 9) = 5
    k = 0
    local want2 = expect(specs, function(_, i)
      if not selected[i] then return false end
      k = k + 1
      return k <= 5
    end)
    assert.same(want2, s:step(specs))
    assert.equal(0, s:stats().policy_errors)
    s:close()
  end)
end)

describe("policies/ramcap.lua", function()
  it("keeps everything at or above the RAM cap, is default.lua below it", function()
    local src = read("policies/ramcap.lua")
    local specs = model()
    local s = H.session {}
    assert(s.e:set_policy { source = src:gsub("local RAM_PCT = 60", "local RAM_PCT = 0") })
    assert.same(expect(specs, function() return false end), s:step(specs))
    assert(s.e:set_policy { source = src:gsub("local RAM_PCT = 60", "local RAM_PCT = 100") })
    assert.same(expect(specs, is_default_eligible), s:step(specs))
    s:close()
  end)

  it("as shipped, caps at 60% of the host's RAM", function()
    local pct = host_ram_pct()
    if not pct or math.abs(pct - 60) < 5 then
      pending("host RAM use too close to 60% to tell")
      return
    end
    local s = H.session { policy_path = "policies/ramcap.lua" }
    local specs = model()
    local want = expect(specs, function(x) return pct < 60 and is_default_eligible(x) end)
    assert.same(want, s:step(specs))
    s:close()
  end)
end)

describe("policies/budget.lua", function()
  -- the model plus a loss packed last, as a language model saves it
  local function with_loss()
    local specs = model()
    specs[#specs + 1] = { path = "loss", class = "CrossEntropyLoss", bytes = 4096 * 16 }
    return specs
  end
  local function is_budget_eligible(s)
    return (s.kind == nil or s.kind == "ACTIVATION") and (s.bytes or 4096) >= 1024
      and s.path ~= "loss" and not s.path:lower():find("liger")
      and not (s.class or ""):lower():find("liger")
  end

  it("offloads every activation but the loss, the head's included, and prefetches", function()
    local s = H.session { policy_path = "policies/budget.lua" }
    local specs = with_loss()
    local want = expect(specs, is_budget_eligible)
    assert.same(want, s:step(specs))
    local before = s:stats().prefetches
    assert.same(want, s:step(specs))
    local st = s:stats()
    assert.is_true(st.prefetches - before > LAYERS)
    assert.equal(0, st.policy_errors)
    s:close()
  end)

  it("holds less on device at the peak than keeping everything", function()
    -- 16 layers: with no compute between packs the stash (FWD_STASH = 16
    -- buffers in flight) holds a 4-layer model's tensors nearly whole
    local specs = H.transformer(16)
    specs[#specs + 1] = { path = "loss", class = "CrossEntropyLoss", bytes = 4096 * 16 }
    local s = H.session { policy_path = "policies/budget.lua" }
    s:step(specs)
    s:step(specs)
    local budget_peak = s:stats().device_bytes_held_peak
    s:close()
    local none = H.session {}
    none:step(specs)
    local all_peak = none:stats().device_bytes_held_peak
    none:close()
    assert.is_true(budget_peak < all_peak / 2)
  end)
end)
