#!/usr/bin/env python3
"""The Perfetto/Chrome traces ferry writes, against one schema:

- `ferry sim --chrome-trace` (the simulator's runs);
- a real run: `ferry run --chrome-trace FILE` (alias --trace-out) over
  examples/train_gpt.py (host backend) and over examples/trainer_cuda.c on
  the CUDA test double (cuda backend, copies timed by host functions on
  their streams), and (tests/python/test_chrome_trace_run.py)
  ferry.torch.offload(..., chrome_trace=FILE) from pytest.

Checked everywhere: known phases; every slice on a declared lane with a
known name; compute slices named by layer, or outside the blocks by module
(args module, flops, bytes; the synthesized trace's embedding, final norm,
head and loss, a recorded run's module paths); copies named by module path
with bytes, tensor (and layer inside a layer); every flow arrow with exactly one start on an offload and
one end on the reload of the same tensor, not before the offload ended;
counters never negative; backward before step end. Real runs also: a lane
per calling thread and one per copy stream, copies of one stream never
overlapping (a stream runs its copies in order), copy args tensor, bytes,
module, decision and reload mode, every unpack's tensor packed before, the
device/pinned/stash counters present, step begin < backward < step end per
step.

Usage: test_chrome_trace.py FERRY_BINARY          (the simulator's trace)
       test_chrome_trace.py FERRY_BINARY --run    (ferry run --chrome-trace;
                                                    exit 77 when the build's
                                                    Python package or torch
                                                    cannot be imported)
       test_chrome_trace.py FERRY_BINARY --cuda-trainer TRAINER_CUDA_DOUBLE
       test_chrome_trace.py --check FILE [--real] (check a trace file)"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

SIM_LANES = {"compute", "D2H copies", "H2D copies"}
COPY_LANES = {"D2H copies", "H2D copies"}
# the one_copy_stream knob: reloads run on the offloads' stream, drawn on its
# lane, named for both (a run's, or a simulated run's, D2H lane renamed)
ONE_STREAM = "copies (one stream)"
SIM_LANES_ONE = {"compute", ONE_STREAM, "H2D copies"}
ALL_COPY_LANES = COPY_LANES | {ONE_STREAM}
THREAD_LANE = re.compile(r"compute thread \d+( \(.*\))?")
ENGINE_CALLS = {"pack", "unpack", "discard", "step end"}
REAL_COUNTERS = {"device bytes held (saved tensors)", "pinned host bytes in use",
                 "forward stash depth"}
EPS = 0.002  # µs: timestamps are rounded to the ns


def check(events, real=False, synth=True):
    """Problems found (strings) and the number of offload -> reload arrows."""
    problems = []
    lanes = {}  # (pid, tid) -> lane name
    for e in events:
        if e["ph"] not in "MXsfCi":
            problems.append(f"unknown phase {e}")
        if e["ph"] == "M" and e["name"] == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    names = set(lanes.values())
    per_pid = collections.defaultdict(set)
    for (pid, _), name in lanes.items():
        per_pid[pid].add(name)
    for pid, pnames in per_pid.items():
        if not real and pnames not in (SIM_LANES, SIM_LANES_ONE):
            problems.append(f"pid {pid}: lanes {sorted(pnames)}")
        copy_lanes = pnames & ALL_COPY_LANES
        if real and (copy_lanes not in (COPY_LANES, {ONE_STREAM, "H2D copies"})
                     or not any(THREAD_LANE.fullmatch(n) for n in pnames)
                     or any(n not in ALL_COPY_LANES and not THREAD_LANE.fullmatch(n)
                            for n in pnames)):
            problems.append(f"lanes {sorted(pnames)}: want D2H copies (or {ONE_STREAM}), "
                            "H2D copies and compute threads")
    slices_at = {}  # (pid, tid, ts) -> slice
    packed = set()
    by_lane = collections.defaultdict(list)
    for e in sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"]):
        lane = lanes.get((e["pid"], e.get("tid")))
        if lane is None:
            problems.append(f"slice on an undeclared lane: {e}")
            continue
        if e["ts"] < 0 or e["dur"] < 0:
            problems.append(f"negative time: {e}")
        slices_at[(e["pid"], e["tid"], e["ts"])] = e
        by_lane[(e["pid"], e["tid"])].append(e)
        a = e.get("args", {})
        if lane == "compute":
            # a block's by its layer; outside the blocks by its module (the
            # op or module the trace names: embedding, final norm, head,
            # loss), "outside layers" only where none is known; args module,
            # flops and bytes where the trace gives them
            m = re.fullmatch(r"layer (\d+)", e["name"])
            if m and a.get("layer") != int(m.group(1)):
                problems.append(f"compute slice {e['name']!r} with layer {a.get('layer')}")
            elif not m and e["name"] == "outside layers" and "module" in a:
                problems.append(f"compute slice 'outside layers' of a known module: {e}")
            elif not m and e["name"] != "outside layers" and \
                    (a.get("module") != e["name"] or "layer" in a):
                problems.append(f"compute slice {e['name']!r} not named by its module: {e}")
            for k in ("flops", "bytes"):
                if k in a and not (isinstance(a[k], (int, float)) and a[k] >= 0):
                    problems.append(f"compute slice {k} {a[k]!r}: {e}")
        elif real and lane not in ALL_COPY_LANES:  # a calling thread's lane
            if e["cat"] == "wait":
                if not e["name"].startswith("wait for "):
                    problems.append(f"wait slice name {e['name']!r}")
            elif e["cat"] != "engine" or e["name"] not in ENGINE_CALLS:
                problems.append(f"thread slice {e['name']!r} ({e.get('cat')})")
            elif e["name"] != "step end" and ("tensor" not in a or a.get("bytes", 0) <= 0
                                              or a.get("decision") not in ("keep", "offload")):
                problems.append(f"{e['name']} without its tensor: {e}")
            elif e["name"] == "pack":
                packed.add((e["pid"], a["tensor"]))
            elif e["name"] == "unpack" and (e["pid"], a["tensor"]) not in packed:
                problems.append(f"unpack of tensor {a['tensor']} before its pack: {e}")
        elif e["cat"] == "other":  # a resident buffer's or checkpoint's copy
            if real and e["name"] != "other copy":
                problems.append(f"other copy named {e['name']!r}")
            # the simulator names what it moves: a block's weights, the optimizer's share
            if not real and (e["name"] != "weights" or "layer" not in a) and \
                    e["name"] not in ("optimizer: gradients", "optimizer: parameters"):
                problems.append(f"other copy named {e['name']!r}: {e}")
            if lane not in ALL_COPY_LANES or a.get("bytes", 0) <= 0:
                problems.append(f"other copy off the copy lanes or without bytes: {e}")
        else:
            # the one stream's lane carries both; the others one direction each
            if e["cat"] not in (("offload", "reload") if lane == ONE_STREAM else
                                ("offload",) if lane == "D2H copies" else ("reload",)):
                problems.append(f"copy category: {e}")
            if a.get("bytes", 0) <= 0 or "tensor" not in a:
                problems.append(f"copy without its tensor: {e}")
            elif not real:
                # named by the tensor's module path ("layer" only inside a
                # layer, whose paths a synthesized trace starts model.layers.)
                if e["name"] in ("offload", "reload") or synth and \
                        ("layer" in a) != e["name"].startswith("model.layers."):
                    problems.append(f"copy without its tensor: {e}")
            else:
                module = a.get("module")
                if e["name"] != (module or e["cat"]) or a.get("decision") != "offload" or \
                        ("layer" in a and str(a["layer"]) not in (module or "").split(".")) or \
                        (e["cat"] == "reload" and a.get("reload") not in ("prefetch", "on use")) \
                        or a.get("queued_us", -1) < 0:
                    problems.append(f"copy args: {e}")
    if real:  # a stream runs its copies one after the other
        for (pid, tid), sl in by_lane.items():
            if lanes[(pid, tid)] not in ALL_COPY_LANES:
                continue
            for prev, cur in zip(sl, sl[1:]):
                if cur["ts"] + EPS < prev["ts"] + prev["dur"]:
                    problems.append(f"{lanes[(pid, tid)]}: copies overlap: {prev} {cur}")
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
                off["args"]["tensor"] != rel["args"]["tensor"] or \
                f["ts"] + (EPS if real else 0) < s["ts"] + off["dur"]:
            problems.append(f"flow {fid} does not join an offload to its reload: {s} {f}")
    counters = set()
    for e in events:
        if e["ph"] == "C":
            counters.add(e["name"])
            if any(v < 0 for v in e["args"].values()):
                problems.append(f"negative counter {e}")
    if real and not REAL_COUNTERS <= counters:
        problems.append(f"counters {sorted(counters)}: want {sorted(REAL_COUNTERS)}")
    # instants: per process (the simulator: one step per process) or per step
    marks = collections.defaultdict(dict)
    for e in events:
        if e["ph"] == "i":
            marks[(e["pid"], e.get("args", {}).get("step"))][e["name"]] = e["ts"]
    for (pid, step), m in marks.items():
        order = [n for n in ("step begin", "backward", "step end") if n in m]
        if real and "step end" in m and "step begin" not in m:
            problems.append(f"pid {pid} step {step}: ends without a begin")
        if "backward" in m and "step end" not in m and not real:
            problems.append(f"pid {pid}: backward without a step end")
        if any(m[a] > m[b] for a, b in zip(order, order[1:])) or \
                ("backward" in m and "step end" in m and not m["backward"] < m["step end"]):
            problems.append(f"pid {pid} step {step}: marks out of order {m}")
    return problems, len(flows)


def report(problems, events, nflows, what):
    for p in problems[:20]:
        print("FAIL", p)
    if problems:
        sys.exit(f"{what}: {len(problems)} problem(s) in {len(events)} events")
    print(f"ok   {what}: {len(events)} events, {nflows} offload -> reload arrows, schema holds")


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def sim_trace(ferry, d):
    trace, out = os.path.join(d, "t.jsonl"), os.path.join(d, "run.json")
    subprocess.run([ferry, "trace", "synth", "--preset", "tiny", "-o", trace], check=True,
                   capture_output=True)
    subprocess.run([ferry, "sim", "--trace", trace, "--policy", "default,budget,layers",
                    "--no-layers", "--chrome-trace", out], check=True, capture_output=True)
    events = load(out)
    problems, nflows = check(events)
    if nflows == 0:
        problems.append("no flow arrows: the policies offload on this trace")
    problems += compute_modules(events, with_work=True)
    report(problems, events, nflows, "ferry sim --chrome-trace")
    # weights' and the optimizer's copies beside the activations'
    subprocess.run([ferry, "sim", "--trace", trace, "--policy", "default", "--weight-layers", "2",
                    "--optimizer-fraction", "0.5", "--no-layers", "--chrome-trace", out],
                   check=True, capture_output=True)
    events = load(out)
    problems, nflows = check(events)
    names = collections.Counter(e["name"] for e in events if e.get("cat") == "other")
    # blocks 0 and 1, each way, in the last step; a chunk of the optimizer's a layer and one more
    if names["weights"] != 4 or names["optimizer: gradients"] == 0:
        problems.append(f"resident copies of the weights and the optimizer: {dict(names)}")
    report(problems, events, nflows, "ferry sim --chrome-trace --weight-layers --optimizer-fraction")
    # one_copy_stream: the reloads on the offloads' lane; default's unchanged beside it
    subprocess.run([ferry, "sim", "--trace", trace, "--policy", "default," + one_stream_policy(d),
                    "--no-layers", "--chrome-trace", out],
                   check=True, capture_output=True)
    events = load(out)
    problems, nflows = check(events)
    cats, ends = copy_lanes_by_process(events)
    problems += one_stream_lanes(cats, ends, "one_stream", True)
    problems += one_stream_lanes(cats, ends, "default", False)
    report(problems, events, nflows, "ferry sim --chrome-trace, a policy with one_copy_stream")


def one_stream_policy(d):
    """policies/default.lua with R.one_copy_stream(): reloads on the offloads' stream."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "policies", "default.lua")) as f:
        src = f.read()
    anchor = "  R.max_stash(FWD_STASH),\n"
    if anchor not in src:
        sys.exit("policies/default.lua has no R.max_stash(FWD_STASH) line to add the rule after")
    path = os.path.join(d, "one_stream.lua")
    with open(path, "w") as f:
        f.write(src.replace(anchor, anchor + "  R.one_copy_stream(),\n", 1))
    return path


