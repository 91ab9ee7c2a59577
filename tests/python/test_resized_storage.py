"""Issue 36 item 2: a saved parameter whose storage its owner frees with
resize_(0) right after the pack (FSDP and FSDP2 free all-gathered weights so,
while references remain) under a policy that offloads parameters. Holding a
reference does not keep the bytes: the host backend's offload copy, running
later on its worker, read freed memory (a crash, or another tensor's bytes).
The binding marks parameters FERRY_FLAG_RESIZABLE; the engine waits for
their copy inside the pack and unpack reloads the bytes as packed."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "resize_worker.py")


@pytest.mark.parametrize("mode", ["restore", "no_restore"])
def test_parameter_storage_freed_under_a_slow_copy(mode):
    p = subprocess.run([sys.executable, WORKER, mode], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", (p.returncode, p.stderr[-4000:])
