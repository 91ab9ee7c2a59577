#!/usr/bin/env python3
"""Every simulated memory saving and step overhead of `ferry sim` carries its
error band from docs/sim-validation.md's validation table (sim_bands.c), in the
text report, the JSON (`band`, docs/sim-outputs.md "Outputs") and the HTML
table: a 1-GPU eager long-context trace gets axolotl #3733's rows, an
8-GPU compiled one torchtitan's (copies hidden) or DeepSpeed's and
PyTorch's (copy-bound), and an optimizer-offload run no band, said so.
  test_sim_bands.py FERRY"""
import json
import os
import re
import subprocess
import sys
import tempfile

from cli_report import finish

FERRY = sys.argv[1]
AX = "axolotl-ai-cloud/axolotl#3733"


def run(*args):
    r = subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=120)
    if r.returncode:
        sys.exit(f"FAIL ferry {' '.join(args)}: exit {r.returncode}: {r.stderr[-400:]}")
    return r.stdout


def sim(d, trace, policies, *extra):
    j, h = os.path.join(d, "r.json"), os.path.join(d, "r.html")
    out = run("sim", "--trace", trace, "--policy", policies, "--hw", "h100", "--steps", "2",
              "--no-layers", "--json", j, "--html", h, *extra)
    with open(j) as f:
        rep = json.load(f)
    with open(h) as f:
        html = f.read()
    return out, rep, html


def check_band(failures, name, pol):
    """The band's figures agree with the policy's own: value, and the real
    range = value - points (an overhead's clamped at 0)."""
    band = pol.get("band")
    if not band:
        failures.append(f"{name}: no band")
        return
    for fig, key in (("memory", "device_reduction_pct"), ("overhead", "step_overhead_pct")):
        b = band[fig]
        lo, hi = b["points"]
        if lo > hi:
            failures.append(f"{name} {fig}: points {lo} > {hi}")
        if abs(b["value_pct"] - pol[key]) > 1e-6:
            failures.append(f"{name} {fig}: value_pct {b['value_pct']} != {key} {pol[key]}")
        want = [pol[key] - hi, pol[key] - lo]
        if fig == "overhead":
            want = [max(0.0, w) for w in want]
        if any(abs(a - w) > 1e-6 for a, w in zip(b["real_pct"], want)):
            failures.append(f"{name} {fig}: real_pct {b['real_pct']}, want {want}")
        if b["runs"] < 2 or b["publications"] < 2 or len(b["rows"]) < b["runs"]:
            failures.append(f"{name} {fig}: {b['runs']} runs, rows {b['rows']}")
    copy = pol["step_overhead_pct"] >= 5
    if band["run"]["copy_bound"] != copy:
        failures.append(f"{name}: copy_bound {band['run']['copy_bound']} at overhead "
                        f"{pol['step_overhead_pct']}")


def html_points(html):
    """(figure, lo, hi) of every band in the HTML table, in order."""
    return [(m.group(1), float(m.group(2)), float(m.group(3))) for m in
            re.finditer(r'<small class="band" data-figure="(\w+)" data-points="([-\d.]+),([-\d.]+)"',
                        html)]


