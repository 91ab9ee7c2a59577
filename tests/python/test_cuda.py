"""ferry.torch on a real GPU: the cuda backend under torch's own CUDA tensors,
streams and caching allocator.

Skipped where torch sees no GPU (CI). On a GPU machine:
    PYTHONPATH=<build>/python python -m pytest tests/python/test_cuda.py
(a build whose extension was made for that interpreter, with the CUDA
toolkit found at configure time).

Every comparison is bit for bit against the same run without ferry, with
torch's deterministic algorithms on (cuBLAS workspace fixed, embedding
backward without atomics) so that two plain runs agree with each other."""
import contextlib
import json
import os

# Before the first cuBLAS call: deterministic cuBLAS needs a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: these tests run on a GPU machine", allow_module_level=True)

import ferry  # noqa: E402
import ferry.torch as ft  # noqa: E402
from conftest import GPT, assert_bit_identical  # noqa: E402

DEV = torch.device("cuda", 0)

# Every activation out, reloaded on use; parameters and buffers kept.
OFFLOAD_ALL = """
return { api = 1, name = "offload-all",
  decide = function(t, ctx)
    if t.kind ~= ferry.ACTIVATION then return ferry.KEEP, ferry.ON_USE, nil, true end
    return ferry.OFFLOAD, ferry.ON_USE, nil, true
  end }
"""


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def offload_all(tmp_path):
    p = tmp_path / "offload_all.lua"
    p.write_text(OFFLOAD_ALL)
    return str(p)


def train(steps=3, ctx=None, dtype=torch.float32, b=8, t=256, stream=None, peaks=True):
    """AdamW steps on the GPU; [(loss, grads)] per step, the model and the
    peak of torch.cuda.max_memory_allocated over the steps' forward+backward
    (peaks=False: the allocator's peak statistics left alone, 0)."""
    torch.manual_seed(0)
    model = GPT(vocab=256, d=256, heads=4, layers=4, ctx=256).to(DEV, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history, peak = [], 0
    s = stream or torch.cuda.current_stream()
    for i in range(steps):
        g = torch.Generator(device="cpu").manual_seed(100 + i)
        batch = torch.randint(0, 256, (b, t + 1), generator=g).to(DEV)
        torch.cuda.synchronize()
        if peaks:
            torch.cuda.reset_peak_memory_stats()
        with torch.cuda.stream(s):
            with ctx(model) if ctx else contextlib.nullcontext():
                logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     batch[:, 1:].reshape(-1))
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if peaks:
            peak = max(peak, torch.cuda.max_memory_allocated())
        history.append((loss.detach().clone(), grads))
        del logits, loss
    return history, model, peak


def assert_same(a, b):
    (ha, ma, _), (hb, mb, _) = a, b
    for step, ((la, ga), (lb, gb)) in enumerate(zip(ha, hb)):
        assert_bit_identical(la, lb, f"step {step} loss")
        for (n, _), x, y in zip(ma.named_parameters(), ga, gb):
            assert_bit_identical(x, y, f"step {step} grad {n}")
    for (n, p), q in zip(ma.named_parameters(), mb.parameters()):
        assert_bit_identical(p, q, f"final parameter {n}")


def test_plain_runs_agree():
    """The reference itself is deterministic on this GPU (else nothing below
    could be compared bit for bit)."""
    assert_same(train(), train())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_offloaded_bit_identical_and_lighter(offload_all, dtype):
    """Every saved activation goes to pinned host memory and back through the
    cuda backend: losses, gradients and weights bit-identical to plain
    autograd, and the device peak drops."""
    plain = train(dtype=dtype)
    off = train(dtype=dtype, ctx=lambda m: ft.offload(m, policy=offload_all))
    assert_same(plain, off)
    s = ft.stats()
    assert s["backend"] == "cuda", s
    assert s["tensors_offloaded"] > 0 and s["bytes_d2h"] > 0, s
    # (a tensor unpacked while its device buffer is still in the forward
    # stash comes back without a copy)
    assert 0 < s["bytes_h2d"] <= s["bytes_d2h"], s
    # The peak falls by at least a quarter of what one step sends out (the
    # forward stash and the reloads in flight hold the rest at times; on an
    # H200: 321.6 -> 241.0 MB with 172.4 MB out per step, 47%).
    per_step = s["bytes_d2h"] / 3
    assert off[2] < plain[2] - per_step / 4, (plain[2], off[2], per_step)


def test_default_policy_matches_plain():
    """The shipped default (torchtune's behaviour: head kept, stash of 5)."""
    assert_same(train(), train(ctx=lambda m: ft.offload(m, policy="default")))
    assert ft.stats()["bytes_d2h"] > 0


def test_side_stream(offload_all):
    """Forward and backward on a stream of the user's own: ferry orders its
    copies after that stream's work, and that stream after the reloads."""
    side = torch.cuda.Stream()
    assert_same(train(), train(ctx=lambda m: ft.offload(m, policy=offload_all), stream=side))


