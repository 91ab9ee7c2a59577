"""Issue 38 review: the keep path reads Tensor._base only when the facts
module says the tensor is a view (autograd meta's is_view_). For every kind
of view the flag must say what _base says, on both torches, and saved views
(of views, detached, made under no_grad, of a Parameter, changed in place
before their save) must give the same gradients, bit for bit, offloaded as
kept; a view changed after its save still fails the version check."""
import contextlib
import os
import tempfile

import pytest
import torch

import ferry._ferry as _ferry
import ferry.torch as ft

OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(256), R.max_stash(1), reload = R.on_use() }
"""


@pytest.fixture
def offload_policy():
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
    yield f.name
    os.unlink(f.name)


def view_cases():
    p = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8, requires_grad=True)
    cases = {
        "plain": torch.randn(8, 8),
        "view": x[1:],
        "view of a view": x[1:][:, 2:],
        "detach of a view": x[1:].detach(),
        "detach": x.detach(),
        "make_subclass of a view": torch.Tensor._make_subclass(torch.Tensor, x[1:].detach(), False),
        "parameter view": p.t(),
        "parameter view of a view": p.t()[1:],
        "unbind": x.unbind(0)[0],
        "reshape (a view)": x.reshape(64),
        "contiguous copy": x.t().contiguous(),
        "view_as_real": torch.view_as_real(torch.randn(4, dtype=torch.complex64)),
    }
    with torch.no_grad():
        cases["no_grad view"] = x[2:]
        cases["no_grad parameter view"] = p.t()
    v = x.detach().clone()[1:]
    v.add_(1)
    cases["view changed in place"] = v
    return cases


def test_is_view_says_what_base_says():
    if _ferry.tensor_facts(torch.zeros(1)) is None:
        pytest.skip("no torch-facts module for this torch")
    for name, t in view_cases().items():
        f = _ferry.tensor_facts(t)
        assert f is not None, name
        assert f[4] == (t._base is not None), name


def grads(offload):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    with offload():
        h = x @ w                     # mm does not save its output
        v = h[:, :32]                 # a view of an activation
        v2 = v[8:]                    # a view of a view
        v2.mul_(1.5)                  # changed in place before it is saved
        a = v2.sin()                  # saves v2 (version 1)
        with torch.no_grad():
            nv = h[:, 32:]            # a view made under no_grad
        b = a.sum() + (v * nv).cos().sum()   # saves v and nv
        c = (w.t()[:, :16] * h[:, :16]).sigmoid().sum()  # a Parameter's view
        d = torch.exp(h.detach()[:4] * x[:4]).sum()      # a detached view
        loss = b + c + d
    loss.backward()
    return x.grad.clone(), w.grad.clone()


def test_saved_views_offloaded_give_bit_identical_grads(offload_policy):
    want = grads(contextlib.nullcontext)
    try:  # torch 1.13 fails this graph under any saved-tensor hooks
        grads(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match="No grad accumulator for a saved leaf"):
            grads(lambda: ft.offload(policy=offload_policy, backend="host"))
        ft.close()
        assert "No grad accumulator" in str(e)
        return
    got = grads(lambda: ft.offload(policy=offload_policy, backend="host"))
    ft.close()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def changed_after_save(offload):
    x = torch.randn(64, 64, requires_grad=True)
    with offload():
        h = x * 2
        v = h[:, :32]
        y = v.sin().sum()  # saves v
        h.add_(1)          # its base changed after the save
    y.backward()


def test_view_changed_after_save_still_fails(offload_policy):
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        changed_after_save(contextlib.nullcontext)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        changed_after_save(lambda: ft.offload(policy=offload_policy, backend="host"))
    ft.close()
