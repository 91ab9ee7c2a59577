--[[ layers.lua — Transformer Engine / Megatron layer offloading.

Reproduces Transformer Engine's get_cpu_offload_context(enabled=True,
num_layers=N, model_layers=L, offload_activations=True) and Megatron's
--cpu-offloading --cpu-offloading-num-layers N:
  - the activations saved by the first N repeated blocks (layers 0 .. N-1)
    are offloaded; everything outside the blocks (embeddings, head) and the
    later layers stay on device;
  - like TE (num_layers <= model_layers - 1), the last layer is never
    offloaded: backward needs it first;
  - during backward the next layer is prefetched: unpacking a tensor starts
    the reload of one layer's worth of offloaded tensors ahead (the count is
    learned in the first step, then fixed);
  - tensors under 1 MiB elements are not worth a copy in TE
    (min_tensor_size_to_offload = 2**20 elements); here the threshold is in
    bytes, MIN_BYTES below.
The first step learns the prefetch count and caches nothing; the second
stores every answer in the engine's cache; from the third on every answer
comes from it (`ferry check layers --steps 3` shows - / stored / hit).

Knobs: edit the lines below. ]]
local N = 2 -- layers to offload, counted from the first
local MIN_BYTES = 1024
local PREFETCH_LAYERS = 1 -- how many layers ahead to reload in backward

local R = require "ferry.rules"

return R.policy {
  name = "layers",
  R.min_bytes(MIN_BYTES),
  R.exclude_params_and_buffers(),
  R.first_layers(N),
  R.keep_last_layers(1),
  reload = R.prefetch_layers(PREFETCH_LAYERS),
}
