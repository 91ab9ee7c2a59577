#!/usr/bin/env python3
"""The engine's messages through the CLI: FERRY_LOG_FILE is capped and
rotated, a wrong FERRY_LOG_* is an error naming the variable and its value,
and -q leaves only errors on stderr (a policy's ferry.log lines, repeated
lines counted once, are gone).

Usage: test_log.py FERRY_BINARY"""
import os
import subprocess
import sys
import tempfile

FERRY = sys.argv[1]
# a distinct line per decision, then the same one for the rest
LOGGER = ('local n = 0\n'
          'return { api = 1, name = "logger", decide = function(t)\n'
          '  n = n + 1\n'
          '  ferry.log(n <= 60 and ("decision " .. n .. " " .. string.rep("x", 40)) or "same")\n'
          '  return ferry.KEEP\nend }\n')


def run(args, env=None, **kw):
    return subprocess.run([FERRY, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})}, **kw)


def fail(what, r):
    sys.exit(f"FAIL {what}: exit {r.returncode}\n--- stdout\n{r.stdout[-2000:]}\n"
             f"--- stderr\n{r.stderr[-2000:]}")


def main():
    with tempfile.TemporaryDirectory() as d:
        policy = os.path.join(d, "logger.lua")
        with open(policy, "w") as f:
            f.write(LOGGER)
        trace = os.path.join(d, "tiny.jsonl")
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", trace], check=True,
                       capture_output=True)

        # a log file of at most 4 KiB, one old file kept
        log = os.path.join(d, "ferry.log")
        r = run(["sim", "--trace", trace, "--policy", policy, "--steps", "2"],
                {"FERRY_LOG_FILE": log, "FERRY_LOG_MAX_BYTES": "4K", "FERRY_LOG_KEEP": "1"})
        sizes = [os.path.getsize(p) if os.path.exists(p) else -1
                 for p in (log, log + ".1", log + ".2")]
        if r.returncode != 0 or "policy logger" in r.stderr or not 0 < sizes[0] <= 4096 or \
                not 0 < sizes[1] <= 4096 or sizes[2] != -1:
            fail(f"FERRY_LOG_FILE capped and rotated (sizes {sizes})", r)
        text = open(log).read()
        if "policy logger: same\n" not in text or "the previous message repeated" not in text:
            fail("repeats counted in the file:\n" + text[-600:], r)
        print(f"ok   FERRY_LOG_FILE: {sizes[0]} + {sizes[1]} bytes, no .2")

        # a wrong variable is an error naming it and its value
        for var, value, want in (("FERRY_LOG_KEEP", "-1", "FERRY_LOG_KEEP"),
                                 ("FERRY_LOG_MAX_BYTES", "12x", "FERRY_LOG_MAX_BYTES"),
                                 ("FERRY_LOG_LEVEL", "loud", "FERRY_LOG_LEVEL 'loud'"),
                                 ("FERRY_LOG_FILE", "/dev/null",
                                  "log file /dev/null: not a regular file")):
            r = run(["sim", "--trace", trace, "--policy", policy, "--steps", "1"], {var: value})
            if r.returncode == 0 or want not in r.stderr or value not in r.stderr:
                fail(f"{var}={value} refused", r)
            print(f"ok   {var}={value}: {r.stderr.strip().splitlines()[-1]}")

        # stderr: the policy's lines, repeats counted; with -q nothing but errors
        r = run(["sim", "--trace", trace, "--policy", policy, "--steps", "2"])
        if r.returncode != 0 or "ferry: policy logger: decision 1 x" not in r.stderr or \
                r.stderr.count("ferry: policy logger: same") != 1:
            fail("policy lines on stderr, repeats once", r)
        r = run(["sim", "-q", "--trace", trace, "--policy", policy, "--steps", "2"])
        if r.returncode != 0 or r.stderr != "" or "logger" not in r.stdout:
            fail("ferry sim -q: nothing on stderr", r)
        r = run(["check", "-q", policy])
        if "policy logger" in r.stderr:
            fail("ferry check -q: no ferry.log lines", r)
        print("ok   -q: errors only on stderr (sim, check)")


if __name__ == "__main__":
    main()
