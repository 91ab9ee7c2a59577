"""Issue 36 item 1: a saved tensor is the same bytes as an earlier one only
when it is the same storage at the same version. Matching by address alone
gave a tensor changed in place, or a new tensor at a freed and reused
address, the bytes of the earlier save (silently wrong gradients)."""
import os
import tempfile

import pytest
import torch

import ferry.torch as ft

# Everything of 1 KiB or more goes to the host; the stash holds {stash}
# device buffers, so later packs push a saved tensor out of device memory and
# its unpack reloads the bytes its pack copied.
OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy {{ name = "offload-all", R.min_bytes(1024), R.max_stash({stash}), reload = R.on_use() }}
"""
KEEP_ALL = """
local R = require "ferry.rules"
return R.policy { name = "keep-all", R.when(function() return false end) }
"""


@pytest.fixture
def policy_file():
    paths = []

    def make(src):
        with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
            f.write(src)
        paths.append(f.name)
        return f.name

    yield make
    for p in paths:
        os.unlink(p)


def storage_of(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def grads_inplace_then_resave(offload):
    """h saved by one op, changed in place, saved again by another op while
    the first graph is alive; only the second graph is backwarded."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    w1 = torch.randn(64, 64, requires_grad=True)
    w2 = torch.randn(64, 64, requires_grad=True)
    with offload():
        h = x * 2
        y1 = h @ w1           # saves h at version 0
        with torch.no_grad():
            h.mul_(3)         # version 1
        y2 = h @ w2           # saves h at version 1: other bytes, same address
        y2 = torch.tanh(y2).exp()  # more saves push h's buffer out of the stash
    del y1                    # the first saver's graph is dropped
    y2.sum().backward()
    return w2.grad.clone()


def test_inplace_then_resave_gets_the_new_bytes(policy_file):
    want = grads_inplace_then_resave(lambda: torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t))
    path = policy_file(OFFLOAD_ALL.format(stash=2))  # h stays until it is saved again
    got = grads_inplace_then_resave(lambda: ft.offload(policy=path, backend="host"))
    assert torch.equal(got, want), (got - want).abs().max()
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, s
    assert s["tensors_aliased"] == 0, s  # h at version 1 is not h at version 0


def test_same_tensor_saved_twice_is_still_one_copy(policy_file):
    """What aliasing is for stays: the same storage at the same version,
    saved by two ops, is copied once."""
    path = policy_file(OFFLOAD_ALL.format(stash=8))
    x = torch.randn(64, 64, requires_grad=True)
    w1 = torch.randn(64, 64, requires_grad=True)
    w2 = torch.randn(64, 64, requires_grad=True)
    with ft.offload(policy=path, backend="host"):
        h = x * 2
        y = (h @ w1).sum() + (h @ w2).sum()
    y.backward()
    assert ft.stats()["tensors_aliased"] >= 1, ft.stats()
    ref_h = (x.detach() * 2)
    assert torch.equal(w1.grad, ref_h.t() @ torch.ones(64, 64))


def resize_and_reuse(offload):
    """A tensor saved, its storage freed with resize_(0) (how FSDP drops an
    all-gathered weight), and a new tensor of the same size made at the
    freed address and saved while the first graph still holds its save."""
    torch.manual_seed(1)
    # 36 MB: above glibc's largest mmap threshold, so the freed block goes
    # back to the kernel and the next one of the same size is mapped there
    x = torch.randn(3000, 3000, requires_grad=True)
    w = torch.randn(3000, 3000, requires_grad=True)
    with offload():
        h = x * 2
        y1 = h * w
        addr = h.data_ptr()
        storage_of(h).resize_(0)
        held = []
        for _ in range(64):  # the allocator hands the freed block back
            g = x * 3
            if g.data_ptr() == addr:
                break
            held.append(g)
        else:
            return None  # mapped elsewhere this time (another thread's mmap came first)
        y2 = g * w
    del y1, held
    y2.sum().backward()
    return w.grad.clone(), x.grad.clone()


def reused(offload, tries=20):
    """resize_and_reuse until the allocator hands the freed block back; each
    try in a fresh engine. Another thread's mmap can take the address first:
    5 tries were not enough twice in full wheel-suite runs on the loaded
    2-core machine (torch 1.13), while the case alone passes at the first."""
    for _ in range(tries):
        ft.close()
        got = resize_and_reuse(offload)
        if got is not None:
            return got
    pytest.fail(f"the allocator did not reuse the freed address in {tries} tries; the case needs it")


@pytest.mark.parametrize("policy", [OFFLOAD_ALL.format(stash=8), KEEP_ALL],
                         ids=["offload-all", "keep-all"])
def test_storage_freed_and_address_reused_is_new_bytes(policy_file, policy):
    path = policy_file(policy)
    got = reused(lambda: ft.offload(policy=path, backend="host"))
    # w, saved by both products at one version, is one copy; g is not h
    assert ft.stats()["tensors_aliased"] == 1, ft.stats()
    want = reused(lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()
