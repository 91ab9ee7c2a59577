#!/usr/bin/env python3
"""Cost of optimizer-state offload (ferry.torch.offload_optimizer,
docs/optimizer-offload.md) on a CPU-only machine: the "device" share and the
host share both step on the CPU, so this measures the wrapper's own cost
(gradient and parameter copies to and from the host share, the worker
thread), not a PCIe link.

Model: a GPT-sized MLP stack (--blocks blocks of Linear(d, 4d), GELU,
Linear(4d, d), LayerNorm; d = --dim), AdamW (foreach=False on both sides),
batch 16 x d. Two modes, each timing whole training steps (zero_grad,
forward, backward, step):
  plain    the plain optimizer
  offload  offload_optimizer(opt, fraction=0.5, overlap=True)
They are interleaved in pairs, the order alternating (plain-offload, then
offload-plain: neither always runs on a cache the other warmed), --reps
pairs after 3 warm-up pairs. The ratio is the median of the pairs' ratios:
the two steps of a pair run a few milliseconds apart, so a change of the
machine's load during the run (another process, frequency) moves both and
cancels, where a ratio of two medians taken over the whole run takes it in.
The spread of the pairs' ratios (their 25th and 75th percentiles) is
reported beside it: a wide one says the machine was too busy to trust the
figure.
Metrics (merged into the flat JSON object of --json):
  optimizer_offload_step_ratio   median over pairs of offload / plain
  optimizer_offload_step_ratio_p25, _p75   the spread of the pairs' ratios
  optimizer_offload_step_ratio_method   how the ratio was taken (a string)
  optimizer_offload_step_pairs   how many pairs it is the median of
  optimizer_offload_step_ratio_of_medians   median(offload) / median(plain),
      the figure before pairing, beside it as a check on the pairing
  optimizer_offload_step_ms_{plain,offload}   medians of each mode's steps
  optimizer_offload_host_fraction   bytes in the host share / all parameter bytes
Usage: python bench/bench_optim.py [--json build/bench.json] [--reps 31]
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
    ap.add_argument("--reps", type=int, default=31)
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

    warmup = 3
    times = {m: [] for m in runs}
    ratios = []
    for i in range(args.reps + warmup):
        order = ("plain", "offload") if i % 2 == 0 else ("offload", "plain")
        t = {m: step(m) for m in order}
        if i >= warmup:
            for m in runs:
                times[m].append(t[m])
            ratios.append(t["offload"] / t["plain"])
    med = {m: statistics.median(v) for m, v in times.items()}
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    off = runs["offload"][1].ferry_offload
    n_params = sum(p.numel() for p in runs["plain"][0].parameters())
    out = {
        "optimizer_offload_step_ratio": round(statistics.median(ratios), 4),
        "optimizer_offload_step_ratio_p25": round(q[0], 4),
        "optimizer_offload_step_ratio_p75": round(q[2], 4),
        # how the ratio was taken, and the other way beside it: a paired
        # median far below the ratio of medians would flatter the offload
        "optimizer_offload_step_ratio_method": "median of per-pair offload/plain ratios, "
                                               "pairs in alternating order",
        "optimizer_offload_step_pairs": len(ratios),
        "optimizer_offload_step_ratio_of_medians": round(med["offload"] / med["plain"], 4),
        "optimizer_offload_step_ms_plain": round(med["plain"] * 1e3, 3),
        "optimizer_offload_step_ms_offload": round(med["offload"] * 1e3, 3),
        "optimizer_offload_host_fraction": round(off.host_bytes / off.total_bytes, 4),
    }
    print(f"  {n_params / 1e6:.1f} M parameters, AdamW, host share "
          f"{out['optimizer_offload_host_fraction']:.2f} of the bytes, torch {torch.__version__}")
    print(f"  step: plain {out['optimizer_offload_step_ms_plain']:.1f} ms, offload "
          f"{out['optimizer_offload_step_ms_offload']:.1f} ms (medians of {args.reps}); "
          f"offload / plain {out['optimizer_offload_step_ratio']:.3f} (median of {args.reps} "
          f"pairs, spread {q[0]:.3f} .. {q[2]:.3f})")
    print(json.dumps(out, indent=1))
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
