"""Checkpoint staging from Python (issue 6): ferry.torch.snapshot writes what
torch.save writes, holds the state as of the call while training goes on,
adds no device memory, keeps the cap, reports errors as exceptions naming
the path, survives a killed writer, follows the policy's snapshot(e), and
writes per rank under torch.distributed.

Run as a script (`python test_checkpoint.py worker ...`) it is the worker
the multi-process tests start."""
import inspect
import io
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import warnings
import zipfile

import pytest
import torch

import ferry
import ferry.torch as ft
from ferry.checkpoint import CheckpointError, CheckpointIOError, describe
from conftest import assert_same_saved, load_saved as load

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def assert_same(a, b, where="obj"):
    assert_same_saved(a, b, where, strict=True)


def clone_state(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, clone_state(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(clone_state(v) for v in x)
    return x


class Tag:
    """A custom object in a checkpoint: pickled as is, reported as skipped."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Tag) and other.name == self.name


def make_model(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 4))


def train_step(model, opt, seed):
    torch.manual_seed(seed)
    model(torch.randn(16, model[0].in_features)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def rich_state():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "state_dict": {"w": torch.randn(5, 7), "bf16": torch.randn(3, 3).to(torch.bfloat16),
                       "mask": torch.tensor([True, False, True]),
                       "idx": torch.arange(10, dtype=torch.int64),
                       "param": torch.nn.Parameter(torch.ones(2, 2)), "empty": torch.empty(0)},
        "views": [base, base[1:3], base.t(), base[:, ::2]],  # one storage, four tensors
        "nested": ({"a": torch.zeros(3, dtype=torch.float16)}, [1, 2.5, "three", None, True]),
        "global_step": 17, "epoch": 2, "name": "run-1", "tag": Tag("x"),
    }


# ---- the file ----------------------------------------------------------------
def torch_save_named(obj, tmp_path, name):
    """torch.save's bytes for a file of this name (its records' directory is
    the name's stem, as in ferry's file)."""
    d = tmp_path / "torch.save"
    d.mkdir(exist_ok=True)
    torch.save(obj, str(d / name))
    return (d / name).read_bytes()


def test_file_is_what_torch_save_writes(tmp_path):
    state = rich_state()
    path = tmp_path / "ck.pt"
    h = ft.snapshot(state, path)
    h.wait()
    assert h.done() and h.fenced
    got = load(path)
    assert_same(state, got)
    # views still share one storage after loading, as with torch.save
    v = got["views"]
    assert v[1].data_ptr() == v[0].data_ptr() + 6 * 4 and v[2].data_ptr() == v[0].data_ptr()

    buf = io.BytesIO(torch_save_named(state, tmp_path, "ck.pt"))
    ours, theirs = zipfile.ZipFile(path), zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    assert ours.namelist() == theirs.namelist()
    for name in ours.namelist():
        if not name.endswith("serialization_id"):
            assert ours.read(name) == theirs.read(name), name  # data.pkl included
    with open(path, "rb") as f:
        raw = f.read()
    raw_theirs = buf.getvalue()

    def extra_ids(data, info):
        """ids of the local header's extra fields: torch pads with "FB" ones"""
        at = info.header_offset + 30 + len(info.filename.encode())
        end = at + int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
        ids = []
        while at + 4 <= end:
            ids.append(data[at:at + 2])
            at += 4 + int.from_bytes(data[at + 2:at + 4], "little")
        return ids

    for info, their in zip(ours.infolist(), theirs.infolist()):
        assert info.compress_type == zipfile.ZIP_STORED
        # local header (30 bytes + name + extra) then data, 64-byte aligned
        start = info.header_offset + 30 + len(info.filename.encode()) + \
            int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
        assert start % 64 == 0, info.filename
        assert b"FB" in extra_ids(raw, info), info.filename
        assert b"FB" in extra_ids(raw_theirs, their), their.filename


def test_every_kind_of_tensor_pickles_as_torch_save_does(tmp_path):
    """Plain dense tensors are reduced by ferry's own _plain_reduce (torch's
    __reduce_ex__ without its checks); every other kind goes to torch. Both
    ways, data.pkl is byte for byte torch.save's."""
    import ferry.checkpoint as ck
    with_attr = torch.ones(2)
    with_attr.note = "kept"  # Python state: torch's path
    hooked = torch.ones(2, requires_grad=True)
    hooked.register_hook(torch.utils.hooks.unserializable_hook(lambda g: g))
    complex_ = torch.randn(3, dtype=torch.complex64)
    state = {
        "plain": torch.randn(3, 4), "offset_view": torch.arange(10.0)[2:7:2],
        "transposed": torch.randn(2, 3).t(), "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3), "grad": torch.ones(2, requires_grad=True),
        "int8": torch.arange(4, dtype=torch.int8), "half": torch.ones(2).half(),
        "conj": complex_.conj(), "neg": torch.randn(2, dtype=torch.complex64).conj().imag,
        "param": torch.nn.Parameter(torch.ones(2)), "with_attr": with_attr, "hooked": hooked,
        "sparse": torch.eye(3).to_sparse(), "shared": [complex_, complex_],
    }
    if hasattr(torch, "uint16"):
        state["uint16"] = torch.zeros(3, dtype=torch.uint16)  # _rebuild_tensor_v3
    h = ft.snapshot(state, tmp_path / "kinds.pt").wait()
    buf = io.BytesIO(torch_save_named(state, tmp_path, "kinds.pt"))
    ours, theirs = zipfile.ZipFile(h.path), zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    # in torch.save's order too (torch 1.x: the keys' string order, "10"
    # before "2": this state has 19 storages)
    assert ours.namelist() == theirs.namelist()
    for name in ours.namelist():
        if not name.endswith("serialization_id"):
            assert ours.read(name) == theirs.read(name), name  # data.pkl included
    # loaded, as torch.save's file loads (torch 1.x drops the conj bit itself)
    got, want = load(h.path), load(io.BytesIO(buf.getvalue()))
    for k, v in want.items():
        pairs = zip(v, got[k]) if isinstance(v, list) else [(v, got[k])]
        for a, b in pairs:
            assert type(a) is type(b) and (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg()), k
            assert torch.equal(a.detach().resolve_conj().resolve_neg().to_dense(),
                               b.detach().resolve_conj().resolve_neg().to_dense()), k
    # the fast path ran where torch has what it needs (torch >= 2)
    assert ferry._checkpoint_records._plain_reduce_on is hasattr(torch.Tensor, "untyped_storage")


def _serialization_id_of(path):
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".data/serialization_id")))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_serialization_id_is_fresh_per_file_and_per_forked_process(tmp_path):
    """torch >= 2.x names each file with a 40-digit id: ferry draws a new one
    per snapshot, and a forked child (a DataLoader worker, a launcher's
    rank) does not repeat its parent's sequence."""
    state = {"w": torch.ones(4)}
    h = ft.snapshot(state, tmp_path / "probe.pt").wait()
    if not any(n.endswith(".data/serialization_id") for n in zipfile.ZipFile(h.path).namelist()):
        pytest.skip("this torch writes no serialization_id")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent through the pipe
        code = 1
        try:
            ft.snapshot(state, tmp_path / "child.pt").wait()
            os.write(w, _serialization_id_of(tmp_path / "child.pt"))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    child = os.read(r, 64)
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    ids = []
    for name in ("a.pt", "b.pt"):
        ft.snapshot(state, tmp_path / name).wait()
        ids.append(_serialization_id_of(tmp_path / name))
    for i in ids + [child]:
        assert len(i) == 40 and i.isdigit(), i
    assert ids[0] != ids[1] and child not in ids


