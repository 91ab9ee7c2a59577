#!/usr/bin/env python3
"""ferry sim reports the link it priced and the node settings it ran with:
--gpus-per-node and --numa-far change the link each GPU gets
(sim_node_apply), so the report's link (text header and JSON `link`) must be
that one, not the preset's, and the JSON's `node` names the settings
(--gpus-per-node, --numa-far, --contention, --host-overhead).
  test_sim_node_report.py FERRY"""
import json
import os
import subprocess
import sys
import tempfile

from cli_report import finish

FERRY = sys.argv[1]
GB = 1e9


def sim(d, *args):
    j = os.path.join(d, "r.json")
    r = subprocess.run([FERRY, "sim", "--policy", "default", "--trace", os.path.join(d, "t.jsonl"),
                        "--steps", "1", "--no-layers", "--json", j, *args],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        sys.exit(f"FAIL ferry sim {' '.join(args)}: exit {r.returncode}: {r.stderr[-300:]}")
    with open(j) as f:
        return r.stdout, json.load(f)


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o",
                        os.path.join(d, "t.jsonl")], check=True, capture_output=True)
        # a100: 25 GB/s each way, 2 GPUs per PCIe switch, 409.6 GB/s of host memory
        out, rep = sim(d, "--hw", "a100", "--gpus-per-node", "8", "--numa-far", "0.5",
                       "--contention", "off", "--host-overhead", "12")
        want_link = 25 * GB * 0.5 / 2  # halved by the switch's other GPU, then NUMA-far
        for k in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            if abs(rep["link"][k] - want_link) > 1:
                failures.append(f"link.{k} = {rep['link'][k]}, want {want_link} (the priced link)")
        if "H2D 6.2 GB/s, D2H 6.2 GB/s" not in out:
            failures.append(f"text header does not show the priced link: {out.splitlines()[:3]}")
        want_node = {"gpus_per_node": 8, "numa_far": 0.5, "contention": False,
                     "host_overhead_us": 12, "host_mem_bytes_per_s": 409.6 * GB / 8}
        node = rep.get("node", {})
        for k, v in want_node.items():
            if k not in node or (node[k] != v if isinstance(v, bool) else abs(node[k] - v) > 1e-6 * max(1, v)):
                failures.append(f"node.{k} = {node.get(k)!r}, want {v!r}")
        if "node: 8 GPUs copying at once" not in out:
            failures.append(f"text does not name the node settings: {out.splitlines()[:4]}")
        # the defaults: one GPU, the preset's link, contention on, torch 2's host cost
        out, rep = sim(d, "--hw", "a100")
        if rep["link"]["h2d_bytes_per_s"] != 25 * GB:
            failures.append(f"default link.h2d_bytes_per_s = {rep['link']['h2d_bytes_per_s']}")
        node = rep.get("node", {})
        if node.get("gpus_per_node") != 1 or node.get("contention") is not True or \
                node.get("host_overhead_us") != 10:
            failures.append(f"default node = {node!r}")
    finish(failures, "ok   ferry sim reports the priced link and the node settings")


if __name__ == "__main__":
    main()
