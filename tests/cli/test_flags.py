#!/usr/bin/env python3
"""Every numeric flag of every subcommand refuses NaN, infinities,
negatives, overflow, trailing garbage and (where meaningless) zero, with an
error that names the flag and the value, through the one number parser; and
a good value of each is accepted. A flag missing from the table below fails
the test (the list is read from each subcommand's --help).

Usage: test_flags.py FERRY_BINARY"""
import os
import re
import subprocess
import sys
import tempfile

FERRY = sys.argv[1]
BAD = ["nan", "inf", "-inf", "-1", "1e300", "12x", "0x10", ""]

# subcommand, flag, extra bad values, a good value
TABLE = [
    ("sim", "--steps", ["0", "1.5"], "2"),
    ("sim", "--warmup", ["1.5"], "0"),
    ("sim", "--host-cap", ["0", "0.4"], "64M"),
    ("sim", "--host-ram", ["0"], "64G"),
    ("sim", "--fit", ["0"], None),
    ("sim", "--fit-host", ["0"], None),
    ("sim", "--mfu", ["0", "1.5"], "0.4"),
    ("sim", "--tflops", ["0"], "400"),
    ("sim", "--hbm", ["0"], "2000"),
    ("sim", "--nodes", ["0", "1.5"], "2"),
    ("sim", "--nvlink", ["-1", "1e6"], "360"),
    ("sim", "--nic", ["-1", "1e6"], "50"),
    ("sim", "--max-line", ["0", "63"], "1M"),
    ("sim", "--link h2d=", ["0", "55", "1e-300GB/s"], "12GB/s"),
    ("sim", "--link d2h=", ["0", "200TB/s"], "12GiB/s"),
    ("sim", "--link latency=", ["2s", "5"], "5us"),
    ("sim", "--link duplex=", ["0", "1.5"], "0.8"),
    ("sim", "--pinned alloc=", ["2s"], "3ms"),
    ("sim", "--pinned touch=", ["1e-9GB/s"], "2.5GB/s"),
    ("sim", "--optimizer-fraction", ["1.5", "1.0001"], "0.5"),
    ("sim", "--cpu-adam", ["0", "1", "1e14"], "2e8"),
    ("sim", "--weight-layers", ["1.5", "2..1", "1..x", "..3"], "2"),
    ("sim", "--untracked", ["1.5", "auto2"], "2G"),
    ("sim", "--gpus-per-node", ["0", "1.5", "9"], "8"),
    ("sim", "--numa-far", ["0", "1.5"], "0.35"),
    ("sim", "--host-overhead", ["1e7"], "12"),
    ("sim", "--mfu-sensitivity", ["0", "0.95", "1"], "0.1"),
    ("check", "--layers", ["0", "2000"], "2"),
    ("check", "--steps", ["0", "101"], "1"),
    ("check", "--ram-pct", ["101"], "50"),
    ("run", "--cap", ["0", "0%", "101%", "nan%"], "40%"),
    ("trace synth", "--layers", ["1.5"], "2"),
    ("trace synth", "--hidden", ["1.5"], None),
    ("trace synth", "--heads", ["1.5"], None),
    ("trace synth", "--kv-heads", ["1.5"], None),
    ("trace synth", "--ffn", ["1.5"], None),
    ("trace synth", "--vocab", ["1.5"], None),
    ("trace synth", "--seq", ["1.5", "4294967296"], "256"),
    ("trace synth", "--micro-batch", ["1.5"], None),
    ("trace synth", "--shard", ["1.5"], None),
    ("trace synth", "--steps", ["1.5"], None),
    ("trace synth", "--tflops", ["0"], "300"),
    ("trace synth", "--hbm", ["0"], "1500"),
    ("trace synth", "--head-dim", ["1.5"], "64"),
    ("trace synth", "--experts", ["1.5"], None),
    ("trace synth", "--top-k", ["1.5"], None),
    ("trace synth", "--expert-ffn", ["1.5"], None),
    ("trace synth", "--lora", ["0", "1.5"], "0.01"),
    ("trace synth", "--tp", ["1.5"], "2"),
    ("trace synth", "--cp", ["1.5"], "2"),
]
# flags that take no number
NOT_NUMERIC = {"--policy", "--trace", "--hw", "--json", "--chrome-trace", "--svg", "--html",
               "--sweep",
               "--recorded", "--no-layers", "--demo", "--help", "--fit-out",
               "--release-copied", "--prefetch-at-backward", "--quiet", "--backend",
               "--dry-run", "--preset", "--arch", "--dtype", "--flash", "--checkpoint", "--checkpoint-impl",
               "--qk-norm", "--tie-embeddings", "--loss", "--param-dtype", "--grad-dtype",
               "--master-weights", "--optimizer", "--sp", "--norm",
               "--output", "--trusted", "--link", "--pinned", "--trace-out",
               "--optimizer-overlap", "--why", "--verbose", "--weight-double-buffer",
               "--contention", "--cp-impl"}


