"""The distributed part of ferry.checkpoint (moved out of checkpoint.py):
torch.distributed helpers, the DCP Stager and distributed="dcp" saves.
Imported by ferry.checkpoint, which re-exports every name."""
from __future__ import annotations

import collections
import concurrent.futures
import inspect
from typing import Any, Dict, Optional, Union

import torch

from ._policy import PolicyLike
from ._ferry import FerryError
from .checkpoint import (CheckpointError, Snapshot, _error, _backend_device, _snapshot_policy,
                         _engine_for)

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
