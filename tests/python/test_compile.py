"""torch.compile'd models under ferry.torch.offload (issue 18 item 8).

Compiled the three ways trainers do it: torchtitan's per-block
torch.compile(block), torchtune's in-place block.compile(), and the whole
model. Each trains 3 steps, compiled inside the offload context as a real
trainer's first step is, with every saved tensor really offloaded and
reloaded; losses and gradients must equal the same compiled model's without
ferry, bit for bit, with no graph break (a Python hook inside a compiled
region would split its graph)."""
import os
import tempfile
import warnings

import pytest
import torch

import ferry.torch as ft
from conftest import GPT, assert_same_training, gpt_batch, gpt_loss, read_trace, train

pytestmark = pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile needs torch 2.x")

OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(0), R.max_stash(0), reload = R.on_use() }
"""


def compiled_gpt(how):
    def make():
        m = GPT()
        if how == "per_block":
            for i, block in enumerate(m.h):
                m.h[i] = torch.compile(block)
            return m
        if how == "in_place":
            for block in m.h:
                block.compile()
            return m
        return torch.compile(m)
    return make


def run(how, offload=None):
    torch._dynamo.reset()
    return train(compiled_gpt(how), gpt_batch, gpt_loss, steps=3, offload=offload)


@pytest.fixture(scope="module")
def policy():
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
    yield f.name
    os.unlink(f.name)


@pytest.mark.parametrize("how", ["per_block", "in_place", "whole"])
def test_compiled_model_trains_identically_with_real_reloads(how, policy, tmp_path):
    from torch._dynamo.utils import counters

    base = run(how)
    counters.clear()
    trace = tmp_path / "t.jsonl"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mine = run(how, lambda m: ft.offload(m, policy=policy, record_trace=trace))
        h2d = ft.stats()["bytes_h2d"]
        ft.close()
    assert_same_training(base, mine)
    assert h2d > 0, "no tensor was really reloaded"
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"

    packs = [r for r in read_trace(trace) if r["ev"] == "pack" and r["kind"] == "activation"]
    assert packs
    assert not any("_orig_mod" in r.get("module", "") for r in packs), "paths must not show dynamo's wrapper"
    whole_warned = any("compile'd as a whole" in str(w.message) for w in caught)
    if how == "whole":
        # Inside one compiled graph nothing tells the layers apart: said once
        # at offload(), and every tensor carries layer -1.
        assert whole_warned
        assert {r["layer"] for r in packs} == {-1}
    else:
        # Per block: each block's tensors carry its path and layer.
        assert not whole_warned
        layered = {(r.get("module"), r["layer"]) for r in packs if r["layer"] >= 0}
        assert layered == {(f"h.{i}", i) for i in range(4)}
        assert all(r["class"] == "Block" for r in packs if r["layer"] >= 0)
