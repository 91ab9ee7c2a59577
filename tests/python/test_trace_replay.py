"""Item 5: a trace recorded from a real model run replays in `ferry sim`
with the same decisions and bytes moved as the run's own stats."""
import json
import os
import subprocess

import pytest
import torch

import ferry
import ferry.torch as ft
from conftest import GPT, gpt_batch, gpt_loss, read_trace

STEPS = 3


def ferry_cli():
    exe = os.environ.get("FERRY_BIN")
    if not exe:  # <build>/python/ferry/__init__.py -> <build>/bin/ferry
        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ferry.__file__))))
        exe = os.path.join(build, "bin", "ferry")
    if not os.access(exe, os.X_OK):
        if os.environ.get("CI") == "true":
            pytest.fail(f"no ferry CLI at {exe} (set FERRY_BIN)")
        pytest.skip(f"no ferry CLI at {exe} (set FERRY_BIN)")
    return exe


@pytest.mark.parametrize("policy", ["default", "layers"])
def test_recorded_trace_replays_with_same_decisions(policy, tmp_path):
    exe = ferry_cli()
    trace = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = GPT(layers=4)
    for _ in range(STEPS):
        with ft.offload(model, policy=policy, record_trace=str(trace)):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
    ft.step()
    run = ft.stats()
    ft.close()
    out = tmp_path / "sim.json"
    r = subprocess.run([exe, "sim", "--policy", ferry.policy_path(policy), "--trace", str(trace),
                        "--steps", str(STEPS), "--json", str(out), "--recorded"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    sims = {p["name"]: p for p in report["policies"]}
    replayed = [p for n, p in sims.items() if n != "no offload"]
    assert len(replayed) == 2  # the policy, and the recorded decisions
    # Steady state: every step makes the same decisions (cached per site),
    # so the simulator's per-step figures are the run's totals / STEPS.
    for sim in replayed:
        for key in ("tensors_packed", "tensors_offloaded", "bytes_d2h"):
            assert sim[key] * STEPS == run[key], (sim["name"], key, sim[key], run[key])
    assert run["tensors_offloaded"] > 0


# ---- issue 12 item 6: what a recorded trace carries for an honest replay ------------
def steps_of(events):
    """{step: the events from its step_begin to its step_end}."""
    out, cur = {}, None
    for e in events:
        if e["ev"] == "step_begin":
            cur = out[e["step"]] = []
        if cur is not None:
            cur.append(e)
        if e["ev"] == "step_end":
            cur = None
    return out


def resident_at_each_step(events):
    """[{what: bytes} in force at each step_begin], checking that every
    resident event comes between steps."""
    declared, out, in_step = {}, [], False
    for e in events:
        if e["ev"] == "resident":
            assert not in_step, f"resident memory declared inside a step: {e}"
            assert "flops" not in e
            declared[e["what"]] = e["bytes"]
        elif e["ev"] == "step_begin":
            in_step = True
            out.append(dict(declared))
        elif e["ev"] == "step_end":
            in_step = False
    return out


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def linear_stack(a, b, c, d):
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c),
                               torch.nn.Tanh(), torch.nn.Linear(c, d, bias=False))


