"""The engine closed by Python code that one of its own calls runs: a
tensor's finalizer when the engine releases it (its release callback, inside
ferry_pack), or any thread while a wait lets the GIL go. The binding
destroyed the engine at once, and the call it was inside went on through
freed memory; now close() leaves the engine to the end of the calls in
progress, as it does for live Resident buffers."""
import os
import tempfile
import weakref

import pytest
import torch

import ferry.torch as ft

OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(1024), R.max_stash(1), reload = R.on_use() }
"""


def copy_threads():
    """The host backend's copy threads alive in this process."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names.count("ferry-stream")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_close_inside_a_release_callback_waits_for_the_call():
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
    before = copy_threads()
    seen = {}

    def close_now():
        ft.close()
        # the pack that released h is still running: its engine must be too
        seen["threads_in_call"] = copy_threads() - before

    torch.manual_seed(0)
    x, w1, w2 = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    try:
        with pytest.raises(ft.FerryError, match="closed"):
            with ft.offload(None, policy=f.name, backend="host", min_offload_bytes=1024):
                c = torch.randn(64, 64)  # needs no grad: the engine holds c itself
                weakref.finalize(c, close_now)
                h = x @ c                # saves c: offloaded, stashed
                del c                    # the engine holds the last reference
                z = (h.sin() @ w2).cos()  # these packs push c out and release it
            z.sum().backward()
    finally:
        os.unlink(f.name)
    assert seen["threads_in_call"] > 0, seen
    assert copy_threads() == before  # destroyed once the call returned
