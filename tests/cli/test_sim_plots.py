#!/usr/bin/env python3
"""The SVG and the HTML report of `ferry sim` against what a reader needs
(docs/sim-outputs.md, "Outputs"), without a browser:

SVG: one device curve per run (the baseline and each policy), a pinned
host curve for each run that pins memory, the right axis with its title
and ticks, the stall strip's rects for each run with stall (inside the
strip and the time axis, adding up to the run's stall), no rect for a run
without, one "backward starts" line per run, the peak annotations equal to
--json's peaks and drawn at them, the legend below everything else, and
no text outside the viewBox or over another text (text boxes estimated
with the SVG writer's own rule).

HTML: parses as XML, a row of the comparison table per run with its peak,
the SVG inline with its curves, the per-layer bars equal to --json's
layers, and nothing fetched from anywhere (no http(s):// at all, no
script, link, img, iframe, src, url() or @import).

Usage: test_sim_plots.py FERRY_BINARY"""
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

FERRY = sys.argv[1]
SVG_NS = "{http://www.w3.org/2000/svg}"
GIB, MIB = 1 << 30, 1 << 20


def text_w(s, fs):
    """sim_plot.c's text_w: the width of s at font size fs, a little wide."""
    w = 0.0
    for ch in s:
        if ord(ch) >= 0x80:
            w += 0.9
        elif ch in "il.,:;'|!Ijft()[] ":
            w += 0.34
        elif ch in "mwMW%@":
            w += 0.95
        elif "A" <= ch <= "Z":
            w += 0.72
        elif "0" <= ch <= "9":
            w += 0.64
        else:
            w += 0.58
    return w * fs


def fmt_bytes(v):
    """sim_plot.c's fmt_bytes."""
    if v >= GIB:
        return f"{v / GIB:.2f} GiB"
    if v >= MIB:
        return f"{v / MIB:.1f} MiB"
    if v >= 1024:
        return f"{v / 1024:.1f} KiB"
    return f"{v:.0f} B"


def tag(e):
    return e.tag.rsplit("}", 1)[-1]


def classes(e):
    return (e.get("class") or "").split()


def points(e):
    return [tuple(map(float, p.split(","))) for p in e.get("points").split()]


