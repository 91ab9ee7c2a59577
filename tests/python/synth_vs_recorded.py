#!/usr/bin/env python3
"""The synthesizer against a recorded run: what autograd really saves.

Builds a tiny Hugging Face transformers model from its config (no download:
LlamaForCausalLM, or Qwen3ForCausalLM with QK-norm), records one training
step on the CPU through ferry.torch.offload(record_trace=) with a policy that
keeps everything (so every saved tensor reaches the trace), synthesizes the
same shape with `ferry trace synth`, and compares them layer by layer:

- the bytes of the activations saved (a buffer packed twice, an `alias`
  pack, counted once: in the layer that packed it first);
- the multiset of saved tensors: (module path below the layer, kind, dtype,
  shape, alias or not), parameters included;
- the ops: the module paths that save, in order.

Run it by hand (PYTHONPATH=<build>/python, an interpreter with torch 2.x and
transformers):

    python tests/python/synth_vs_recorded.py --arch llama --attn eager -- --norm eager

prints the side-by-side table and exits 1 when a layer's bytes differ by more
than 5% or the lists differ. tests/python/test_synth_vs_recorded.py runs the
same comparison under pytest; docs/sim-synth.md, "Validated against a
recorded run", shows its tables.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

KEEP_ALL = "return { api = 1, decide = function() return ferry.KEEP end }\n"

# The tiny shape: hidden 64, 4 heads of 16, 2 KV heads, FFN 160, vocab 512.
SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=512, seq=32, batch=2,
             dtype="f32")
DTYPES = {"f32": "float32", "bf16": "bfloat16"}
TOLERANCE = 0.05


def ferry_cli():
    """The ferry CLI of the build the imported package belongs to, or $FERRY_BIN."""
    exe = os.environ.get("FERRY_BIN")
    if not exe:
        import ferry

        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(ferry.__file__))))
        exe = os.path.join(build, "bin", "ferry")
    return exe


def build_model(arch, attn, shape):
    import torch
    import transformers

    kw = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
              intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
              num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
              max_position_embeddings=4 * shape["seq"], attn_implementation=attn,
              tie_word_embeddings=False)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=shape["hidden"] // shape["heads"], **kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).to(getattr(torch, DTYPES[shape["dtype"]]))
    model.train()
    return model


def record(arch, attn, path, shape=SHAPE, workdir=None):
    """One training step of the tiny model on the CPU, every saved tensor
    kept and recorded to `path`."""
    import torch

    import ferry.torch as ft

    policy = os.path.join(workdir or os.path.dirname(os.path.abspath(path)), "keep-all.lua")
    with open(policy, "w") as f:
        f.write(KEEP_ALL)
    model = build_model(arch, attn, shape)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
    ft.close()
    with ft.offload(model, policy=policy, record_trace=str(path), backend="host",
                    min_offload_bytes=0):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    ft.step()
    ft.close()  # flushes the trace


def synth_args(arch, attn, shape=SHAPE, extra=()):
    """`ferry trace synth` flags for the same model and step."""
    args = ["--layers", shape["layers"], "--hidden", shape["hidden"], "--heads", shape["heads"],
            "--kv-heads", shape["kv_heads"], "--ffn", shape["ffn"], "--vocab", shape["vocab"],
            "--seq", shape["seq"], "--micro-batch", shape["batch"], "--dtype", shape["dtype"],
            "--flash", "on" if attn == "sdpa" else "off", "--tie-embeddings", "off",
            "--shard", "1"]
    if arch == "qwen3":
        args += ["--qk-norm", "on", "--head-dim", shape["hidden"] // shape["heads"]]
    return [str(a) for a in args] + list(extra)


def synthesize(path, args):
    r = subprocess.run([ferry_cli(), "trace", "synth", "-q", *args, "-o", str(path)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise RuntimeError(f"ferry trace synth {' '.join(args)}: {r.stderr.strip()}")


# ---- reading and comparing -------------------------------------------------------------
def first_step_packs(path):
    """The forward packs of the trace's first step."""
    out, in_step = [], False
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["ev"] == "step_begin":
                in_step = True
            elif e["ev"] == "step_end":
                break
            elif in_step and e["ev"] == "pack" and e.get("phase", "forward") == "forward":
                out.append(e)
    return out


def suffix(pack):
    """The module path below the repeated block (the whole path outside)."""
    m, layer = pack.get("module", ""), pack.get("layer", -1)
    if layer >= 0:
        for prefix in (f"model.layers.{layer}.", f"model.layers.{layer}"):
            if m.startswith(prefix):
                return m[len(prefix):]
    return m


