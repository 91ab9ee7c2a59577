"""Fixtures that force the hard paths: every saved tensor really leaves and
comes back (forward stash 0, everything offloaded, `bytes_h2d > 0` checked),
for every dtype torch offers, offset and non-contiguous views, aliases of
different sizes at one address, activation checkpointing, and several steps
of a byte-bounded stash."""
import os
import tempfile

import pytest
import torch
import torch.utils.checkpoint as tuc

import ferry.torch as ft
from conftest import assert_bit_identical, bits

OFFLOAD_ALL = """
local R = require "ferry.rules"
return R.policy { name = "offload-all", R.min_bytes(0), R.max_stash(0), reload = R.on_use() }
"""


@pytest.fixture
def policy_file():
    files = []

    def make(src=OFFLOAD_ALL):
        f = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
        f.write(src)
        f.close()
        files.append(f.name)
        return f.name

    yield make
    for f in files:
        os.unlink(f)


def _dtypes():
    out = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64", "complex32"):
        if hasattr(torch, name):
            out.append(getattr(torch, name))
    return out


def _random_payload(dtype, n=4096):
    """n elements of dtype with every byte pattern likely (NaNs included)."""
    g = torch.Generator().manual_seed(hash(str(dtype)) & 0xFFFF)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw % 2 == 1
    return raw.view(dtype)


class _Keep(torch.autograd.Function):
    """Saves `payload` for backward and hands what it got back to `sink`."""

    @staticmethod
    def forward(ctx, x, payload, sink):
        ctx.save_for_backward(payload)
        ctx.sink = sink
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (payload,) = ctx.saved_tensors
        ctx.sink.append(payload.clone())
        return g * 2, None, None


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_every_dtype_is_really_reloaded_bit_identical(dtype, policy_file):
    try:
        payload = _random_payload(dtype)
    except (RuntimeError, TypeError) as e:  # a dtype this torch cannot make from bytes
        pytest.skip(f"{dtype}: {e}")
    expect = payload.clone()
    x = torch.randn(8, requires_grad=True)
    sink = []
    with ft.offload(None, policy=policy_file(), backend="host"):
        y = _Keep.apply(x, payload, sink)
    before = ft.stats()["bytes_h2d"]
    y.sum().backward()
    s = ft.stats()
    assert s["bytes_h2d"] - before >= payload.numel() * payload.element_size(), s
    assert len(sink) == 1
    got = sink[0]
    assert got.dtype == dtype and got.shape == expect.shape
    assert torch.equal(bits(got), bits(expect)), f"{dtype}: bytes differ after a reload"


def _grads(fn, leaf_shape, offload_policy=None, checkpoint=None):
    torch.manual_seed(0)
    base = torch.randn(*leaf_shape, dtype=torch.float64, requires_grad=True)
    if offload_policy:
        with ft.offload(None, policy=offload_policy, backend="host"):
            loss = fn(base)
    else:
        loss = fn(base)
    loss.backward()
    return loss.detach(), base.grad.detach().clone()


def _check_same(fn, shape, policy, reloads=True):
    plain = _grads(fn, shape)
    mine = _grads(fn, shape, policy)
    s = ft.stats()
    assert s["tensors_offloaded"] > 0, s
    if reloads:
        assert s["bytes_h2d"] > 0, s
    assert_bit_identical(plain[0], mine[0], "loss")
    assert_bit_identical(plain[1], mine[1], "grad")
    return s


def test_views_at_offsets_and_strides(policy_file):
    """A view saved at a nonzero storage offset, a strided view and a
    transposed one come back as themselves, not as offset 0 of the base."""

    def fn(base):
        r = base * 1                       # a fresh storage
        v = r[1:3]                         # offset 1 row
        w = r[:, 5:9]                      # non-contiguous, offset 5
        t = r[2:].t()                      # transposed, offset
        e = r.view(-1)[7::3]               # strided, odd offset
        return (v * v).sum() + (w * w).sum() * 3 + (t.sin() * t).sum() + (e * e).sum()

    _check_same(fn, (64, 32), policy_file())


