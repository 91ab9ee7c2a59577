--[[ budget.lua — aim for a device-memory budget, hide reloads.

The same eligible tensors as default.lua (activations of at least 1024
bytes, no parameters or buffers, no head, no Liger modules), but instead of
offloading all of them:
  - the budget: at the end of the forward pass, when saved activations peak,
    at most BUDGET of them stay on device. From the previous step's total T,
    the policy offloads tensors in pack order until T - BUDGET bytes are
    off, and keeps the rest. The kept ones are the last packed, i.e. the
    last layer(s), which backward needs first: no reload for them at all.
    The offloaded ones are the first packed, reloaded last, with the most
    time to bring them back. The first step offloads everything (T unknown).
  - reloads are prefetched PREFETCH_LAYERS layers ahead (the number of
    tensors per layer is learned in the first step): while backward works
    on layer i, layer i-1 is already coming back.
BUDGET is one layer's worth by default (BUDGET_LAYERS); set BUDGET_BYTES to
an absolute number of bytes instead.

Knobs: edit the lines below. ]]
local BUDGET_BYTES = nil -- e.g. 8 * 2^30; nil = BUDGET_LAYERS layers' worth
local BUDGET_LAYERS = 1
local PREFETCH_LAYERS = 1
local MIN_BYTES = 1024
local FWD_STASH = 4 -- offloaded buffers kept alive while their copies run

local R = require "ferry.rules"

return R.policy {
  name = "budget",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.HEAD),
  R.exclude_modules(R.LIGER),
  R.budget(BUDGET_BYTES and { bytes = BUDGET_BYTES } or { layers = BUDGET_LAYERS }),
  R.max_stash(FWD_STASH),
  reload = R.prefetch_layers(PREFETCH_LAYERS),
}
