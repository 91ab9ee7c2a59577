--[[ host_budget.lua — as much as a host byte budget per rank holds, the
largest tensors first, the last layers kept on device.

The policy most multi-GPU runs need: each rank has a share of the node's
pinned RAM (RAM / GPUs per node, less what the dataloader and the
optimizer's CPU side take). Offloading a byte costs a copy each way
whatever the tensor, but a large tensor pays the per-copy latency once
for many bytes, so for the same host bytes the largest tensors give the
most device memory for the least copy time:
  - R.host_budget: the first step offloads in pack order while the budget
    allows and learns the step's tensors; from the second step on it
    offloads whole sites (module path + size + dtype + kind) largest first
    while their bytes fit, and the engine caches every answer;
  - the last KEEP_LAST layers stay on device: backward needs them first, a
    reload of them could not be hidden behind any compute;
  - the loss's saved log-probabilities stay (budget.lua explains why);
  - reloads come PREFETCH_LAYERS layers ahead in backward.

Knobs: edit the lines below (`ferry sim --fit` writes this file with its
choice). ]]
local HOST_BYTES = 16 * 2^30 -- host budget per rank
local KEEP_LAST = 1 -- layers kept on device, from the last
local MIN_BYTES = 1024
local FWD_STASH = 4 -- offloaded buffers kept alive while their copies run
local PREFETCH_LAYERS = 1 -- how many layers ahead to reload in backward

local R = require "ferry.rules"

return R.policy {
  name = "host_budget",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.LOSS),
  R.exclude_modules(R.LIGER),
  R.host_budget { bytes = HOST_BYTES, keep_last = KEEP_LAST },
  R.max_stash(FWD_STASH),
  reload = R.prefetch_layers(PREFETCH_LAYERS),
}
