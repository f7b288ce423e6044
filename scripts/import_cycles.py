#!/usr/bin/env python3
"""Finds import cycles between the crate's source files.

A file uses another when it names a path into it: `use super::staging::…`,
`crate::transport::serve::poller::…`, `super::poller::ud(…)` in an
expression, and so on. Two files that use each other, directly or through
others, are a cycle. A module's `mod.rs` (or `lib.rs`) is left out of the
graph: it declares and re-exports its children, and children use the
parent's shared types by design (`super::Common`); a cycle is between
sibling or cousin files, which is what breaks "a file holds one idea"
(the two files are one idea, or one of them should own the shared part).

  scripts/import_cycles.py [src]      # prints each cycle; exit 1 if any

Comments and string literals are stripped before paths are read, and test
modules (`#[cfg(test)] mod tests { … }` at the end of a file) count too:
a test that needs a sibling's internals is a dependency as well.
"""
import os
import re
import sys

ROOT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
ROOT = os.path.normpath(ROOT)


def module_path(rel):
    """src-relative file path -> module path list (crate root = [])."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    if parts and parts[0] == "bin":
        return None  # binaries are their own crates
    return parts


files = {}
for dirpath, _, names in os.walk(ROOT):
    for n in names:
        if n.endswith(".rs"):
            full = os.path.join(dirpath, n)
            rel = os.path.relpath(full, ROOT)
            mp = module_path(rel)
            if mp is not None:
                files[tuple(mp)] = (rel, os.path.basename(rel) in ("mod.rs", "lib.rs"))

STRIP = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'', re.S)
PATH = re.compile(r"\b(crate|super|self)((?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\b(crate|super|self)((?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)*)\s*::\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def resolve(base, head, tail):
    """The longest module (a file) that the path names, or None."""
    if head == "crate":
        cur = []
    elif head == "self":
        cur = list(base)
    else:
        cur = list(base[:-1])
    segs = [s.strip() for s in tail.split("::") if s.strip()]
    while segs and segs[0] == "super":
        cur = cur[:-1]
        segs.pop(0)
    best = tuple(cur) if tuple(cur) in files else None
    for s in segs:
        cur = cur + [s]
        if tuple(cur) in files:
            best = tuple(cur)
        else:
            break
    return best


edges = {k: set() for k in files}
for mod, (rel, is_mod) in files.items():
    text = STRIP.sub(" ", open(os.path.join(ROOT, rel), encoding="utf-8").read())
    # `self` is the file's own module (a mod.rs is its directory's
    # module), `super` that module's parent.
    base = mod

    def add(head, tail):
        t = resolve(base, head, tail)
        if t is not None and t != mod:
            edges[mod].add(t)

    for m in GROUP.finditer(text):
        head, prefix, inner = m.group(1), m.group(2), m.group(3)
        for item in re.split(r",(?![^{]*\})", inner):
            item = item.strip()
            if not item:
                continue
            first = re.match(r"[A-Za-z_][A-Za-z0-9_]*(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)*", item)
            if first:
                add(head, prefix + "::" + first.group(0))
    for m in PATH.finditer(text):
        add(m.group(1), m.group(2))

# Leave out mod.rs / lib.rs nodes (see the docstring).
nodes = [k for k, (_, is_mod) in files.items() if not is_mod]
graph = {k: sorted(t for t in edges[k] if t in nodes and not files[t][1]) for k in nodes}

# Tarjan's strongly connected components.
index = {}
low = {}
stack = []
on = set()
sccs = []
counter = [0]
sys.setrecursionlimit(10000)


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            sccs.append(comp)


for v in sorted(graph):
    if v not in index:
        visit(v)

if not sccs:
    print(f"import cycles: none among {len(nodes)} files (mod.rs/lib.rs left out)")
    sys.exit(0)
for comp in sccs:
    names = sorted(files[c][0] for c in comp)
    print("import cycle:", " <-> ".join(names))
    for c in sorted(comp):
        uses = [files[t][0] for t in graph[c] if t in comp]
        print(f"  {files[c][0]} uses {', '.join(uses)}")
sys.exit(1)
