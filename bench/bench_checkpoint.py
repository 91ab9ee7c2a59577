#!/usr/bin/env python3
"""Checkpoint staging from PyTorch: how long a training loop is blocked by
ferry.torch.snapshot against a synchronous copy of the same state, and how
much slower its steps run while a snapshot drains, in one run.

An MLP (4 x Linear(2048, 2048) by default: 64 MiB of parameters, 192 MiB
with AdamW's two moments) trains on the CPU (one torch thread). Each round
(--reps, default 9): one untimed step, --plain-steps steps with no snapshot
in flight, a snapshot of {model state_dict, optimizer state_dict} taken
right after an optimizer step followed by the steps that overlap its drain
(the snapshot is still in flight, staging copies or writer, when the step
starts; the first one's optimizer pre-hook fences), --plain-steps more
plain steps (A-B-A). Then, in the same round: the synchronous-copy
baseline, a clone, torch.save, and a snapshot alone from start to durable
file.

Definitions (the same as bench/bench_snapshot.c's; bench/README.md,
"Checkpoint benchmarks"):
  blocked         the snapshot() call (torch's pickler, the policy, the
                  engine's start) + the fence (in the next optimizer step's
                  pre-hook), timed on the training thread
  sync copy       copy_() of every tensor of the same state into host
                  tensors allocated once and reused (warm): the cheapest
                  synchronous copy, what a `.cpu()` into reused buffers costs
  step            forward, backward, optimizer step (its pre-hook included)

Metrics (merged into the flat JSON object of --json):
  snapshot_blocked_vs_sync_cpu     median blocked / median sync copy
                                   (target <= 0.1)
  snapshot_step_slowdown           per round: median step overlapping the
                                   drain / median plain step of the same
                                   round; the median over rounds (target
                                   <= 1.10)
  torch_snapshot_blocked_ms        median blocked; _call_ms and _fence_ms its
                                   two parts (medians of each)
  torch_sync_cpu_copy_ms           median sync copy
  torch_sync_cpu_clone_ms          median clone() of every tensor into fresh
                                   memory (AsyncCheckpointIO's way on the CPU;
                                   information, not the baseline)
  torch_snapshot_blocked_vs_clone  median blocked / median clone
  torch_plain_step_ms, torch_overlapped_step_ms, torch_first_overlapped_step_ms
                                   pooled medians; _steps the counts
  torch_snapshot_first_step_slowdown  the step right after snapshot() (staging
                                   copies run under it) / plain, pooled
  torch_snapshot_step_slowdown_max the worst round's ratio
  torch_snapshot_drain_steps_max   most steps one snapshot overlapped
                                   (capped at --max-overlap-steps)
  torch_snapshot_step_time_lost_ms per snapshot, sum over its overlapped
                                   steps of (step - plain step of the round);
                                   median over rounds
  torch_save_blocked_ms            median torch.save of the same state to the
                                   same disk (what TorchCheckpointIO blocks)
  torch_snapshot_GBps              state bytes / (snapshot() to durable file,
                                   fsync and rename included, no training)
  torch_snapshot_memcpy_GBps       state bytes / sync copy time
  torch_snapshot_disk_write_GBps   the same bytes written as a snapshot writes
                                   them: a new temporary file, write, fsync,
                                   rename over the target, directory fsync;
                                   in every round right after the snapshot
  torch_snapshot_write_vs_disk     disk baseline time / snapshot start to
                                   durable (target >= 0.8); _busy: both with
                                   one spinning process per CPU (target >= 0.8),
                                   torch_snapshot_busy_write_ms/_disk_ms the
                                   medians

Honest about the CPU: on the host backend "device" memory is host memory;
the engine's copies are memcpys on its worker thread, which share the two
cores with the training step and the writer thread, and the fence waits on
the host for copies not done yet. On a GPU the fence is a stream wait.

Usage: python bench/bench_checkpoint.py [--json build/bench.json] [--reps 9]
       [--plain-steps 2] [--max-overlap-steps 40] [--layers 4] [--width 2048]
       [--batch 32] [--dir DIR]
"""
import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from bench_common import import_ferry, merge_json  # noqa: E402


