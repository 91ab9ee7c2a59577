--[[
ferry.rules_policy — R.policy, the composer of ferry.rules: turns a spec of
rules into the policy table the host calls (decide, explain, step, knobs).
ferry.rules requires it and hands it the helpers its rules share; a policy
requires ferry.rules, never this module.
]]

return function(R, h)
local fail, site_keys = h.fail, h.site_keys
local host_chooser, forget_cached = h.host_chooser, h.forget_cached
local RULE, RELOAD, MAX_BYTES = h.RULE, h.RELOAD, h.MAX_BYTES
local KEEP, OFFLOAD, PARAMETER, BUFFER, FORWARD = h.KEEP, h.OFFLOAD, h.PARAMETER, h.BUFFER,
  h.FORWARD
local OWN_TESTS = h.OWN_TESTS
-- the host's views t and ctx, and the tables behind them (rules.lua); none
-- outside the host
local views = h.host_views or {}
local HOST_T, HOST_T_FIELDS = views.t, views.t_fields
local HOST_CTX, HOST_CTX_FIELDS = views.ctx, views.ctx_fields
local type, tostring, tonumber, ipairs, pairs = type, tostring, tonumber, ipairs, pairs
local getmetatable, setmetatable, next = getmetatable, setmetatable, next
local floor, ceil = math.floor, math.ceil
local find, format = string.find, string.format
local concat = table.concat

local KNOB_LIMITS = {
  max_fwd_stash = { 0, 1048576 },
  prefetch_distance = { 0, 4096 },
  min_offload_bytes = { 0, MAX_BYTES },
  max_fwd_stash_bytes = { 0, MAX_BYTES },
  release_when_copied = { 0, 1 },
  max_tail_prefetch = { 0, 4096 },
  sync_copies = { 0, 2 },
  one_copy_stream = { 0, 1 },
}

local MEMO_LIMIT = 65536 -- distinct module paths remembered before a reset

-- The rules R.policy makes itself (keep_recompute, the merged module rules)
-- remember the policy line that called R.policy, as ferry.rules's own do:
-- ferry.rules passes it (where), this module's frames are not the policy's.
local policy_where
local function rule(spec)
  spec.where = policy_where
  if spec.test then OWN_TESTS[spec.test] = true end
  return setmetatable(spec, RULE)
end

