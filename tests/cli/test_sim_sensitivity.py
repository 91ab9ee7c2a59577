#!/usr/bin/env python3
"""ferry sim --mfu-sensitivity on|off|F: each run's replays at the compute
rate x (1 -+ F) beside it (on: F = 0.25). Counted by the JSON's `replays`
(full replays a run took: 3 with the sensitivity, 1 without), not by time:
off replays every run once, and every report says it is off (text, HTML:
the line `sensitivity to the compute rate: off`; JSON: `mfu_sensitivity`
"off", no run's `compute_sensitivity`); F sets the two rates; a bad value,
or the flag with --fit, is refused naming the flag and the value.
  test_sim_sensitivity.py FERRY"""
import json
import os
import subprocess
import sys
import tempfile

from cli_report import finish

FERRY = sys.argv[1]


# two packs and four 300 us compute events without FLOPs: timed as recorded
NO_FLOPS_TRACE = "".join(json.dumps(e) + "\n" for e in [
    {"ev": "header", "t_us": 0, "format": "ferry-trace", "version": 1},
    {"ev": "step_begin", "t_us": 0, "step": 1},
    *[e for i, b in ((1, 100000), (2, 400000)) for e in (
        {"ev": "pack", "t_us": 0, "id": i, "step": 1, "bytes": b, "dtype": "u8", "shape": [b],
         "kind": "activation", "phase": "forward", "layer": i - 1, "layers": 2,
         "decision": "offload"},
        {"ev": "compute", "t_us": 0, "us": 300})],
    {"ev": "backward_begin", "t_us": 0},
    *[e for i in (1, 2) for e in ({"ev": "unpack", "t_us": 0, "id": i},
                                  {"ev": "compute", "t_us": 0, "us": 300})],
    {"ev": "backward_end", "t_us": 0}, {"ev": "step_end", "t_us": 9, "step": 1}])


def sim(d, *args):
    j, h = os.path.join(d, "r.json"), os.path.join(d, "r.html")
    r = subprocess.run([FERRY, "sim", "--policy", "default,layers", "--trace",
                        os.path.join(d, "t.jsonl"), "--steps", "2", "--no-layers", "--json", j,
                        "--html", h, *args], capture_output=True, text=True, timeout=120)
    if r.returncode:
        sys.exit(f"FAIL ferry sim {' '.join(args)}: exit {r.returncode}: {r.stderr[-300:]}")
    with open(j) as f, open(h) as g:
        return r.stdout, json.load(f), g.read()


def runs(rep):
    return [rep["baseline"], *rep["policies"]]


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o",
                        os.path.join(d, "t.jsonl")], check=True, capture_output=True)
        # default (on): three replays a run, the two rates in every run
        out, rep, _ = sim(d)
        if [r["replays"] for r in runs(rep)] != [3, 3, 3] or rep.get("mfu_sensitivity") != 0.25:
            failures.append(f"default: replays {[r['replays'] for r in runs(rep)]}, "
                            f"mfu_sensitivity {rep.get('mfu_sensitivity')!r}: want 3 each, 0.25")
        if any(len(r.get("compute_sensitivity", [])) != 2 for r in runs(rep)):
            failures.append("default: a run without its two compute_sensitivity entries")
        if "sensitivity to the compute rate (" not in out:
            failures.append("default: no sensitivity paragraph in the text")
        step = rep["baseline"]["step_us"]
        # off: one replay a run, and every report says so
        out, rep, html = sim(d, "--mfu-sensitivity", "off")
        if [r["replays"] for r in runs(rep)] != [1, 1, 1]:
            failures.append(f"off: replays {[r['replays'] for r in runs(rep)]}: want 1 each")
        if rep.get("mfu_sensitivity") != "off" or \
                any("compute_sensitivity" in r for r in [rep, *runs(rep)]):
            failures.append(f"off: mfu_sensitivity {rep.get('mfu_sensitivity')!r}, or a "
                            "compute_sensitivity left in the JSON")
        line = "sensitivity to the compute rate: off (--mfu-sensitivity off"
        if line not in out or "step (overhead) at" in out:
            failures.append(f"off: the text does not say it is off: {out[-600:]!r}")
        if line not in html:
            failures.append("off: the HTML report does not say it is off")
        if rep["baseline"]["step_us"] != step:
            failures.append(f"off: the run itself changed: {rep['baseline']['step_us']} "
                            f"vs {step}")
        # F: the rates x 0.9 and x 1.1
        _, rep, _ = sim(d, "--mfu-sensitivity", "0.1", "--tflops", "400")
        got = [e["tflops"] for e in rep["baseline"].get("compute_sensitivity", [])]
        if rep.get("mfu_sensitivity") != 0.1 or len(got) != 2 or \
                abs(got[0] - 360) > 1e-6 or abs(got[1] - 440) > 1e-6:
            failures.append(f"0.1: rates {got}, mfu_sensitivity {rep.get('mfu_sensitivity')!r}: "
                            "want 360 and 440 TFLOP/s")
        # refused, naming the flag and the value
        trace = os.path.join(d, "t.jsonl")
        for args, want in ((["--mfu-sensitivity", "maybe"], "--mfu-sensitivity maybe: expected on, off"),
                           (["--mfu-sensitivity", "0"], "--mfu-sensitivity 0"),
                           (["--mfu-sensitivity", "1"], "--mfu-sensitivity 1"),
                           (["--mfu-sensitivity", "off", "--fit", "device"],
                            "--mfu-sensitivity with --fit")):
            r = subprocess.run([FERRY, "sim", "--policy", "default", "--trace", trace, *args],
                               capture_output=True, text=True, timeout=60)
            if r.returncode != 2 or f"ferry sim: {want}" not in r.stderr:
                failures.append(f"{' '.join(args)}: exit {r.returncode}, {r.stderr.strip()!r}")
        # asked for on a trace whose compute is not timed from FLOPs (recorded
        # times): no replay at other rates can run, and the run says so
        noflops = os.path.join(d, "noflops.jsonl")
        with open(noflops, "w") as f:
            f.write(NO_FLOPS_TRACE)
        for args, said in (([], False), (["--mfu-sensitivity", "0.2"], True),
                           (["--mfu-sensitivity", "off"], False),
                           (["--mfu-sensitivity", "0.2", "-q"], False)):
            r = subprocess.run([FERRY, "sim", "--policy", "default", "--trace", noflops,
                                "--no-layers", *args], capture_output=True, text=True, timeout=60)
            note = "--mfu-sensitivity: not run: no compute in this trace is timed from FLOPs"
            if r.returncode != 0 or (note in r.stderr) != said:
                failures.append(f"no FLOPs, {' '.join(args) or 'default'}: exit {r.returncode}, "
                                f"want the note {'' if said else 'not '}said: {r.stderr.strip()!r}")
    finish(failures, "ok   ferry sim --mfu-sensitivity: on 3 replays a run, off 1 and said so, "
                     "F sets the rates, bad values refused, not run on a trace without FLOPs said")


if __name__ == "__main__":
    main()