STASHING = """
local R = require "ferry.rules"
return R.policy { name = "stash-8", R.min_bytes(0), R.max_stash(8), reload = R.on_use() }
"""


def test_aliases_of_different_sizes_at_one_address(policy_file):
    """r[0] and r start at the same address with different sizes: each is
    saved and restored as itself. The stash keeps the first one's device
    buffer while the others are packed, so the engine sees one address
    saved three times (twice with the same size: one stored copy)."""

    def fn(base):
        r = base * 1
        a = r[0]          # the first row: same data pointer as r, smaller
        b = r[:2]         # a larger prefix at the same address
        loss = (a * a).sum() + (r * r).sum() * 2 + (b * b * b).sum()
        z = base * 2
        for _ in range(12):  # more saves than the stash holds: the aliased
            z = torch.sin(z)  # entries go to the host and are reloaded
        return loss + z.sum()

    s = _check_same(fn, (16, 64), policy_file(STASHING))
    assert s["tensors_aliased"] > 0, s


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_with_real_reloads(reentrant, policy_file):
    """Tensors saved in the forward and again in the recomputation during
    backward both go to the host and come back."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(64, 64).double() for _ in range(3))

    def block(x, lin):
        return torch.nn.functional.gelu(lin(x)) * x

    def fn(base):
        x = base
        for lin in layers:
            if reentrant:
                x = tuc.checkpoint(block, x, lin, use_reentrant=True)
            else:
                x = tuc.checkpoint(block, x, lin, use_reentrant=False)
        return (x * x).sum()

    _check_same(fn, (8, 64), policy_file())


def test_byte_bounded_stash_holds_over_many_steps(policy_file):
    """With the stash bounded by bytes, every step (1, 2 and 10 alike) makes
    the same offloads, stash hits and reloads: the stash's byte count goes
    back down on a hit, or from step 2 on it would never hold anything."""
    src = """
local R = require "ferry.rules"
return R.policy { name = "stash-bytes", R.min_bytes(0), R.max_stash(64),
                  R.max_stash_bytes(96 * 1024), reload = R.on_use() }
"""
    path = policy_file(src)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(6)])
    per_step = []
    last = None
    for step in range(10):
        x = torch.randn(32, 128)
        with ft.offload(model, policy=path, backend="host"):
            loss = model(x).pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        s = ft.stats()
        cur = {k: s[k] for k in ("tensors_offloaded", "stash_hits", "bytes_h2d")}
        if last:
            per_step.append({k: cur[k] - last[k] for k in cur})
        else:
            per_step.append(dict(cur))
        last = cur
    assert per_step[0]["stash_hits"] > 0 and per_step[0]["bytes_h2d"] > 0, per_step[0]
    for i in (1, 9):
        assert per_step[i] == per_step[0], f"step {i + 1}: {per_step[i]} vs step 1 {per_step[0]}"


@pytest.mark.parametrize("evict", [False, True], ids=["stash-hit", "reloaded"])
def test_same_bytes_other_layout_at_an_offset(evict, policy_file):
    """Two views of the same bytes at a nonzero storage offset with different
    shapes: the second is stored once (an alias) and rebuilt from the first
    one's buffer at its own offset and layout, whether the buffer is still on
    device (stash hit) or comes back from the host."""

    def fn(base):
        r = base * 1
        v = r[1:3]                              # 2 x 64 at element offset 64
        u = r.view(-1)[64:192].view(8, 16)      # the same 128 elements, 8 x 16
        loss = (v * v).sum() + (u.cos() * u).sum()
        if evict:
            z = base * 2
            for _ in range(12):
                z = torch.sin(z)
            loss = loss + z.sum()
        return loss

    s = _check_same(fn, (16, 64), policy_file(STASHING), reloads=evict)
    assert s["tensors_aliased"] > 0, s
