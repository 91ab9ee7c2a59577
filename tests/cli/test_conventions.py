#!/usr/bin/env python3
"""The conventions every `ferry` command keeps (docs/cli.md):

- "-" is stdin or stdout: a synthesized trace piped into `ferry sim --trace -`
  gives the figures of the same trace read from a file; each output flag of
  `ferry sim` and `ferry check --json` writes its data alone to stdout while
  the report goes to stderr; two outputs on stdout, or stdin read twice, are
  usage errors; `ferry run` refuses "-";
- -q and -v do what each command's --help says;
- colour only on a terminal and never with NO_COLOR set: nothing written to a
  pipe carries an escape sequence; on a pseudo-terminal the error prefix and
  `ferry check`'s decisions are coloured, and NO_COLOR turns that off;
- progress: one line on stderr rewritten with "\\r" and cleared at the end,
  only when stderr is a terminal and not with -q;
- every command's --help lists -q/-v and has examples, and the examples run.

Usage: test_conventions.py FERRY_BINARY"""
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile

FERRY = os.path.abspath(sys.argv[1])
COMMANDS = [["check"], ["sim"], ["trace", "synth"], ["run"]]
ESC = "\x1b"
failures = 0


def run(args, stdin=None, env=None, rc=0, timeout=120, cwd=None):
    r = subprocess.run([FERRY, *args], input=stdin, capture_output=True, timeout=timeout,
                       env={**os.environ, **(env or {})}, cwd=cwd)
    r.out = r.stdout.decode(errors="replace")
    r.err = r.stderr.decode(errors="replace")
    if rc is not None and r.returncode != rc:
        fail(f"ferry {' '.join(args)}: exit {r.returncode}, wanted {rc}", r)
    return r


def fail(what, r=None):
    global failures
    failures += 1
    print(f"FAIL {what}")
    if r is not None:
        print(f"--- stdout\n{r.out[-1500:]}\n--- stderr\n{r.err[-1500:]}")


def ok(what):
    print(f"ok   {what}")


