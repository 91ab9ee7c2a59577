"""ferry.torch.stats(by=...): saved tensors by the rule that decided them and
by layer (offload(..., reasons=True)), checked against the recorded trace of
the same run, an independent account of every pack."""
import collections

import pytest

import ferry.torch as ft
from conftest import GPT, assert_same_training, gpt_batch, gpt_loss, read_trace, train

LAYERS = 4
# Line numbers matter: the breakdown names the line each rule is written on.
POLICY = """local R = require "ferry.rules"
return R.policy {
  R.min_bytes(0),
  R.exclude_modules(R.HEAD),
  R.first_layers(2),
}
"""


def make():
    return GPT(layers=LAYERS)


def run(tmp_path, **kw):
    policy = tmp_path / "why.lua"
    policy.write_text(POLICY)
    trace = str(tmp_path / "trace.jsonl")
    result = train(make, gpt_batch, gpt_loss, steps=2,
                   offload=lambda m: ft.offload(m, policy=str(policy), record_trace=trace,
                                                min_offload_bytes=0, **kw))
    ft.step()
    return result, str(policy), trace


def stored_packs(trace):
    """The trace's packs that stored a buffer (an alias is the same bytes again)."""
    return [e for e in read_trace(trace) if e["ev"] == "pack" and not e.get("alias")]


def test_by_layer_equals_the_trace(tmp_path):
    _, _, trace = run(tmp_path, reasons=True)
    rows = ft.stats(by="layer")
    ft.close()  # flushes the trace
    want = collections.defaultdict(lambda: [0, 0, 0, 0])
    for p in stored_packs(trace):
        w = want[p["layer"]]
        if p["decision"] == "offload":
            w[0] += 1
            w[1] += p["bytes"]
        else:
            w[2] += 1
            w[3] += p["bytes"]
    got = {r["layer"]: [r["tensors_offloaded"], r["bytes_offloaded"], r["tensors_kept"],
                        r["bytes_kept"]] for r in rows}
    assert got == dict(want)
    assert set(got) == {-1, 0, 1, 2, 3}
    assert all(got[layer][0] > 0 for layer in (0, 1)) and all(got[layer][0] == 0 for layer in (2, 3))


def test_by_rule_names_each_rule_and_its_line(tmp_path):
    _, policy, trace = run(tmp_path, reasons=True)
    s = ft.stats()
    rows = ft.stats(by="rule")
    by_both = ft.stats(by="rule,layer")
    ft.close()
    packs = stored_packs(trace)
    # a rule's file:line (the policy's path, its start cut when long)
    rules = {r["rule"].split("(")[0]: r for r in rows}
    assert len(rules) == len(rows) == 3, rows
    first, head, passed = rules["first_layers"], rules["exclude_modules"], rules["all rules passed"]
    assert first["rule"] == "first_layers(2)" and first["where"].endswith("why.lua:5")
    assert head["rule"].startswith("exclude_modules({top=lm_head|") and head["where"].endswith("why.lua:4")
    assert passed["where"].endswith("why.lua:2")
    assert policy.endswith(first["where"][:-2].lstrip("."))
    # every offload is one no rule kept, and they are all the engine copied
    assert passed["tensors_offloaded"] == s["tensors_offloaded"] > 0
    assert passed["bytes_offloaded"] == s["bytes_d2h"]
    assert first["tensors_offloaded"] == head["tensors_offloaded"] == 0
    # first_layers(2) keeps every tensor of blocks 2 and 3
    deep = [p for p in packs if p["layer"] >= 2]
    assert {r["layer"] for r in by_both if r["rule"] == "first_layers(2)"} >= {2, 3}
    assert first["bytes_kept"] >= sum(p["bytes"] for p in deep) > 0
    assert head["tensors_kept"] > 0
    # the rows account for every stored pack, once
    assert sum(r["tensors_offloaded"] + r["tensors_kept"] for r in rules.values()) == len(packs)
    assert sum(r["bytes_offloaded"] + r["bytes_kept"] for r in rules.values()) == \
        sum(p["bytes"] for p in packs)


def test_counting_reasons_changes_no_result(tmp_path):
    base = train(make, gpt_batch, gpt_loss, steps=2)
    mine, _, _ = run(tmp_path, reasons=True)
    assert_same_training(base, mine)


def test_without_reasons_stats_by_says_how(tmp_path):
    run(tmp_path)
    with pytest.raises(ft.FerryError, match=r"offload\(\.\.\., reasons=True\)"):
        ft.stats(by="rule")
    with pytest.raises(ValueError, match="by='module'"):
        ft.stats(by="module")
