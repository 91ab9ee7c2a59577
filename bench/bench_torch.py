#!/usr/bin/env python3
"""Per-saved-tensor cost of ferry's PyTorch hooks (docs/hardware.md micro-benchmark).

Runs under any torch; the metrics it names after the interpreter carry the
suffix _torch2 (torch 2.x) or _torch1 (torch 1.x), so `make bench` runs it
under both and neither overwrites the other.

1. Real-size tensors, the target (hook_keep_vs_noop_pair_<sfx>)
   256 tensors of 1 MiB (float32, 262144 elements): 128 leaves that require
   grad and 128 outputs of an op (they have a grad_fn), the kinds torch hands
   a pack hook. ferry runs with a Lua policy written to a temp file that
   keeps every tensor (ferry.KEEP, cacheable, as default.lua's answers are):
   the first tensor is decided by the policy through the whole pack path;
   the others find the answer in the policy's site cache
   (ferry_pack_cached_keep: counted by the engine, kept without a handle),
   as every tensor of a site does after a training run's first step. No
   tensor is small enough for the binding's small-tensor fast path (checked
   from ferry's counters after the run: every tensor packed by the engine,
   every one kept, none on the fast path).
   End to end (the target value): a chain of 128 ops, each a
   torch.autograd.Function whose forward saves two of the 1 MiB tensors
   (one leaf, one op output; each tensor once per run) with
   save_for_backward and passes a 16-element tensor through (x * 2),
   backward reads ctx.saved_tensors; forward+backward per run. The ops' own
   compute is tiny, so the hooks' cost is not buried under 1 MiB of
   arithmetic per tensor. Each mode's context object is made once and
   entered every run, as a training loop enters it every step (the cost of
   making a new one each step is bench_step.py's _new_ctx figure). Modes
   none / noop / ferry keep-all in a rotating order within each round, gc
   collected between rounds and off within them, median of --e2e-reps runs;
   --e2e-trials such trials (9 of 41 runs), each with 256 freshly allocated
   tensors: the ratio of one trial moved by +-0.05 to 0.1 from one set of
   tensors (or one stretch of time) to the next, more runs of one set did
   not narrow it, more trials do.
     hook_keep_vs_noop_pair_<sfx> = the median over the trials of
         (median(ferry keep-all) - median(no hooks)) per saved tensor
       / (median(no-op pair) - median(no hooks)) per saved tensor
     hook_keep_vs_noop_pair_{min,max}_<sfx>: the lowest and highest trial.
     The difference includes torch's own cost of calling any hook pair
     (wrapping the tensor, storing the packed object), in both terms: that
     is the floor the no-op pair stands for.
     hook_e2e_overhead_ns_{keep,noop}_1mib_<sfx>: the two ns figures of the
     median trial.
     tensor_facts_<sfx>: 1 when the hooks read tensors through the
     _torchfacts module built for this torch (bindings/python/ext/
     torch_facts.h), 0 through torch's getters (FERRY_TORCH_FACTS=0, or no
     module for this torch).
   Direct call (reported, not the target): per rep, inside the context (a
   step), pack all 256, then unpack them in reverse order (backward's
   order), timed with perf_counter; the no-op pair on the same tensors in
   the same rep (interleaved); min over --direct-reps reps, per tensor.
   It leaves out torch's cost of calling a hook, so it compares ferry's C
   hooks with two Python lambdas that do nothing at all.
     hook_keep_direct_vs_noop_pair_<sfx> =
         ns of ferry's pack+unpack per tensor (keep-all, cached decision)
       / ns of the no-op pair (lambda t: t, lambda t: t) per tensor
     hook_keep_uncached_direct_vs_noop_pair_<sfx> = the same with a
         keep-all policy that does not let the engine cache (Lua runs per
         tensor, every tensor held by the engine with a handle)
       / the same no-op pair
     hook_call_ns_{keep,keep_uncached,noop}_1mib_<sfx>: the three ns figures.

2. Small tensors (64 bytes): reported apart, not the target. 2000 chained
   multiplies of a 16-element tensor, y = y * w, forward and backward: 4000
   saved tensors per run. Modes, interleaved, median of --reps runs each:
     none        no hooks (the reference)
     noop        a pair of no-op Python saved_tensors_hooks
     save_on_cpu torch.autograd.graph.save_on_cpu()
     ferry_keep  ferry.torch.offload with default.lua (64-byte tensors are
                 kept by the binding's fast path, without the engine)
     ferry_offload  a policy offloading every tensor (min_offload_bytes = 1),
                 host backend
   Per-tensor overhead = (median(mode) - median(none)) / saved tensors.
     hook_keep_vs_noop_pair_small_<sfx> =
         ferry_keep overhead per saved tensor / noop overhead per saved tensor
     torch_<mode>_overhead_us_<sfx>, torch_hook_call_ns_{ferry_keep,noop}_<sfx>
       (the pair called directly on 64-byte tensors, min of 5 x 100k calls)
   Under torch 2.x the unsuffixed names of earlier versions are also written
   (docs/pytorch.md): torch_hook_overhead_ratio (= the small ratio),
   torch_save_on_cpu_overhead_ratio, torch_ferry_offload_overhead_ratio
   (save_on_cpu, ferry_offload overhead / noop overhead), torch_<mode>_overhead_us,
   torch_chain_none_ms, torch_hook_call_ns_{ferry_keep,noop}.

Usage: python bench/bench_torch.py [--json build/bench.json] [--reps 15]
         [--direct-reps 300] [--e2e-reps 41] [--e2e-trials 9]
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import timeit
from bench_common import import_ferry, write_policy, merge_json  # noqa: E402

CHAIN = 2000
MIB_ELEMS = 262144  # float32: 1 MiB
N_BIG = 128         # leaves; as many op outputs again


OFFLOAD_ALL = """
return { api = 1, name = "offload-all", knobs = { min_offload_bytes = 1, max_fwd_stash = 64 },
  decide = function(t, ctx) return ferry.OFFLOAD, ferry.ON_USE, nil, true end }
