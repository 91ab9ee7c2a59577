#!/usr/bin/env python3
"""`ferry sim --nodes N` says so when the trace has nothing to send across
nodes (no data-parallel collectives: --shard 1, or a trace written before
ferry modelled collectives), instead of a report that looks multi-node; and
refuses more nodes than the group has ranks, naming both.

Usage: test_sim_nodes.py FERRY_BINARY"""
import os
import subprocess
import sys
import tempfile

from cli_report import finish

FERRY = sys.argv[1]


def sim(trace, *args):
    return subprocess.run([FERRY, "sim", "--trace", trace, "--policy", "layers", "--steps", "2",
                           *args], capture_output=True, text=True, timeout=120)


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        one, eight = os.path.join(d, "s1.jsonl"), os.path.join(d, "s8.jsonl")
        for path, shard in ((one, "1"), (eight, "8")):
            subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "--shard", shard, "-q",
                            "-o", path], check=True)
        # an older trace: the same without its collectives
        old = os.path.join(d, "old.jsonl")
        with open(eight) as src, open(old, "w") as dst:
            dst.writelines(l for l in src if '"ev":"collective' not in l)
        for path in (one, old):
            r = sim(path, "--nodes", "2")
            if r.returncode != 0 or "--nodes 2: the trace has no data-parallel collectives" \
                    not in r.stderr:
                failures.append(f"{os.path.basename(path)} --nodes 2: exit {r.returncode}, "
                                f"stderr {r.stderr[-300:]!r}")
        r = sim(eight, "--nodes", "2")
        if r.returncode != 0 or "no data-parallel collectives" in r.stderr:
            failures.append(f"s8 --nodes 2: exit {r.returncode}, stderr {r.stderr[-300:]!r}")
        r = sim(eight, "--nodes", "16")
        if r.returncode == 0 or "spans 16 nodes (--nodes) but has 8 ranks" not in r.stderr:
            failures.append(f"s8 --nodes 16: exit {r.returncode}, stderr {r.stderr[-300:]!r}")
    finish(failures, "ok   ferry sim --nodes: a trace with nothing to send is named; "
           "too many nodes refused")


if __name__ == "__main__":
    main()
