#!/usr/bin/env python3
"""Optimizer-state offload and weight offload on the GPU, each against the
plain run measured in the same process, then the same settings replayed by
`ferry sim` on a trace recorded here.

Model: a stack of --blocks MLP blocks (Linear(d, 4d), GELU, Linear(4d, d),
LayerNorm) in a ModuleList `h` (fp32, d = --dim), AdamW, batch --batch x d.
Every mode starts from the same weights and sees the same batches:
  plain                    the plain AdamW
  optim_f{0,025,05,1}      offload_optimizer(opt, fraction=F, overlap=True)
  weights_none             the plain run again (weight offload's baseline)
  weights_double_buffer    offload_weights(model, blocks, double_buffer=True)
  weights_single_buffer    the same, double_buffer=False
Figures per mode: median step ms (zero_grad, forward, backward, step), peak
device memory from before the mode builds its model (MiB,
torch.cuda.max_memory_allocated: weights, gradients, optimizer states and
activations), and whether the parameters after the last
step are bit-identical to the plain run's. sim_step_ms: the same setting
replayed by `ferry sim --trace T --optimizer-fraction 0,0.25,0.5,1`
(or --weight-layers N --weight-double-buffer on|off) on the preset of this
GPU, compute at the run's own rate (optim_sim_mfu: the --mfu at which the
replayed plain step is the measured one; optim_sim_plain_vs_measured: how
near it came); sim_vs_measured = simulated / measured step.
Without a GPU: one smoke step per mode on the CPU at a toy size (nothing
measured), and the replay on a trace recorded there (not reported)."""
import json
import os
import statistics
import subprocess
import sys

import schema
from gpu_common import bits_equal, main, no_gpu_reason, timed
from gpu_link import preset_for


def make(torch, dim, blocks, dev):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(dim, 4 * dim)
            self.out = nn.Linear(4 * dim, dim)
            self.norm = nn.LayerNorm(dim)

        def forward(self, x):
            return self.norm(x + self.out(torch.nn.functional.gelu(self.fc(x))))

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x):
            for b in self.h:
                x = b(x)
            return x

    torch.manual_seed(0)
    return Stack().to(dev)


def run_mode(torch, ft, mode, a, dev, on_gpu):
    # the peak counts from before the model: weights, gradients and optimizer
    # states on the device are what these modes take off it (a base taken
    # after offload_weights would leave the weights out of plain's peak only)
    if on_gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    model = make(torch, a.dim, a.blocks, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    w = None
    if mode.startswith("optim_f"):
        frac = {schema.frac_tag(f): f for f in schema.FRACTIONS}[mode[len("optim_f"):]]
        ft.offload_optimizer(opt, fraction=frac, overlap=True)
    elif mode.startswith("weights_") and mode != "weights_none":
        w = ft.offload_weights(model, layers=list(model.h),
                               double_buffer=mode == "weights_double_buffer")
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randn(a.batch, a.dim, generator=g).to(dev) for _ in range(a.warmup + a.steps)]

    def step(x):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    times = []
    for i, x in enumerate(batches):
        ms, _ = timed(torch, lambda: step(x), on_gpu)
        if i >= a.warmup:
            times.append(ms)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if on_gpu else None
    if w is not None:
        w.remove()
    if hasattr(opt, "ferry_offload"):
        opt.ferry_offload.remove()
    params = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return statistics.median(times), peak, params


