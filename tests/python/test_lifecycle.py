"""Items 1, 3, 7: package import, no leak over 1,000 steps, bad input."""
import gc
import os
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

import ferry
import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss

HERE = os.path.dirname(os.path.abspath(__file__))


def run_py(code, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=120)


# ---- item 1: the package -----------------------------------------------------------
def test_import_without_torch():
    r = run_py("import sys; sys.modules['torch'] = None\n"
               "import ferry; i = ferry.info(); print(i['version'], i['arena'], 'torch' in sys.modules and sys.modules['torch'])")
    assert r.returncode == 0, r.stderr
    version, arena, torch_loaded = r.stdout.split()
    assert version == ferry.__version__ and arena == "pool" and torch_loaded == "None"


def test_info_reports_jemalloc_when_preloaded():
    lib = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
    if not os.path.exists(lib):
        pytest.skip("Debian's libjemalloc2 is not installed")
    r = run_py("import ferry; print(ferry.info()['arena'], ferry.info()['jemalloc_preloaded'])",
               {"LD_PRELOAD": lib})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["jemalloc", "True"]


def test_info_backends():
    i = ferry.info()
    assert i["backends"]["host"]["available"] is True
    cuda = i["backends"]["cuda"]
    assert cuda["available"] == torch.cuda.is_available() or "error" in cuda
    if not cuda["available"]:
        assert cuda["error"]  # says why


# ---- item 3: no leak ------------------------------------------------------------------
class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_no_leak_over_1000_steps():
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 64)
    refs = []
    catch = lambda mod, inp, out: refs.append(weakref.ref(out))
    hooks = [b.register_forward_hook(catch) for b in model.blocks]
    counts = {}
    for i in range(1000):
        with ft.offload(model, policy="default"):
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        if i in (99, 999):
            gc.collect()
            counts[i] = len(gc.get_objects()) - len(refs)
    for h in hooks:
        h.remove()
    assert ft.step() == 0
    s = ft.stats()
    assert s["steps"] == 1000
    assert s["tensors_offloaded"] >= 1000 * 3 and s["bytes_h2d"] + s["stash_hits"] > 0
    for k in ("live_handles", "device_bytes_held", "arena_in_use"):
        assert s[k] == 0, (k, s[k])
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} activations kept alive"
    # Python objects do not pile up step after step (slack for caches)
    assert counts[999] - counts[99] < 200, counts


def test_forward_without_backward_frees_everything():
    """A graph dropped without backward (evaluation with grad on) must not
    leak: kept outputs are stored without their grad_fn (no C++ cycle)."""
    torch.manual_seed(0)
    model = GPT(layers=2)
    refs = []
    model.h[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    with ft.offload(model, policy="default"):
        out = model(gpt_batch()[:, :-1])
        y = out.exp()  # exp saves its output
    assert ft.stats()["live_handles"] > 0
    del out, y
    gc.collect()
    assert ft.stats()["live_handles"] == 0
    assert ft.step() == 0
    s = ft.stats()
    assert s["device_bytes_held"] == 0 and s["arena_in_use"] == 0
    assert all(r() is None for r in refs)


KEEP_CACHED = ("return { api = 1, name = 'keep-cached', decide = function(t, ctx)\n"
               "  return ferry.KEEP, ferry.ON_USE, nil, true end }\n")


def test_cached_keeps_hold_no_handle_and_keep_every_promise(tmp_path):
    """A site the policy answered 'keep' before (cacheable) is kept without
    an engine handle (ferry_pack_cached_keep). Such tensors still come back
    bit-identical, an in-place change is still torch's error, a graph
    dropped without backward is freed when the step ends, and the engine
    counts them."""
    policy = tmp_path / "keep_cached.lua"
    policy.write_text(KEEP_CACHED)
    torch.manual_seed(0)
    model, ref = GPT(layers=2), GPT(layers=2)
    ref.load_state_dict(model.state_dict())
    batch = gpt_batch()
    for _ in range(2):  # the second step's sites are all answered from the cache
        with ft.offload(model, policy=str(policy), backend="host"):
            loss = gpt_loss(model, batch)
        loss.backward()
        gpt_loss(ref, batch).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)
    ft.step()
    s = ft.stats()
    assert s["tensors_kept_unheld"] > s["tensors_packed"] // 3, s
    assert s["live_handles"] == 0 and s["device_bytes_held"] == 0

    # the same site twice: the second save takes the cached path
    x = torch.randn(4096, requires_grad=True)
    with ft.offload(None, policy=str(policy), backend="host"):
        x.exp().sum().backward()
        before = ft.stats()["tensors_kept_unheld"]
        y = x.exp()  # exp saves its output: a grad_fn that must not own it
        assert ft.stats()["tensors_kept_unheld"] == before + 1
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        refs = [weakref.ref(y)]
        z = x.exp()
        refs.append(weakref.ref(z))
    del y, z
    gc.collect()
    # kept tensors are stored as themselves until the step ends; then those
    # still saved hold a detached alias, and a dropped graph goes
    assert ft.step() == 0
    gc.collect()
    assert all(r() is None for r in refs), "a graph dropped without backward kept its tensors"

    # a graph alive across the step's end: its kept tensors hold aliases by
    # then, which still give the same values and still see in-place changes
    x.grad = None
    with ft.offload(None, policy=str(policy), backend="host"):
        y, w = x.exp(), x.exp()
    assert ft.step() == 0
    y.sum().backward()
    assert torch.equal(x.grad, x.exp())
    w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        w.sum().backward()


