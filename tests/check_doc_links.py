#!/usr/bin/env python3
"""The docs' cross-references resolve (split pages keep their readers):
  - every relative Markdown link of README.md, CONTRIBUTING.md, bench/README.md
    and docs/*.md names a file that exists and, with #anchor, a heading of
    that file (GitHub's slugs: lower case, punctuation dropped, spaces to -);
  - in docs/*.md a quoted section named "above" or "below" (`"Stall floor"
    above`) is a heading or a bold paragraph of the same page: text moved to
    another page must link to it instead;
  - a citation of a simulator page in the sources (`docs/sim-model.md,
    "Collectives"`, as the engine's messages and comments write them) names
    a heading or bold paragraph of that page.
  check_doc_links.py REPO [FILE...]   (FILEs: check these docs instead)"""
import os
import re
import subprocess
import sys

LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
NEARBY = re.compile(r"\"([A-Z][^\"\n]{1,70}(?:\n[^\"\n]{0,70})?)\"\)?[,;]?\s+(above|below)\b")
CITE = re.compile(r"(docs/sim[\w-]*\.md),\s*(?:\\\")?\"?([A-Z][^\"\\\n]{2,70})(?:\\\"|\")")


def slug(text):
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text.strip().lower()).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def outside_fences(path):
    """(line number, line) of path outside ``` blocks."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced:
                yield i, line


def anchors(path, cache={}):
    if path not in cache:
        seen, out = {}, set()
        for _, line in outside_fences(path):
            m = HEADING.match(line)
            if m:
                s = slug(m.group(2))
                n = seen.get(s, 0)
                seen[s] = n + 1
                out.add(s if n == 0 else f"{s}-{n}")
        cache[path] = out
    return cache[path]


def names(path):
    """Headings and bold paragraph names of path, lower case, without `."""
    out = []
    for _, line in outside_fences(path):
        m = HEADING.match(line)
        if m:
            out.append(m.group(2))
        out += re.findall(r"\*\*([^*]+)\*\*", line)
        if line.lstrip("- ").startswith("**"):  # "**Saved tensors** per op: ..."
            out.append(line.lstrip("- ").replace("**", ""))
    return [n.replace("`", "").rstrip(".:").lower() for n in out]


def names_section(path, name):
    name = " ".join(name.split()).lower().rstrip(".")
    return any(n.startswith(name) for n in names(path))


def check_links(root, docs):
    problems = []
    for path in docs:
        for i, line in outside_fences(path):
            for m in LINK.finditer(line):
                url = m.group(1)
                if re.match(r"^[a-z][a-z0-9+.-]*:", url):
                    continue
                file, _, anchor = url.partition("#")
                target = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
                where = f"{os.path.relpath(path, root)}:{i}"
                if not os.path.exists(target):
                    problems.append(f"{where}: {url}: no file {os.path.relpath(target, root)}")
                elif anchor and target.endswith(".md") and anchor not in anchors(target):
                    problems.append(f"{where}: {url}: no heading #{anchor} in "
                                    f"{os.path.relpath(target, root)}")
    return problems


def check_nearby(root, docs):
    problems = []
    for path in docs:
        if not path.startswith(os.path.join(root, "docs")):
            continue
        text = "".join(line for _, line in outside_fences(path))
        for m in NEARBY.finditer(text):
            if not names_section(path, m.group(1)):
                problems.append(f"{os.path.relpath(path, root)}: \"{' '.join(m.group(1).split())}\" "
                                f"{m.group(2)}: no such heading or bold paragraph on this page")
    return problems


def check_citations(root):
    problems = []
    files = subprocess.run(["git", "-C", root, "ls-files", "*.c", "*.h", "*.py", "*.lua"],
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            text = f.read()
        # comments and string literals continue over lines: join them
        flat = re.sub(r"\"\s*\n\s*\"", "", text)
        flat = re.sub(r"\n\s*(?:\*|#|--|//)?\s*", " ", flat)
        for m in CITE.finditer(flat):
            doc, section = m.group(1), m.group(2)
            path = os.path.join(root, doc)
            if not os.path.exists(path):
                problems.append(f"{rel}: {doc}: no such page")
            elif not names_section(path, section):
                problems.append(f"{rel}: {doc}, \"{section}\": no such heading or bold "
                                "paragraph there")
    return problems


def main():
    root = os.path.abspath(sys.argv[1])
    docs = [os.path.abspath(p) for p in sys.argv[2:]]
    if not docs:
        docs = [os.path.join(root, p) for p in ("README.md", "CONTRIBUTING.md", "bench/README.md")]
        docs += sorted(os.path.join(root, "docs", p) for p in os.listdir(os.path.join(root, "docs"))
                       if p.endswith(".md"))
    problems = check_links(root, docs) + check_nearby(root, docs)
    if len(sys.argv) == 2:
        problems += check_citations(root)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        sys.exit(1)
    print(f"ok   links, anchors, \"above\"/\"below\" and sources' citations in {len(docs)} docs")


if __name__ == "__main__":
    main()
