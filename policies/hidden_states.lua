--[[ hidden_states.lua — axolotl's `activation_offloading: hidden_states`,
costed as it runs (to set ferry beside it in `ferry sim`).

Gradient checkpointing keeps only each decoder layer's input; axolotl moves
that one tensor per layer to pinned host memory. It has two implementations,
and they differ in how they wait and when they reload:

  - non-reentrant (the default since axolotl PR #3776,
    src/axolotl/monkeypatch/checkpoint_activation_offload.py,
    CheckpointHiddenStatesOffload): a saved-tensor hook offloads the input
    every checkpointed layer marks (the last layer's too) on one side stream;
    at most max_fwd_stash_size = 2 device copies are held while their copies
    run, older ones are waited for (s0.wait_event); the reload is issued at
    unpack, when backward needs the tensor, and the compute stream waits for
    it: no prefetch; but the side stream does not wait for compute first, so
    a host running ahead of the GPU starts it early (ferry's R.on_use()
    below waits for compute: the latest placement; docs/sim-validation.md
    brackets it with a reload one ahead). Host buffers come from its own
    pool, exact sizes.
  - reentrant (`use_reentrant: true`, axolotl PR #3733, "ALST-style",
    src/axolotl/monkeypatch/activation_offload_checkpoint.py,
    HiddenStatesOffloadCheckpoint): the same tensor on the same kind of side
    stream; a device input is dropped at the next offload once its copy is
    done (ev.query()), and with more than max_inflight = 2 copies in flight
    the host waits for the oldest (Event.synchronize()); in backward the
    layer's input is restored and the next one (the layer before) is
    prefetched, so only the first reload of backward is on demand.
Both use ONE side stream for both directions (a reload queues behind the
offloads still on it): R.one_copy_stream().

Here: a repeated block's own saved input (as checkpointed_inputs.lua), the
last block's included, parameters never; at most 2 device buffers kept
(ferry's stash bound makes the host wait for the oldest, as the reentrant
version does; the non-reentrant one makes only the GPU wait, which costs the
same GPU time): the non-reentrant one keeps the 2 newest whether copied or
not (a tensor still there at unpack is used as is), the reentrant one drops
each once its copy is done (release_when_copied); reload on use
(non-reentrant) or one tensor ahead (reentrant). Use it with `--checkpoint full` (non-reentrant) or
`--checkpoint full --checkpoint-impl reentrant`.
Not modelled: the reentrant checkpoint's own cost beside the default one
(docs/sim-validation.md, "Validation: memory and cost").

Knobs: edit the lines below. ]]
local REENTRANT = false -- true: the reentrant (ALST-style) implementation
local FWD_STASH = 2     -- max_fwd_stash_size / max_inflight, both 2

local R = require "ferry.rules"

-- a repeated block itself: no digit before the path's final numeric part
local BLOCK = { pattern = { "^[^%d]*%.%d+$" } }

return R.policy {
  name = "hidden_states",
  R.exclude_params_and_buffers(),
  R.only_modules(BLOCK),
  R.max_stash(FWD_STASH),
  R.one_copy_stream(),
  knobs = REENTRANT and { release_when_copied = 1 } or nil,
  reload = REENTRANT and R.prefetch(1) or R.on_use(),
}
