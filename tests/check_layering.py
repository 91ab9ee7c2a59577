#!/usr/bin/env python3
"""Fails if an include or import runs against ferry's layering
(docs/architecture.md):

- outside engine/, C files include only the public headers (ferry.h,
  ferry_tools.h), never a file under engine/src/; the one exception is a
  test of util/'s header-only helpers (the bottom room: no state, no
  calls into the engine), which tests/ may include to test them alone;
- inside engine/src/, a room includes only itself and rooms below it
  (util < backend, policy < arena < core < sim, checkpoint), and never
  another room's private header (*_internal.h);
- the Python package's modules import each other one way (no cycle);
- inside the rooms listed in NO_CIRCLE, no file calls (or takes the address
  of) a function of a file that, through others, calls back into it: the
  engine core is layered file by file too (the stash tells its recorders
  through observers, core/engine_internal.h, instead of calling them).

Usage: check_layering.py [REPO_ROOT]; prints each violation as FILE:LINE.
"""
import ast
import os
import re
import subprocess
import sys

RANK = {"util": 0, "backend": 1, "policy": 1, "arena": 2, "core": 3, "sim": 4, "checkpoint": 4, "resident": 4}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
NO_CIRCLE = ["core"]
# a function defined at file scope, not static: the name before its
# parameter list and body (comments and strings are blanked first)
C_DEFINITION = re.compile(r'^(?!static\b|typedef\b|extern\b|return\b|else\b)[A-Za-z_][\w \t*]*?'
                          r'\b(\w+)\s*\(([^;{}]*?)\)\s*(?:__attribute__\s*\(\([^)]*\)\)\s*)?\{', re.M)
C_NOISE = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
C_IDENT = re.compile(r'\b[A-Za-z_]\w*\b')


def tracked(root, *patterns):
    """The repository's files matching patterns; every file when root is not
    a git checkout (an unpacked source archive)."""
    r = subprocess.run(["git", "-C", root, "ls-files", *patterns], capture_output=True, text=True)
    if r.returncode == 0:
        return [p for p in r.stdout.split("\n") if p]
    exts = tuple(p.lstrip("*") for p in patterns)
    return [os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root)
            if "/build" not in d and "/." not in d for f in fs if f.endswith(exts)]


def check_c(root):
    bad = []
    for path in tracked(root, "*.c", "*.h"):
        parts = path.split("/")
        in_engine = parts[:2] == ["engine", "src"] and len(parts) > 3
        room = parts[2] if in_engine else None
        if parts[0] == "engine" and not in_engine:
            continue  # engine/include: the public headers
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                m = INCLUDE.match(line)
                if not m:
                    continue
                inc = m.group(1)
                target = inc.split("/")[0] if "/" in inc else None
                if not in_engine:
                    if path.startswith("tests/") and re.search(r"engine/src/util/\w+\.h$", inc):
                        continue
                    if "engine/src" in inc or target in RANK:
                        bad.append(f"{path}:{n}: includes the engine-internal \"{inc}\"; "
                                   "use ferry.h or ferry_tools.h")
                    continue
                if target is None or target not in RANK:
                    continue
                if target != room and RANK[target] >= RANK[room]:
                    bad.append(f"{path}:{n}: room {room}/ includes \"{inc}\" of room {target}/, "
                               "which is not below it")
                elif target != room and inc.endswith("_internal.h"):
                    bad.append(f"{path}:{n}: room {room}/ includes {target}/'s private header "
                               f"\"{inc}\"")
    return bad


def room_calls(root, room):
    """{file: {file it uses a function of: that function}} within a room."""
    files = [p for p in tracked(root, "*.c") if p.startswith(f"engine/src/{room}/")]
    text, defined = {}, {}
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            text[path] = C_NOISE.sub(" ", f.read())
        for m in C_DEFINITION.finditer(text[path]):
            defined.setdefault(m.group(1), path)
    edges = {p: {} for p in files}
    for path in files:
        for name in sorted(set(C_IDENT.findall(text[path]))):
            other = defined.get(name)
            if other and other != path:
                edges[path].setdefault(other, name)
    return edges


def check_circles(root):
    bad = []
    for room in NO_CIRCLE:
        edges, state = room_calls(root, room), {}

        def visit(f, stack):
            state[f] = 1
            for g, name in sorted(edges[f].items()):
                if state.get(g) == 1:
                    cyc = stack[stack.index(g):] + [f, g] if g in stack else [f, g]
                    bad.append(f"{f}: call circle in {room}/: " + " -> ".join(
                        os.path.basename(c) for c in cyc) +
                               f" ({os.path.basename(f)} uses {name}())")
                elif not state.get(g):
                    visit(g, stack + [f])
            state[f] = 2

        for f in sorted(edges):
            if not state.get(f):
                visit(f, [])
    return bad


def check_python(root):
    pkg = os.path.join(root, "bindings", "python", "ferry")
    mods = {f[:-3] for f in os.listdir(pkg) if f.endswith(".py")}
    edges = {m: {} for m in mods}
    for m in mods:
        with open(os.path.join(pkg, m + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read(), m + ".py")
        for node in ast.walk(tree):  # imports anywhere, never text in strings
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name.split(".")[1] if a.name.startswith("ferry.") else
                           "__init__" for a in node.names if a.name.split(".")[0] == "ferry"]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 1 and not mod or mod == "ferry":
                    targets = [a.name for a in node.names]
                elif node.level == 1 or mod.startswith("ferry."):
                    targets = [mod.replace("ferry.", "", 1).split(".")[0]]
            for t in targets:
                if t in mods and t != m:
                    edges[m].setdefault(t, node.lineno)
    bad, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for t, line in edges[m].items():
            if t == "__init__" or m == "__init__":
                continue  # the package re-exports its modules: not a layer
            if state.get(t) == 1:
                cyc = stack[stack.index(t):] + [m, t]
                bad.append(f"bindings/python/ferry/{m}.py:{line}: import cycle "
                           + " -> ".join(cyc))
            elif not state.get(t):
                visit(t, stack + [m])
        state[m] = 2

    for m in sorted(mods):
        if not state.get(m):
            visit(m, [])
    return bad


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    bad = check_c(root) + check_circles(root) + check_python(root)
    for b in bad:
        print(b)
    print(f"layering: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
