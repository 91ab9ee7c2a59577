#!/usr/bin/env python3
"""Drop-ins and peers on the GPU: a Hugging Face transformers Llama of a few
layers (built from its config, no download) in bf16, AdamW, the same weights
and batches in every mode, torch's deterministic algorithms on:
  none                       no saved-tensor hooks (the reference)
  torchtune                  torchtune's own OffloadActivations() (the carried
                             wheel's module; see load_torchtune)
  ferry_offload_activations  ferry.torch.OffloadActivations(model=model), the
                             torchtune-compatible drop-in
  save_on_cpu                torch.autograd.graph.save_on_cpu(pin_memory=True)
  ferry_default, ferry_budget, ferry_host_budget
                             ferry.torch.offload(model, policy=...)
Per mode: median step ms (forward in the context, loss, backward, step),
peak device memory above the mode's start (MiB), and whether every step's
loss and the final parameters are bit-identical to `none`'s.
Without a GPU: the torchtune module is loaded all the same and each ferry
mode and save_on_cpu runs one step of a toy Llama on the CPU (nothing
reported)."""
import contextlib
import importlib.util
import logging
import os
import re
import statistics
import sys
import types

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call

import schema  # noqa: E402
from gpu_common import bits_equal, main, no_gpu_reason, timed  # noqa: E402


def load_torchtune(site):
    """torchtune's OffloadActivations and its version, from the unzipped wheel.

    Only its module torchtune/training/_activation_offloading.py is loaded:
    the package's __init__ imports torchao and Hugging Face datasets, which
    a CUDA torch image lacks. What that module imports besides torch gets a
    stand-in where missing: torchao's NF4Tensor (used only in an isinstance
    test for quantized weights, which this model has none of), torchtune's
    TiedLinear (used only by a helper that builds the context for a
    torchtune model) and its get_logger (a logging.Logger)."""
    path = os.path.join(site, "torchtune", "training", "_activation_offloading.py")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: carry torchtune's wheel (tests/gpu/gather.sh)")
    with open(os.path.join(site, "torchtune", "__init__.py")) as fh:
        version = re.search(r"__version__ = '([^']+)'", fh.read()).group(1)
    stand_ins, added = [], []
    try:
        import torchao  # noqa: F401
        from torchao.dtypes.nf4tensor import NF4Tensor  # noqa: F401
    except Exception:
        ao = types.ModuleType("torchao")
        ao.__version__ = "0"
        nf4 = types.ModuleType("torchao.dtypes.nf4tensor")
        nf4.NF4Tensor = type("NF4Tensor", (), {})
        ao.dtypes = types.ModuleType("torchao.dtypes")
        ao.dtypes.nf4tensor = nf4
        added += [("torchao", ao), ("torchao.dtypes", ao.dtypes), ("torchao.dtypes.nf4tensor", nf4)]
        stand_ins.append("torchao.NF4Tensor")
    tt = types.ModuleType("torchtune")
    tt.__path__ = []
    mods = types.ModuleType("torchtune.modules")
    mods.TiedLinear = type("TiedLinear", (), {})
    utils = types.ModuleType("torchtune.utils")
    utils.get_logger = lambda level=None: logging.getLogger("torchtune")
    training = types.ModuleType("torchtune.training")
    training.__path__ = []
    added += [("torchtune", tt), ("torchtune.modules", mods), ("torchtune.utils", utils),
              ("torchtune.training", training)]
    sys.modules.update(dict(added))
    stand_ins += ["torchtune.modules.TiedLinear", "torchtune.utils.get_logger"]
    name = "torchtune.training._activation_offloading"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        # gone again once the module holds them: others (transformers) probe
        # for torchao and must not find the stand-in
        for n, _ in added:
            sys.modules.pop(n, None)
        sys.modules.pop(name, None)
    return mod.OffloadActivations, version, stand_ins


def llama(torch, a, dev, dtype):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                                   intermediate_size=a.hidden * 11 // 4,
                                   num_hidden_layers=a.layers, num_attention_heads=a.heads,
                                   num_key_value_heads=max(1, a.heads // 4),
                                   max_position_embeddings=a.seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    with dev:  # initialised where it runs: on the CPU a 300M model takes seconds
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype)


