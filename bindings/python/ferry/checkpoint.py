"""ferry.checkpoint — snapshot training state to disk without stopping training.

    import ferry.torch
    h = ferry.torch.snapshot({"model": model.state_dict(),
                              "optimizer": opt.state_dict(), "step": step},
                             "ckpt/step-1000.pt", optimizer=opt, module=model)
    loss = model(batch).sum(); loss.backward()   # training goes on
    opt.step()        # the optimizer hook fences first: the file holds the
                      # state as of the snapshot() call
    ...
    h.wait()          # or h.done(); raises CheckpointError naming the path

What happens (docs/checkpoints.md): the object is pickled here exactly as
torch.save pickles it (same persistent ids, same records), so the file is a
torch.save file that torch.load reads; the tensors' bytes are not copied
here but staged by the engine into its pinned arena on its copy stream (a
worker thread on the host backend) and written by a writer thread to
"<path>.tmp", fsynced and renamed over path.

The caller must not modify the snapshotted tensors in place until fence():
the optimizer pre-step hook and the forward pre-hooks of modules that own
buffers (BatchNorm statistics change in a training forward) call it for
you when you pass optimizer= / module=.
"""
import atexit
import io
import json
import os
import pickle
import random
import sys
import threading
import time
import warnings
import zipfile

import torch

import ferry as _pkg
from . import _ferry, _session
from ._ferry import FerryError

__all__ = ["snapshot", "Snapshot", "CheckpointError", "describe", "load_sharded",
           "wait_all", "pending"]

_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)
_DISTRIBUTED_MODES = ("auto", "rank0", "all", "sharded", "dcp")


class CheckpointError(FerryError):
    """A snapshot failed (I/O error, bad path, no memory). `path` is the
    checkpoint's path, `code` the FERRY_E* name; an I/O error is also an
    OSError."""

    def __init__(self, message, path=None, code=None):
        super().__init__(message)
        self.path = path
        self.code = code

    def __str__(self):
        return self.args[0]


class CheckpointIOError(CheckpointError, OSError):
    """A snapshot that could not be written (disk full, unwritable path)."""


def _error(message, path, code):
    cls = CheckpointIOError if code == "FERRY_EIO" else CheckpointError
    return cls(message, path, code)


# ---- the structure -----------------------------------------------------------
def _untyped(t):
    """The untyped storage of a tensor (one Python object per call, one
    StorageImpl: compare ._cdata)."""
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage()
    return t.storage()._storage  # torch 1.13


def describe(obj, keys=None):
    """Walk dicts, lists and tuples like snapshot() does. Returns a dict:
    tensors, tensor_bytes (of their storages, each counted once),
    primitives (None/bool/int/float/str/bytes), objects (other objects,
    passed through to the pickle unchanged) and skipped ("path: module.Type"
    for each such object), plus paths {storage _cdata: (top-level key, path)}.
    keys: only these top-level keys (None: all)."""
    out = {"tensors": 0, "tensor_bytes": 0, "primitives": 0, "objects": 0, "skipped": [],
           "paths": {}}
    seen = out["paths"]

    def walk(x, key, path):
        if isinstance(x, torch.Tensor):
            out["tensors"] += 1
            try:
                st = _untyped(x)
                cid = st._cdata
                if cid not in seen:
                    seen[cid] = (key, path)
                    out["tensor_bytes"] += st.nbytes()
            except (RuntimeError, NotImplementedError, AttributeError):
                pass  # sparse/nested/subclass tensors: the pickler finds their storages
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, key if path else str(k), f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, key if path else str(i), f"{path}.{i}" if path else str(i))
        elif isinstance(x, _PRIMITIVES):
            out["primitives"] += 1
        else:
            out["objects"] += 1
            t = type(x)
            out["skipped"].append(f"{path or '<top>'}: {t.__module__}.{t.__qualname__}")

    if keys is not None and isinstance(obj, dict):
        for k in keys:
            if k in obj:
                walk(obj[k], str(k), str(k))
    else:
        walk(obj, "", "")
    return out