def test_non_tensor_objects_pass_through_and_are_counted(tmp_path):
    state = rich_state()
    h = ft.snapshot(state, tmp_path / "ck.pt").wait()
    s = h.stats
    assert s["objects"] == 1 and s["skipped"] == [f"tag: {__name__}.Tag"]
    assert s["primitives"] == 8  # 1, 2.5, "three", None, True, 17, 2, "run-1"
    assert s["tensors"] == 11 and s["storages"] == 8  # four views share one
    assert load(tmp_path / "ck.pt")["tag"] == Tag("x")
    d = describe(state, keys=["state_dict"])
    assert d["tensors"] == 6 and d["objects"] == 0



def test_describe_walks_what_the_pickler_walks():
    """describe()'s walk (in C): containers through their own iteration
    (an OrderedDict's order decides which path a shared storage gets),
    primitive subclasses as primitives, other objects named by path,
    tensors without a storage counted, and a cycle is a RecursionError."""
    import collections
    import enum

    class Flag(enum.IntEnum):
        ON = 1

    class Name(str):
        pass

    class Seq(list):
        pass

    Pair = collections.namedtuple("Pair", "a b")
    base = torch.arange(16.0)
    od = collections.OrderedDict(first=base[:4], second=base)
    od.move_to_end("first")  # iteration: second, then first
    sparse = torch.eye(3).to_sparse()
    state = {"od": od, "seq": Seq([Flag.ON, Name("n"), (None, 2)]),
             "pair": Pair(torch.ones(2, dtype=torch.float16), {3: Tag("t")}),
             "sparse": sparse, 7: [[base[8:]]]}
    d = describe(state)
    assert d["tensors"] == 5 and d["objects"] == 1 and d["primitives"] == 4
    assert d["skipped"] == [f"pair.1.3: {__name__}.Tag"]
    from ferry.checkpoint import _untyped
    st = _untyped(base)
    assert d["paths"][st._cdata] == ("od", "od.second")
    half = _untyped(state["pair"].a)
    assert d["paths"][half._cdata] == ("pair", "pair.0") and d["dtypes"][half._cdata] == torch.float16
    assert len(d["paths"]) == 2 and d["tensor_bytes"] == 16 * 4 + 2 * 2  # sparse: no storage
    assert describe(Tag("x"))["skipped"] == [f"<top>: {__name__}.Tag"]
    k = describe(state, keys=[7, "missing"])
    assert (k["tensors"], list(k["paths"].values())) == (1, [("7", "7.0.0")])
    cycle = {"a": 1}
    cycle["self"] = [cycle]
    with pytest.raises(RecursionError):
        describe(cycle)