def test_offload_made_every_step_follows_arguments_environment_and_cwd(tmp_path, monkeypatch):
    """offload() derives its configuration once per (arguments, environment,
    working directory): the same call every step reuses it; a changed
    variable or directory is seen at the next call."""
    m = torch.nn.Linear(4, 4)
    monkeypatch.delenv("FERRY_RELEASE_COPIED", raising=False)
    a, b = ft.offload(m, backend="host"), ft.offload(m, backend="host")
    assert a.session is b.session and not a.engine.info()["release_when_copied"]
    monkeypatch.setenv("FERRY_RELEASE_COPIED", "1")
    c = ft.offload(m, backend="host")
    assert c.session is not a.session and c.engine.info()["release_when_copied"]
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "p.lua").write_text(KEEP_CACHED)
    monkeypatch.chdir(tmp_path / "one")
    assert ft.offload(m, policy="p.lua", backend="host").policy_path == str(tmp_path / "one" / "p.lua")
    monkeypatch.chdir(tmp_path / "two")
    assert ft.offload(m, policy="p.lua", backend="host").policy_path == str(tmp_path / "two" / "p.lua")
    with pytest.raises(TypeError, match="max_stash"):  # still checked on every call
        ft.offload(m, max_stash=3)


def test_alternating_policies_swap_back_without_reload(tmp_path):
    """Two contexts on one engine configuration, each with its own policy,
    entered in turn: each policy comes back with its Lua state (a counter
    here), not reloaded, until its file changes."""
    second = ("local n = 0\n"
              "return { api = 1, name = 'second', decide = function(t, ctx)\n"
              "  n = n + 1\n"
              "  if n == 2 then return ferry.OFFLOAD end\n"
              "  return ferry.KEEP end }\n")
    a, b = tmp_path / "a.lua", tmp_path / "b.lua"
    a.write_text(second)
    b.write_text(KEEP_CACHED)
    x = torch.randn(4096, requires_grad=True)

    def run(policy):  # one step saving one 16 KiB tensor; the engine's offload count after it
        with ft.offload(None, policy=str(policy), backend="host", max_fwd_stash=0):
            y = x.exp()
        y.sum().backward()
        ft.step()
        return ft.stats()["tensors_offloaded"]

    counts = [run(p) for p in (a, b, a)]
    assert counts[2] - counts[0] == 1, counts  # a's second decision, after b's turn
    a.write_text("-- edited\n" + second)
    counts = [run(p) for p in (b, a)]
    assert counts[1] == counts[0], counts  # reloaded: its first decision again


def test_close_with_live_graph_then_gc():
    model = GPT(layers=2)
    with ft.offload(model, policy="default"):
        loss = gpt_loss(model, gpt_batch())
    ft.close()  # engine destroyed while the graph still holds handles
    with pytest.raises(RuntimeError, match="engine holding this saved tensor was closed"):
        loss.backward()  # autograd re-raises the hook's FerryError as RuntimeError
    del loss
    gc.collect()


# ---- item 7: bad input ------------------------------------------------------------------
def test_unknown_policy_name():
    with pytest.raises(FileNotFoundError) as e:
        ft.offload(torch.nn.Linear(2, 2), policy="no_such_policy")
    msg = str(e.value)
    assert "no_such_policy" in msg and "default" in msg  # lists the shipped ones


def test_missing_policy_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ft.offload(torch.nn.Linear(2, 2), policy=str(tmp_path / "nope.lua"))


def test_policy_that_does_not_load(tmp_path):
    p = tmp_path / "broken.lua"
    p.write_text("return {\n api = 1,\n decide = function(t, ctx) return end end\n")  # syntax error
    with pytest.raises(ferry.FerryError) as e:
        ft.offload(torch.nn.Linear(2, 2), policy=str(p))
    assert "broken.lua" in str(e.value)


def test_policy_failing_at_run_time_never_stops_training(tmp_path):
    p = tmp_path / "fails.lua"
    p.write_text("return { api = 1, name = 'fails', decide = function(t, ctx)\n"
                 "  error('boom') end }\n")
    torch.manual_seed(0)
    model = GPT(layers=2)
    ref = GPT(layers=2)
    ref.load_state_dict(model.state_dict())
    batch = gpt_batch()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            with ft.offload(model, policy=str(p)):
                loss = gpt_loss(model, batch)
            loss.backward()
        ft.step()
    mine = [x for x in w if "fails.lua" in str(x.message)]
    assert len(mine) == 1, [str(x.message) for x in w]  # warned once
    assert "boom" in str(mine[0].message)
    s = ft.stats()
    assert s["policy_errors"] > 0 and s["tensors_offloaded"] == 0
    for _ in range(3):
        gpt_loss(ref, batch).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_unknown_knob_and_bad_values():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="unknown knob"):
        ft.offload(m, max_stash=3)
    with pytest.raises(ValueError, match="backend"):
        ft.offload(m, backend="tpu")
    with pytest.raises(ValueError, match="host_cap 140%: must be above 0% and at most 100%"):
        ft.offload(m, host_cap="140%")
    with pytest.raises(ValueError, match="host_cap 12 parsecs: unexpected"):
        ft.offload(m, host_cap="12 parsecs")
    with pytest.raises(TypeError, match="nn.Module"):
        ft.offload(object())
    if not torch.cuda.is_available():
        with pytest.raises(ferry.FerryError, match="no GPU"):
            ft.offload(m, backend="cuda")


