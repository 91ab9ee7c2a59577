#!/usr/bin/env python3
"""`ferry sim --trace X` on what is not a trace ends with a clear error, in a
few seconds, within 64 MiB of a normal run's peak memory: /dev/zero, a FIFO
with no writer, a directory, a binary file, an endless single line (a FIFO
fed forever), a line nested 5000 deep.

Usage: test_hostile_traces.py FERRY_BINARY"""
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

FERRY = sys.argv[1]
LIMIT_S = 5.0
RSS_MARGIN_KIB = 64 * 1024


def run_measured(args):
    """exit code, stderr, seconds, peak RSS (KiB) of one child."""
    probe = ("import resource, subprocess, sys, json, time\n"
             "t = time.monotonic()\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=60)\n"
             "print(json.dumps([p.returncode, p.stderr, time.monotonic() - t,\n"
             "                  resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))\n")
    out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True,
                         timeout=120)
    import json
    return json.loads(out.stdout)


def feed_forever(path, stop):
    try:
        with open(path, "w") as f:
            while not stop.is_set():
                f.write("a" * 65536)
    except (BrokenPipeError, OSError):
        pass


def main():
    tmp = tempfile.mkdtemp(prefix="ferry-hostile-")
    ok = os.path.join(tmp, "ok.jsonl")
    subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", ok], check=True,
                   capture_output=True)
    base = run_measured([FERRY, "sim", "--policy", "default", "--trace", ok])
    assert base[0] == 0, base[1]
    binary = os.path.join(tmp, "binary.jsonl")
    with open(binary, "wb") as f:
        f.write(b'{"ev":"header"}\n' + bytes(range(256)) * 64)
    deep = os.path.join(tmp, "deep.jsonl")
    with open(deep, "w") as f:
        f.write("[" * 5000 + "]" * 5000 + "\n")
    fifo = os.path.join(tmp, "nowriter.fifo")
    os.mkfifo(fifo)
    endless = os.path.join(tmp, "endless.fifo")
    os.mkfifo(endless)
    cases = [
        ("/dev/zero", "/dev/zero:1: a NUL byte"),
        (fifo, "empty trace (no header line)"),
        (tmp, "is a directory, not a trace"),
        (binary, "binary.jsonl:2: a NUL byte"),
        (deep, "deep.jsonl:1: nested deeper than 32 levels"),
        (endless, "endless.fifo:1: a line longer than 1048576 bytes"),
    ]
    failures = 0
    for path, want in cases:
        stop = threading.Event()
        feeder = None
        if path == endless:
            feeder = threading.Thread(target=feed_forever, args=(path, stop), daemon=True)
            feeder.start()
        rc, err, secs, rss = run_measured([FERRY, "sim", "--policy", "default", "--trace", path])
        stop.set()
        good = (rc == 1 and want in err and secs < LIMIT_S and rss - base[3] < RSS_MARGIN_KIB)
        print(f"{'ok  ' if good else 'FAIL'} {path}: exit {rc}, {secs:.2f} s, "
              f"peak {rss} KiB (normal run {base[3]} KiB): {err.strip()}")
        failures += not good
    print(f"{len(cases) - failures} passed, {failures} failed")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