def record_trace(torch, ft, a, dev, path):
    """Two plain steps recorded (the replay's --warmup 1 drops the first)."""
    model = make(torch, a.dim, a.blocks, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(2):
        x = torch.randn(a.batch, a.dim, generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        with ft.offload(model, policy="default", record_trace=path, optimizer=opt):
            y = model(x).pow(2).mean()
        y.backward()
        opt.step()
        ft.step()
    ft.close()


def replay(a, trace, preset, extra):
    out = os.path.join(a.work, "optim-sim.json")
    cmd = [os.path.join(a.build, "bin", "ferry"), "sim", "--trace", trace, "--hw", preset,
           "--steps", "2", "--json", out, "--no-layers"] + extra
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=30, stdout=subprocess.DEVNULL)
    with open(out) as fh:
        return json.load(fh)["policies"]


def body(a, f):
    import torch
    import ferry.torch as ft

    why = no_gpu_reason()
    on_gpu = not why
    dev = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:  # a smoke run of every mode and of the replay, nothing reported
        a.dim, a.blocks, a.batch, a.warmup, a.steps = 32, 2, 4, 1, 1
    modes = (["plain"] + [f"optim_f{schema.frac_tag(x)}" for x in schema.FRACTIONS]
             + ["weights_none", "weights_double_buffer", "weights_single_buffer"])
    res = {m: run_mode(torch, ft, m, a, dev, on_gpu) for m in modes}
    trace = os.path.join(a.work, "optim-trace.jsonl")
    record_trace(torch, ft, a, dev, trace)
    preset = preset_for(torch.cuda.get_device_name(0) if on_gpu else "h100") or "h100"
    fr = ",".join(str(x) for x in schema.FRACTIONS)
    plain_ms = res["plain"][0]
    # compute at this run's own rate: the preset's default (0.40 of its BF16
    # peak) is no rate for an fp32 model; the MFU at which the replay's plain
    # step is the measured one (twice: gaps without FLOPs do not scale)
    mfu = 0.40
    for _ in range(2):
        base_ms = replay(a, trace, preset, ["--optimizer-fraction", "0", "--mfu", f"{mfu:.6g}"]
                         )[0]["step_us_baseline"] / 1e3
        mfu = min(max(mfu * base_ms / plain_ms, 1e-4), 2.0)
    base_ms = replay(a, trace, preset, ["--optimizer-fraction", "0", "--mfu", f"{mfu:.6g}"]
                     )[0]["step_us_baseline"] / 1e3
    rate = ["--mfu", f"{mfu:.6g}"]
    sim_opt = {p["optimizer_fraction"]: p["step_us"] / 1e3
               for p in replay(a, trace, preset, ["--optimizer-fraction", fr] + rate)}
    sim_w = {db: replay(a, trace, preset, rate + ["--weight-layers", str(a.blocks),
                                           "--weight-double-buffer", "on" if db else "off"])[0]
             ["step_us"] / 1e3 for db in (True, False)}
    _, plain_peak, plain_params = res["plain"]
    same = lambda ps: all(bits_equal(torch, x, y) for x, y in zip(ps, plain_params))  # noqa: E731
    if not on_gpu:
        differ = [m for m in modes if not same(res[m][2])]
        if differ:  # on the CPU both shares step with the same kernels
            raise AssertionError(f"on the CPU, parameters not bit-identical to plain: {differ}")
        if sorted(sim_opt) != sorted(schema.FRACTIONS):
            raise AssertionError(f"the replay ran fractions {sorted(sim_opt)}")
        f.no_gpu(why + "; smoke run of every mode and replay on the CPU passed")
        return
    f["optim_plain_step_ms"], f["optim_plain_peak_MiB"] = plain_ms, plain_peak
    f["optim_sim_mfu"], f["optim_sim_plain_vs_measured"] = mfu, base_ms / plain_ms
    for x in schema.FRACTIONS:
        t = schema.frac_tag(x)
        ms, peak, params = res[f"optim_f{t}"]
        f[f"optim_f{t}_step_ms"], f[f"optim_f{t}_peak_MiB"] = ms, peak
        f[f"optim_f{t}_step_vs_plain"] = ms / plain_ms
        f[f"optim_f{t}_params_bit_identical"] = same(params)
        sim = sim_opt.get(x)
        f[f"optim_f{t}_sim_step_ms"] = sim
        f[f"optim_f{t}_sim_vs_measured"] = sim / ms if sim else None
    ms, peak, _ = res["weights_none"]
    f["weights_none_step_ms"], f["weights_none_peak_MiB"] = ms, peak
    for db, name in ((True, "double_buffer"), (False, "single_buffer")):
        ms, peak, params = res[f"weights_{name}"]
        f[f"weights_{name}_step_ms"], f[f"weights_{name}_peak_MiB"] = ms, peak
        f[f"weights_{name}_params_bit_identical"] = same(params)
        f[f"weights_{name}_sim_step_ms"] = sim_w[db]
        f[f"weights_{name}_sim_vs_measured"] = sim_w[db] / ms
    f.note(f"replayed on --hw {preset} at --mfu {mfu:.4g}: the plain step's own rate")


def extra(ap):
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)


if __name__ == "__main__":
    sys.exit(main("optim", __doc__, body, extra))
