"""Resident buffers (ext/resident.c) and Engine.close() (ext/engine.c):
torch.frombuffer views of a resident buffer keep reading its bytes after
the engine is closed (issue 39 item 10: close() gave the arena back while
the views were alive, and an old view then read another buffer's data at
the same address), and after Resident.close() (which gave the bytes back
while a view, holding the Resident and no buffer export, still read them)."""
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
    r.close()  # the view still reads the bytes: they (and the engine) go with it
    assert torch.equal(view, want)
    with pytest.raises(ferry.FerryError, match="closed"):
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


def in_use(e):
    return e.stats()["arena_in_use"]


def test_view_outlives_resident_close_and_frees_with_it():
    want = torch.arange(4096, dtype=torch.float32)
    e = engine()
    r, view = staged(e, want)
    held = in_use(e)
    assert held >= want.numel() * 4
    r.close()
    assert r.nbytes == 0 and r.host_ptr == 0
    assert in_use(e) == held  # a view may read the bytes: not given back yet
    # other buffers of the same size are taken and written; before, one of
    # them reused the view's address and the view read its 7s
    others = [staged(e, torch.full((4096,), 7.0)) for _ in range(3)]
    assert all(o.host_ptr != view.data_ptr() for o, _ in others)
    assert torch.equal(view, want)
    with pytest.raises(ferry.FerryError, match="closed"):
        r.to_host(want.data_ptr())
    with pytest.raises(BufferError, match="closed"):
        memoryview(r)  # torch.frombuffer says only "could not retrieve buffer"
    for o, v in others:
        o.close()
    del others, o, v
    gc.collect()
    assert in_use(e) == held  # the closed buffer's view is alive still
    del r
    assert in_use(e) == held  # ... and holds the Resident
    del view
    gc.collect()
    assert in_use(e) == 0  # the last view gone, the bytes are back
    e.close()


def test_close_before_any_view_frees_at_once():
    e = engine()
    r = e.resident(1 << 16)
    assert in_use(e) >= 1 << 16
    r.close()
    assert in_use(e) == 0  # never exported: nothing can read the bytes
    r.close()  # twice is fine
    with pytest.raises(BufferError, match="closed"):
        memoryview(r)
    e.close()


def test_memoryview_export_defers_close_too():
    e = engine()
    r = e.resident(4096)
    m = memoryview(r)
    r.close()  # before: BufferError; now the bytes stay for the export
    m[0] = 5
    assert m[0] == 5
    m.release()
    del m, r
    gc.collect()
    assert in_use(e) == 0
    e.close()
