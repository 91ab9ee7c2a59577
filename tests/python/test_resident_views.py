"""Resident buffers (ext/resident.c) and Engine.close() (ext/engine.c):
torch.frombuffer views of a resident buffer keep reading its bytes after
the engine is closed (issue 39 item 10: close() gave the arena back while
the views were alive, and an old view then read another buffer's data at
the same address)."""
import gc

import pytest
import torch

import ferry
from ferry import _ferry


def engine():
    return _ferry.Engine(backend="host", policy_path=ferry.policy_path("default"))


def staged(e, values):
    r = e.resident(values.numel() * values.element_size())
    r.to_host(values.data_ptr())
    r.wait()
    return r, torch.frombuffer(r, dtype=values.dtype)


def test_views_outlive_engine_close():
    want = torch.arange(4096, dtype=torch.float32)
    e = engine()
    r, view = staged(e, want)
    del r  # the view holds the buffer
    e.close()
    assert e.closed
    # a new engine's buffer of the same size, other bytes: the old view must
    # still read its own (the arena it lives in was not given back)
    e2 = engine()
    r2, view2 = staged(e2, torch.full((4096,), 7.0))
    assert torch.equal(view, want)
    assert torch.equal(view2, torch.full((4096,), 7.0))
    del view, view2, r2
    gc.collect()
    e2.close()


def test_closed_engine_buffer_refuses_copies_and_is_destroyed_with_its_last_view():
    want = torch.arange(256, dtype=torch.float64)
    e = engine()
    r, view = staged(e, want)
    e.close()
    with pytest.raises(ferry.FerryError, match="engine was closed"):
        r.to_host(want.data_ptr())
    with pytest.raises(ferry.FerryError, match="engine was closed"):
        r.to_device(want.data_ptr())
    assert torch.equal(view, want)  # the bytes stay for the view
    r.wait()  # copies queued before close() still complete
    r.close()  # gives the bytes back: the engine's deferred destroy runs here
    with pytest.raises(ferry.FerryError):
        r.wait()
    del view, r
    gc.collect()


def test_close_without_buffers_destroys_at_once():
    e = engine()
    r = e.resident(64)
    r.close()
    e.close()
    assert e.closed
    with pytest.raises(ferry.FerryError, match="closed"):
        e.resident(64)