--[[ R.policy(spec) -> a policy table for the policy host:
  spec.name    string (default "policy")
  spec.reload  R.on_use() (default), R.prefetch(d), R.prefetch_layers(k) or
               R.prefetch_bytes(n)
  spec.knobs   engine knobs { max_fwd_stash, prefetch_distance,
               min_offload_bytes, max_fwd_stash_bytes, release_when_copied,
               max_tail_prefetch }; rules may set some (min_bytes sets
               min_offload_bytes, prefetch_bytes sets max_tail_prefetch = 1);
               giving one twice with different values is an error
  spec.cache   false to never let the engine cache a decision
  spec.snapshot  the checkpoint snapshot function, e.g. R.snapshot { ... }
  spec.optimizer which parameters' optimizer states live and step on the
               host: a selector (R.host_fraction(0.5), R.host_modules(...),
               R.host_first_layers(n), R.device_below(n)), a list of them
               (the first with an opinion decides) or a function(r)
  spec.weights   which layers' weights live on the host between uses: the same
  spec[1..n]   the rules
The result has api = 1, name, knobs, decide, and also rules (their names,
in evaluation order) and explain(t, ctx) -> action, rule name, its
"file:line", reload, distance, cacheable, for tools (see explain below).]]
function R.policy(spec, where)
  policy_where = where
  if type(spec) ~= "table" then fail("policy", "expected a table of rules") end
  local name = spec.name or "policy"
  if type(name) ~= "string" then fail("policy", "name must be a string") end
  for k in pairs(spec) do
    if type(k) ~= "number" and k ~= "name" and k ~= "reload" and k ~= "knobs" and k ~= "cache"
      and k ~= "snapshot" and k ~= "optimizer" and k ~= "weights" and k ~= "recompute" then
      fail("policy", "unknown field '" .. tostring(k) ..
        "' (known: name, reload, knobs, cache, snapshot, optimizer, weights, recompute)")
    end
  end
  -- Recompute packs (checkpointing's forward run again inside backward) are
  -- unpacked moments after they are packed: offloading them only adds two
  -- copies, so a policy keeps them unless it says recompute = "decide"
  -- (then its rules decide them like forward packs).
  local recompute = spec.recompute
  if recompute == nil then recompute = "keep" end
  if recompute ~= "keep" and recompute ~= "decide" then
    fail("policy", "recompute must be \"keep\" (the default) or \"decide\", got " ..
      (type(recompute) == "string" and ("\"" .. recompute .. "\"") or type(recompute)))
  end
  local choose = { optimizer = host_chooser("optimizer", spec.optimizer),
                   weights = host_chooser("weights", spec.weights) }
  local resident
  if choose.optimizer or choose.weights then
    resident = function(r)
      local c = choose[r.kind]
      if not c then return false, "no " .. tostring(r.kind) .. " selector", nil end
      return c(r)
    end
  end
  if spec.snapshot ~= nil and type(spec.snapshot) ~= "function" then
    fail("policy", "snapshot must be a function, e.g. R.snapshot { ... }, got " ..
      type(spec.snapshot))
  end
  local reload = spec.reload or R.on_use()
  if getmetatable(reload) ~= RELOAD then
    fail("policy", "reload must be R.on_use(), R.prefetch(d), R.prefetch_layers(k) or " ..
      "R.prefetch_bytes(n)")
  end
  local cache_allowed = spec.cache ~= false

  -- knobs: from rules, then spec.knobs; validated here so a typo fails at load
  local knobs, knob_source = {}, {}
  local function set_knob(k, v, source)
    local lim = KNOB_LIMITS[k]
    if not lim then
      fail("policy", "unknown knob '" .. tostring(k) ..
        "' (known: max_fwd_stash, prefetch_distance, min_offload_bytes, " ..
        "max_fwd_stash_bytes, release_when_copied, max_tail_prefetch, sync_copies, " ..
        "one_copy_stream)", 3)
    end
    if type(v) ~= "number" or v ~= floor(v) or v < lim[1] or v > lim[2] then
      fail("policy", format("knob %s must be an integer within [%d, %.0f], got %s",
        k, lim[1], lim[2], tostring(v)), 3)
    end
    if knobs[k] ~= nil and knobs[k] ~= v then
      fail("policy", format("knob %s set twice: %s by %s, %s by %s", k,
        tostring(knobs[k]), knob_source[k], tostring(v), source), 3)
    end
    knobs[k], knob_source[k] = v, source
  end

  -- sort rules into stages, keeping the written order within a stage
  local stages = { [1] = {}, [2] = {}, [3] = {}, [4] = {}, [5] = {} }
  local modules = {}
  if recompute == "keep" then
    local keep = rule {
      name = "keep_recompute()", stage = 1, scope = "site",
      test = function(t) return t.phase == FORWARD end,
    }
    stages[1][1] = keep
  end
  local n = #spec
  for i = 1, n do
    local r = spec[i]
    if getmetatable(r) ~= RULE then
      fail("policy", "entry " .. i .. " is not a rule (got " .. type(r) ..
        "); build rules with R.min_bytes(...), R.exclude_modules(...), ...")
    end
    if r.knobs then
      for k, v in pairs(r.knobs) do set_knob(k, v, r.name) end
    end
    if r.module then
      modules[#modules + 1] = r
    elseif r.stage > 0 then
      local list = stages[r.stage]
      list[#list + 1] = r
    end
  end
  -- a byte window opens once backward has passed the loss (the tail)
  if reload.bytes then set_knob("max_tail_prefetch", 1, reload.name) end
  if spec.knobs ~= nil then
    if type(spec.knobs) ~= "table" then fail("policy", "knobs must be a table") end
    for k, v in pairs(spec.knobs) do set_knob(k, v, "knobs") end
  end

  -- All module rules become one site filter with a memo per path string, so
  -- the matchers (string.find) run once per module, not once per tensor.
  if #modules > 0 then
    local nmod = #modules
    local by_path, by_class, memo_size = {}, {}, 0
    local names = {}
    for i = 1, nmod do names[i] = modules[i].name end
    local function verdict(path, class)
      for i = 1, nmod do
        local m = modules[i]
        if m.matches(path, class) == m.exclude then return i end
      end
      return 0
    end
    local merged = rule {
      name = concat(names, ", "), stage = 1, scope = "site",
      test = function(t, _, path)
        path = path or t:path()
        local v
        if path ~= "" then
          v = by_path[path]
          if v == nil then
            v = verdict(path, t:class())
            if memo_size >= MEMO_LIMIT then by_path, by_class, memo_size = {}, {}, 0 end
            by_path[path] = v
            memo_size = memo_size + 1
          end
        else
          local class = t:class()
          v = by_class[class]
          if v == nil then
            v = verdict("", class)
            by_class[class] = v
          end
        end
        return v == 0
      end,
    }
    merged.which = function(t)
      local i = verdict(t:path(), t:class())
      return i > 0 and modules[i] or nil
    end
    -- module filters after the cheap field filters of stage 1
    stages[1][#stages[1] + 1] = merged
  end

  -- flatten into arrays the decide loop indexes by number. The tests run on
  -- the host's field tables when decide got the host's t and ctx (fields
  -- read directly); a test the policy wrote gets the read-only views.
  -- The views are found from the arguments, not kept from decide: a
  -- policy's function may call this decide again (about another tensor).
  local function on_views(fn)
    return function(t, ctx)
      if t == HOST_T_FIELDS then t = HOST_T end
      if ctx == HOST_CTX_FIELDS then ctx = HOST_CTX end
      return fn(t, ctx)
    end
  end
  local tests, scopes, names = {}, {}, {}
  local selector = nil -- the last selector: the reason for an offload, if any
  local nfilter, nguard, nselect = 0, 0, 0
  local learned = {} -- selectors whose answer depends on the site once ready
  local on_steps = {}
  local discards = {} -- called before on_steps after a step only partly counted
  for s = 1, 5 do
    for _, r in ipairs(stages[s]) do
      local i = #tests + 1
      local test = r.test
      if test and not OWN_TESTS[test] then test = on_views(test) end
      tests[i], scopes[i], names[i] = test, r.scope, r
      if r.discard then discards[#discards + 1] = r.discard end
      if s <= 3 then nfilter = nfilter + 1
      elseif s == 4 then
        if not r.per_step then nguard = nguard + 1 end
      elseif r.learned then learned[#learned + 1] = r
      else nselect = nselect + 1 end
      if s == 5 then selector = r end
      if r.on_step then on_steps[#on_steps + 1] = r.on_step end
    end
  end
  local ntest = #tests
  local nstep = #on_steps

  -- reload: fixed, or learned (tensors per layer) and then fixed
  local rmode, rdist = reload.mode, reload.distance
  local learning = reload.learn == true
  local per_layer, learned_max = {}, 0
  local function finish_learning()
    if learned_max > 0 then
      rdist = ceil(reload.layers * learned_max)
      if rdist > 4096 then rdist = 4096 end
      learning = false
      per_layer = nil
    end
  end
  if learning then
    on_steps[#on_steps + 1] = function()
      if learning then finish_learning() end
      if learning then per_layer = {}; learned_max = 0 end
    end
    nstep = #on_steps
  end

  -- reload window in bytes: cumulative sizes of this step's offloaded
  -- tensors by engine position (ctx.offloaded_this_step), reused every step
  local window = reload.bytes
  local win_sum, win_stamp, win_first, win_step = {}, {}, 0, 0
  local win_count = 0 -- offloads this step
  local tail, freed = 0, nil -- kept bytes since the last offload; learned
  local function window_distance(pos, b)
    win_count = pos + 1
    tail = 0
    local limit = 0 -- one tensor
    if freed then limit = freed < window and freed or window end
    local before = 0
    if pos > 0 and win_stamp[pos - 1] == win_step then
      before = win_sum[pos - 1]
    else
      win_first = pos -- a gap (a cached or refused offload): start over here
    end
    local total = before + b
    win_sum[pos], win_stamp[pos] = total, win_step
    -- the smallest j >= win_first with total - sum(j - 1) <= limit
    local lo, hi = win_first, pos
    while lo < hi do
      local mid = floor((lo + hi) / 2)
      local below = mid > win_first and win_sum[mid - 1] or 0
      if total - below <= limit then hi = mid else lo = mid + 1 end
    end
    local d = pos - lo + 1
    return d > 4096 and 4096 or d
  end
  if window then
    discards[#discards + 1] = function() win_count = 0 end
    on_steps[#on_steps + 1] = function()
      if win_count > 0 and not freed then freed = tail end
      win_count, tail, win_step = 0, 0, win_step + 1
    end
    nstep = #on_steps
  end

  local nlearned = #learned
  local offload_cacheable = cache_allowed and nguard == 0 and nselect == 0
  local any_layer_scope, any_tensor_scope = false, false
  for i = 1, nfilter do
    if scopes[i] == "layer" then any_layer_scope = true end
    if scopes[i] == "tensor" then any_tensor_scope = true end
  end
  if any_tensor_scope then offload_cacheable = false end

  -- Steady state. Selectors and byte windows count within a step, so their
  -- answers are not the site's alone, but a training loop packs the same
  -- sites in the same order every step: once two whole steps in a row gave
  -- every site one answer, and the same answer in both, the next steps would
  -- too, and the answers are frozen and cached by the engine. A site the
  -- frozen steps did not have thaws them: the engine forgets its cache and
  -- every rule counts again (from that tensor on, for the rest of the step).
  local freezable = cache_allowed and nguard == 0 and not any_tensor_scope
    and (nselect > 0 or window ~= nil)
  local FREEZE_MAX = 16384 -- the engine's site cache holds no more
  local current_step = nil
  local last_rule = 0 -- index of the rule that kept the last tensor, 0 = offloaded
  local site_id = site_keys()
  -- this step: site id -> answer code ((rule index * 2 + action) * 8192 +
  -- distance + 1; rule index 0 = offloaded)
  local sig, sig_n, mixed = {}, 0, false
  local sig_prev, sig_prev_n, frozen = nil, 0, nil
  local function same(a, an, b, bn)
    if an ~= bn then return false end
    for k, v in pairs(b) do
      if a[k] ~= v then return false end
    end
    return true
  end
  if freezable then
    on_steps[#on_steps + 1] = function()
      if frozen then return end
      if sig_n > 0 and not mixed then
        if sig_prev and same(sig_prev, sig_prev_n, sig, sig_n) then
          frozen = sig
          return
        end
        sig_prev, sig_prev_n = sig, sig_n
      else
        sig_prev = nil
      end
      sig, sig_n, mixed = {}, 0, false
    end
    nstep = #on_steps
  end
  local function note(t, action, dist, path)
    if mixed then return end
    local id = site_id(t, path)
    local code = (last_rule * 2 + action) * 8192 + (dist or -1) + 1
    local old = sig[id]
    if old == nil then
      if sig_n >= FREEZE_MAX then mixed = true; return end
      sig[id], sig_n = code, sig_n + 1
    elseif old ~= code then
      mixed = true
    end
  end

  -- Whether the answers may be cached: once every learned part has
  -- learned. That changes only in the step functions (a learned rule's
  -- ready() turns true in its on_step), so it is found after them, not
  -- per decision.
  local function find_stable()
    local s = not learning and not (window and not freed)
    for i = 1, nlearned do
      if not learned[i].ready() then s = false end
    end
    return s
  end
  local stable = find_stable()

  local needs_path = #modules > 0 or nlearned > 0 or any_layer_scope or freezable

  local partial = false -- this step was counted from a thaw on
  local function run_steps(step, ctx)
    current_step = step
    if partial then
      partial = false
      for i = 1, #discards do discards[i]() end
    end
    for i = 1, nstep do on_steps[i](step, ctx) end
    stable = find_stable()
  end

  -- keep_recompute(), when the policy keeps recompute packs, is the first
  -- test: decide checks it inline (one field read instead of a call per
  -- tensor).
  local recompute_first = recompute == "keep"
  local first_test = recompute_first and 2 or 1

  -- decide(t, ctx) -> action, reload, distance, cacheable. Allocates nothing
  -- per call once the steps repeat.
  local function decide(t, ctx)
    local tf, cf = t, ctx
    if t == HOST_T then tf = HOST_T_FIELDS end
    if ctx == HOST_CTX then cf = HOST_CTX_FIELDS end
    if nstep > 0 then
      -- the host's field is a number already
      local step = cf.step
      if cf ~= HOST_CTX_FIELDS then step = tonumber(step) end
      if step ~= current_step then run_steps(step, ctx) end
    end
    -- t:path() is a C call: made once, here, when some part reads it
    local path = needs_path and tf:path() or nil
    if frozen then
      local code = frozen[site_id(tf, path)]
      if code then
        local low = code % 8192 -- (code - low) / 8192 is exact: no floor call
        local d, hi = low - 1, (code - low) / 8192
        local action = hi % 2
        last_rule = (hi - action) / 2
        return action, rmode, d >= 0 and d or nil, true
      end
      frozen, sig_prev, sig, sig_n, mixed, partial = nil, nil, {}, 0, true, true
      forget_cached()
    end
    -- the rules themselves -> action, dist, ok_cache (written out here,
    -- not called: a Lua call costs the interpreter about what six field
    -- reads do); t and ctx in the block: the field tables
    local action, dist, ok_cache
    do
      local t, ctx = tf, cf
      local kept = 0 -- index of the rule that kept the tensor
      if recompute_first and t.phase ~= FORWARD then
        kept = 1
      else
        local tests_, path_ = tests, path
        for i = first_test, ntest do
          if not tests_[i](t, ctx, path_) then kept = i; break end
        end
      end
      if kept > 0 then
        local i = kept
        if window and not freed then
          local kind = t.kind
          if kind ~= PARAMETER and kind ~= BUFFER then tail = tail + tonumber(t.bytes) end
        end
        local cacheable = false
        local r = names[i]
        if (i <= nfilter or r.learned or r.per_step) and cache_allowed and stable then
          local scope = scopes[i]
          if scope == "site" then
            cacheable = true
          elseif scope == "layer" then
            cacheable = (path or t:path()) ~= ""
          end
        end
        last_rule = i
        action, dist, ok_cache = KEEP, rdist, cacheable
        goto decided
      end
      if learning then
        local layer = t.layer
        if layer >= 0 then
          local c = (per_layer[layer] or 0) + 1
          per_layer[layer] = c
          if c > learned_max then learned_max = c end
        end
      end
      local cacheable = offload_cacheable and stable
      if cacheable and (any_layer_scope or nlearned > 0) then
        cacheable = (path or t:path()) ~= ""
      end
      last_rule = 0
      if window then
        action, dist, ok_cache = OFFLOAD,
          window_distance(tonumber(ctx.offloaded_this_step), tonumber(t.bytes)), cacheable
        goto decided
      end
      action, dist, ok_cache = OFFLOAD, rdist, cacheable
    end
    ::decided::
    if freezable then note(tf, action, dist, path) end
    return action, rmode, dist, ok_cache
  end

  local order = {}
  for i = 1, ntest do order[i] = names[i].name end

  -- explain(t, ctx) -> action, rule, where, reload, distance, cacheable:
  -- decide's answer with its reason, the name of the rule that made it and
  -- "file:line" where the policy wrote that rule. A keep: the rule that kept
  -- the tensor. An offload: the last selector (fraction, budget, ...), which
  -- chose it; without one, "all rules passed" and no line (the policy host
  -- puts the policy's `return` line there). It runs decide, so selectors
  -- count the tensor like a real decision: call it instead of decide, not
  -- besides. For tools (ferry_policy_explain, `ferry check`) and for an
  -- engine counting reasons (config.count_reasons).
  local function explain(t, ctx)
    local action, rl, dist, cacheable = decide(t, ctx)
    local i = last_rule
    local r
    if i == 0 then
      r = selector
      if not r then return action, "all rules passed", nil, rl, dist, cacheable end
    else
      r = names[i]
      if r.which then r = r.which(t) or r end
    end
    return action, r.name, r.where, rl, dist, cacheable
  end

  return {
    api = 1,
    name = name,
    knobs = next(knobs) ~= nil and knobs or nil,
    decide = decide,
    step = nstep > 0 and function(ctx) run_steps(tonumber(ctx.step), ctx) end or nil,
    explain = explain,
    rules = order,
    reload = reload.name,
    snapshot = spec.snapshot,
    resident = resident,
  }
end

end