def on_pty(args, env=None, stdout_tty=False):
    """Runs ferry with stderr (and stdout if stdout_tty) on a pseudo-terminal:
    (exit status, what the terminal got, stdout if it was a pipe)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([FERRY, *args], stdin=subprocess.DEVNULL,
                         stdout=slave if stdout_tty else subprocess.PIPE, stderr=slave,
                         env={**os.environ, "TERM": "xterm", **(env or {})})
    os.close(slave)
    got = b""
    out = b""
    while True:
        fds = [master] + ([p.stdout] if p.stdout else [])
        ready, _, _ = select.select(fds, [], [], 60)
        if not ready:
            p.kill()
            break
        if p.stdout in ready:
            chunk = p.stdout.read1(65536) if hasattr(p.stdout, "read1") else p.stdout.read()
            out += chunk
            if not chunk:
                p.stdout.close()
                p.stdout = None
        if master in ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child is gone, the terminal closed
                chunk = b""
            if not chunk:
                break
            got += chunk
    if p.stdout:
        out += p.stdout.read()
    os.close(master)
    return p.wait(), got.decode(errors="replace"), out.decode(errors="replace")


def figures(report):
    return [(p["name"], p["step_us"], p["peak_device_bytes"], p["bytes_d2h"])
            for p in report["policies"]]


def check_dash(d):
    trace = os.path.join(d, "t.jsonl")
    # SGD: foreach AdamW's transients put tiny's peak at the optimizer step,
    # which no policy (and no --fit) reaches
    synth = run(["trace", "synth", "--preset", "tiny", "--optimizer", "sgd", "--steps", "2", "-q",
                 "-o", "-"])
    with open(trace, "wb") as f:
        f.write(synth.stdout)
    if not synth.stdout.startswith(b"{") or synth.err:
        fail("trace synth -o - -q: the trace alone on stdout, nothing on stderr", synth)

    base = ["sim", "--policy", "default", "--steps", "2", "--no-layers"]
    from_file = run(base + ["--trace", trace, "--json", os.path.join(d, "f.json")])
    with open(os.path.join(d, "f.json")) as f:
        want = json.load(f)
    piped = run(base + ["--trace", "-", "--json", "-"], stdin=synth.stdout)
    try:
        got = json.loads(piped.out)
    except ValueError:
        got = None
        fail("sim --trace - --json -: stdout is not the JSON alone", piped)
    if got is not None:
        if figures(got) != figures(want):
            fail(f"synth -o - | sim --trace -: {figures(got)} against the file's {figures(want)}")
        elif "peak dev" not in piped.err or "peak dev" in piped.out:
            fail("sim --json -: the table goes to stderr", piped)
        elif "peak dev" not in from_file.out:
            fail("sim --json FILE: the table stays on stdout", from_file)
        else:
            ok("trace synth -o - | sim --trace - --json -: the file's figures; the table on stderr")

    # a real pipe between two processes, as a shell would run it
    sh = subprocess.run(f"'{FERRY}' trace synth --preset tiny --optimizer sgd --steps 2 -q -o - | "
                        f"'{FERRY}' sim --policy default --steps 2 --no-layers --trace - --json -",
                        shell=True, capture_output=True, text=True, timeout=120)
    try:
        good = sh.returncode == 0 and figures(json.loads(sh.stdout)) == figures(want)
    except ValueError:
        good = False
    if not good:
        print(sh.stderr[-1500:])
        fail("a shell pipe: ferry trace synth -o - | ferry sim --trace -")
    else:
        ok("a shell pipe: ferry trace synth -o - | ferry sim --trace - --json -")

    # every output of ferry sim on stdout, alone
    outputs = {
        "--chrome-trace": lambda s: "traceEvents" in json.loads(s),
        "--svg": lambda s: s.lstrip().startswith(("<svg", "<?xml")) and "</svg>" in s,
        "--html": lambda s: s.lstrip().lower().startswith("<!doctype html") and "</html>" in s,
    }
    for flag, looks_right in outputs.items():
        r = run(base + ["--trace", trace, flag, "-"])
        try:
            good = looks_right(r.out)
        except ValueError:
            good = False
        if not good or "peak dev" not in r.err:
            fail(f"sim {flag} -: the data alone on stdout, the table on stderr", r)
        else:
            ok(f"sim {flag} -")
    r = run(["sim", "--fit", "25MiB", "--trace", trace, "--fit-out", "-"])
    if "local HOST_BYTES" not in r.out or "best:" in r.out or "best:" not in r.err:
        fail("sim --fit --fit-out -: the policy alone on stdout", r)
    else:
        ok("sim --fit-out -: the policy on stdout, the search's report on stderr")
    with open(os.path.join(d, "fit.lua"), "w") as f:
        f.write(r.out)

    # policies from stdin
    with open(find_policy("default")) as f:
        default_src = f.read().encode()
    r = run(base + ["--trace", trace, "--policy", "-", "--json", os.path.join(d, "s.json")],
            stdin=default_src)
    with open(os.path.join(d, "s.json")) as f:
        s = json.load(f)
    if [x[1:] for x in figures(s)] != [x[1:] for x in figures(want)] or \
            figures(s)[0][0] != "stdin":
        fail(f"sim --policy -: {figures(s)} against default's {figures(want)}", r)
    else:
        ok("sim --policy - (default.lua on stdin): default's figures, labelled stdin")

    # ferry check
    r = run(["check", "-q", "--trace", trace, "--json", "-", "default"])
    try:
        doc = json.loads(r.out)
        good = doc["format"] == "ferry-check" and "summary:" in r.err
    except ValueError:
        good = False
    if not good:
        fail("check --json -: the JSON alone on stdout, the text on stderr", r)
    else:
        ok("check --json -: the JSON on stdout, the text on stderr")
    r = run(["check", "-q", "--trace", "-", "default"], stdin=synth.stdout)
    r2 = run(["check", "-q", "--trace", trace, "default"])
    if r.out.replace("trace    -", "") != r2.out.replace(f"trace    {trace}", ""):
        fail("check --trace -: the file's decisions", r)
    else:
        ok("check --trace -")
    r = run(["check", "-q", "-"], stdin=default_src)
    if "name     default" not in r.out or "(policy:" not in r.out:
        fail("check - (a policy on stdin): loaded, reasons at policy:LINE", r)
    else:
        ok("check - (a policy on stdin)")

    # at most one "-" each way
    for args, want_err in [
        (base + ["--trace", trace, "--json", "-", "--svg", "-"], "only one output can go to stdout"),
        (base + ["--trace", trace, "--chrome-trace", "-", "--html", "-"], "only one output"),
        (["sim", "--policy", "-", "--trace", "-"], "stdin can be read only once"),
        (["check", "--trace", "-", "-"], "stdin can be read only once"),
    ]:
        r = run(args, rc=2, stdin=b"")
        if want_err not in r.err or r.out:
            fail(f"ferry {' '.join(args)}: usage error '{want_err}', nothing on stdout", r)
    ok("two outputs on stdout, or stdin twice: exit 2, named")
    for flag in ["--policy", "--trace", "--chrome-trace"]:
        r = run(["run", flag, "-", "--", "true"], rc=125)
        if "its own; give a file" not in r.err:
            fail(f"run {flag} -: refused", r)
    ok("ferry run refuses '-' (the trainer's streams are its own)")
    return trace


def find_policy(name):
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "policies", name + ".lua")


def check_quiet_verbose(d, trace):
    for cmd in COMMANDS:
        h = run([*cmd, "--help"]).out
        if not re.search(r"^\s+-q, --quiet\s", h, re.M) or \
                not re.search(r"^\s+-v, --verbose\s", h, re.M):
            fail(f"ferry {' '.join(cmd)} --help: lists -q, --quiet and -v, --verbose")
    ok("every command's --help lists -q, --quiet and -v, --verbose")

    sim = ["sim", "--policy", "default", "--trace", trace, "--steps", "2", "--no-layers"]
    normal, quiet, verbose = run(sim), run(sim + ["-q"]), run(sim + ["-v"])
    if "replayed in" in normal.err or "default.lua" in normal.err:
        fail("sim: no -v lines without -v", normal)
    elif not re.search(r"ferry sim: --policy default: \S+/default\.lua", verbose.err) or \
            not re.search(r"ferry sim: default: 2 steps replayed in [0-9.]+ s", verbose.err):
        fail("sim -v: each policy's file and each replay's steps and time", verbose)
    elif quiet.err or quiet.out != normal.out:
        fail("sim -q: nothing on stderr, the same report", quiet)
    else:
        ok("sim: -v names the files and times the replays; -q leaves stderr empty")

    chk = ["check", "--trace", trace, "default"]
    normal, quiet, verbose = run(chk), run(chk + ["-q"]), run(chk + ["-v"])
    rows = re.compile(r"^  (offload|keep) ", re.M)
    if not rows.search(normal.out) or "offloaded per layer:" in normal.out:
        fail("check: rows, no per-layer line", normal)
    elif rows.search(quiet.out) or "summary:" not in quiet.out:
        fail("check -q: no rows, the summary", quiet)
    elif not re.search(r"^  offloaded per layer: 0:\d+ 1:\d+", verbose.out, re.M) or \
            not rows.search(verbose.out):
        fail("check -v: rows and the offloads per layer after each step", verbose)
    else:
        ok("check: -q drops the rows; -v adds the offloads per layer")

    syn = ["trace", "synth", "--preset", "tiny", "-o", os.path.join(d, "q.jsonl")]
    normal, quiet, verbose = run(syn), run(syn + ["-q"]), run(syn + ["-v"])
    if "parameters" not in normal.err or "layers 4, hidden" in normal.err:
        fail("trace synth: the summary line only", normal)
    elif quiet.err:
        fail("trace synth -q: nothing on stderr", quiet)
    elif "arch llama, layers 4, hidden 256" not in verbose.err or "parameters" not in verbose.err:
        fail("trace synth -v: every dimension and the summary", verbose)
    else:
        ok("trace synth: -q silent; -v every dimension")

    quiet = run(["run", "-n", "-q", "--", "true"])
    normal = run(["run", "-n", "--", "true"])
    verbose = run(["run", "-v", "--", "true"])
    if "FERRY_LOG_LEVEL=error" not in quiet.out or "FERRY_LOG_LEVEL" in normal.out:
        fail("run -q: FERRY_LOG_LEVEL=error for the trainer", quiet)
    elif "exec true" not in verbose.err or "LD_PRELOAD=" not in verbose.err or verbose.out:
        fail("run -v: the environment and the command on stderr, then it runs", verbose)
    elif run(["run", "--", "true"]).err:
        fail("run: nothing on stderr by default")
    else:
        ok("run: -q sets FERRY_LOG_LEVEL=error; -v shows the environment and command")


def check_pipes(trace):
    """Nothing that goes to a pipe carries an escape sequence, whatever the command."""
    cases = [
        (["--help"], 0), (["sim", "--help"], 0), (["check", "default"], 0),
        (["check", "-q", "--trace", trace, "--json", "-", "default"], 0),
        (["sim", "--policy", "default", "--trace", trace, "--steps", "2"], 0),
        (["sim", "--stpes", "2"], 2), (["chekc"], 2), (["check", "--layers", "x", "default"], 2),
        (["trace", "synth", "--preset", "tiny", "-o", "-"], 0), (["run", "--cpa", "1"], 125),
        (["run", "-n", "--", "true"], 0),
    ]
    for args, rc in cases:
        r = run(args, rc=rc)
        if ESC in r.out or ESC in r.err:
            fail(f"ferry {' '.join(args)} into a pipe: an escape sequence", r)
    ok("into pipes: no escape sequences (help, check, sim, synth, run, errors)")


def check_colour(d, trace):

    # a terminal gets colour; NO_COLOR (not empty) and TERM=dumb take it away
    rc, tty, _ = on_pty(["sim", "--stpes", "2"])
    if rc != 2 or "\x1b[1;31mferry sim:\x1b[0m" not in tty or "\x1b[1m--steps\x1b[0m" not in tty:
        fail(f"an error on a terminal: a red 'ferry sim:' and a bold suggestion; got {tty!r}")
    else:
        ok("an error on a terminal: 'ferry sim:' red, the suggestion bold")
    for env in ({"NO_COLOR": "1"}, {"NO_COLOR": "anything"}, {"TERM": "dumb"}):
        rc, tty, _ = on_pty(["sim", "--stpes", "2"], env=env)
        if rc != 2 or ESC in tty or "did you mean '--steps'" not in tty:
            fail(f"{env}: no colour on a terminal; got {tty!r}")
    rc, tty, _ = on_pty(["sim", "--stpes", "2"], env={"NO_COLOR": ""})
    if ESC not in tty:
        fail("NO_COLOR empty: colour stays (no-color.org: set and not empty)")
    ok("NO_COLOR=1 / NO_COLOR=anything / TERM=dumb: no colour; NO_COLOR empty: colour")

    rc, tty, _ = on_pty(["check", "default"], stdout_tty=True)
    if rc != 0 or "\x1b[32moffload \x1b[0m" not in tty or "\x1b[32m0 faults\x1b[0m" not in tty:
        fail(f"check on a terminal: offload and '0 faults' green; got {tty[-600:]!r}")
    else:
        ok("check on a terminal: 'offload' and '0 faults' green")
    rc, tty, _ = on_pty(["check", "default"], env={"NO_COLOR": "1"}, stdout_tty=True)
    if rc != 0 or ESC in tty or "offload" not in tty:
        fail("check on a terminal with NO_COLOR: no colour")
    else:
        ok("check on a terminal with NO_COLOR: plain")


def check_progress(d, trace):
    sim = ["sim", "--policy", "default,layers", "--trace", trace, "--steps", "3", "--no-layers"]
    rc, tty, out = on_pty(sim)
    lines = tty.split("\r")
    if rc != 0 or "ferry sim: run 1/3 no offload: step 1/3" not in tty or \
            "run 3/3 layers" not in tty or not re.fullmatch(r" +", lines[-2] if len(lines) > 1 else "") \
            or lines[-1] != "" or "\n" in tty or "peak dev" not in out:
        fail(f"sim progress on a terminal: one line rewritten, cleared at the end; got {tty!r}")
    else:
        ok("sim on a terminal: 'run i/3 label: step s/3' on one line, cleared; the table on stdout")
    rc, tty, out = on_pty(sim + ["-q"])
    if rc != 0 or tty:
        fail(f"sim -q on a terminal: no progress; got {tty!r}")
    r = run(sim)
    if "\r" in r.err or "step 1/3" in r.err:
        fail("sim: no progress when stderr is not a terminal", r)
    ok("no progress with -q or into a pipe")
    rc, tty, out = on_pty(["sim", "--fit", "25MiB", "--trace", trace, "--fit-out",
                           os.path.join(d, "f.lua")])
    if rc != 0 or "ferry sim --fit: setting 2, step 1/" not in tty or "best:" not in out:
        fail(f"sim --fit on a terminal: the settings counted; got {tty[:300]!r}")
    else:
        ok("sim --fit on a terminal: 'setting k, step s/S'")


def check_examples(d):
    """Every example of every --help runs (ferry run only with -n)."""
    bindir = os.path.join(d, "bin")
    os.makedirs(bindir)
    os.symlink(FERRY, os.path.join(bindir, "ferry"))
    work = os.path.join(d, "examples")
    os.makedirs(work)
    for name in ("t.jsonl", "run.jsonl"):
        run(["trace", "synth", "--preset", "tiny", "--steps", "2", "-q", "-o",
             os.path.join(work, name)])
    run(["trace", "synth", "-q", "-o", os.path.join(work, "llama3-8b.jsonl")])
    shutil.copy(find_policy("default"), os.path.join(work, "mine.lua"))
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"]}
    count = 0
    for cmd in [[], *COMMANDS, ["trace"]]:
        h = run([*cmd, "--help"]).out
        m = re.search(r"^examples:\n((?:  .*\n?)+)", h, re.M)
        if not m:
            fail(f"ferry {' '.join(cmd)} --help: no examples")
            continue
        for line in m.group(1).splitlines():
            ex = line.strip()
            if not ex.startswith("ferry "):
                fail(f"ferry {' '.join(cmd)} --help: an example that is not a ferry command: {ex}")
            if ex.startswith("ferry run") and " -n " not in ex:
                continue  # needs a trainer
            if "| jq" in ex and not shutil.which("jq"):
                continue
            r = subprocess.run(["bash", "-o", "pipefail", "-c", ex + " >/dev/null"],
                               cwd=work, env=env, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                print(r.stderr[-1500:])
                fail(f"the example `{ex}` (ferry {' '.join(cmd)} --help): exit {r.returncode}")
            count += 1
    ok(f"the examples of every --help run ({count})")


def main():
    with tempfile.TemporaryDirectory() as d:
        trace = check_dash(d)
        check_quiet_verbose(d, trace)
        check_pipes(trace)
        try:
            for fd in os.openpty():
                os.close(fd)
            have_pty = True
        except OSError as e:
            have_pty = False
            print(f"SKIP colour and progress on a terminal: no pseudo-terminal here ({e})")
        if have_pty:
            check_colour(d, trace)
            check_progress(d, trace)
        check_examples(d)
    if failures:
        sys.exit(f"{failures} failure(s)")


if __name__ == "__main__":
    main()
