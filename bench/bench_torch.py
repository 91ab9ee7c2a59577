#!/usr/bin/env python3
"""Per-saved-tensor cost of ferry's PyTorch hooks (docs/hardware.md micro-benchmark).

2000 chained multiplies of a 16-element tensor, y = y * w, forward and
backward: 4000 saved tensors per run (each multiply saves y and w). Modes,
interleaved in one process, median of --reps runs each:
  none        no hooks (the reference)
  noop        a pair of no-op Python saved_tensors_hooks
  save_on_cpu torch.autograd.graph.save_on_cpu()
  ferry_keep  ferry.torch.offload with default.lua (64-byte tensors: kept)
  ferry_offload  ferry.torch.offload with a policy offloading every tensor
                 (min_offload_bytes = 1), host backend
Per-tensor overhead = (median(mode) - median(none)) / saved tensors.
Metrics (merged into the flat JSON object of --json):
  torch_hook_overhead_ratio          ferry_keep / noop      (target <= 0.5)
  torch_save_on_cpu_overhead_ratio   save_on_cpu / noop
  torch_ferry_offload_overhead_ratio ferry_offload / noop
  torch_<mode>_overhead_us           per saved tensor, microseconds
  torch_hook_call_ns_{ferry_keep,noop}  the pack+unpack pair alone, called
                                     directly (min of 5; robust to load)
Usage: python bench/bench_torch.py [--json build/bench.json] [--reps 15]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHAIN = 2000


def import_ferry(json_path):
    try:
        import ferry  # noqa: F401
    except ImportError:
        for d in ([os.path.join(os.path.dirname(os.path.abspath(json_path)), "python")] if json_path else []) + \
                 [os.path.join(HERE, "..", "build", "python")]:
            if os.path.isdir(os.path.join(d, "ferry")):
                sys.path.insert(0, d)
                break
    import ferry
    import ferry.torch
    return ferry


OFFLOAD_ALL = """
return { api = 1, name = "offload-all", knobs = { min_offload_bytes = 1, max_fwd_stash = 64 },
  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch

    torch.set_num_threads(1)
    ft = ferry.torch

    def chain():
        x = torch.randn(16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)
        y = x
        for _ in range(CHAIN):
            y = y * w
        y.sum().backward()

    saved_per_run = 2 * CHAIN

    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(OFFLOAD_ALL)
        offload_all = f.name

    def noop():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    import contextlib

    modes = {
        "none": contextlib.nullcontext,
        "noop": noop,
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "ferry_keep": lambda: ft.offload(None, policy="default", backend="host"),
        # its own engine (another knob value), so no policy swap per run
        "ferry_offload": lambda: ft.offload(None, policy=offload_all, backend="host", max_fwd_stash=64),
    }
    times = {m: [] for m in modes}
    for m, ctx in modes.items():  # warm-up: engines, caches, allocator
        with ctx():
            chain()
    import gc

    for _ in range(args.reps):
        for m, ctx in modes.items():
            gc.collect()
            gc.disable()  # a collection inside one run would swamp microseconds
            t0 = time.perf_counter()
            with ctx():
                chain()
            times[m].append(time.perf_counter() - t0)
            gc.enable()
    # The hooks alone, called directly (min of 5 x 100k calls: robust to a
    # loaded machine): what ferry itself adds per saved tensor, next to the
    # Python no-op pair. Half leaf (w), half non-leaf (y) tensors, as above.
    import timeit

    keep_ctx = modes["ferry_keep"]()
    keep_ctx.__enter__()
    pack, unpack = keep_ctx.engine.hooks()
    w = torch.randn(16, requires_grad=True)
    y = w * 1.5
    noop_pack = noop_unpack = lambda t: t
    env = dict(pack=pack, unpack=unpack, noop_pack=noop_pack, noop_unpack=noop_unpack, w=w, y=y)

    def call_ns(stmt):
        return min(timeit.repeat(stmt, globals=env, number=100000, repeat=5)) / 100000 * 1e9

    hook_ns = {
        "ferry_keep": (call_ns("unpack(pack(w))") + call_ns("unpack(pack(y))")) / 2,
        "noop": (call_ns("noop_unpack(noop_pack(w))") + call_ns("noop_unpack(noop_pack(y))")) / 2,
    }
    keep_ctx.__exit__(None, None, None)
    ft.step()
    with modes["ferry_offload"]():
        pass
    ft.step()
    stats = ft.stats()  # the offload engine's, for the report line
    ft.close()
    os.unlink(offload_all)

    med = {m: statistics.median(v) for m, v in times.items()}
    per = {m: (med[m] - med["none"]) / saved_per_run * 1e6 for m in modes if m != "none"}
    noop_us = per["noop"]
    out = {f"torch_{m}_overhead_us": round(v, 4) for m, v in per.items()}
    out["torch_hook_overhead_ratio"] = round(per["ferry_keep"] / noop_us, 4)
    out["torch_save_on_cpu_overhead_ratio"] = round(per["save_on_cpu"] / noop_us, 4)
    out["torch_ferry_offload_overhead_ratio"] = round(per["ferry_offload"] / noop_us, 4)
    out["torch_chain_none_ms"] = round(med["none"] * 1e3, 3)
    out["torch_hook_call_ns_ferry_keep"] = round(hook_ns["ferry_keep"], 1)
    out["torch_hook_call_ns_noop"] = round(hook_ns["noop"], 1)

    print(f"torch {torch.__version__}, {CHAIN} chained multiplies, {saved_per_run} saved tensors/run, "
          f"median of {args.reps}")
    print(f"  no hooks: {med['none'] * 1e3:.2f} ms/run")
    for m in per:
        print(f"  {m:14s} {per[m]:7.3f} us per saved tensor  ({per[m] / noop_us:5.2f} x no-op Python hooks)")
    print(f"  hooks alone (pack+unpack called directly): ferry keep {hook_ns['ferry_keep']:.0f} ns, "
          f"Python no-op pair {hook_ns['noop']:.0f} ns")
    print(f"  ferry_offload moved {stats['bytes_d2h']} bytes D2H, {stats['bytes_h2d']} H2D "
          f"({stats['tensors_offloaded']} tensors, {stats['tensors_aliased']} aliased)")
    print(json.dumps(out, indent=1))
    if args.json:
        data = {}
        if os.path.exists(args.json):
            with open(args.json) as f:
                text = f.read().strip()
            data = json.loads(text) if text else {}
        data.update(out)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
