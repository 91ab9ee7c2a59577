#!/usr/bin/python3
"""Tests of `ferry run`, the trainer launcher (bindings/cli/cli_run.c).

usage: test_launcher.py --ferry BIN --lib LIBFERRY CASE...   (--list for the cases)

Each case is one ctest entry (tests/launcher/CMakeLists.txt). A case raises
on the first broken expectation; exit 0 = pass, 77 = skipped (a sanitizer
build, whose libferry cannot be loaded into Python with ctypes).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(HERE, "arena_probe.py")
PYTHON = sys.executable
SKIP = 77
LAUNCHER_FAILED, CANNOT_EXECUTE, NOT_FOUND = 125, 126, 127

FERRY = LIB = None  # set from the command line


def clean_env(**extra):
    """The test's environment without any ferry setting or preload of its own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FERRY_") and k != "LD_PRELOAD"}
    env.update(extra)
    return env


def run(args, env=None, cwd=None, timeout=60):
    return subprocess.run(args, env=env if env is not None else clean_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def expect(cond, what, proc=None):
    if not cond:
        detail = ""
        if proc is not None:
            detail = (f"\n  command: {proc.args}\n  exit: {proc.returncode}"
                      f"\n  stdout: {proc.stdout!r}\n  stderr: {proc.stderr!r}")
        raise AssertionError(what + detail)


def probe(via_launcher, launcher_args=(), env=None):
    """Run arena_probe.py as a trainer and return its JSON report."""
    if via_launcher:
        # "python3" found through PATH: ferry run has execvp semantics.
        env = env or clean_env()
        env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
        cmd = [FERRY, "run", *launcher_args, "--", os.path.basename(PYTHON), PROBE, LIB]
    else:
        cmd = [PYTHON, PROBE, LIB]
    proc = run(cmd, env=env)
    expect(proc.returncode == 0, "the probe trainer failed", proc)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


def system_lib_path(name):
    """Path of a library already mapped in this process (to preload a real one)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(name):
                return path
    raise AssertionError(f"{name} is not mapped in the test process")


def sanitized():
    return os.environ.get("FERRY_TEST_SANITIZED") == "1"


# ---- cases --------------------------------------------------------------------

def case_arena_jemalloc():
    """Under ferry run, the Python trainer has jemalloc loaded and ferry's
    arena is a jemalloc arena; an offload through it comes back identical."""
    if sanitized():
        return SKIP
    report, proc = probe(True)
    expect(report["jemalloc_mapped"], "libjemalloc is not mapped in the child", proc)
    expect(report["arena"] == "jemalloc", f"arena is {report['arena']!r}, not 'jemalloc'", proc)
    expect(report["jemalloc_arenas_added"] == 1,
           f"jemalloc gained {report['jemalloc_arenas_added']} arenas at engine creation "
           "(ferry's own arena should be one)", proc)
    expect(report["roundtrip_identical"], "offloaded bytes did not come back identical", proc)
    expect(report["bytes_d2h"] == 256 * 1024 and report["arena_peak"] >= 256 * 1024,
           f"the tensor did not go through the arena: {report}", proc)
    expect(report["buffers_left"] == 0, "owner tokens were not all released", proc)
    env = report["env"]
    expect(env["LD_PRELOAD"] == env["FERRY_JEMALLOC_PRELOADED"],
           f"LD_PRELOAD should be exactly the jemalloc preloaded: {env}", proc)
    return 0


def case_arena_pool_without_launcher():
    """The same trainer started without ferry run: no jemalloc, the pool arena."""
    if sanitized():
        return SKIP
    report, proc = probe(False)
    expect(not report["jemalloc_mapped"], "libjemalloc is mapped without the launcher", proc)
    expect(report["arena"] == "pool", f"arena is {report['arena']!r}, not 'pool'", proc)
    expect(report["jemalloc_arenas_added"] is None, "mallctl is reachable without jemalloc", proc)
    expect(report["roundtrip_identical"], "offloaded bytes did not come back identical", proc)
    expect(report["bytes_d2h"] == 256 * 1024, f"the tensor was not offloaded: {report}", proc)
    return 0


def case_settings_env():
    """Options become FERRY_* variables with absolute paths and normalized
    caps; an existing LD_PRELOAD is kept after jemalloc, without duplicates."""
    if sanitized():
        return SKIP
    with tempfile.TemporaryDirectory() as tmp:
        policy = os.path.join(tmp, "keep.lua")
        with open(policy, "w") as f:
            f.write("return function() return 'keep' end\n")
        libm = system_lib_path("libm.so")
        jemalloc = run([FERRY, "run", "--dry-run", "true"]).stdout.splitlines()[0]
        expect(jemalloc.startswith("LD_PRELOAD="), "dry run did not print LD_PRELOAD first")
        jemalloc = jemalloc.split("=", 1)[1]
        # The caller already preloads libm and (as another spelling) jemalloc.
        env = clean_env(LD_PRELOAD=f"{libm} {jemalloc}")
        env["PATH"] = os.path.dirname(PYTHON) + os.pathsep + env.get("PATH", "")
        proc = run([FERRY, "run", "--policy", "keep.lua", "--trace", "out/t.jsonl",
                    "--cap", "512M", "--backend", "host", "--",
                    os.path.basename(PYTHON), PROBE, LIB], env=env, cwd=tmp)
        os.makedirs(os.path.join(tmp, "out"), exist_ok=True)
        expect(proc.returncode == LAUNCHER_FAILED and "cannot write in" in proc.stderr
               and os.path.join(tmp, "out") in proc.stderr,
               "--trace into a missing directory was not refused", proc)
        proc = run([FERRY, "run", "--policy", "keep.lua", "--trace", "out/t.jsonl",
                    "--cap", "512M", "--backend", "host", "--",
                    os.path.basename(PYTHON), PROBE, LIB], env=env, cwd=tmp)
        expect(proc.returncode == 0, "the probe trainer failed", proc)
        got = json.loads(proc.stdout.strip().splitlines()[-1])["env"]
        want = {
            "LD_PRELOAD": f"{jemalloc}:{libm}",
            "FERRY_JEMALLOC_PRELOADED": jemalloc,
            "FERRY_POLICY": policy,
            "FERRY_TRACE": os.path.join(tmp, "out", "t.jsonl"),
            "FERRY_HOST_CAP": str(512 << 20),
            "FERRY_BACKEND": "host",
        }
        expect(got == want, f"child environment\n  got  {got}\n  want {want}", proc)
    for cap, value in [("12.5%", "12.5%"), ("40%", "40%"), ("1073741824", "1073741824"),
                       ("2GiB", str(2 << 30)), ("3k", "3072"), ("1T", str(1 << 40))]:
        proc = run([FERRY, "run", "-n", "-c", cap, "true"])
        expect(proc.returncode == 0 and f"FERRY_HOST_CAP={value}\n" in proc.stdout,
               f"--cap {cap} should give FERRY_HOST_CAP={value}", proc)
    return 0


def case_exit_status():
    """The command's exit status and signal deaths pass through; the trainer
    runs in the launcher's own process (exec), so signals reach it directly."""
    proc = run([FERRY, "run", "--", "sh", "-c", "exit 3"])
    expect(proc.returncode == 3, "exit 3 did not pass through", proc)
    proc = run([FERRY, "run", "sh", "-c", "exit 0"])
    expect(proc.returncode == 0, "exit 0 did not pass through (no '--')", proc)
    # Killed by SIGTERM: the waiting process sees the signal, a shell says 143.
    proc = run([FERRY, "run", "--", PYTHON, "-c",
                "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    expect(proc.returncode == -signal.SIGTERM, "death by SIGTERM did not pass through", proc)
    proc = run(["sh", "-c", '"$0" run -- sh -c "kill -TERM \\$\\$"; echo "status=$?"', FERRY])
    expect(proc.stdout.strip() == "status=143", "a shell should see 143 (128+SIGTERM)", proc)
    return 0


def case_signals():
    """SIGINT and SIGTERM sent to the pid that was launched reach the trainer."""
    child = ("import os, signal, sys, time\n"
             "def on(sig, frame):\n"
             "    print('got', signal.Signals(sig).name, flush=True); sys.exit(7)\n"
             "signal.signal(signal.SIGINT, on); signal.signal(signal.SIGTERM, on)\n"
             "print(os.getpid(), flush=True)\n"
             "time.sleep(60)\n")
    for sig in (signal.SIGINT, signal.SIGTERM):
        p = subprocess.Popen([FERRY, "run", "--", PYTHON, "-c", child], env=clean_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            pid_line = p.stdout.readline()
            expect(pid_line.strip() == str(p.pid),
                   f"the trainer runs as pid {pid_line.strip()}, not the launched {p.pid}")
            p.send_signal(sig)
            out, err = p.communicate(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        expect(p.returncode == 7 and f"got {sig.name}" in out,
               f"{sig.name} did not reach the trainer: exit {p.returncode}, "
               f"out {out!r}, err {err!r}")
    return 0


def case_missing_jemalloc():
    """No usable jemalloc: a clear refusal naming it and how to install it,
    and the command is not run."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        not_elf = os.path.join(tmp, "libjemalloc.so.2")
        with open(not_elf, "w") as f:
            f.write("not a library\n")
        cases = [("/nonexistent/libjemalloc.so.2", "No such file or directory"),
                 (not_elf, "not an ELF shared library"),
                 ("libjemalloc.so.2", "not an absolute path")]
        for path, reason in cases:
            proc = run([FERRY, "run", "--", "touch", marker],
                       env=clean_env(FERRY_JEMALLOC=path))
            expect(proc.returncode == LAUNCHER_FAILED,
                   f"FERRY_JEMALLOC={path}: expected exit {LAUNCHER_FAILED}", proc)
            expect(f"FERRY_JEMALLOC={path}" in proc.stderr and reason in proc.stderr,
                   f"FERRY_JEMALLOC={path}: the message should name it and say {reason!r}", proc)
            if reason != "not an absolute path":
                expect("apt-get install libjemalloc2" in proc.stderr,
                       "the message should say how to install jemalloc", proc)
            expect(not os.path.exists(marker), "the command ran without jemalloc", proc)
    return 0


def case_bad_usage():
    """Bad usage is refused with exit 125 and a message naming the problem."""
    bad = [
        ([], "no command to run"),
        (["--"], "no command to run"),
        (["--bogus", "true"], "unknown option '--bogus'"),
        (["-x", "true"], "unknown option '-x'"),
        (["--cap"], "option '--cap' needs a value"),
        (["--cap", "0", "true"], "--cap 0: must be between 1 B and 8 PiB"),
        (["--cap", "150%", "true"], "--cap 150%: must be above 0% and at most 100%"),
        (["--cap", "-5", "true"], "--cap -5: must be between 1 B"),
        (["--cap", "3X", "true"], "--cap 3X: unexpected \"X\""),
        (["--cap", "99999999999T", "true"], "--cap 99999999999T: must be between 1 B"),
        (["--cap", "nan", "true"], "--cap nan: not a number"),
        (["--cap", "0.4", "true"], "--cap 0.4: must be between 1 B"),
        (["--cap", "1.5", "true"], "--cap 1.5: must be a whole number of bytes"),
        (["--backend", "gpu", "true"], "--backend 'gpu': expected host, cuda or auto"),
        (["--policy", "/nonexistent/p.lua", "true"], "--policy /nonexistent/p.lua: No such file"),
        (["--policy", "/", "true"], "not a regular file"),
        (["--trace", "/nonexistent/t.jsonl", "true"], "cannot write in /nonexistent"),
        (["--trace", "out/", "true"], "names a directory"),
    ]
    for args, message in bad:
        proc = run([FERRY, "run", *args])
        expect(proc.returncode == LAUNCHER_FAILED, f"ferry run {args}: expected exit 125", proc)
        expect(message in proc.stderr, f"ferry run {args}: stderr should say {message!r}", proc)
    proc = run([FERRY, "run", "--help"])
    expect(proc.returncode == 0 and "usage: ferry run" in proc.stdout and "FERRY_POLICY" in
           proc.stdout, "--help should print the usage", proc)
    return 0


def case_exec_errors():
    """A command that is not found exits 127, one that cannot run 126."""
    proc = run([FERRY, "run", "--", "ferry-no-such-command-xyz"])
    expect(proc.returncode == NOT_FOUND and "not found in PATH" in proc.stderr
           and "ferry-no-such-command-xyz" in proc.stderr, "missing command: expected 127", proc)
    with tempfile.TemporaryDirectory() as tmp:
        not_exec = os.path.join(tmp, "train.sh")
        with open(not_exec, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(not_exec, 0o644)
        proc = run([FERRY, "run", "--", not_exec])
        expect(proc.returncode == CANNOT_EXECUTE and "Permission denied" in proc.stderr,
               "non-executable command: expected 126", proc)
    return 0


def case_dry_run():
    """--dry-run prints the environment and the command and runs nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        marker = os.path.join(tmp, "ran")
        proc = run([FERRY, "run", "-n", "-b", "cuda", "--", "touch", marker, "a b", "it's"])
        expect(proc.returncode == 0, "dry run failed", proc)
        lines = proc.stdout.splitlines()
        expect(lines[0].startswith("LD_PRELOAD=/") and "libjemalloc" in lines[0],
               "dry run should print LD_PRELOAD with jemalloc", proc)
        expect("FERRY_BACKEND=cuda" in lines, "dry run should print FERRY_BACKEND", proc)
        expect(lines[-1] == f"exec touch {marker} 'a b' 'it'\\''s'",
               "dry run should print the command, shell-quoted", proc)
        expect(not os.path.exists(marker), "dry run ran the command", proc)
    return 0


def case_engine_switches():
    """--release-copied and --prefetch-at-backward set FERRY_RELEASE_COPIED=1
    and FERRY_PREFETCH_AT_BACKWARD=1, which ferry.torch.offload takes as the
    defaults of release_when_copied and prefetch_at_backward_begin; without
    them neither variable is set."""
    proc = run([FERRY, "run", "-n", "--release-copied", "--prefetch-at-backward", "--", "true"])
    expect(proc.returncode == 0, "dry run failed", proc)
    lines = proc.stdout.splitlines()
    expect("FERRY_RELEASE_COPIED=1" in lines, "--release-copied should set FERRY_RELEASE_COPIED=1",
           proc)
    expect("FERRY_PREFETCH_AT_BACKWARD=1" in lines,
           "--prefetch-at-backward should set FERRY_PREFETCH_AT_BACKWARD=1", proc)
    proc = run([FERRY, "run", "-n", "--", "true"])
    expect(proc.returncode == 0 and "FERRY_RELEASE_COPIED" not in proc.stdout
           and "FERRY_PREFETCH_AT_BACKWARD" not in proc.stdout,
           "without the flags neither variable should be set", proc)
    proc = run([FERRY, "run", "--release-copied", "--", "sh", "-c",
                'echo "[$FERRY_RELEASE_COPIED][$FERRY_PREFETCH_AT_BACKWARD]"'])
    expect(proc.returncode == 0 and proc.stdout.strip() == "[1][]",
           "the trainer should see FERRY_RELEASE_COPIED=1 only", proc)
    return 0


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def main():
    global FERRY, LIB
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferry", help="the ferry executable")
    ap.add_argument("--lib", help="libferry.so")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("cases", nargs="*")
    a = ap.parse_args()
    if a.list:
        print("\n".join(CASES))
        return 0
    if not a.ferry or not a.lib:
        ap.error("--ferry and --lib are required")
    FERRY, LIB = os.path.abspath(a.ferry), os.path.abspath(a.lib)
    status = 0
    for name in a.cases or CASES:
        if name not in CASES:
            print(f"unknown case {name!r}; --list shows them", file=sys.stderr)
            return 2
        try:
            rc = CASES[name]()
        except AssertionError as e:
            print(f"FAIL launcher/{name}: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{'SKIP' if rc == SKIP else 'ok'} launcher/{name}")
        if rc == SKIP and status == 0:
            status = SKIP
    return status


if __name__ == "__main__":
    sys.exit(main())