def recorded_trace_gpus(failures, d):
    """A trace recorded by ferry.torch (version 1: no seq, shard or tp in its
    header) says nothing of its GPUs: --gpus-per-node's default of 1 must not
    class it as a 1-GPU run; given, it does."""
    rec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded_h200", "trace.jsonl")
    out, rep, _ = sim(d, rec, "layers", "--hw", "h200")
    run_ = rep["policies"][0]["band"]["run"]
    if run_["gpus"] is not None or run_["compiled"] is not None or run_["seq"] is not None:
        failures.append(f"recorded trace: band.run {run_} (its header gives no GPUs, compile, seq)")
    if "this trace: GPUs not given (--gpus-per-node)" not in out:
        failures.append("recorded trace: the class line does not say the GPUs are not given")
    _, rep, _ = sim(d, rec, "layers", "--hw", "h200", "--gpus-per-node", "1")
    if rep["policies"][0]["band"]["run"]["gpus"] != 1:
        failures.append(f"recorded trace, --gpus-per-node 1: {rep['policies'][0]['band']['run']}")


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        # 1 GPU, eager (reentrant checkpoint), seq 16384: long context
        t1 = os.path.join(d, "long.jsonl")
        run("trace", "synth", "-q", "--preset", "tiny", "--seq", "16384", "--shard", "1",
            "--checkpoint", "full", "--checkpoint-impl", "reentrant", "-o", t1)
        out, rep, html = sim(d, t1, "checkpointed_inputs,default")
        if "this trace: 1 GPU, eager, seq 16384 (long context)" not in out:
            failures.append("text: no class line for the 1-GPU long trace")
        ci = rep["policies"][0]
        if ci["name"] != "checkpointed_inputs" or ci["step_overhead_pct"] >= 5:
            failures.append(f"setup: checkpointed_inputs overhead {ci['step_overhead_pct']}")
        mem = ci["band"]["memory"]
        # axolotl #3733's two long rows are one publication: accelerate's CP 8
        # run joins them, GPUs given up
        if mem["points"] != [-2.9, 17.6] or mem["all"] or mem["publications"] != 2 or \
                mem["rows"] != ["huggingface/accelerate#4175 Qwen3-0.6B, 1M tokens over CP 8",
                                f"{AX} hidden_states, seq 16k", f"{AX} hidden_states, seq 32k"]:
            failures.append(f"1 GPU eager long: memory band {mem}")
        run_ = ci["band"]["run"]
        if run_ != {"gpus": 1, "compiled": False, "seq": 16384, "cp": 1, "long_context": True,
                    "copy_bound": False, "other_offload": False}:
            failures.append(f"band.run {run_}")
        line = re.search(r"\n  checkpointed_inputs +memory saved ([\d.]+)%: -2\.9 to \+17\.6 points "
                         r"on 3 published runs from 2 publications \(long context, copies hidden\) "
                         r"-> a real run: (-?[\d.]+)% to ([\d.]+)%\n", out)
        if not line:
            failures.append("text: no memory band line for checkpointed_inputs")
        elif abs(float(line.group(2)) - (float(line.group(1)) - 17.6)) > 0.051 or \
                abs(float(line.group(3)) - (float(line.group(1)) + 2.9)) > 0.051:
            failures.append(f"text: real run {line.group(2)} for saved {line.group(1)}")
        if not re.search(r"\n {25}step overhead [+-][\d.]+%: -3\.7 to -0\.4 points on 2 published "
                         r"runs from 2 publications \(long context, copies hidden\)", out):
            failures.append("text: no overhead band line for checkpointed_inputs")
        for i, p in enumerate(rep["policies"]):
            check_band(failures, f"1-GPU policy {p['name']}", p)
        if rep.get("band") != ci["band"]:
            failures.append("the top level's band is not the first policy's")
        if "band" in rep["baseline"]:
            failures.append("the baseline (no offload) carries a band")
        want = []
        for p in rep["policies"]:
            for fig in ("memory", "overhead"):
                want.append((fig, *[round(x, 1) for x in p["band"][fig]["points"]]))
        if html_points(html) != want:
            failures.append(f"HTML bands {html_points(html)}, JSON {want}")
        if "how sure" not in html:
            failures.append("HTML: the text report lacks the bands")

        # 8 GPUs, compiled (selective-op, compiled), seq 4096: torchtitan's
        # rows for a policy whose copies hide, DeepSpeed's and PyTorch's for
        # a copy-bound one
        t8 = os.path.join(d, "c8.jsonl")
        run("trace", "synth", "-q", "--preset", "tiny", "--seq", "4096", "--shard", "8",
            "--checkpoint", "selective-op", "--checkpoint-impl", "compiled", "-o", t8)
        out, rep, _ = sim(d, t8, "checkpointed_inputs,default", "--gpus-per-node", "8")
        hidden, bound = rep["policies"]
        if hidden["step_overhead_pct"] >= 5 or bound["step_overhead_pct"] < 5:
            failures.append(f"setup: overheads {hidden['step_overhead_pct']}, "
                            f"{bound['step_overhead_pct']}")
        # torchtitan's sweep (4 rows, one publication) and Megatron's row
        tt = [r for r in hidden["band"]["memory"]["rows"] if r.startswith("pytorch/torchtitan#")]
        if len(tt) != 4 or hidden["band"]["memory"]["rows"] != \
                tt + ["NVIDIA/Megatron-LM#1752 QKV input only"]:
            failures.append(f"8 GPUs compiled, hidden: memory rows {hidden['band']['memory']['rows']}")
        ov = bound["band"]["overhead"]
        if sorted(r.split()[0] for r in ov["rows"]) != ["deepspeedai/DeepSpeed#8255"] * 2 + \
                ["pytorch/pytorch#186161"] or ov["points"] != [-13.9, 66.2]:
            failures.append(f"8 GPUs compiled, copy-bound: overhead band {ov}")
        if bound["band"]["run"]["compiled"] is not True or bound["band"]["run"]["gpus"] != 8:
            failures.append(f"8 GPUs compiled: run {bound['band']['run']}")
        for p in rep["policies"]:
            check_band(failures, f"8-GPU policy {p['name']}", p)

        # optimizer-state offload: no published run does it, so no band, said so
        # in the text, the JSON and the HTML
        out, rep, html = sim(d, t1, "default", "--optimizer-fraction", "0.5")
        b = rep["policies"][0]["band"]
        for fig in ("memory", "overhead"):
            if b[fig]["runs"] or b[fig]["points"] or b[fig]["real_pct"] or b[fig]["rows"] or \
                    b[fig]["all"] or not b["run"]["other_offload"]:
                failures.append(f"optimizer offload: {fig} band {b[fig]}")
        if out.count("no band: no published run offloads optimizer states or weights") != 2 or \
                re.search(r"opt=0\.5 .*a real run", out):
            failures.append("text: optimizer offload: no band is not said")
        if html.count(">no band<br/>not validated</small>") != 2 or "data-points" in html:
            failures.append("HTML: optimizer offload: no band is not said")
        recorded_trace_gpus(failures, d)
    finish(failures, "ok: bands in text, JSON and HTML; rows like the run; fallback said")


if __name__ == "__main__":
    main()