class Layer:
    """What one layer (or everything outside the blocks: -1) saved."""

    def __init__(self):
        self.bytes = 0      # activation bytes, each buffer once
        self.tensors = collections.Counter()  # (suffix, kind, dtype, shape, alias)
        self.ops = []       # module suffixes in the order they saved
        self.classes = {}   # suffix -> module class

    def add(self, p):
        alias = "alias_of" in p or bool(p.get("alias"))
        if p["kind"] == "activation" and not alias:
            self.bytes += p["bytes"]
        s = suffix(p)
        self.tensors[(s, p["kind"], p["dtype"], tuple(p["shape"]), alias)] += 1
        if not self.ops or self.ops[-1] != s:
            self.ops.append(s)
        self.classes.setdefault(s, p.get("class", ""))


def layers_of(path):
    out = collections.OrderedDict()
    for p in first_step_packs(path):
        out.setdefault(p.get("layer", -1), Layer()).add(p)
    return out


def compare(recorded_path, synth_path, tolerance=TOLERANCE):
    """[row per layer]: layer, recorded and synthesized bytes, the difference
    in %, the tensors only one side saved, and whether the ops match."""
    rec, syn = layers_of(recorded_path), layers_of(synth_path)
    rows = []
    for layer in sorted(set(rec) | set(syn), key=lambda x: (x < 0, x)):
        a, b = rec.get(layer, Layer()), syn.get(layer, Layer())
        pct = 100.0 * (b.bytes - a.bytes) / a.bytes if a.bytes else float("inf")
        rows.append(dict(layer=layer, recorded=a.bytes, synthesized=b.bytes, pct=pct,
                         only_recorded=a.tensors - b.tensors, only_synth=b.tensors - a.tensors,
                         ops_recorded=a.ops, ops_synth=b.ops, classes=(a.classes, b.classes),
                         ok=abs(pct) <= 100 * tolerance and a.tensors == b.tensors
                         and a.ops == b.ops))
    return rows


def fmt_tensor(key, n):
    s, kind, dtype, shape, alias = key
    return (f"{n}x " if n > 1 else "") + (f"{s or '(root)'} {kind[:5]} {dtype}{list(shape)}"
                                          + (" alias" if alias else ""))


def table(rows, title=""):
    """The side-by-side text: bytes per layer, then each difference."""
    out = [title] if title else []
    out.append(f"{'layer':>6} {'recorded B':>11} {'synth B':>11} {'diff':>8}  tensors/ops")
    for r in rows:
        name = "outside" if r["layer"] < 0 else str(r["layer"])
        same = "same" if not r["only_recorded"] and not r["only_synth"] else "DIFFER"
        ops = "same" if r["ops_recorded"] == r["ops_synth"] else "DIFFER"
        out.append(f"{name:>6} {r['recorded']:>11} {r['synthesized']:>11} {r['pct']:>+7.1f}%  "
                   f"tensors {same}, ops {ops}")
    for r in rows:
        name = "outside the blocks" if r["layer"] < 0 else f"layer {r['layer']}"
        keys = sorted(set(r["only_recorded"]) | set(r["only_synth"]), key=str)
        if keys:
            out.append(f"  {name}: {'recorded only':<58} | synthesized only")
            left = [fmt_tensor(k, r["only_recorded"][k]) for k in keys if r["only_recorded"][k]]
            right = [fmt_tensor(k, r["only_synth"][k]) for k in keys if r["only_synth"][k]]
            for i in range(max(len(left), len(right))):
                lt = left[i] if i < len(left) else ""
                rt = right[i] if i < len(right) else ""
                out.append(f"    {lt:<58} | {rt}")
        if r["ops_recorded"] != r["ops_synth"]:
            out.append(f"  {name}: ops recorded    {' > '.join(o or '(root)' for o in r['ops_recorded'])}")
            out.append(f"  {name}: ops synthesized {' > '.join(o or '(root)' for o in r['ops_synth'])}")
    return "\n".join(out)


def run(arch, attn, extra=(), workdir=None, shape=SHAPE):
    """Record, synthesize, compare: (rows, table text)."""
    workdir = workdir or tempfile.mkdtemp(prefix="ferry-synth-vs-rec-")
    rec = os.path.join(workdir, f"recorded-{arch}-{attn}.jsonl")
    syn = os.path.join(workdir, f"synth-{arch}-{attn}.jsonl")
    record(arch, attn, rec, shape, workdir)
    args = synth_args(arch, attn, shape, extra)
    synthesize(syn, args)
    rows = compare(rec, syn)
    title = (f"{arch}, attn_implementation={attn!r}, {DTYPES[shape['dtype']]} on the CPU, "
             f"batch {shape['batch']} x seq {shape['seq']}; ferry trace synth {' '.join(args)}")
    return rows, table(rows, title)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=SHAPE["dtype"])
    ap.add_argument("--workdir", help="keep the two traces there")
    ap.add_argument("extra", nargs="*", help="more `ferry trace synth` flags (after --)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if a.workdir:
        os.makedirs(a.workdir, exist_ok=True)
    rows, text = run(a.arch, a.attn, a.extra, a.workdir, dict(SHAPE, layers=a.layers, dtype=a.dtype))
    print(text)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
