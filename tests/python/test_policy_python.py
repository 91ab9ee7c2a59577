"""Policies from Python (issue 18 item 5): ferry.policy(...) renders the rules
library's selectors as Lua, ferry.Policy.from_source takes inline Lua; both
run in the engine unchanged, `ferry check` reads their file; offload()'s
keyword knobs win over a policy's; set_policy stays in force."""
import subprocess
import warnings

import pytest
import torch

import ferry
import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss, read_trace
from test_trace_replay import ferry_cli


def decisions(policy, tmp_path, steps=2, **kw):
    """[(module, layer, bytes, decision)] of every saved tensor over `steps`
    steps of the test GPT, as the engine recorded them."""
    trace = tmp_path / f"t{len(list(tmp_path.iterdir()))}.jsonl"
    torch.manual_seed(0)
    model = GPT(layers=4)
    for i in range(steps):
        torch.manual_seed(10 + i)
        with ft.offload(model, policy=policy, record_trace=str(trace), **kw):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
    ft.step()
    ft.close()
    return [(r.get("module"), r["layer"], r["bytes"], r["decision"])
            for r in read_trace(trace) if r["ev"] == "pack"]


HANDWRITTEN = [
    (dict(min_bytes=0, max_stash=0),
     'local R = require "ferry.rules"\n'
     'return R.policy { name = "h", R.min_bytes(0), R.max_stash(0), reload = R.on_use() }\n'),
    (dict(min_bytes="4K", exclude=["attn", "lm_head"], first_layers=2, prefetch=1),
     'local R = require "ferry.rules"\n'
     'return R.policy { name = "h", R.min_bytes(4096), R.exclude_modules("attn", "lm_head"),\n'
     '  R.first_layers(2), reload = R.prefetch(1) }\n'),
    (dict(activations_only=True, keep_last=1, max_stash_bytes="16K", prefetch_layers=1),
     'local R = require "ferry.rules"\n'
     'return R.policy { name = "h", R.activations_only(), R.keep_last_layers(1),\n'
     '  R.max_stash_bytes(16384), reload = R.prefetch_layers(1) }\n'),
]


@pytest.mark.parametrize("kw,lua", HANDWRITTEN, ids=["all", "exclude-first", "keep-last"])
def test_python_policy_decides_as_the_lua_it_stands_for(kw, lua, tmp_path):
    mine = decisions(ferry.policy(**kw), tmp_path)
    theirs = decisions(ferry.Policy.from_source(lua), tmp_path)
    assert mine == theirs
    kinds = {d for *_, d in mine}
    assert "offload" in kinds, "the policy must offload something for the comparison to mean anything"
    if "first_layers" in kw:
        assert all(layer in (0, 1) for _, layer, _, d in mine if d == "offload")
        assert not any(".attn" in (m or "") for m, _, _, d in mine if d == "offload")
        assert any(".attn" in (m or "") and layer == 0 and b >= 4096 for m, layer, b, d in mine), \
            "layer 0 attention saves tensors the exclusion keeps"


def test_bad_arguments_name_the_argument_and_bad_lua_its_file_line():
    with pytest.raises(ValueError, match=r"first_layers=-1"):
        ferry.policy(first_layers=-1)
    with pytest.raises(ValueError, match=r"min_bytes='12Q'"):
        ferry.policy(min_bytes="12Q")
    with pytest.raises(ValueError, match="one of prefetch"):
        ferry.policy(prefetch=1, prefetch_layers=1)
    with pytest.raises(ValueError, match=r"inline-[0-9a-f]+\.lua:3: decide must be a function"):
        ferry.Policy.from_source("return {\n api = 1,\n decide = 3 }\n")


def test_cli_reads_a_python_policy(tmp_path):
    p = ferry.policy(min_bytes="1M", exclude="lm_head", name="from-python")
    out = subprocess.run([ferry_cli(), "check", p.path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "from-python" in out.stdout and "min_offload_bytes=1048576" in out.stdout
    saved = p.save(tmp_path / "mine.lua")
    assert open(saved).read() == p.source


def test_keyword_knobs_win_over_the_policy_with_one_warning(tmp_path):
    pol = ferry.Policy.from_source(
        'return { api = 1, knobs = { max_fwd_stash = 0 },\n'
        '  decide = function(t, ctx) return ferry.OFFLOAD end }\n')
    model = GPT(layers=2)

    def run(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with ft.offload(model, policy=pol, **kw) as o:
                    loss = gpt_loss(model, gpt_batch())
                    knobs = o.engine.knobs()
                loss.backward()
            ft.step()
            hits = ft.stats()["stash_hits"]
        ft.close()
        return knobs, hits, [w for w in caught if "overrule" in str(w.message)]

    knobs, hits, warned = run()
    assert knobs["max_fwd_stash"] == 0 and hits == 0 and not warned
    knobs, hits, warned = run(max_fwd_stash=4, max_fwd_stash_bytes=1 << 30)
    assert knobs["max_fwd_stash"] == 4 and knobs["max_fwd_stash_bytes"] == 1 << 30
    assert knobs["overruled"] == ["max_fwd_stash"]
    assert hits > 0, "the keyword's stash must be the one in force"
    assert len(warned) == 1 and "max_fwd_stash=4" in str(warned[0].message)


def test_set_policy_stays_in_force_for_blocks_that_name_none():
    model = GPT(layers=2)
    with ft.offload(model):
        gpt_loss(model, gpt_batch()).backward()
    assert ft.stats()["policy"].endswith("default.lua")
    ft.set_policy("layers")
    for _ in range(2):
        with ft.offload(model):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
        assert ft.stats()["policy"].endswith("layers.lua")
    with ft.offload(model, policy="budget"):
        gpt_loss(model, gpt_batch()).backward()
    assert ft.stats()["policy"].endswith("budget.lua")


def test_budget_policy_knobs_are_in_force():
    # budget.lua's own knobs: copied buffers go at once, one reload at the tail
    model = GPT(layers=2)
    for policy, release, tail in (("budget", True, 1), ("default", False, None)):
        with ft.offload(model, policy=policy) as o:
            gpt_loss(model, gpt_batch()).backward()
            knobs = o.engine.knobs()
        assert (knobs["release_when_copied"], knobs["max_tail_prefetch"]) == (release, tail)
        ft.close()