# ---- consistency ----------------------------------------------------------------
def test_checkpoint_holds_state_at_snapshot_time_while_training_continues(tmp_path):
    model = make_model(512)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for i in range(2):
        train_step(model, opt, i)
    at_snapshot = clone_state({"model": model.state_dict(), "optimizer": opt.state_dict()})
    # 3 MiB through a 1 MiB cap over an emulated 200 MB/s link: the last
    # copies are issued only as the writer drains the first ones, long after
    # snapshot() returned (without the fence the file gets later values)
    h = ft.snapshot({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2},
                    tmp_path / "ck.pt", optimizer=opt, module=model, host_cap=1 << 20,
                    link=(200e6, 200e6, 0, 1))
    assert not h.fenced
    for i in range(2, 5):
        train_step(model, opt, i)  # the BatchNorm forward fences first
        assert h.fenced
    h.wait()
    got = load(tmp_path / "ck.pt")
    assert got["step"] == 2
    assert_same(at_snapshot["model"], got["model"], "model")
    assert_same(at_snapshot["optimizer"], got["optimizer"], "optimizer")
    assert not torch.equal(model.state_dict()["0.weight"], got["model"]["0.weight"])


def test_optimizer_hook_fences_before_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)  # no buffers: only the optimizer fences
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    # 4 MiB through a 1 MiB cap: chunks are copied as the writer drains
    # them (without the hook the file holds the stepped weights)
    h = ft.snapshot(model.state_dict(), tmp_path / "ck.pt", optimizer=opt, host_cap=1 << 20,
                    link=(200e6, 200e6, 0, 1))
    model(torch.randn(4, 1024)).sum().backward()
    assert not h.fenced  # forward and backward only read the state
    opt.step()
    assert h.fenced
    h.wait()
    assert torch.equal(load(tmp_path / "ck.pt")["weight"], before)
    assert not torch.equal(model.weight, before)
    # the hook is gone once fenced: later steps do not call into the snapshot
    opt.step()


