"""The structure of a snapshot (moved out of checkpoint.py): describe(),
the records torch's own serializer writes for it, and the zip container
torch.save uses. Imported by ferry.checkpoint, which re-exports every name."""
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

from . import _ferry
from ._checkpoint_errors import CheckpointError


# ---- the structure -----------------------------------------------------------
def _untyped(t):
    """The untyped storage of a tensor (one Python object per call, one
    StorageImpl: compare ._cdata)."""
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage()
    return t.storage()._storage  # torch 1.13


# _untyped for describe's walk: the name of the tensor's method where torch
# has one
_untyped_storage = "untyped_storage" if hasattr(torch.Tensor, "untyped_storage") else _untyped


def describe(obj: Any, keys: Optional[Iterable[Any]] = None) -> Dict[str, Any]:
    """Walk dicts, lists and tuples like snapshot() does. Returns a dict:
    tensors, tensor_bytes (of their storages, each counted once),
    primitives (None/bool/int/float/str/bytes), objects (other objects,
    passed through to the pickle unchanged) and skipped ("path: module.Type"
    for each such object), plus paths {storage _cdata: (top-level key, path)} and
    dtypes {storage _cdata: dtype of the first tensor seen on it}.
    keys: only these top-level keys (None: all)."""
    if keys is not None and isinstance(obj, dict):
        roots = [(obj[k], str(k), str(k)) for k in keys if k in obj]
    else:
        roots = [(obj, "", "")]
    # in C: snapshot() runs it on the training thread (an MLP's state and
    # its AdamW moments: 27 -> 13 us in a loop, 80 -> 70 us right after a
    # training step, where torch's getters on cache-cold tensors dominate)
    tensors, tensor_bytes, primitives, objects, skipped, paths, dtypes = \
        _ferry.describe_walk(roots, torch.Tensor, _untyped_storage)
    return {"tensors": tensors, "tensor_bytes": tensor_bytes, "primitives": primitives,
            "objects": objects, "skipped": skipped, "paths": paths, "dtypes": dtypes}


# ---- torch.save's records, made by torch -------------------------------------
# torch.serialization._save (the body of torch.save) pickles the object with
# torch's own pickler and hands each record to a zip writer; _Recorder is that
# writer, keeping the small records and, for each storage, only its name and
# size: ferry stages and writes the storage bytes. The storages themselves
# are learned through a location tagger (torch.serialization.register_package),
# which torch's persistent_id calls for every storage right after giving it
# its key, so the order of first sight is the key order.
_tls = threading.local()
_tagger_registered = False


def _record_storage(storage):
    seen = getattr(_tls, "storages", None)
    if seen is not None and storage._cdata not in seen:
        seen[storage._cdata] = storage
    return None  # let torch's own taggers name the location


def _register_tagger():
    global _tagger_registered
    if not _tagger_registered:
        # first in the registry (lowest priority value), never answering
        torch.serialization.register_package(-(1 << 62), _record_storage,
                                             lambda storage, location: None)
        _tagger_registered = True


class _Recorder:
    """The zip writer torch.serialization._save writes to."""

    def __init__(self):
        self.records = []  # (name, bytes or None for a storage, nbytes)

    def write_record(self, name, data, nbytes):
        if name.startswith("data/"):
            self.records.append((name, None, int(nbytes)))  # the storage: staged by ferry
            return
        if isinstance(data, str):
            data = data.encode()
        self.records.append((name, bytes(data)[:nbytes], int(nbytes)))

    def write_record_metadata(self, name, nbytes):  # torch >= 2.5 under skip_data()
        self.records.append((name, None, int(nbytes)))


# Whether objects of a type are storages, the only objects torch's
# persistent_id names (isinstance of TypedStorage or one of torch's storage
# classes: a question of the type alone).
_is_storage_type = {}


def _is_storage(obj):
    return isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)


def _storages_only(pid):
    """torch's persistent_id pid, asked only about storages. The pickler asks
    persistent_id about every object it writes (about 700 for an MLP and its
    AdamW state); torch's answers None for all but the storages after two
    Python calls, _ferry.StorageFilter after a dict lookup in C (torch's pass
    over that state: 0.82 -> 0.76 ms with the same filter in Python, 0.72 ms
    in C). The answers are the same, so is the pickle
    (test_file_is_what_torch_save_writes compares data.pkl with torch.save's)."""
    return _ferry.StorageFilter(pid, _is_storage_type, _is_storage)


