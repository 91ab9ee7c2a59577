--[[
ferry.rules — build a policy (policy API v1) out of one-line rules.

    local R = require "ferry.rules"
    return R.policy {
      name = "default",
      R.min_bytes(1024),
      R.exclude_kinds(ferry.PARAMETER, ferry.BUFFER),
      R.exclude_modules(R.HEAD),
      R.exclude_modules(R.LIGER),
      reload = R.on_use(),
    }

A tensor is offloaded when every rule lets it through; the first rule that
says no keeps it on device. Rules run in a fixed order of stages, whatever
order they are written in (within a stage, in the order written):

  1. filters on the site (kind, size, dtype, module path/class): the same
     answer for every tensor of a site, so a "keep" they give is cached by
     the engine and later steps never call Lua for it;
  2. filters on the layer (first N layers, keep the last K): cached too when
     the tensor has a module path (the embedders derive the layer from it);
  3. filters on the tensor (phase, user predicates): never cached;
  4. guards on the engine's state (host RAM %, bytes in flight, arena): they
     read the context, so nothing past a guard is cached;
  5. selectors that count within a step (fraction, budget): they see only
     tensors that passed every filter and guard, in pack order, and reset
     when ctx.step changes.

An offload is cached only when the policy has no guard and no selector (and
its reload distance, if learned, is known). Each rule's scope is written
next to it below. See docs/policy-api.md for the full API.

Cost: decide reads each descriptor field it needs once, calls t:path() at
most once (the library's tests get it as a third argument), and allocates
nothing per call in steady state (module
matches are memoized per path string; paths are interned Lua strings).
]]

local ferry = ferry -- the sandbox's global; a stand-in table outside it

-- The policy host passes ferry's own modules a function giving "file:line"
-- of the policy line that called into the module (where a rule is written,
-- for explain and `ferry check`). Outside the host (the unit specs' test
-- double) plain LuaJIT's debug library does the same.
-- It also passes the read-only views t and ctx it hands to decide, and the
-- tables they read from: this library's own tests read those directly (a
-- field through a view costs a metamethod call, several times a direct
-- read); a policy's own functions only ever get the views (R.policy).
local caller_where, host_views = select(2, ...)
if type(caller_where) ~= "function" then
  local ok, dbg = pcall(function() return debug end) -- an error in the sandbox
  if ok and type(dbg) == "table" then
    caller_where = function()
      local self = dbg.getinfo(1, "S").source
      for level = 2, 255 do
        local info = dbg.getinfo(level, "Sl")
        if not info then return nil end
        if info.currentline > 0 and info.source ~= self then
          return info.short_src .. ":" .. info.currentline
        end
      end
    end
  else
    caller_where = function() return nil end
  end
end

local F = ferry or {}
local KEEP, OFFLOAD = F.KEEP or 0, F.OFFLOAD or 1
local ON_USE, PREFETCH = F.ON_USE or 0, F.PREFETCH or 1
local ACTIVATION, PARAMETER, BUFFER, OTHER =
  F.ACTIVATION or 0, F.PARAMETER or 1, F.BUFFER or 2, F.OTHER or 3
local FORWARD = F.FORWARD or 0

local type, tostring, tonumber, error, select, ipairs, pairs =
  type, tostring, tonumber, error, select, ipairs, pairs
local setmetatable, getmetatable, next, pcall = setmetatable, getmetatable, next, pcall
local floor, ceil = math.floor, math.ceil
local lower, find, sub, format = string.lower, string.find, string.sub, string.format
local concat = table.concat

local R = { api = 1 }

local MAX_BYTES = 2 ^ 50 -- 1 PiB, the engine's limit on a tensor

-- Drops the engine's cached answers (outside the sandbox: nothing to drop).
local forget_cached = F.forget_cached or function() end

-- ---------------------------------------------------------------------------
-- helpers

local RULE = {} -- metatable that marks rule objects
-- test functions this library wrote: they may be given the host's field
-- tables instead of the views (they never write to them); a function a
-- policy wrote, or put into a rule, is not in it
local OWN_TESTS = setmetatable({}, { __mode = "k" })
local RELOAD = {} -- metatable that marks reload specs

local function fail(fn, msg, level)
  error("ferry.rules." .. fn .. ": " .. msg, (level or 2) + 1)
end

local function check_number(fn, what, v, lo, hi, integer)
  if type(v) ~= "number" or v ~= v then
    fail(fn, what .. " must be a number, got " .. type(v), 3)
  end
  if (lo and v < lo) or (hi and v > hi) then
    fail(fn, format("%s must be within [%s, %s], got %s", what, lo and format("%.14g", lo)
      or "-inf", hi and format("%.17g", hi) or "inf", tostring(v)), 3)
  end
  if integer and v ~= floor(v) then
    fail(fn, what .. " must be an integer, got " .. tostring(v), 3)
  end
  return v
end

-- A rule remembers where the policy wrote it: "file:line", or nil.
local function rule(spec)
  spec.where = caller_where()
  if spec.test then OWN_TESTS[spec.test] = true end
  return setmetatable(spec, RULE)
end

