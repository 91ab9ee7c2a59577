#!/usr/bin/env python3
"""`ferry check` gives every decision its reason: the rule that made it and
the file:line where the policy wrote it.

  - golden: `ferry check --trace` on the small bundled trace
    (check_reasons/trace.jsonl) with a rules-library policy and with a
    hand-written decide prints exactly check_reasons/*.golden (rows, reasons,
    totals by reason);
  - bare policy names keep working, synthetic model and trace alike, and
    their reasons point at the shipped file's lines;
  - --why PATTERN keeps the rows (and totals) whose rule, file:line or
    module path contains PATTERN.

Usage: test_check_reasons.py FERRY_BINARY
FERRY_UPDATE_GOLDEN=1 rewrites the golden files from the current output."""
import difflib
import os
import re
import subprocess
import sys

FERRY = os.path.abspath(sys.argv[1])
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DATA = "tests/cli/check_reasons"
TRACE = f"{DATA}/trace.jsonl"
POLICY = f"{DATA}/policy.lua"


def check(*args, rc=0):
    """Runs `ferry check ARGS` in the repository root (paths relative)."""
    r = subprocess.run([FERRY, "check", *args], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    if r.returncode != rc:
        sys.exit(f"FAIL ferry check {' '.join(args)}: exit {r.returncode}, want {rc}\n"
                 f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    return r.stdout


def rows(out):
    """The decision rows: lines starting with keep/offload."""
    return [x for x in out.splitlines() if re.match(r"^  (keep|offload) ", x)]


def line_of(path, needle):
    """1-based line of the first line of ROOT/path containing needle."""
    with open(os.path.join(ROOT, path)) as f:
        for i, text in enumerate(f, 1):
            if needle in text:
                return i
    sys.exit(f"FAIL {path} has no line with {needle!r}")


def golden(name, args, rc):
    out = check(*args, rc=rc)
    path = os.path.join(ROOT, DATA, name)
    if os.environ.get("FERRY_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(out)
        print(f"wrote {path}")
        return
    with open(path) as f:
        want = f.read()
    if out != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), out.splitlines(True),
                                            f"{DATA}/{name}", "ferry check"))
        sys.exit(f"FAIL ferry check {' '.join(args)} differs from {DATA}/{name} "
                 f"(FERRY_UPDATE_GOLDEN=1 rewrites it if the change is meant):\n{diff}")
    print(f"ok   ferry check {' '.join(args)} = {DATA}/{name}")


def main():
    golden("check.golden", ["--trace", TRACE, POLICY], 0)
    golden("decide.golden", ["--trace", TRACE, f"{DATA}/decide.lua"], 1)

    # bare names: the synthetic model and a trace; reasons at the shipped lines
    default = "policies/default.lua"
    want = {"min_bytes(1024)": line_of(default, "R.min_bytes("),
            "exclude_params_and_buffers()": line_of(default, "R.exclude_params_and_buffers("),
            "all rules passed": line_of(default, "return R.policy")}
    for args in (["default"], ["--trace", TRACE, "default"]):
        out = check(*args)
        for rule, line in want.items():
            tail = re.compile(re.escape(rule) + r" \((.*/)?" + re.escape(f"{default}:{line})") + "$")
            hits = [x for x in rows(out) if tail.search(x)]
            if not hits:
                sys.exit(f"FAIL ferry check {' '.join(args)}: no row with reason "
                         f"{rule} ({default}:{line})\n{out[-3000:]}")
        if "\nby reason:\n" not in out:
            sys.exit(f"FAIL ferry check {' '.join(args)}: no totals by reason\n{out[-2000:]}")
    print("ok   bare names: reasons at policies/default.lua's lines")

    # --why: by rule name, by file:line, by module path; totals follow
    keep_last = f"keep_last_layers(1) ({POLICY}:{line_of(POLICY, 'R.keep_last_layers(')})"
    for pattern, want_rows in (("keep_last", 4), (f"policy.lua:{line_of(POLICY, 'R.keep_last')}", 4)):
        out = check("--why", pattern, "--trace", TRACE, POLICY)
        got = rows(out)
        if len(got) != want_rows or not all(x.endswith(keep_last) for x in got):
            sys.exit(f"FAIL --why {pattern}: want {want_rows} rows of {keep_last}\n{out}")
        totals = out.split("\nby reason")[1].split("\nsummary:")[0].strip().splitlines()[2:]
        if len(totals) != 1 or not totals[0].endswith(keep_last) or \
                totals[0].split()[:2] != ["4", "0"]:
            sys.exit(f"FAIL --why {pattern}: totals should be the one rule's\n{out}")
    out = check("--why", "up_proj", "--trace", TRACE, POLICY)
    got = rows(out)
    if len(got) != 8 or not all(" model.layers." in x and ".mlp.up_proj (Linear) " in x
                                for x in got):
        sys.exit(f"FAIL --why up_proj: want the 8 rows of the up_proj modules\n{out}")
    out = check("--why", "no such thing", "--trace", TRACE, POLICY)
    if rows(out) or "by reason" in out or "summary: 20 decisions" not in out:
        sys.exit(f"FAIL --why matching nothing: no rows, no totals, the summary\n{out}")
    out = check("-q", "--why", "min_bytes", "--trace", TRACE, POLICY)
    if rows(out) or "min_bytes(1024)" not in out.split("by reason")[-1]:
        sys.exit(f"FAIL -q --why: totals without rows\n{out}")
    print("ok   --why filters rows and totals by rule, file:line and module path")


if __name__ == "__main__":
    main()