# ---- a plain tensor's reduction, without torch's checks -----------------------
# Tensor.__reduce_ex__ goes through about 15 checks in Python (device, layout,
# quantized, sparse, nested, subclass, fake) before it builds, for a plain
# dense tensor, (_rebuild_tensor_v2, (TypedStorage, offset, size, stride,
# requires_grad, OrderedDict())). For exactly those tensors the pickler gets
# the same tuple from _plain_reduce, built directly: the same bytes in
# data.pkl (test_every_kind_of_tensor_pickles_as_torch_save_does), 350 -> 245
# us for the pickle of an MLP's state and its AdamW moments (32 tensors,
# torch 2.15). Anything else goes to torch, and so does every tensor of a
# process where _plain_reduce_agrees finds an answer unlike torch's.
_Tensor = torch.Tensor
_has_names = getattr(_Tensor, "has_names", None)  # named tensors: gone in later torch
# None: not checked yet in this process; never on torch 1.x, whose reduction
# reads the storage through Tensor.storage(), the cost itself
_plain_reduce_on = None if hasattr(_Tensor, "untyped_storage") else False


def _plain_dense(t):
    return (type(t) is _Tensor and not t.__dict__ and not t._backward_hooks
            and t.layout is torch.strided and not t.is_quantized
            and not getattr(t, "is_nested", False) and not t.is_conj() and not t.is_neg()
            and (_has_names is None or not _has_names(t)) and t.dtype not in _v3_dtypes
            and t.device.type in ("cpu", "cuda"))


def _plain_reduce(t):
    if not _plain_dense(t):
        return NotImplemented
    storage = torch.storage.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype,
                                         **_typed_internal)
    return (torch._utils._rebuild_tensor_v2,
            (storage, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad,
             collections.OrderedDict()))


