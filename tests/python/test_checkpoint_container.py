"""A snapshot's file is torch.save's file, byte for byte (issue 37, item 4):
the records' directory named after the file as torch names it, torch's
version, flag and date fields, data descriptors and end records; torch 2's
torch.load(mmap=True) with calculate_storage_offsets (which computes where
each storage is from the layout) reads it right."""
import filecmp
import io
import os

import pytest
import torch

import ferry.checkpoint as ck
import ferry.torch as ft


def state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.BatchNorm1d(17),
                                torch.nn.Linear(17, 5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 33)).sum().backward()
    opt.step()
    base = torch.arange(30, dtype=torch.float64)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3,
            "views": [base[2:9], base], "half": torch.randn(7).half(),
            "empty": torch.zeros(0), "big": torch.randn(70000)}


def torch_save_bytes(obj, path):
    torch.save(obj, path)
    with open(path, "rb") as f:
        return f.read()


def serialization_id(raw):
    """The 40-digit id torch >= 2 writes per file (None on torch 1.x)."""
    at = raw.find(b".data/serialization_id")
    if at < 0:
        return None
    start = raw.index(b"FB", at) + 4
    start += int.from_bytes(raw[start - 2:start], "little")
    return raw[start:start + 40]


@pytest.mark.parametrize("name", ["step-1000.pt", "epoch=1-step=10.ckpt", "noext",
                                  ".hidden.pt", "a.b.c", "x.", "sp ace.pt", "ünï.pt"])
def test_whole_file_equals_torch_save(tmp_path, monkeypatch, name):
    obj = state()
    (tmp_path / "ref").mkdir()
    theirs = torch_save_bytes(obj, str(tmp_path / "ref" / name))
    sid = serialization_id(theirs)
    if sid is not None:  # the one field torch draws at random
        monkeypatch.setattr(ck, "_serialization_id", lambda: sid)
    ft.snapshot(obj, tmp_path / name).wait()
    ours = (tmp_path / name).read_bytes()
    assert len(ours) == len(theirs)
    if ours != theirs:
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        pytest.fail(f"first difference at byte {at}: ours {ours[at - 8:at + 8].hex()} "
                    f"torch.save {theirs[at - 8:at + 8].hex()}")


def test_non_ascii_directory_names_the_archive_as_torch_does(tmp_path, monkeypatch):
    # torch >= 2 writes such a path through a Python file object: "archive/"
    theirs_dir, ours_dir = tmp_path / "répertoire", tmp_path / "dössier"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    obj = {"w": torch.arange(5.0)}
    theirs = torch_save_bytes(obj, str(theirs_dir / "ck.pt"))
    sid = serialization_id(theirs)
    if sid is not None:
        monkeypatch.setattr(ck, "_serialization_id", lambda: sid)
    ft.snapshot(obj, ours_dir / "ck.pt").wait()
    assert (ours_dir / "ck.pt").read_bytes() == theirs


try:
    from torch.utils.serialization import config as _serialization_config
    config = _serialization_config.load
except ImportError:
    config = None


@pytest.mark.skipif(config is None or not hasattr(config, "calculate_storage_offsets"),
                    reason="torch without torch.utils.serialization.config.load."
                           "calculate_storage_offsets (torch < 2.7)")
def test_mmap_load_with_calculated_storage_offsets(tmp_path):
    obj = state()
    ft.snapshot(obj, tmp_path / "ck.pt").wait()
    was = config.calculate_storage_offsets  # torch's config: set and put back, not monkeypatch
    config.calculate_storage_offsets = True
    try:
        got = torch.load(tmp_path / "ck.pt", mmap=True, weights_only=False)
    finally:
        config.calculate_storage_offsets = was
    for k, v in obj["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert torch.equal(got["big"], obj["big"]) and torch.equal(got["half"], obj["half"])
    assert torch.equal(got["views"][0], obj["views"][0])
    for i, st in obj["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][i][k], v), (i, k)


@pytest.mark.skipif(os.environ.get("FERRY_TEST_BIG_FILES") != "1",
                    reason="writes two 4 GiB files (~40 s, 8.6 GB of disk): FERRY_TEST_BIG_FILES=1")
def test_a_file_over_4_gib_is_torch_saves_and_loads(tmp_path, monkeypatch):
    """ZIP64 for real: an entry past 4 GiB and entries after it at offsets
    past 4 GiB, the whole file compared with torch.save's, then torch.load
    (mmap where torch has it). The tensor is calloc'd zeros: little memory."""
    n = (4 << 30) + 4096
    big = torch.zeros(n, dtype=torch.uint8)
    big[-5:] = torch.arange(1, 6, dtype=torch.uint8)
    small = torch.arange(10.0)
    obj = {"small": small, "big": big, "after": small * 2}
    (tmp_path / "ref").mkdir()
    torch.save(obj, str(tmp_path / "ref" / "big.pt"))
    with open(tmp_path / "ref" / "big.pt", "rb") as f:
        f.seek(-4096, 2)
        sid = serialization_id(f.read())
    if sid is not None:
        monkeypatch.setattr(ck, "_serialization_id", lambda: sid)
    ft.snapshot(obj, tmp_path / "big.pt", host_cap=64 << 20).wait()
    same = filecmp.cmp(tmp_path / "ref" / "big.pt", tmp_path / "big.pt", shallow=False)
    os.remove(tmp_path / "ref" / "big.pt")
    assert same, "the >4 GiB file differs from torch.save's"
    kw = {"mmap": True} if "mmap" in torch.load.__code__.co_varnames else {}
    if "weights_only" in torch.load.__code__.co_varnames:
        kw["weights_only"] = False
    got = torch.load(tmp_path / "big.pt", **kw)
    assert got["big"].numel() == n and got["big"][-5:].tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(got["after"], small * 2) and torch.equal(got["small"], small)


def test_a_file_object_is_refused_with_a_clear_error(tmp_path):
    buf = io.BytesIO()
    with pytest.raises(TypeError, match="not to a file object.*torch.save"):
        ck.snapshot({"w": torch.ones(2)}, buf)
    assert buf.getvalue() == b""
