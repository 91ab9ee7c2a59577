"""Issue 36 item 2: FSDP2 (fully_shard; 2 gloo ranks on CPU) with ferry in
each rank trains bit-identically to FSDP2 without it, told the model or not.

Before: offload(model) raised at entry (reading the DTensor parameters'
storage); without model=, the all-gathered unsharded weights were classed as
activations and offloaded, and FSDP2 freed their storage under the copy. A policy that
offloads everything, parameters too, with slow copies: the copy read the
freed bytes (wrong gradients or a crash) until parameters were packed
FERRY_FLAG_RESIZABLE."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fsdp2_worker.py")


def have_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    except Exception:  # absent, or (Debian's torch 1.13 on Python 3.11) broken at import
        return False
    return torch.distributed.is_available()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not have_fsdp2(), reason="this torch has no FSDP2 (fully_shard)")
def test_fsdp2_gloo_two_ranks_bit_identical(tmp_path):
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), "2", str(port), str(outs[r])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        assert p.returncode == 0, err[-4000:]
    for o in outs:
        r = json.loads(o.read_text())
        assert r["same"] == {"model": True, "no_model": True, "offload_all": True}, r
        for mode, s in r["stats"].items():
            assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, (mode, s)
            assert s["live_handles"] == 0, (mode, s)
