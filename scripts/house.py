"""File-level measurements of the workspace, for `scripts/layers.py`: the import graph between
the files of each crate (the library, the CLI, the models crate) and its circles, and the
functions longer than 80 lines in every `.rs` file.

The module tree of a crate is read from its root (`lib.rs` or `main.rs`) through every `mod x;`
declaration (`#[path = ...]` honoured; a module declared twice under `cfg`s, such as a stub and
the real backend, maps to both files). A file imports another when one of its paths resolves to
the other's module: `crate::a::b`, `super::x`, `self::x`, and a child module's name used as a
path (`child::f`), whether in a `use` or inline. A path that ends at a name a module file
re-exports (`pub use child::Name`) resolves on to where the name comes from, so a file that
imports `super::Name` depends on the sibling defining it, not on the `mod.rs` that re-exports it.
A module's declaration of its children (`mod x;`) is not an import.

Stdlib only.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

FUNCTION_LIMIT = 80


def strip(text: str) -> str:
    """The text without comments and string/char literals (replaced by spaces, lines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = re.match(r'b?r(#*)"', text[i:i + 260]) if c in "rb" else None
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j + 1
            continue
        if c == "'":
            # A char literal ('a', '\n', '\u{..}'), not a lifetime ('a).
            m = re.match(r"'(\\[^']{1,10}|[^'\\])'", text[i:i + 14])
            if m:
                out.append("' '")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


class Crate:
    """The module tree and file graph of one crate rooted at `root` (a lib.rs or main.rs)."""

    def __init__(self, name: str, root: str):
        self.name = name
        self.root = root
        self.files: dict[str, list[str]] = defaultdict(list)  # module path -> files
        self.module_of: dict[str, str] = {}  # file -> module path
        self.children: dict[str, set[str]] = defaultdict(set)  # module -> child names
        self.text: dict[str, str] = {}
        self._walk(root, "")

    def _walk(self, path: str, module: str) -> None:
        if path in self.module_of or not os.path.isfile(path):
            return
        self.module_of[path] = module
        self.files[module].append(path)
        with open(path) as f:
            text = strip(f.read())
        self.text[path] = text
        base = os.path.basename(path)
        folder = os.path.dirname(path)
        own_dir = folder if base in ("mod.rs", "lib.rs", "main.rs") else os.path.join(
            folder, base[:-3])
        for m in re.finditer(r'((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;',
                             text):
            attrs, name = m.group(1), m.group(2)
            raw = None
            if "#[path" in attrs:
                decl_line = text[:m.start() + len(attrs)].count("\n")
                raw = re.search(r'#\[path\s*=\s*"([^"]*)"\]', self._raw_attrs(path, decl_line))
            child = f"{module}::{name}" if module else name
            self.children[module].add(name)
            if raw:
                target = os.path.normpath(os.path.join(folder, raw.group(1)))
                self._walk(target, child)
                continue
            for cand in (os.path.join(own_dir, name + ".rs"),
                         os.path.join(own_dir, name, "mod.rs")):
                if os.path.isfile(cand):
                    self._walk(cand, child)
                    break

    @staticmethod
    def _raw_attrs(path: str, line: int) -> str:
        """The attribute lines right above line `line` (0-based) of the file as written (`strip`
        blanked the path attribute's string)."""
        with open(path) as f:
            lines = f.read().splitlines()
        lo = line
        while lo > 0 and lines[lo - 1].lstrip().startswith("#["):
            lo -= 1
        return "\n".join(lines[lo:line + 1])

    # ---- path resolution ---------------------------------------------------------------------

    def reexports(self, module: str) -> dict[str, list[str]]:
        """Names a module's files re-export: name -> the absolute path it comes from."""
        out: dict[str, list[str]] = {}
        for f in self.files.get(module, []):
            for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", self.text[f]):
                for path, alias in expand_use(m.group(1)):
                    segs = path.split("::")
                    absolute = self.absolute(segs, module)
                    if absolute is not None:
                        out[alias or segs[-1]] = absolute
        return out

    def absolute(self, segs: list[str], module: str) -> list[str] | None:
        """`segs` (as written in `module`) as an absolute module path, or None (another crate)."""
        cur = module.split("::") if module else []
        head = segs[0]
        if head == "crate":
            return segs[1:]
        if head == "self":
            return cur + segs[1:]
        if head == "super":
            i = 0
            while i < len(segs) and segs[i] == "super":
                cur = cur[:-1]
                i += 1
            return cur + segs[i:]
        if head in self.children.get(module, set()):
            return cur + segs
        return None

    def resolve(self, segs: list[str], depth: int = 0) -> str | None:
        """The module an absolute path lands in: the longest module prefix, followed through
        re-exports of the name after it."""
        best = ""
        for i in range(1, len(segs) + 1):
            m = "::".join(segs[:i])
            if m in self.files:
                best = m
            else:
                break
        rest = segs[len(best.split("::")) if best else 0:]
        if rest and depth < 8:
            names = self.reexports(best)
            # The first name the module re-exports (names before it may be inline modules).
            for k, name in enumerate(rest):
                target = names.get(name)
                if target is not None and target != segs[:len(target)]:
                    deeper = self.resolve(target + rest[k + 1:], depth + 1)
                    if deeper is not None:
                        return deeper
                    break
        return best

    @staticmethod
    def inline_modules(text: str) -> list[tuple[int, int, str]]:
        """(start, end, name) of every inline `mod name { ... }` block."""
        return Crate.blocks(text, r"\bmod\s+(\w+)\s*\{")

    @staticmethod
    def blocks(text: str, pattern: str) -> list[tuple[int, int, str]]:
        """(start, end, name) of every block `pattern` opens (its last character a `{`)."""
        out = []
        for m in re.finditer(pattern, text):
            i, depth = m.end() - 1, 0
            while i < len(text):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                i += 1
            out.append((m.start(), i, m.group(1)))
        return out

    def graph(self) -> dict[str, set[str]]:
        """file -> files it imports."""
        edges: dict[str, set[str]] = defaultdict(set)
        for f, module in self.module_of.items():
            text = self.text[f]
            inline = self.inline_modules(text)
            paths = []
            for m in re.finditer(r"\buse\s+([^;]+);", text):
                paths += [(m.start(), p) for p, _ in expand_use(m.group(1))]
            for m in re.finditer(r"(?<![\w:])((?:crate|super|self|\w+)(?:::\w+)+)", text):
                # The prefix of a `use a::b::{...}` group: its paths are read above.
                if not text.startswith("::{", m.end()):
                    paths.append((m.start(), m.group(1)))
            # A macro's paths resolve where it expands: not read here.
            macros = [(a, b) for (a, b, _) in self.blocks(text, r"\bmacro_rules!\s*(\w+)\s*\{")]
            for at, p in paths:
                segs = [s for s in p.split("::") if s]
                if not segs or segs[0] == "*" or any(a <= at <= b for a, b in macros):
                    continue
                # Inside inline modules (`mod tests { use super::*; }`), `self` and `super` are
                # theirs.
                inner = [name for (a, b, name) in inline if a <= at <= b]
                here = "::".join(([module] if module else []) + inner)
                absolute = self.absolute(segs, here)
                if absolute is None:
                    continue
                target = self.resolve(absolute)
                if target is None or target == module:
                    continue
                # The parent declaring/re-exporting: only real imports count.
                for g in self.files.get(target, []):
                    if g != f:
                        edges[f].add(g)
        return edges


def expand_use(tree: str) -> list[tuple[str, str | None]]:
    """`a::{b, c::{d, e as f}}` -> [("a::b", None), ("a::c::d", None), ("a::c::e", "f")]."""
    tree = " ".join(tree.split())
    out: list[tuple[str, str | None]] = []

    def walk(prefix: str, t: str) -> None:
        t = t.strip()
        if not t:
            return
        i = t.find("{")
        if i < 0:
            alias = None
            m = re.match(r"(.*?)\s+as\s+(\w+)$", t)
            if m:
                t, alias = m.group(1), m.group(2)
            full = (prefix + t).replace(" ", "")
            if full.endswith("::self"):
                full = full[:-6]
            out.append((full, alias))
            return
        head = t[:i]
        body = t[i + 1:t.rfind("}")]
        depth, cur, parts = 0, "", []
        for ch in body:
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
        for p in parts:
            walk(prefix + head, p)

    walk("", tree)
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan, iterative)."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    nodes = sorted(set(edges) | {g for gs in edges.values() for g in gs})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def long_functions(path: str) -> list[tuple[int, str, int]]:
    """(lines, name, first line) of each function of `path` longer than FUNCTION_LIMIT lines,
    from its `fn` line to its closing brace."""
    with open(path) as f:
        text = strip(f.read())
    out = []
    for m in re.finditer(r"\bfn\s+(\w+)", text):
        # The body's opening brace: the first `{` after the signature at depth 0 of (), <>, [].
        i, depth = m.end(), 0
        while i < len(text):
            c = text[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == ";" and depth == 0:
                i = -1  # a declaration without a body
                break
            elif c == "{" and depth == 0:
                break
            i += 1
        if i < 0 or i >= len(text):
            continue
        j, braces = i, 0
        while j < len(text):
            if text[j] == "{":
                braces += 1
            elif text[j] == "}":
                braces -= 1
                if braces == 0:
                    break
            j += 1
        first = text.count("\n", 0, m.start()) + 1
        lines = text.count("\n", m.start(), j) + 1
        if lines > FUNCTION_LIMIT:
            out.append((lines, m.group(1), first))
    return out
