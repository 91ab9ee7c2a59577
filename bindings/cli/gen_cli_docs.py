#!/usr/bin/env python3
"""The `ferry` man page and bash completion, made at build time from the
help text the built command prints: `ferry --help`, then `ferry CMD --help`
for each command it lists (and `ferry CMD SUB --help` for a command whose
help lists subcommands), so neither can drift from --help.

Usage: gen_cli_docs.py FERRY_BINARY OUT_DIR
Writes OUT_DIR/ferry.1 (roff, man(7) macros) and OUT_DIR/ferry.bash.

The help text's shape (docs/cli.md): a "usage:" line (and "       " lines
under it), paragraphs, option lines "  -x, --flag VALUE   description" with
deeper continuation lines, a "commands:"/"subcommands:" list of
"  name   summary" lines, and an "examples:" block of command lines.
"""
import re
import subprocess
import sys

FLAG = re.compile(r"(?<![\w-])(-[A-Za-z]|--[a-z][a-z0-9-]*)(?![\w-])")
# "  -o, --output FILE    text": the part before the first run of 2+ spaces
OPTION_LINE = re.compile(r"^(\s+)(-[A-Za-z]|--[a-z])")


def run_help(ferry, args):
    r = subprocess.run([ferry, *args, "--help"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not r.stdout.strip():
        sys.exit(f"gen_cli_docs: `ferry {' '.join(args)} --help` failed ({r.returncode}): "
                 f"{r.stderr.strip()}")
    return r.stdout


def listed_commands(text):
    """Names under a line that ends in "commands:" (top level, subcommands)."""
    names, inside = [], False
    for line in text.splitlines():
        if re.search(r"commands:\s*$", line, re.I):
            inside = True
            continue
        if inside:
            m = re.match(r"^  ([a-z][a-z0-9-]*)\s{2,}\S", line)
            if not m:
                inside = False
                continue
            names.append(m.group(1))
    return names


def split_option(line):
    """(head, description) of an option line: head holds the flags, each
    with its value name, up to the first gap of two spaces or the first word
    after a value that is not a flag ("--chrome-trace FILE compute, ...")."""
    body = line.strip()
    m = re.search(r"\s{2,}", body)
    head, desc = (body[:m.start()], body[m.end():]) if m else (body, "")
    words = head.split(" ")
    i = 0
    while i < len(words) and FLAG.fullmatch(words[i].rstrip(",")):
        i += 1
        if i < len(words) and not words[i].startswith("-"):
            i += 1  # its value
    if i < len(words):
        desc = " ".join(words[i:]) + ("  " + desc if desc else "")
        head = " ".join(words[:i])
    return head, desc.strip()


def options(text):
    """[(flags, value or None, choices)] of every option line, in order."""
    out = []
    for line in text.splitlines():
        if not OPTION_LINE.match(line):
            continue
        head, _ = split_option(line)
        tokens = head.replace(",", " ").split()
        i = 0
        while i < len(tokens):
            if not FLAG.fullmatch(tokens[i]):
                i += 1
                continue
            names = [tokens[i]]
            value = None
            j = i + 1
            while j < len(tokens) and FLAG.fullmatch(tokens[j]):
                names.append(tokens[j])  # "-q, --quiet"
                j += 1
            if j < len(tokens) and not tokens[j].startswith("-"):
                value = tokens[j]
                j += 1
            # "on|off", "llama|gpt": literal words to offer (not "BYTES|PCT%")
            choices = value.split("|") if value and "|" in value else []
            if not all(re.fullmatch(r"[a-z0-9][a-z0-9._-]*", c) for c in choices):
                choices = []
            out.append((names, value, choices))
            i = j
    return out


def roff_escape(s):
    s = s.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + s if s[:1] in (".", "'") else s


def roff_block(text):
    """A help text as man(7): usage and examples preformatted, options as
    tagged paragraphs, the rest as filled paragraphs."""
    out = []
    lines = text.rstrip("\n").splitlines()
    i = 0
    mode = None  # "examples" after an "examples:" line

    while i < len(lines):
        line = lines[i]
        if not line.strip():
            mode = None if mode != "examples" else mode
            if mode == "examples":
                out.append(".fi\n.RE")
                mode = None
            i += 1
            continue
        if line.startswith("usage:"):
            out.append(".PP\n.nf\n" + roff_escape(line))
            i += 1
            while i < len(lines) and lines[i].startswith("       "):
                out.append(roff_escape(lines[i]))
                i += 1
            out.append(".fi")
            continue
        if re.match(r"^examples?:\s*$", line):
            out.append(".PP\n\\fBexamples:\\fR\n.RS\n.nf")
            mode = "examples"
            i += 1
            continue
        if mode == "examples":
            out.append(roff_escape(line.strip()))
            i += 1
            continue
        if OPTION_LINE.match(line):
            indent = len(line) - len(line.lstrip())
            head, desc = split_option(line)
            body = [desc] if desc else []
            i += 1
            while i < len(lines) and lines[i].strip() and \
                    len(lines[i]) - len(lines[i].lstrip()) > indent + 2 and \
                    not OPTION_LINE.match(lines[i]):
                body.append(lines[i].strip())
                i += 1
            out.append(".TP\n.B " + roff_escape(head))
            out.append(roff_escape(" ".join(body)) if body else "\\&")
            continue
        m = re.match(r"^  ([a-z][a-z0-9-]*)\s{2,}(\S.*)$", line)
        if m:  # "  check    load a policy ..."
            out.append(".TP\n.B " + roff_escape(m.group(1)) + "\n" + roff_escape(m.group(2)))
            i += 1
            continue
        if line.startswith(" "):  # anything else indented: as printed
            out.append(".PP\n.nf")
            while i < len(lines) and lines[i].startswith(" ") and \
                    not OPTION_LINE.match(lines[i]):
                out.append(roff_escape(lines[i]))
                i += 1
            out.append(".fi")
            continue
        para = []
        while i < len(lines) and lines[i].strip() and not lines[i].startswith(" ") and \
                not re.match(r"^examples?:\s*$", lines[i]) and not lines[i].startswith("usage:"):
            para.append(lines[i].strip())
            i += 1
        out.append(".PP\n" + roff_escape(" ".join(para)))
    if mode == "examples":
        out.append(".fi\n.RE")
    return "\n".join(out) + "\n"


def man_page(version, top, commands):
    body = [
        '.\\" Generated by bindings/cli/gen_cli_docs.py from `ferry --help` and each',
        '.\\" `ferry CMD --help`; edit the help text, not this file.',
        f'.TH FERRY 1 "" "ferry {roff_escape(version)}" "User Commands"',
        ".SH NAME",
        "ferry \\- check, simulate and run tensor offload policies",
        ".SH SYNOPSIS",
        ".B ferry",
        "\\fIcommand\\fR [\\fIoptions\\fR] [\\fIargs\\fR]",
        ".br",
        ".B ferry",
        "\\-V | \\-\\-version | \\-h | \\-\\-help",
        ".SH DESCRIPTION",
        roff_block(top).rstrip("\n"),
        ".SH COMMANDS",
    ]
    for name, text in commands:
        body.append(f'.SS "ferry {roff_escape(name)}"')
        body.append(roff_block(text).rstrip("\n"))
    body += [
        ".SH ENVIRONMENT",
        ".TP",
        ".B NO_COLOR",
        "set and not empty: no colour, even on a terminal (https://no\\-color.org).",
        ".TP",
        ".B FERRY_POLICY_DIR",
        "folders (colon\\-separated) searched first for a policy given by name.",
        ".TP",
        ".B FERRY_LOG_LEVEL, FERRY_LOG_FILE",
        "the engine's messages: error, warning or info; a file instead of stderr.",
        ".SH SEE ALSO",
        "The docs/ folder of the ferry sources: cli.md (these conventions),",
        "simulator.md, policy\\-api.md, trace\\-format.md.",
    ]
    return "\n".join(body) + "\n"


def bash_words(words):
    return " ".join(sorted(set(words)))


def completion(top_cmds, commands, groups):
    """commands: [(key, help)] with key "sim", "trace synth"; groups: {"trace": ["synth"]}."""
    lines = [
        "# bash completion for ferry. Generated by bindings/cli/gen_cli_docs.py from",
        "# `ferry --help` and each `ferry CMD --help`; edit the help text, not this file.",
        "",
        f"_ferry_commands='{bash_words(top_cmds + ['help'])}'",
    ]
    for group, subs in groups.items():
        lines.append(f"_ferry_sub_{group.replace('-', '_')}='{bash_words(subs)}'")
    hw, presets = [], []
    for key, text in commands:
        var = key.replace(" ", "_").replace("-", "_")
        opts = options(text)
        flags = [f for names, _, _ in opts for f in names]
        valued = [f for names, v, _ in opts if v for f in names]
        lines.append(f"_ferry_flags_{var}='{bash_words(flags)}'")
        lines.append(f"_ferry_valued_{var}='{bash_words(valued)}'")
        for names, _, choices in opts:
            if choices:
                for f in names:
                    fv = f.lstrip("-").replace("-", "_")
                    lines.append(f"_ferry_choices_{var}__{fv}='{bash_words(choices)}'")
        m = re.search(r"--hw ([a-z0-9-]+(?:, [a-z0-9-]+)*)\]", text)
        if m:
            hw = m.group(1).split(", ")
        m = re.search(r"Presets: ([a-z0-9.-]+(?:, [a-z0-9.-]+)*)\.", text)
        if m:
            presets = m.group(1).split(", ")
    lines.append(f"_ferry_hw='{bash_words(hw)}'")
    lines.append(f"_ferry_presets='{bash_words(presets)}'")
    lines.append(COMPLETION_BODY)
    return "\n".join(lines) + "\n"


COMPLETION_BODY = r'''
# The shipped policies' names, from the folders `ferry` searches
# (ferry_policy_find): $FERRY_POLICY_DIR, <prefix>/share/ferry/policies and
# policies/ beside the binary (a build tree's share/ links to its sources);
# and, for a wheel's `ferry` (a Python script in <env>/bin that points the
# binary at its package's policies), <env>/lib/python3*/*-packages/ferry/policies.
_ferry_policy_names() {
  local bin dir f dirs=()
  if [[ -n ${FERRY_POLICY_DIR-} ]]; then
    IFS=: read -r -a dirs <<< "$FERRY_POLICY_DIR"
  fi
  bin=$(type -P -- "${COMP_WORDS[0]}" 2>/dev/null) && bin=$(readlink -f -- "$bin") &&
    dirs+=("${bin%/*}/../share/ferry/policies" "${bin%/*}/policies"
           "${bin%/*}"/../lib/python3*/{site,dist}-packages/ferry/policies)
  for dir in "${dirs[@]}"; do
    for f in "$dir"/*.lua; do
      [[ -f $f ]] || continue
      f=${f##*/}
      printf '%s\n' "${f%.lua}"
    done
  done | sort -u
}

_ferry_files() { # files (those matching the glob $1, and folders) named from $cur
  compopt -o filenames 2>/dev/null
  if [[ -n ${1-} ]]; then
    COMPREPLY+=($(compgen -f -X "!$1" -- "$cur") $(compgen -d -- "$cur"))
  else
    COMPREPLY+=($(compgen -f -- "$cur"))
  fi
}

_ferry() {
  local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
  local key first=2 i
  COMPREPLY=()
  if ((COMP_CWORD == 1)); then
    COMPREPLY=($(compgen -W "$_ferry_commands -h --help -V --version" -- "$cur"))
    return
  fi
  key=${COMP_WORDS[1]}
  if [[ $key == help ]]; then
    ((COMP_CWORD == 2)) && COMPREPLY=($(compgen -W "${_ferry_commands/help/}" -- "$cur"))
    return
  fi
  local subs_var="_ferry_sub_${key//-/_}"
  if [[ -n ${!subs_var-} ]]; then # a command with subcommands (ferry trace synth)
    if ((COMP_CWORD == 2)); then
      COMPREPLY=($(compgen -W "${!subs_var} -h --help" -- "$cur"))
      return
    fi
    key="${key}_${COMP_WORDS[2]}"
    first=3
  fi
  key=${key//-/_}
  local flags_var="_ferry_flags_$key" valued_var="_ferry_valued_$key"
  [[ -n ${!flags_var-} ]] || return
  # ferry run: the trainer's command line follows "--" or the first word
  # that is neither an option nor an option's value
  if [[ $key == run ]]; then
    for ((i = first; i <= COMP_CWORD; i++)); do
      local w=${COMP_WORDS[i]} before=${COMP_WORDS[i-1]}
      if [[ $w == -- ]] && ((i < COMP_CWORD)); then
        if ((i + 1 == COMP_CWORD)); then COMPREPLY=($(compgen -c -- "$cur")); else _ferry_files; fi
        return
      fi
      if [[ $w != -* ]] && [[ " ${!valued_var} " != *" $before "* ]]; then
        if ((i == COMP_CWORD)); then COMPREPLY=($(compgen -c -- "$cur")); else _ferry_files; fi
        return
      fi
    done
  fi
  if [[ " ${!valued_var} " == *" $prev "* ]]; then
    local choices_var="_ferry_choices_${key}__${prev##*-}"
    choices_var=${choices_var//-/_}
    case $prev in
      --policy | -p)
        COMPREPLY=($(compgen -W "$(_ferry_policy_names)" -- "$cur"))
        _ferry_files '*.lua'
        ;;
      --hw) COMPREPLY=($(compgen -W "$_ferry_hw" -- "$cur")) ;;
      --preset) COMPREPLY=($(compgen -W "$_ferry_presets" -- "$cur")) ;;
      *)
        if [[ -n ${!choices_var-} ]]; then
          COMPREPLY=($(compgen -W "${!choices_var}" -- "$cur"))
        else
          _ferry_files
        fi
        ;;
    esac
    return
  fi
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "${!flags_var}" -- "$cur"))
    return
  fi
  if [[ $key == check ]]; then # POLICY
    COMPREPLY=($(compgen -W "$(_ferry_policy_names)" -- "$cur"))
    _ferry_files '*.lua'
    return
  fi
  _ferry_files
}
complete -F _ferry ferry
'''


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    ferry, out_dir = sys.argv[1:]
    version = subprocess.run([ferry, "--version"], capture_output=True, text=True,
                             check=True).stdout.split()[-1]
    top = run_help(ferry, [])
    top_cmds = listed_commands(top)
    if not top_cmds:
        sys.exit("gen_cli_docs: no commands listed in `ferry --help`")
    commands, groups = [], {}
    for name in top_cmds:
        text = run_help(ferry, [name])
        subs = [s for s in listed_commands(text)]
        if subs:
            groups[name] = subs
            commands.append((name, text))
            for sub in subs:
                commands.append((f"{name} {sub}", run_help(ferry, [name, sub])))
        else:
            commands.append((name, text))
    with open(f"{out_dir}/ferry.1", "w") as f:
        f.write(man_page(version, top, commands))
    with open(f"{out_dir}/ferry.bash", "w") as f:
        f.write(completion(top_cmds, commands, groups))


if __name__ == "__main__":
    main()
