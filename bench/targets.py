#!/usr/bin/env python3
"""The benchmark targets against build/bench.json: prints a table (value,
target, pass/fail) and writes it into the JSON under "targets". A metric no
benchmark produced yet is listed as missing, never as passing.

Usage: python bench/targets.py [build/bench.json]"""
import json
import sys

# metric, comparison, target, what it is (numerator / denominator)
TARGETS = [
    ("pack_unpack_keep_ns", "<=", 150, "engine pack+unpack of a kept tensor, ns"),
    ("pinned_allocs_per_step_after_warmup", "==", 0, "backend pinned allocations per steady step"),
    ("arena_reserved_over_peak", "<=", 1.15, "arena reserved bytes / peak bytes in use"),
    ("arena_reserved_over_peak_training", "<=", 1.15, "the same after 30 GPT training steps of varying shapes"),
    ("host_copy_vs_memcpy_1MB", ">=", 0.9, "host backend 1 MiB copy throughput / same-thread memcpy"),
    ("host_copy_vs_memcpy_64MB", ">=", 0.9, "host backend 64 MiB copy throughput / same-thread memcpy"),
    ("host_copy_vs_worker_memcpy_1MB", ">=", 0.9, "host backend 1 MiB copy throughput / memcpy handed to a worker thread"),
    ("host_copy_vs_worker_memcpy_64MB", ">=", 0.9, "host backend 64 MiB copy throughput / memcpy handed to a worker thread"),
    ("decide_uncached_ns", "<=", 1000, "default.lua decision without the cache, ns"),
    ("decide_cached_ns", "<=", 50, "default.lua decision from the site cache, ns"),
    ("decide_uncached_ns_max", "<=", 1000, "slowest shipped policy, uncached, ns"),
    ("decide_cached_ns_max", "<=", 50, "slowest shipped policy, cached, ns"),
    ("policy_call_max_ms", "<=", 20, "slowest single pattern call the policy sandbox accepts, ms"),
    ("policy_overrun_max_x", "<=", 2, "slowest hostile decision / its 50 ms budget"),
    ("sim_events_per_s", ">=", 2_000_000, "trace events per second, JSONL file read and replayed"),
    ("prefetch_per_tensor_100k_vs_1k", "<=", 1.2, "per-tensor cost at 100k tensors / at 1k"),
    ("hook_keep_vs_noop_pair_torch2", "<=", 1.1, "ferry keep path per saved tensor / no-op hook pair, torch 2.x"),
    ("hook_keep_vs_noop_pair_torch1", "<=", 1.1, "the same on Debian's torch 1.13"),
    ("step_overhead_vs_torchtune", "<=", 1.0, "step overhead of ferry keeping all / torchtune's logic"),
    ("stall_vs_floor", "<=", 1.1, "budget.lua exposed stall / link-bound floor, demo trace"),
    ("snapshot_blocked_vs_sync_cpu", "<=", 0.1, "training blocked by a snapshot / a .cpu() copy of the state"),
    ("snapshot_step_slowdown", "<=", 1.10, "step time while a snapshot drains / without"),
    ("engine_snapshot_write_vs_disk", ">=", 0.8, "snapshot start-to-durable throughput / temp file, write, fsync, rename, dir fsync of the same bytes (C)"),
    ("engine_snapshot_write_vs_disk_busy", ">=", 0.8, "the same with every core busy (C)"),
    ("torch_snapshot_write_vs_disk", ">=", 0.8, "snapshot start-to-durable / the same disk baseline (Python)"),
    ("torch_snapshot_write_vs_disk_busy", ">=", 0.8, "the same with every core busy (Python)"),
    ("stress_mismatches", "==", 0, "tensors not bit-identical, 5 threads in 2 processes on one node cap"),
    ("stress_cap_exceeded_samples", "==", 0, "monitor samples with the node total over the cap"),
    ("stress_reclaimed_vs_killed_share", "==", 1, "bytes reclaimed after SIGKILL / the killed process's share"),
    ("stress_node_total_after_close", "==", 0, "node total after every survivor engine is destroyed, B"),
    ("stress_rss_drift_mib", "<=", 8, "survivor RSS growth over the second half of the run, MiB"),
    ("optimizer_offload_step_ratio", "<=", 1.3, "step with offload_optimizer(fraction=0.5) / plain, median of 31 interleaved pairs"),
]
# Measured only where a CUDA device is (make gpu-check, tests/gpu/on-device.sh):
# elsewhere listed as "no GPU", never as passing.
GPU_TARGETS = [
    ("cuda_d2h_vs_cudamemcpy_64MB", ">=", 0.95, "cuda backend 64 MiB D2H GB/s / cudaMemcpyAsync into cudaHostAlloc"),
    ("cuda_h2d_vs_cudamemcpy_64MB", ">=", 0.95, "the same, H2D"),
    ("cuda_copy_mismatches", "==", 0, "bytes differing after 64 MiB each way through the backend"),
    ("gpu_ferry_default_step_vs_save_on_cpu", "<=", 1.0, "GPT step with default.lua / with torch's save_on_cpu"),
]


def check(value, op, target):
    return {"<=": value <= target, ">=": value >= target, "==": value == target}[op]


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "build/bench.json"
    with open(path) as f:
        data = json.load(f)
    rows, table = [], {}
    for name, op, target, what in TARGETS + GPU_TARGETS:
        value = data.get(name)
        if isinstance(value, (int, float)):
            status = "pass" if check(value, op, target) else "FAIL"
            shown = f"{value:.4g}"
        else:
            status = "no GPU" if (name, op, target, what) in GPU_TARGETS else "missing"
            shown = "-"
        table[name] = {"value": value, "target": f"{op} {target:g}", "status": status,
                       "what": what}
        rows.append((name, shown, f"{op} {target:g}", status, what))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'target':{width}}  {'value':>12}  {'target':>10}  status   what")
    for name, shown, tgt, status, what in rows:
        print(f"{name:{width}}  {shown:>12}  {tgt:>10}  {status:7}  {what}")
    counts = {s: sum(1 for r in rows if r[3] == s) for s in ("pass", "FAIL", "missing", "no GPU")}
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['missing']} missing, "
          f"{counts['no GPU']} measured only on a GPU")
    data["targets"] = table
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