@pytest.mark.parametrize("wrap", ["adamw", "adamw under offload_optimizer"])
def test_recorded_trace_declares_the_models_resident_memory(wrap, tmp_path):
    """Parameters, gradients and (optimizer=) AdamW's states are declared
    between steps: exp_avg and exp_avg_sq are 2x the fp32 parameter bytes
    once the first step created them, the host share of offload_optimizer
    included (ferry sim --optimizer-fraction moves it)."""
    trace = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    model = linear_stack(32, 64, 48, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if wrap != "adamw":
        ft.offload_optimizer(opt, fraction=0.5)
    for _ in range(STEPS):
        with ft.offload(model, record_trace=str(trace), optimizer=opt, backend="host"):
            loss = model(torch.randn(8, 32)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ft.step()
    ft.close()
    params = nbytes(model.parameters())
    at = resident_at_each_step(read_trace(trace))
    assert len(at) == STEPS
    assert at[0] == {"parameters": params, "gradients": params, "optimizer states": 0}
    for later in at[1:]:
        assert later == {"parameters": params, "gradients": params,
                         "optimizer states": 2 * params}
    # the allocator's peak is a GPU's (test_cuda.py): none on the host backend
    assert not [e for e in read_trace(trace) if e["ev"] == "device_peak"]


@pytest.mark.parametrize("frozen_first", [False, True])
def test_recorded_flops_of_a_linear_stack_are_the_hand_arithmetic(frozen_first, tmp_path):
    """2 x in x out FLOPs per token and Linear forward; backward the same
    once for the weight's gradient and once for the input's, where each is
    needed. Every event of a step carries "flops"; forward's are all in by
    backward_begin."""
    n, a, b, c, d = 8, 32, 64, 48, 16
    trace = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    model = linear_stack(a, b, c, d)
    if frozen_first:
        model[0].requires_grad_(False)
    fwd = 2 * n * (a * b + b * c + c * d)
    if frozen_first:  # nothing for layer 0; layer 1's input needs no gradient
        bwd = 2 * n * b * c + 2 * (2 * n * c * d)
    else:  # layer 0's input (the data) needs no gradient
        bwd = 2 * n * a * b + 2 * (2 * n * b * c) + 2 * (2 * n * c * d)
    for _ in range(STEPS):
        with ft.offload(model, record_trace=str(trace), backend="host"):
            loss = model(torch.randn(n, a)).square().mean()
        loss.backward()
    ft.step()
    ft.close()
    steps = steps_of(read_trace(trace))
    assert sorted(steps) == list(range(1, STEPS + 1))
    for k, evs in steps.items():
        assert all("flops" in e for e in evs), [e for e in evs if "flops" not in e][:3]
        fwd_part = 0
        for e in evs:
            fwd_part += e["flops"]
            if e["ev"] == "backward_begin":
                break
        assert fwd_part == fwd, (k, fwd_part, fwd)
        assert sum(e["flops"] for e in evs) == fwd + bwd, (k, sum(e["flops"] for e in evs), fwd + bwd)


class Mixed(torch.nn.Module):
    """A convolution, nn.MultiheadAttention, a matmul of a parameter and, on
    a torch that has it, F.scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.w = torch.nn.Parameter(torch.randn(32, 6))

    def forward(self, img, seq):
        c = self.conv(img)
        s = self.mha(seq, seq, seq, need_weights=False)[0]
        m = s @ self.w
        out = c.mean() + m.mean()
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        if sdpa is not None:
            q = s.reshape(2, 10, 4, 8).transpose(1, 2)
            out = out + sdpa(q, q, q).mean()
        return out


def test_recorded_flops_of_convolution_and_attention(tmp_path):
    trace = tmp_path / "t.jsonl"
    torch.manual_seed(0)
    model = Mixed()
    n, l, e = 2, 10, 32  # batch, sequence, embedding
    # conv: 2 x (in channels x kernel) per output element; input needs no
    # gradient, the weight does
    conv = 2 * (n * 8 * 16 * 16) * (3 * 3 * 3)
    # attention: q, k, v and output projections, q k^T and attention x v
    mha = 2 * n * l * e * e * 4 + 2 * 2 * n * l * l * e
    mm = 2 * (n * l * 6) * e  # [n, l, e] @ [e, 6]
    fwd, bwd = conv + mha + mm, conv + 2 * mha + 2 * mm
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        sdpa = 2 * 2 * (n * 4 * l * l * 8)  # [n, 4 heads, l, 8]: two products
        fwd, bwd = fwd + sdpa, bwd + 2 * sdpa
    for _ in range(STEPS):
        with ft.offload(model, record_trace=str(trace), backend="host"):
            loss = model(torch.randn(n, 3, 16, 16), torch.randn(n, l, e))
        loss.backward()
    ft.step()
    ft.close()
    for k, evs in steps_of(read_trace(trace)).items():
        assert sum(ev["flops"] for ev in evs) == fwd + bwd, k


def sim_json(tmp_path, trace, *args):
    out = tmp_path / "sim.json"
    r = subprocess.run([ferry_cli(), "sim", "--trace", str(trace), "--hw", "h100", "--policy",
                        "default", "--steps", str(STEPS), "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    runs = {p["name"]: p for p in report["policies"]}
    runs["no offload"] = report["baseline"]
    return runs


def test_recorded_trace_replays_from_its_flops_and_resident_memory(tmp_path):
    """Recorded on the CPU, replayed on an h100: the step is the trace's
    FLOPs at the simulated GPU's rate (half the MFU, twice the time; at
    --tflops X, FLOPs / X exactly), the note says so, and the device peak
    counts parameters, gradients and AdamW's states."""
    trace = tmp_path / "gpt.jsonl"
    torch.manual_seed(0)
    model = GPT(layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(STEPS):
        with ft.offload(model, policy="default", record_trace=str(trace), optimizer=opt):
            loss = gpt_loss(model, gpt_batch())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ft.step()
    ft.close()
    per_step = {k: sum(e["flops"] for e in evs) for k, evs in steps_of(read_trace(trace)).items()}
    flops = per_step[1]
    assert flops > 0 and set(per_step.values()) == {flops}
    params = nbytes(model.parameters())
    runs = {mfu: sim_json(tmp_path, trace, "--mfu", mfu) for mfu in ("0.4", "0.2")}
    runs["tflops"] = sim_json(tmp_path, trace, "--tflops", "50")
    for name, sims in runs.items():
        for p in sims.values():
            assert p["compute_note"].startswith("compute timed from the trace's FLOPs"), (name, p)
            assert p["gaps_as_recorded"] == 0 and p["gaps_from_flops"] > 0
            assert p["resident_bytes"] == 4 * params  # parameters, gradients, 2 states
            assert p["peak_device_bytes"] > p["resident_bytes"]
    slow, fast = runs["0.2"]["no offload"]["step_us"], runs["0.4"]["no offload"]["step_us"]
    assert slow == pytest.approx(2 * fast, rel=1e-9)
    assert runs["tflops"]["no offload"]["step_us"] == pytest.approx(flops / 50e6, rel=1e-9)


class Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256))

    def forward(self, x):
        return (x * self.w).tanh() * self.w


