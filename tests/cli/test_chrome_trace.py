#!/usr/bin/env python3
"""The Perfetto/Chrome trace of `ferry sim --chrome-trace` against its
schema: known phases; every slice on a declared lane with a known name;
copies named by module path with bytes, tensor and (inside a layer) layer; every flow arrow
with exactly one start on an offload and one end on the reload of the same
tensor, not before it; counters never negative; backward before step end.

Usage: test_chrome_trace.py FERRY_BINARY"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

FERRY = sys.argv[1]
LANES = {"compute", "D2H copies", "H2D copies"}


def check(events):
    problems = []
    lanes = {}  # (pid, tid) -> lane name
    for e in events:
        if e["ph"] not in "MXsfCi":
            problems.append(f"unknown phase {e}")
        if e["ph"] == "M" and e["name"] == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    if set(lanes.values()) != LANES:
        problems.append(f"lanes {sorted(set(lanes.values()))}")
    slices_at = {}  # (pid, tid, ts) -> slice
    for e in events:
        if e["ph"] != "X":
            continue
        lane = lanes.get((e["pid"], e["tid"]))
        if lane is None:
            problems.append(f"slice on an undeclared lane: {e}")
            continue
        if e["ts"] < 0 or e["dur"] < 0:
            problems.append(f"negative time: {e}")
        slices_at[(e["pid"], e["tid"], e["ts"])] = e
        if lane == "compute":
            if not re.fullmatch(r"layer \d+|outside layers", e["name"]):
                problems.append(f"compute slice name {e['name']!r}")
        else:
            a = e["args"]
            # named by the tensor's module path ("layer" only inside a layer)
            if a.get("bytes", 0) <= 0 or "tensor" not in a or e["name"] in ("offload", "reload") \
                    or ("layer" in a) != e["name"].startswith("model.layers."):
                problems.append(f"copy without its tensor: {e}")
            if e["cat"] != ("offload" if lane == "D2H copies" else "reload"):
                problems.append(f"copy category: {e}")
    flows = collections.defaultdict(list)
    for e in events:
        if e["ph"] in "sf":
            flows[e["id"]].append(e)
    for fid, ends in flows.items():
        phs = sorted(x["ph"] for x in ends)
        if phs != ["f", "s"]:
            problems.append(f"flow {fid}: ends {phs}")
            continue
        s, f = sorted(ends, key=lambda x: x["ph"], reverse=True)
        off = slices_at.get((s["pid"], s["tid"], s["ts"]))
        rel = slices_at.get((f["pid"], f["tid"], f["ts"]))
        if not off or not rel or off["cat"] != "offload" or rel["cat"] != "reload" or \
                off["args"]["tensor"] != rel["args"]["tensor"] or f["ts"] < s["ts"] + off["dur"]:
            problems.append(f"flow {fid} does not join an offload to its reload: {s} {f}")
    for e in events:
        if e["ph"] == "C" and any(v < 0 for v in e["args"].values()):
            problems.append(f"negative counter {e}")
    marks = {(e["pid"], e["name"]): e["ts"] for e in events if e["ph"] == "i"}
    for (pid, name), ts in marks.items():
        if name == "backward" and not ts < marks.get((pid, "step end"), -1):
            problems.append(f"pid {pid}: backward at {ts}, not before the step's end")
    return problems, len(flows)


def main():
    with tempfile.TemporaryDirectory() as d:
        trace, out = os.path.join(d, "t.jsonl"), os.path.join(d, "run.json")
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", trace], check=True,
                       capture_output=True)
        subprocess.run([FERRY, "sim", "--trace", trace, "--policy", "default,budget,layers",
                        "--no-layers", "--chrome-trace", out], check=True, capture_output=True)
        with open(out) as f:
            events = json.load(f)["traceEvents"]
        problems, nflows = check(events)
        if nflows == 0:
            problems.append("no flow arrows: the policies offload on this trace")
        for p in problems[:20]:
            print("FAIL", p)
        if problems:
            sys.exit(f"{len(problems)} problem(s) in {len(events)} events")
        print(f"ok   {len(events)} events, {nflows} offload -> reload arrows, schema holds")


if __name__ == "__main__":
    main()
