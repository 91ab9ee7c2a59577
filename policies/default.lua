--[[ default.lua — today's torchtune / TRL activation offloading.

Reproduces torchtune's OffloadActivations and TRL's
get_act_offloading_ctx_manager with their defaults:
  - saved tensors of at least 1024 bytes are offloaded (min_offload_size=1024);
  - parameters and buffers are never offloaded (isinstance checks, and TRL's
    parameter-storage check: the embedder marks such tensors PARAMETER);
  - the output head and final norms are kept (TRL's NoOpManager around
    output / lm_head / ln_f / final_layer_norm / head; torchtune's recipes
    around model.output): their activations are needed first in backward;
  - modules whose name or class contains "liger" are kept (TRL);
  - reload on use; 5 device buffers kept alive in the forward stash while
    their copies run (max_fwd_stash_size=5, use_streams=True).
Every answer depends only on the tensor's site, so after the first step the
engine answers from its cache and never calls Lua.

Checkpoint snapshots (ferry.torch.snapshot, the Lightning plugin and
callback) ask `snapshot`: by default every tensor of every top-level key is
staged through the pinned arena while training goes on, in the order
torch.save would write it; nothing is copied while the loop waits.

Knobs: edit the lines below. ]]
local MIN_BYTES = 1024 -- torchtune/TRL min_offload_size
local FWD_STASH = 5 -- torchtune/TRL max_fwd_stash_size
-- snapshots: top-level keys staged (nil = all; Lightning's CPUOffloadCallback
-- uses { "state_dict", "optimizer_states", "lr_schedulers" }), smaller
-- tensors copied at start instead, keys written first
local SNAPSHOT_KEYS = nil
local SNAPSHOT_MIN_BYTES = 0
local SNAPSHOT_ORDER = nil

local R = require "ferry.rules"

return R.policy {
  name = "default",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.exclude_modules(R.HEAD),
  R.exclude_modules(R.LIGER),
  R.max_stash(FWD_STASH),
  reload = R.on_use(),
  snapshot = R.snapshot { keys = SNAPSHOT_KEYS, min_bytes = SNAPSHOT_MIN_BYTES,
                          order = SNAPSHOT_ORDER },
}