def run_mode(torch, ft, mode, a, dev, on_gpu, TorchtuneOA, model, init):
    """One mode from the initial weights `init`, with a fresh AdamW."""
    model.load_state_dict(init)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # the two OffloadActivations are made once and entered every step, as
    # torchtune's recipes do; the others are made per step
    once = {"torchtune": TorchtuneOA, "ferry_offload_activations":
            lambda: ft.OffloadActivations(model=model)}
    made = once[mode]() if mode in once else None
    ctxs = {
        "none": contextlib.nullcontext,
        "torchtune": lambda: made,
        "ferry_offload_activations": lambda: made,
        "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(pin_memory=on_gpu),
        "ferry_default": lambda: ft.offload(model, policy="default"),
        "ferry_budget": lambda: ft.offload(model, policy="budget"),
        "ferry_host_budget": lambda: ft.offload(model, policy="host_budget"),
    }
    g = torch.Generator(device="cpu").manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev)
               for _ in range(a.warmup + a.steps)]

    def step(ids):
        with ctxs[mode]():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if on_gpu:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i, ids in enumerate(batches):
        ms, loss = timed(torch, lambda: step(ids), on_gpu)
        losses.append(loss)
        if i >= a.warmup:
            times.append(ms)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if on_gpu else None
    params = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    return statistics.median(times), peak, losses, params


def body(a, f):
    import torch
    import ferry.torch as ft

    why = no_gpu_reason()
    on_gpu = not why
    TorchtuneOA, version, stand_ins = load_torchtune(os.environ.get("FERRY_GPU_SITE") or a.site)
    f.note(f"torchtune {version}: OffloadActivations loaded, stand-ins for {', '.join(stand_ins)}")
    dev = torch.device("cuda" if on_gpu else "cpu")
    if not on_gpu:
        a.layers, a.hidden, a.heads, a.vocab, a.seq, a.batch, a.warmup, a.steps = 2, 64, 4, 128, 16, 2, 1, 1
        modes = [m for m in schema.DROPIN_MODES if m != "torchtune"]  # it needs CUDA streams
    else:
        modes = list(schema.DROPIN_MODES)
        # warn_only: an op without a deterministic kernel warns (in the log)
        # rather than stopping the comparison; two plain runs are compared below
        torch.use_deterministic_algorithms(True, warn_only=True)
    model = llama(torch, a, dev, torch.bfloat16)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    res = {m: run_mode(torch, ft, m, a, dev, on_gpu, TorchtuneOA, model, init) for m in modes}
    ref = res["none"]

    def identical(m):
        _, _, losses, params = res[m]
        return (all(bits_equal(torch, x, y) for x, y in zip(losses, ref[2]))
                and all(bits_equal(torch, x, y) for x, y in zip(params, ref[3])))
    if not on_gpu:
        differ = [m for m in modes if not identical(m)]
        if differ:  # on the CPU every mode is plain arithmetic on the same bytes
            raise AssertionError(f"on the CPU, not bit-identical to none: {differ}")
        f.no_gpu(why + "; torchtune's module loaded, a CPU step of every other mode passed")
        return
    again = run_mode(torch, ft, "none", a, dev, on_gpu, TorchtuneOA, model, init)
    if not all(bits_equal(torch, x, y) for x, y in zip(again[3], ref[3])):
        f.note("two plain runs differ: bit-identity cannot be judged on this GPU")
    f["dropins_model"] = (f"Llama {a.layers} layers x {a.hidden}, {a.heads} heads, vocab {a.vocab}, "
                          f"{a.batch}x{a.seq} tokens, bf16")
    f["torchtune_version"] = version
    for m in modes:
        ms, peak, _, _ = res[m]
        f[f"dropin_{m}_step_ms"], f[f"dropin_{m}_peak_MiB"] = ms, peak
        f[f"dropin_{m}_bit_identical"] = identical(m)


def extra(ap):
    ap.add_argument("--site", default="", help="the unzipped wheels (default $FERRY_GPU_SITE)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)


if __name__ == "__main__":
    sys.exit(main("dropins", __doc__, body, extra))
