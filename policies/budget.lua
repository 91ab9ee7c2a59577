--[[ budget.lua — default.lua's memory saving at a fraction of its stall.

Where the peak is: with offloading, device memory peaks where the loss is
computed and differentiated, at the end of the forward pass and the start
of backward. Everything still on device then counts: kept tensors,
offloaded ones whose copies have not finished, and the loss's own saved
log-probabilities (fp32, sequence x vocabulary: 3.9 GiB for Llama-3-8B at
8192 tokens) with the logits and gradients around them (another 7.8 GiB
in its backward, docs/sim-synth.md "The loss working set"), which exist
there whatever a policy does. So:
  - the loss is kept (R.LOSS): offloading it cannot lower the peak, and
    backward needs it first — default.lua pays two 3.9 GiB copies for it;
  - every other activation of at least MIN_BYTES goes, the output head's
    inputs included, except BUDGET_BYTES of the last packed (R.budget). On
    a link slower than the forward pass produces activations (H100 PCIe,
    55 GB/s, against 1.28 GiB per 11 ms layer of Llama-3-8B), a byte kept is
    a byte more at the peak, so the default budget is 0; on a faster link
    (GH200) keep the last layer or two: BUDGET_BYTES = their size;
  - offloaded buffers stay alive while their copies run, up to FWD_STASH_BYTES
    of them (and at most FWD_STASH buffers), so the copy stream never waits
    for compute (the forward pass is copy-bound); a byte bound, not a count,
    because an attention block packs many small tensors between large ones;
  - a buffer goes as soon as its copy is done (knob release_when_copied), not
    when the bound pushes it out: no copied buffer is held at the loss, where
    the step peaks (0.43 GiB less there on Llama-3-8B at 8192 tokens), and
    the stash bounds only the copies in flight;
  - reloads are prefetched by bytes (R.prefetch_bytes): while backward runs,
    PREFETCH_BYTES of the tensors it needs next are coming back, whatever
    their sizes; size it above link bandwidth x one layer's backward. The
    library caps the window at what backward frees first (the loss's bytes,
    learned in the first step), and the engine starts one reload while the
    loss is unpacked (knob max_tail_prefetch = 1, which the library sets),
    so prefetching never raises the peak.

Knobs: edit the lines below. ]]
local BUDGET_BYTES = 0 -- kept of the eligible tensors at the peak
local MIN_BYTES = 1024
local FWD_STASH = 16 -- offloaded buffers kept alive while their copies run...
local FWD_STASH_BYTES = 1.25 * 2^30 -- ...and their bytes
local PREFETCH_BYTES = 3 * 2^30 -- reload window in backward

local R = require "ferry.rules"

return R.policy {
  name = "budget",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.LOSS),
  R.exclude_modules(R.LIGER),
  R.budget { bytes = BUDGET_BYTES },
  R.max_stash(FWD_STASH),
  R.max_stash_bytes(FWD_STASH_BYTES),
  reload = R.prefetch_bytes(PREFETCH_BYTES),
  knobs = { release_when_copied = 1 },
}