def test_a_trace_with_nothing_counted_keeps_its_recorded_times(tmp_path):
    """No op ferry counts: no event carries FLOPs, and the replay says its
    compute times are the recording machine's."""
    trace = tmp_path / "t.jsonl"
    model = Scale()
    for _ in range(STEPS):
        with ft.offload(model, record_trace=str(trace), backend="host"):
            loss = model(torch.randn(64, 256)).sum()
        loss.backward()
    ft.step()
    ft.close()
    events = read_trace(trace)
    assert not any("flops" in e for e in events)
    assert resident_at_each_step(events)[0] == {"parameters": 1024, "gradients": 1024}
    for p in sim_json(tmp_path, trace).values():
        assert p["gaps_from_flops"] == 0 and p["gaps_as_recorded"] > 0
        assert "recording machine's" in p["compute_note"]
        assert p["resident_bytes"] == 2048


def test_not_recording_installs_no_flop_counting():
    """Without record_trace nothing of the recorder is installed: no mode
    sees torch calls, no gradient hook is added, no resident is computed."""
    from ferry import _flops
    model = linear_stack(8, 8, 8, 8)
    with ft.offload(model, backend="host") as ctx:
        assert getattr(_flops._active, "mode", None) is None
        y = model(torch.randn(4, 8))
    assert ctx.session.flops is None and not ctx.session.recording
    assert not y._backward_hooks
    y.sum().backward()