def test_special_tensors_kept_with_reason():
    """Sparse and subclass tensors (and non-dense views, see test_autograd)
    are kept, each counted under its reason."""

    class Sub(torch.Tensor):
        pass

    w = torch.randn(64, 64, requires_grad=True)
    sp = torch.randn(64, 64).relu().to_sparse().requires_grad_()
    sub = torch.randn(64, 64).as_subclass(Sub).requires_grad_()
    with ft.offload(None, policy="default"):
        a = torch.sparse.mm(sp, w).sum()
        b = (sub * w).sum()
    (a + b).backward()
    s = ft.stats()
    assert s["kept_sparse"] > 0, s
    assert s["kept_subclass"] > 0, s


def test_env_defaults(tmp_path):
    """`ferry run` passes FERRY_POLICY/FERRY_TRACE/FERRY_HOST_CAP/FERRY_BACKEND."""
    trace = tmp_path / "env.jsonl"
    code = ("import torch, ferry.torch as ft\n"
            "m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))\n"
            "with ft.offload(m):\n"
            "    l = m(torch.randn(32, 64)).sum()\n"
            "l.backward(); ft.step(); s = ft.stats()\n"
            "print(s['policy'], s['arena_cap'], s['backend'])\n"
            "ft.close()\n")
    r = run_py(code, {"FERRY_POLICY": ferry.policy_path("layers"), "FERRY_TRACE": str(trace),
                      "FERRY_HOST_CAP": "64M", "FERRY_BACKEND": "host"})
    assert r.returncode == 0, r.stderr
    policy, cap, backend = r.stdout.split()
    assert policy.endswith("layers.lua") and int(cap) == 64 << 20 and backend == "host"
    assert trace.exists() and trace.stat().st_size > 0


def test_host_cap_falls_back_to_keep():
    """A cap too small for anything: everything is kept, counted, gradients fine."""
    torch.manual_seed(0)
    model = GPT(layers=2)
    ref = GPT(layers=2)
    ref.load_state_dict(model.state_dict())
    batch = gpt_batch()
    with ft.offload(model, policy="default", host_cap=4096):
        loss = gpt_loss(model, batch)
    loss.backward()
    gpt_loss(ref, batch).backward()
    s = ft.stats()
    assert s["cap_fallbacks"] > 0 and s["arena_reserved"] <= 4096
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_makes_its_own_engines_and_exits(tmp_path):
    """After fork() the parent's engines have no copy threads in the child
    (nor its snapshots a writer): a call into them is a clear error, not a
    wait forever; offload() and snapshot() make new engines there (a
    snapshot in the child used to wait forever on the parent's engine); and
    the child exits normally (atexit, engine deallocation) while the
    parent's snapshot is still draining."""
    code = f"""
import os, sys, torch, ferry, ferry.torch as ft
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
x = torch.randn(64, 256)
def step():
    with ft.offload(m, backend="host") as ctx:
        m(x).sum().backward()
    return ctx
parent_engine = step().engine
# 8 MiB over an emulated 20 MB/s link: still draining at the fork
h = ft.snapshot({{"w": torch.randn(1 << 21)}}, {str(tmp_path / "parent.pt")!r},
                link=(20e6, 20e6, 0, 1))
pid = os.fork()
if pid == 0:
    try:
        parent_engine.stats()
        print("no error from the parent's engine"); os._exit(3)
    except ferry.FerryError as e:
        assert "forked" in str(e) and e.args[1] == "FERRY_ESTATE", e.args
    try:
        h.done()
        print("no error from the parent's snapshot"); os._exit(4)
    except Exception as e:
        assert "forked" in str(e), e
    # (no backward here: torch's own thread pools do not survive a fork)
    child_engine = ft.offload(m, backend="host").engine
    assert child_engine is not parent_engine and child_engine.stats() is not None
    ft.snapshot({{"w": torch.ones(8)}}, {str(tmp_path / "child.pt")!r}).wait()
    assert torch.load({str(tmp_path / "child.pt")!r})["w"].sum() == 8
    sys.exit(0)  # a normal exit: atexit handlers, engines deallocated
_, status = os.waitpid(pid, 0)
h.wait()
assert not ft.snapshot({{"w": torch.ones(1)}}, {str(tmp_path / "again.pt")!r}).wait().error()
print("child", os.waitstatus_to_exitcode(status))
"""
    r = run_py(code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["child", "0"], r.stdout + r.stderr
