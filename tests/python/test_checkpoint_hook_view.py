"""What ferry's saved-tensor hook receives of a checkpointed block, per
implementation: the simulator's --checkpoint-impl table (docs/sim-synth.md,
"What a policy can see") rests on it. Reentrant: the block's input
(CheckpointFunction's save_for_backward) and, in backward, the recomputed
saves. Non-reentrant, torch 2: the block's input too (saved through
_NoopSaveInputs, outside the checkpoint's own hooks), nothing recomputed.
torch 1.13's non-reentrant checkpoint saved nothing ferry sees."""
import torch

import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss, read_trace

LAYERS = 4


def forward_and_recompute_packs(mode, trace):
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, checkpoint=mode)
    batch = gpt_batch()
    with ft.offload(model, policy="default", record_trace=trace):
        gpt_loss(model, batch).backward()
    ft.step()
    ft.close()  # flushes the trace
    packs = [e for e in read_trace(trace) if e["ev"] == "pack"]
    return (sum(p["phase"] == "forward" for p in packs),
            sum(p["phase"] == "recompute" for p in packs))


def test_checkpointed_block_input_reaches_the_hook(tmp_path):
    fwd_r, rec_r = forward_and_recompute_packs("reentrant", str(tmp_path / "r.jsonl"))
    fwd_n, rec_n = forward_and_recompute_packs("non_reentrant", str(tmp_path / "n.jsonl"))
    assert rec_r > 0 and rec_n == 0
    torch2 = int(torch.__version__.split(".")[0]) >= 2
    # the ops outside the blocks are packed alike; the blocks add their inputs
    assert fwd_n == (fwd_r if torch2 else fwd_r - LAYERS), (fwd_r, fwd_n)
