--[[ wait_each.lua — offloading that waits on each copy right after issuing
it, as compiled offloaders schedule it (a device-to-host copy followed by a
wait on it before the next kernel that may reuse the buffer; reloads the
same before their first use).

The selection is default.lua's (saved tensors of at least 1024 bytes, no
parameters or buffers, the output head and Liger modules kept), so the
difference from default.lua is the waiting alone: the compute stream waits
for every copy (sync_copies "compute"), the host runs on; nothing is held
on the device while a copy runs (no forward stash); reload on use.

Knobs: edit the lines below. ]]
local MIN_BYTES = 1024

local R = require "ferry.rules"

return R.policy {
  name = "wait_each",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.HEAD),
  R.exclude_modules(R.LIGER),
  R.max_stash(0),
  R.sync_copies("compute"),
  reload = R.on_use(),
}
