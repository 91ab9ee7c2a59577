#!/usr/bin/env python3
"""Checkpoint staging from PyTorch: how long a training loop is blocked by
ferry.torch.snapshot against a synchronous copy of the same state, in one run.

An MLP (4 x Linear(2048, 2048) by default: 64 MiB of parameters, 192 MiB
with AdamW's two moments) trains on the CPU. Each round takes a checkpoint
of {model state_dict, optimizer state_dict} right after an optimizer step,
then runs the next forward/backward and optimizer step (whose pre-hook
fences); separately it times a snapshot alone from start to durable file.

Metrics (merged into the flat JSON object of --json; the C benchmark's
snapshot_* figures come from bench/bench_snapshot.c, these are torch_*):
  torch_snapshot_state_MiB         the checkpoint's tensor bytes
  snapshot_blocked_ms              median time the loop is blocked per
                                   snapshot: the snapshot() call (pickle,
                                   policy, start) plus the fence in the next
                                   optimizer step's pre-hook
  torch_snapshot_call_ms           the snapshot() call alone
  torch_snapshot_fence_ms          the fence alone
  torch_sync_cpu_copy_ms           median synchronous copy of the same
                                   tensors into fresh host memory (what
                                   `.cpu()` of every tensor costs on a GPU,
                                   and AsyncCheckpointIO's clone on the CPU)
  snapshot_blocked_vs_sync_cpu     blocked / sync copy (target <= 0.1)
  torch_save_blocked_ms            median torch.save of the same state to the
                                   same disk (what TorchCheckpointIO blocks)
  torch_snapshot_step_ms           median compute of one training step
  torch_snapshot_GBps              state bytes / (snapshot() to durable file,
                                   fsync and rename included, no training)
  torch_snapshot_memcpy_GBps       state bytes / sync copy time
  torch_snapshot_disk_write_GBps   the same bytes written with write()+fsync

Honest about the CPU: on the host backend "device" memory is host memory;
the engine's copies are memcpys on its worker thread, which share the two
cores with the training step and the writer thread, and the fence waits on
the host for copies not done yet. On a GPU the fence is a stream wait.

Usage: python bench/bench_checkpoint.py [--json build/bench.json] [--reps 3]
       [--layers 4] [--width 2048] [--batch 32] [--dir DIR]
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def import_ferry(json_path):
    try:
        import ferry  # noqa: F401
    except ImportError:
        for d in ([os.path.join(os.path.dirname(os.path.abspath(json_path)), "python")]
                  if json_path else []) + [os.path.join(HERE, "..", "build", "python")]:
            if os.path.isdir(os.path.join(d, "ferry")):
                sys.path.insert(0, d)
                break
    import ferry
    import ferry.torch
    return ferry


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


def merge_json(path, metrics):
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            text = f.read().strip()
        data = json.loads(text) if text else {}
    data.update(metrics)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=3)
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
        opt.step()
        opt.zero_grad(set_to_none=True)

    def state():
        return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "global_step": 0}

    step()  # AdamW state exists from here
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state(), []))
    workdir = args.dir or tempfile.mkdtemp(prefix="ferry-bench-ckpt-")
    path = os.path.join(workdir, "ckpt.pt")

    step_ms, sync_ms, save_ms, blocked, call_ms, fence_ms, total_s = [], [], [], [], [], [], []
    for rep in range(args.reps + 1):  # the first round warms the engine and the arena
        t0 = time.perf_counter()
        step()
        step_ms.append((time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        copies = [t.clone() for t in tensors_of(state(), [])]
        sync_ms.append((time.perf_counter() - t0) * 1e3)
        del copies

        t0 = time.perf_counter()
        torch.save(state(), path + ".torch")
        save_ms.append((time.perf_counter() - t0) * 1e3)

        t0 = time.perf_counter()
        h = ferry.torch.snapshot(state(), path, optimizer=opt)
        call_ms.append((time.perf_counter() - t0) * 1e3)
        step()  # forward/backward overlap the staging; the step's hook fences
        h.wait()
        fence_ms.append(h.stats.get("fence_ms", 0.0))
        blocked.append(call_ms[-1] + fence_ms[-1])

        t0 = time.perf_counter()
        ferry.torch.snapshot(state(), path, optimizer=opt).wait()
        total_s.append(time.perf_counter() - t0)
    for lst in (step_ms, sync_ms, save_ms, blocked, call_ms, fence_ms, total_s):
        del lst[0]

    payload = os.urandom(min(nbytes, 64 << 20))
    disk = []
    for _ in range(3):
        t0 = time.perf_counter()
        with open(path + ".raw", "wb") as f:
            left = nbytes
            while left > 0:
                n = f.write(payload[:min(left, len(payload))])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        disk.append(time.perf_counter() - t0)
    for p in (path, path + ".torch", path + ".raw"):
        if os.path.exists(p):
            os.remove(p)

    med = statistics.median
    out = {
        "torch_snapshot_state_MiB": round(nbytes / 2**20, 1),
        "snapshot_blocked_ms": round(med(blocked), 3),
        "torch_snapshot_call_ms": round(med(call_ms), 3),
        "torch_snapshot_fence_ms": round(med(fence_ms), 3),
        "sync_cpu_copy_ms": round(med(sync_ms), 3),
        "snapshot_blocked_vs_sync_cpu": round(med(blocked) / med(sync_ms), 4),
        "torch_save_blocked_ms": round(med(save_ms), 3),
        "torch_snapshot_step_ms": round(med(step_ms), 3),
        "torch_snapshot_GBps": round(nbytes / med(total_s) / 1e9, 3),
        "torch_snapshot_memcpy_GBps": round(nbytes / (med(sync_ms) / 1e3) / 1e9, 3),
        "torch_snapshot_disk_write_GBps": round(nbytes / med(disk) / 1e9, 3),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
