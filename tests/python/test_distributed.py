"""Item 4: DDP (gloo, 2 processes on loopback) with ferry in each rank, and a
host cap shared by the local ranks of a node through shared memory."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

import ferry

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "dist_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(*args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen([sys.executable, WORKER, *map(str, args)], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_all(procs, timeout=240):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_ddp_gloo_two_ranks_identical_gradients(tmp_path):
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [spawn("ddp", r, 2, port, outs[r]) for r in range(2)]
    for rc, out, err in wait_all(procs):
        assert rc == 0, err[-3000:]
    for o in outs:
        r = json.loads(o.read_text())
        assert r["same"], "gradients differ with ferry"
        assert r["across_ranks"], "ranks disagree after all-reduce"
        assert r["offloaded"] > 0 and r["live"] == 0


@pytest.fixture
def cap_name():
    name = "ferry-test-" + uuid.uuid4().hex[:12]
    yield name
    ferry._ferry.unlink_node_cap(name)


def wait_line(p, timeout=60):
    t0 = time.time()
    line = p.stdout.readline()
    assert time.time() - t0 < timeout
    return line.strip()


def test_node_cap_shared_and_dead_rank_reclaimed(cap_name):
    cap = 100 << 20
    a = spawn("capholder", cap_name, cap, 60 << 20)
    try:
        assert wait_line(a) == "reserved"
        b = ferry.NodeCap(cap_name, cap)
        assert not b.reserve(50 << 20), "two ranks together would exceed the cap"
        assert b.reserve(40 << 20)
        st = b.state()
        assert st["total"] == cap and st["total"] <= st["cap"]
        assert set(st["slots"]) == {a.pid, os.getpid()}
        assert not b.reserve(1)
        a.send_signal(signal.SIGKILL)  # dies holding 60 MiB
        a.wait(timeout=30)
        assert b.reserve(50 << 20), "the killed rank's share was not reclaimed"
        st = b.state()
        assert st["reclaimed"] >= 60 << 20 and a.pid not in st["slots"]
        assert st["total"] == 90 << 20
        with pytest.raises(ValueError, match="same cap"):
            ferry.NodeCap(cap_name, cap + 1)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()


def test_node_cap_two_training_ranks_and_a_killed_one(cap_name, tmp_path):
    """Two local ranks train under one node cap; together they never hold
    more than it. A rank killed mid-step does not keep its share: a
    restarted rank gets it."""
    cap = 8 << 20
    env = {"LOCAL_WORLD_SIZE": "2", "CAPRANK_HOLD": "1"}
    outs = [tmp_path / f"r{i}.json" for i in range(3)]
    r0 = spawn("caprank", cap_name, cap, outs[0], env=env)
    r1 = spawn("caprank", cap_name, cap, outs[1], env=env)
    procs = [r0, r1]
    try:
        for o in outs[:2]:
            t0 = time.time()
            while not o.exists():
                assert time.time() - t0 < 120, (r0.poll(), r1.poll())
                time.sleep(0.2)
        res = [json.loads(o.read_text()) for o in outs[:2]]
        for r in res:
            assert r["offloaded"] > 0
            assert r["node_total"] <= r["node_cap"] == cap
            if not ferry._ferry.HAVE_NODE_CAP_HOOK:  # static split: each rank capped at its share
                assert r["arena_reserved"] <= r["arena_cap"]
        assert sum(r["arena_reserved"] for r in res) <= cap
        nc = ferry.NodeCap(cap_name, cap)
        held = nc.state()["total"]
        assert held >= sum(r["arena_reserved"] for r in res) > 0
        # kill rank 0 mid-step (it sleeps inside the offload context)
        r0.send_signal(signal.SIGKILL)
        r0.wait(timeout=30)
        # its share comes back: what rank 1 does not hold can be reserved now
        free_now = cap - res[1]["arena_reserved"]
        assert free_now > cap - held  # more than was free while rank 0 lived
        assert nc.reserve(free_now)
        nc.release(free_now)
        r2 = spawn("caprank", cap_name, cap, outs[2], env=dict(env, CAPRANK_HOLD=""))
        procs.append(r2)
        rc, _, err = wait_all([r2])[0]
        assert rc == 0, err[-3000:]
        r2res = json.loads(outs[2].read_text())
        assert r2res["offloaded"] > 0 and r2res["node_total"] <= cap
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.skipif(not ferry._ferry.HAVE_NODE_CAP_HOOK,
                    reason="libferry lacks the host_reserve hook: the node cap is split statically")
def test_node_cap_dynamic_sharing(cap_name, tmp_path):
    """With the engine's reserve hook one rank may use more than half while
    the other uses little, and the sum still never exceeds the cap."""
    cap = 8 << 20
    nc = ferry.NodeCap(cap_name, cap)
    assert nc.reserve(cap - (1 << 20))  # another "rank" takes almost everything
    out = tmp_path / "r.json"
    r = spawn("caprank", cap_name, cap, out, env={"LOCAL_WORLD_SIZE": "2"})
    rc, _, err = wait_all([r])[0]
    assert rc == 0, err[-3000:]
    res = json.loads(out.read_text())
    assert res["node_total"] <= cap
    assert res["arena_reserved"] <= 1 << 20
