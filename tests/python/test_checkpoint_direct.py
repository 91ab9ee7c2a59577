"""A snapshot's staged file image goes to a disk file system with O_DIRECT
(no copy into the page cache) and to tmpfs buffered, and either way the file
is torch.save's, byte for byte (issue 37, item 10)."""
import os
import tempfile

import pytest
import torch

import ferry.checkpoint as ck
import ferry.torch as ft

from test_checkpoint_container import serialization_id, state, torch_save_bytes


def fs_type(path):
    with open("/proc/mounts") as f:
        mounts = [line.split() for line in f]
    best = max((m for m in mounts if os.path.realpath(path).startswith(m[1].rstrip("/") + "/")
                or os.path.realpath(path) == m[1]), key=lambda m: len(m[1]))
    return best[2]




def written(obj, directory, monkeypatch):
    """Snapshot obj into directory; (its bytes, torch.save's, direct, buffered)."""
    (directory / "ref").mkdir()
    theirs = torch_save_bytes(obj, str(directory / "ref" / "ck.pt"))
    sid = serialization_id(theirs)
    if sid is not None:
        monkeypatch.setattr(ck, "_serialization_id", lambda: sid)
    h = ft.snapshot(obj, directory / "warm.pt")  # the engine exists from here
    h.wait()
    before = h.engine.stats()
    h = ft.snapshot(obj, directory / "ck.pt")
    h.wait()
    after = h.engine.stats()
    ours = (directory / "ck.pt").read_bytes()
    return (ours, theirs,
            after["snapshot_bytes_direct"] - before["snapshot_bytes_direct"],
            after["snapshot_bytes_buffered"] - before["snapshot_bytes_buffered"])


def test_disk_file_system_is_written_direct(tmp_path, monkeypatch):
    kind = fs_type(str(tmp_path))
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind}: no disk file system here")
    ours, theirs, direct, buffered = written(state(), tmp_path, monkeypatch)
    assert ours == theirs
    assert (direct, buffered) == (len(ours), 0), (kind, direct, buffered)


def test_tmpfs_is_written_buffered(monkeypatch):
    if not os.path.isdir("/dev/shm") or fs_type("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        from pathlib import Path
        ours, theirs, direct, buffered = written(state(), Path(d), monkeypatch)
    assert ours == theirs
    assert (direct, buffered) == (0, len(ours))


def test_odd_sizes_direct_equal_torch_save(tmp_path, monkeypatch):
    """Storages of 0 bytes, 1 byte, a block less and a block more one byte,
    3 MiB and 7 floats, with plain objects between them."""
    g = torch.Generator().manual_seed(1)
    obj = {"empty": torch.zeros(0), "one": torch.ones(1, dtype=torch.uint8),
           "short": torch.randint(0, 255, (4095,), dtype=torch.uint8, generator=g),
           "long": torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g),
           "big": torch.randn(3 * 2**18 + 7, generator=g), "text": "between", "n": 3}
    ours, theirs, direct, buffered = written(obj, tmp_path, monkeypatch)
    assert ours == theirs
    assert direct + buffered == len(ours)
