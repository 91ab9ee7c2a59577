#!/usr/bin/env python3
"""`ferry check` prints each distinct fault once and sums up the repeats:
a policy failing on every large tensor gives one line, not one per tensor,
with -q as without.

Usage: test_check_faults.py FERRY_BINARY"""
import os
import subprocess
import sys
import tempfile

FERRY = sys.argv[1]
POLICY = ('return { api = 1, decide = function(t)\n'
          '  if t.bytes > 1e6 then error("too big") end\n'
          '  return ferry.KEEP\nend }\n')


def main():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "faulty.lua")
        with open(path, "w") as f:
            f.write(POLICY)
        for flags in ([], ["-q"]):
            r = subprocess.run([FERRY, "check", *flags, path], capture_output=True, text=True,
                               timeout=60)
            lines = r.stdout.splitlines()
            first = [x for x in lines if x.strip() == f"fault: {path}:2: too big"]
            repeated = [x for x in lines if x.startswith("fault repeated ")]
            if r.returncode != 1 or len(first) != 1 or \
                    repeated != [f"fault repeated 99 times: {path}:2: too big"]:
                sys.exit(f"FAIL ferry check {flags}: exit {r.returncode}\n{r.stdout}")
            print(f"ok   ferry check {' '.join(flags)}: one line per distinct fault")


if __name__ == "__main__":
    main()
