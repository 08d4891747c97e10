#!/usr/bin/env python3
"""The library's floors as its `use` statements draw them.

Reads every `.rs` file under `src/`, finds each path that starts with `crate::` (in `use`
statements and inline), and maps it to the top-level module it reaches (`crate::train::...` ->
`train`; a name the crate root re-exports, such as `crate::Error`, -> `lib`, the front door).
Prints:

- the import graph between top-level modules (`A -> B: n imports`),
- import circles (strongly connected groups of more than one module),
- the floors as measured (each module one floor above the highest module it imports),
- upward imports against the plan in ARCHITECTURE.md (helpers < settings < machinery <
  accelerator < lib): an import of a higher floor, including any import through the crate root,
- the largest source files of the whole workspace (the library, the CLI, the models crate, tests,
  benches and examples), and how many are over 1,000 lines,
- one level down (`scripts/house.py`): circles between the files of each crate (the library, the
  CLI, the models crate; `super::` and re-exports followed), and the functions over 80 lines of
  the whole workspace, against a ceiling (`FUNCTION_CEILING`) that may only go down.

Usage: python3 scripts/layers.py [--check]   (--check: exit 1 on a circle between top-level
modules, an upward import, a file over 1,000 lines, or more long functions or circles between
files than their ceilings)
Stdlib only.
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import house  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")

# The plan (ARCHITECTURE.md): a module may import its own floor or the floors below. `lib` (the
# front door, re-exporting everything) is the top.
PLAN = {
    "error": 0, "inplace": 0, "cuda_ptx": 0, "files": 0, "readback": 0, "par": 0,
    "settings": 1, "logging": 1,
    "allocator": 2, "collective": 2, "data": 2, "optim": 2, "nn": 2, "tracking": 2, "train": 2, "memory": 2, "quant": 2,
    "checkpoint": 2, "weights": 2,
    "accelerator": 3,
    "lib": 4,
}


# The most functions over 80 lines the workspace may have, and the most circles between files
# (all three crates together): lowered as functions are split and circles broken, never raised.
FUNCTION_CEILING = 27
FILE_CIRCLE_CEILING = 0


def top_modules() -> set[str]:
    text = open(os.path.join(SRC, "lib.rs")).read()
    return set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*[;{]", text, re.M))


def group_of(path: str) -> str:
    rel = os.path.relpath(path, SRC)
    head = rel.split(os.sep)[0]
    return "lib" if head == "lib.rs" else head.removesuffix(".rs")


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def crate_paths(text: str) -> list[str]:
    """The first segment after `crate::` of every crate path, with `use crate::{a, b::c}` split."""
    out = []
    for m in re.finditer(r"\bcrate::(\{[^}]*(?:\{[^}]*\}[^}]*)*\}|\w+)", text):
        seg = m.group(1)
        if seg.startswith("{"):
            inner = seg[1:-1]
            depth, cur, parts = 0, "", []
            for ch in inner:
                if ch == "{":
                    depth += 1
                elif ch == "}":
                    depth -= 1
                if ch == "," and depth == 0:
                    parts.append(cur)
                    cur = ""
                else:
                    cur += ch
            parts.append(cur)
            out += [p.strip().split("::")[0].strip() for p in parts if p.strip()]
        else:
            out.append(seg)
    return out


def main() -> int:
    check = "--check" in sys.argv
    mods = top_modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    sizes = []
    for dirpath, _, files in os.walk(SRC):
        for f in files:
            if not f.endswith(".rs"):
                continue
            path = os.path.join(dirpath, f)
            raw = open(path).read()
            sizes.append((raw.count("\n"), os.path.relpath(path, ROOT)))
            src = group_of(path)
            if src == "lib":
                continue  # the front door may import everything
            for seg in crate_paths(strip_comments(raw)):
                dst = seg if seg in mods else "lib"
                if seg == "self":
                    continue
                if dst != src:
                    edges[(src, dst)].append(f"{os.path.relpath(path, SRC)}: crate::{seg}")
    nodes = sorted({n for e in edges for n in e} | (mods & set(PLAN)))
    graph = defaultdict(set)
    for (a, b) in edges:
        graph[a].add(b)

    # Strongly connected components (Tarjan).
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
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
            comps.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    circles = [c for c in comps if len(c) > 1]
    comp_of = {v: i for i, c in enumerate(comps) for v in c}

    # Floors as measured: 0 for a module importing nothing; else 1 + the highest floor imported
    # (a circle is one floor).
    floor: dict[int, int] = {}

    def floor_of(ci: int, seen: frozenset = frozenset()) -> int:
        if ci in floor:
            return floor[ci]
        deps = {comp_of[w] for v in comps[ci] for w in graph[v]} - {ci}
        f = 0 if not deps else 1 + max(floor_of(d, seen | {ci}) for d in deps if d not in seen)
        floor[ci] = f
        return f

    measured = {v: floor_of(comp_of[v]) for v in nodes if v != "lib"}
    measured["lib"] = 1 + max(measured.values(), default=0)

    print("imports between top-level modules:")
    for (a, b), where in sorted(edges.items()):
        print(f"  {a:11} -> {b:11} {len(where):3}")
    print(f"\nimport circles: {len(circles)}")
    for c in circles:
        print("  " + " <-> ".join(c))
        for a in c:
            for b in c:
                for w in edges.get((a, b), [])[:4]:
                    print(f"      {w}")
    print(f"\nfloors as measured: {1 + max(measured.values(), default=0)}")
    for f in sorted(set(measured.values())):
        print(f"  {f}: " + ", ".join(sorted(v for v in measured if measured[v] == f)))
    upward = [(a, b, w) for (a, b), ws in sorted(edges.items()) for w in ws
              if PLAN.get(b, 4) > PLAN.get(a, 4)]
    print(f"\nupward imports (against the plan in ARCHITECTURE.md): {len(upward)}")
    for a, b, w in upward:
        print(f"  {a} -> {b}: {w}")
    # File sizes: the whole workspace, not only the library.
    for top in ("cli", "models", "tests", "benches", "examples"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "target"]
            for f in files:
                if f.endswith(".rs"):
                    path = os.path.join(dirpath, f)
                    with open(path) as fh:
                        sizes.append((fh.read().count("\n"), os.path.relpath(path, ROOT)))
    sizes.sort(reverse=True)
    print(f"\nlargest source files ({len(sizes)} .rs files in the workspace, tests included):")
    for n, p in sizes[:5]:
        print(f"  {n:5} {p}")
    over = [p for n, p in sizes if n > 1000]
    print(f"files over 1,000 lines: {len(over)}")

    file_circles = 0
    print("\ncircles between files, per crate:")
    for name, root in (("accelerate-rs", "src/lib.rs"), ("accelerate-rs-cli", "cli/src/main.rs"),
                       ("accelerate-rs-models", "models/src/lib.rs")):
        crate = house.Crate(name, os.path.join(ROOT, root))
        if name == "accelerate-rs-cli":
            crate._walk(os.path.join(ROOT, "cli/src/lib.rs"), "")
        found = house.circles(crate.graph())
        file_circles += len(found)
        print(f"  {name}: {len(crate.module_of)} files, {len(found)} circles")
        for c in found:
            print("    " + " <-> ".join(os.path.relpath(f, ROOT) for f in c))

    long = []
    for _, rel in sizes:
        for lines, fn, line in house.long_functions(os.path.join(ROOT, rel)):
            long.append((lines, f"{rel}:{line} {fn}"))
    long.sort(reverse=True)
    print(f"\nfunctions over {house.FUNCTION_LIMIT} lines: {len(long)} (ceiling {FUNCTION_CEILING})")
    for n, where in long:
        print(f"  {n:4} {where}")
    too_many = len(long) > FUNCTION_CEILING
    if len(long) < FUNCTION_CEILING:
        print(f"  (below the ceiling: lower FUNCTION_CEILING in scripts/layers.py to {len(long)})")
    print(f"  ({file_circles} circles between files in all; ceiling {FILE_CIRCLE_CEILING})")
    if file_circles < FILE_CIRCLE_CEILING:
        print(f"  (below the ceiling: lower FILE_CIRCLE_CEILING in scripts/layers.py to {file_circles})")
    too_many = too_many or file_circles > FILE_CIRCLE_CEILING
    if check and (circles or upward or over or too_many):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