# ---- the engine's switches: release_when_copied, prefetch_at_backward_begin ------------
def test_release_when_copied_frees_the_stash_once_copies_are_done():
    """The forward stash holds offloaded buffers until max_fwd_stash pushes
    them out; with release_when_copied a buffer goes at the first pack after
    its copy to the host completed (engine test
    stash_released_when_copy_completes): device_bytes_held drops within
    forward. Packs go on (each one a chance to release) until it has, or
    for at most 20 s, far below the stash bound; without the switch nothing
    is released at all."""
    import time
    pol = ferry.policy(min_bytes=4096, max_stash=4096)

    def run(release, packs):
        xs = [torch.randn(64, 256, requires_grad=True) for _ in range(packs)]
        with ft.offload(None, policy=pol, backend="host", release_when_copied=release):
            ys, held, deadline = [], [], time.monotonic() + 20
            for i, x in enumerate(xs):
                ys.append(x.sin())  # saves x: 64 KiB, offloaded
                held.append(ft.stats()["device_bytes_held"])
                if release and held[-1] < (i + 1) * 65536:
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)  # let the copy run
            sum(y.sum() for y in ys).backward()
        for x, _ in zip(xs, ys):
            torch.testing.assert_close(x.grad, x.detach().cos())  # reloaded intact
        ft.step()
        ft.close()
        return held

    kept = run(False, 8)
    assert kept == [(i + 1) * 65536 for i in range(8)]  # nothing released within forward
    released = run(True, 1000)
    assert released[-1] < len(released) * 65536, released[-5:]


@pytest.mark.parametrize("early", [False, True])
def test_prefetch_at_backward_begin_starts_the_first_reloads(early):
    """With a prefetching policy, prefetch_at_backward_begin starts the last
    offloaded tensors' reloads when backward begins, before any unpack."""
    pol = ferry.policy(min_bytes=4096, max_stash=0, prefetch=2)
    xs = [torch.randn(64, 256, requires_grad=True) for _ in range(4)]
    with ft.offload(None, policy=pol, backend="host", prefetch_at_backward_begin=early):
        loss = sum(x.sin().sum() for x in xs)
    assert ft.stats()["tensors_offloaded"] == 4
    ft.engine().backward_begin()
    started = ft.stats()["prefetches"]
    assert started == (2 if early else 0)
    loss.backward()
    for x in xs:
        torch.testing.assert_close(x.grad, x.detach().cos())


def test_engine_switches_are_checked_and_default_from_ferry_run(monkeypatch):
    model = torch.nn.Linear(2, 2)
    info = ft.offload(model, backend="host").engine.info()
    assert not info["release_when_copied"] and not info["prefetch_at_backward_begin"]
    monkeypatch.setenv("FERRY_RELEASE_COPIED", "1")  # ferry run --release-copied
    monkeypatch.setenv("FERRY_PREFETCH_AT_BACKWARD", "1")  # --prefetch-at-backward
    info = ft.offload(model, backend="host").engine.info()
    assert info["release_when_copied"] and info["prefetch_at_backward_begin"]
    info = ft.offload(model, backend="host", release_when_copied=False).engine.info()
    assert not info["release_when_copied"] and info["prefetch_at_backward_begin"]  # keyword wins
    for bad in ("yes please", 2, 1.0, None.__class__):
        with pytest.raises(TypeError, match="release_when_copied must be True or False"):
            ft.offload(model, release_when_copied=bad)
    monkeypatch.setenv("FERRY_PREFETCH_AT_BACKWARD", "maybe")
    with pytest.raises(ValueError, match="FERRY_PREFETCH_AT_BACKWARD='maybe'"):
        ft.offload(model)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        ft.offload(model, optimizer=model)
