#!/usr/bin/env python3
"""Training steps on a real GPU: ferry's offloading against no offloading and
against torch's own offloading, and a recorded trace for the simulator.

The model: a GPT-style stack in bf16 (--layers blocks of width --width, 16
heads, SDPA attention, a GELU MLP of 4x width), batch --batch, sequence
--seq, AdamW; one step = forward, loss, backward, optimizer step. At the
defaults (8 x 2048 wide, 4 x 2048 tokens) a step saves about 4 GiB of
activations and computes about 20 TFLOP: at PCIe Gen5 speeds, moving every
saved tensor out and back takes longer than the step's compute, which is
the case where scheduling decides the cost.

Modes (each: --warmup steps, then --steps timed steps, the modes in turn):
  none          no saved-tensor hooks (the reference)
  save_on_cpu   torch.autograd.graph.save_on_cpu(pin_memory=True): torch's
                own offload of every saved tensor (the baseline users have)
  ferry_default ferry.torch.offload(model, policy="default"): torchtune's
                behaviour (activations of >= 1 KiB out, head kept, a stash
                of 5, reload on use)
  ferry_layers  policy="layers"
Reported per mode: median step time (ms), peak device memory
(torch.cuda.max_memory_allocated, GiB), bytes sent to the host per step.
Ratios (numerator / denominator named):
  gpu_ferry_default_step_vs_save_on_cpu = ferry_default step / save_on_cpu step
  gpu_ferry_default_step_vs_none        = ferry_default step / none step
  gpu_ferry_default_peak_vs_none        = ferry_default peak / none peak
--trace FILE records one ferry_default step's JSONL trace (FLOPs and the
optimizer's resident memory included) for `ferry sim --hw h200` to replay
against the measured figures (docs/sim-validation.md).
Needs a CUDA device; without one it says so and writes nothing.

Usage: python bench/bench_gpu.py [--json build/bench.json] [--trace FILE]
"""
import argparse
import statistics
import sys
import time

from bench_common import import_ferry, merge_json


def build(torch, layers, width, heads, vocab, seq):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(width)
            self.c_attn = nn.Linear(width, 3 * width)
            self.c_proj = nn.Linear(width, width)
            self.ln_2 = nn.LayerNorm(width)
            self.c_fc = nn.Linear(width, 4 * width)
            self.c_out = nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, width)
            self.wpe = nn.Embedding(seq, width)
            self.h = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(width)
            self.lm_head = nn.Linear(width, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.h:
                x = blk(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def sent_so_far(ft):
    """Bytes the current engine has sent to the host (both ferry modes share
    one engine, its policy swapped at each entry: the arena is reused)."""
    try:
        return ft.stats()["bytes_d2h"]
    except Exception:  # no context entered yet
        return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="build/bench.json")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a smoke test of this script (times and peaks mean nothing, "
                         "no metrics written)")
    a = ap.parse_args()
    import torch
    on_gpu = a.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device: nothing measured (the gpu_* metrics come from a GPU machine)")
        return 0
    ferry = import_ferry(a.json)
    ft = ferry.torch
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    torch.manual_seed(0)
    model = build(torch, a.layers, a.width, 16, a.vocab, a.seq).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
    params = sum(p.numel() for p in model.parameters())
    print(f"bench_gpu: {torch.cuda.get_device_name(0) if on_gpu else 'CPU'}, torch {torch.__version__}, "
          f"{params / 1e6:.0f}M parameters, {a.batch}x{a.seq} tokens, bf16")

    def step(ctx):
        # The loss inside the context, as a Hugging Face model computes it in
        # its forward: its saved tensors are in the recorded trace too.
        with ctx():
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab),
                                                     batch[:, 1:].reshape(-1))
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    import contextlib
    modes = {
        "none": contextlib.nullcontext,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=on_gpu),
        "ferry_default": lambda: ft.offload(model, policy="default"),
        "ferry_layers": lambda: ft.offload(model, policy="layers"),
    }
    times = {m: [] for m in modes}
    peaks = {m: 0 for m in modes}
    sent = {}
    for rnd in range(a.warmup + a.steps):
        for m, ctx in modes.items():
            sync()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            before = sent_so_far(ft) if m.startswith("ferry") else 0
            t0 = time.perf_counter()
            step(ctx)
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            if m.startswith("ferry"):
                ft.step()
                if rnd >= a.warmup:
                    sent[m] = sent_so_far(ft) - before
            if rnd >= a.warmup:
                times[m].append(dt)
                peaks[m] = max(peaks[m], torch.cuda.max_memory_allocated() if on_gpu else 1)
    out = {}
    print(f"  {'mode':14} {'step ms':>9} {'peak GiB':>9} {'to host GiB/step':>17}")
    for m in modes:
        med = statistics.median(times[m])
        print(f"  {m:14} {med:9.1f} {peaks[m] / 2**30:9.2f} {sent.get(m, 0) / 2**30:17.2f}")
        out[f"gpu_{m}_step_ms"] = med
        out[f"gpu_{m}_peak_GiB"] = peaks[m] / 2**30
        if m in sent:
            out[f"gpu_{m}_to_host_GiB_per_step"] = sent[m] / 2**30
    out["gpu_ferry_default_step_vs_save_on_cpu"] = out["gpu_ferry_default_step_ms"] / out["gpu_save_on_cpu_step_ms"]
    out["gpu_ferry_default_step_vs_none"] = out["gpu_ferry_default_step_ms"] / out["gpu_none_step_ms"]
    out["gpu_ferry_default_peak_vs_none"] = out["gpu_ferry_default_peak_GiB"] / out["gpu_none_peak_GiB"]
    for k in ("gpu_ferry_default_step_vs_save_on_cpu", "gpu_ferry_default_step_vs_none",
              "gpu_ferry_default_peak_vs_none"):
        print(f"  {k} = {out[k]:.3f}")
    if a.trace:
        # Two steps recorded: the replay's --warmup 1 drops the first.
        for _ in range(2):
            step(lambda: ft.offload(model, policy="default", record_trace=a.trace, optimizer=opt))
            ft.step()
        ft.close()
        print(f"  trace: {a.trace}")
    if on_gpu:
        merge_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
