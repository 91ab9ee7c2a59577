"""ferry.checkpoint.reserve() grows the arena ahead of training, so that the
first snapshot takes warm staging buffers instead of pinning new memory on
the training thread (issue 37, item 9)."""
import pytest
import torch

import ferry.checkpoint as ck
from ferry.checkpoint import CheckpointError


def test_reserve_ahead_then_the_first_snapshot_does_not_grow_the_arena(tmp_path):
    torch.manual_seed(0)
    state = {"w": torch.randn(5 << 20), "b": torch.randn(3 << 20)}  # 32 MiB
    engine = ck.reserve(state)
    reserved = engine.stats()["arena_reserved"]
    assert reserved >= 32 << 20
    assert engine.stats()["arena_in_use"] == 0
    h = ck.snapshot(state, tmp_path / "ck.pt")
    assert engine.stats()["arena_reserved"] == reserved  # staged into warm memory
    h.wait()
    got = torch.load(tmp_path / "ck.pt")
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert engine.stats()["arena_reserved"] == reserved


def test_reserve_past_the_cap_is_refused_naming_it():
    with pytest.raises(CheckpointError, match="cap"):
        ck.reserve(64 << 20, host_cap=8 << 20)