def sim(d, name, policies, extra=()):
    trace = os.path.join(d, "t.jsonl")
    if not os.path.exists(trace):
        subprocess.run([FERRY, "trace", "synth", "--preset", "tiny", "-o", trace], check=True,
                       capture_output=True)
    out = {k: os.path.join(d, f"{name}.{k}") for k in ("json", "svg", "html")}
    # --host-overhead 0: the tiny model's kernels are so short that the
    # host's per-tensor cost would set its pace and absorb the stalls (and
    # split step 2's waits otherwise than step 3's) the plots are checked on
    r = subprocess.run([FERRY, "sim", "--trace", trace, "--policy", policies, "--steps", "3",
                        "--host-overhead", "0", "--no-layers", "-q", "--json", out["json"], "--svg", out["svg"],
                        "--html", out["html"], *extra], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ferry sim failed ({r.returncode}): {r.stderr}")
    with open(out["json"]) as f:
        report = json.load(f)
    runs = {x["name"]: x for x in [report["baseline"], *report["policies"]]}
    return out, report, runs


def text_boxes(root, problems):
    """(box, text) of every text element; problems for those outside the viewBox."""
    W, H = (float(x) for x in root.get("viewBox").split()[2:])
    boxes = []
    for e in root.iter():
        if tag(e) != "text":
            continue
        s = "".join(e.itertext())
        fs = float(e.get("font-size") or root.get("font-size") or 12)
        x, y = float(e.get("x")), float(e.get("y"))
        w = text_w(s, fs)
        anchor = e.get("text-anchor") or "start"
        x0 = x if anchor == "start" else x - w / 2 if anchor == "middle" else x - w
        tr = e.get("transform") or ""
        if tr.startswith("rotate"):  # turned 90 degrees about its anchor: along y
            b = (x - 0.8 * fs, y - w / 2, x + 0.8 * fs, y + w / 2) if anchor == "middle" else None
            if b is None:
                problems.append(f"rotated text not centred: {s!r}")
                continue
        else:
            b = (x0, y - 0.8 * fs, x0 + w, y + 0.25 * fs)
        if b[0] < 0 or b[1] < 0 or b[2] > W or b[3] > H:
            problems.append(f"text outside the viewBox 0 0 {W:g} {H:g}: {s!r} at {b}")
        boxes.append((b, s))
    return boxes


def overlap(a, b):
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def check_svg(path, runs, problems):
    root = ET.parse(path).getroot()
    if tag(root) != "svg" or root.tag != SVG_NS + "svg":
        problems.append(f"root {root.tag}")
    by_class = {}
    for e in root.iter():
        for c in classes(e):
            by_class.setdefault(c, []).append(e)
    area = by_class["plot-area"][0]
    L, T = float(area.get("x")), float(area.get("y"))
    R, B = L + float(area.get("width")), T + float(area.get("height"))
    dev_top = float(area.get("data-device-bytes-top"))
    host_top = float(area.get("data-host-bytes-top"))
    strip = by_class["stall-area"][0]
    sT = float(strip.get("y"))
    sB = sT + float(strip.get("height"))

    def inside(x, y, x0, y0, x1, y1, what):
        if not (x0 - 0.5 <= x <= x1 + 0.5 and y0 - 0.5 <= y <= y1 + 0.5):
            problems.append(f"{what}: ({x}, {y}) outside ({x0}, {y0})-({x1}, {y1})")

    # one device curve per run, one host curve per run that pins memory
    for cls, want in (("device-curve", set(runs)),
                      ("host-curve", {n for n, r in runs.items() if r["peak_host_bytes"] > 0})):
        got = [e.get("data-run") for e in by_class.get(cls, [])]
        if sorted(got) != sorted(want):
            problems.append(f"{cls}s for {sorted(got)}, want one for each of {sorted(want)}")
        for e in by_class.get(cls, []):
            pts = points(e)
            if len(pts) < 2:
                problems.append(f"{cls} {e.get('data-run')}: {len(pts)} points")
            for x, y in pts:
                inside(x, y, L, T, R, B, f"{cls} {e.get('data-run')}")
    # the axes: titles on both sides, ticks right of the plot on the right
    titles = {" ".join(classes(e)[1:]): "".join(e.itertext()) for e in by_class["axis-title"]}
    if not re.match(r"device memory in use \((GiB|MiB)\)", titles.get("left", "")):
        problems.append(f"left axis title {titles.get('left')!r}")
    if not re.match(r"pinned host memory in use \((GiB|MiB)\)", titles.get("right", "")):
        problems.append(f"right axis title {titles.get('right')!r}")
    if "time" not in titles.get("x", ""):
        problems.append(f"time axis title {titles.get('x')!r}")
    right = [e for e in by_class.get("tick", []) if "right" in classes(e)]
    if len(right) < 3 or any(float(e.get("x")) <= R for e in right):
        problems.append(f"right axis ticks: {len(right)}, all right of the plot expected")
    # the stall strip: rects where a run stalled, inside the strip and the
    # time axis, adding up to its stall (the last step's, the same as the
    # steady mean here)
    stalled = {}
    for e in by_class.get("stall", []):
        run = e.get("data-run")
        x, y = float(e.get("x")), float(e.get("y"))
        w, h = float(e.get("width")), float(e.get("height"))
        inside(x, y, L, sT, R, sB, f"stall rect of {run}")
        inside(x + w, y + h, L, sT, R, sB, f"stall rect of {run}")
        stalled[run] = stalled.get(run, 0) + float(e.get("data-us"))
    for name, r in runs.items():
        got, want = stalled.get(name, 0), r["stall_us"]
        if abs(got - want) > max(1.0, 0.01 * want):
            problems.append(f"{name}: stall rects add up to {got:.1f} us, --json says {want:.1f}")
    if not any(r["stall_us"] > 0 for r in runs.values()):
        problems.append("no run stalls: the test needs one that does")
    # one backward line per run, inside the plot
    got = sorted(e.get("data-run") for e in by_class.get("backward", []))
    if got != sorted(runs):
        problems.append(f"backward lines for {got}")
    for e in by_class.get("backward", []):
        inside(float(e.get("x1")), float(e.get("y1")), L, T, R, B, "backward line")
    # the peaks: the figure --json gives, drawn where the curve reaches it
    peaks = {}
    for g in by_class.get("peak", []):
        kind = "device" if "device" in classes(g) else "host"
        run = g.get("data-run")
        peaks[(run, kind)] = g
        want = runs[run]["peak_device_bytes" if kind == "device" else "peak_host_bytes"]
        if float(g.get("data-bytes")) != want:
            problems.append(f"{run} {kind} peak {g.get('data-bytes')}, --json says {want}")
        label = "".join(t for e in g if tag(e) == "text" for t in e.itertext())
        if fmt_bytes(want) not in label or not label.startswith(run[:12]):  # long names cut
            problems.append(f"{run} {kind} peak label {label!r} lacks {fmt_bytes(want)!r}")
        for e in g:
            if tag(e) in ("circle", "rect"):
                cy = float(e.get("cy")) if tag(e) == "circle" else float(e.get("y")) + 3.5
                top = dev_top if kind == "device" else host_top
                if abs((B - cy) / (B - T) * top - want) > 1.5 / (B - T) * top:
                    problems.append(f"{run} {kind} peak marker at y {cy}, not at {want} B")
            if tag(e) == "text":
                inside(float(e.get("x")), float(e.get("y")), L, T, R, B, f"{run} peak label")
    for name, r in runs.items():
        if (name, "device") not in peaks:
            problems.append(f"{name}: no device peak annotation")
        if r["peak_host_bytes"] > 0 and (name, "host") not in peaks:
            problems.append(f"{name}: no host peak annotation")
    # the legend: a row per run, below the plot and the strip
    got = sorted(g.get("data-run") for g in by_class.get("run", []) if "legend" in classes(g))
    if got != sorted(runs):
        problems.append(f"legend rows for {got}")
    for g in by_class.get("legend", []):
        for e in g.iter():
            y = e.get("y") or e.get("y1") or e.get("cy")
            if y is not None and float(y) < sB:
                problems.append(f"legend element {tag(e)} at y {y}, inside the plot or strip")
    # text: inside the viewBox, none over another
    boxes = text_boxes(root, problems)
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if overlap(boxes[i][0], boxes[j][0]):
                problems.append(f"texts overlap: {boxes[i][1]!r} and {boxes[j][1]!r}")


def check_html(path, runs, report, problems):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for bad in ("http://", "https://", "<script", "<link", "<img", "<iframe", "src=", "url(",
                "@import"):
        if bad in text:
            problems.append(f"{path}: {bad!r}: the page must load nothing")
    root = ET.fromstring(text[text.index("<html"):])  # well-formed
    rows = {e.get("data-run"): e for e in root.iter("tr") if e.get("data-run")}
    if sorted(rows) != sorted(runs):
        problems.append(f"comparison rows for {sorted(rows)}, want {sorted(runs)}")
    for name, tr in rows.items():
        cells = ["".join(td.itertext()) for td in tr.iter("td")]
        if fmt_bytes(runs[name]["peak_device_bytes"]) not in cells:
            problems.append(f"{name}'s row {cells} lacks its peak")
    svgs = list(root.iter("svg"))
    if len(svgs) != 1:
        problems.append(f"{len(svgs)} inline svg elements")
    else:
        curves = [e.get("data-run") for e in svgs[0].iter("polyline")
                  if "device-curve" in classes(e)]
        if sorted(curves) != sorted(runs):
            problems.append(f"inline svg curves for {sorted(curves)}")
    # per-layer bars: each policy's bytes offloaded and kept, as --json has them
    layers = {}
    for p in report["policies"]:
        for row in p["layers"]:
            layers[(p["name"], row["layer"])] = row
    seen = 0
    for tr in root.iter("tr"):
        if tr.get("data-layer") is None:
            continue
        first, count = int(tr.get("data-layer")), int(tr.get("data-layers"))
        for td in tr.iter("td"):
            run = td.get("data-run")
            if run is None:
                continue
            for layer in range(first, first + count) if first >= 0 else [first]:
                row = layers.get((run, layer))
                if row is None:
                    problems.append(f"bar for {run} layer {layer}: not in --json")
                    continue
                seen += 1
                off, kept = float(td.get("data-offloaded")), float(td.get("data-kept"))
                if off != row["offloaded_bytes"] or off + kept != row["saved_bytes"]:
                    problems.append(f"{run} layer {layer}: bar {off:.0f} + {kept:.0f} B, --json "
                                    f"{row['offloaded_bytes']} of {row['saved_bytes']} B")
    want = sum(1 for (_, _), r in layers.items() if r["saved_bytes"] > 0 or r["tensors"] > 0)
    if seen < want:
        problems.append(f"bars for {seen} (policy, layer) pairs, --json has {want}")


def main():
    problems = []
    with tempfile.TemporaryDirectory() as d:
        out, report, runs = sim(d, "three", "default,layers,budget")
        if len(runs) != 4:
            problems.append(f"runs {sorted(runs)}")
        check_svg(out["svg"], runs, problems)
        check_html(out["html"], runs, report, problems)
        # six runs crowd the plot: still nothing over anything
        out, report, runs = sim(d, "sweep", "layers", ["--sweep", "N=0..4"])
        check_svg(out["svg"], runs, problems)
        check_html(out["html"], runs, report, problems)
        # a name too long for the margins is cut, never drawn off the canvas
        longer = os.path.join(d, "a_policy_whose_name_is_much_too_long_for_any_margin.lua")
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "..", "policies", "default.lua")) as f:
            body = f.read()
        with open(longer, "w") as f:
            f.write(body)
        out, report, runs = sim(d, "long", longer + ",budget")
        check_svg(out["svg"], runs, problems)
        check_html(out["html"], runs, report, problems)
    for p in problems[:40]:
        print("FAIL:", p)
    if problems:
        print(f"{len(problems)} problem(s)")
        return 1
    print("ok: SVG and HTML reports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