def test_saved_tensor_layouts_round_trip(offload_all):
    """Views, transposes, storage offsets and dtypes come back with their
    exact bytes, strides and offsets (the saved tensor is what backward
    reads; a wrong stride or offset gives a wrong gradient)."""
    torch.manual_seed(0)
    base = torch.randn(64, 96, device=DEV)
    cases = {
        "contiguous": base.clone(),
        "transposed": base.clone().t(),
        "offset view": base.clone()[3:40],
        "strided slice": base.clone()[3:40, 5:70],  # not dense: kept, as torch holds it
        "bf16": base.to(torch.bfloat16),
        "f16 channels_last": torch.randn(2, 8, 16, 16, device=DEV, dtype=torch.float16)
        .to(memory_format=torch.channels_last),
    }
    for name, x in cases.items():
        before = ft.stats()["tensors_offloaded"] if name != "contiguous" else 0
        x = x.detach().requires_grad_()
        w = torch.randn_like(x).requires_grad_()
        ref_x, ref_w = torch.autograd.grad((x * w).sum(), (x, w))
        with ft.offload(None, policy=offload_all):
            y = (x * w).sum()  # saves x and w
        gx, gw = torch.autograd.grad(y, (x, w))
        assert_bit_identical(gx, ref_x, f"{name}: grad of x")
        assert_bit_identical(gw, ref_w, f"{name}: grad of w")
        went = ft.stats()["tensors_offloaded"] - before
        assert went == (1 if name == "strided slice" else 2), (name, went)


def test_in_place_change_after_save_is_torchs_error(offload_all):
    x = torch.randn(256, 256, device=DEV, requires_grad=True)
    with ft.offload(None, policy=offload_all):
        y = x.exp()  # saves its output
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_host_cap_keeps_what_does_not_fit(offload_all):
    """A host cap smaller than the activations: what does not fit stays on
    the device, training is unchanged, the arena never exceeds the cap."""
    cap = 8 << 20
    plain = train(steps=2)
    off = train(steps=2, ctx=lambda m: ft.offload(m, policy=offload_all, host_cap=cap))
    assert_same(plain, off)
    s = ft.stats()
    assert s["tensors_offloaded"] > 0 and s["tensors_kept"] > 0, s
    assert s["arena_peak"] <= cap, s


def test_recorded_trace_carries_each_steps_device_peak(offload_all, tmp_path):
    """On the GPU the recorder writes each step's own allocator peak
    (device_peak) after the step: the peak statistic is reset as a recorded
    step begins, so the last step's is what torch reads after it."""
    trace = tmp_path / "gpu.jsonl"
    # a higher peak before the recording must not hide the steps' own
    big = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    del big
    train(steps=2, ctx=lambda m: ft.offload(m, policy=offload_all, record_trace=str(trace)),
          peaks=False)
    ft.step()
    last = torch.cuda.max_memory_allocated()
    ft.close()  # flushes the trace
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    peaks = [e for e in events if e["ev"] == "device_peak"]
    assert [e["step"] for e in peaks] == [1, 2], peaks
    assert peaks[-1]["bytes"] == last
    assert all(0 < e["bytes"] < (1 << 30) for e in peaks), peaks


PREFETCH_ALL = """
local R = require "ferry.rules"
return R.policy { name = "prefetch-all", R.min_bytes(1024), R.exclude_params_and_buffers(),
                  R.max_stash(1), reload = R.prefetch(4) }
"""


def test_prefetch_at_backward_begin_on_a_side_stream(tmp_path):
    """Backward on a stream of the user's own, with the reloads started as
    backward begins: their buffers come from that stream's pool, are ordered
    after it, and every reloaded tensor is recorded on it (issue 36 items 6
    and 7; the engine's side is tested on the CUDA double)."""
    p = tmp_path / "prefetch_all.lua"
    p.write_text(PREFETCH_ALL)
    side = torch.cuda.Stream()
    ctx = lambda m: ft.offload(m, policy=str(p), prefetch_at_backward_begin=True)  # noqa: E731
    assert_same(train(stream=side), train(ctx=ctx, stream=side))
    s = ft.stats()
    assert s["prefetches"] > 0 and s["bytes_h2d"] > 0, s


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_device_other_than_the_current_one(offload_all):
    """The model on cuda:1 while the thread's current device is 0: the
    compute stream is cuda:1's, so its tensors are offloaded (they were
    kept, silently: issue 36 item 9; the device guard's side is tested on
    the CUDA double)."""
    dev = torch.device("cuda", 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 512)).to(dev)
    x = torch.randn(64, 512, device=dev)
    assert torch.cuda.current_device() == 0
    ref = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
    with ft.offload(model, policy=offload_all):
        y = model(x).pow(2).sum()
    got = torch.autograd.grad(y, list(model.parameters()))
    for a, b in zip(got, ref):
        assert_bit_identical(a, b, "grad")
    assert ft.stats()["tensors_offloaded"] > 0, ft.stats()
