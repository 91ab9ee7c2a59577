"""Issue 36 item 5 (and issue 41 item 2): nested contexts and two models in
one step; weights recognised as weights without being told the model.

Before: entering an inner context ended the outer step mid-forward, its exit
restored neither the outer policy nor the outer model's parameter ranges
(the outer model's weights and buffers then read as activations);
autocast's casts of weights, and every weight under OffloadActivations()
without model=, were classed as activations and offloaded."""
import pytest
import torch

import ferry.torch as ft
from conftest import read_trace


class Scaled(torch.nn.Module):
    """A Linear and a buffer the forward multiplies by (so it is saved):
    the buffer is known for one only through the model's ranges."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.register_buffer("scale", torch.rand(n_out) + 0.5)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


def packs(path):
    return [e for e in read_trace(path) if e.get("ev") == "pack"]


def test_weights_are_parameters_without_model(tmp_path, monkeypatch):
    """OffloadActivations() without model=: the weights (saved as
    weight.t(), a view of the Parameter) are kept, not offloaded."""
    trace = tmp_path / "t.jsonl"
    monkeypatch.setenv("FERRY_TRACE", str(trace))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Tanh(), torch.nn.Linear(80, 48))
    x = torch.randn(16, 48)
    with ft.OffloadActivations(min_offload_size=1024):
        loss = model(x).pow(2).sum()
    loss.backward()
    ft.close()
    weight_bytes = {48 * 80 * 4}
    seen = packs(trace)
    weights = [p for p in seen if p["bytes"] in weight_bytes]
    assert len(weights) == 1, seen  # the second Linear's (the first's input needs no grad)
    assert all(p["kind"] == "parameter" and p["decision"] == "keep" for p in weights), weights
    assert any(p["decision"] == "offload" for p in seen), seen


def test_autocast_weight_casts_are_parameters(tmp_path):
    """Under autocast the Linear saves a bf16 copy of its weight: a weight,
    though a new tensor, with model= given or not."""
    for with_model in (True, False):
        trace = tmp_path / f"t{with_model}.jsonl"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Tanh(),
                                    torch.nn.Linear(80, 48))
        x = torch.randn(16, 48)
        with ft.offload(model if with_model else None, policy="default", backend="host",
                        record_trace=str(trace), min_offload_bytes=1024):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).sum()
        loss.backward()
        ft.close()
        casts = [p for p in packs(trace) if p["dtype"] == "bf16" and p["bytes"] == 48 * 80 * 2]
        assert len(casts) == 1, packs(trace)  # the second Linear's, as above
        assert all(p["kind"] == "parameter" and p["decision"] == "keep" for p in casts), casts


def run_nested(outer_ctx, inner_ctx, a, b, x):
    with outer_ctx(a):
        h = a(x)
        with inner_ctx(b):
            g = b(h)
        y = a(g)  # the outer model again, after the inner context exited
    return y.pow(2).sum()


def test_nested_contexts_join_the_step_and_restore_ranges(tmp_path):
    trace = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    a, b = Scaled(32, 32), Scaled(32, 32)
    x = torch.randn(16, 32)
    ref_a, ref_b = Scaled(32, 32), Scaled(32, 32)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    run_nested(lambda m: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
               lambda m: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
               ref_a, ref_b, x).backward()

    def ctx(m):
        return ft.offload(m, policy="default", backend="host", record_trace=str(trace),
                          min_offload_bytes=1024)

    loss = run_nested(ctx, ctx, a, b, x)
    assert ft.engine().in_step and ft.stats()["steps"] == 1  # the inner entry ended no step
    loss.backward()
    ft.close()
    for m, r in ((a, ref_a), (b, ref_b)):
        for p, q in zip(m.parameters(), r.parameters()):
            assert torch.equal(p.grad, q.grad)
    scale_packs = [p for p in packs(trace) if p["bytes"] == 32 * 4 and p["shape"] == [32]]
    # a.scale before the inner context, b.scale inside it, a.scale after it
    assert [p["kind"] for p in scale_packs] == ["buffer"] * 3, scale_packs
    assert len({p["step"] for p in packs(trace)}) == 1


def test_nested_context_cannot_change_the_policy():
    a, b = Scaled(32, 32), Scaled(32, 32)
    with ft.offload(a, policy="default", backend="host"):
        with pytest.raises(ft.FerryError, match="cannot change within a step"):
            with ft.offload(b, policy="layers", backend="host"):
                pass
        a(torch.randn(4, 32)).sum().backward()
    assert ft.stats()["policy"].endswith("default.lua")


def test_inner_context_of_another_engine_gives_back_the_outer_one():
    a, b = Scaled(32, 32), Scaled(32, 32)
    with ft.offload(a, policy="default", backend="host") as outer:
        with ft.offload(b, policy="default", backend="host", min_offload_bytes=1024) as inner:
            assert ft.engine() is inner.engine
        assert ft.engine() is outer.engine  # ft.step() ends the outer engine's step
