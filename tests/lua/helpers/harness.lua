--[[ harness.lua — drives the real libferry (host backend) through the
binding in bindings/lua/ferry.lua, for the busted specs.

  local H = require "harness"
  local s = H.session { policy_path = "policies/default.lua" }
  assert.equal("offload", s:pack { bytes = 4096, path = "model.layers.0.mlp" })
  s:finish_step()     -- backward: unpack everything, check every byte
  s:close()

s:pack reports the engine's decision for that tensor from the change of
stats.tensors_offloaded, so every assertion goes through the engine and
the real policy host. Buffers are malloc'd "device" memory (the host
backend's device is host memory) filled with a pattern that depends on
the tensor, and checked bit for bit when unpacked. ]]
local ffi = require "ffi"
local ferry = require "ferry"

local H = {}
H.ferry = ferry
H.root = (debug.getinfo(1, "S").source:match("^@(.-)tests/lua/helpers/[^/]*$") or "")
if H.root == "" then H.root = "./" end

local Session = {}
Session.__index = Session

function H.session(opts)
  opts = opts or {}
  local dev = ferry.malloc_device()
  local cfg = { backend = "host", arena = opts.arena or "auto", device = dev }
  for k, v in pairs(opts) do cfg[k] = v end
  if cfg.policy_path and not cfg.policy_path:match("^/") then
    cfg.policy_path = H.root .. cfg.policy_path
  end
  local e, err = ferry.engine(cfg)
  assert(e, err)
  return setmetatable({ e = e, dev = dev, live = {}, serial = 0, decisions = {} }, Session)
end

local function pattern(serial)
  return function(i) return (i * 31 + serial * 17 + 5) % 256 end
end

-- Pack one tensor described by spec (see Engine:desc); returns "offload"
-- or "keep" as the engine decided, and the handle.
function Session:pack(spec)
  local e = self.e
  local bytes = spec.bytes or 4096
  spec.bytes = bytes
  self.serial = self.serial + 1
  local fill = pattern(self.serial)
  local ptr, owner = self.dev:new_buffer(bytes, fill)
  local before = e:stats().tensors_offloaded
  local d = e:desc(spec)
  local h, err = e:pack(d, ptr, owner)
  assert(h, err)
  local after = e:stats().tensors_offloaded
  local decision = after > before and "offload" or "keep"
  self.live[#self.live + 1] = { h = h, bytes = bytes, fill = fill, spec = spec, decision = decision }
  self.decisions[#self.decisions + 1] = decision
  return decision, h
end

-- Backward: unpack every live handle in reverse pack order, check the
-- bytes, give the buffers back; then end the step.
function Session:finish_step()
  local e = self.e
  assert(e:backward_begin())
  for i = #self.live, 1, -1 do
    local t = self.live[i]
    local ptr, owner = e:unpack(t.h)
    assert(ptr, owner)
    local b = ffi.cast("uint8_t *", ptr)
    for j = 0, t.bytes - 1 do
      if b[j] ~= t.fill(j) then
        error(string.format("tensor %d (%s) came back different at byte %d", i,
          tostring(t.spec.path), j))
      end
    end
    self.dev:release(owner)
  end
  self.live = {}
  assert(e:backward_end())
  assert(e:step_end())
  local d = self.decisions
  self.decisions = {}
  return d
end

-- Pack a list of specs as one step; returns the list of decisions.
function Session:step(specs)
  for _, s in ipairs(specs) do self:pack(s) end
  return self:finish_step()
end

function Session:stats() return self.e:stats() end

function Session:close()
  self.e:destroy()
  self.dev:free_callbacks()
end

-- A small transformer's saved tensors, in pack order: embedding output,
-- then per layer the tensors HF Llama-style modules save, then the final
-- norm and the head. bytes per tensor = unit.
function H.transformer(layers, unit)
  unit = unit or 4096
  local specs = {}
  local function add(path, class, layer, bytes, kind)
    specs[#specs + 1] = { path = path, class = class, layer = layer or -1,
      layer_count = layers, bytes = bytes or unit, kind = kind }
  end
  add("model.embed_tokens", "Embedding")
  for l = 0, layers - 1 do
    local p = "model.layers." .. l .. "."
    add(p .. "input_layernorm", "LlamaRMSNorm", l)
    add(p .. "self_attn.q_proj", "Linear", l)
    add(p .. "self_attn.k_proj", "Linear", l)
    add(p .. "self_attn", "LlamaAttention", l)
    add(p .. "self_attn.o_proj", "Linear", l)
    add(p .. "post_attention_layernorm", "LlamaRMSNorm", l)
    add(p .. "mlp.up_proj", "Linear", l)
    add(p .. "mlp.act_fn", "SiLU", l)
    add(p .. "mlp.down_proj", "Linear", l)
  end
  add("model.norm", "LlamaRMSNorm")
  add("lm_head", "Linear", -1, unit * 4)
  return specs
end

-- Indices (1-based) of the specs whose decision is d.
function H.where(decisions, d)
  local out = {}
  for i, x in ipairs(decisions) do if x == d then out[#out + 1] = i end end
  return out
end

return H
