#!/usr/bin/env python3
"""A few training steps of a small GPT-style model on CPU through ferry.

    python3 examples/train_gpt.py [--steps N] [--policy default] [--trace FILE]

Runs the same steps twice from the same seed: once plain, once inside
`ferry.torch.offload(model, policy=...)`, prints ferry's stats per step,
checks that losses and gradients are bit-identical, and records the trace
that `ferry sim --trace FILE` replays on a simulated GPU link.
Needs torch (Debian's python3-torch 1.13 or a current one) and the ferry
package (PYTHONPATH=build/python).
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import ferry
import ferry.torch


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, d=128, heads=4, layers=6, seq=128):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.wte(idx) + self.wpe(torch.arange(t))
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def run(steps, policy, trace, seed=0):
    torch.manual_seed(seed)
    model = GPT()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.randint(0, 512, (steps, 4, 129), generator=torch.Generator().manual_seed(1))
    losses, grads, prev = [], None, {}
    for step in range(steps):
        idx, target = data[step, :, :-1], data[step, :, 1:]
        if policy:
            # optimizer=: the trace declares its states as resident memory
            with ferry.torch.offload(model, policy=policy, record_trace=trace, optimizer=opt):
                logits = model(idx)
        else:
            logits = model(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if policy:
            ferry.torch.step()
            s = ferry.torch.stats()
            d = {k: s[k] - prev.get(k, 0) for k in
                 ("tensors_packed", "tensors_offloaded", "tensors_kept", "bytes_d2h", "bytes_h2d")}
            prev = s
            print(f"  step {step + 1}: loss {loss.item():.4f}  packed {d['tensors_packed']:4d}  "
                  f"offloaded {d['tensors_offloaded']:4d}  kept {d['tensors_kept']:4d}  "
                  f"D2H {d['bytes_d2h'] / 2**20:6.1f} MiB  H2D {d['bytes_h2d'] / 2**20:6.1f} MiB  "
                  f"arena peak {s['arena_peak'] / 2**20:5.1f} MiB  live handles {s['live_handles']}")
    return losses, grads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--policy", default="default")
    ap.add_argument("--trace", default=None, help="record the ferry trace here")
    args = ap.parse_args()
    print(f"ferry {ferry.__version__}, torch {torch.__version__}, arena {ferry.info()['arena']}")
    base_losses, base_grads = run(args.steps, None, None)
    print(f"GPT-style model, {args.steps} steps through ferry.torch.offload(policy={args.policy!r}):")
    losses, grads = run(args.steps, args.policy, args.trace)
    identical = losses == base_losses and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    print(f"losses and gradients bit-identical with and without ferry: {'yes' if identical else 'NO'}")
    if args.trace:
        print(f"trace recorded: {args.trace}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
