#!/usr/bin/env python3
"""The man page and the bash completion made at build time
(bindings/cli/gen_cli_docs.py) agree with what the built `ferry` prints:

- ferry.1 has a section per command and subcommand that `ferry --help`
  (and `ferry trace --help`) lists, and each section names every flag and
  every example of that command's --help; it carries `ferry -V`'s version;
  groff renders it without a warning (where groff is installed);
- the completion, run in bash with COMP_WORDS/COMP_CWORD set, offers the
  commands, every flag of each command's --help (and no other), the shipped
  policies after --policy and for `ferry check`, --hw and --preset values,
  on|off values, and the trainer's command after `ferry run`'s options.

The flags are read from --help here with a pattern of this test's own, not
the generator's, so a generator that drops one fails.

Usage: test_cli_docs.py FERRY_BINARY FERRY_1 FERRY_BASH"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

FERRY, MAN, BASH = (os.path.abspath(a) for a in sys.argv[1:4])
POLICY_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "policies")
failures = 0


def fail(what):
    global failures
    failures += 1
    print(f"FAIL {what}")


def ok(what):
    print(f"ok   {what}")


def help_of(cmd):
    return subprocess.run([FERRY, *cmd, "--help"], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def commands():
    """["check"], ["sim"], ["trace"], ["trace", "synth"], ["run"] as --help lists them."""
    def listed(text):
        block = re.search(r"commands:\s*\n((?:  [a-z][a-z0-9-]*  +\S.*\n)+)", text, re.I)
        return re.findall(r"^  ([a-z][a-z0-9-]*)  ", block.group(1), re.M) if block else []
    out = []
    for name in listed(help_of([])):
        out.append([name])
        out += [[name, sub] for sub in listed(help_of([name]))]
    return out


def flags_in_help(text):
    """Every -x and --long on an option line, before its description."""
    found = set()
    for line in text.splitlines():
        if not re.match(r"^\s+-", line):
            continue
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        found |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[A-Za-z])(?![\w-])", head))
    return found


def examples_in_help(text):
    m = re.search(r"^examples:\n((?:  .*\n?)+)", text, re.M)
    return [x.strip() for x in m.group(1).splitlines()] if m else []


def unroff(s):
    s = re.sub(r"\\f[BIRP]", "", s).replace("\\-", "-").replace("\\&", "").replace("\\e", "\\")
    return s


def check_man(cmds):
    with open(MAN) as f:
        man = f.read()
    version = subprocess.run([FERRY, "-V"], capture_output=True, text=True).stdout.split()[-1]
    if f'"ferry {version}"' not in unroff(man):
        fail(f"ferry.1 is not of this build's version {version} (a stale man page?)")
    sections = {}
    for m in re.finditer(r'^\.SS "ferry ([^"]+)"\n(.*?)(?=^\.S[SH] |\Z)', man, re.M | re.S):
        sections[unroff(m.group(1))] = unroff(m.group(2))
    for cmd in cmds:
        name = " ".join(cmd)
        if name not in sections:
            fail(f"ferry.1: no section for ferry {name}")
            continue
        text = help_of(cmd)
        body = sections[name]
        missing = [f for f in sorted(flags_in_help(text))
                   if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", body)]
        if missing:
            fail(f"ferry.1, ferry {name}: flags of --help missing: {missing}")
        for ex in examples_in_help(text):
            if ex not in body:
                fail(f"ferry.1, ferry {name}: the example `{ex}` missing")
    top = unroff(man.split(".SH COMMANDS")[0])
    for ex in examples_in_help(help_of([])):
        if ex not in top:
            fail(f"ferry.1: ferry --help's example `{ex}` missing")
    ok(f"ferry.1: a section for each of {len(cmds)} commands with every flag and example")
    groff = shutil.which("groff")
    if groff:
        r = subprocess.run([groff, "-man", "-ww", "-z", "-Tutf8", MAN], capture_output=True,
                           text=True, timeout=60)
        if r.returncode or r.stderr.strip():
            fail(f"groff -man -ww: {r.stderr.strip()[:1000]}")
        else:
            ok("groff -man -ww renders ferry.1 without a warning")


def complete(*words, env=None, bin_dir=None):
    """COMPREPLY of the completion for the command line `words` (the last is
    the word being completed), with `ferry` found in bin_dir (default: the
    build's)."""
    script = (f'source "{BASH}"\n'
              'COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=()\n'
              '_ferry\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    path = (bin_dir or os.path.dirname(FERRY)) + os.pathsep + os.environ.get("PATH", "")
    r = subprocess.run(["bash", "-c", script, "bash", *words], capture_output=True, text=True,
                       timeout=60, cwd=os.path.dirname(MAN),
                       env={**os.environ, "PATH": path, **(env or {})})
    if r.returncode:
        fail(f"completion of {words}: bash exit {r.returncode}: {r.stderr[-500:]}")
    return set(r.stdout.split())


def check_completion(cmds):
    top = {c[0] for c in cmds}
    got = complete("ferry", "")
    if not top <= got:
        fail(f"ferry <TAB>: {sorted(top - got)} not offered (got {sorted(got)})")
    if complete("ferry", "s") != {"sim"}:
        fail(f"ferry s<TAB>: {complete('ferry', 's')}")
    for cmd in cmds:
        if len(cmd) == 1 and [c for c in cmds if c[:1] == cmd and len(c) == 2]:
            subs = {c[1] for c in cmds if c[:1] == cmd and len(c) == 2}
            got = complete("ferry", *cmd, "")
            if not subs <= got:
                fail(f"ferry {cmd[0]} <TAB>: {sorted(subs)} not offered (got {sorted(got)})")
            continue
        want = flags_in_help(help_of(cmd))
        got = complete("ferry", *cmd, "-")
        if got != want:
            fail(f"ferry {' '.join(cmd)} -<TAB>: missing {sorted(want - got)}, "
                 f"extra {sorted(got - want)}")
        longs = {f for f in want if f.startswith("--")}
        if complete("ferry", *cmd, "--") != longs:
            fail(f"ferry {' '.join(cmd)} --<TAB>: not the long flags")
    ok("every command's flags offered, as its --help lists them")
    if complete("ferry", "sim", "--st") != {"--steps"}:
        fail("ferry sim --st<TAB>: --steps")
    else:
        ok("ferry sim --st<TAB>: --steps")

    shipped = {f[:-4] for f in os.listdir(POLICY_DIR) if f.endswith(".lua")}
    for words in (("ferry", "sim", "--policy", ""), ("ferry", "check", ""),
                  ("ferry", "run", "-p", "")):
        got = complete(*words)
        if not shipped <= got:
            fail(f"{' '.join(words)}<TAB>: shipped policies {sorted(shipped - got)} missing")
    if complete("ferry", "check", "--layers", "2", "la") != {"layers"}:
        fail("ferry check --layers 2 la<TAB>: layers (after an option's value)")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "zz_mine.lua"), "w") as f:
            f.write("return {}\n")
        if "zz_mine" not in complete("ferry", "sim", "--policy", "zz",
                                     env={"FERRY_POLICY_DIR": d}):
            fail("FERRY_POLICY_DIR's policies offered")
    ok("shipped policy names after --policy/-p and for ferry check; FERRY_POLICY_DIR's too")
    with tempfile.TemporaryDirectory() as env_root:
        # A wheel installed into an environment: <env>/bin/ferry is pip's
        # console script; the policies are in the package, not beside it.
        bin_dir = os.path.join(env_root, "bin")
        pkg = os.path.join(env_root, "lib", "python3.11", "site-packages", "ferry", "policies")
        os.makedirs(bin_dir)
        os.makedirs(pkg)
        with open(os.path.join(pkg, "zz_wheel.lua"), "w") as f:
            f.write("return {}\n")
        script = os.path.join(bin_dir, "ferry")
        with open(script, "w") as f:
            f.write("#!/bin/sh\nexit 0\n")
        os.chmod(script, 0o755)
        if "zz_wheel" not in complete("ferry", "sim", "--policy", "zz", bin_dir=bin_dir):
            fail("a wheel's policies (<env>/lib/python3*/site-packages/ferry/policies) offered")
        else:
            ok("a wheel's policies offered")

    hw = re.search(r"--hw ([a-z0-9, -]+)\]", help_of(["sim"])).group(1).split(", ")
    if complete("ferry", "sim", "--hw", "") != set(hw):
        fail(f"ferry sim --hw <TAB>: {hw}")
    if "tiny" not in complete("ferry", "trace", "synth", "--preset", "t"):
        fail("ferry trace synth --preset t<TAB>: tiny")
    if complete("ferry", "trace", "synth", "--flash", "") != {"on", "off"}:
        fail("ferry trace synth --flash <TAB>: on off")
    ok("values: --hw presets, --preset names, on|off")

    if "true" not in complete("ferry", "run", "--policy", "default", "tru"):
        fail("ferry run --policy default tru<TAB>: a command (true)")
    if "true" not in complete("ferry", "run", "--", "tru"):
        fail("ferry run -- tru<TAB>: a command (true)")
    if any(w.startswith("--") for w in complete("ferry", "run", "--", "python", "--")):
        fail("ferry run -- python --<TAB>: the trainer's words, not ferry run's flags")
    ok("ferry run: the trainer's command after its options or --")


def main():
    cmds = commands()
    if len(cmds) < 5:
        sys.exit(f"FAIL commands read from ferry --help: {cmds}")
    check_man(cmds)
    check_completion(cmds)
    if failures:
        sys.exit(f"{failures} failure(s)")


if __name__ == "__main__":
    main()