def _plain_reduce_agrees():
    """Whether _plain_reduce gives what torch's __reduce_ex__ gives for the
    tensors it takes, checked on probes once per process."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    probes = [base, base[1:, ::2], base.t(), torch.zeros(3, dtype=torch.float16),
              torch.ones(2, dtype=torch.bfloat16), torch.arange(5), torch.ones(3) > 0,
              torch.tensor(2.5), torch.empty(0), torch.ones(2, requires_grad=True)]
    for t in probes:
        ours, theirs = _plain_reduce(t), t.__reduce_ex__(torch.serialization.DEFAULT_PROTOCOL)
        if ours is NotImplemented or ours[0] is not theirs[0] or len(ours[1]) != len(theirs[1]):
            return False
        (st, *rest), (their_st, *their_rest) = ours[1], theirs[1]
        if (type(st) is not type(their_st) or st.dtype != their_st.dtype
                or st._untyped_storage._cdata != their_st._untyped_storage._cdata
                or rest != their_rest or [type(x) for x in rest] != [type(x) for x in their_rest]):
            return False
    return True


def _storage_new_dtypes():
    new = getattr(torch.storage, "_new_dtypes", None)
    return frozenset(new()) if new is not None else frozenset()


_v3_dtypes = _storage_new_dtypes()  # torch >= 2.3 saves these with _rebuild_tensor_v3
_typed_internal = ({"_internal": True} if "_internal" in  # no deprecation warning
                   inspect.signature(torch.storage.TypedStorage.__init__).parameters else {})


class _Pickler(pickle.Pickler):
    """pickle.Pickler whose persistent_id, however torch sets it, is asked
    only about storages: torch >= 2.x subclasses it with a persistent_id
    method, torch 1.x assigns the attribute. Plain dense tensors are reduced
    by _plain_reduce."""

    def reducer_override(self, obj):
        global _plain_reduce_on
        if type(obj) is not _Tensor:
            return NotImplemented
        if _plain_reduce_on is None:
            _plain_reduce_on = _plain_reduce_agrees()
        return _plain_reduce(obj) if _plain_reduce_on else NotImplemented

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        pid = cls.__dict__.get("persistent_id")
        if callable(pid):
            cls.persistent_id = _storages_only(pid)

    def __setattr__(self, name, value):
        if name == "persistent_id" and callable(value):
            value = _storages_only(value)
        super().__setattr__(name, value)


class _PickleModule:
    Pickler = _Pickler  # all torch.serialization._save takes from its pickle_module


_save_takes_byteorder = None


def _run_save(obj, skip):
    """One pass of torch.serialization._save into a _Recorder, under
    skip_data when skip is given: (records, storages in key order)."""
    global _save_takes_byteorder
    rec = _Recorder()
    args = [obj, rec, _PickleModule, torch.serialization.DEFAULT_PROTOCOL]
    if _save_takes_byteorder is None:
        _save_takes_byteorder = ("_disable_byteorder_record"
                                 in inspect.signature(torch.serialization._save).parameters)
    if _save_takes_byteorder:
        args.append(False)
    _tls.storages = {}
    try:
        with (skip() if skip is not None else contextlib.nullcontext()):
            torch.serialization._save(*args)
    finally:
        storages = list(_tls.storages.values())
        _tls.storages = None
    return rec.records, storages


def _torch_records(obj):
    """torch.save's records for obj, made by torch: ([(name, bytes or None,
    nbytes)] in torch's order, [untyped storage] in key order). Under
    torch.serialization.skip_data (torch >= 2.5) torch copies no storage
    bytes; older torch (and objects skip_data refuses: quantized, nested)
    copy device storages to the CPU here, which ferry then ignores."""
    _register_tagger()
    skip = getattr(torch.serialization, "skip_data", None)
    try:
        records, storages = _run_save(obj, skip)
    except RuntimeError as e:
        if skip is None or "skip_data" not in str(e):
            raise
        records, storages = _run_save(obj, None)  # e.g. a quantized tensor: the plain way
    n_data = sum(1 for name, data, _ in records if data is None)
    if n_data != len(storages):
        raise CheckpointError(f"ferry.torch.snapshot: torch's serializer wrote {n_data} "
                              f"storage record(s) but ferry saw {len(storages)}; this torch "
                              f"({torch.__version__}) serializes differently than ferry "
                              "expects: use torch.save", None, "FERRY_EINVAL")
    return records, storages


_container = None


def _container_records():
    """(prefix, records written after the data): what torch's zip container
    (PyTorchStreamWriter) adds to _save's records, learned once from a
    torch.save into memory ("version", ".data/serialization_id")."""
    global _container
    if _container is None:
        buf = io.BytesIO()
        torch.save({"t": torch.zeros(1)}, buf)
        with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
            names = z.namelist()
            prefix = names[0].split("/", 1)[0] + "/"
            last_data = max(i for i, n in enumerate(names) if n[len(prefix):].startswith("data/"))
            tail = [(n[len(prefix):], z.read(n)) for n in names[last_data + 1:]]
        _container = (prefix, tail)
    return _container


def _torch_names_non_ascii_archive():
    # torch >= 2 writes to a path that is not ASCII through a Python file
    # object, which its writer names "archive"; torch 1.x names it by path
    try:
        return "ascii" in inspect.getsource(torch.serialization._open_zipfile_writer_file)
    except (AttributeError, OSError, TypeError):
        return int(torch.__version__.split(".")[0]) >= 2


_non_ascii_archive = _torch_names_non_ascii_archive()


def _archive_name(path):
    """The directory name torch.save gives the records of the file at path
    (its writer's rule): the base name ('/' and '\\' both separate) up to
    its last '.'; "archive" for a path torch writes through a file object,
    and where that leaves nothing (".hidden", which torch.save refuses)."""
    if _non_ascii_archive and not path.isascii():
        return "archive"
    base = path[max(path.rfind("/"), path.rfind("\\")) + 1:]
    dot = base.rfind(".")
    return (base[:dot] if dot >= 0 else base) or "archive"


# torch >= 2.x writes a 40-digit id per file; a fresh one per snapshot from a
# generator seeded from the OS once per process (and again in a forked
# child), not an os.urandom read per snapshot (25 us of the blocked time)
_ids = random.Random()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_ids.seed)


def _serialization_id():
    return ("%040d" % _ids.randrange(10 ** 40)).encode()


_dtype_names = {None: str(torch.uint8)}  # a storage no tensor named: its bytes


def _dtype_name(dtype):
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name
