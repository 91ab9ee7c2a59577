--[[ fraction.lua — Megatron fine-grained activation offloading.

Reproduces Megatron-LM's --fine-grained-activation-offloading with
--offload-modules core_attn attn_proj expert_fc1 (here: attention core,
attention output projection, and the first MLP/expert projection) and its
activation_offload_fraction:
  - only tensors saved by the selected module kinds are eligible (MODULES);
  - of those, the first FRACTION of each step are offloaded: the earliest,
    which free memory soonest and are reloaded last; the count comes from the
    previous step (the first step spreads them evenly instead);
  - the last layer is kept, like Megatron's offload margin (the last group is
    not offloaded: backward needs it at once);
  - parameters, buffers and tensors under MIN_BYTES stay (Megatron's
    min_offloaded_tensor_size counts elements, 1024*1024 by default; use
    R.min_elements(1024 * 1024) for the same threshold);
  - reload with prefetch, PREFETCH tensors ahead.
The fraction counts tensors within a step: eligible tensors are decided by
Lua until two steps in a row give the same answers, then from the engine's
cache (docs/policy-api.md, "Steady state").

Knobs: edit the lines below. ]]
local FRACTION = 0.5
local MIN_BYTES = 1024
local PREFETCH = 2

local R = require "ferry.rules"
local MODULES = { R.CORE_ATTN, R.ATTN_PROJ, R.FC1 }

return R.policy {
  name = "fraction",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.only_modules(MODULES[1], MODULES[2], MODULES[3]),
  R.keep_last_layers(1),
  R.fraction(FRACTION, "first"),
  reload = R.prefetch(PREFETCH),
}
