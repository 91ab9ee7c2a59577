#!/usr/bin/env python3
"""The simulator against a real GPU run (docs/sim-validation.md, "Validated
against a real GPU run"): recorded_h200/ holds the trace that
bench/bench_gpu.py recorded on an NVIDIA H200 and the figures it measured
in the same run (measured.json). `ferry sim --hw h200` replays the trace
with default.lua and layers.lua, compute at the run's own rate (the --mfu
that reproduces the measured no-offload step: an input, calibrated once
from the no-offload step, never per policy), and must reproduce:

  - each policy's step time within 5% of the measured one,
  - the bytes sent to the host per step within 0.5%,
  - the memory each policy saves (no-offload peak minus its peak) within
    0.05 GiB of the measured saving,
  - with --untracked off, a peak gap (measured minus simulated) that is
    the same for every run within 0.05 GiB: the device memory a trace does
    not hold (the loss's transients) does not depend on the policy;
  - with --untracked auto (the default: the trace's device_peak, the run's
    own peak, less its recorded decisions replayed), every run's absolute
    peak within 0.05 GiB of the measured one.

Usage: test_recorded_gpu_run.py FERRY_BINARY"""
import json
import os
import subprocess
import sys
import tempfile

FERRY = sys.argv[1]
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "recorded_h200")
POLICIES = os.path.join(HERE, "..", "..", "policies")
GIB = 1 << 30
DEFAULT_MFU = 0.40


def sim(mfu, out, untracked="auto"):
    subprocess.run([FERRY, "sim", "--trace", os.path.join(DATA, "trace.jsonl"), "--policy",
                    os.path.join(POLICIES, "default.lua") + "," + os.path.join(POLICIES, "layers.lua"),
                    "--hw", "h200", "--steps", "2", "--warmup", "1", "--mfu", f"{mfu:.6f}",
                    "--untracked", untracked, "--json", out], check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        d = json.load(f)
    runs = {"none": d["baseline"]}
    runs.update({p["name"]: p for p in d["policies"]})
    return runs


def main():
    with open(os.path.join(DATA, "measured.json")) as f:
        m = json.load(f)["metrics"]
    failures = []

    def check(ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sim.json")
        # Compute scales with the rate: one replay at the default gives the
        # no-offload step, and the rate that makes it the measured one.
        first = sim(DEFAULT_MFU, out)
        mfu = DEFAULT_MFU * first["none"]["step_us"] / 1e3 / m["gpu_none_step_ms"]
        runs = sim(mfu, out, "off")
        learned = sim(mfu, out)
    print(f"compute at --mfu {mfu:.3f} (the measured no-offload step {m['gpu_none_step_ms']:.1f} ms)")
    none_ms = runs["none"]["step_us"] / 1e3
    check(abs(none_ms / m["gpu_none_step_ms"] - 1) < 0.02,
          f"no offload: simulated {none_ms:.1f} ms, measured {m['gpu_none_step_ms']:.1f} ms")
    gaps = {"none": m["gpu_none_peak_GiB"] - runs["none"]["peak_device_bytes"] / GIB}
    for name in ("default", "layers"):
        r = runs[name]
        ms, meas = r["step_us"] / 1e3, m[f"gpu_ferry_{name}_step_ms"]
        check(abs(ms / meas - 1) < 0.05,
              f"{name}: step simulated {ms:.1f} ms, measured {meas:.1f} ms ({ms / meas - 1:+.1%})")
        sent = r["bytes_d2h"] / GIB  # per steady step, as the table prints
        meas_sent = m[f"gpu_ferry_{name}_to_host_GiB_per_step"]
        check(abs(sent / meas_sent - 1) < 0.005,
              f"{name}: sent to host {sent:.3f} GiB/step simulated, {meas_sent:.3f} measured")
        saved = (runs["none"]["peak_device_bytes"] - r["peak_device_bytes"]) / GIB
        meas_saved = m["gpu_none_peak_GiB"] - m[f"gpu_ferry_{name}_peak_GiB"]
        check(abs(saved - meas_saved) < 0.05,
              f"{name}: memory saved {saved:.2f} GiB simulated, {meas_saved:.2f} GiB measured")
        gaps[name] = m[f"gpu_ferry_{name}_peak_GiB"] - r["peak_device_bytes"] / GIB
    spread = max(gaps.values()) - min(gaps.values())
    check(spread < 0.05, "--untracked off: peak gap (measured - simulated) the same in every "
          "run: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in gaps.items()))
    u = learned["none"]["untracked_bytes"] / GIB
    check(u > 1, f"--untracked auto: {u:.2f} GiB learned from the trace's device_peak")
    for name, key in (("none", "gpu_none_peak_GiB"), ("default", "gpu_ferry_default_peak_GiB"),
                      ("layers", "gpu_ferry_layers_peak_GiB")):
        pk = learned[name]["peak_device_bytes"] / GIB
        check(abs(pk - m[key]) < 0.05,
              f"--untracked auto: {name} peak simulated {pk:.2f} GiB, measured {m[key]:.2f} GiB")
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
