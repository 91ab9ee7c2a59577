#!/usr/bin/env python3
"""`ferry check --json FILE` carries what the text shows, reasons included:
each decision with its rule and file:line, the totals by reason (which add
up to the decisions), the steps and the summary; `--json -` writes only the
JSON to stdout; --why filters the JSON's decisions and totals as it does the
rows; a file that cannot be written is an error.

Usage: test_check_json.py FERRY_BINARY"""
import json
import os
import re
import subprocess
import sys
import tempfile

FERRY = os.path.abspath(sys.argv[1])
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DATA = "tests/cli/check_reasons"
TRACE = f"{DATA}/trace.jsonl"
POLICY = f"{DATA}/policy.lua"
DECIDE = f"{DATA}/decide.lua"
RESIDENT = f"{DATA}/resident.lua"


def check(*args, rc=0):
    r = subprocess.run([FERRY, "check", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    if r.returncode != rc:
        sys.exit(f"FAIL ferry check {' '.join(args)}: exit {r.returncode}, want {rc}\n"
                 f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    return r


def fail(what, doc):
    sys.exit(f"FAIL {what}\n{json.dumps(doc, indent=1)[:4000]}")


def line_of(path, needle):
    with open(os.path.join(ROOT, path)) as f:
        for i, text in enumerate(f, 1):
            if needle in text:
                return i
    sys.exit(f"FAIL {path} has no line with {needle!r}")


def totals(decisions):
    """The totals by reason, recomputed from the decisions."""
    out = {}
    for d in decisions:
        t = out.setdefault((d["rule"], d["where"]), [0, 0, 0, 0, 0])
        t[0] += 1
        if d["decision"] == "offload":
            t[1] += 1
            t[2] += d["bytes"]
        else:
            t[3] += 1
            t[4] += d["bytes"]
    return out


def same_totals(doc):
    got = {(r["rule"], r["where"]): [r["tensors"], r["offloaded"], r["offloaded_bytes"],
                                     r["kept"], r["kept_bytes"]] for r in doc["reasons"]}
    return got == totals(doc["decisions"])


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "check.json")
        r = check("--json", path, "--trace", TRACE, POLICY)
        if "by reason:" not in r.stdout:
            sys.exit(f"FAIL --json FILE: the text goes on as before\n{r.stdout}")
        doc = json.load(open(path))
        if doc["format"] != "ferry-check" or doc["version"] != 1 or doc["name"] != "reasons" \
                or doc["trace"] != TRACE or doc["why"] is not None or \
                doc["knobs"] != {"min_offload_bytes": 1024}:
            fail("header fields", doc)
        dec = doc["decisions"]
        if len(dec) != 20 or doc["summary"]["decisions"] != 20 or len(doc["steps"]) != 2:
            fail("20 decisions in 2 steps", doc)
        want = {"min_bytes(1024)": line_of(POLICY, "R.min_bytes("),
                "exclude_params_and_buffers()": line_of(POLICY, "R.exclude_params_and_buffers("),
                "keep_last_layers(1)": line_of(POLICY, "R.keep_last_layers("),
                "forward_only()": line_of(POLICY, "R.forward_only("),
                "all rules passed": line_of(POLICY, "return R.policy")}
        for x in dec:
            line = want.get(x["rule"], line_of(POLICY, "R.exclude_modules("))
            if x["where"] != f"{POLICY}:{line}":
                fail(f"{x['rule']} should be at {POLICY}:{line}", x)
            if x["decision"] == "offload" and x["rule"] != "all rules passed":
                fail("an offload no rule kept: all rules passed", x)
        q = [x for x in dec if x["module"] == "model.layers.0.self_attn.q_proj"]
        if [(x["decision"], x["reload"], x["distance"], x["cache"]) for x in q] != \
                [("offload", "prefetch", 2, "stored"), ("offload", "prefetch", 2, "hit")] or q[0]["shape"] != [1, 64, 256] or \
                q[0]["dtype"] != "bf16" or q[0]["kind"] != "activation" or q[0]["bytes"] != 32768:
            fail("the q_proj rows", q)
        if [x["cache"] for x in dec if x["module"] == "lm_head"] != ["stored", "hit"]:
            fail("lm_head: stored, then a hit with its reason", dec)
        if not same_totals(doc):
            fail("totals by reason = the decisions added up", doc)
        print("ok   --json FILE: every decision with its rule and file:line; totals add up")

        # --json -: the same document, alone on stdout
        r = check("--json", "-", "--trace", TRACE, POLICY)
        if json.loads(r.stdout) != doc:
            sys.exit(f"FAIL --json -: stdout is not the same JSON alone\n{r.stdout[:2000]}")
        print("ok   --json -: the JSON alone on stdout")

        # --why filters the JSON as the rows
        r = check("--json", "-", "--why", "up_proj", "--trace", TRACE, POLICY)
        w = json.loads(r.stdout)
        if w["why"] != "up_proj" or len(w["decisions"]) != 8 or \
                any("up_proj" not in x["module"] for x in w["decisions"]) or \
                not same_totals(w) or w["summary"]["decisions"] != 20:
            fail("--why up_proj in the JSON", w)
        print("ok   --json with --why: the decisions and totals shown")

        # a hand-written decide: "decide" at its line, "fault" at the error's
        r = check("--json", "-", "-q", "--trace", TRACE, DECIDE, rc=1)
        h = json.loads(r.stdout)
        rules = {(x["rule"], x["where"]) for x in h["decisions"]}
        want = {("decide", f"{DECIDE}:{line_of(DECIDE, 'decide = function')}"),
                ("fault", f"{DECIDE}:{line_of(DECIDE, 'error(')}")}
        if rules != want or h["summary"]["faults"] != 2 or \
                not re.search(r"decide\.lua:\d+: no SiLU here", h["summary"]["last_fault"]):
            fail(f"hand-written decide: reasons {want}", h)
        print("ok   --json: a hand-written decide's and a fault's reasons")

        # resident(r): the synthetic model's parameters and layers, largest
        # first, each with its place and reason; the host share within half
        r = check("--json", "-", "-q", RESIDENT)
        res = json.loads(r.stdout)["resident"]
        opt, wts = res["optimizer"], res["weights"]
        sizes = [x["bytes"] for x in opt]
        total = sum(sizes)
        host = sum(x["bytes"] for x in opt if x["place"] == "host")
        below = line_of(RESIDENT, "R.device_below(")
        frac = line_of(RESIDENT, "R.host_fraction(")
        if len(opt) != 4 * 9 + 3 or sizes != sorted(sizes, reverse=True) or \
                not 0.45 * total < host <= 0.5 * total:
            fail("optimizer states: 39 parameters, largest first, half the bytes on the host", res)
        for x in opt:
            want = (("device_below(65536)", below, "device") if x["bytes"] < 65536
                    else ("host_fraction(0.5)", frac, None))
            if x["rule"] != want[0] or x["where"] != f"{RESIDENT}:{want[1]}" or \
                    (want[2] and x["place"] != want[2]):
                fail(f"{x['name']}: {want}", x)
        if [(x["name"], x["place"], x["rule"]) for x in sorted(wts, key=lambda x: x["layer"])] != \
                [("model.layers.0", "host", "host_first_layers(1)")] + \
                [(f"model.layers.{i}", "device", "device by default") for i in (1, 2, 3)]:
            fail("weights: layer 0 on the host", res)
        text = check("-q", RESIDENT).stdout
        if "optimizer states (resident(r), largest first):" not in text or \
                not re.search(r"on the host: 1 of 4, ", text):
            sys.exit(f"FAIL the text's resident sections\n{text}")
        print("ok   resident(r): optimizer states and weights with reasons and the host share")

        r = check("--json", os.path.join(d, "no", "such", "dir.json"), "-q", POLICY, rc=1)
        if "cannot write" not in r.stderr:
            sys.exit(f"FAIL an unwritable --json file: {r.stderr}")
        print("ok   --json to an unwritable path: exit 1 with the path")


if __name__ == "__main__":
    main()
