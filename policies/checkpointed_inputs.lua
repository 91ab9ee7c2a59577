--[[ checkpointed_inputs.lua — offload only what full checkpointing keeps.

With full activation checkpointing a block keeps just its input from
forward to backward (the rest is recomputed), and on long sequences those
inputs are what is left to grow with the layers: seq x hidden x 2 bytes per
block (Llama-3-8B at 128k tokens: 1 GiB a block, 32 GiB for 32). Long-context
trainers move exactly these to the host: DeepSpeed's activation
checkpointing with "cpu_checkpointing": true (used with Ulysses sequence
parallelism for million-token runs), Unsloth's offloaded gradient
checkpointing (use_gradient_checkpointing="unsloth"). This policy does
the same:
  - only a block's own saved input goes: a pack whose module path is a
    repeated block itself ("model.layers.5", "layers.5", "transformer.h.5"),
    not a module inside one; embeddings, head, loss and parameters stay;
  - the last block's input stays (its backward comes first, a reload would
    wait on the critical path);
  - during backward the next block's input is prefetched one layer ahead,
    behind the current block's recompute and backward;
  - packs made while recomputing stay (R.policy's default).
Without checkpointing nothing in a block is saved under the block's own path
but its input-norm's input under some layouts; use it with
`--checkpoint full` (torch.utils.checkpoint per block).
In a real run the checkpoint must run inside the block's own module, as
torchtitan's checkpoint_wrapper does: a checkpoint called from the parent's
forward (`x = checkpoint(block, x)` in the model's loop) saves the input
before the block's hooks run, so ferry sees it under the parent's path and
this policy keeps it.

Knobs: edit the lines below. ]]
local KEEP_LAST = 1 -- blocks at the end whose input stays on the device
local PREFETCH_LAYERS = 1 -- how many blocks ahead to reload in backward
local FWD_STASH = 2 -- device buffers kept while their copies run

local R = require "ferry.rules"

-- a repeated block itself: no digit before the path's final numeric part
local BLOCK = { pattern = { "^[^%d]*%.%d+$" } }

return R.policy {
  name = "checkpointed_inputs",
  R.exclude_params_and_buffers(),
  R.only_modules(BLOCK),
  R.keep_last_layers(KEEP_LAST),
  R.max_stash(FWD_STASH),
  reload = R.prefetch_layers(PREFETCH_LAYERS),
}
