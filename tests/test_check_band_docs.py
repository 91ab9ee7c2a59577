#!/usr/bin/env python3
"""check_band_docs.py catches drift: it passes on docs/sim-validation.md as it
is and fails on copies of it with a changed error, a changed simulated or
published figure whose error was left alone, a row removed, a row added and
two rows swapped; a page without the section or its table gets a message.

Usage: test_check_band_docs.py LIBFERRY_SO DOC"""
import os
import subprocess
import sys
import tempfile

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_band_docs.py")
ACC = "| [huggingface/accelerate PR #4175]"
MEG = "| [NVIDIA/Megatron-LM PR #1752]"
TT5 = "| [pytorch/torchtitan PR #3521]"


def row_index(lines, row_start):
    """The validation table's row starting row_start (other tables of the
    page have rows of the same publications)."""
    top = lines.index("## Validation: memory and cost")
    return next(k for k in range(top, len(lines)) if lines[k].startswith(row_start))


def edit_cell(text, row_start, old, new):
    """text with old replaced by new in the table row starting row_start."""
    lines = text.split("\n")
    i = row_index(lines, row_start)
    if old not in lines[i]:
        sys.exit(f"FAIL setup: {old!r} not in the row {row_start!r}")
    lines[i] = lines[i].replace(old, new, 1)
    return "\n".join(lines)


def rows_op(text, row_start, op):
    lines = text.split("\n")
    i = row_index(lines, row_start)
    if op == "remove":
        del lines[i]
    elif op == "add":
        lines.insert(i + 1, lines[i])
    else:  # swap with the next row
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    return "\n".join(lines)


def check(lib, path):
    return subprocess.run([sys.executable, CHECK, lib, path], capture_output=True, text=True)


def main():
    lib, doc = sys.argv[1], sys.argv[2]
    text = open(doc, encoding="utf-8").read()
    failures = []
    r = check(lib, doc)
    if r.returncode:
        failures.append(f"the table as it is fails: {r.stdout[-400:]}")
    mutants = {
        "an error changed": edit_cell(text, MEG, "| +0.0% | −0.3 |", "| +0.0% | −0.4 |"),
        "a simulated memory figure changed, its error not":
            edit_cell(text, ACC, "| 43.0% (15.99 → 9.11 GB) |", "| 44.2% (15.99 → 8.92 GB) |"),
        "a published overhead changed, its error not":
            edit_cell(text, MEG, "| +0.3% (1249.7 → 1253.8 ms) |", "| +1.3% (1249.7 → 1265.0 ms) |"),
        "a row removed": rows_op(text, MEG, "remove"),
        "a row added": rows_op(text, MEG, "add"),
        "two rows swapped": rows_op(text, TT5, "swap"),
    }
    with tempfile.TemporaryDirectory() as d:
        for what, mutant in mutants.items():
            if mutant == text:
                failures.append(f"setup: {what}: the copy is unchanged")
                continue
            path = os.path.join(d, "sim-validation.md")
            with open(path, "w", encoding="utf-8") as f:
                f.write(mutant)
            if check(lib, path).returncode == 0:
                failures.append(f"{what}: check_band_docs.py passes")
    # a page without the section, or the section without its table: a
    # message naming what is missing, not a traceback
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sim-validation.md")
        top = text.index("## Validation: memory and cost")
        for what, mutant, want in (
                ("no section", text.replace("## Validation: memory and cost", "## Validation"),
                 "no \"## Validation: memory and cost\" section"),
                ("no table", text[:top] + "## Validation: memory and cost\n\nsoon.\n",
                 "no table under \"## Validation: memory and cost\"")):
            with open(path, "w", encoding="utf-8") as f:
                f.write(mutant)
            r = check(lib, path)
            if r.returncode == 0 or "Traceback" in r.stderr or want not in r.stdout + r.stderr:
                failures.append(f"{what}: exit {r.returncode}, {(r.stdout + r.stderr)[-300:]!r}")
    for f in failures:
        print("FAIL " + f)
    if failures:
        return 1
    print(f"ok: check_band_docs.py fails on each of {len(mutants)} drifted tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
