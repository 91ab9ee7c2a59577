#!/usr/bin/env python3
"""Ctrl-C ends `ferry check` and `ferry sim` with exit status 130 within a
second, also while the policy is busy in a call that does not return soon
(its load loops on os.clock under a long budget).

Usage: test_interrupt.py FERRY_BINARY"""
import os
import signal
import subprocess
import sys
import tempfile
import time

FERRY = sys.argv[1]
SLOW = ("local t0 = os.clock()\n"
        "while os.clock() - t0 < 30 do end\n"
        "return { api = 1, decide = function() return ferry.KEEP end }\n")


def interrupted(args, env):
    p = subprocess.Popen([FERRY, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env, text=True)
    time.sleep(0.5)
    assert p.poll() is None, f"{args}: ended before the interrupt: {p.communicate()}"
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        sys.exit(f"FAIL {args}: still running 5 s after SIGINT")
    took = time.monotonic() - t0
    if p.returncode != 130 or "ferry: interrupted" not in err:
        sys.exit(f"FAIL {args}: exit {p.returncode}, stderr {err!r}")
    print(f"ok   ferry {args[0]}: exit 130, {took * 1000:.0f} ms after SIGINT")


def main():
    with tempfile.TemporaryDirectory() as d:
        slow = os.path.join(d, "slow.lua")
        with open(slow, "w") as f:
            f.write(SLOW)
        trace = os.path.join(d, "tiny.jsonl")
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", trace], check=True)
        env = dict(os.environ, FERRY_POLICY_LOAD_MS="60000")
        interrupted(["check", slow], env)
        interrupted(["sim", "--trace", trace, "--policy", slow], env)


if __name__ == "__main__":
    main()
