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

What happens (docs/checkpoints.md): torch's own serializer (the body of
torch.save) pickles the object here and produces every record, so the file
is a torch.save file that torch.load reads; the tensors' bytes are not
copied by torch but staged by the engine into its pinned arena on its copy stream (a
worker thread on the host backend) and written by a writer thread to
"<path>.tmp", fsynced and renamed over path.

The caller must not modify the snapshotted tensors in place until fence():
the optimizer pre-step hook (after a step's closure) and the forward
pre-hooks of modules that own buffers (BatchNorm statistics change in a
training forward) call it for you; anything else that changes the state in
place must call fence() first (docs/checkpoints.md, "Fencing").
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import functools
import inspect
import io
import os
import pickle
import random
import sys
import threading
import time
import warnings
import weakref
import zipfile
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import torch

from ._policy import PolicyLike
import ferry as _pkg
from . import _ferry, _session
from ._ferry import FerryError
from ._checkpoint_fences import fence_after_closure, register_global_step_pre_hook

__all__ = ["snapshot", "Snapshot", "Stager", "CheckpointError", "describe",
           "wait_all", "pending", "reserve"]

_DISTRIBUTED_MODES = ("auto", "rank0", "all", "dcp")


from ._checkpoint_errors import CheckpointError, CheckpointIOError, _error  # noqa: E402,F401
from ._checkpoint_records import (describe, _untyped, _torch_records, _container_records,  # noqa: E402,F401
                                  _archive_name, _serialization_id, _dtype_name)




# ---- policies ------------------------------------------------------------------
_policies = {}
_policy_paths = {}  # (policy, $FERRY_POLICY, $FERRY_POLICY_DIR) -> its file


def _snapshot_policy(policy):
    # A name is resolved once per (name, environment): resolving looks in
    # every policy directory (60 us a snapshot), and even a stat of the file
    # found costs 30-35 us right after a training step (the kernel's path
    # walk runs cache-cold; docs/checkpoints.md). The file is read once
    # either way (its instance is kept per path below). A ferry.Policy is
    # its own file: not looked up.
    named = policy is None or isinstance(policy, str)
    key = (policy, os.environ.get("FERRY_POLICY"), os.environ.get("FERRY_POLICY_DIR"))
    path = _policy_paths.get(key) if named else None
    if path is None:
        path = _pkg.policy_path(policy or key[1] or "default")
        if named:
            _policy_paths[key] = path
    p = _policies.get(path)
    if p is None:
        p = _policies[path] = [_ferry.PolicyInstance(path=path), 0]
    return path, p


# ---- engines -------------------------------------------------------------------
def _backend_device(backend, devices, who, path=None):
    """(backend, cuda device or -1) for tensors on `devices`: backend None
    or "auto" means $FERRY_BACKEND, else cuda when a tensor is on a GPU."""
    if backend is None:
        backend = os.environ.get("FERRY_BACKEND") or "auto"
    if backend == "auto":
        backend = "cuda" if any(dv.type == "cuda" for dv in devices) else "host"
    if backend not in ("host", "cuda"):
        raise ValueError(f"{who}: backend {backend!r} is not 'host' or 'cuda'")
    cuda_devices = sorted({dv.index or 0 for dv in devices if dv.type == "cuda"})
    if backend == "host" and cuda_devices:
        raise CheckpointError(f"{who}: backend='host' but the state has tensors on a GPU; "
                              "use backend='cuda'", path, "FERRY_EINVAL")
    return backend, cuda_devices[0] if cuda_devices else -1


_engines = {}  # (backend, device, policy, $FERRY_HOST_CAP) -> Session, given no cap or knob


def _engine_for(backend, device, policy_path, host_cap, knobs):
    plain = host_cap is None and not knobs
    cur = _session.current
    if plain and cur is not None and not cur.engine.closed and cur.cfg.get("backend") == backend:
        return cur.engine  # share the offload engine's arena and cap
    if plain:  # the session found last time (its config built and sorted: 16 -> 4 us)
        key = (backend, device, policy_path, os.environ.get("FERRY_HOST_CAP"))
        s = _engines.get(key)
        if s is not None and not s.engine.closed:
            return s.engine
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
    s = _session.session_for(policy_path, cfg, None)
    if plain:
        _engines[key] = s
    return s.engine


# ---- handles ---------------------------------------------------------------------
_pending = set()
_pending_lock = threading.Lock()


def _after_fork_in_child():
    # the pending snapshots are the parent's to finish (their writers did not
    # fork), and the lock may have been held by a thread that did not either
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Snapshot:
    """A checkpoint being written. fence() before modifying the state in
    place (automatic with optimizer=/module=), done() to poll, wait() to
    block; both raise CheckpointError on failure. stats: what was written."""

    def __init__(self, path: str, c_handle: Optional[_ferry.Snapshot] = None,
                 stats: Optional[Dict[str, Any]] = None,
                 skipped_rank: Optional[int] = None) -> None:
        self.path = path
        self._c = c_handle
        self.stats = stats or {}
        self.skipped_rank = skipped_rank  # set on ranks that write nothing
        self._hooks = []
        self._exc = None
        self._ok = c_handle is None
        self._trimmer = None  # trim=: the thread that trims once the file is durable
        # the ferry.Engine that wrote it (its stats() say how: snapshot_bytes_direct,
        # snapshot_bytes_buffered); None for a snapshot no engine wrote
        self.engine = None

    # -- hooks that fence automatically
    def _arm(self, optimizers, modules, global_step, global_forward):
        fence = self._fence_hook
        for opt in optimizers:
            if hasattr(opt, "register_step_pre_hook"):
                self._hooks.append(_ArmedFor(opt, self))
            else:  # torch 1.13: wrap the instance's step
                self._hooks.append(_StepPatch(opt, fence))
        for m in modules:
            for sub in m.modules():
                if sub._buffers:
                    self._hooks.append(sub.register_forward_pre_hook(self._forward_hook))
        if global_step:  # every optimizer's step (torch 1.13: ferry's own hook)
            self._hooks.append(register_global_step_pre_hook(self._step_hook))
        if global_forward:
            reg = getattr(torch.nn.modules.module, "register_module_forward_pre_hook", None)
            if reg is not None:
                self._hooks.append(reg(self._global_forward_hook))

    def _fence_hook(self):
        self.fence()

    def _step_hook(self, optimizer, args, kwargs):
        return fence_after_closure(self.fence, args, kwargs)

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
    def fenced(self) -> bool:
        return self._c is None or self._c.fenced

    def fence(self) -> None:
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
                self._disarm()  # part of what the step waits for: timed too
                self.stats["fence_ms"] = self.stats.get("fence_ms", 0.0) + \
                    (time.perf_counter() - t0) * 1e3
        else:
            self._disarm()

    def done(self) -> bool:
        """True once the file is durable at path (and, with trim=, its
        staging memory given back), False before; never blocks; raises
        CheckpointError if it failed."""
        if self._exc is not None:
            raise self._exc
        if self._ok:
            return True
        try:
            ok = self._c.poll()
        except FerryError as e:
            self._fail(e)
        t = self._trimmer
        if ok and t is not None and t.is_alive() and t is not threading.current_thread():
            return False  # a poll: the trim (munmap, cudaHostUnregister) may take a while
        if ok:
            self._finish()
        return ok

    def wait(self) -> Snapshot:
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

    def error(self) -> str:
        """The failure message, '' if none (yet)."""
        if self._exc is not None:
            return str(self._exc)
        return self._c.error() if self._c is not None else ""

    def _start_trimmer(self, engine, keep_bytes):
        c = self._c

        def trim_when_durable():
            try:
                c.wait()  # the staging buffers are back in the arena, failed or not
            except FerryError:
                pass  # reported by done()/wait()
            try:
                self.stats["trimmed_bytes"] = engine.trim(keep_bytes)
            except FerryError:
                pass  # an engine closed meanwhile has nothing left to trim
        self._trimmer = threading.Thread(target=trim_when_durable, daemon=True,
                                         name="ferry-checkpoint-trim")
        self._trimmer.start()

    def _join_trimmer(self):
        # done()/wait() report the memory given back, not only the file
        t = self._trimmer
        if t is not None and t is not threading.current_thread():
            t.join()

    def _finish(self):
        self._ok = True
        self._disarm()
        self._join_trimmer()
        with _pending_lock:
            _pending.discard(self)

    def _fail(self, e):
        code = e.args[1] if len(e.args) > 1 else None
        msg = e.args[0] if e.args else str(e)
        self._exc = _error(msg, self.path, code)
        self._disarm()
        self._join_trimmer()
        with _pending_lock:
            _pending.discard(self)
        raise self._exc

    def __repr__(self):
        state = ("failed" if self._exc else "done" if self._ok else
                 "writing" if self.fenced else "staging")
        return f"<ferry snapshot {self.path!r} {state}>"


# Snapshots to fence before an optimizer's next step. Each optimizer gets
# one step pre-hook, kept for its lifetime, that fences them: registering
# and removing a hook per snapshot (a RemovableHandle, a weakref, an
# OrderedDict entry) was 25 us of the time snapshot() blocks the loop.
_armed = weakref.WeakKeyDictionary()  # optimizer -> [Snapshot]


def _fence_armed(opt, args, kwargs):
    handles = _armed.get(opt, ())[:]
    if not handles:
        return None

    def fence_them():
        for h in handles:
            h.fence()

    return fence_after_closure(fence_them, args, kwargs)


class _ArmedFor:
    """h in the optimizer's list until fenced (the handle _disarm removes)."""
    __slots__ = ("armed", "h")

    def __init__(self, opt, h):
        armed = _armed.get(opt)
        if armed is None:
            armed = _armed[opt] = []
            opt.register_step_pre_hook(_fence_armed)
        armed.append(h)
        self.armed, self.h = armed, h

    def remove(self):
        try:
            self.armed.remove(self.h)
        except ValueError:
            pass


class _StepPatch:
    """torch 1.13 has no optimizer step pre-hook: shadow the instance's step."""

    def __init__(self, opt, fence):
        self.opt = opt
        self.had_own = "step" in opt.__dict__
        self.orig = opt.step

        # wraps: keeps an LR scheduler's _with_counter mark (else torch 1.13
        # warns that optimizer.step was overridden after the scheduler)
        @functools.wraps(self.orig)
        def step(*args, **kwargs):
            fenced = fence_after_closure(fence, args, kwargs, at=0)  # a bound method's args
            if fenced is not None:
                args, kwargs = fenced
            return self.orig(*args, **kwargs)

        self.wrapper = step
        opt.step = step

    def remove(self):
        if self.opt.__dict__.get("step") is self.wrapper:
            if self.had_own:
                self.opt.step = self.orig
            else:
                del self.opt.step


_STAGING_PIECE = 16 << 20  # the engine's largest staging buffer (staging.c)


def reserve(obj: Any, *, backend: Optional[str] = None, policy: Optional[PolicyLike] = None,
            host_cap: Optional[Union[int, str]] = None, **knobs: Any) -> "_ferry.Engine":
    """Grow the pinned arena that snapshot() with the same arguments will
    use to hold obj's tensors (or obj bytes, given an int), ahead of
    training: the first snapshot then takes warm staging buffers instead of
    pinning new memory on the training thread (647-940 ms for 256 MiB on
    the development VM). Returns the engine; its stats()["arena_reserved"]
    shows the memory held. Refused (CheckpointError) past the host cap."""
    if isinstance(obj, int):
        nbytes, devices = obj, set()
    else:
        nbytes = describe(obj)["tensor_bytes"]
        tensors = []
        _walk_tensors(obj, tensors)
        devices = {t.device for t in tensors if t.device.type != "cpu"}
    backend, device = _backend_device(backend, devices, "ferry.checkpoint.reserve")
    policy_path, _ = _snapshot_policy(policy)
    engine = _engine_for(backend, device, policy_path, host_cap, knobs)
    pieces = []
    try:
        while nbytes > 0:
            take = min(nbytes, _STAGING_PIECE)
            pieces.append(engine.resident(take))  # arena memory, pinned now
            nbytes -= take
    except FerryError as e:
        raise _error(f"ferry.checkpoint.reserve: {e.args[0]}", None,
                     e.args[1] if len(e.args) > 1 else None) from None
    finally:
        for r in pieces:  # back to the arena, which keeps it for the snapshots
            r.close()
    return engine


def pending() -> List[Snapshot]:
    """Snapshots started and not yet finished (or failed unobserved)."""
    with _pending_lock:
        return list(_pending)


def wait_all() -> None:
    """Wait for every pending snapshot; raises the first failure."""
    first = None
    for h in pending():
        try:
            h.wait()
        except CheckpointError as e:
            first = first or e
    if first is not None:
        raise first


# Atexit handlers cannot see the exit status: remember a non-zero one given
# to sys.exit() or set by an uncaught exception, so that a checkpoint failing
# at exit never replaces it (sys.exit(3) stays 3, Ctrl-C stays a SIGINT).
_exit_nonzero = False


def _note_exit(code=None):
    global _exit_nonzero
    if code is not None and code != 0:
        _exit_nonzero = True


def _install_exit_notes():
    real_exit, real_hook = sys.exit, sys.excepthook

    @functools.wraps(real_exit)
    def exit(status=None):
        if threading.current_thread() is threading.main_thread():  # else it ends a thread
            _note_exit(status)
        return real_exit(status)

    @functools.wraps(real_hook)
    def excepthook(*exc_info):
        _note_exit(1)
        return real_hook(*exc_info)

    sys.exit, sys.excepthook = exit, excepthook


_install_exit_notes()


@atexit.register
def _wait_at_exit():
    # A file started must be complete when the process ends normally; one
    # that failed makes an exit status of 0 into 1 (a job scheduler must see
    # it), after the other exit handlers have run; a non-zero status stays.
    failed = False
    for h in pending():
        try:
            h.wait()
        except CheckpointError as e:
            print(f"ferry: checkpoint {h.path} failed: {e}", file=sys.stderr)
            failed = True
    if failed and not _exit_nonzero:
        atexit._run_exitfuncs()  # those not run yet (this one is done)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(1)


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


class Stager:
    """torch.distributed.checkpoint's AsyncStager protocol, staging through
    ferry: ``dcp.async_save(state_dict, checkpoint_id=path,
    async_stager=ferry.checkpoint.Stager())``.

    stage() takes a buffer of the engine's pinned arena for each tensor
    (DTensor: its local shard), under the engine's host cap, and queues the
    copy on the engine's copy stream after the work already on the compute
    stream (a worker thread on the host backend); it returns at once a
    Future of the staged state dict, which a ferry thread completes when the
    copies are done. DCP's writer waits for it; so must training before it
    changes the tensors in place (AsyncSaveResponse.staging_completion, or
    ferry.torch.snapshot(..., distributed="dcp") and its fence()). The
    pinned buffers go back to the arena when DCP drops the staged dict.
    Tensors that are not contiguous are made contiguous first (a copy on
    the compute stream); values that are not tensors are passed as they
    are, as torch's own stagers do.
    """

    _synchronize_after_execute = False

    def __init__(self, *, policy: Optional[PolicyLike] = None, backend: Optional[str] = None,
                 host_cap: Optional[Union[int, str]] = None, **knobs: Any) -> None:
        self._policy, self._backend, self._host_cap, self._knobs = policy, backend, host_cap, knobs
        self._pool = None
        self._last = None
        self.engine = None  # the ferry.Engine whose arena holds the staged copies
        self.stats = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def _engine(self, devices):
        backend, device = _backend_device(self._backend, devices, "ferry.checkpoint.Stager")
        policy_path, _ = _snapshot_policy(self._policy)
        return _engine_for(backend, device, policy_path, self._host_cap, self._knobs)

    def stage(self, state_dict: Dict[str, Any]) -> concurrent.futures.Future:
        # the last staged dict is DCP's (or gone) once its copies are done:
        # holding it here would keep its pinned buffers under the cap
        self.synchronize_staging()
        self._last = None
        tensors = []
        _walk_tensors(state_dict, tensors)
        devices = {t.device for t in tensors}
        engine = self._engine(devices) if tensors else None
        self.engine = engine or self.engine
        residents = []
        stats = {"tensors": 0, "staged_bytes": 0}

        def stage_one(t):
            if type(t).__name__ == "DTensor":
                local = stage_one(t._local_tensor)
                return type(t)(local, t._spec, requires_grad=False)
            if type(t).__name__ == "ShardedTensor" or t.layout != torch.strided:
                raise CheckpointError(f"ferry.checkpoint.Stager: cannot stage a "
                                      f"{type(t).__name__} ({t.layout}); use DTensor state "
                                      "dicts or torch's DefaultStager", None, "FERRY_EINVAL")
            if not t.is_contiguous():
                t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                return torch.empty(t.shape, dtype=t.dtype)
            try:
                r = engine.resident(nbytes)
            except FerryError as e:
                raise _error(f"ferry.checkpoint.Stager: {e.args[0]}", None,
                             e.args[1] if len(e.args) > 1 else None) from None
            r.to_host(t.data_ptr())
            residents.append((r, t))  # t kept alive until its copy is done
            stats["tensors"] += 1
            stats["staged_bytes"] += nbytes
            return torch.frombuffer(r, dtype=t.dtype).view(t.shape)

        staged = _map_tensors(state_dict, stage_one)
        self.stats = stats
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "ferry-stager")

        def finish():
            for r, _ in residents:
                r.wait()
            residents.clear()
            return staged

        self._last = self._pool.submit(finish)
        return self._last

    def synchronize_staging(self) -> None:
        """Block until the last stage()'s copies are done."""
        if self._last is not None:
            self._last.result()

    def close(self) -> None:
        """Stop the staging thread and drop the last staged dict (its pinned
        buffers go back to the arena once DCP has let go of it too)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._last = None


def _walk_tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            _walk_tensors(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _walk_tensors(v, out)


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        out = type(x)() if type(x) in (dict, collections.OrderedDict) else {}
        for k, v in x.items():
            out[k] = _map_tensors(v, fn)
        return out
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_map_tensors(v, fn) for v in x)
    return x


class _DcpSnapshot(Snapshot):
    """A torch.distributed.checkpoint save (sharded state: DTensor). With
    dcp.async_save taking an async_stager, ferry's Stager stages it: fence()
    waits for the staging, done()/wait() for the write."""

    def __init__(self, path, staging, upload, stats):
        super().__init__(path, None, stats)
        self.stager = None  # ferry's Stager, when DCP took one
        self._staging = staging
        self._future = upload
        self._ok = upload is None

    @property
    def fenced(self) -> bool:
        return self._staging is None or self._staging.done()

    def fence(self) -> None:
        """Wait until the staged copy is complete: then the tensors may be
        modified."""
        try:
            if self._staging is not None:
                self._staging.result()
        except Exception as e:  # noqa: BLE001 - reported with the path
            self._exc = CheckpointError(f"snapshot {self.path}: staging failed: {e}",
                                        self.path, getattr(e, "code", None) or "FERRY_EIO")
            raise self._exc from e
        finally:
            self._disarm()

    def done(self) -> bool:
        if self._exc is not None:
            raise self._exc
        if not self._ok and self._future.done():
            self.wait()
        return self._ok

    def wait(self) -> Snapshot:
        if self._exc is not None:
            raise self._exc
        if not self._ok:
            try:
                self._future.result()
            except Exception as e:  # noqa: BLE001 - reported with the path
                self._exc = CheckpointError(f"snapshot {self.path}: torch.distributed.checkpoint "
                                            f"failed: {e}", self.path, "FERRY_EIO")
                raise self._exc from e
            finally:
                if self.stager is not None:
                    self.stager.close()
            self._finish()
        return self


def _dcp_save(obj, path, stats, stager_kwargs):
    dcp = _dcp()
    if dcp is None:
        raise CheckpointError(
            f"ferry.torch.snapshot({path!r}): distributed='dcp' needs "
            f"torch.distributed.checkpoint, which this torch ({torch.__version__}) lacks",
            path, "FERRY_EINVAL")
    stats["mode"] = "dcp"
    async_save = getattr(dcp, "async_save", None)
    if async_save is not None and "async_stager" in inspect.signature(async_save).parameters:
        stager = Stager(**stager_kwargs)
        resp = async_save(obj, checkpoint_id=path, async_stager=stager)
        staging = getattr(resp, "staging_completion", None) or stager._last
        upload = getattr(resp, "upload_completion", resp)
        upload.add_done_callback(lambda _: stager.close())
        stats.update(stager="ferry", staged=stager.stats["tensors"],
                     staged_bytes=stager.stats["staged_bytes"])
        h = _DcpSnapshot(path, staging, upload, stats)
        h.stager = stager
        return h
    stats["stager"] = "torch"  # older torch: DCP stages (or writes) by itself
    if async_save is not None:
        fut = async_save(obj, checkpoint_id=path)
        return _DcpSnapshot(path, None, getattr(fut, "upload_completion", fut), stats)
    if hasattr(dcp, "save"):
        dcp.save(obj, checkpoint_id=path)
    else:
        dcp.save_state_dict(obj, dcp.FileSystemWriter(path))
    return _DcpSnapshot(path, None, None, stats)


def _arm(h, optimizer, module, fence_hooks):
    """Fence h before the next step of optimizer (after its closure) and
    the next training forward of module; fence_hooks="auto": of any
    optimizer when none is given, of any module when none is given. h is
    pending."""
    optimizers = [] if optimizer is None else (
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
    modules = [] if module is None else (
        list(module) if isinstance(module, (list, tuple)) else [module])
    auto = fence_hooks == "auto"
    h._arm(optimizers, modules, auto and not optimizers, auto and not modules)
    with _pending_lock:
        _pending.add(h)


# ---- the entry point -----------------------------------------------------------------
def snapshot(
        obj: Any,
        path: Union[str, "os.PathLike[str]"],
        *,
        optimizer: Optional[Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]]] = None,
        module: Optional[Union[torch.nn.Module, Sequence[torch.nn.Module]]] = None,
        policy: Optional[PolicyLike] = None,
        keys: Optional[Iterable[Any]] = None,
        backend: Optional[str] = None,
        host_cap: Optional[Union[int, str]] = None,
        distributed: str = "auto",
        fence_hooks: str = "auto",
        trim: Union[bool, int] = False,
        **knobs: Any,
) -> Snapshot:
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
        (every rank writes its own path), "dcp" (torch.distributed.checkpoint
        into the directory path, staged by ferry's Stager where
        dcp.async_save takes one; dcp.load reads it at any world size);
        "auto": "dcp" when the state holds DTensor/ShardedTensor, else
        "rank0". "dcp" also works without a process group.
    fence_hooks: "auto" (every optimizer's step when optimizer is not
        given, every module's training forward when module is not given:
        torch's global hooks, on torch 1.13 ferry's own for the step),
        "none". A step given a closure is fenced after the closure.
    trim: False (default): the pinned staging memory stays in the arena
        for the next snapshot (no new pinning on the training thread).
        True: once the file is durable, the arena's free pinned memory goes
        back to the OS (Engine.trim; stats["trimmed_bytes"]); an int: the
        same, keeping that many bytes reserved (e.g. what reserve() took,
        so the next snapshot stays warm). Memory still in use stays.
        wait() returns after the trim; done() says False until it is over.
    """
    t0 = time.perf_counter()
    if isinstance(trim, bool):
        keep_bytes = 0 if trim else None
    elif isinstance(trim, int) and trim >= 0:
        keep_bytes = trim
    else:
        raise ValueError(f"ferry.torch.snapshot: trim={trim!r} is not True, False or a number "
                         "of bytes to keep reserved (>= 0)")
    if distributed == "sharded":
        raise ValueError("ferry.torch.snapshot: distributed='sharded' (the ferry-sharded/1 "
                         "format) is retired: use distributed='dcp' (torch.distributed."
                         "checkpoint, read back with dcp.load at any world size) or 'all'")
    if distributed not in _DISTRIBUTED_MODES:
        raise ValueError(f"ferry.torch.snapshot: distributed={distributed!r} is not one of "
                         f"{', '.join(_DISTRIBUTED_MODES)}")
    if fence_hooks not in ("auto", "none"):
        raise ValueError(f"ferry.torch.snapshot: fence_hooks={fence_hooks!r} is not 'auto' or "
                         "'none'")
    if hasattr(path, "write") and not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError("ferry.torch.snapshot writes a file at a path (temporary file, fsync, "
                        f"rename), not to a file object ({type(path).__name__}): give a path, "
                        "or use torch.save for a file object")
    path = os.fspath(path)
    stats = {"mode": "local"}
    d = _dist()
    if d is not None and d.get_world_size() > 1:
        rank, world = d.get_rank(), d.get_world_size()
        mode = distributed
        if mode == "auto":
            mode = "dcp" if _has_sharded_tensors(obj) else "rank0"
        stats.update(mode=mode, rank=rank, world_size=world)
        if mode == "rank0" and rank != 0:
            return Snapshot(path, None, stats, skipped_rank=rank)
    else:
        mode = distributed
    if mode == "dcp":
        if keep_bytes is not None:
            raise ValueError("ferry.torch.snapshot: trim= applies to a file snapshot; a DCP "
                             "Stager keeps its staging buffers until close()")
        h = _dcp_save(obj, path, stats, dict(knobs, policy=policy, backend=backend,
                                             host_cap=host_cap))
        _arm(h, optimizer, module, fence_hooks)
        stats["blocked_ms"] = (time.perf_counter() - t0) * 1e3
        return h

    desc = describe(obj)
    torch_records, storages = _torch_records(obj)

    # each storage's device once (torch.device objects are built per read)
    on_device = [st.device for st in storages]
    for i, dv in enumerate(on_device):
        on_device[i] = dv if dv.type != "cpu" else None
    # backend and device: cuda when a storage lives on a GPU
    devices = {dv for dv in on_device if dv is not None}
    backend, device = _backend_device(backend, devices, f"ferry.torch.snapshot({path!r})", path)
    policy_path, pol = _snapshot_policy(policy)
    engine = _engine_for(backend, device, policy_path, host_cap, knobs)

    # each storage's record name (by key), and its place among torch's
    # storage records: the policy's e.index, so that the default write order
    # is torch.save's (the keys' order; torch 1.x: their string order, "10"
    # before "2")
    data_names, file_order = {}, {}
    for name, data, _ in torch_records:
        if data is None:
            key = int(name[5:])
            data_names[key], file_order[key] = name, len(file_order)

    # the policy's plan, per storage (key order)
    entries = []
    paths, dtypes = desc["paths"], desc["dtypes"]
    for index, st in enumerate(storages):
        top, spath = paths.get(st._cdata, ("", ""))
        entries.append((top, spath, st.nbytes(), file_order[index],
                        _dtype_name(dtypes.get(st._cdata)), on_device[index] is not None))
    plan = pol[0].plan(entries) if entries else []
    if pol[0].errors > pol[1]:
        pol[1] = pol[0].errors
        warnings.warn(f"ferry: the snapshot function of policy {policy_path} failed: "
                      f"{pol[0].last_error()}; the entries concerned were staged",
                      RuntimeWarning, stacklevel=2)
    key_set = None if keys is None else {str(k) for k in keys}

    # torch's small records in its order, then the storages in the policy's
    # write order (ties in torch's), then the container's records
    _, tail = _container_records()
    prefix = _archive_name(path) + "/"
    records = [(prefix + name, data) for name, data, _ in torch_records if data is not None]
    pickle_bytes = len(records[0][1])
    staged = copied = staged_bytes = copied_bytes = 0
    keepalive = []
    for i in sorted(range(len(entries)), key=lambda i: (plan[i][1], file_order[i])):
        st = storages[i]
        nbytes = entries[i][2]
        stage = plan[i][0] and (key_set is None or entries[i][0] in key_set)
        on_gpu = entries[i][5]
        name = prefix + data_names[i]
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
                 skipped=desc["skipped"], pickle_bytes=pickle_bytes, backend=backend,
                 policy=policy_path)
    h = Snapshot(path, c, stats)
    h.engine = engine
    _arm(h, optimizer, module, fence_hooks)
    if keep_bytes is not None:
        h._start_trimmer(engine, keep_bytes)
    stats["blocked_ms"] = (time.perf_counter() - t0) * 1e3
    return h