# ---- memory ---------------------------------------------------------------------
def test_no_device_memory_added_and_arena_returns(tmp_path):
    with ft.offload(torch.nn.Linear(4, 4)) as ctx:  # the snapshot shares this engine
        pass
    e = ctx.engine
    s0 = e.stats()
    state = {"w": torch.randn(1 << 20), "v": torch.randn(1 << 19)}
    h = ft.snapshot(state, tmp_path / "ck.pt")
    assert h.stats["staged_bytes"] == 6 << 20
    h.wait()
    s1 = e.stats()
    assert s1["device_allocs"] == s0["device_allocs"]  # the allocator callback was never called
    assert s1["device_bytes_held"] == s0["device_bytes_held"]
    assert s1["alloc_failures"] == s0["alloc_failures"]
    assert s1["arena_peak"] >= 6 << 20  # staged through the arena ...
    assert s1["arena_in_use"] == s0["arena_in_use"]  # ... and given back
    assert_same(state, load(tmp_path / "ck.pt"))


def test_cap_holds_with_chunked_staging(tmp_path):
    cap = 1 << 20
    state = {f"t{i}": torch.randn(1 << 18) for i in range(8)}  # 8 MiB through a 1 MiB cap
    h = ft.snapshot(state, tmp_path / "ck.pt", host_cap=cap)
    h.fence()
    h.wait()
    assert_same(state, load(tmp_path / "ck.pt"))
    eng = ft._sessions[next(k for k in ft._sessions if ("host_cap_bytes", cap) in k)].engine
    s = eng.stats()
    assert s["arena_cap"] == cap and 0 < s["arena_peak"] <= cap


# ---- errors ---------------------------------------------------------------------
def test_unwritable_path_raises_naming_path_and_training_goes_on(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = tmp_path / "no" / "such" / "dir" / "ck.pt"
    h = ft.snapshot(model.state_dict(), bad, optimizer=opt, module=model)
    train_step(model, opt, 0)
    with pytest.raises(CheckpointIOError) as ei:
        h.wait()
    assert str(bad) in str(ei.value) and "No such file or directory" in str(ei.value)
    assert isinstance(ei.value, OSError) and ei.value.path == str(bad)
    with pytest.raises(CheckpointIOError):
        h.done()  # stays failed
    assert h not in ferry.checkpoint.pending()
    # training is not corrupted: the same steps without any snapshot agree
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train_step(ref, ref_opt, 0)
    assert_same(ref.state_dict(), model.state_dict())
    # and the engine still writes the next one
    ft.snapshot(model.state_dict(), tmp_path / "ok.pt").wait()
    assert_same(model.state_dict(), load(tmp_path / "ok.pt"))


def _can_mount_tmpfs(where):
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                          stderr=subprocess.DEVNULL).returncode == 0


def _temp_files(folder):
    """The snapshots' own temporary files in folder (".NAME.ferry-XXXXXX")."""
    import pathlib
    return [p for p in pathlib.Path(folder).iterdir()
            if p.name.startswith(".") and ".ferry-" in p.name]


def test_disk_full_on_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a tmpfs here (not root); the RLIMIT_FSIZE test covers it")
    try:
        (mnt / "ck.pt").write_bytes(b"previous")
        state = {"w": torch.randn(1 << 20)}  # 4 MiB on a 1 MiB file system
        h = ft.snapshot(state, mnt / "ck.pt")
        with pytest.raises(CheckpointIOError) as ei:
            h.wait()
        msg = str(ei.value)
        assert str(mnt / "ck.pt") in msg and "No space left on device" in msg
        assert (mnt / "ck.pt").read_bytes() == b"previous"
        assert not _temp_files(mnt)
    finally:
        subprocess.run(["umount", str(mnt)])


