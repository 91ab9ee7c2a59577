"""Recompute packs (reentrant checkpointing's forward run again inside a
backward that runs in the context, as the trainer callbacks and TRL do) are
unpacked moments after they are packed: every shipped policy keeps them;
at f9032b9 the shipped policies offloaded up to half of them for
nothing (default.lua: 48 of 104 per step on this model)."""
import pytest
import torch

import ferry.torch as ft
from conftest import GPT, SHIPPED_POLICIES, assert_bit_identical, gpt_batch, gpt_loss, read_trace


def backward_inside(policy, trace):
    torch.manual_seed(0)
    model = GPT(checkpoint="reentrant")
    batch = gpt_batch()
    with ft.offload(model, policy=policy, record_trace=trace):
        gpt_loss(model, batch).backward()
    ft.step()
    stats = ft.stats()
    ft.close()  # flushes the trace
    return model, stats, [e for e in read_trace(trace) if e["ev"] == "pack"]


@pytest.mark.parametrize("policy", SHIPPED_POLICIES)
def test_shipped_policies_keep_recompute_packs(policy, tmp_path):
    model, stats, packs = backward_inside(policy, str(tmp_path / "t.jsonl"))
    recompute = [p for p in packs if p["phase"] == "recompute"]
    assert stats["recompute_packs"] > 0 and len(recompute) == stats["recompute_packs"]
    assert [p for p in recompute if p["decision"] == "offload"] == []
    torch.manual_seed(0)
    ref = GPT(checkpoint="reentrant")
    gpt_loss(ref, gpt_batch()).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_bit_identical(p.grad, q.grad, f"grad {n}")


def test_recompute_decide_lets_the_rules_offload_them(tmp_path):
    """recompute = "decide" hands them to the rules again (what every policy
    did before): the switch is the policy's, not the engine's."""
    src = tmp_path / "all.lua"
    src.write_text('local R = require "ferry.rules"\n'
                   'return R.policy { name = "all", R.min_bytes(1024), R.exclude_params_and_buffers(),\n'
                   '                  recompute = "decide" }\n')
    _, _, packs = backward_inside(str(src), str(tmp_path / "t.jsonl"))
    assert any(p["phase"] == "recompute" and p["decision"] == "offload" for p in packs)
