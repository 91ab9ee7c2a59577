#!/usr/bin/env python3
"""Checkpoint staging on the GPU: how long training is blocked by
ferry.torch.snapshot() against the two ways of getting a checkpoint off the
GPU that Lightning offers, measured in the same run on the same state:
  sync_cpu    {k: t.cpu()} of the whole state, synchronously (TorchCheckpointIO
              blocks for it, then for torch.save)
  clone_gpu   t.clone() of every tensor into GPU memory first, the copy to the
              host and the write left to a thread (Lightning's
              AsyncCheckpointIO): blocked for the clones, at the cost of a
              second copy of the state in device memory
  snapshot    ferry.torch.snapshot(state, path, optimizer=opt): blocked for the
              call and the fence in the next optimizer step's pre-hook
              (Snapshot.stats["fence_ms"]); copies go through the pinned arena
Model: --layers Linear(--width, --width) in fp32 with AdamW (state: weights and
two moments). Per way (medians of --reps): blocked ms; peak device memory
above what was allocated before it (MiB, torch.cuda.max_memory_allocated over
the call and the steps until the checkpoint is on the host; for the snapshot,
whose window holds the drain's training steps, less plain steps' own peak); the steps that
overlap a snapshot's drain against plain steps of the same round
(ckpt_step_slowdown_during_drain = median overlapped / median plain). The
file of the last snapshot is read back with torch.load and compared bit for
bit with the state it was taken from.
Without a GPU: one round on the CPU at a toy size (nothing reported)."""
import os
import statistics
import sys
import tempfile

from gpu_common import bits_equal, main, no_gpu_reason, timed


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


def body(a, f):
    import torch
    import ferry.torch as ft

    why = no_gpu_reason()
    on_gpu = not why
    if not on_gpu:
        a.layers, a.width, a.batch, a.reps = 2, 64, 8, 1
    dev = torch.device("cuda" if on_gpu else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(a.batch, a.width, device=dev)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()  # a snapshot not yet fenced is fenced in its pre-hook
        opt.zero_grad(set_to_none=True)

    def state():
        return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}

    def peak_from(base):
        return (torch.cuda.max_memory_allocated() - base) / 2**20 if on_gpu else None

    def window():
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        return 0

    step()
    step()
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state(), []))
    work = tempfile.mkdtemp(prefix="ckpt-", dir=a.work)
    path = os.path.join(work, "ckpt.pt")
    ft.snapshot(state(), path, optimizer=opt).wait()  # engine and arena warm

    r = {k: [] for k in ("plain", "drain", "blocked", "sync", "clone", "peak_plain",
                         "peak_snapshot", "peak_sync", "peak_clone")}
    for _ in range(a.reps):
        base = window()  # the steps' own peak, taken off the snapshot's below
        for _ in range(a.plain_steps):
            r["plain"].append(timed(torch, step, on_gpu)[0])
        r["peak_plain"].append(peak_from(base))
        obj = state()
        base = window()
        ms, h = timed(torch, lambda: ft.snapshot(obj, path, optimizer=opt), False)
        del obj
        n = 0
        while n < a.max_overlap_steps and (n == 0 or not h.done()):
            r["drain"].append(timed(torch, step, on_gpu)[0])  # the first one fences
            n += 1
        h.wait()
        r["blocked"].append(ms + h.stats.get("fence_ms", 0.0))
        r["peak_snapshot"].append(peak_from(base))
        for _ in range(a.plain_steps):
            r["plain"].append(timed(torch, step, on_gpu)[0])

        tensors = tensors_of(state(), [])
        base = window()
        ms, cpu = timed(torch, lambda: [t.cpu() for t in tensors], on_gpu)
        r["sync"].append(ms)
        r["peak_sync"].append(peak_from(base))
        del cpu
        base = window()
        ms, clones = timed(torch, lambda: [t.clone() for t in tensors], on_gpu)
        r["clone"].append(ms)
        # the clones live until the thread has copied them out
        _ = [c.cpu() for c in clones]
        r["peak_clone"].append(peak_from(base))
        del clones, _, tensors

    # the file holds the state it was taken from, bit for bit
    ref = [t.to("cpu", copy=True) for t in tensors_of(state(), [])]
    ft.snapshot(state(), path, optimizer=opt).wait()
    back = tensors_of(torch.load(path, map_location="cpu", weights_only=False), [])
    identical = len(back) == len(ref) and all(bits_equal(torch, p, q) for p, q in zip(ref, back))
    if not on_gpu:
        if not identical:
            raise AssertionError("the snapshot read back differs from its state")
        f.no_gpu(why + "; smoke round on the CPU passed")
        return
    med = statistics.median
    f["ckpt_state_MiB"] = nbytes / 2**20
    f["ckpt_snapshot_blocked_ms"] = med(r["blocked"])
    f["ckpt_sync_cpu_ms"] = med(r["sync"])
    f["ckpt_clone_gpu_ms"] = med(r["clone"])
    f["ckpt_snapshot_blocked_vs_sync_cpu"] = med(r["blocked"]) / med(r["sync"])
    f["ckpt_snapshot_blocked_vs_clone_gpu"] = med(r["blocked"]) / med(r["clone"])
    # the snapshot's window holds training steps (the drain), the others' none:
    # what it adds above the steps alone
    f["ckpt_peak_snapshot_MiB"] = max(0.0, max(r["peak_snapshot"]) - max(r["peak_plain"]))
    f["ckpt_peak_sync_cpu_MiB"] = max(r["peak_sync"])
    f["ckpt_peak_clone_gpu_MiB"] = max(r["peak_clone"])
    f["ckpt_plain_step_ms"] = med(r["plain"])
    f["ckpt_step_during_drain_ms"] = med(r["drain"])
    f["ckpt_step_slowdown_during_drain"] = med(r["drain"]) / med(r["plain"])
    f["ckpt_snapshot_bit_identical"] = identical


def extra(ap):
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--plain-steps", type=int, default=2)
    ap.add_argument("--max-overlap-steps", type=int, default=20)


if __name__ == "__main__":
    sys.exit(main("checkpoint", __doc__, body, extra))
