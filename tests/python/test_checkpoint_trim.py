"""snapshot(trim=...) gives the pinned staging memory back to the OS once
the file is durable: the engine's arena_reserved and the process's VmLck
(/proc/self/status; the host backend mlocks its pinned memory) drop after
the snapshot with the knob and stay without it (issue 37, item 9). Each
case runs in a fresh interpreter, whose locked memory is its own: pages
that earlier tests locked count against the same RLIMIT_MEMLOCK."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ferry.checkpoint as ck

CASE = r"""
import json, resource, sys
import torch
import ferry.checkpoint as ck

def vmlck():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return -1

path, trim = sys.argv[1], json.loads(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
torch.manual_seed(0)
state = {"w": torch.randn(3 << 18), "step": 7}  # 3 MiB: under the usual 8 MiB mlock limit
engine = ck.reserve(0, host_cap="1G")  # the engine snapshot() below uses, nothing taken
out = {"memlock": soft, "lck0": vmlck(), "res0": engine.stats()["arena_reserved"]}
h = ck.snapshot(state, path, host_cap="1G", trim=trim)
h.wait()
out.update(lck1=vmlck(), res1=engine.stats()["arena_reserved"],
           in_use1=engine.stats()["arena_in_use"], trimmed=h.stats.get("trimmed_bytes"))
ok1 = torch.equal(torch.load(path)["w"], state["w"])
state["w"].mul_(2)  # the arena grows again for the next one
h = ck.snapshot(state, path, host_cap="1G", trim=trim)
h.wait()
got = torch.load(path)
out.update(ok=ok1 and torch.equal(got["w"], state["w"]) and got["step"] == 7,
           lck2=vmlck(), res2=engine.stats()["arena_reserved"])
print(json.dumps(out))
"""


def run_case(tmp_path, trim):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the pool arena of a plain interpreter
    p = subprocess.run([sys.executable, "-c", CASE, str(tmp_path / "ck.pt"), json.dumps(trim)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


STATE = 3 << 20


def test_without_trim_the_pinned_memory_stays(tmp_path):
    r = run_case(tmp_path, False)
    assert r["ok"]
    assert r["res0"] == 0
    assert r["res1"] >= STATE and r["res2"] >= STATE  # kept for the next snapshot
    assert r["trimmed"] is None
    if r["memlock"] >= 2 * STATE:
        assert r["lck1"] - r["lck0"] >= STATE and r["lck2"] - r["lck0"] >= STATE


def test_with_trim_the_pinned_memory_goes_back_after_each_snapshot(tmp_path):
    r = run_case(tmp_path, True)
    assert r["ok"]  # both files whole and right, the second after the arena grew again
    assert r["res1"] == 0 and r["res2"] == 0 and r["in_use1"] == 0
    assert r["trimmed"] >= STATE
    assert r["lck1"] == r["lck0"] and r["lck2"] == r["lck0"]


def test_trim_keeps_the_bytes_asked_for(tmp_path):
    r = run_case(tmp_path, STATE)
    assert r["ok"]
    assert r["res1"] >= STATE and r["res2"] >= STATE
    assert r["trimmed"] == 0


def test_vmlck_rises_here_at_all(tmp_path):
    # The VmLck assertions above need mlock to work for a few MiB here.
    r = run_case(tmp_path, False)
    if r["memlock"] < 2 * STATE:
        pytest.skip(f"RLIMIT_MEMLOCK {r['memlock']} bytes: the host backend cannot lock "
                    "a snapshot's staging memory here")
    assert r["lck1"] > r["lck0"]


@pytest.mark.parametrize("bad", [-1, 1.5, "yes", None])
def test_a_bad_trim_is_refused_naming_it(tmp_path, bad):
    with pytest.raises(ValueError, match="trim="):
        ck.snapshot({"w": torch.zeros(4)}, tmp_path / "x.pt", trim=bad)
    assert not (tmp_path / "x.pt").exists()


def test_done_is_a_poll_while_the_trim_runs(tmp_path):
    # done() is what a training loop polls: a trim that takes long (munmap
    # of GBs, cudaHostUnregister) must not block it; it says False until the
    # trim is over, and wait() then returns with trimmed_bytes set.
    import threading
    h = ck.snapshot({"w": torch.randn(1 << 16)}, tmp_path / "p.pt")
    release = threading.Event()

    class SlowEngine:  # stands for Engine.trim taking its time
        def trim(self, keep):
            release.wait(60)
            return 123

    h._start_trimmer(SlowEngine(), 0)
    answers = []
    poller = threading.Thread(target=lambda: answers.extend(h.done() for _ in range(3)))
    poller.start()
    poller.join(30)  # generous: a blocked done() would hold it the whole 60 s
    blocked = poller.is_alive()
    release.set()
    poller.join()
    assert not blocked, "done() blocked on the running trim"
    assert answers == [False] * 3
    assert h.wait() is h and h.done()
    assert h.stats["trimmed_bytes"] == 123
    assert torch.load(tmp_path / "p.pt")["w"].numel() == 1 << 16
