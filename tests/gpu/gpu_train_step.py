#!/usr/bin/env python3
"""A training step through ferry.torch that reuses device memory while its
copies are in flight, for tests/gpu/gpu_sanitizer.py (run alone, and under
compute-sanitizer's racecheck and memcheck).

Each round: a stack of matmul + tanh layers forwards inside
ferry.torch.offload with a policy that offloads every activation; right
after the forward, before backward, the caching allocator is made to hand
out freed blocks again (tensors of the activations' size filled with NaN),
so a device buffer released before its copy to the host finished would be
overwritten under the copy; then backward. The gradients must equal, bit for
bit, those of plain autograd on the same inputs.

  gpu_train_step.py [--rounds N] [--device cuda|cpu]
Prints `stress: R rounds, M mismatches`; exit 1 if any."""
import argparse
import sys

OFFLOAD_ALL = """
return { api = 1, name = "offload-all",
  decide = function(t, ctx)
    if t.kind ~= ferry.ACTIVATION then return ferry.KEEP, ferry.ON_USE, nil, true end
    return ferry.OFFLOAD, ferry.ON_USE, nil, true
  end }
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import torch
    import ferry
    import ferry.torch as ft

    dev = torch.device(a.device)
    torch.manual_seed(0)
    weights = [(torch.randn(a.width, a.width, device=dev) / a.width ** 0.5).requires_grad_()
               for _ in range(a.layers)]
    policy = ferry.Policy(OFFLOAD_ALL, "offload-all")

    def forward(x):
        h = x
        for w in weights:
            h = torch.tanh(h @ w)
        return h.pow(2).sum()

    mismatches = 0
    for r in range(a.rounds):
        g = torch.Generator(device="cpu").manual_seed(100 + r)
        x = torch.randn(a.rows, a.width, generator=g).to(dev)
        ref = torch.autograd.grad(forward(x), weights)
        with ft.offload(None, policy=policy):
            loss = forward(x)
        # blocks freed since the forward go to new tensors at once, and are written
        junk = [torch.full((a.rows, a.width), float("nan"), device=dev) for _ in range(2 * a.layers)]
        got = torch.autograd.grad(loss, weights)
        del junk
        for p, q in zip(got, ref):
            if not torch.equal(p, q):
                mismatches += 1
    if dev.type == "cuda":
        torch.cuda.synchronize()
    s = ft.stats()
    ft.close()
    print(f"stress: {a.rounds} rounds, {mismatches} mismatches "
          f"({s['tensors_offloaded']} tensors offloaded, backend {s['backend']})")
    return 1 if mismatches or not s["tensors_offloaded"] else 0


if __name__ == "__main__":
    sys.exit(main())