def test_file_size_limit_surfaces_as_exception(tmp_path):
    """A writer that hits a size limit (RLIMIT_FSIZE: the same failing write
    as a full disk) fails the handle; the process carries on."""
    out = subprocess.run([sys.executable, HERE, "worker", "fsize", str(tmp_path / "ck.pt")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["raised"] == "CheckpointIOError" and str(tmp_path / "ck.pt") in r["message"]
    assert "File too large" in r["message"]
    assert r["previous_intact"] and r["next_ok"]


def test_killed_writer_leaves_previous_checkpoint(tmp_path):
    path = tmp_path / "ck.pt"
    p = subprocess.Popen([sys.executable, HERE, "worker", "crash", str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "second started", p.stderr.read()[-3000:]
        deadline = time.time() + 60
        while (not any(t.stat().st_size > (1 << 20) for t in _temp_files(tmp_path))
               and time.time() < deadline):
            time.sleep(0.01)
        assert _temp_files(tmp_path), "the second snapshot never started writing"
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    got = load(path)
    assert got["version"] == 1
    torch.manual_seed(1)
    assert torch.equal(got["w"], torch.randn(4 << 20))


# ---- policy ---------------------------------------------------------------------
def test_policy_snapshot_function_decides(tmp_path):
    pol = tmp_path / "snap.lua"
    pol.write_text(
        'local R = require "ferry.rules"\n'
        'return R.policy { name = "snap", R.min_bytes(1024),\n'
        '  snapshot = R.snapshot { keys = { "state_dict", "optimizer_states" },\n'
        '                          min_bytes = 64, order = { "optimizer_states" } } }\n')
    state = {"state_dict": {"w": torch.randn(100), "tiny": torch.ones(2)},
             "optimizer_states": [{"m": torch.randn(50)}],
             "callbacks": {"x": torch.randn(30)}}
    h = ft.snapshot(state, tmp_path / "ck.pt", policy=str(pol)).wait()
    assert h.stats["staged"] == 2 and h.stats["copied"] == 2  # tiny: small; callbacks: key
    assert h.stats["staged_bytes"] == 600
    names = [n.rsplit("/", 1)[-1] for n in zipfile.ZipFile(tmp_path / "ck.pt").namelist()
             if "/data/" in n]
    assert names == ["2", "0", "1", "3"]  # optimizer_states first, then traversal order
    assert_same(state, load(tmp_path / "ck.pt"))
    # keys= (Lightning's offload_keys) narrows further
    h = ft.snapshot(state, tmp_path / "ck2.pt", policy=str(pol), keys=["state_dict"]).wait()
    assert h.stats["staged"] == 1
    assert_same(state, load(tmp_path / "ck2.pt"))


def test_policy_fault_stages_and_warns(tmp_path):
    pol = tmp_path / "bad.lua"
    pol.write_text('return { api = 1, decide = function() return ferry.KEEP end,\n'
                   '  snapshot = function(e) error("cannot decide " .. e.path) end }\n')
    state = {"a": torch.randn(10), "b": torch.randn(20)}
    with pytest.warns(RuntimeWarning, match=r"bad\.lua:2: cannot decide"):
        h = ft.snapshot(state, tmp_path / "ck.pt", policy=str(pol))
    h.wait()
    assert h.stats["staged"] == 2
    assert_same(state, load(tmp_path / "ck.pt"))


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="distributed='everyone'"):
        ft.snapshot({}, tmp_path / "x.pt", distributed="everyone")
    with pytest.raises(TypeError, match="unknown knob"):
        ft.snapshot({"a": torch.ones(1)}, tmp_path / "x.pt", host_cap="1G", bogus=1)
    with pytest.raises(FileNotFoundError, match="unknown policy"):
        ft.snapshot({"a": torch.ones(1)}, tmp_path / "x.pt", policy="nope")


def test_same_path_twice_at_once_is_refused(tmp_path):
    state = {"w": torch.randn(1 << 20)}
    h = ft.snapshot(state, tmp_path / "ck.pt", link=(50e6, 50e6, 0, 1))
    with pytest.raises(CheckpointError, match="ck.pt"):
        ft.snapshot(state, tmp_path / "ck.pt", link=(50e6, 50e6, 0, 1))
    h.wait()


# ---- distributed ------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(mode, path, world=2):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, HERE, "worker", "dist", mode, str(path), str(r),
                               str(world), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def rank_state(rank):
    torch.manual_seed(100 + rank)
    return {"w": torch.randn(64, 64), "rank": rank}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_rank0_writes_replicated_state(tmp_path):
    outs = run_ranks("rank0", tmp_path / "ck.pt")
    assert outs[0]["wrote"] and not outs[1]["wrote"] and outs[1]["skipped_rank"] == 1
    assert_same(rank_state(0), load(tmp_path / "ck.pt"))


def test_sharded_mode_is_retired_with_a_pointer_to_dcp(tmp_path):
    with pytest.raises(ValueError, match="retired: use distributed='dcp'"):
        ft.snapshot({"w": torch.ones(2)}, tmp_path / "ck", distributed="sharded")
    assert not hasattr(ferry.checkpoint, "load_sharded")


def _dcp_has_stager():
    dcp = ferry.checkpoint._dcp()
    return dcp is not None and hasattr(dcp, "async_save") and \
        "async_stager" in inspect.signature(dcp.async_save).parameters


needs_stager = pytest.mark.skipif(not _dcp_has_stager(),
                                  reason="this torch's dcp.async_save takes no async_stager")


def full_weight():
    torch.manual_seed(7)
    return torch.randn(64, 48)


@needs_stager
def test_dcp_two_ranks_staged_by_ferry_load_at_world_size_one(tmp_path):
    # each rank holds a DTensor shard (Shard(0) over a 2-rank gloo mesh) and
    # changes it in place right after fence(): the checkpoint must hold the
    # values as of snapshot(), and dcp.load in one process (no process
    # group) must put the shards back together
    import torch.distributed.checkpoint as dcp

    outs = run_ranks("dcp", tmp_path / "dcp")
    for o in outs:
        assert o["mode"] == "dcp" and o["stager"] == "ferry"
        assert o["staged"] == 2 and o["staged_bytes"] == 32 * 48 * 4 + 10 * 8
        assert o["arena_peak"] >= o["staged_bytes"]  # the pinned arena held the copies
        assert o["arena_in_use_after"] == 0            # and got them back
    assert (tmp_path / "dcp" / ".metadata").exists()
    back = {"w": torch.zeros(64, 48), "step": torch.zeros(10, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(back, checkpoint_id=str(tmp_path / "dcp"))
    assert torch.equal(back["w"], full_weight())
    assert torch.equal(back["step"], torch.arange(10))


@needs_stager
def test_stager_is_dcps_async_stager_and_isolates_the_state(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    stager = ferry.checkpoint.Stager(host_cap="64M")
    assert isinstance(stager, AsyncStager)
    state = {"w": torch.randn(256, 256), "t": torch.randn(16, 8).t(), "n": 5,
             "empty": torch.zeros(0, 3), "nested": {"h": torch.arange(7, dtype=torch.int16)}}
    ref = {"w": state["w"].clone(), "t": state["t"].clone(), "h": state["nested"]["h"].clone()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resp = dcp.async_save(state, checkpoint_id=str(tmp_path / "ck"), async_stager=stager)
        resp.staging_completion.result()
        state["w"].mul_(0)
        state["t"].add_(1)
        state["nested"]["h"].fill_(-1)
        resp.upload_completion.result()
        stager.close()
        back = {"w": torch.zeros(256, 256), "t": torch.zeros(8, 16), "n": 0,
                "empty": torch.ones(0, 3), "nested": {"h": torch.zeros(7, dtype=torch.int16)}}
        dcp.load(back, checkpoint_id=str(tmp_path / "ck"))
    assert torch.equal(back["w"], ref["w"]) and torch.equal(back["t"], ref["t"])
    assert torch.equal(back["nested"]["h"], ref["h"]) and back["n"] == 5
    assert stager.stats == {"tensors": 3, "staged_bytes": 256 * 256 * 4 + 16 * 8 * 4 + 7 * 2}


@needs_stager
def test_stager_refuses_what_the_host_cap_cannot_hold():
    stager = ferry.checkpoint.Stager(host_cap=1 << 20)
    with pytest.raises(CheckpointError, match="cap"):
        stager.stage({"w": torch.zeros(1 << 20)})  # 4 MiB into a 1 MiB cap
    stager.close()


# ---- the worker ---------------------------------------------------------------------
def _worker(argv):
    torch.set_num_threads(1)
    what = argv[0]
    if what == "fsize":
        path = argv[1]
        ft.snapshot({"version": 0, "w": torch.zeros(16)}, path).wait()
        before = open(path, "rb").read()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        h = ft.snapshot({"version": 1, "w": torch.randn(1 << 20)}, path)
        raised, message = None, ""
        try:
            h.wait()
        except CheckpointError as e:
            raised, message = type(e).__name__, str(e)
        intact = open(path, "rb").read() == before and not _temp_files(os.path.dirname(path))
        ft.snapshot({"small": torch.ones(4)}, path + ".next").wait()
        print(json.dumps({"raised": raised, "message": message, "previous_intact": intact,
                          "next_ok": torch.equal(load(path + ".next")["small"], torch.ones(4))}))
    elif what == "crash":
        path = argv[1]
        torch.manual_seed(1)
        ft.snapshot({"version": 1, "w": torch.randn(4 << 20)}, path).wait()
        # the second one crawls through a 1 MiB cap over a 20 MB/s emulated link
        ft.snapshot({"version": 2, "w": torch.randn(16 << 20)}, path, host_cap=1 << 20,
                    link=(20e6, 20e6, 0, 1))
        print("second started", flush=True)
        time.sleep(120)  # killed meanwhile
    elif what == "dist":
        mode, path, rank, world, port = argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        state = rank_state(rank)
        if mode == "dcp":  # a sharded weight and a replicated plain tensor
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            state = {"w": distribute_tensor(full_weight(), mesh, [Shard(0)]),
                     "step": torch.arange(10)}
        h = ft.snapshot(state, path, distributed=mode)
        out = {"wrote": h.skipped_rank is None, "skipped_rank": h.skipped_rank,
               "mode": h.stats["mode"]}
        if mode == "dcp":
            h.fence()
            state["w"].to_local().add_(100)  # training goes on: not in the checkpoint
            state["step"].zero_()
        h.wait()
        dist.barrier()
        if mode == "dcp":
            import gc

            gc.collect()
            st = h.stager.engine.stats()
            out.update(stager=h.stats["stager"], staged=h.stats["staged"],
                       staged_bytes=h.stats["staged_bytes"], arena_peak=st["arena_peak"],
                       arena_in_use_after=st["arena_in_use"])
        dist.destroy_process_group()
        print(json.dumps(out))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    _worker(sys.argv[2:])


def test_checkpoint_does_not_import_ferry_torch():
    # Dependencies go one way: ferry.torch -> ferry.checkpoint -> ferry._session.
    code = ("import sys, ferry.checkpoint; assert 'ferry.torch' not in sys.modules, 'cycle'; "
            "import ferry.torch as ft; assert ft.snapshot is ferry.checkpoint.snapshot; "
            "assert ft._current is None and ft._sessions is ferry._session.sessions")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
