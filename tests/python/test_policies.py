"""Item 3: every shipped policy gives identical gradients, and the decisions
(seen in the recorded trace and the stats) are the ones each should make.
Item 2: hot swap between steps; stats; record_trace."""
import os

import pytest
import torch

import ferry
import ferry.torch as ft
from conftest import GPT, SHIPPED_POLICIES, assert_same_training, gpt_batch, gpt_loss, read_trace, train

LAYERS = 4


def make():
    return GPT(layers=LAYERS)


class CheckpointWrapped(torch.nn.Module):
    """A block under reentrant activation checkpointing, run from inside its
    own module as torchtitan's checkpoint_wrapper does: the input the
    checkpoint saves carries the block's path ("h.3")."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        import torch.utils.checkpoint as cp

        return cp.checkpoint(self.block, x, use_reentrant=True)


def make_checkpointed():
    m = make()
    for i, block in enumerate(m.h):
        m.h[i] = CheckpointWrapped(block)
    return m


# Policies that only act under full activation checkpointing: trained with
# it, and compared with a baseline trained with it.
CHECKPOINTED = {"checkpointed_inputs", "hidden_states"}


def make_for(policy):
    return make_checkpointed if policy in CHECKPOINTED else make


@pytest.fixture(scope="module")
def baseline():
    return train(make, gpt_batch, gpt_loss, steps=3)


@pytest.fixture(scope="module")
def baseline_checkpointed():
    return train(make_checkpointed, gpt_batch, gpt_loss, steps=3)


def run_policy(policy, trace):
    mine = train(make_for(policy), gpt_batch, gpt_loss, steps=3,
                 offload=lambda m: ft.offload(m, policy=policy, record_trace=trace))
    ft.step()
    s = ft.stats()
    ft.close()  # flushes the trace
    packs = [e for e in read_trace(trace) if e["ev"] == "pack"]
    return mine, s, packs


def offloaded(packs):
    return [p for p in packs if p["decision"] == "offload"]


def test_all_shipped_policies_are_tested():
    assert set(SHIPPED_POLICIES) >= {"default", "layers", "fraction", "ramcap", "budget"}


@pytest.mark.parametrize("policy", SHIPPED_POLICIES)
def test_policy_identical_gradients(policy, baseline, baseline_checkpointed, tmp_path):
    mine, s, packs = run_policy(policy, str(tmp_path / "trace.jsonl"))
    assert_same_training(baseline_checkpointed if policy in CHECKPOINTED else baseline, mine)
    assert s["live_handles"] == 0 and s["arena_in_use"] == 0 and s["device_bytes_held"] == 0, s
    assert s["policy_errors"] == 0, s["policy_error"]
    off = offloaded(packs)
    assert off, f"{policy} offloaded nothing"
    if policy == "checkpointed_inputs":  # the blocks' saved inputs only, the last block's kept
        assert all(p["module"] == "h.%d" % p["layer"] and p["layer"] < LAYERS - 1 for p in off), \
            {(p["module"], p["layer"]) for p in off}
    if policy == "hidden_states":  # axolotl's: every block's saved input, the last block's too
        assert {(p["module"], p["layer"]) for p in off if p["step"] == 3} == \
            {("h.%d" % i, i) for i in range(LAYERS)}, {(p["module"], p["layer"]) for p in off}
    # No shipped policy offloads parameters or buffers but save_on_cpu.lua,
    # which reproduces torch's hook: it copies every saved tensor.
    if policy != "save_on_cpu":
        assert all(p["kind"] == "activation" for p in off), {p["kind"] for p in off}
    else:
        assert any(p["kind"] == "parameter" for p in off) and len(off) == len(packs)
    # Every saved tensor reached the engine while tracing, and the trace
    # agrees with the stats.
    assert len(packs) == s["tensors_packed"]
    stored = [p for p in off if not p.get("alias")]  # an alias is the same bytes again
    assert len(stored) == s["tensors_offloaded"]
    assert sum(p["bytes"] for p in stored) == s["bytes_d2h"]
    # Paths and layers are the model's.
    layered = [p for p in packs if p["layer"] >= 0]
    assert layered and all(p["layers"] == LAYERS for p in layered)
    assert all(p["module"].startswith("h.%d" % p["layer"]) for p in layered)


def test_default_policy_decisions(tmp_path):
    _, s, packs = run_policy("default", str(tmp_path / "t.jsonl"))
    params = [p for p in packs if p["kind"] == "parameter"]
    assert params, "the model's weights are saved (matmul) and must be seen as parameters"
    assert all(p["decision"] == "keep" for p in params)
    head = [p for p in packs if p.get("module", "").split(".")[0] in ("lm_head", "ln_f")]
    assert head and all(p["decision"] == "keep" for p in head)
    # everything else of at least 1024 bytes is offloaded
    rest = [p for p in packs if p["kind"] == "activation" and p["bytes"] >= 1024 and p not in head]
    assert rest and all(p["decision"] == "offload" for p in rest)
    assert s["policy_cache_hits"] > 0  # default's answers are cached per site


def test_layers_policy_offloads_only_first_two_layers(tmp_path):
    _, s, packs = run_policy("layers", str(tmp_path / "t.jsonl"))
    layers = {p["layer"] for p in offloaded(packs)}
    assert layers == {0, 1}, layers
    assert s["prefetches"] > 0


def test_fraction_policy_only_selected_modules(tmp_path):
    _, s, packs = run_policy("fraction", str(tmp_path / "t.jsonl"))
    off = offloaded(packs)
    assert all(p["layer"] != LAYERS - 1 for p in off)  # last layer kept
    mods = {p["module"].split(".", 2)[2] for p in off}
    assert mods <= {"attn", "attn.c_proj", "mlp.c_fc"}, mods
    eligible = [p for p in packs if p["layer"] not in (-1, LAYERS - 1) and p["kind"] == "activation"
                and p["bytes"] >= 1024 and p["module"].split(".", 2)[2] in mods]
    assert 0 < len(off) < len(eligible)  # a fraction, not all


def test_budget_policy_offloads_eligible_and_prefetches(tmp_path):
    # budget.lua's default budget is 0 bytes kept (docs/sim-validation.md, "Policy
    # quality"): every eligible activation goes, the head's inputs included,
    # parameters never, and reloads are prefetched. The loss (cross_entropy,
    # called outside the model: no module) is kept (R.LOSS).
    _, s, packs = run_policy("budget", str(tmp_path / "t.jsonl"))
    step3 = [p for p in packs if p["step"] == 3]
    loss = [p for p in step3 if not p.get("module")]
    assert loss and all(p["decision"] == "keep" for p in loss)
    eligible = [p for p in step3 if p["kind"] == "activation" and p["bytes"] >= 1024
                and p.get("module")]
    assert eligible and all(p["decision"] == "offload" for p in eligible)
    assert any(p.get("module", "").startswith("lm_head") for p in eligible)
    assert all(p["decision"] == "keep" for p in step3 if p["kind"] in ("parameter", "buffer"))
    assert s["prefetches"] > 0


def test_hot_swap_between_steps(tmp_path):
    torch.manual_seed(0)
    m = make()
    trace = str(tmp_path / "t.jsonl")
    for policy in ("layers", "default", "layers"):
        with ft.offload(m, policy=policy, record_trace=trace):
            loss = gpt_loss(m, gpt_batch())
        loss.backward()
        assert ft.stats()["policy"].endswith(policy + ".lua")
    ft.set_policy("default")  # explicit swap API
    with ft.offload(m, policy="default", record_trace=trace):
        loss = gpt_loss(m, gpt_batch())
    loss.backward()
    ft.close()
    packs = [e for e in read_trace(trace) if e["ev"] == "pack"]
    by_step = {}
    for p in offloaded(packs):
        by_step.setdefault(p["step"], set()).add(p["layer"])
    assert by_step[1] == {0, 1} and by_step[3] == {0, 1}
    assert by_step[2] >= {0, 1, 2, 3} and by_step[4] >= {0, 1, 2, 3}


def test_failed_swap_keeps_previous_policy(tmp_path):
    bad = tmp_path / "bad.lua"
    bad.write_text("return { api = 1, name = 'bad', decide = function(t, ctx) return ferry.KEEP end\n")
    m = make()
    with ft.offload(m, policy="layers"):
        gpt_loss(m, gpt_batch()).backward()
    with pytest.raises(ferry.FerryError) as e:
        ft.set_policy(str(bad))
    assert "bad.lua" in str(e.value)
    assert ft.stats()["policy"].endswith("layers.lua")


def test_stats_keys_and_policy_by_path():
    m = make()
    path = os.path.join(os.path.dirname(ferry.policy_path("default")), "default.lua")
    with ft.offload(m, policy=path):
        gpt_loss(m, gpt_batch()).backward()
    s = ft.stats()
    for k in ("tensors_packed", "tensors_offloaded", "bytes_d2h", "bytes_h2d", "live_handles",
              "arena_in_use", "arena_peak", "policy_calls", "kept_small", "backend", "arena"):
        assert k in s
    assert s["backend"] == "host"
    assert s["kept_small"] > 0  # tiny tensors took the fast path


@pytest.mark.parametrize("reentrant", [False, True])
def test_hidden_states_one_copy_stream_identical_gradients(reentrant, baseline_checkpointed,
                                                           tmp_path):
    # hidden_states.lua's two implementations under real autograd: reloads on
    # the offloads' own stream (one_copy_stream), on use or one block ahead.
    src = open(ferry.policy_path("hidden_states")).read()
    assert "local REENTRANT = false" in src
    pol = tmp_path / "hidden_states_variant.lua"
    pol.write_text(src.replace("local REENTRANT = false",
                               "local REENTRANT = " + ("true" if reentrant else "false")))
    contexts = []

    def offload(m):
        contexts.append(ft.offload(m, policy=str(pol)))
        return contexts[-1]

    mine = train(make_checkpointed, gpt_batch, gpt_loss, steps=3, offload=offload)
    ft.step()
    s = ft.stats()
    knobs = contexts[-1].engine.knobs()
    ft.close()
    assert_same_training(baseline_checkpointed, mine)
    assert knobs["one_copy_stream"] == 1 and knobs["max_fwd_stash"] == 2, knobs
    assert s["tensors_offloaded"] == 3 * LAYERS and 0 < s["bytes_h2d"] <= s["bytes_d2h"], s
    if not reentrant:
        # the last 2 inputs are still in the 2-deep stash when backward begins
        assert s["bytes_h2d"] < s["bytes_d2h"], s
    # reentrant (ALST) drops a device input once its copy is done
    # (release_when_copied): whether the last ones are gone by backward
    # depends on when the copy thread finished, so all may come back
    assert (s["prefetches"] > 0) == reentrant, s
    assert s["live_handles"] == 0 and s["arena_in_use"] == 0 and s["device_bytes_held"] == 0, s