# ---- torch.save's layout -------------------------------------------------------
_layout = None


def _torch_layout():
    """The records torch.save of this torch writes besides data.pkl and
    data/<key>, learned once from a torch.save into memory: (prefix, records
    between data.pkl and the data, records after the data)."""
    global _layout
    if _layout is None:
        buf = io.BytesIO()
        torch.save({"t": torch.zeros(1)}, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            names = z.namelist()
            prefix = names[0].split("/", 1)[0] + "/"
            mid, tail, seen_data = [], [], False
            for n in names:
                rel = n[len(prefix):]
                if rel == "data.pkl":
                    continue
                if rel.startswith("data/"):
                    seen_data = True
                    continue
                (tail if seen_data else mid).append((rel, z.read(n)))
        _layout = (prefix, mid, tail)
    return _layout


def _serialization_id():
    # torch >= 2.x writes a 40-digit id per file; a fresh one per snapshot
    return ("%040d" % random.SystemRandom().randrange(10 ** 40)).encode()


def _pickle_like_torch_save(obj):
    """(data.pkl bytes, {key: untyped storage} in key order): the pickle
    torch.save writes, with the same persistent ids
    ('storage', storage type, key, location, numel)."""
    storages = {}
    id_map = {}
    dtypes = {}

    storage_types = _storage_types()

    def persistent_id(o):
        # called for every object pickled: reject the non-storages first
        if isinstance(o, storage_types):
            if isinstance(o, torch.storage.TypedStorage):
                st = o._untyped_storage if hasattr(o, "_untyped_storage") else o._storage
                dtype = o.dtype
                stype_name = (o._pickle_storage_type() if hasattr(o, "_pickle_storage_type")
                              else o.pickle_storage_type())
                stype = getattr(torch, stype_name)
                numel = o._size() if hasattr(o, "_size") else o.size()
            else:
                st = o
                dtype = torch.uint8
                stype = torch.serialization.normalize_storage_type(type(o))
                numel = st.nbytes()
            if st.device.type == "meta":
                raise CheckpointError("ferry.torch.snapshot: a meta tensor has no data to save")
            ptr = st.data_ptr()
            if ptr:
                if dtypes.setdefault(ptr, dtype) != dtype:
                    raise RuntimeError("Cannot save multiple tensors or storages that view the "
                                       "same data as different types")
            key = id_map.setdefault(st._cdata, str(len(id_map)))
            storages[key] = (st, dtype)
            return ("storage", stype, key, torch.serialization.location_tag(st), numel)
        return None

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=2)  # torch.save's DEFAULT_PROTOCOL
    pickler.persistent_id = persistent_id
    pickler.dump(obj)
    return buf.getvalue(), storages


_storage_type_tuple = None


def _storage_types():
    """TypedStorage (the legacy FloatStorage & co. derive from it) and
    UntypedStorage. Not the legacy classes themselves: isinstance() against
    them warns on torch 2.x."""
    global _storage_type_tuple
    if _storage_type_tuple is None:
        untyped = getattr(torch, "UntypedStorage", None) or getattr(torch, "_UntypedStorage")
        _storage_type_tuple = (torch.storage.TypedStorage, untyped)
    return _storage_type_tuple


# ---- policies ------------------------------------------------------------------
_policies = {}


def _snapshot_policy(policy):
    path = _pkg.policy_path(policy or os.environ.get("FERRY_POLICY") or "default")
    p = _policies.get(path)
    if p is None:
        p = _policies[path] = [_ferry.SnapshotPolicy(path=path), 0]
    return path, p