def tensors_of(x, out):
    import torch

    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, dict):
        for v in x.values():
            tensors_of(v, out)
    elif isinstance(x, (list, tuple)):
        for v in x:
            tensors_of(v, out)
    return out


def disk_baseline_s(path, payload, nbytes):
    """What the disk does without ferry, the way a snapshot does it: a new
    temporary file beside path, the bytes, fsync, rename, directory fsync."""
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".")
    with os.fdopen(fd, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(payload[:min(left, len(payload))])
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)
    d = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)
    return time.perf_counter() - t0


def _spin():
    while True:
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=9, help="rounds (each: plain steps, a snapshot "
                    "and the steps overlapping it, plain steps, the baselines)")
    ap.add_argument("--plain-steps", type=int, default=2,
                    help="steps without a snapshot before, and as many after, the snapshot's")
    ap.add_argument("--max-overlap-steps", type=int, default=40,
                    help="steps per snapshot at most; then it is waited for")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dir", help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()  # with a snapshot not yet fenced, its pre-hook fences first
        opt.zero_grad(set_to_none=True)

    def state():
        return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "global_step": 0}

    def timed_step():
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    step()  # AdamW state exists from here
    tensors = tensors_of(state(), [])
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # the sync-copy baseline's destination: allocated once, written once
    # (warm), reused every round: the cheapest synchronous copy there is
    warm_dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(warm_dst, tensors):
        d.copy_(t)
    workdir = args.dir or tempfile.mkdtemp(prefix="ferry-bench-ckpt-")
    path = os.path.join(workdir, "ckpt.pt")
    ferry.torch.snapshot(state(), path, optimizer=opt).wait()  # engine and arena warm

    # the disk baseline's bytes (random: nothing on the way can shortcut them)
    payload = os.urandom(min(nbytes, 64 << 20))
    disk = []
    plain, overlapped, first_overlapped, blocked, call_ms, fence_ms = [], [], [], [], [], []
    sync_ms, clone_ms, save_ms, total_s, drain_steps, ratios, lost_ms = [], [], [], [], [], [], []

    def plain_phase():
        for _ in range(args.plain_steps):
            plain.append(timed_step())  # no snapshot in flight: the last one was waited for

    def snapshot_phase():
        obj = state()  # the state dicts, built before the timer as for the baseline
        t0 = time.perf_counter()
        h = ferry.torch.snapshot(obj, path, optimizer=opt)
        call_ms.append((time.perf_counter() - t0) * 1e3)
        del obj
        n = 0
        # a step overlaps the drain when the snapshot (its staging copies or
        # its writer) is still in flight as the step starts
        while n < args.max_overlap_steps and (n == 0 or not h.done()):
            ms = timed_step()  # the first one's optimizer pre-hook fences
            (first_overlapped if n == 0 else overlapped).append(ms)
            n += 1
        h.wait()
        drain_steps.append(n)
        fence_ms.append(h.stats.get("fence_ms", 0.0))
        blocked.append(call_ms[-1] + fence_ms[-1])

    med = statistics.median
    for rep in range(args.reps):
        # plain steps before and after the snapshot's steps (A-B-A: a load
        # from outside this process that drifts over the round hits both
        # sides alike); the slowdown is taken per round, then the median
        # over rounds. One untimed step first: the baselines of the round
        # before (copies, clone, torch.save) must not slow a timed step.
        step()
        n_plain, n_first, n_over = len(plain), len(first_overlapped), len(overlapped)
        plain_phase()
        snapshot_phase()
        plain_phase()
        this = first_overlapped[n_first:] + overlapped[n_over:]
        ratios.append(med(this) / med(plain[n_plain:]))
        lost_ms.append(sum(this) - len(this) * med(plain[n_plain:]))

        cur = tensors_of(state(), [])
        t0 = time.perf_counter()
        for d, t in zip(warm_dst, cur):
            d.copy_(t)
        sync_ms.append((time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        copies = [t.clone() for t in cur]
        clone_ms.append((time.perf_counter() - t0) * 1e3)
        del copies, cur

        obj = state()
        t0 = time.perf_counter()
        torch.save(obj, path + ".torch")
        save_ms.append((time.perf_counter() - t0) * 1e3)
        os.sync()  # its dirty pages are not left for the next round to write back

        t0 = time.perf_counter()
        ferry.torch.snapshot(obj, path, optimizer=opt).wait()
        del obj
        total_s.append(time.perf_counter() - t0)
        # the baseline right after, in the same conditions (it ran three
        # times after all rounds before: the load of a shared machine drifts)
        disk.append(disk_baseline_s(path + ".raw", payload, nbytes))

    # start-to-durable and the baseline again with every core busy (as
    # DataLoader workers keep them): one spinning process per CPU
    busy_total, busy_disk = [], []
    spinners = [multiprocessing.Process(target=_spin, daemon=True)
                for _ in range(os.cpu_count() or 1)]
    for p in spinners:
        p.start()
    try:
        for _ in range(3):
            obj = state()
            t0 = time.perf_counter()
            ferry.torch.snapshot(obj, path, optimizer=opt).wait()
            busy_total.append(time.perf_counter() - t0)
            del obj
            busy_disk.append(disk_baseline_s(path + ".raw", payload, nbytes))
    finally:
        for p in spinners:
            p.terminate()
            p.join()
    for p in (path, path + ".torch", path + ".raw"):
        if os.path.exists(p):
            os.remove(p)

    during = first_overlapped + overlapped  # every step that overlapped a drain
    out = {
        "torch_snapshot_state_MiB": round(nbytes / 2**20, 1),
        "torch_snapshot_blocked_ms": round(med(blocked), 3),
        "torch_snapshot_call_ms": round(med(call_ms), 3),
        "torch_snapshot_fence_ms": round(med(fence_ms), 3),
        "torch_sync_cpu_copy_ms": round(med(sync_ms), 3),
        "torch_sync_cpu_clone_ms": round(med(clone_ms), 3),
        "snapshot_blocked_vs_sync_cpu": round(med(blocked) / med(sync_ms), 4),
        "torch_snapshot_blocked_vs_clone": round(med(blocked) / med(clone_ms), 4),
        "torch_plain_step_ms": round(med(plain), 3),
        "torch_overlapped_step_ms": round(med(during), 3),
        "torch_first_overlapped_step_ms": round(med(first_overlapped), 3),
        "torch_overlapped_steps": len(during),
        "torch_plain_steps": len(plain),
        "snapshot_step_slowdown": round(med(ratios), 4),
        "torch_snapshot_step_slowdown_max": round(max(ratios), 4),
        "torch_snapshot_drain_steps_max": max(drain_steps),
        "torch_snapshot_step_time_lost_ms": round(med(lost_ms), 3),
        "torch_snapshot_first_step_slowdown": round(med(first_overlapped) / med(plain), 4),
        "torch_save_blocked_ms": round(med(save_ms), 3),
        "torch_snapshot_GBps": round(nbytes / med(total_s) / 1e9, 3),
        "torch_snapshot_memcpy_GBps": round(nbytes / (med(sync_ms) / 1e3) / 1e9, 3),
        "torch_snapshot_disk_write_GBps": round(nbytes / med(disk) / 1e9, 3),
        "torch_snapshot_write_vs_disk": round(med(disk) / med(total_s), 4),
        "torch_snapshot_busy_write_ms": round(med(busy_total) * 1e3, 1),
        "torch_snapshot_busy_disk_ms": round(med(busy_disk) * 1e3, 1),
        "torch_snapshot_write_vs_disk_busy": round(med(busy_disk) / med(busy_total), 4),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
