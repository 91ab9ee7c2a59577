"""A final checkpoint that fails at exit makes the exit status non-zero
(after the other exit handlers ran), and one DCP Stager reused for every
save needs the state once under its cap, not twice (issue 37, item 6)."""
import gc
import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ferry.checkpoint

EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, torch
    atexit.register(lambda: print("the other exit handler ran", flush=True))
    import ferry.torch as ft
    ft.snapshot({"w": torch.zeros(1000)}, sys.argv[1])  # not waited for
    print("training done", flush=True)
""")


def test_a_checkpoint_failing_at_exit_makes_the_exit_status_nonzero(tmp_path):
    bad = str(tmp_path / "missing-dir" / "final.pt")
    good = str(tmp_path / "final.pt")
    env = dict(os.environ)
    runs = {p: subprocess.run([sys.executable, "-c", EXIT_SCRIPT, p], capture_output=True,
                              text=True, env=env, timeout=120) for p in (bad, good)}
    r = runs[bad]
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"ferry: checkpoint {bad} failed" in r.stderr
    assert "training done" in r.stdout and "the other exit handler ran" in r.stdout
    ok = runs[good]
    assert ok.returncode == 0, ok.stderr
    assert "the other exit handler ran" in ok.stdout
    assert torch.equal(torch.load(good)["w"], torch.zeros(1000))


def test_one_stager_reused_needs_the_state_once_under_the_cap(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    if "async_stager" not in inspect.signature(getattr(dcp, "async_save", len)).parameters:
        pytest.skip("dcp.async_save takes no async_stager (torch < 2.6)")
    stager = ferry.checkpoint.Stager(host_cap=6 << 20)
    state = {"w": torch.randn(1 << 20)}  # 4 MiB under a 6 MiB cap
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(3):
            resp = dcp.async_save(state, checkpoint_id=str(tmp_path / f"ck{i}"),
                                  async_stager=stager)
            saved = state["w"].clone()
            resp.upload_completion.result()
            del resp
            gc.collect()
            state["w"].add_(1)
        back = {"w": torch.zeros(1 << 20)}
        dcp.load(back, checkpoint_id=str(tmp_path / "ck2"))
    stager.close()
    assert torch.equal(back["w"], saved)


NONZERO_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch
    import ferry.torch as ft
    ft.snapshot({"w": torch.zeros(1000)}, sys.argv[1])  # fails, not waited for
    if sys.argv[2] == "exit3":
        sys.exit(3)
    if sys.argv[2] == "thread_exit3":  # ends that thread only
        import threading
        t = threading.Thread(target=sys.exit, args=(3,))
        t.start(); t.join()
    if sys.argv[2] == "raise":
        raise RuntimeError("the training failed")
    sys.exit(0)
""")


@pytest.mark.parametrize("how,status", [("exit3", 3), ("raise", 1), ("exit0", 1),
                                        ("thread_exit3", 1)])
def test_a_checkpoint_failing_at_exit_keeps_a_nonzero_exit_status(tmp_path, how, status):
    bad = str(tmp_path / "missing-dir" / "final.pt")
    r = subprocess.run([sys.executable, "-c", NONZERO_EXIT_SCRIPT, bad, how],
                       capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert r.returncode == status, (r.returncode, r.stderr)
    assert f"ferry: checkpoint {bad} failed" in r.stderr
    if how == "raise":
        assert "the training failed" in r.stderr