# ---- engines -------------------------------------------------------------------
def _engine_for(backend, device, policy_path, host_cap, knobs):
    cur = _session.current
    if (cur is not None and not cur.engine.closed and cur.cfg.get("backend") == backend
            and host_cap is None and not knobs):
        return cur.engine  # share the offload engine's arena and cap
    cap_bytes, cap_pct = _session.parse_cap(host_cap if host_cap is not None
                                       else os.environ.get("FERRY_HOST_CAP") or None, "host_cap")
    unknown = set(knobs) - _session.ENGINE_KNOBS
    if unknown:
        raise TypeError(f"ferry.torch.snapshot: unknown knob(s) {', '.join(sorted(unknown))}; "
                        f"known: {', '.join(sorted(_session.ENGINE_KNOBS))}")
    cfg = dict(knobs, backend=backend, device=device, host_cap_bytes=cap_bytes,
               host_cap_pct=cap_pct)
    if cfg.get("link") is not None:
        cfg["link"] = tuple(float(x) for x in cfg["link"])
    return _session.session_for(policy_path, cfg, None).engine


# ---- handles ---------------------------------------------------------------------
_pending = set()
_pending_lock = threading.Lock()


class Snapshot:
    """A checkpoint being written. fence() before modifying the state in
    place (automatic with optimizer=/module=), done() to poll, wait() to
    block; both raise CheckpointError on failure. stats: what was written."""

    def __init__(self, path, c_handle=None, stats=None, skipped_rank=None):
        self.path = path
        self._c = c_handle
        self.stats = stats or {}
        self.skipped_rank = skipped_rank  # set on ranks that write nothing
        self._hooks = []
        self._exc = None
        self._ok = c_handle is None

    # -- hooks that fence automatically
    def _arm(self, optimizers, modules, global_hooks):
        fence = self._fence_hook
        for opt in optimizers:
            if hasattr(opt, "register_step_pre_hook"):
                self._hooks.append(opt.register_step_pre_hook(lambda *a, **k: fence()))
            else:  # torch 1.13: wrap the instance's step
                self._hooks.append(_StepPatch(opt, fence))
        for m in modules:
            for sub in m.modules():
                if sub._buffers:
                    self._hooks.append(sub.register_forward_pre_hook(self._forward_hook))
        if global_hooks:
            optim_mod = sys.modules.get("torch.optim.optimizer")
            if optim_mod is not None and hasattr(optim_mod, "register_optimizer_step_pre_hook"):
                self._hooks.append(optim_mod.register_optimizer_step_pre_hook(
                    lambda *a, **k: fence()))
            reg = getattr(torch.nn.modules.module, "register_module_forward_pre_hook", None)
            if reg is not None:
                self._hooks.append(reg(self._global_forward_hook))

    def _fence_hook(self):
        self.fence()

    def _forward_hook(self, module, args):
        if module.training:  # a training forward may update buffers in place
            self.fence()

    def _global_forward_hook(self, module, args):
        if module.training and module._buffers:
            self.fence()

    def _disarm(self):
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    # -- the API
    @property
    def fenced(self):
        return self._c is None or self._c.fenced

    def fence(self):
        """Order the compute stream after the snapshot's copies (host
        backend: wait for them on the host). After it returns, the tensors
        may be modified: the file holds their values as of snapshot()."""
        if self._c is not None and not self._c.fenced:
            t0 = time.perf_counter()
            try:
                self._c.fence()
            except FerryError as e:
                self._fail(e)
            finally:
                self.stats["fence_ms"] = self.stats.get("fence_ms", 0.0) + \
                    (time.perf_counter() - t0) * 1e3
                self._disarm()
        else:
            self._disarm()

    def done(self):
        """True once the file is durable at path, False while writing;
        raises CheckpointError if it failed."""
        if self._exc is not None:
            raise self._exc
        if self._ok:
            return True
        try:
            ok = self._c.poll()
        except FerryError as e:
            self._fail(e)
        if ok:
            self._finish()
        return ok

    def wait(self):
        """Block until the file is durable; raises CheckpointError naming the
        path if it failed. Returns self."""
        if self._exc is not None:
            raise self._exc
        if not self._ok:
            try:
                self._c.wait()
            except FerryError as e:
                self._fail(e)
            self._finish()
        return self

    def error(self):
        """The failure message, '' if none (yet)."""
        if self._exc is not None:
            return str(self._exc)
        return self._c.error() if self._c is not None else ""

    def _finish(self):
        self._ok = True
        self._disarm()
        with _pending_lock:
            _pending.discard(self)

    def _fail(self, e):
        code = e.args[1] if len(e.args) > 1 else None
        msg = e.args[0] if e.args else str(e)
        self._exc = _error(msg, self.path, code)
        self._disarm()
        with _pending_lock:
            _pending.discard(self)
        raise self._exc

    def __repr__(self):
        state = ("failed" if self._exc else "done" if self._ok else
                 "writing" if self.fenced else "staging")
        return f"<ferry snapshot {self.path!r} {state}>"