def argv(sub, flag, value, d):
    """The command line that gives flag the value, the rest valid."""
    if flag.endswith("="):  # a key of --link / --pinned
        opt, key = flag.split(" ")
        flag_args = [opt, key + value]
    else:
        flag_args = [flag, value]
    if sub == "sim":
        return ["sim", "--trace", os.path.join(d, "t.jsonl"), "--policy", "default",
                "--steps", "1", "--no-layers", *flag_args]
    if sub == "check":
        return ["check", *flag_args, "default"]
    if sub == "run":
        return ["run", "-n", *flag_args, "--", "true"]
    return ["trace", "synth", "--preset", "tiny", *flag_args, "-o", os.path.join(d, "s.jsonl")]


def shown(flag, value):
    """How the error names the flag: '--link h2d 0', '--steps 0'."""
    name = flag[:-1].replace("=", "") if flag.endswith("=") else flag
    return f"{name}: empty value" if value == "" else f"{name} {value}"


def listed_flags(sub):
    h = subprocess.run([FERRY, *sub.split(), "--help"], capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z][a-z0-9-]*)", h, re.M))


def main():
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o",
                        os.path.join(d, "t.jsonl")], check=True, capture_output=True)
        for sub in ("sim", "check", "run", "trace synth"):
            covered = {f.split(" ")[0] for s, f, _, _ in TABLE if s == sub}
            listed = listed_flags(sub)
            if len(listed) < 3:
                print(f"FAIL ferry {sub} --help: no flags read from it")
                failures += 1
            missing = listed - covered - NOT_NUMERIC
            if missing:
                print(f"FAIL ferry {sub}: flags not in the table: {sorted(missing)}")
                failures += 1
        for sub, flag, extra, good in TABLE:
            for value in BAD + extra:
                r = subprocess.run([FERRY, *argv(sub, flag, value, d)], capture_output=True,
                                   text=True, timeout=30)
                want = f"ferry {sub}: {shown(flag, value)}"
                if r.returncode == 0 or want not in r.stderr:
                    print(f"FAIL ferry {sub} {flag}{'' if flag.endswith('=') else ' '}{value!r}: "
                          f"exit {r.returncode}, stderr {r.stderr.strip()[-300:]!r}")
                    failures += 1
            if good is not None:
                r = subprocess.run([FERRY, *argv(sub, flag, good, d)], capture_output=True,
                                   text=True, timeout=60)
                if r.returncode != 0:
                    print(f"FAIL ferry {sub} {flag} {good}: refused: {r.stderr.strip()[-300:]}")
                    failures += 1
            print(f"ok   ferry {sub} {flag}: {len(BAD) + len(extra)} bad values refused")
        # a flag that takes words besides numbers names them when refused
        for flag, value, words in (("--host-overhead", "torch3", "torch1 or torch2"),
                                   ("--contention", "maybe", "on or off"),
                                   ("--mfu-sensitivity", "maybe", "on, off or a factor")):
            r = subprocess.run([FERRY, *argv("sim", flag, value, d)], capture_output=True,
                               text=True, timeout=30)
            if r.returncode == 0 or f"ferry sim: {flag} {value}" not in r.stderr \
                    or words not in r.stderr:
                print(f"FAIL ferry sim {flag} {value!r}: exit {r.returncode}, stderr "
                      f"{r.stderr.strip()[-300:]!r} (want the choices: {words})")
                failures += 1
            else:
                print(f"ok   ferry sim {flag} {value}: refused, naming {words}")
    if failures:
        sys.exit(f"{failures} failure(s)")


if __name__ == "__main__":
    main()
