--[[ save_on_cpu.lua — torch.autograd.graph.save_on_cpu(), costed as it runs.

What torch's own hooks do (torch/autograd/graph.py, class save_on_cpu):
  - pack: every saved tensor goes to the CPU, whatever its size or kind
    (parameters saved for backward too: the hook cannot tell them apart);
    with the default pin_memory=False by `tensor.cpu()`, a blocking copy:
    the host waits for it, and what the GPU runs next comes after it;
  - unpack: `tensor.to(device, non_blocking=pin_memory)`, when backward asks
    for the tensor, never ahead: blocking with pin_memory=False;
  - nothing is held on the device while a copy runs (the copy is done when
    pack returns), so there is no stash and no stash hit.
Here: every pack offloaded, reload on use, the host waits for each copy
(sync_copies "host"), no forward stash. For save_on_cpu(pin_memory=True)
on torch 2.x, whose pack is `copy_(tensor, non_blocking=True)` into pinned
memory on the compute stream (torch 1.13's was blocking), use
R.sync_copies("compute"): the GPU still waits for every copy, the host not.
Not modelled: its pageable (pin_memory=False) copies run slower than the
pinned link the simulator prices (docs/hardware.md), and a tensor saved
twice is copied twice (ferry copies its buffer once).

Knobs: edit the line below. ]]
local WHO_WAITS = "host" -- "compute" for save_on_cpu(pin_memory=True), torch 2.x

local R = require "ferry.rules"

return R.policy {
  name = "save_on_cpu",
  R.min_bytes(0),
  R.max_stash(0),
  R.sync_copies(WHO_WAITS),
  reload = R.on_use(),
}
