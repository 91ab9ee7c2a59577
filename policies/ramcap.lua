--[[ ramcap.lua — default.lua plus an enforced host RAM cap.

torchtune and TRL check psutil.virtual_memory().percent once, at the first
backward, and only warn past 60%. This policy is default.lua (activations
of at least 1024 bytes, no parameters or buffers, no head, no Liger
modules, reload on use) with the 60% made a rule: while the host's RAM use
(sampled by the engine) is at or above RAM_PCT, new tensors stay on device.
The engine samples the RAM use once per step, so every answer is cached,
and forgotten at the begin of a step where the reading has crossed RAM_PCT.

Knobs: edit the lines below. ]]
local RAM_PCT = 60
local MIN_BYTES = 1024
local FWD_STASH = 5

local R = require "ferry.rules"

return R.policy {
  name = "ramcap",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.HEAD),
  R.exclude_modules(R.LIGER),
  R.ram_cap(RAM_PCT),
  R.max_stash(FWD_STASH),
  reload = R.on_use(),
}
