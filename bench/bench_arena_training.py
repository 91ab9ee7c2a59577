#!/usr/bin/env python3
"""The pinned arena on a real training run with varying shapes: reserved
bytes over peak bytes in use (bench/README.md, "Arena benchmarks").

examples/train_gpt.py's GPT (6 blocks, width 128, positions up to 512)
trains --steps steps (30) on the CPU with one torch thread inside
ferry.torch.offload(model, policy="default", backend="host"): each step a
batch of 2-4 sequences of 64-512 tokens, drawn from a fixed seed, so every
step saves tensors of other shapes (what padding-free batches or a
sequence-length schedule give). Offloaded tensors go through the engine's
real arena, of the kind ferry picks in this process (named in the output:
the pool unless libjemalloc is preloaded; bench_arena.c measures both kinds
on synthetic sizes).

  arena_reserved_over_peak_training = arena_reserved / arena_peak after the
      run (ferry.torch.stats(): bytes the arena holds from the backend, which
      it never gives back before the engine is destroyed, over the most it
      ever had in use; target <= 1.15)
  arena_training_offloaded: tensors offloaded (0 would measure nothing)

Usage: python bench/bench_arena_training.py [--json build/bench.json] [--steps 30]
"""
import argparse
import os
import random
import sys

from bench_common import HERE, import_ferry, merge_json


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(HERE, "..", "examples"))
    from train_gpt import GPT

    torch.set_num_threads(1)
    vocab = 512
    ft = ferry.torch

    def train(arena):
        torch.manual_seed(0)
        model = GPT(vocab=vocab, seq=512)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        rng = random.Random(1)
        for _ in range(args.steps):
            batch = rng.choice([2, 3, 4])
            tokens = rng.choice([64, 96, 128, 192, 256, 320, 384, 512])
            idx = torch.randint(0, vocab, (batch, tokens + 1))
            with ft.offload(model, policy="default", backend="host", optimizer=opt, arena=arena):
                logits = model(idx[:, :-1])
            F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ft.step()
        s = ft.stats()
        ft.close()
        if not s["tensors_offloaded"] or not s["arena_peak"]:
            sys.exit(f"bench_arena_training: nothing went through the {arena} arena: {s}")
        print(f"  {arena:8s} reserved {s['arena_reserved'] / 2**20:6.1f} MiB, peak in use "
              f"{s['arena_peak'] / 2**20:6.1f} MiB, {s['tensors_offloaded']} tensors offloaded")
        return s

    print(f"the arena on {args.steps} training steps of varying shapes (auto = "
          f"{ferry._ferry.info().get('arena', '?')} here)")
    s = train("auto")
    out = {"arena_reserved_over_peak_training": round(s["arena_reserved"] / s["arena_peak"], 4),
           "arena_training_offloaded": s["tensors_offloaded"]}
    print(f"target: arena_reserved_over_peak_training = "
          f"{out['arena_reserved_over_peak_training']:.3f} (<= 1.15 wanted)")
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
