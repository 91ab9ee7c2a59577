#!/usr/bin/env python3
"""The link of the machine: ferry_bench --only cuda_copy (the cuda backend's
copies against cudaMemcpyAsync, bench/bench_cuda_copy.c) beside the figures of
the `--hw` preset for this GPU (docs/hardware.md; h100 or h200 by the GPU's
name; `ferry sim` prints the preset's link)."""
import json
import os
import subprocess
import sys

from gpu_common import main, no_gpu_reason, run


def preset_for(name):
    n = (name or "").upper()
    for p in ("GH200", "H200", "H100", "A100"):
        if p in n:
            return p.lower()
    return None


def preset_link(build, work, preset):
    """(d2h, h2d) GB/s of the preset, as `ferry sim --json` reports them."""
    trace = os.path.join(work, "link-probe.jsonl")
    subprocess.run([os.path.join(build, "bin", "ferry"), "trace", "synth", "--preset", "tiny",
                    "-o", trace], check=True, timeout=30, stdout=subprocess.DEVNULL)
    out = os.path.join(work, "link-probe.json")
    subprocess.run([os.path.join(build, "bin", "ferry"), "sim", "--policy", "default", "--trace",
                    trace, "--hw", preset, "--json", out, "--no-layers"], check=True, timeout=30,
                   stdout=subprocess.DEVNULL)
    with open(out) as fh:
        link = json.load(fh)["link"]
    return link["d2h_bytes_per_s"] / 1e9, link["h2d_bytes_per_s"] / 1e9


def body(a, f):
    why = no_gpu_reason()
    if why:
        d2h, h2d = preset_link(a.build, a.work, "h100")  # the preset's side runs all the same
        f.no_gpu(f"{why}; the h100 preset reads {d2h:.1f}/{h2d:.1f} GB/s D2H/H2D")
        return
    import torch

    preset = preset_for(torch.cuda.get_device_name(0))
    f["link_preset"] = preset
    bench = os.path.join(a.work, "cuda_copy.json")
    if os.path.exists(bench):
        os.remove(bench)
    rc, _ = run([os.path.join(a.build, "bin", "ferry_bench"), "--only", "cuda_copy", "--json", bench],
                timeout=20)
    if rc != 0:
        raise RuntimeError(f"ferry_bench --only cuda_copy: {rc}")
    with open(bench) as fh:
        b = json.load(fh)
    for d in ("d2h", "h2d"):
        f[f"link_{d}_GBps_64MB"] = b.get(f"cuda_{d}_GBps_64MB")
        f[f"link_{d}_GBps_1MB"] = b.get(f"cuda_{d}_GBps_1MB")
        f[f"link_{d}_vs_cudamemcpy"] = b.get(f"cuda_{d}_vs_cudamemcpy_64MB")
    f["link_duplex_share"] = b.get("cuda_duplex_share")
    f["link_latency_us"] = b.get("cuda_copy_latency_us")
    f["link_copy_mismatches"] = b.get("cuda_copy_mismatches")
    if preset:
        d2h, h2d = preset_link(a.build, a.work, preset)
        f["preset_d2h_GBps"], f["preset_h2d_GBps"] = d2h, h2d
        if f.figures["link_d2h_GBps_64MB"]:
            f["link_d2h_vs_preset"] = f.figures["link_d2h_GBps_64MB"] / d2h
            f["link_h2d_vs_preset"] = f.figures["link_h2d_GBps_64MB"] / h2d
    else:
        f.note("no --hw preset for this GPU: the preset's figures stay null")


if __name__ == "__main__":
    sys.exit(main("link", __doc__, body))