def copy_lanes_by_process(events):
    """{process name: {lane name: Counter of copy categories}}, and the flow
    ends ("f": the reload's) by process and lane."""
    procs, lanes = {}, {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "thread_name":
            lanes[(e["pid"], e["tid"])] = e["args"]["name"]
    cats = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    for pid, name in procs.items():  # every declared lane, slices or not
        for (p, _), lane in lanes.items():
            if p == pid:
                cats[name][lane].update()
    flow_ends = collections.defaultdict(collections.Counter)
    for e in events:
        if e["ph"] == "X" and e.get("cat") in ("offload", "reload", "other"):
            cats[procs[e["pid"]]][lanes[(e["pid"], e["tid"])]][e["cat"]] += 1
        if e["ph"] == "f":
            flow_ends[procs[e["pid"]]][lanes[(e["pid"], e["tid"])]] += 1
    return cats, flow_ends


def one_stream_lanes(cats, flow_ends, name, one_stream):
    """Problems with process name's copy lanes: with one_stream, its reloads
    (and every arrow's end) on the shared lane and nothing on the H2D lane;
    without, the two lanes as ever."""
    lanes, ends = cats.get(name), flow_ends.get(name, {})
    if lanes is None:
        return [f"no process {name!r} in {sorted(cats)}"]
    problems = []
    if one_stream:
        shared = lanes.get(ONE_STREAM, collections.Counter())
        if "D2H copies" in lanes:
            problems.append(f"{name}: a D2H copies lane beside {ONE_STREAM!r}: {dict(lanes)}")
        if shared["reload"] == 0 or shared["offload"] == 0:
            problems.append(f"{name}: want offloads and reloads on {ONE_STREAM!r}: {dict(lanes)}")
        if sum(lanes.get("H2D copies", collections.Counter()).values()):
            problems.append(f"{name}: slices on the H2D lane: {dict(lanes['H2D copies'])}")
        if not ends or set(ends) != {ONE_STREAM}:
            problems.append(f"{name}: arrows end on {dict(ends)}: want {ONE_STREAM!r}")
    else:
        if ONE_STREAM in lanes:
            problems.append(f"{name}: a {ONE_STREAM!r} lane without the knob")
        if lanes.get("H2D copies", {}).get("reload", 0) == 0 or \
                lanes.get("D2H copies", {}).get("reload", 0):
            problems.append(f"{name}: reloads not on the H2D lane: {dict(lanes)}")
    return problems


def compute_modules(events, with_work):
    """The compute outside the blocks, named by module: the synthesized
    trace's embedding, final norm, head and loss (with_work: each with its
    FLOPs and bytes, and a block's op too), or a recorded trace's modules."""
    problems = []
    outside = collections.defaultdict(list)
    inside = []
    for e in events:
        if e["ph"] == "X" and e.get("cat") == "compute":
            (inside if "layer" in e.get("args", {}) else outside[e["name"]]).append(e)
    names = set(outside)
    if with_work:
        want = {"model.embed_tokens", "model.norm", "lm_head"}
        if not want <= names or not any(n.startswith("loss.") for n in names):
            problems.append(f"compute outside the blocks named {sorted(names)}: want {sorted(want)}"
                            " and the loss's")
        for name, sl in outside.items():
            if any("flops" not in e["args"] or "bytes" not in e["args"] for e in sl):
                problems.append(f"compute {name!r} without its FLOPs and bytes")
        if not any(e["args"].get("flops", 0) > 0 and e["args"].get("module") for e in inside):
            problems.append("no block compute slice with its op and FLOPs")
    elif not names - {"outside layers"}:
        problems.append(f"compute outside the blocks named {sorted(names)}: want module paths")
    return problems


def run_trace(ferry, d):
    """ferry run --trace-out over examples/train_gpt.py (2 steps, host backend)."""
    build = os.path.dirname(os.path.dirname(os.path.abspath(ferry)))  # <build>/bin/ferry
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    if os.environ.get("FERRY_TEST_SANITIZED") == "1":
        print("SKIP: a sanitizer build's extension cannot be loaded into Python")
        sys.exit(77)
    # an interpreter with torch for which the build made the extension
    venv = os.environ.get("FERRY_VENV") or os.path.expanduser("~/.cache/ferry/venv-torch2")
    python, why = None, []
    for cand in (sys.executable, "/usr/bin/python3", os.path.join(venv, "bin", "python")):
        if not os.access(cand, os.X_OK):
            continue
        probe = subprocess.run([cand, "-c", "import torch, ferry.torch"], env=env,
                               capture_output=True, text=True)
        if probe.returncode == 0:
            python = cand
            break
        why.append(f"{cand}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    if not python:
        print("SKIP: no interpreter here imports torch and the build's ferry package:", why)
        sys.exit(77)
    out = os.path.join(d, "run-%p.json")
    jsonl = os.path.join(d, "recorded.jsonl")
    r = subprocess.run([ferry, "run", "--trace-out", out, "--trace", jsonl, "--backend", "host", "--",
                        python, os.path.join(repo, "examples", "train_gpt.py"),
                        "--steps", "2", "--policy", "default"],
                       env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"ferry run failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    files = [f for f in os.listdir(d) if f.startswith("run-") and f.endswith(".json")]
    if len(files) != 1 or not re.fullmatch(r"run-\d+\.json", files[0]):
        sys.exit(f"want one run-PID.json (%p is the process id), found {files}")
    events = load(os.path.join(d, files[0]))
    problems, nflows = check(events, real=True)
    steps = {e["args"]["step"] for e in events if e["ph"] == "i" and e["name"] == "step end"}
    if steps != {1, 2}:
        problems.append(f"step ends {sorted(steps)}: want 1 and 2")
    if nflows == 0:
        problems.append("no flow arrows: default.lua offloads train_gpt.py's activations")
    report(problems, events, nflows, "ferry run --trace-out")
    # the simulator's view of the same run: its compute named by module
    sim_out = os.path.join(d, "recorded-sim.json")
    r = subprocess.run([ferry, "sim", "--trace", jsonl, "--policy", "default", "--no-layers",
                        "--chrome-trace", sim_out], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"ferry sim of the recorded run failed ({r.returncode}):\n{r.stderr[-2000:]}")
    events = load(sim_out)
    problems, nflows = check(events, synth=False)
    problems += compute_modules(events, with_work=False)
    report(problems, events, nflows, "ferry sim --chrome-trace of the recorded run")


def cuda_trace(ferry, trainer, d):
    """ferry run --trace-out over trainer_cuda on the CUDA test double: 3
    steps of 8 layers, 6 offloaded each step; every copy timed by the
    backend (no "observed" timing), none overlapping on its stream."""
    out = os.path.join(d, "cuda.json")
    r = subprocess.run([ferry, "run", "--trace-out", out, "--", trainer, "--steps", "3"],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"trainer failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    events = load(out)
    problems, nflows = check(events, real=True)
    copies = [e for e in events if e["ph"] == "X" and e.get("cat") in ("offload", "reload")]
    offloads = sum(e["cat"] == "offload" for e in copies)
    if offloads != 18:
        problems.append(f"{offloads} offload slices: want 18 (6 layers x 3 steps)")
    problems += [f"copy not timed by the backend: {e}" for e in copies
                 if e["args"].get("timing") == "observed"]
    if nflows == 0:
        problems.append("no flow arrows")
    report(problems, events, nflows, "ferry run --trace-out -- trainer_cuda (CUDA double)")
    # the same with one_copy_stream: the reloads drawn on the offloads' stream
    r = subprocess.run([ferry, "run", "--policy", one_stream_policy(d), "--trace-out", out, "--",
                        trainer, "--steps", "3"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"trainer failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    events = load(out)
    problems, nflows = check(events, real=True)
    cats, ends = copy_lanes_by_process(events)
    problems += one_stream_lanes(cats, ends, next(iter(cats)), True)
    report(problems, events, nflows, "ferry run --trace-out -- trainer_cuda, one_copy_stream")


def main():
    if sys.argv[1] == "--check":
        events = load(sys.argv[2])
        problems, nflows = check(events, real="--real" in sys.argv)
        report(problems, events, nflows, sys.argv[2])
        return
    with tempfile.TemporaryDirectory() as d:
        if "--run" in sys.argv[2:]:
            run_trace(sys.argv[1], d)
        elif "--cuda-trainer" in sys.argv[2:]:
            cuda_trace(sys.argv[1], sys.argv[sys.argv.index("--cuda-trainer") + 1], d)
        else:
            sim_trace(sys.argv[1], d)


if __name__ == "__main__":
    main()
