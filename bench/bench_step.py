#!/usr/bin/env python3
"""Step overhead of ferry keeping every saved tensor, next to torchtune's
OffloadActivations bookkeeping, on a small GPT-like model on CPU.

The model: token embedding + positions, --blocks transformer blocks
(LayerNorm, attention from nn.Linear with a causal softmax, LayerNorm, a
GELU MLP of 4x width), final LayerNorm and an output head, built with
torch.nn. Batch 8, sequence 256, width 128, 4 heads: a block's activations
are 1 MiB (B x S x width x 4 bytes), its MLP hidden tensors 4 MiB, its
attention scores 8 MiB. One step = forward, loss, backward (no optimizer:
it would be the same in every mode).

Overhead = the time a mode adds to a step over the same step with no hooks,
context entry included (the context manager is entered every step, as a
training loop does). Modes:
  none       no saved-tensor hooks (the reference)
  torchtune  a re-implementation of torchtune's OffloadActivations
             keep/offload bookkeeping, for CPU tensors it copies nothing
             (TorchtuneBookkeeping below: written from its documented
             behaviour, no torchtune code; torchtune is not installed). One
             object entered every step, as torchtune's recipes do.
  ferry      ferry.torch.offload(None, policy=<keep-all Lua file>,
             backend="host"): every saved tensor of at least 1 KiB goes
             through the binding, the engine and the policy (decision cached
             per site, as default.lua's are; a tensor whose bytes the engine
             already holds is aliased to them) and is kept; smaller ones
             (biases' grads inputs, indices: about one in six here) take
             the binding's small-tensor fast path, as in any ferry run.
             One object entered every step.

Two measures:
  replay (the target value): the tensors one real step saves, recorded in
    order, handed to each mode's pack hook in that order and to its unpack
    hook in reverse (backward's order), between the mode's context entry
    and exit; min of --replay-reps rounds, the modes in a rotating order in
    each round (gc off within a round, a collection between rounds). What each
    mode adds to a step without the step's compute, which on this model is
    about a thousand times larger and would bury it in noise.
      step_overhead_vs_torchtune =
          ferry's replayed step overhead (entry + packs + unpacks + exit), us
        / torchtune bookkeeping's replayed step overhead, same tensors, us
  end to end (the cross-check): whole steps, the modes interleaved in a
    rotating order, --reps rounds; each mode's overhead is the median over
    rounds of (its step time - the no-hook step time of the same round).
      step_overhead_vs_torchtune_e2e = ferry's median overhead / torchtune's
    Also ferry with model= (its module hooks on: paths and layers for the
    policy) / torchtune's. On a 2-core shared machine the no-hook step's
    interquartile spread (printed) is tens of times these overheads: the
    end-to-end figures show the overheads are lost in step-to-step noise,
    they do not rank the modes. ferry constructing its context every step
    (the README's `with ferry.torch.offload(...)` idiom) is measured by the
    replay too: step_overhead_vs_torchtune_new_ctx.
  context entry (reported): entering and leaving an offload context with
    nothing in it, median of 400, with one policy
    (offload_entry_us_same_policy) and with two contexts of the same engine
    configuration and different policies entered in turn
    (offload_entry_us_alternating_policies: the engine swaps the parked
    policy back instead of loading Lua again).
Metrics are suffixed _torch1 under torch 1.x (the unsuffixed names are the
torch 2.x run's).

Usage: python bench/bench_step.py [--json build/bench.json] [--reps 15]
         [--replay-reps 200] [--blocks 2]
"""
import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_common import import_ferry, merge_json, write_policy  # noqa: E402
from bench_torch import KEEP_ALL  # noqa: E402

B, S, WIDTH, HEADS, VOCAB = 8, 256, 128, 4, 512


