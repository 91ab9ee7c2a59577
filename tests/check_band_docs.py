#!/usr/bin/env python3
"""The error bands' rows (engine/src/sim/sim_bands.c) are docs/sim-validation.md's
validation table ("## Validation: memory and cost"), row for row: source,
GPUs, eager or compiled, seq and CP, the simulated overhead (which makes a
row copy-bound), and the memory and overhead errors in points (or the
published bound, or none). When the table's figures change (the model
improved), this fails and names the row and field to update in sim_bands.c.
Each error must also be its row's simulated - published figure, so a
simulated or published figure changed without its error fails too.

Usage: check_band_docs.py LIBFERRY_SO DOC"""
import ctypes
import re
import sys

NONE, NUMBER, BOUND = 0, 1, 2
# each of simulated, published and error is rounded to the table's digits
ERROR_ROUNDING = 0.1 + 1e-9


class Row(ctypes.Structure):  # sim_band_row (ferry_sim.h)
    _fields_ = [("source", ctypes.c_char_p), ("label", ctypes.c_char_p),
                ("gpus", ctypes.c_int32), ("compiled", ctypes.c_int32),
                ("seq", ctypes.c_int32), ("cp", ctypes.c_int32),
                ("sim_overhead_pct", ctypes.c_double),
                ("memory_kind", ctypes.c_int32), ("memory_points", ctypes.c_double),
                ("overhead_kind", ctypes.c_int32), ("overhead_points", ctypes.c_double),
                ("publication", ctypes.c_char_p)]


def library_rows(path):
    lib = ctypes.CDLL(path)
    lib.sim_band_rows.restype = ctypes.c_int
    lib.sim_band_rows.argtypes = [ctypes.POINTER(ctypes.POINTER(Row))]
    p = ctypes.POINTER(Row)()
    n = lib.sim_band_rows(ctypes.byref(p))
    return [p[i] for i in range(n)]


def number(text):
    """The first signed number of a cell ("−21.0 (−61.2)" -> -21.0), or None."""
    m = re.search(r"[+\-−]?\d[\d,]*(?:\.\d+)?", text)
    return float(m.group(0).replace("−", "-").replace(",", "")) if m else None


def table(doc):
    """The validation table's header cells and rows (lists of cells)."""
    lines = open(doc, encoding="utf-8").read().split("\n")
    section = "## Validation: memory and cost"
    if section not in lines:
        sys.exit(f"{doc}: no \"{section}\" section (the error bands' rows come from its table)")
    start = lines.index(section)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    if len(rows) < 2:
        sys.exit(f"{doc}: no table under \"{section}\" (a header line and its |---| line)")
    return rows[0], [r for r in rows[2:]]


def documented_rows(doc):
    head, body = table(doc)

    def col(prefix):
        for i, h in enumerate(head):
            if h.startswith(prefix):
                return i
        sys.exit(f"{doc}: the validation table has no column starting {prefix!r}: {head}")
    c_src, c_hw, c_mode, c_seq = col("source"), col("hardware"), col("eager"), col("seq")
    c_mem, c_ovh = col("memory saved"), col("overhead")
    if head[c_mem + 2] != "error" or head[c_ovh + 1] != "simulated" or head[c_ovh + 2] != "error":
        sys.exit(f"{doc}: expected 'published | simulated | error' after {head[c_mem]!r} and "
                 f"{head[c_ovh]!r}: {head}")
    out, prev, inconsistent = [], {}, []
    for cells in body:
        def cell(i):
            return cells[i] if i < len(cells) else ""
        src = cell(c_src)
        m = re.search(r"github\.com/([^/]+/[^/]+)/pull/(\d+)", src)
        source = f"{m.group(1)}#{m.group(2)}" if m else prev.get("source")
        hw = cell(c_hw)
        if hw.startswith("same"):
            gpus, cp = prev["gpus"], prev["cp"]
        else:
            g = re.search(r"(\d+)\s*(?:x\b|GPUs?\b)", hw)
            c = re.search(r"CP (\d+)", hw)
            gpus, cp = int(g.group(1)) if g else None, int(c.group(1)) if c else 1
        seq = prev.get("seq") if cell(c_seq).startswith("same") else number(cell(c_seq))
        mem_err = cell(c_mem + 2)
        ovh_pub, ovh_sim, ovh_err = cell(c_ovh), cell(c_ovh + 1), cell(c_ovh + 2)
        if ovh_err.startswith("a bound"):
            ovh = (BOUND, number(ovh_pub))
        elif number(ovh_err) is None:
            ovh = (NONE, 0.0)
        else:
            ovh = (NUMBER, number(ovh_err))
        # the error is simulated - published: a figure changed without its
        # error (or the other way) is a table at odds with itself
        for what, c in (("memory saved", c_mem), ("overhead", c_ovh)):
            pub, sim, err = (number(cell(c + k)) for k in range(3))
            if None in (pub, sim, err) or cell(c + 2).startswith("a bound"):
                continue
            if abs(err - (sim - pub)) > ERROR_ROUNDING:
                inconsistent.append(f"{source} ({cell(c_src)[:60]}...): {what}: error {err:+.1f} "
                                    f"is not simulated {sim} - published {pub} = {sim - pub:+.2f}")
        row = {"source": source, "gpus": gpus, "cp": cp, "seq": int(seq) if seq else None,
               "compiled": 1 if cell(c_mode).startswith("compiled") else 0,
               "sim_overhead_pct": number(ovh_sim),
               "memory": (NONE, 0.0) if number(mem_err) is None else (NUMBER, number(mem_err)),
               "overhead": ovh}
        out.append(row)
        prev = row
    return out, inconsistent


def main():
    lib, doc = sys.argv[1], sys.argv[2]
    have, (said, inconsistent) = library_rows(lib), documented_rows(doc)
    where = "engine/src/sim/sim_bands.c's rows"
    bad = list(inconsistent)
    if len(have) != len(said):
        bad.append(f"{doc} has {len(said)} validation rows, {where} {len(have)}")
    for i, (h, d) in enumerate(zip(have, said)):
        name = f"row {i + 1} ({h.source.decode()} {h.label.decode()})"
        pairs = [("source", h.source.decode(), d["source"]), ("GPUs", h.gpus, d["gpus"]),
                 ("CP", h.cp, d["cp"]), ("seq", h.seq, d["seq"]),
                 ("compiled", h.compiled, d["compiled"]),
                 ("memory", (h.memory_kind, round(h.memory_points, 1)),
                  (d["memory"][0], round(d["memory"][1], 1))),
                 ("overhead", (h.overhead_kind, round(h.overhead_points, 1)),
                  (d["overhead"][0], round(d["overhead"][1], 1)))]
        for what, a, b in pairs:
            if a != b:
                bad.append(f"{name}: {what}: {doc} says {b!r}, {where} {a!r}")
        if d["sim_overhead_pct"] is None or abs(h.sim_overhead_pct - d["sim_overhead_pct"]) > 0.05:
            bad.append(f"{name}: simulated overhead: {doc} says {d['sim_overhead_pct']!r}, "
                       f"{where} {h.sim_overhead_pct!r}")
    if bad:
        print("the error bands' rows disagree with the validation table (update " + where +
              " from the table: the kinds are 0 none, 1 a number, 2 a bound):")
        for b in bad:
            print("  " + b)
        return 1
    print(f"{doc}: the {len(have)} validation rows match {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
