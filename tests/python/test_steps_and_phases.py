"""Issue 36 items 3 and 4: phases per backward and one source of truth for
steps.

Item 3: several microbatches accumulated in one context (one step) each pack
their forward as forward: a backward ends when autograd's backward ends, not
at the step's end. Before, microbatches 2..N were packed as recompute, so a
policy with R.forward_only() offloaded [n, 0, 0, 0], and the engine's backward
began once per step (prefetch_at_backward_begin fired once).

Item 4: with steps="manual" the engine begins steps on its own (at a pack
outside one); ft.step() must end them. Before, the binding's own flag did
not know, ft.step() did nothing, the next entry raised "step N has not
ended", set_policy raised, and graphs dropped without backward were never
freed."""
import gc
import os
import tempfile

import pytest
import torch

import ferry.torch as ft
from conftest import read_trace

FORWARD_ONLY = """
local R = require "ferry.rules"
return R.policy { name = "forward-only", R.min_bytes(1024), R.forward_only(),
                  R.exclude_params_and_buffers(), reload = R.prefetch(2) }
"""


@pytest.fixture
def forward_only():
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(FORWARD_ONLY)
    yield f.name
    os.unlink(f.name)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8))


def accumulate(model, ctx, micro=4):
    """micro microbatches forward and backward inside one context; returns
    the tensors offloaded by each and the accumulated gradients."""
    per_micro = []
    with ctx:
        for i in range(micro):
            before = ft.stats()["tensors_offloaded"] if ft._sessmod.current else 0
            torch.manual_seed(100 + i)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            if ft._sessmod.current:
                per_micro.append(ft.stats()["tensors_offloaded"] - before)
    return per_micro, [p.grad.clone() for p in model.parameters()]


def test_each_accumulated_microbatch_packs_as_forward(forward_only, tmp_path):
    base = mlp()
    _, want = accumulate(base, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    model = mlp()
    trace = tmp_path / "t.jsonl"
    per_micro, got = accumulate(model, ft.offload(model, policy=forward_only, backend="host",
                                                  record_trace=str(trace),
                                                  prefetch_at_backward_begin=True))
    assert per_micro[0] > 0
    assert per_micro == [per_micro[0]] * 4, per_micro
    assert ft.stats()["recompute_packs"] == 0, ft.stats()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ft.close()  # the trace complete
    events = [e.get("ev") or e.get("event") or e.get("type") for e in read_trace(trace)]
    # one backward phase per microbatch's backward, each ended before the
    # next microbatch's forward packs
    assert events.count("backward_begin") == 4, events
    assert events.count("backward_end") == 4, events


def test_checkpoint_recompute_is_still_recompute_in_each_microbatch(forward_only):
    """Packs inside backward (reentrant checkpointing's recompute) keep
    their phase, in every microbatch."""
    import torch.utils.checkpoint as cp

    model = mlp()
    recomputed = []
    with ft.offload(model, policy=forward_only, backend="host"):
        for i in range(2):
            x = torch.randn(16, 32, requires_grad=True)
            before = ft.stats()["recompute_packs"]
            cp.checkpoint(model, x, use_reentrant=True).pow(2).mean().backward()
            recomputed.append(ft.stats()["recompute_packs"] - before)
    assert recomputed[0] > 0 and recomputed == [recomputed[0]] * 2, recomputed


def manual_loop(model, iterations=4):
    """The documented manual-step loop inside one long context, with a graph
    dropped without backward each iteration."""
    live, steps = [], []
    with ft.offload(model, policy="default", backend="host", steps="manual",
                    min_offload_bytes=1024):
        for i in range(iterations):
            torch.manual_seed(i)
            model(torch.randn(16, 32)).pow(2).mean().backward()
            model(torch.randn(16, 32)).tanh()  # dropped: never backwarded
            ft.step()
            gc.collect()
            s = ft.stats()
            live.append(s["live_handles"])
            steps.append(s["steps"])
    return live, steps


def test_manual_steps_inside_one_context_end_each_step():
    model = mlp()
    live, steps = manual_loop(model)
    assert live == [0, 0, 0, 0], live
    assert steps == [1, 2, 3, 4], steps
    assert not ft.engine().in_step
    # the next entry begins a step of its own, and set_policy is allowed
    ft.set_policy("layers")
    with ft.offload(model, backend="host", steps="manual", min_offload_bytes=1024):
        model(torch.randn(16, 32)).sum().backward()
    ft.step()
    assert ft.stats()["steps"] == 5


def test_manual_step_before_a_pending_backward():
    """ft.step() with a backward still to run: the backward's unpacks begin
    a step of the engine's own, which the next entry sees and ends."""
    model = mlp()
    for i in range(3):
        with ft.offload(model, policy="default", backend="host", steps="manual",
                        min_offload_bytes=1024):
            loss = model(torch.randn(16, 32)).pow(2).mean()
        with pytest.warns(RuntimeWarning, match="whose backward has not run yet") if i == 0 else \
                _no_warning():
            ft.step()
        loss.backward()
        assert ft.engine().in_step  # the backward began one
        ft.step()
        assert not ft.engine().in_step
    assert ft.stats()["live_handles"] == 0


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_auto_steps_end_the_engines_own_step():
    """steps="auto": an entry ends whatever step the engine is in, even one
    it began by itself (a backward after the previous step ended)."""
    model = mlp()
    with ft.offload(model, policy="default", backend="host", min_offload_bytes=1024):
        loss = model(torch.randn(16, 32)).pow(2).mean()
    ft.step()
    loss.backward()  # begins a step in the engine
    with ft.offload(model, policy="default", backend="host", min_offload_bytes=1024):
        model(torch.randn(16, 32)).pow(2).mean().backward()
    ft.step()
    assert ft.stats()["live_handles"] == 0