"""
# Keeps every tensor; the fourth value lets the engine cache the answer per
# site, as it does for default.lua's.
KEEP_ALL = """
return { api = 1, name = "keep-all",
  decide = function(t, ctx) return ferry.KEEP, ferry.ON_USE, nil, true end }
"""
# Keeps every tensor, asked for each one (no caching): Lua runs per tensor.
KEEP_ALL_UNCACHED = """
return { api = 1, name = "keep-all-uncached",
  decide = function(t, ctx) return ferry.KEEP end }
"""


def timed_reps(modes, run, reps):
    """Each mode's run, reps rounds, the modes in a rotating order in each
    round; gc collected between rounds and off within them (a collection
    inside a run would swamp microseconds; one right before every run would
    leave each run's first operations cold, which no training step sees)."""
    times = {m: [] for m in modes}
    for m, ctx in modes.items():  # warm-up: engines, caches, allocator
        with ctx():
            run()
    order = list(modes)
    for r in range(reps):
        gc.collect()
        gc.disable()
        for m in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            with modes[m]():
                run()
            times[m].append(time.perf_counter() - t0)
        gc.enable()
    return times


def small_tensors(torch, ft, noop, reps, tmp):
    """Part 2: 64-byte tensors (the binding's fast path for ferry_keep)."""
    def chain():
        x = torch.randn(16, requires_grad=True)
        w = torch.randn(16, requires_grad=True)
        y = x
        for _ in range(CHAIN):
            y = y * w
        y.sum().backward()

    saved_per_run = 2 * CHAIN
    offload_all = write_policy(tmp, "offload_all.lua", OFFLOAD_ALL)
    # ferry's context objects made once and entered every run (a step)
    keep_obj = ft.offload(None, policy="default", backend="host")
    # its own engine (another knob value), so no policy swap per run
    offload_obj = ft.offload(None, policy=offload_all, backend="host", max_fwd_stash=64)
    modes = {
        "none": contextlib.nullcontext,
        "noop": noop,
        "save_on_cpu": torch.autograd.graph.save_on_cpu,
        "ferry_keep": lambda: keep_obj,
        "ferry_offload": lambda: offload_obj,
    }
    times = timed_reps(modes, chain, reps)
    # The hooks alone, called directly (min of 5 x 100k calls: robust to a
    # loaded machine). Half leaf (w), half non-leaf (y) tensors, as above.
    keep_ctx = modes["ferry_keep"]()
    keep_ctx.__enter__()
    pack, unpack = keep_ctx.engine.hooks()
    w = torch.randn(16, requires_grad=True)
    y = w * 1.5
    noop_pack = noop_unpack = lambda t: t  # noqa: E731
    env = dict(pack=pack, unpack=unpack, noop_pack=noop_pack, noop_unpack=noop_unpack, w=w, y=y)

    def call_ns(stmt):
        return min(timeit.repeat(stmt, globals=env, number=100000, repeat=5)) / 100000 * 1e9

    hook_ns = {
        "ferry_keep": (call_ns("unpack(pack(w))") + call_ns("unpack(pack(y))")) / 2,
        "noop": (call_ns("noop_unpack(noop_pack(w))") + call_ns("noop_unpack(noop_pack(y))")) / 2,
    }
    keep_ctx.__exit__(None, None, None)
    ft.step()
    with modes["ferry_offload"]():
        pass
    ft.step()
    stats = ft.stats()  # the offload engine's, for the report line
    med = {m: statistics.median(v) for m, v in times.items()}
    per = {m: (med[m] - med["none"]) / saved_per_run * 1e6 for m in modes if m != "none"}
    print(f"64-byte tensors (not the target): {CHAIN} chained multiplies, {saved_per_run} saved "
          f"tensors/run, median of {reps}; no hooks {med['none'] * 1e3:.2f} ms/run")
    for m in per:
        print(f"  {m:14s} {per[m]:7.3f} us per saved tensor  ({per[m] / per['noop']:5.2f} x no-op Python hooks)")
    print(f"  hooks alone (pack+unpack called directly): ferry keep {hook_ns['ferry_keep']:.0f} ns, "
          f"Python no-op pair {hook_ns['noop']:.0f} ns")
    print(f"  ferry_offload moved {stats['bytes_d2h']} bytes D2H, {stats['bytes_h2d']} H2D "
          f"({stats['tensors_offloaded']} tensors, {stats['tensors_aliased']} aliased)")
    return per, med, hook_ns


def big_tensors(torch, ft, noop, reps, trials, direct_reps, tmp):
    """Part 1: 1 MiB tensors through the engine and a keep-all policy."""
    keep_all = write_policy(tmp, "keep_all.lua", KEEP_ALL)
    keep_unc = write_policy(tmp, "keep_all_uncached.lua", KEEP_ALL_UNCACHED)
    # Distinct knob values give each policy its own engine (no hot swap per
    # entry); neither knob matters when every tensor is kept.
    keep_obj = ft.offload(None, policy=keep_all, backend="host", max_fwd_stash=6)
    unc_obj = ft.offload(None, policy=keep_unc, backend="host", max_fwd_stash=7)
    keep_ctx = lambda: keep_obj  # noqa: E731
    unc_ctx = lambda: unc_obj  # noqa: E731

    def big():
        leaves = [torch.randn(MIB_ELEMS, requires_grad=True) for _ in range(N_BIG)]
        outputs = [leaf * 1.0 for leaf in leaves]  # non-leaves with a grad_fn
        assert all(t.numel() * t.element_size() == 1 << 20 for t in leaves + outputs)
        return leaves, outputs

    leaves, outputs = big()
    tensors = [t for pair in zip(leaves, outputs) for t in pair]

    # ---- direct calls ----
    def hooks_of(ctx_fn):
        c = ctx_fn()
        with c:
            return c.engine.hooks()

    candidates = {
        "noop": (noop, (lambda t: t), (lambda t: t)),
        "keep": (keep_ctx,) + tuple(hooks_of(keep_ctx)),
        "keep_uncached": (unc_ctx,) + tuple(hooks_of(unc_ctx)),
    }
    ft.step()
    before = {m: ft.offload(None, policy=p, backend="host", max_fwd_stash=k).engine.stats()
              for m, p, k in (("keep", keep_all, 6), ("keep_uncached", keep_unc, 7))}
    best = {m: float("inf") for m in candidates}
    rev = list(range(len(tensors) - 1, -1, -1))
    for _ in range(direct_reps):
        for m, (ctx_fn, pack, unpack) in candidates.items():
            with ctx_fn():
                gc.disable()
                t0 = time.perf_counter()
                packed = [pack(t) for t in tensors]
                for i in rev:
                    unpack(packed[i])
                dt = time.perf_counter() - t0
                gc.enable()
                del packed
            best[m] = min(best[m], dt)
    direct_ns = {m: v / len(tensors) * 1e9 for m, v in best.items()}

    # ---- end to end ----
    class SaveBig(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, pair):
            # saved without being inputs: no graph edges to them
            ctx.save_for_backward(*pair)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            leaf, out = ctx.saved_tensors
            return g * 2, None

    x0 = torch.randn(16, requires_grad=True)
    chain_len = N_BIG
    saved_per_run = 2 * chain_len
    modes = {"none": contextlib.nullcontext, "noop": noop, "keep": keep_ctx}
    # Each trial with tensors of its own (fresh allocations): one set's
    # placement in memory moved the ratio by +-0.05-0.1 from trial to trial,
    # more than more runs of one set could average out.
    trial_ns, trial_med = [], []
    for trial in range(trials):
        if trial:
            leaves, outputs = big()
        pairs = list(zip(leaves, outputs))

        def chain():
            y = x0
            for i in range(chain_len):
                y = SaveBig.apply(y, pairs[i])
            y.sum().backward()

        times = timed_reps(modes, chain, reps)
        ft.step()
        med = {m: statistics.median(v) for m, v in times.items()}
        trial_med.append(med)
        trial_ns.append({m: (med[m] - med["none"]) / saved_per_run * 1e9 for m in ("noop", "keep")})
        del pairs, chain
    ratios = [t["keep"] / t["noop"] for t in trial_ns]
    at = sorted(range(trials), key=lambda i: ratios[i])[trials // 2]  # the median trial
    e2e_ns, med = trial_ns[at], trial_med[at]

    # The whole path was taken: every tensor packed by the engine and kept,
    # none on the binding's fast path, the policy consulted for each.
    for m, p, k in (("keep", keep_all, 6), ("keep_uncached", keep_unc, 7)):
        after = ft.offload(None, policy=p, backend="host", max_fwd_stash=k).engine.stats()
        d = {key: after[key] - before[m][key] for key in
             ("tensors_packed", "tensors_kept", "tensors_offloaded", "kept_small",
              "policy_calls", "policy_cache_hits", "tensors_kept_unheld")}
        expect = direct_reps * len(tensors) + (trials * (reps + 1) * saved_per_run
                                               if m == "keep" else 0)
        if not (d["tensors_packed"] == d["tensors_kept"] == expect and d["kept_small"] == 0
                and d["tensors_offloaded"] == 0
                and d["policy_calls"] + d["policy_cache_hits"] == expect):
            sys.exit(f"bench_torch: the {m} engine did not take the whole keep path: {d}, "
                     f"expected {expect} tensors packed and kept")
        if m == "keep_uncached" and (d["policy_calls"] != expect or d["tensors_kept_unheld"]):
            sys.exit(f"bench_torch: the uncached policy was not asked for every tensor: {d}")
        if m == "keep":
            unheld = d["tensors_kept_unheld"] / expect

    print(f"1 MiB tensors through the engine, keep-all policy ({len(tensors)} tensors: "
          f"{N_BIG} leaves, {N_BIG} op outputs; {unheld:.1%} answered from the site cache "
          "without a handle)")
    print(f"  direct pack+unpack, min of {direct_reps} reps, per tensor: ferry keep-all "
          f"{direct_ns['keep']:.0f} ns (uncached Lua {direct_ns['keep_uncached']:.0f} ns), "
          f"no-op pair {direct_ns['noop']:.0f} ns")
    print(f"  end to end ({chain_len} ops saving 2 x 1 MiB each, {trials} trials with fresh "
          f"tensors, median of {reps} runs each), keep-all / no-op pair per trial: "
          + " ".join(f"{r:.3f}" for r in ratios))
    print(f"  the median trial: no hooks {med['none'] * 1e3:.2f} ms/run, overhead per saved "
          f"tensor: ferry keep-all {e2e_ns['keep']:.0f} ns, no-op pair {e2e_ns['noop']:.0f} ns")
    return direct_ns, e2e_ns, med, ratios


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="merge the metrics into this flat JSON object file")
    ap.add_argument("--reps", type=int, default=15, help="64-byte chain runs per mode (median)")
    ap.add_argument("--direct-reps", type=int, default=300, help="1 MiB direct-call reps (min)")
    ap.add_argument("--e2e-reps", type=int, default=41,
                    help="1 MiB end-to-end runs per mode and trial (median)")
    ap.add_argument("--e2e-trials", type=int, default=9,
                    help="1 MiB end-to-end trials, each with fresh tensors (median of their ratios)")
    args = ap.parse_args()
    ferry = import_ferry(args.json)
    import torch

    torch.set_num_threads(1)
    ft = ferry.torch
    sfx = "torch%d" % int(torch.__version__.split(".")[0])

    def noop():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    print(f"torch {torch.__version__} ({sfx}), {sys.executable}")
    with tempfile.TemporaryDirectory(prefix="ferry-bench-torch-") as tmp:
        direct_ns, e2e_ns, _, ratios = big_tensors(torch, ft, noop, args.e2e_reps,
                                                   args.e2e_trials, args.direct_reps, tmp)
        per, med, hook_ns = small_tensors(torch, ft, noop, args.reps, tmp)
        ft.close()

    out = {
        f"hook_keep_vs_noop_pair_{sfx}": round(e2e_ns["keep"] / e2e_ns["noop"], 4),
        f"hook_keep_vs_noop_pair_min_{sfx}": round(min(ratios), 4),
        f"hook_keep_vs_noop_pair_max_{sfx}": round(max(ratios), 4),
        f"tensor_facts_{sfx}": int(ferry._ferry.tensor_facts_active()),
        f"hook_keep_direct_vs_noop_pair_{sfx}": round(direct_ns["keep"] / direct_ns["noop"], 4),
        f"hook_keep_uncached_direct_vs_noop_pair_{sfx}": round(direct_ns["keep_uncached"] / direct_ns["noop"], 4),
        f"hook_call_ns_keep_1mib_{sfx}": round(direct_ns["keep"], 1),
        f"hook_call_ns_keep_uncached_1mib_{sfx}": round(direct_ns["keep_uncached"], 1),
        f"hook_call_ns_noop_1mib_{sfx}": round(direct_ns["noop"], 1),
        f"hook_e2e_overhead_ns_keep_1mib_{sfx}": round(e2e_ns["keep"], 1),
        f"hook_e2e_overhead_ns_noop_1mib_{sfx}": round(e2e_ns["noop"], 1),
        f"hook_keep_vs_noop_pair_small_{sfx}": round(per["ferry_keep"] / per["noop"], 4),
    }
    small = {f"torch_{m}_overhead_us": round(v, 4) for m, v in per.items()}
    small["torch_hook_overhead_ratio"] = out[f"hook_keep_vs_noop_pair_small_{sfx}"]
    small["torch_save_on_cpu_overhead_ratio"] = round(per["save_on_cpu"] / per["noop"], 4)
    small["torch_ferry_offload_overhead_ratio"] = round(per["ferry_offload"] / per["noop"], 4)
    small["torch_chain_none_ms"] = round(med["none"] * 1e3, 3)
    small["torch_hook_call_ns_ferry_keep"] = round(hook_ns["ferry_keep"], 1)
    small["torch_hook_call_ns_noop"] = round(hook_ns["noop"], 1)
    out.update({f"{k}_{sfx}": v for k, v in small.items()})
    if sfx == "torch2":  # the names docs/pytorch.md gives, from the default interpreter
        out.update(small)

    print("tensor facts: " + ("the _torchfacts module of this torch" if out[f"tensor_facts_{sfx}"]
                              else "none (torch's getters)"))
    print(f"target: hook_keep_vs_noop_pair_{sfx} = {out[f'hook_keep_vs_noop_pair_{sfx}']:.3f} "
          f"(per saved 1 MiB tensor over no hooks, keep-all; <= 1.1 wanted); direct calls "
          f"{out[f'hook_keep_direct_vs_noop_pair_{sfx}']:.3f}; 64-byte fast path "
          f"{out[f'hook_keep_vs_noop_pair_small_{sfx}']:.3f}")
    print(json.dumps(out, indent=1))
    if args.json:
        merge_json(args.json, out)


if __name__ == "__main__":
    main()
