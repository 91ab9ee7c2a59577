#!/usr/bin/env python3
"""bench/bench_gpu.py at a size that fits the run's bound: training steps of a
GPT-style model in bf16 with ferry's default policy against no offload and
torch's save_on_cpu. Without a GPU: its CPU smoke mode at a toy size
(nothing measured), so the script itself is exercised."""
import json
import os
import sys

from gpu_common import main, no_gpu_reason, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("gpu_none_step_ms", "gpu_save_on_cpu_step_ms", "gpu_ferry_default_step_ms",
        "gpu_ferry_default_step_vs_save_on_cpu", "gpu_ferry_default_peak_vs_none")


def body(a, f):
    why = no_gpu_reason()
    out = os.path.join(a.work, "bench_gpu.json")
    if os.path.exists(out):
        os.remove(out)
    script = os.path.join(ROOT, "bench", "bench_gpu.py")
    size = (["--device", "cpu", "--layers", "1", "--width", "64", "--batch", "1", "--seq", "32",
             "--vocab", "128", "--warmup", "0", "--steps", "1"] if why else
            ["--layers", "4", "--warmup", "1", "--steps", "3"])
    rc, _ = run([sys.executable, script, "--json", out] + size, timeout=28)
    if rc != 0:
        raise RuntimeError(f"bench_gpu.py: exit {rc}")
    if why:
        f.no_gpu(why)
        return
    with open(out) as fh:
        b = json.load(fh)
    for k in KEYS:
        f[k] = b.get(k)


if __name__ == "__main__":
    sys.exit(main("bench_gpu", __doc__, body))
