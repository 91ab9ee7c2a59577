#!/usr/bin/env python3
"""Cost of optimizer-state offload (ferry.torch.offload_optimizer,
docs/optimizer-offload.md) on a CPU-only machine: the "device" share and the
host share both step on the CPU, so this measures the wrapper's own cost
(gradient and parameter copies to and from the host share, the worker
thread), not a PCIe link.

Model: a GPT-sized MLP stack (--blocks blocks of Linear(d, 4d), GELU,
Linear(4d, d), LayerNorm; d = --dim), AdamW (foreach=False on both sides),
batch 16 x d. Two modes, interleaved in one process, each timing whole
training steps (zero_grad, forward, backward, step), median of --reps steps
after 2 warm-up steps:
  plain    the plain optimizer
  offload  offload_optimizer(opt, fraction=0.5, overlap=True)
Metrics (merged into the flat JSON object of --json):
  optimizer_offload_step_ratio   median(offload) / median(plain)
  optimizer_offload_step_ms_{plain,offload}
  optimizer_offload_host_fraction   bytes in the host share / all parameter bytes
Usage: python bench/bench_optim.py [--json build/bench.json] [--reps 9]
"""
import argparse
import json
import statistics
import time
from bench_common import import_ferry, merge_json  # noqa: E402


def make(torch, dim, blocks, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim),
                   torch.nn.LayerNorm(dim)]
    return torch.nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch

    runs = {}
    for mode in ("plain", "offload"):
        model = make(torch, args.dim, args.blocks)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        if mode == "offload":
            opt = ferry.torch.offload_optimizer(opt, fraction=0.5, overlap=True)
        runs[mode] = (model, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, args.dim, generator=g)
    y = torch.randn(16, args.dim, generator=g)

    def step(mode):
        model, opt = runs[mode]
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    times = {m: [] for m in runs}
    for i in range(args.reps + 2):
        for m in runs:
            t = step(m)
            if i >= 2:
                times[m].append(t)
    med = {m: statistics.median(v) for m, v in times.items()}
    off = runs["offload"][1].ferry_offload
    n_params = sum(p.numel() for p in runs["plain"][0].parameters())
    out = {
        "optimizer_offload_step_ratio": round(med["offload"] / med["plain"], 4),
        "optimizer_offload_step_ms_plain": round(med["plain"] * 1e3, 3),
        "optimizer_offload_step_ms_offload": round(med["offload"] * 1e3, 3),
        "optimizer_offload_host_fraction": round(off.host_bytes / off.total_bytes, 4),
    }
    print(f"  {n_params / 1e6:.1f} M parameters, AdamW, host share "
          f"{out['optimizer_offload_host_fraction']:.2f} of the bytes, torch {torch.__version__}")
    print(f"  step: plain {out['optimizer_offload_step_ms_plain']:.1f} ms, offload "
          f"{out['optimizer_offload_step_ms_offload']:.1f} ms (median of {args.reps})")
    print(json.dumps(out, indent=1))
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
