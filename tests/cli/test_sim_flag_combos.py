#!/usr/bin/env python3
"""Options of ferry sim that mean something only beside another are refused
without it, naming the flag and the value, rather than ignored: --fit-host
and --fit-out are --fit's (its host budget, the policy file it writes).
With --fit they work as before.
  test_sim_flag_combos.py FERRY"""
import os
import subprocess
import sys
import tempfile

from cli_report import finish

FERRY = sys.argv[1]


def main():
    failures = []
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "t.jsonl")
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", trace], check=True,
                       capture_output=True)
        out = os.path.join(d, "fit.lua")
        for args, want in ((["--fit-host", "1G"], "--fit-host 1G: only with --fit"),
                           (["--fit-out", out], f"--fit-out {out}: only with --fit")):
            r = subprocess.run([FERRY, "sim", "--policy", "default", "--trace", trace, "--steps",
                                "1", "--no-layers", *args], capture_output=True, text=True,
                               timeout=60)
            if r.returncode != 2 or f"ferry sim: {want}" not in r.stderr:
                failures.append(f"{' '.join(args)} without --fit: exit {r.returncode}, "
                                f"{r.stderr.strip()[-300:]!r}")
        r = subprocess.run([FERRY, "sim", "--fit", "25MiB", "--fit-host", "1G", "--fit-out", out,
                            "--trace", trace], capture_output=True, text=True, timeout=120)
        if r.returncode not in (0, 4) or (r.returncode == 0 and not os.path.exists(out)):
            failures.append(f"--fit with --fit-host and --fit-out: exit {r.returncode}, "
                            f"{r.stderr.strip()[-300:]!r}")
    finish(failures, "ok   ferry sim: --fit-host and --fit-out refused without --fit, "
                     "taken with it")


if __name__ == "__main__":
    main()
