#!/usr/bin/env python3
"""Stream ordering under a sanitizer: compute-sanitizer's racecheck and memcheck
on the engine's stream and ordering tests over the real runtime
(ferry_tests_gpu, a subset: the whole suite does not fit the run's bound
under the sanitizer) and on a training step through ferry.torch
(gpu_train_step.py), then that step's stress alone: device memory reused
while copies are in flight, gradients compared bit for bit.

Figures: {racecheck,memcheck}_{suite,train}_errors (the tool's error count),
_status ("ok", "errors", "timeout", "unsupported": the runtime refused the
tool, or "failed"); stress_reuse_rounds and stress_reuse_mismatches.
The step fails on any error or mismatch; a sanitizer run that times out or
is refused is reported, not failed.
Without a GPU: the stress runs a few rounds on the CPU (host backend;
nothing reported)."""
import os
import re
import shutil
import subprocess
import sys

from gpu_common import main, no_gpu_reason, run

HERE = os.path.dirname(os.path.abspath(__file__))
# the suite's tests of copies, streams, events and their order
SUITE_PATTERN = re.compile(r"order|stream|reload|prefetch|resident|snapshot_staging|cuda_backend|"
                           r"round_trip|wait")
# each under its own bound, inside the step's 55 s (on-device.sh): 2 x (8 + 12) + 8
BOUNDS = {"suite": 8, "train": 12}


def sanitizer():
    for p in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
              "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if p and os.path.exists(p):
            return p
    return None


def suite_tests(build):
    out = subprocess.run([os.path.join(build, "bin", "ferry_tests_gpu"), "--list"],
                         stdout=subprocess.PIPE, text=True, timeout=10, check=True).stdout.split()
    return [t for t in out if SUITE_PATTERN.search(t) and not t.startswith(("sim_", "host_"))][:40]


def judge(rc, out):
    """(errors, status) of one compute-sanitizer run."""
    if rc == "timeout":
        return None, "timeout"
    if re.search(r"Device not supported|Unable to find injection|not supported on this", out):
        return None, "unsupported"
    m = re.search(r"ERROR SUMMARY: (\d+) error", out) or \
        re.search(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", out)
    if not m:
        return None, "failed"
    errors = int(m.group(1))
    if errors:
        return errors, "errors"
    return 0, "ok" if rc == 0 else "failed"


def body(a, f):
    why = no_gpu_reason()
    train = [sys.executable, os.path.join(HERE, "gpu_train_step.py")]
    if why:
        rc, _ = run(train + ["--device", "cpu", "--rounds", "3", "--rows", "64", "--width", "64"],
                    timeout=30)
        if rc != 0:
            raise RuntimeError(f"gpu_train_step.py on the CPU: {rc}")
        f.no_gpu(why + "; the stress passed 3 rounds on the CPU")
        return
    cs = sanitizer()
    env = dict(os.environ, FERRY_TEST_BACKEND="cuda", FERRY_TEST_STEPS="50")
    bad = []
    for tool in ("racecheck", "memcheck"):
        for what in ("suite", "train"):
            if not cs:
                f[f"{tool}_{what}_status"] = "unsupported"
                continue
            target = ([os.path.join(a.build, "bin", "ferry_tests_gpu")] + suite_tests(a.build)
                      if what == "suite" else train + ["--rounds", "2", "--rows", "256",
                                                       "--width", "256"])
            rc, out = run([cs, "--tool", tool, "--print-limit", "20"] + target,
                          timeout=BOUNDS[what], env=env)
            errors, status = judge(rc, out)
            f[f"{tool}_{what}_errors"], f[f"{tool}_{what}_status"] = errors, status
            if status in ("errors", "failed"):
                bad.append(f"{tool} {what}: {status}")
    if not cs:
        f.note("compute-sanitizer not found: the sanitizer runs are reported unsupported")
    rounds = 20
    rc, out = run(train + ["--rounds", str(rounds)], timeout=8)
    m = re.search(r"stress: (\d+) rounds, (\d+) mismatches", out)
    f["stress_reuse_rounds"] = int(m.group(1)) if m else None
    f["stress_reuse_mismatches"] = int(m.group(2)) if m else None
    if rc != 0:
        bad.append(f"stress: {rc}")
    if bad:
        f.status, f.reason = "failed", "; ".join(bad)


if __name__ == "__main__":
    sys.exit(main("sanitizer", __doc__, body))