class _StepPatch:
    """torch 1.13 has no optimizer step pre-hook: shadow the instance's step."""

    def __init__(self, opt, fence):
        self.opt = opt
        self.had_own = "step" in opt.__dict__
        self.orig = opt.step

        def step(*args, **kwargs):
            fence()
            return self.orig(*args, **kwargs)

        self.wrapper = step
        opt.step = step

    def remove(self):
        if self.opt.__dict__.get("step") is self.wrapper:
            if self.had_own:
                self.opt.step = self.orig
            else:
                del self.opt.step


def pending():
    """Snapshots started and not yet finished (or failed unobserved)."""
    with _pending_lock:
        return list(_pending)


def wait_all():
    """Wait for every pending snapshot; raises the first failure."""
    first = None
    for h in pending():
        try:
            h.wait()
        except CheckpointError as e:
            first = first or e
    if first is not None:
        raise first


@atexit.register
def _wait_at_exit():
    # A file started must be complete when the process ends normally.
    for h in pending():
        try:
            h.wait()
        except CheckpointError as e:
            print(f"ferry: checkpoint {h.path} failed: {e}", file=sys.stderr)


# ---- distributed -------------------------------------------------------------------
def _dist():
    d = getattr(torch, "distributed", None)
    if d is None or not d.is_available() or not d.is_initialized():
        return None
    return d


def _has_sharded_tensors(obj):
    names = ("DTensor", "ShardedTensor")
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if type(x).__name__ in names:
                return True
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return False


def _dcp():
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return None
    return dcp if hasattr(dcp, "save") or hasattr(dcp, "save_state_dict") else None


class _DcpSnapshot(Snapshot):
    """A torch.distributed.checkpoint save (sharded state: DTensor,
    ShardedTensor). DCP stages and writes it itself; ferry only waits."""

    def __init__(self, path, future, stats):
        super().__init__(path, None, stats)
        self._future = future
        self._ok = future is None

    def done(self):
        if self._exc is not None:
            raise self._exc
        if not self._ok and self._future.done():
            self.wait()
        return self._ok

    def wait(self):
        if self._exc is not None:
            raise self._exc
        if not self._ok:
            try:
                self._future.result()
            except Exception as e:  # noqa: BLE001 - reported with the path
                self._exc = CheckpointError(f"snapshot {self.path}: torch.distributed.checkpoint "
                                            f"failed: {e}", self.path, "FERRY_EIO")
                raise self._exc from e
            self._finish()
        return self


def _dcp_save(obj, path, stats):
    dcp = _dcp()
    if dcp is None:
        raise CheckpointError(
            f"ferry.torch.snapshot({path!r}): the state holds sharded tensors (DTensor/"
            f"ShardedTensor) and this torch ({torch.__version__}) has no "
            "torch.distributed.checkpoint; save it with the strategy's own checkpointing",
            path, "FERRY_EINVAL")
    stats["mode"] = "dcp"
    if hasattr(dcp, "async_save"):
        fut = dcp.async_save(obj, checkpoint_id=path)
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (newer torch)
        return _DcpSnapshot(path, fut, stats)
    if hasattr(dcp, "save"):
        dcp.save(obj, checkpoint_id=path)
    else:
        dcp.save_state_dict(obj, dcp.FileSystemWriter(path))
    return _DcpSnapshot(path, None, stats)


