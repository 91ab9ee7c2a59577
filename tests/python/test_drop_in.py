"""ferry.torch.OffloadActivations / NoOffload: torchtune's context managers
on ferry's engine — the same losses and gradients as plain torch, real
reloads, NoOffload keeping a region on device, composition with
torch.utils.checkpoint, and torchtune's arguments meaning what they mean."""
import os
import tempfile

import pytest
import torch

import ferry.torch as ft
from conftest import GPT, assert_same_training, gpt_batch, gpt_loss, train


def test_one_import_switches_a_recipe():
    base = train(GPT, gpt_batch, gpt_loss, steps=3)
    mine = train(GPT, gpt_batch, gpt_loss, steps=3,
                 offload=lambda m: ft.OffloadActivations(max_fwd_stash_size=1,
                                                         min_offload_size=1024))
    assert_same_training(base, mine)
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["bytes_h2d"] > 0, s


def test_arguments_mean_what_they_mean():
    torch.manual_seed(0)
    model = GPT()
    batch = gpt_batch()
    # every activation is below 1 GiB: nothing offloaded
    with ft.OffloadActivations(min_offload_size=1 << 30):
        gpt_loss(model, batch).backward()
    assert ft.stats()["tensors_offloaded"] == 0
    ft.close()
    # a large stash holds everything: offloaded, but no reload (stash hits)
    with ft.OffloadActivations(max_fwd_stash_size=100000, min_offload_size=0):
        gpt_loss(model, batch).backward()
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["stash_hits"] >= s["tensors_offloaded"], s  # aliases hit too
    assert s["bytes_h2d"] == 0, s
    with pytest.raises(ValueError, match="max_fwd_stash_size=-1"):
        ft.OffloadActivations(max_fwd_stash_size=-1)
    # torchtune refuses 0 (some activation must stay alive while its copy runs)
    with pytest.raises(ValueError, match="max_fwd_stash_size=0 must be a whole number >= 1"):
        ft.OffloadActivations(max_fwd_stash_size=0)
    with pytest.raises(ValueError, match="min_offload_size=1.5"):
        ft.OffloadActivations(min_offload_size=1.5)


def test_no_offload_keeps_its_region():
    torch.manual_seed(0)
    model = GPT()
    batch = gpt_batch()
    with ft.OffloadActivations(max_fwd_stash_size=1, min_offload_size=0):
        with ft.NoOffload():
            loss = gpt_loss(model, batch)
    loss.backward()
    assert ft.stats()["tensors_packed"] == 0  # the engine never saw them
    ft.close()
    # a region inside: the head kept, the rest offloaded
    idx = batch[:, :-1]
    with ft.OffloadActivations(max_fwd_stash_size=1, min_offload_size=0):
        x = model.wte(idx) + model.wpe(torch.arange(idx.shape[1]))
        for block in model.h:
            x = block(x)
        packed_before_head = ft.stats()["tensors_packed"]
        with ft.NoOffload():
            logits = model.lm_head(model.ln_f(x))
        assert ft.stats()["tensors_packed"] == packed_before_head  # the head's: not seen
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
    loss.backward()
    assert ft.stats()["tensors_offloaded"] > 0


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_composes_with_checkpointing(mode):
    make = lambda: GPT(checkpoint=mode)  # noqa: E731
    base = train(make, gpt_batch, gpt_loss, steps=2)
    mine = train(make, gpt_batch, gpt_loss, steps=2,
                 offload=lambda m: ft.OffloadActivations(max_fwd_stash_size=1,
                                                         min_offload_size=0))
    assert_same_training(base, mine)
    assert ft.stats()["bytes_h2d"] > 0


def _ferry_files(d):
    return sorted(os.path.relpath(os.path.join(r, f), d)
                  for r, _, fs in os.walk(d) for f in fs if "ferry" in f or f.endswith(".lua"))


def test_drop_in_writes_no_file_in_the_shared_temp_dir(tmp_path, monkeypatch):
    """The drop-in's policy goes to the user's private policy cache, never to
    a predictable name in /tmp (at f9032b9: /tmp/ferry-torchtune-PID-HASH.lua,
    left there after exit, and a file planted at that name was loaded)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    mine = train(GPT, gpt_batch, gpt_loss, steps=1,
                 offload=lambda m: ft.OffloadActivations(min_offload_size=1024))
    assert _ferry_files(shared) == []
    assert ft.stats()["tensors_offloaded"] > 0
    assert any(f.startswith("ferry/policies/torchtune-") for f in _ferry_files(tmp_path / "cache"))
    assert_same_training(train(GPT, gpt_batch, gpt_loss, steps=1), mine)


def test_a_planted_policy_file_is_not_loaded(tmp_path, monkeypatch):
    """A keep-all policy planted where the drop-in's file would go (the old
    predictable /tmp name, and the policy cache's name for the same source)
    is never what runs: the cache file is checked against its source."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    keep_all = "return { api = 1, name = 'planted', decide = function() return ferry.KEEP end }\n"
    path = os.fspath(ft._policy_file(1024, 5))
    with open(path, "w") as f:
        f.write(keep_all)
    import hashlib
    old = os.path.join(tempfile.gettempdir(), "ferry-torchtune-%d-%s.lua" % (
        os.getpid(), hashlib.sha1(ft._POLICY.format(min_bytes=1024, stash=5).encode()).hexdigest()[:12]))
    with open(old, "w") as f:
        f.write(keep_all)
    try:
        torch.manual_seed(0)
        model = GPT()
        with ft.OffloadActivations(min_offload_size=1024):
            gpt_loss(model, gpt_batch()).backward()
        assert ft.stats()["tensors_offloaded"] > 0
        with open(path) as f:
            assert "planted" not in f.read()
    finally:
        os.unlink(old)


def test_policy_cache_falls_back_to_a_private_dir(tmp_path, monkeypatch):
    """A home that cannot be written: the policy goes to a directory of this
    process's own (mkdtemp, 0700), not to a shared name another user could
    create first (at f9032b9: /tmp/ferry-policies-UID, used as found)."""
    import ferry
    from ferry import _policy
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    monkeypatch.setattr(_policy, "_private_tmp", None, raising=False)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    planted = shared / f"ferry-policies-{os.getuid()}"
    planted.mkdir(mode=0o777)
    os.chmod(planted, 0o777)
    p = ferry.policy(min_bytes=4096, name="fallback")
    d = os.path.dirname(p.path)
    assert os.path.dirname(d) == str(shared) and d != str(planted)
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert list(planted.iterdir()) == []


def test_policy_cache_under_a_directory_others_can_write_is_not_used(tmp_path, monkeypatch):
    """XDG_CACHE_HOME in a directory others can write (no sticky bit): our
    own ferry/policies there passed the check, although another user could
    rename it away and put a directory of theirs, with their policy, in its
    place. The policy goes to a directory of this process's own instead."""
    import ferry
    from ferry import _policy
    monkeypatch.setattr(_policy, "_private_tmp", None, raising=False)
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared))
    p = ferry.policy(min_bytes=4096, name="shared-parent")
    assert not p.path.startswith(str(shared)), p.path
    assert os.stat(os.path.dirname(p.path)).st_mode & 0o777 == 0o700
    # the same cache below a directory of this user's alone is used
    os.chmod(shared, 0o700)
    p = ferry.policy(min_bytes=4096, name="own-parent")
    assert p.path.startswith(str(shared / "ferry" / "policies")), p.path