-- Site ids: a tensor's (module path, or class when the path is empty;
-- bytes; dtype; kind; phase) -> a small integer, memoized in nested tables, so
-- that keying a tensor by its site builds no string.
local function site_keys()
  local by_path, by_class, n = {}, {}, 0
  return function(t, path) -- path: t:path() if the caller has it
    local root, k = by_path, path or t:path()
    if k == "" then root, k = by_class, t:class() end
    local a = root[k]
    if not a then a = {}; root[k] = a end
    local bytes = tonumber(t.bytes)
    local b = a[bytes]
    if not b then b = {}; a[bytes] = b end
    local code = (t.dtype * 4 + t.kind) * 4 + t.phase
    local id = b[code]
    if not id then n = n + 1; id = n; b[code] = id end
    return id
  end
end

local KIND_NAMES = { [ACTIVATION] = "ACTIVATION", [PARAMETER] = "PARAMETER",
  [BUFFER] = "BUFFER", [OTHER] = "OTHER" }

local function kind_set(fn, ...)
  local n = select("#", ...)
  if n == 0 then fail(fn, "give at least one kind (ferry.ACTIVATION, ...)", 3) end
  local set, names = {}, {}
  for i = 1, n do
    local k = select(i, ...)
    if KIND_NAMES[k] == nil then
      fail(fn, "argument " .. i .. " is not a tensor kind (ferry.ACTIVATION, " ..
        "ferry.PARAMETER, ferry.BUFFER, ferry.OTHER): " .. tostring(k), 3)
    end
    set[k] = true
    names[#names + 1] = KIND_NAMES[k]
  end
  return set, concat(names, ", ")
end

local function number_set(fn, what, ...)
  local n = select("#", ...)
  if n == 0 then fail(fn, "give at least one " .. what, 3) end
  local set, names = {}, {}
  for i = 1, n do
    local v = select(i, ...)
    if type(v) ~= "number" then
      fail(fn, "argument " .. i .. " must be a " .. what .. " number, got " .. type(v), 3)
    end
    set[v] = true
    names[#names + 1] = tostring(v)
  end
  return set, concat(names, ", ")
end

-- ---------------------------------------------------------------------------
-- module matchers

--[[ A matcher says which modules a rule is about. It is a string or a table:

  "lm_head"                 same as { under = { "lm_head" } }
  {
    name     = { "o_proj", "attn.c_proj" },  -- the module's own name: the
                              -- path ends with it at a dot ("a.b" = last two)
    under    = { "mlp" },     -- the module or one of its parents is named so
    top      = { "lm_head" }, -- like under, but only outside the repeated
                              -- blocks (before the first numeric component:
                              -- "model.norm" yes, "model.layers.3.norm" no)
    class    = { "LigerRMSNorm" },   -- module class equals
    contains = { "liger" },   -- path or class contains it, ignoring case
    pattern  = { "^model%.layers%.%d+%.mlp%." },  -- Lua pattern on the path
  }

A module matches when any entry of any field matches. Paths are dotted
module paths as PyTorch's named_modules() gives them.]]

local MATCHER_FIELDS = { name = true, under = true, top = true, class = true,
  contains = true, pattern = true }

local function string_list(fn, field, v)
  if type(v) == "string" then v = { v } end
  if type(v) ~= "table" then
    fail(fn, "matcher field '" .. field .. "' must be a string or a list of strings", 4)
  end
  local out = {}
  for i, s in ipairs(v) do
    if type(s) ~= "string" or s == "" then
      fail(fn, "matcher field '" .. field .. "' entry " .. i .. " must be a non-empty string", 4)
    end
    out[i] = s
  end
  return out
end

-- Turns a matcher into a plain function(path, class) -> boolean, plus a
-- description. Called at load, never per tensor.
local function compile_matcher(fn, m)
  if type(m) == "string" then m = { under = { m } } end
  if type(m) ~= "table" then
    fail(fn, "a module matcher must be a string or a table, got " .. type(m), 3)
  end
  local names, under, top, classes, contains, patterns = {}, {}, {}, {}, {}, {}
  local desc = {}
  for k, v in pairs(m) do
    if type(k) ~= "string" or not MATCHER_FIELDS[k] then
      fail(fn, "unknown matcher field '" .. tostring(k) ..
        "' (known: name, under, top, class, contains, pattern)", 3)
    end
  end
  for _, k in ipairs({ "name", "under", "top", "class", "contains", "pattern" }) do
    if m[k] ~= nil then
      local list = string_list(fn, k, m[k])
      desc[#desc + 1] = k .. "=" .. concat(list, "|")
      for _, s in ipairs(list) do
        if k == "name" then names[#names + 1] = "." .. s
        elseif k == "under" then under[#under + 1] = "." .. s .. "."
        elseif k == "top" then top[#top + 1] = "." .. s .. "."
        elseif k == "class" then classes[s] = true
        elseif k == "contains" then contains[#contains + 1] = lower(s)
        else
          local ok, err = pcall(find, "", s)
          if not ok then fail(fn, "bad Lua pattern '" .. s .. "': " .. tostring(err), 3) end
          patterns[#patterns + 1] = s
        end
      end
    end
  end
  if #desc == 0 then fail(fn, "empty module matcher", 3) end

  local function matches(path, class)
    if classes[class] then return true end
    local dotted = "." .. path .. "."
    for i = 1, #names do
      local s = names[i]
      if sub(dotted, -#s - 1, -2) == s then return true end
    end
    for i = 1, #under do
      if find(dotted, under[i], 1, true) then return true end
    end
    if #top > 0 then
      -- the part of the path before the first all-digit component
      local cut = find(dotted, "%.%d+%.")
      local outside = cut and sub(dotted, 1, cut) or dotted
      for i = 1, #top do
        if find(outside, top[i], 1, true) then return true end
      end
    end
    if #contains > 0 then
      local lp, lc = lower(path), lower(class)
      for i = 1, #contains do
        local s = contains[i]
        if find(lp, s, 1, true) or find(lc, s, 1, true) then return true end
      end
    end
    for i = 1, #patterns do
      if find(path, patterns[i]) then return true end
    end
    return false
  end
  return matches, "{" .. concat(desc, " ") .. "}"
end

-- Ready-made matchers. Extend or copy them: they are plain tables.

-- Output heads and final norms, outside the repeated blocks (TRL disables
-- offloading for model.output, output.linear, lm_head, decoder.output,
-- decoder.lm_head, final_layer_norm, ln_f and head; torchtune for output).
R.HEAD = { top = { "lm_head", "output", "head", "ln_f", "final_layer_norm",
  "final_layernorm", "norm", "final_norm", "embed_out", "score", "classifier" } }
-- Liger kernel modules: "liger" anywhere in the path or the class, any case.
R.LIGER = { contains = { "liger" } }
-- The loss module, outside the blocks. A language model's cross-entropy
-- saves its fp32 log-probabilities (sequence x vocabulary: Llama-3-8B at
-- 8192 tokens, 3.9 GiB, the largest saved tensor of the step); they are
-- created at the very end of the forward pass, when memory peaks anyway, and
-- backward needs them first: an offload cannot lower the peak, it only adds
-- two copies (and a stall) for the biggest tensor. Where there is no loss
-- module the loss is saved at the model's root (path ""): Hugging Face's
-- *ForCausalLM computes it in its own forward (class LlamaForCausalLM, ...),
-- torchtune and torchtitan call it outside the model.
R.LOSS = { top = { "loss", "loss_fn", "criterion" },
  class = { "CrossEntropyLoss", "NLLLoss" }, pattern = { "^$" } }

-- Module kinds inside a transformer block (Megatron's --offload-modules
-- choices and their usual names in HF, torchtune, Megatron and GPT-2 code).
R.ATTN_NORM = { name = { "input_layernorm", "attn_norm", "ln_1", "attention_norm",
  "self_attn_layer_norm", "sa_norm" } }
R.QKV = { name = { "q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value",
  "linear_qkv", "c_attn", "Wqkv", "wqkv", "query", "key", "value", "in_proj", "wq", "wk", "wv" } }
R.CORE_ATTN = { name = { "core_attention", "core_attn", "self_attn", "attn", "attention",
  "self_attention" } }
R.ATTN_PROJ = { name = { "o_proj", "out_proj", "output_proj", "linear_proj", "attn.c_proj",
  "attention.dense", "attention.output.dense", "wo" } }
R.MLP_NORM = { name = { "post_attention_layernorm", "pre_mlp_layernorm", "mlp_norm", "ln_2",
  "ffn_norm", "pre_feedforward_layernorm" } }
R.FC1 = { name = { "fc1", "linear_fc1", "up_proj", "gate_proj", "gate_up_proj", "c_fc", "w1",
  "w3", "dense_h_to_4h", "intermediate.dense", "wi" } }
R.FC2 = { name = { "fc2", "linear_fc2", "down_proj", "mlp.c_proj", "w2", "dense_4h_to_h" } }
R.MLP = { under = { "mlp", "feed_forward", "ffn", "block_sparse_moe", "experts" } }
R.EXPERT_FC1 = { pattern = { "experts%..*fc1", "experts%..*up_proj", "experts%..*gate_proj",
  "experts%..*w1" } }
R.MOE_ACT = { pattern = { "experts%..*act", "experts%..*activation" } }

-- ---------------------------------------------------------------------------
-- filters on the site: cached by the engine when they keep a tensor

-- Keep tensors smaller than n bytes; also sets the engine knob
-- min_offload_bytes = n, so smaller tensors never reach Lua at all.
function R.min_bytes(n)
  check_number("min_bytes", "n", n, 0, MAX_BYTES, true)
  return rule {
    name = "min_bytes(" .. n .. ")", stage = 1, scope = "site",
    knobs = { min_offload_bytes = n },
    test = function(t) return t.bytes >= n end,
  }
end

-- Keep tensors with fewer than n elements (product of the shape), like
-- Megatron's min_offloaded_tensor_size and TE's min_tensor_size_to_offload.
function R.min_elements(n)
  check_number("min_elements", "n", n, 0, MAX_BYTES, true)
  return rule {
    name = "min_elements(" .. n .. ")", stage = 1, scope = "site",
    test = function(t)
      local count = 1
      for i = 0, t.ndim - 1 do count = count * tonumber(t.shape[i]) end
      return count >= n
    end,
  }
end

-- Offload only these kinds (ferry.ACTIVATION, ferry.PARAMETER, ...).
function R.kinds(...)
  local set, names = kind_set("kinds", ...)
  return rule {
    name = "kinds(" .. names .. ")", stage = 1, scope = "site",
    test = function(t) return set[t.kind] == true end,
  }
end

-- Keep tensors of these kinds.
function R.exclude_kinds(...)
  local set, names = kind_set("exclude_kinds", ...)
  return rule {
    name = "exclude_kinds(" .. names .. ")", stage = 1, scope = "site",
    test = function(t) return set[t.kind] == nil end,
  }
end

-- Parameters and buffers stay (torchtune/TRL never offload them).
function R.exclude_params_and_buffers()
  local r = R.exclude_kinds(PARAMETER, BUFFER)
  r.name = "exclude_params_and_buffers()"
  return r
end

-- Only activations (kind OTHER is kept too).
function R.activations_only()
  local r = R.kinds(ACTIVATION)
  r.name = "activations_only()"
  return r
end

-- Offload only these dtypes (ferry.DTYPE_* numbers), or keep these dtypes.
function R.dtypes(...)
  local set, names = number_set("dtypes", "dtype", ...)
  return rule {
    name = "dtypes(" .. names .. ")", stage = 1, scope = "site",
    test = function(t) return set[t.dtype] == true end,
  }
end

function R.exclude_dtypes(...)
  local set, names = number_set("exclude_dtypes", "dtype", ...)
  return rule {
    name = "exclude_dtypes(" .. names .. ")", stage = 1, scope = "site",
    test = function(t) return set[t.dtype] == nil end,
  }
end

local function module_rule(fn, exclude, ...)
  local n = select("#", ...)
  if n == 0 then fail(fn, "give at least one module matcher (e.g. R.HEAD or \"lm_head\")", 2) end
  local fns, descs = {}, {}
  for i = 1, n do
    fns[i], descs[i] = compile_matcher(fn, (select(i, ...)))
  end
  local function matches(path, class)
    for i = 1, n do
      if fns[i](path, class) then return true end
    end
    return false
  end
  return rule {
    name = fn .. "(" .. concat(descs, ", ") .. ")", stage = 1, scope = "site",
    module = true, exclude = exclude, matches = matches,
  }
end

-- Keep tensors saved by modules that match (or by their submodules, per
-- the matcher's fields).
function R.exclude_modules(...)
  return module_rule("exclude_modules", true, ...)
end

-- Offload only tensors saved by modules that match.
function R.only_modules(...)
  return module_rule("only_modules", false, ...)
end

-- ---------------------------------------------------------------------------
-- filters on the layer (t.layer, t.layer_count)

-- Offload only tensors of the first n repeated blocks (layers 0 .. n-1);
-- tensors outside the blocks (t.layer == -1) are kept. Transformer Engine's
-- and Megatron's num_layers.
function R.first_layers(n)
  check_number("first_layers", "n", n, 0, 1e6, true)
  return rule {
    name = "first_layers(" .. n .. ")", stage = 2, scope = "layer",
    test = function(t)
      local layer = t.layer
      return layer >= 0 and layer < n
    end,
  }
end

-- Keep the tensors of the last k layers (layer >= layer_count - k): backward
-- needs them first, so offloading them only adds a reload on the critical
-- path. No effect while layer_count is unknown (0).
function R.keep_last_layers(k)
  check_number("keep_last_layers", "k", k, 0, 1e6, true)
  return rule {
    name = "keep_last_layers(" .. k .. ")", stage = 2, scope = "layer",
    test = function(t)
      local count = t.layer_count
      return count <= 0 or t.layer < count - k
    end,
  }
end

-- ---------------------------------------------------------------------------
-- filters on the tensor: never cached

-- Keep tensors packed while recomputing (activation checkpointing): they
-- are unpacked moments later, an offload would only add two copies. The
-- phase is part of the engine's site key, so the answer is cached per site
-- and phase. R.policy keeps recompute packs already unless its field
-- recompute = "decide"; then this rule keeps them at its place in the rules.
function R.forward_only()
  return rule {
    name = "forward_only()", stage = 1, scope = "site",
    test = function(t) return t.phase == FORWARD end,
  }
end

-- Your own test: fn(t, ctx) returns true to let the tensor through.
-- opts.site = true promises the answer depends only on the site (module
-- path, shape, dtype, kind), so a "keep" may be cached.
function R.when(fn, opts)
  if type(fn) ~= "function" then fail("when", "expected a function(t, ctx), got " .. type(fn)) end
  opts = opts or {}
  if type(opts) ~= "table" then fail("when", "opts must be a table") end
  local r = rule {
    name = "when(" .. tostring(opts.name or "fn") .. ")", stage = 3,
    scope = opts.site and "site" or "tensor",
    test = fn,
  }
  OWN_TESTS[fn] = nil -- the policy's function: it gets the views
  return r
end

-- ---------------------------------------------------------------------------
-- guards on the engine's state: never cached, but for ram_cap

-- Keep everything while the host's RAM use is at or above pct percent
-- (torchtune/TRL only warn past 60%).
-- The engine samples the RAM use once per step, at its begin, so within a
-- step the answer depends on the site only: it is cached, and every cached
-- answer is dropped at the begin of a step where the reading has crossed pct.
function R.ram_cap(pct)
  check_number("ram_cap", "pct", pct, 0, 100)
  local above = nil
  return rule {
    name = "ram_cap(" .. pct .. "%)", stage = 4, scope = "site", per_step = true,
    on_step = function(_, ctx)
      local now = ctx.host_ram_used_pct >= pct
      if above ~= nil and now ~= above then forget_cached() end
      above = now
    end,
    test = function(t, ctx) return ctx.host_ram_used_pct < pct end,
  }
end

-- Keep a tensor when copies already in flight plus this one would exceed
-- the cap (bytes). One copy may always start, whatever its size.
function R.in_flight_cap(cap)
  check_number("in_flight_cap", "bytes", cap, 1, MAX_BYTES)
  return rule {
    name = "in_flight_cap(" .. cap .. ")", stage = 4, scope = "ctx",
    test = function(t, ctx)
      local busy = tonumber(ctx.bytes_in_flight)
      return busy == 0 or busy + tonumber(t.bytes) <= cap
    end,
  }
end

-- Keep a tensor when it would take the pinned arena past pct percent of its
-- cap (no effect without a cap). The engine enforces the cap itself; this
-- leaves headroom for others sharing the arena.
function R.arena_cap(pct)
  check_number("arena_cap", "pct", pct, 0, 100)
  local frac = pct / 100
  return rule {
    name = "arena_cap(" .. pct .. "%)", stage = 4, scope = "ctx",
    test = function(t, ctx)
      local cap = tonumber(ctx.arena_cap)
      return cap == 0 or tonumber(ctx.arena_in_use) + tonumber(t.bytes) <= frac * cap
    end,
  }
end

-- ---------------------------------------------------------------------------
-- selectors: count within a step; cached once the steps repeat (R.policy)

-- Offload a fraction f of the eligible tensors, deterministically.
--   order "first" (default): the first ceil(f * n) eligible tensors of each
--     step, n being the previous step's eligible count (Megatron's
--     activation_offload_fraction keeps the earliest groups: released
--     soonest, reloaded last). The first step, with n unknown, uses "spread".
--   order "spread": the k-th eligible tensor is offloaded when ceil(f * k)
--     grows, so any prefix of k tensors has exactly ceil(f * k) offloaded
--     (Bresenham: evenly spread, no total needed).
function R.fraction(f, order)
  check_number("fraction", "f", f, 0, 1)
  order = order or "first"
  if order ~= "first" and order ~= "spread" then
    fail("fraction", "order must be \"first\" or \"spread\", got " .. tostring(order))
  end
  local eps = 1e-9 -- f * k is not exact in binary floating point
  local seen, previous = 0, nil
  return rule {
    name = "fraction(" .. f .. ", " .. order .. ")", stage = 5, scope = "step",
    on_step = function()
      if seen > 0 then previous = seen end
      seen = 0
    end,
    discard = function() seen = 0 end, -- a partial step: learn nothing from it
    test = function()
      local k = seen + 1
      seen = k
      if order == "first" and previous then
        return k <= ceil(f * previous - eps)
      end
      return ceil(f * k - eps) > ceil(f * (k - 1) - eps)
    end,
  }
end

-- Aim for a device-memory budget: at the end of the forward pass (the peak)
-- at most `budget` bytes of eligible tensors stay on device. Knowing the
-- previous step's eligible bytes T, the rule offloads in pack order until
-- T - budget bytes are offloaded and keeps the rest: the tensors packed
-- last, which backward needs first, stay; the ones packed first, reloaded
-- last with the most time to prefetch them, go. If a step grows past the
-- projection, anything that would push the kept bytes past the budget is
-- offloaded too. The first step, with T unknown, offloads everything.
--   opts.bytes    = absolute budget in bytes, or
--   opts.fraction = budget as a fraction of T, or
--   opts.layers   = budget as k layers' worth (T / layers seen in the step).
function R.budget(opts)
  if type(opts) ~= "table" then
    fail("budget", "expected a table { bytes = n } or { fraction = f } or { layers = k }")
  end
  local given = (opts.bytes and 1 or 0) + (opts.fraction and 1 or 0) + (opts.layers and 1 or 0)
  if given ~= 1 then fail("budget", "give exactly one of bytes, fraction, layers") end
  local bytes, fraction, layers = opts.bytes, opts.fraction, opts.layers
  if bytes then check_number("budget", "bytes", bytes, 0, MAX_BYTES) end
  if fraction then check_number("budget", "fraction", fraction, 0, 1) end
  if layers then check_number("budget", "layers", layers, 0, 1e6) end
  -- seen_layers[layer] holds the number of the step it was last seen in:
  -- no table is allocated per step
  local total, offloaded, seen_layers, layer_count, stamp = 0, 0, {}, 0, 0
  local prev_total, prev_layers = nil, 0
  local budget, need = 0, 0
  local desc = bytes and ("bytes=" .. bytes) or fraction and ("fraction=" .. fraction)
    or ("layers=" .. layers)
  return rule {
    name = "budget(" .. desc .. ")", stage = 5, scope = "step",
    on_step = function()
      if total > 0 then prev_total, prev_layers = total, layer_count end
      total, offloaded, layer_count, stamp = 0, 0, 0, stamp + 1
      if prev_total then
        budget = bytes or (fraction and fraction * prev_total)
          or layers * prev_total / (prev_layers > 0 and prev_layers or 1)
        need = prev_total - budget
      end
    end,
    discard = function() total = 0 end, -- a partial step: learn nothing from it
    test = function(t)
      local b = tonumber(t.bytes)
      total = total + b
      local layer = t.layer
      if layer >= 0 and seen_layers[layer] ~= stamp then
        seen_layers[layer] = stamp
        layer_count = layer_count + 1
      end
      if not prev_total or offloaded < need or total - offloaded > budget then
        offloaded = offloaded + b
        return true
      end
      return false
    end,
  }
end

-- Offload the largest tensors first until a host byte budget per rank is
-- used, keeping the last `keep_last` layers on device (backward needs them
-- first). The offloaded tensors of a step are all on the host at the end of
-- the forward pass, so the budget bounds the sum of their bytes.
-- How it decides: the first step offloads in pack order while the budget
-- allows (it does not know the step's tensors yet). At its end the rule has
-- seen every eligible site (module path + bytes + dtype + kind) and how many
-- tensors each packed; it sorts the sites by tensor size, largest first
-- (ties: packed first), and takes each whole site whose bytes still fit,
-- skipping the ones that do not. From then on the answer depends on the site
-- only, so the engine caches it (tensors with no module path are never
-- cached). Sites new in a later step are taken while their bytes fit.
--   opts.bytes     host budget per rank in bytes (required)
--   opts.keep_last layers kept on device, counted from the last (default 0;
--                  no effect while layer_count is unknown)
function R.host_budget(opts)
  if type(opts) ~= "table" then
    fail("host_budget", "expected a table { bytes = n, keep_last = k }")
  end
  for k in pairs(opts) do
    if k ~= "bytes" and k ~= "keep_last" then
      fail("host_budget", "unknown option '" .. tostring(k) .. "' (known: bytes, keep_last)")
    end
  end
  if opts.bytes == nil then fail("host_budget", "bytes is required") end
  local cap = check_number("host_budget", "bytes", opts.bytes, 0, MAX_BYTES)
  local keep_last = check_number("host_budget", "keep_last", opts.keep_last or 0, 0, 1e6, true)
  -- learning: per site key, first pack position, tensor size, tensor count
  -- (three tables, so a new site allocates no table of its own)
  local learning, first, size, packs, nsites, pos = true, {}, {}, {}, 0, 0
  local chosen = nil -- site key -> true (offload) / false (keep), after learning
  local used, stepno = 0, nil -- bytes offloaded this step (learning and new sites)
  local key_of = site_keys() -- a site's key: a number, no string built per call
  local function finish()
    local list = {}
    for k, f in pairs(first) do list[#list + 1] = { key = k, first = f, size = size[k], n = packs[k] } end
    table.sort(list, function(a, b)
      if a.size ~= b.size then return a.size > b.size end
      return a.first < b.first
    end)
    chosen = {}
    local left = cap
    for _, s in ipairs(list) do
      local total = s.size * s.n
      if total <= left then
        chosen[s.key] = true
        left = left - total
      else
        chosen[s.key] = false
      end
    end
    first, size, packs, learning, used = nil, nil, nil, false, cap - left
  end
  local r = rule {
    name = "host_budget(bytes=" .. format("%.0f", cap) .. ", keep_last=" .. keep_last .. ")",
    stage = 5, scope = "site", learned = true,
    on_step = function(step)
      if learning and nsites > 0 and stepno ~= nil and step ~= stepno then finish() end
      stepno = step
      if learning then used = 0 end
    end,
    test = function(t, _, path)
      local count = t.layer_count
      if count > 0 and t.layer >= count - keep_last then return false end
      local b = tonumber(t.bytes)
      local key = key_of(t, path)
      if learning then
        local n = packs[key]
        if not n then
          nsites, pos = nsites + 1, pos + 1
          first[key], size[key], packs[key] = pos, b, 1
        else
          packs[key] = n + 1
        end
        if used + b <= cap then used = used + b; return true end
        return false
      end
      local c = chosen[key]
      if c == nil then -- a site the first step did not have
        c = used + b <= cap
        if c then used = used + b end
        chosen[key] = c
      end
      return c
    end,
  }
  r.ready = function() return not learning end
  return r
end

-- Engine knob: device buffers kept alive in the forward stash (torchtune's
-- max_fwd_stash_size).
function R.max_stash(n)
  check_number("max_stash", "n", n, 0, 1048576, true)
  return rule { name = "max_stash(" .. n .. ")", stage = 0, knobs = { max_fwd_stash = n } }
end

-- Also bound the forward stash by bytes: offloaded device buffers stay
-- alive while their copies run only while they total at most `bytes`.
function R.max_stash_bytes(bytes)
  check_number("max_stash_bytes", "bytes", bytes, 0, 2 ^ 50, true)
  return rule { name = "max_stash_bytes(" .. bytes .. ")", stage = 0,
                knobs = { max_fwd_stash_bytes = bytes } }
end

-- Engine knob: who waits for each copy right after the engine issues it.
-- "none": nobody, copies overlap compute (ferry's own, the default);
-- "compute": the compute stream, the host runs on (a copy on the compute
-- stream: save_on_cpu(pin_memory=True) in torch 2.x, compilers that wait on
-- each copy at issue); "host": the host too (a blocking copy: save_on_cpu()'s
-- .cpu() and .to(device)).
local SYNC_COPIES = { none = 0, compute = 1, host = 2 }
function R.sync_copies(who)
  local v = SYNC_COPIES[who]
  if v == nil then
    fail("sync_copies", "who must be \"none\", \"compute\" or \"host\", got " ..
      (type(who) == "string" and format("%q", who) or type(who)))
  end
  return rule { name = "sync_copies(" .. who .. ")", stage = 0, knobs = { sync_copies = v } }
end

-- Engine knob: one copy stream for both directions (the peers' single side
-- stream): a reload waits behind the offloads issued before it. No switch:
-- R.one_copy_stream(false) would read as "off" and turn it on.
function R.one_copy_stream(...)
  if select("#", ...) > 0 then
    fail("one_copy_stream", "takes no argument (leave the rule out for a stream each " ..
      "way), got " .. tostring((...)))
  end
  return rule { name = "one_copy_stream()", stage = 0, knobs = { one_copy_stream = 1 } }
end

-- ---------------------------------------------------------------------------
-- reload specs (the policy's `reload` field)

-- Reload when unpacked.
function R.on_use()
  return setmetatable({ name = "on_use()", mode = ON_USE }, RELOAD)
end

-- When a tensor is unpacked, also start reloading the next `distance`
-- offloaded tensors backward will need (the ones packed before it).
-- nil = the engine's prefetch_distance knob.
function R.prefetch(distance)
  if distance ~= nil then check_number("prefetch", "distance", distance, 0, 4096, true) end
  return setmetatable({ name = "prefetch(" .. tostring(distance or "default") .. ")",
    mode = PREFETCH, distance = distance }, RELOAD)
end

-- Prefetch k layers ahead: the distance is k times the largest number of
-- tensors offloaded in one layer, learned during the first step that
-- offloads anything and then fixed (so decisions can be cached again).
-- Until then the engine's default distance is used.
function R.prefetch_layers(k)
  check_number("prefetch_layers", "k", k or 1, 0, 1000)
  return setmetatable({ name = "prefetch_layers(" .. (k or 1) .. ")", mode = PREFETCH,
    layers = k or 1, learn = true }, RELOAD)
end

-- ---------------------------------------------------------------------------
-- checkpoint snapshots (the policy's `snapshot` field)

--[[ R.snapshot(opts) -> a snapshot(e) function for the policy's `snapshot`
field. ferry.torch.snapshot calls it once per tensor of a checkpoint, with
e = { key, path, bytes, index, dtype, device }, and it answers stage, order:
staged tensors are copied into the pinned arena while training goes on;
the others are copied when the snapshot starts (torch.save's way: the loop
waits for them). Nothing is ever left out of the file.
  opts.keys          top-level keys whose tensors are staged (nil: every
                     key); Lightning's CPUOffloadCallback offloads
                     { "state_dict", "optimizer_states", "lr_schedulers" }
  opts.exclude_keys  top-level keys whose tensors are copied at start
  opts.min_bytes     tensors under n bytes are copied at start (default 0)
  opts.order         top-level keys written first, in this order; the
                     others follow in traversal order (nil: traversal order)
Options are checked at load.]]
local SNAPSHOT_OPTS = { keys = true, exclude_keys = true, min_bytes = true, order = true }

function R.snapshot(opts)
  if opts == nil then opts = {} end
  if type(opts) ~= "table" then
    fail("snapshot", "expected a table { keys = {...}, exclude_keys = {...}, min_bytes = n, " ..
      "order = {...} }, got " .. type(opts))
  end
  for k in pairs(opts) do
    if not SNAPSHOT_OPTS[k] then
      fail("snapshot", "unknown option '" .. tostring(k) ..
        "' (known: keys, exclude_keys, min_bytes, order)")
    end
  end
  local function key_list(what, v)
    if v == nil then return nil end
    if type(v) == "string" then v = { v } end
    if type(v) ~= "table" then fail("snapshot", what .. " must be a list of strings", 3) end
    local set, n = {}, 0
    for i, k in ipairs(v) do
      if type(k) ~= "string" or k == "" then
        fail("snapshot", what .. " entry " .. i .. " must be a non-empty string", 3)
      end
      n = n + 1
      set[k] = n
    end
    return set
  end
  local keys = key_list("keys", opts.keys)
  local exclude = key_list("exclude_keys", opts.exclude_keys) or {}
  local first = key_list("order", opts.order) or {}
  local min = opts.min_bytes or 0
  check_number("snapshot", "min_bytes", min, 0, MAX_BYTES, true)
  local rest = 1
  for _ in pairs(first) do rest = rest + 1 end
  local GROUP = 2 ^ 32 -- indices stay below it; groups below 2^21 keep it exact
  return function(e)
    local key = e.key
    local stage = (keys == nil or keys[key] ~= nil) and exclude[key] == nil and e.bytes >= min
    return stage, (first[key] or rest) * GROUP + e.index
  end
end

-- ---------------------------------------------------------------------------
-- optimizer states and weights on the host (the policy's `optimizer` and
-- `weights` fields, which R.policy turns into its resident(r) function)

--[[ ferry.torch.offload_optimizer and offload_weights ask the policy once per
candidate, largest first (ties in model order), with
r = { kind = "optimizer" | "weights", name, module, layer, layer_count,
bytes, total_bytes, index, count, dtype }. A selector answers true (on the
host), false (on the device) or nil (no opinion: the next selector of the
list decides; none left: the device). Selectors are made at load and checked
there; each remembers the line it is written on, for the reason. ]]
local HOST_SELECTOR = {} -- metatable that marks host selectors

local function host_selector(name, test)
  return setmetatable({ name = name, test = test, where = caller_where() }, HOST_SELECTOR)
end

-- The host share of the states (or weights) by bytes: each candidate is
-- taken, largest first, while the share stays within f of the total
-- (Megatron's optimizer_offload_fraction; ferry.torch.offload_optimizer's
-- fraction= chooses the same parameters).
function R.host_fraction(f)
  check_number("host_fraction", "f", f, 0, 1)
  local used = 0
  return host_selector("host_fraction(" .. format("%.6g", f) .. ")", function(r)
    if r.index == 0 then used = 0 end
    if f >= 1 then return true end
    if used + r.bytes <= f * r.total_bytes then
      used = used + r.bytes
      return true
    end
    return false
  end)
end

-- On the host: the candidates of modules that match (module matchers as in
-- R.exclude_modules; a parameter's module, or a layer's).
function R.host_modules(...)
  local n = select("#", ...)
  if n == 0 then fail("host_modules", "give at least one module matcher (e.g. \"mlp\")", 2) end
  local fns, descs = {}, {}
  for i = 1, n do
    fns[i], descs[i] = compile_matcher("host_modules", (select(i, ...)))
  end
  return host_selector("host_modules(" .. concat(descs, ", ") .. ")", function(r)
    for i = 1, n do
      if fns[i](r.module, "") then return true end
    end
    return nil
  end)
end

-- On the host: the candidates of the first n repeated blocks (layers
-- 0 .. n-1); others: no opinion. Megatron's cpu_offloading_num_layers.
function R.host_first_layers(n)
  check_number("host_first_layers", "n", n, 0, 1e6, true)
  return host_selector("host_first_layers(" .. n .. ")", function(r)
    if r.layer >= 0 and r.layer < n then return true end
    return nil
  end)
end

-- On the device, whatever comes after: candidates under bytes (small
-- parameters: norms, biases, whose host step costs more than it saves).
function R.device_below(bytes)
  check_number("device_below", "bytes", bytes, 0, MAX_BYTES)
  return host_selector("device_below(" .. format("%.0f", bytes) .. ")", function(r)
    if r.bytes < bytes then return false end
    return nil
  end)
end

-- A list of selectors (or one) -> function(r) -> host, rule, where.
local function host_chooser(field, spec)
  if spec == nil then return nil end
  if getmetatable(spec) == HOST_SELECTOR then spec = { spec } end
  if type(spec) == "function" then
    return function(r) return spec(r) end
  end
  if type(spec) ~= "table" or #spec == 0 then
    fail("policy", field .. " must be a selector (R.host_fraction(0.5), R.host_modules(...), " ..
      "R.host_first_layers(n), R.device_below(n)), a list of them or a function(r)", 3)
  end
  for i, sel in ipairs(spec) do
    if getmetatable(sel) ~= HOST_SELECTOR then
      fail("policy", field .. "[" .. i .. "] is not a selector (R.host_fraction(0.5), ...)", 3)
    end
  end
  return function(r)
    for i = 1, #spec do
      local sel = spec[i]
      local host = sel.test(r)
      if host ~= nil then return host, sel.name, sel.where end
    end
    return false, "device by default", nil
  end
end

-- Prefetch a window of bytes: when a tensor is unpacked, the offloaded
-- tensors backward needs next are reloaded until `bytes` are on their way
-- (at least one tensor). The distance handed to the engine is counted in
-- tensors; each offloaded tensor's is computed when it is packed, from the
-- sizes of the offloaded tensors packed just before it in the same step, so
-- a window of big MLP tensors and one of small norm inputs hold the same
-- bytes. Size it from the link: bytes = bandwidth x the compute time the
-- reloads must hide (one layer's backward, or more to build a lead).
-- The window never takes device memory above the forward pass's peak: it is
-- at most the bytes kept after the last offloaded tensor (the loss's
-- log-probabilities, a kept tail), which backward frees before the second
-- reload starts; while the tail is unpacked, with the loss still on device,
-- the engine starts one reload (it sets the knob max_tail_prefetch = 1: the
-- engine knows which unpacks are the tail, whatever this step's count of
-- offloads). Those bytes are learned in the first step, which uses
-- one-tensor windows and caches nothing.
function R.prefetch_bytes(bytes)
  check_number("prefetch_bytes", "bytes", bytes, 1, MAX_BYTES)
  return setmetatable({ name = "prefetch_bytes(" .. format("%.0f", bytes) .. ")",
    mode = PREFETCH, bytes = bytes }, RELOAD)
end

-- ---------------------------------------------------------------------------
-- composing a policy: R.policy (rules_policy.lua)

require("ferry.rules_policy")(R, {
  fail = fail, site_keys = site_keys, host_chooser = host_chooser,
  forget_cached = forget_cached, RULE = RULE, RELOAD = RELOAD, MAX_BYTES = MAX_BYTES,
  OWN_TESTS = OWN_TESTS, host_views = host_views,
  KEEP = KEEP, OFFLOAD = OFFLOAD, PARAMETER = PARAMETER, BUFFER = BUFFER, FORWARD = FORWARD,
})
local compose = R.policy
function R.policy(spec) return compose(spec, caller_where()) end

return R