def build_model(torch, blocks):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            self.ln2 = nn.LayerNorm(WIDTH)
            self.up = nn.Linear(WIDTH, 4 * WIDTH)
            self.act = nn.GELU()
            self.down = nn.Linear(4 * WIDTH, WIDTH)

        def forward(self, x):
            b, s, w = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
            q, k, v = (t.reshape(b, s, HEADS, w // HEADS).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / (w // HEADS) ** 0.5)
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(-1)
            y = (att @ v).transpose(1, 2).reshape(b, s, w)
            x = x + self.proj(y)
            return x + self.down(self.act(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, WIDTH)
            self.pos = nn.Embedding(S, WIDTH)
            self.layers = nn.ModuleList(Block() for _ in range(blocks))
            self.norm = nn.LayerNorm(WIDTH)
            self.output = nn.Linear(WIDTH, VOCAB)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for blk in self.layers:
                x = blk(x)
            return self.output(self.norm(x))

    return GPT()


class TorchtuneBookkeeping:
    """A re-implementation of torchtune's OffloadActivations keep/offload
    bookkeeping, for CPU tensors it copies nothing. Per saved tensor: a
    running id, the tensor's bytes (element size x element count), a
    tracker entry (tensor, would-be-offloaded flag) keyed by the id: the
    flag is set for tensors of at least min_offload_size bytes that are not
    parameters or buffers. First pack of a forward checks the tracker is
    empty and resets the phase flags; first unpack of a backward flips
    them back. Unpack looks the id up, drops the entry and returns the
    tensor (torchtune would copy a flagged tensor back to the GPU here;
    on CPU there is nothing to copy)."""

    def __init__(self, torch, min_offload_size=1024):
        self.min_bytes = min_offload_size
        self.tracker = {}
        self.next_id = 0
        self.forward_starts = True
        self.backward_starts = True
        param_types = [torch.nn.Parameter]
        if hasattr(torch.nn, "Buffer"):
            param_types.append(torch.nn.Buffer)
        self.param_types = tuple(param_types)
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        if self.forward_starts:
            assert not self.tracker, "the previous backward left saved tensors behind"
            self.forward_starts = False
            self.backward_starts = True
        nbytes = t.element_size() * t.nelement()
        self.next_id += 1
        would_offload = nbytes >= self.min_bytes and not isinstance(t, self.param_types)
        self.tracker[self.next_id] = (t, would_offload)
        return self.next_id

    def unpack(self, key):
        if self.backward_starts:
            self.backward_starts = False
            self.forward_starts = True
        assert key in self.tracker, f"tensor id {key} is not tracked"
        t, _ = self.tracker.pop(key)
        return t

    def __enter__(self):
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=None,
                    help="end-to-end rounds (median); default 15, 3 under torch 1.x (its steps take >1 s)")
    ap.add_argument("--replay-reps", type=int, default=200, help="replay reps per mode (min)")
    ap.add_argument("--blocks", type=int, default=2)
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ft = ferry.torch
    major = int(torch.__version__.split(".")[0])
    sfx = "" if major >= 2 else f"_torch{major}"
    if args.reps is None:
        args.reps = 15 if major >= 2 else 3
    model = build_model(torch, args.blocks)
    idx = torch.randint(0, VOCAB, (B, S))
    target = torch.randint(0, VOCAB, (B, S))

    def step():
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    tmp = tempfile.mkdtemp(prefix="ferry-bench-step-")
    keep_all = write_policy(tmp, "keep_all.lua", KEEP_ALL)
    tt = TorchtuneBookkeeping(torch)
    fy = ft.offload(None, policy=keep_all, backend="host")
    fy_model = ft.offload(model, policy=keep_all, backend="host", max_fwd_stash=6)
    modes = {
        "none": None,
        "torchtune": lambda: tt,
        "ferry": lambda: fy,
        "ferry_model": lambda: fy_model,
        "ferry_new_ctx": lambda: ft.offload(None, policy=keep_all, backend="host", max_fwd_stash=7),
    }

    # ---- the tensors one step saves, in order ----
    saved = []

    def record(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        step()
    big = sorted((t.numel() * t.element_size() for t in saved), reverse=True)

    # ---- replay ----
    before = fy.engine.stats()
    rev = list(range(len(saved) - 1, -1, -1))
    replay = {m: float("inf") for m in ("none", "torchtune", "ferry", "ferry_new_ctx")}
    hooks = {}
    for m in ("torchtune", "ferry", "ferry_new_ctx"):
        with modes[m]() as c:
            hooks[m] = (c.pack, c.unpack) if m == "torchtune" else c.engine.hooks()
    hooks["none"] = None
    rmodes = list(replay)
    for r in range(args.replay_reps):
        gc.collect()  # once a round: a collection leaves every cache cold for the next run
        gc.disable()
        for m in rmodes[r % len(rmodes):] + rmodes[:r % len(rmodes)]:
            t0 = time.perf_counter()
            if m == "none":  # the loop alone: what every mode's replay also pays
                packed = [t for t in saved]
                for i in rev:
                    packed[i]
            else:
                pack, unpack = hooks[m]
                with modes[m]():
                    packed = [pack(t) for t in saved]
                    for i in rev:
                        unpack(packed[i])
            dt = time.perf_counter() - t0
            del packed
            replay[m] = min(replay[m], dt)
        gc.enable()
    ft.step()
    after = fy.engine.stats()
    n = args.replay_reps * len(saved)
    d = {k: after[k] - before[k] for k in ("tensors_packed", "tensors_kept", "kept_small",
                                           "tensors_aliased", "tensors_offloaded")}
    if d["tensors_packed"] + d["kept_small"] != n or d["tensors_offloaded"] or \
            d["tensors_kept"] + d["tensors_aliased"] != d["tensors_packed"]:
        sys.exit(f"bench_step: ferry's replay did not keep all {n} tensors through the engine: "
                 + str(d))
    replay_us = {m: (replay[m] - replay["none"]) * 1e6 for m in replay if m != "none"}

    # ---- end to end ----
    def run(m):
        c = modes[m]
        with (c() if c is not None else contextlib.nullcontext()):
            step()

    order = list(modes)
    for m in order:  # warm-up
        run(m)
    times = {m: [] for m in modes}
    for r in range(args.reps):
        rot = order[r % len(order):] + order[:r % len(order)]
        for m in rot:
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            run(m)
            times[m].append(time.perf_counter() - t0)
            gc.enable()
    ft.step()
    e2e_us = {m: statistics.median(a - b for a, b in zip(times[m], times["none"])) * 1e6
              for m in modes if m != "none"}
    step_ms = statistics.median(times["none"]) * 1e3
    spread_us = (statistics.quantiles(times["none"], n=4)[2] -
                 statistics.quantiles(times["none"], n=4)[0]) * 1e6

    # ---- entering contexts of two policies in turn (one engine configuration) ----
    keep_b = write_policy(tmp, "keep_all_b.lua", KEEP_ALL.replace('"keep-all"', '"keep-all-b"'))
    pair = (ft.offload(None, policy=keep_all, backend="host", max_fwd_stash=5),
            ft.offload(None, policy=keep_b, backend="host", max_fwd_stash=5))

    def entry_us(seq, n=400):
        ts = []
        for i in range(n):
            t0 = time.perf_counter()
            with seq[i % len(seq)]:
                pass
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    entry_us(pair, 20)
    entry = {"same": entry_us(pair[:1]), "alternating": entry_us(pair)}
    ft.close()

    out = {
        f"step_overhead_vs_torchtune{sfx}": round(replay_us["ferry"] / replay_us["torchtune"], 4),
        f"step_overhead_us_ferry{sfx}": round(replay_us["ferry"], 1),
        f"step_overhead_us_torchtune{sfx}": round(replay_us["torchtune"], 1),
        f"step_overhead_vs_torchtune_new_ctx{sfx}": round(replay_us["ferry_new_ctx"] / replay_us["torchtune"], 4),
        f"step_overhead_vs_torchtune_e2e{sfx}": round(e2e_us["ferry"] / e2e_us["torchtune"], 4),
        f"step_overhead_vs_torchtune_e2e_model{sfx}": round(e2e_us["ferry_model"] / e2e_us["torchtune"], 4),
        f"step_overhead_e2e_us_ferry{sfx}": round(e2e_us["ferry"], 1),
        f"step_overhead_e2e_us_ferry_model{sfx}": round(e2e_us["ferry_model"], 1),
        f"step_overhead_e2e_us_torchtune{sfx}": round(e2e_us["torchtune"], 1),
        f"step_none_ms{sfx}": round(step_ms, 3),
        f"offload_entry_us_same_policy{sfx}": round(entry["same"], 2),
        f"offload_entry_us_alternating_policies{sfx}": round(entry["alternating"], 2),
    }
    print(f"torch {torch.__version__}: GPT-like, {args.blocks} blocks, batch {B}, seq {S}, width {WIDTH}; "
          f"{len(saved)} saved tensors per step ({sum(big) / 2**20:.0f} MiB; largest {big[0] / 2**20:.1f} MiB, "
          f"median {statistics.median(big) / 2**20:.2f} MiB); in ferry per step: "
          f"{d['tensors_packed'] // args.replay_reps} through the engine (policy asked or the same bytes "
          f"found again), {d['kept_small'] // args.replay_reps} under 1 KiB kept by the binding's fast path")
    print(f"  replay (min of {args.replay_reps}), step overhead: ferry keep-all {replay_us['ferry']:.0f} us "
          f"(new context each step {replay_us['ferry_new_ctx']:.0f} us), torchtune bookkeeping "
          f"{replay_us['torchtune']:.0f} us")
    print(f"  end to end (median of {args.reps} paired rounds; no-hook step {step_ms:.1f} ms, "
          f"interquartile spread {spread_us:.0f} us): ferry {e2e_us['ferry']:.0f} us, ferry with model= "
          f"{e2e_us['ferry_model']:.0f} us, ferry new context {e2e_us['ferry_new_ctx']:.0f} us, "
          f"torchtune {e2e_us['torchtune']:.0f} us")
    print(f"  context entry+exit, median of 400: {entry['same']:.1f} us with one policy, "
          f"{entry['alternating']:.1f} us alternating two policies on one engine configuration")
    print(f"target: step_overhead_vs_torchtune{sfx} = {out[f'step_overhead_vs_torchtune{sfx}']:.3f} "
          f"(replay; <= 1.0 wanted); end-to-end cross-check {out[f'step_overhead_vs_torchtune_e2e{sfx}']:.3f}")
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
