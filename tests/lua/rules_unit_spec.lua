-- rules_unit_spec.lua — the rules library's logic in plain LuaJIT, with
-- tests/lua/helpers/host_double.lua standing in for the C policy host (a
-- test double: descriptor and context as FFI cdata, no sandbox). The same
-- rules are driven through libferry and the real host in
-- rules_engine_spec.lua and policies_spec.lua.
dofile((debug.getinfo(1, "S").source:match("^@(.-)[^/]*$") or "") .. "setup.lua")
local D = require "host_double"

local KEEP, OFFLOAD, ON_USE, PREFETCH = 0, 1, 0, 1

local function policy(src)
  return D.load("local R = require 'ferry.rules'\n" .. src, true)
end

-- decide on a descriptor spec; returns action, reload, distance, cacheable
local function run(p, spec, ctx)
  return p.decide(D.desc(spec), ctx or D.ctx { step = 0 })
end

describe("ferry.rules", function()
  it("builds an API v1 policy table", function()
    local p = policy [[return R.policy { name = "x", R.min_bytes(10) }]]
    assert.equal(1, p.api)
    assert.equal("x", p.name)
    assert.equal("function", type(p.decide))
    assert.same({ min_offload_bytes = 10 }, p.knobs)
    assert.same({ "keep_recompute()", "min_bytes(10)" }, p.rules)
  end)

  it("min_bytes keeps smaller tensors, cached, and sets the engine knob", function()
    local p = policy [[return R.policy { R.min_bytes(1024) }]]
    local a, r, d, c = run(p, { bytes = 1023 })
    assert.same({ KEEP, ON_USE, nil, true }, { a, r, d, c })
    a, r, d, c = run(p, { bytes = 1024 })
    assert.same({ OFFLOAD, ON_USE, nil, true }, { a, r, d, c })
  end)

  it("min_elements counts the shape's elements", function()
    local p = policy [[return R.policy { R.min_elements(100) }]]
    assert.equal(KEEP, (run(p, { bytes = 4096, shape = { 9, 11 } })))
    assert.equal(OFFLOAD, (run(p, { bytes = 4096, shape = { 10, 10 } })))
  end)

  it("kind rules: exclude params and buffers, activations only", function()
    local p = policy [[return R.policy { R.exclude_params_and_buffers() }]]
    assert.equal(OFFLOAD, (run(p, { kind = 0 })))
    assert.equal(KEEP, (run(p, { kind = 1 })))
    assert.equal(KEEP, (run(p, { kind = 2 })))
    assert.equal(OFFLOAD, (run(p, { kind = 3 })))
    p = policy [[return R.policy { R.activations_only() }]]
    assert.equal(OFFLOAD, (run(p, { kind = 0 })))
    assert.equal(KEEP, (run(p, { kind = 3 })))
    p = policy [[return R.policy { R.kinds(ferry.OTHER) }]]
    assert.equal(KEEP, (run(p, { kind = 0 })))
    assert.equal(OFFLOAD, (run(p, { kind = 3 })))
  end)

  it("dtype rules", function()
    local p = policy [[return R.policy { R.exclude_dtypes(ferry.DTYPE_F32) }]]
    assert.equal(KEEP, (run(p, { dtype = 1 })))
    assert.equal(OFFLOAD, (run(p, { dtype = 3 })))
    p = policy [[return R.policy { R.dtypes(ferry.DTYPE_F32) }]]
    assert.equal(OFFLOAD, (run(p, { dtype = 1 })))
    assert.equal(KEEP, (run(p, { dtype = 3 })))
  end)

  it("HEAD matches heads and final norms outside the layers only", function()
    local p = policy [[return R.policy { R.exclude_modules(R.HEAD) }]]
    for _, path in ipairs({ "lm_head", "output", "model.norm", "transformer.ln_f",
      "base_model.model.lm_head", "lm_head.lora_A.default", "model.decoder.final_layer_norm",
      "head", "decoder.output.linear" }) do
      local a, _, _, c = run(p, { path = path })
      assert.equal(KEEP, a, path)
      assert.is_true(c, path)
    end
    for _, path in ipairs({ "model.layers.3.output", "encoder.layer.0.attention.output.dense",
      "model.layers.0.norm", "model.layers.1.self_attn.head", "model.embed_tokens" }) do
      assert.equal(OFFLOAD, (run(p, { path = path })), path)
    end
  end)

  it("LIGER matches name or class, any case", function()
    local p = policy [[return R.policy { R.exclude_modules(R.LIGER) }]]
    assert.equal(KEEP, (run(p, { path = "model.layers.0.liger_swiglu" })))
    assert.equal(KEEP, (run(p, { path = "model.layers.0.mlp", class = "LigerSwiGLUMLP" })))
    assert.equal(KEEP, (run(p, { path = "", class = "LIGERRMSNorm" })))
    assert.equal(OFFLOAD, (run(p, { path = "model.layers.1.mlp", class = "LlamaMLP" })))
    assert.equal(OFFLOAD, (run(p, { path = "", class = "Linear" })))
  end)

  it("matcher fields: name, under, top, class, contains, pattern, plain string", function()
    local function only(m, path, class)
      local p = policy("return R.policy { R.only_modules(" .. m .. ") }")
      return (run(p, { path = path, class = class or "" })) == OFFLOAD
    end
    assert.is_true(only([[{ name = "attn.c_proj" }]], "h.0.attn.c_proj"))
    assert.is_false(only([[{ name = "attn.c_proj" }]], "h.0.mlp.c_proj"))
    assert.is_false(only([[{ name = "q_proj" }]], "h.0.attn.q_proj.lora_A"))
    assert.is_true(only([[{ under = "mlp" }]], "model.layers.0.mlp.up_proj"))
    assert.is_false(only([[{ under = "mlp" }]], "model.layers.0.mlp_gate"))
    assert.is_true(only([["mlp"]], "model.layers.0.mlp"))
    assert.is_true(only([[{ class = "Linear" }]], "x", "Linear"))
    assert.is_false(only([[{ class = "Linear" }]], "x", "LinearX"))
    assert.is_true(only([[{ contains = "ATTN" }]], "h.0.self_attn"))
    assert.is_true(only([[{ pattern = "%.layers%.[01]%." }]], "m.layers.1.mlp"))
    assert.is_false(only([[{ pattern = "%.layers%.[01]%." }]], "m.layers.2.mlp"))
    assert.is_true(only([[{ top = "embed" }]], "model.embed"))
    assert.is_false(only([[{ top = "embed" }]], "model.layers.0.embed"))
  end)

  it("module kinds for Megatron's --offload-modules", function()
    local p = policy [[return R.policy { R.only_modules(R.QKV, R.CORE_ATTN, R.ATTN_PROJ) }]]
    local yes = { "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn",
      "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.self_attention.core_attention",
      "decoder.layers.1.self_attention.linear_proj", "transformer.h.0.attn.c_proj" }
    local no = { "model.layers.0.mlp.up_proj", "transformer.h.0.mlp.c_proj",
      "model.layers.0.input_layernorm" }
    for _, path in ipairs(yes) do assert.equal(OFFLOAD, (run(p, { path = path })), path) end
    for _, path in ipairs(no) do assert.equal(KEEP, (run(p, { path = path })), path) end
    p = policy [[return R.policy { R.only_modules(R.FC1, R.FC2, R.ATTN_NORM, R.MLP_NORM) }]]
    for _, path in ipairs({ "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj",
      "decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2", "h.0.mlp.c_proj",
      "model.layers.0.input_layernorm", "decoder.layers.0.pre_mlp_layernorm" }) do
      assert.equal(OFFLOAD, (run(p, { path = path })), path)
    end
    p = policy [[return R.policy { R.only_modules(R.EXPERT_FC1, R.MOE_ACT) }]]
    assert.equal(OFFLOAD, (run(p, { path = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1" })))
    assert.equal(OFFLOAD, (run(p, { path = "model.layers.0.mlp.experts.7.act_fn" })))
    assert.equal(KEEP, (run(p, { path = "model.layers.0.mlp.up_proj" })))
  end)

  it("first_layers and keep_last_layers; layer keeps cached only with a path", function()
    local p = policy [[return R.policy { R.first_layers(2), R.keep_last_layers(1) }]]
    local function d(layer, count, path)
      local a, _, _, c = run(p, { layer = layer, layer_count = count, path = path })
      return a, c
    end
    assert.same({ OFFLOAD, true }, { d(0, 4, "m.layers.0") })
    assert.same({ OFFLOAD, true }, { d(1, 4, "m.layers.1") })
    assert.same({ KEEP, true }, { d(2, 4, "m.layers.2") })
    assert.same({ KEEP, true }, { d(-1, 4, "m.embed") })
    assert.same({ KEEP, false }, { d(2, 4, "") })
    assert.same({ OFFLOAD, false }, { d(0, 4, "") })
    -- first_layers(2) of 2 layers: the last one is kept
    assert.same({ KEEP, true }, { d(1, 2, "m.layers.1") })
    -- layer count unknown: keep_last_layers does nothing
    assert.same({ OFFLOAD, true }, { d(1, 0, "m.layers.1") })
  end)

  it("forward_only keeps recompute-phase tensors, cached per site and phase", function()
    local p = policy [[return R.policy { R.forward_only(), recompute = "decide" }]]
    local a, _, _, c = run(p, { phase = 1 })
    assert.same({ KEEP, true }, { a, c })
    a, _, _, c = run(p, { phase = 0 })
    assert.same({ OFFLOAD, true }, { a, c })
  end)

  it("a policy keeps recompute packs unless recompute = \"decide\"", function()
    local p = policy [[return R.policy { name = "all" }]]
    local a, _, _, c = run(p, { phase = 1 })
    assert.same({ KEEP, true }, { a, c })
    a = run(p, { phase = 0 })
    assert.equal(OFFLOAD, a)
    local action, rule = p.explain(D.desc { phase = 1 }, D.ctx { step = 0 })
    assert.same({ KEEP, "keep_recompute()" }, { action, rule })
    p = policy [[return R.policy { name = "all", recompute = "decide" }]]
    assert.equal(OFFLOAD, (run(p, { phase = 1 })))
    assert.has_error(function() policy [[return R.policy { recompute = "offload" }]] end,
      'ferry.rules.policy: recompute must be "keep" (the default) or "decide", got "offload"')
  end)

  it("when runs a user predicate; site = true allows caching", function()
    local p = policy [[return R.policy { R.when(function(t) return t.ndim == 2 end, { site = true }) }]]
    assert.same({ OFFLOAD, true }, { (run(p, { shape = { 4, 4 } })), select(4, run(p, { shape = { 4, 4 } })) })
    assert.same({ KEEP, true }, { (run(p, { shape = { 4 } })), select(4, run(p, { shape = { 4 } })) })
  end)

  it("guards read the context; only ram_cap (sampled once a step) is cached", function()
    local p = policy [[return R.policy { R.ram_cap(60) }]]
    local a, _, _, c = run(p, {}, D.ctx { host_ram_used_pct = 59.9 })
    assert.same({ OFFLOAD, true }, { a, c })
    assert.equal(KEEP, (run(p, {}, D.ctx { host_ram_used_pct = 60 })))
    p = policy [[return R.policy { R.in_flight_cap(10000) }]]
    assert.equal(OFFLOAD, (run(p, { bytes = 50000 }, D.ctx { bytes_in_flight = 0 })))
    assert.equal(OFFLOAD, (run(p, { bytes = 4000 }, D.ctx { bytes_in_flight = 6000 })))
    assert.equal(KEEP, (run(p, { bytes = 4001 }, D.ctx { bytes_in_flight = 6000 })))
    p = policy [[return R.policy { R.arena_cap(50) }]]
    assert.equal(OFFLOAD, (run(p, { bytes = 4096 }, D.ctx { arena_cap = 0, arena_in_use = 1e9 })))
    assert.equal(OFFLOAD, (run(p, { bytes = 1000 }, D.ctx { arena_cap = 10000, arena_in_use = 4000 })))
    assert.equal(KEEP, (run(p, { bytes = 1001 }, D.ctx { arena_cap = 10000, arena_in_use = 4000 })))
  end)

  it("fraction spread: exactly ceil(f*k) of every prefix of k, evenly", function()
    for _, f in ipairs({ 0, 0.25, 1 / 3, 0.5, 0.7, 1 }) do
      local p = policy("return R.policy { R.fraction(" .. f .. ", 'spread') }")
      local ctx = D.ctx { step = 0 }
      local n = 0
      for k = 1, 30 do
        local a, _, _, c = p.decide(D.desc {}, ctx)
        assert.is_false(c)
        if a == OFFLOAD then n = n + 1 end
        assert.equal(math.ceil(f * k - 1e-9), n, "f=" .. f .. " k=" .. k)
      end
    end
  end)

  it("fraction first: the first ceil(f*n) of each step, n from the previous step", function()
    local p = policy [[return R.policy { R.min_bytes(1), R.fraction(0.3) }]]
    local ctx = D.ctx { step = 0 }
    local first = {}
    for k = 1, 10 do first[k] = p.decide(D.desc {}, ctx) end
    -- first step spreads: ceil(0.3 k) grows at k = 1, 4, 7
    assert.same({ 1, 0, 0, 1, 0, 0, 1, 0, 0, 0 }, first)
    ctx.step = 1
    local second = {}
    for k = 1, 10 do second[k] = p.decide(D.desc {}, ctx) end
    assert.same({ 1, 1, 1, 0, 0, 0, 0, 0, 0, 0 }, second)
    -- filtered tensors are not counted
    ctx.step = 2
    assert.equal(KEEP, (p.decide(D.desc { bytes = 0 }, ctx)))
    assert.equal(OFFLOAD, (p.decide(D.desc {}, ctx)))
  end)

  it("budget: first step offloads all, then keeps the last-packed tensors that fit", function()
    local p = policy [[return R.policy { R.budget { layers = 1 } }]]
    local function step(s, n_layers, per_layer)
      local ctx, out = D.ctx { step = s }, {}
      for l = 0, n_layers - 1 do
        for _ = 1, per_layer do
          out[#out + 1] = p.decide(D.desc { bytes = 1000, layer = l, layer_count = n_layers }, ctx)
        end
      end
      return out
    end
    assert.same({ 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 }, step(0, 4, 3))
    -- T = 12000, budget = one layer = 3000: offload 9000, keep the last layer
    assert.same({ 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0 }, step(1, 4, 3))
    -- a longer step than projected: kept bytes never pass the budget
    local longer = step(2, 5, 3)
    local kept = 0
    for _, a in ipairs(longer) do if a == KEEP then kept = kept + 1000 end end
    assert.is_true(kept <= 3000)
    local p2 = policy [[return R.policy { R.budget { bytes = 2500 } }]]
    local ctx = D.ctx { step = 0 }
    for _ = 1, 10 do p2.decide(D.desc { bytes = 1000 }, ctx) end
    ctx.step = 1
    local out = {}
    for i = 1, 10 do out[i] = p2.decide(D.desc { bytes = 1000 }, ctx) end
    assert.same({ 1, 1, 1, 1, 1, 1, 1, 1, 0, 0 }, out)
    local p3 = policy [[return R.policy { R.budget { fraction = 0.5 } }]]
    ctx = D.ctx { step = 0 }
    for _ = 1, 4 do p3.decide(D.desc { bytes = 1000 }, ctx) end
    ctx.step = 1
    out = {}
    for i = 1, 4 do out[i] = p3.decide(D.desc { bytes = 1000 }, ctx) end
    assert.same({ 1, 1, 0, 0 }, out)
  end)

  it("host_budget: largest sites first within the bytes, last layers kept, then cached", function()
    local p = policy [[return R.policy { R.host_budget { bytes = 7000, keep_last = 1 } }]]
    -- three layers of three tensors: a = 4000, b = 1000, c = 2500 bytes
    local sizes = { a = 4000, b = 1000, c = 2500 }
    local function step(s)
      local ctx, out = D.ctx { step = s }, {}
      for l = 0, 2 do
        for _, n in ipairs({ "a", "b", "c" }) do
          local a, _, _, c = p.decide(D.desc { bytes = sizes[n], layer = l, layer_count = 3,
            path = "model.layers." .. l .. "." .. n }, ctx)
          out[#out + 1] = a .. (c and "c" or "")
        end
      end
      return out
    end
    -- step 1, pack order while it fits: 0.a (4000), 0.b (5000), 0.c would make
    -- 7500: kept, 1.a kept, 1.b (6000), 1.c kept; layer 2 kept (keep_last = 1)
    assert.same({ "1", "1", "0", "0", "1", "0", "0", "0", "0" }, step(0)) -- nothing cached yet
    -- then largest first: 0.a (4000, 3000 left), 1.a does not fit, 0.c (2500,
    -- 500 left), 1.c, 0.b, 1.b do not fit: 6500 bytes, every answer cached
    local want = { "1c", "0c", "1c", "0c", "0c", "0c", "0c", "0c", "0c" }
    assert.same(want, step(1))
    assert.same(want, step(2))
    -- no budget: nothing goes; a budget for everything: all but the last layer
    p = policy [[return R.policy { R.host_budget { bytes = 0 } }]]
    step(0)
    assert.same({ "0c", "0c", "0c", "0c", "0c", "0c", "0c", "0c", "0c" }, step(1))
    p = policy [[return R.policy { R.host_budget { bytes = 1e9, keep_last = 2 } }]]
    step(0)
    assert.same({ "1c", "1c", "1c", "0c", "0c", "0c", "0c", "0c", "0c" }, step(1))
  end)

  it("host_budget: checks its options", function()
    local function load_error(src)
      local ok, err = pcall(policy, src)
      assert.is_false(ok)
      return err
    end
    assert.matches("bytes is required", load_error("return R.policy { R.host_budget {} }"))
    assert.matches("unknown option", load_error(
      "return R.policy { R.host_budget { bytes = 1, keep = 1 } }"))
    assert.matches("keep_last must be an integer", load_error(
      "return R.policy { R.host_budget { bytes = 1, keep_last = 1.5 } }"))
  end)

  it("prefetch_layers learns tensors per layer in the first step, then allows caching", function()
    local p = policy [[return R.policy { R.first_layers(8), reload = R.prefetch_layers(1) }]]
    local ctx = D.ctx { step = 0 }
    local a, r, d, c
    for l = 0, 2 do
      for _ = 1, 4 do
        a, r, d, c = p.decide(D.desc { path = "m.layers." .. l, layer = l }, ctx)
        assert.same({ OFFLOAD, PREFETCH, nil, false }, { a, r, d, c })
      end
    end
    ctx.step = 1
    a, r, d, c = p.decide(D.desc { path = "m.layers.0", layer = 0 }, ctx)
    assert.same({ OFFLOAD, PREFETCH, 4, true }, { a, r, d, c })
    p = policy [[return R.policy { reload = R.prefetch(3) }]]
    assert.same({ OFFLOAD, PREFETCH, 3, true }, { run(p, {}) })
  end)

  it("prefetch_bytes counts the window in bytes, bounded by what backward frees first", function()
    local function step(window)
      local q = policy(([[return R.policy { R.exclude_modules(R.LOSS),
        reload = R.prefetch_bytes(%d) }]]):format(window))
      local out = {}
      for _, k in ipairs({ 0, 1 }) do
        local ctx = D.ctx { step = k }
        out = {}
        for i, b in ipairs({ 100, 200, 300, 50 }) do
          ctx.offloaded_this_step = i - 1
          local a, r, d, c = q.decide(D.desc { bytes = b, path = "model.layers.0.x" }, ctx)
          assert.same({ OFFLOAD, PREFETCH }, { a, r })
          out[i] = { d, c }
        end
        -- the loss, kept, packed last: what backward frees before the 2nd reload
        assert.equal(KEEP, (q.decide(D.desc { bytes = 1000, path = "loss" }, ctx)))
        if k == 0 then -- first step: one tensor each, nothing cached
          assert.same({ { 1, false }, { 1, false }, { 1, false }, { 1, false } }, out)
        end
      end
      return out, q
    end
    -- 550 bytes: 300 + 200 fit, + 100 does not; 50 + 300 + 200 do
    local out, q = step(550)
    assert.same({ { 1, true }, { 2, true }, { 2, true }, { 3, true } }, out)
    -- the loss's unpacks (the tail) start one reload: the engine caps them
    assert.equal(1, q.knobs.max_tail_prefetch)
    -- a window past the loss's 1000 bytes is cut to them: all 650
    assert.same({ { 1, true }, { 2, true }, { 3, true }, { 4, true } }, (step(5000)))
    assert.matches("prefetch_bytes: bytes must be within", select(2, pcall(policy,
      [[return R.policy { reload = R.prefetch_bytes(0) }]])))
  end)

  it("R.sync_copies sets the engine knob sync_copies; a bad value names the choices", function()
    assert.equal(0, policy([[return R.policy { R.sync_copies("none") }]]).knobs.sync_copies)
    assert.equal(1, policy([[return R.policy { R.sync_copies("compute") }]]).knobs.sync_copies)
    assert.equal(2, policy([[return R.policy { R.sync_copies("host") }]]).knobs.sync_copies)
    local ok, err = pcall(policy, [[return R.policy { R.sync_copies("always") }]])
    assert.is_false(ok)
    assert.matches('sync_copies: who must be "none", "compute" or "host", got "always"', err, 1, true)
    ok, err = pcall(policy, [[return R.policy { knobs = { sync_copies = 3 } }]])
    assert.is_false(ok)
    assert.matches("knob sync_copies must be an integer within [0, 2], got 3", err, 1, true)
  end)

  it("R.one_copy_stream sets the engine knob one_copy_stream; a bad value names its range", function()
    assert.equal(1, policy([[return R.policy { R.one_copy_stream() }]]).knobs.one_copy_stream)
    local ok, err = pcall(policy, [[return R.policy { knobs = { one_copy_stream = 2 } }]])
    assert.is_false(ok)
    assert.matches("knob one_copy_stream must be an integer within [0, 1], got 2", err, 1, true)
    -- it takes no switch: R.one_copy_stream(false) or (0) must not turn it on
    for _, arg in ipairs({ "false", "0", "1" }) do
      ok, err = pcall(policy, "return R.policy { R.one_copy_stream(" .. arg .. ") }")
      assert.is_false(ok)
      assert.matches("ferry.rules.one_copy_stream: takes no argument", err, 1, true)
    end
  end)

  it("R.LOSS matches the loss outside the blocks: its module by name or class, or the root", function()
    local p = policy [[return R.policy { R.exclude_modules(R.LOSS) }]]
    assert.equal(KEEP, (run(p, { path = "loss" })))
    assert.equal(KEEP, (run(p, { path = "model.loss_fn" })))
    assert.equal(KEEP, (run(p, { path = "x", class = "CrossEntropyLoss" })))
    assert.equal(OFFLOAD, (run(p, { path = "model.layers.0.loss" })))
    assert.equal(OFFLOAD, (run(p, { path = "lm_head" })))
    -- Hugging Face's loss, in the CausalLM's own forward, and a loss
    -- computed outside the model: the root path
    assert.equal(KEEP, (run(p, { path = "", class = "LlamaForCausalLM" })))
    assert.equal(KEEP, (run(p, { path = "" })))
    assert.equal(OFFLOAD, (run(p, { path = "model.embed_tokens", class = "Embedding" })))
  end)

  it("selectors and guards make offloads uncached; cache = false disables caching", function()
    local p = policy [[return R.policy { R.min_bytes(10), R.fraction(1) }]]
    assert.is_false(select(4, run(p, { bytes = 100 })))
    assert.is_true(select(4, run(p, { bytes = 1 })))
    p = policy [[return R.policy { cache = false, R.min_bytes(10) }]]
    assert.is_false(select(4, run(p, { bytes = 1 })))
  end)

  it("explain names the rule that made a decision and its line", function()
    -- line 1 of the source is `local R = require 'ferry.rules'`
    local p = policy [[return R.policy { R.min_bytes(10), R.exclude_modules(R.HEAD),
      R.exclude_modules("vision") }]]
    assert.same({ KEEP, "min_bytes(10)", "policy:2", ON_USE, nil, true },
      { p.explain(D.desc { bytes = 1 }, D.ctx {}) })
    local a, why, where = p.explain(D.desc { path = "lm_head" }, D.ctx {})
    assert.equal(KEEP, a)
    assert.matches("^exclude_modules%({top=lm_head|", why)
    assert.equal("policy:2", where)
    a, why, where = p.explain(D.desc { path = "model.vision.0" }, D.ctx {})
    assert.same({ "exclude_modules({under=vision})", "policy:3" }, { why, where })
    -- an offload no rule kept, without a selector: no line (the host puts
    -- the policy's return there)
    assert.same({ OFFLOAD, "all rules passed", nil, ON_USE, nil, true },
      { p.explain(D.desc { path = "model.layers.0" }, D.ctx {}) })
  end)

  it("explain: a selector's offloads and keeps are the selector's", function()
    local p = policy [[
return R.policy {
  R.min_bytes(10),
  R.fraction(0.5),
  reload = R.prefetch(3),
}]]
    local ctx = D.ctx { step = 1 }
    assert.same({ OFFLOAD, "fraction(0.5, first)", "policy:4", PREFETCH, 3, false },
      { p.explain(D.desc { bytes = 100 }, ctx) })
    assert.same({ KEEP, "fraction(0.5, first)", "policy:4", PREFETCH, 3, false },
      { p.explain(D.desc { bytes = 100 }, ctx) })
    local a, why, where = p.explain(D.desc { bytes = 1 }, ctx)
    assert.same({ KEEP, "min_bytes(10)", "policy:3" }, { a, why, where })
  end)

  it("rejects bad rules at load with the policy's line", function()
    local function load_error(src)
      local ok, err = pcall(policy, src)
      assert.is_false(ok)
      return err
    end
    assert.matches('policy:3: ferry.rules.min_bytes: n must be within %[0, 1125899906842624%], got %-1',
      load_error("return R.policy {\nR.min_bytes(-1) }"))
    -- `return R.policy {...}` is a tail call: no caller line to point at,
    -- so R.policy's own errors name the entry instead
    assert.matches("^ferry.rules.policy: entry 1 is not a rule %(got number%)",
      load_error("return R.policy { 42 }"))
    assert.matches("unknown field 'relaod'", load_error("return R.policy { relaod = R.on_use() }"))
    assert.matches("unknown matcher field 'path'",
      load_error("return R.policy { R.exclude_modules { path = 'x' } }"))
    assert.matches("bad Lua pattern",
      load_error("return R.policy { R.exclude_modules { pattern = '%' } }"))
    assert.matches("knob min_offload_bytes set twice: 10 by min_bytes%(10%), 20 by knobs",
      load_error("return R.policy { R.min_bytes(10), knobs = { min_offload_bytes = 20 } }"))
    assert.matches("unknown knob 'stash'", load_error("return R.policy { knobs = { stash = 1 } }"))
    assert.matches("knob prefetch_distance must be an integer within %[0, 4096%]",
      load_error("return R.policy { knobs = { prefetch_distance = 5000 } }"))
    assert.matches("fraction: f must be within %[0, 1%]", load_error("return R.policy { R.fraction(2) }"))
    assert.matches("give exactly one of bytes, fraction, layers",
      load_error("return R.policy { R.budget { bytes = 1, layers = 1 } }"))
    assert.matches("is not a tensor kind", load_error("return R.policy { R.kinds(9) }"))
  end)

  it("decides without allocating, JIT off (as the host may run it)", function()
    for _, file in ipairs({ "policies/default.lua", "policies/layers.lua", "policies/fraction.lua",
      "policies/ramcap.lua", "policies/budget.lua", "policies/host_budget.lua" }) do
      local p = D.load(file)
      local descs = {}
      for l = 0, 3 do
        for _, m in ipairs({ "self_attn.q_proj", "self_attn", "mlp.up_proj", "mlp.down_proj" }) do
          descs[#descs + 1] = D.desc { path = "model.layers." .. l .. "." .. m, layer = l,
            layer_count = 4, class = "Linear", bytes = 65536 }
        end
      end
      descs[#descs + 1] = D.desc { path = "lm_head", class = "Linear", bytes = 65536 }
      local ctx = D.ctx { step = 0, host_ram_used_pct = 10 }
      local decide = p.decide
      jit.off() -- the whole measurement interpreted: trace exits would box values
      -- warm up: two steps, so memos and learned values are in place
      for s = 0, 1 do
        ctx.step = s
        for i = 1, #descs do decide(descs[i], ctx) end
      end
      collectgarbage()
      collectgarbage("stop")
      local before = collectgarbage("count")
      for s = 2, 101 do
        ctx.step = s
        for i = 1, #descs do decide(descs[i], ctx) end
      end
      local grew = collectgarbage("count") - before
      collectgarbage("restart")
      jit.on()
      assert.is_true(grew < 1, file .. " allocated " .. grew .. " KiB in 1700 calls")
    end
  end)
end)
