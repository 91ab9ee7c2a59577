#!/usr/bin/env python3
"""summary.json of a GPU run, and its check.

  summary.py STEPS OUT.json      collect: on-device.sh's step records
                                 (STEPS/NAME.step) and the checks' fragments
                                 (STEPS/NAME.json) into one object; exit 1 if a
                                 step failed, timed out or did not run
  summary.py --check FILE [--no-gpu]
                                 every step and every figure of schema.py is
                                 there; --no-gpu: the build steps passed, every
                                 other step says "no GPU" and its figures are
                                 null (what `make gpu-rehearse` expects)

summary.json: {"gpu": bool, "run": {the env figures}, "steps": {NAME:
{"status", "seconds", "reason"}}, "figures": {KEY: value or null}, "notes"}.
"""
import json
import os
import sys

import schema


def read_step(steps, name):
    rec = {"status": "not run", "seconds": None, "reason": "on-device.sh did not reach it"}
    p = os.path.join(steps, name + ".step")
    if os.path.exists(p):
        status, secs, _rc, reason = (open(p).read().rstrip("\n").split("\t") + [""] * 4)[:4]
        rec = {"status": status, "seconds": float(secs), "reason": reason or None}
    frag = None
    p = os.path.join(steps, name + ".json")
    if os.path.exists(p):
        with open(p) as f:
            frag = json.load(f)
        if rec["status"] == "ok" and frag.get("status") != "ok":
            rec.update(status=frag["status"], reason=frag.get("reason"))
    elif rec["status"] == "ok" and name in schema.FIGURES and schema.FIGURES[name] \
            and name != "suite":
        rec.update(status="failed", reason="exited 0 but wrote no figures")
    return rec, frag


def collect(steps, out):
    summary = {"gpu": not os.environ.get("FERRY_GPU_NO_GPU"), "run": {}, "steps": {},
               "figures": {}, "notes": {}}
    for name in schema.STEPS:
        rec, frag = read_step(steps, name)
        summary["steps"][name] = rec
        figures = dict.fromkeys(schema.FIGURES.get(name, []))
        if frag:
            unknown = set(frag["figures"]) - set(figures)
            if unknown:
                rec.update(status="failed", reason=f"figures not in schema.py: {sorted(unknown)}")
            figures.update({k: v for k, v in frag["figures"].items() if k in figures})
            if frag.get("notes"):
                summary["notes"][name] = frag["notes"]
        (summary["run"] if name == "env" else summary["figures"]).update(figures)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    bad = {n: r for n, r in summary["steps"].items()
           if r["status"] not in ("ok", "no GPU", "skipped")}
    for n, r in summary["steps"].items():
        print(f"  {n:12} {r['status']:8} {r['seconds'] if r['seconds'] is not None else '-':>6}"
              f"  {r['reason'] or ''}")
    if bad:
        print(f"summary: {len(bad)} step(s) did not pass: {', '.join(bad)}")
        return 1
    return 0


def check(path, no_gpu):
    with open(path) as f:
        s = json.load(f)
    errors = []
    for section in ("gpu", "run", "steps", "figures"):
        if section not in s:
            errors.append(f"no {section!r}")
    for name in schema.STEPS:
        rec = s.get("steps", {}).get(name)
        if rec is None:
            errors.append(f"step {name} missing")
            continue
        if rec.get("status") not in schema.STATUSES:
            errors.append(f"step {name}: status {rec.get('status')!r}")
        want = "ok" if (name in schema.BUILD_STEPS or name == "env") else "no GPU"
        if no_gpu and rec.get("status") != want:
            errors.append(f"step {name}: {rec.get('status')} ({rec.get('reason')}), not {want!r}")
    for name, keys in schema.FIGURES.items():
        where = s.get("run" if name == "env" else "figures", {})
        for k in keys:
            if k not in where:
                errors.append(f"figure {k} ({name}) missing")
            elif no_gpu and name != "env" and where[k] is not None:
                errors.append(f"figure {k} is {where[k]!r} without a GPU")
    if no_gpu:
        if s.get("gpu"):
            errors.append("gpu is true")
        for k in ("torch", "python", "date"):
            if not s.get("run", {}).get(k):
                errors.append(f"run.{k} empty")
    for e in errors:
        print(f"summary check: {e}")
    n = sum(len(v) for v in schema.FIGURES.values())
    print(f"summary check: {path}: {len(schema.STEPS)} steps, {n} figures: "
          f"{'ok' if not errors else f'{len(errors)} problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "--check":
        sys.exit(check(argv[1], "--no-gpu" in argv[2:]))
    if len(argv) != 2:
        sys.exit(__doc__)
    sys.exit(collect(*argv))