def _write_json_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_sharded(path, rank=None, **load_kwargs):
    """Read a snapshot written with distributed="sharded": the list of every
    rank's object, or rank's own. Checks the metadata and that each shard
    is there."""
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    if meta.get("format") != "ferry-sharded/1":
        raise CheckpointError(f"{path}: not a ferry sharded snapshot ({meta.get('format')!r})",
                              path, "FERRY_EINVAL")
    files = [os.path.join(path, s) for s in meta["shards"]]
    missing = [p for p in files if not os.path.exists(p)]
    if missing:
        raise CheckpointError(f"{path}: incomplete sharded snapshot, missing {missing}", path,
                              "FERRY_EIO")
    if rank is not None:
        return torch.load(files[rank], **load_kwargs)
    return [torch.load(p, **load_kwargs) for p in files]


# ---- the entry point -----------------------------------------------------------------
def snapshot(obj, path, *, optimizer=None, module=None, policy=None, keys=None, backend=None,
             host_cap=None, distributed="auto", fence_hooks="auto", **knobs):
    """Write `obj` (nested dicts/lists/tuples of tensors and other objects)
    to `path` as torch.save would, staging the tensors through ferry's
    pinned arena while training goes on. Returns a Snapshot at once.

    optimizer: an optimizer or a list: fence() runs before their next step.
    module: a module or a list: fence() runs before the next training-mode
        forward of each submodule that owns buffers (BatchNorm statistics).
    policy: the policy file whose snapshot(e) function decides per tensor
        (stage through the arena, or copy now; write order); default
        $FERRY_POLICY or "default" (docs/policy-api.md).
    keys: top-level keys whose tensors may be staged (Lightning's
        offload_keys); the tensors of other keys are copied now.
    backend: "host" or "cuda" (default: cuda when a tensor is on a GPU).
    host_cap, knobs: the engine's config when a dedicated engine is needed
        (else the current ferry.torch.offload engine is shared).
    distributed: under an initialised torch.distributed with more than one
        rank: "rank0" (replicated state: only global rank 0 writes), "all"
        (every rank writes its own path), "sharded" (each rank writes
        path/shard-RRRRR-of-WWWWW.pt, rank 0 path/metadata.json), "dcp"
        (torch.distributed.checkpoint into the directory path); "auto":
        "dcp" when the state holds DTensor/ShardedTensor, else "rank0".
    fence_hooks: "auto" (global optimizer/forward hooks when neither
        optimizer nor module is given, torch >= 2.0), "none".
    """
    t0 = time.perf_counter()
    if distributed not in _DISTRIBUTED_MODES:
        raise ValueError(f"ferry.torch.snapshot: distributed={distributed!r} is not one of "
                         f"{', '.join(_DISTRIBUTED_MODES)}")
    if fence_hooks not in ("auto", "none"):
        raise ValueError(f"ferry.torch.snapshot: fence_hooks={fence_hooks!r} is not 'auto' or "
                         "'none'")
    path = os.fspath(path)
    stats = {"mode": "local"}
    d = _dist()
    if d is not None and d.get_world_size() > 1:
        rank, world = d.get_rank(), d.get_world_size()
        mode = distributed
        if mode == "auto":
            mode = "dcp" if _has_sharded_tensors(obj) else "rank0"
        stats.update(mode=mode, rank=rank, world_size=world)
        if mode == "dcp":
            return _dcp_save(obj, path, stats)
        if mode == "rank0" and rank != 0:
            return Snapshot(path, None, stats, skipped_rank=rank)
        if mode == "sharded":
            os.makedirs(path, exist_ok=True)
            shards = [f"shard-{r:05d}-of-{world:05d}.pt" for r in range(world)]
            if rank == 0:
                _write_json_atomic(os.path.join(path, "metadata.json"), {
                    "format": "ferry-sharded/1", "world_size": world, "shards": shards,
                    "torch": torch.__version__, "ferry": _pkg.__version__})
            path = os.path.join(path, shards[rank])
    elif distributed == "dcp":
        return _dcp_save(obj, path, stats)

    desc = describe(obj)
    data_pkl, storages = _pickle_like_torch_save(obj)

    # backend and device: cuda when a storage lives on a GPU
    devices = {st.device for st, _ in storages.values() if st.device.type != "cpu"}
    if backend is None:
        backend = os.environ.get("FERRY_BACKEND") or "auto"
    if backend == "auto":
        backend = "cuda" if any(dv.type == "cuda" for dv in devices) else "host"
    if backend not in ("host", "cuda"):
        raise ValueError(f"ferry.torch.snapshot: backend {backend!r} is not 'host' or 'cuda'")
    cuda_devices = sorted({dv.index or 0 for dv in devices if dv.type == "cuda"})
    if backend == "host" and cuda_devices:
        raise CheckpointError(f"ferry.torch.snapshot({path!r}): backend='host' but the state "
                              "has tensors on a GPU; use backend='cuda'", path, "FERRY_EINVAL")
    device = cuda_devices[0] if cuda_devices else -1
    policy_path, pol = _snapshot_policy(policy)
    engine = _engine_for(backend, device, policy_path, host_cap, knobs)

    # the policy's plan, per storage
    entries = []
    for index, (key, (st, dtype)) in enumerate(storages.items()):
        top, spath = desc["paths"].get(st._cdata, ("", ""))
        entries.append((top, spath, st.nbytes(), index, str(dtype), st.device.type != "cpu"))
    plan = pol[0].plan(entries) if entries else []
    if pol[0].errors > pol[1]:
        pol[1] = pol[0].errors
        warnings.warn(f"ferry: the snapshot function of policy {policy_path} failed: "
                      f"{pol[0].last_error()}; the entries concerned were staged",
                      RuntimeWarning, stacklevel=2)
    key_set = None if keys is None else {str(k) for k in keys}

    prefix, mid, tail = _torch_layout()
    records = [(prefix + "data.pkl", data_pkl)]
    records += [(prefix + rel, data) for rel, data in mid]
    staged = copied = staged_bytes = copied_bytes = 0
    keepalive = []
    storage_keys = list(storages)
    for i in sorted(range(len(entries)), key=lambda i: (plan[i][1], i)):
        key = storage_keys[i]
        st = storages[key][0]
        nbytes = st.nbytes()
        stage = plan[i][0] and (key_set is None or entries[i][0] in key_set)
        on_gpu = st.device.type != "cpu"
        name = f"{prefix}data/{key}"
        if nbytes == 0:
            records.append((name, b""))
            continue
        if stage and (backend == "host" or on_gpu):
            records.append((name, st.data_ptr(), nbytes, st, False))
            staged += 1
            staged_bytes += nbytes
        else:
            host = st.cpu() if on_gpu else st  # torch.save's way: the loop waits
            keepalive.append(host)
            records.append((name, host.data_ptr(), nbytes, host, True))
            copied += 1
            copied_bytes += nbytes
    for rel, data in tail:
        if rel == ".data/serialization_id":
            data = _serialization_id()
        records.append((prefix + rel, data))

    try:
        c = engine.snapshot(path, records)
    except FerryError as e:
        raise _error(e.args[0], path, e.args[1] if len(e.args) > 1 else None) from None
    del keepalive
    stats.update(tensors=desc["tensors"], storages=len(storages), staged=staged,
                 staged_bytes=staged_bytes, copied=copied, copied_bytes=copied_bytes,
                 primitives=desc["primitives"], objects=desc["objects"],
                 skipped=desc["skipped"], pickle_bytes=len(data_pkl), backend=backend,
                 policy=policy_path)
    h = Snapshot(path, c, stats)
    optimizers = [] if optimizer is None else (
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
    modules = [] if module is None else (
        list(module) if isinstance(module, (list, tuple)) else [module])
    h._arm(optimizers, modules, fence_hooks == "auto" and not optimizers and not modules)
    with _pending_lock:
        _pending.add(h)
    stats["blocked_ms"] = (time.perf_counter() - t0) * 1e3
    return h
