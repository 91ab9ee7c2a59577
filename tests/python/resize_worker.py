"""Worker of test_resized_storage.py (not a test module itself): a saved
parameter's storage freed with resize_(0) right after its pack, as FSDP and
FSDP2 free all-gathered weights, while the host backend's modeled link makes
the offload copy slow. Run in a child process: reading the freed bytes may
crash it.

  python resize_worker.py restore|no_restore
"""
import os
import sys
import tempfile

import torch

import ferry.torch as ft

OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(1024), R.max_stash(64), reload = R.on_use() }
"""
N = 512  # 1 MiB of weight: 0.25 s on the 4 MB/s link below


def storage_of(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def grads(w, x, policy, restore):
    w.grad = x.grad = None
    if policy is None:
        (x @ w.t()).sum().backward()
        return x.grad.clone(), w.grad.clone(), None
    weight = w.detach().clone()
    with ft.offload(None, policy=policy, backend="host", min_offload_bytes=1024,
                    link=(4e6, 1e12, 0.0, 1.0)):
        y = x @ w.t()                 # saves x and w.t(), a view of the parameter
        st = storage_of(w)
        size = st.size()
        st.resize_(0)                 # FSDP's free, while the copy is in flight
        junk = torch.full((N, N), 7.0)  # may take the freed bytes
        if restore:                   # FSDP's all-gather before backward
            st.resize_(size)
            w.data.copy_(weight)
        y.sum().backward()
        del junk
    ft.step()
    stats = ft.stats()
    ft.close()
    if not restore:                   # the optimizer would see a freed weight
        storage_of(w).resize_(size)
        w.data.copy_(weight)
    return x.grad.clone(), w.grad.clone(), stats


def main(mode):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(N, N))
    x = torch.randn(8, N, requires_grad=True)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
    try:
        ref = grads(w, x, None, True)
        got = grads(w, x, f.name, mode == "restore")
    finally:
        os.unlink(f.name)
    assert got[2]["tensors_offloaded"] >= 2, got[2]  # x and the weight
    assert got[2]["live_handles"] == 0, got[2]
    for a, b in zip(ref[:2], got[:2]):
        assert torch.equal(a, b), (a - b).abs().max().item()
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
