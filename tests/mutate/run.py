#!/usr/bin/env python3
"""make mutate: plant each mutant of tests/mutate/mutants.py (one small
deliberate bug), rebuild, run the suite that should catch it, restore.

    python3 tests/mutate/run.py [--build DIR] [--json FILE] [ID ...]

A mutant is killed when a test fails (or the build breaks: reported as
such, not counted as a kill), survived when every test passes. Each result
names the tests that failed. Exit status 1 below the 90% target.
The source files are restored after each mutant, also on Ctrl-C.
"""
import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutants import MUTANTS  # noqa: E402

TARGET = 0.90


def sh(cmd, cwd=ROOT, env=None, timeout=900):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def build(bdir):
    r = sh(["cmake", "--build", bdir, "-j", os.environ.get("JOBS", "2")])
    return r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@functools.lru_cache(maxsize=None)
def default_python():
    """The torch 2.x interpreter `make test` uses (the DCP, compile and HF
    tests skip on Debian's torch 1.13, which would let their mutants live)."""
    r = sh([os.path.join(ROOT, ".ci", "python-env")])
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines or not os.access(lines[-1], os.X_OK):
        sys.exit("mutate: no torch 2.x interpreter (.ci/python-env failed); "
                 "set FERRY_MUTATE_PYTHON")
    return lines[-1]


def run_suite(bdir, suite):
    """Failed test names for suite "c" (the C suite: ferry_tests),
    "py:<pytest args>" (pytest over the build tree's package) or
    "cli:<script>" (a tests/cli script run on the build's ferry)."""
    if suite == "c":
        try:
            r = sh([os.path.join(bdir, "bin", "ferry_tests")], timeout=600)
        except subprocess.TimeoutExpired:
            return ["(timeout)"]
        failed = re.findall(r"^FAIL (\S+)", r.stdout + r.stderr, re.M)
        if r.returncode != 0 and not failed:
            failed.append(f"(exit {r.returncode}: a crash or abort)")
        return failed
    if suite.startswith("cli:"):  # a tests/cli script, given the ferry binary
        try:
            r = sh([sys.executable, suite[4:], os.path.join(bdir, "bin", "ferry")], timeout=600)
        except subprocess.TimeoutExpired:
            return ["(timeout)"]
        return [suite[4:]] if r.returncode else []
    args = suite[3:].split()
    env = dict(os.environ, PYTHONPATH=os.path.join(bdir, "python"))
    py = os.environ.get("FERRY_MUTATE_PYTHON") or default_python()
    try:
        r = sh([py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"] + args, env=env,
               timeout=600)
    except subprocess.TimeoutExpired:
        return ["(timeout)"]
    failed = re.findall(r"^FAILED (\S+)", r.stdout, re.M)
    if r.returncode not in (0, 5) and not failed:
        failed.append(f"(pytest exit {r.returncode})")
    return failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build-mutate"))
    ap.add_argument("--json", default=os.path.join(ROOT, "build", "mutate.json"))
    ap.add_argument("ids", nargs="*")
    a = ap.parse_args()
    chosen = [m for m in MUTANTS if not a.ids or m["id"] in a.ids]
    ids = [m["id"] for m in MUTANTS]
    if len(ids) != len(set(ids)):
        sys.exit("mutate: duplicate mutant ids")
    r = sh(["cmake", "-S", ".", "-B", a.build, "-DFERRY_WERROR=ON"])
    if r.returncode:
        sys.exit("mutate: configure failed:\n" + r.stderr[-3000:])
    ok, log = build(a.build)
    if not ok:
        sys.exit("mutate: the unmutated build fails:\n" + log)
    for suite in sorted({m["suite"] for m in chosen}):
        failed = run_suite(a.build, suite)
        if failed:
            sys.exit(f"mutate: suite {suite} fails without any mutant: {failed}")
    results = []
    for m in chosen:
        path = os.path.join(ROOT, m["file"])
        src = open(path).read()
        if src.count(m["old"]) != 1:
            results.append(dict(m, result="stale", tests=[],
                                note=f"the snippet occurs {src.count(m['old'])} times"))
            print(f"STALE    {m['id']}: snippet occurs {src.count(m['old'])} times in {m['file']}")
            continue
        t0 = time.time()
        backup = path + ".mutate-orig"
        shutil.copy2(path, backup)
        try:
            with open(path, "w") as f:
                f.write(src.replace(m["old"], m["new"]))
            ok, log = build(a.build)
            failed = run_suite(a.build, m["suite"]) if ok else []
        finally:
            shutil.move(backup, path)
            # the restored file keeps its old mtime (copy2), older than the
            # mutant's object: touch it or make keeps the mutant built in
            os.utime(path)
        result = "build-broken" if not ok else ("killed" if failed else "survived")
        results.append(dict(m, result=result, tests=failed[:5], seconds=round(time.time() - t0, 1)))
        print(f"{result.upper():9}{m['id']:40} {m['class']:22} {', '.join(failed[:2])}", flush=True)
    build(a.build)  # leave the tree's build as the sources are
    counted = [x for x in results if x["result"] in ("killed", "survived")]
    killed = sum(x["result"] == "killed" for x in counted)
    score = killed / len(counted) if counted else 0.0
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"mutants": len(results), "counted": len(counted), "killed": killed,
                   "score": score, "target": TARGET, "results": results}, f, indent=1)
    print(f"\nmutate: {killed}/{len(counted)} killed ({score:.0%}, target {TARGET:.0%}); "
          f"{len(results) - len(counted)} stale or build-broken; details in {a.json}")
    survivors = [x["id"] for x in results if x["result"] == "survived"]
    if survivors:
        print("survived (each needs a test or an entry in tests/MUTANTS.md): " + ", ".join(survivors))
    return 0 if score >= TARGET and not any(x["result"] == "stale" for x in results) else 1


if __name__ == "__main__":
    sys.exit(main())
