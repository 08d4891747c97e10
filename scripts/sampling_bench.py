#!/usr/bin/env python3
"""Times generation's top-k and top-p filters (`models/src/generate/sampling.rs`) on rows of a
150,000-token vocabulary, side by side for two versions of the file in one run.

The filters are private to the models crate, so this script takes their source from the file as
it is in the working tree and at `--old REV` (git), compiles each with a timing `main` using
`rustc -O` (no Cargo, no dependency), and runs the two in turn, `--runs` times. Each prints the
milliseconds per token (a copy of the row, top-k and/or top-p, the softmax the draw takes) for
three synthetic rows: normal logits of standard deviation 6 and 3 (most of the mass in the first
hundreds and thousands of tokens), and uniform logits in [-10, 10] (a flat row: the nucleus holds
some 17,500 tokens, the worst case of a filter that sorts the likely tokens first).

    python3 scripts/sampling_bench.py --old ef12b53 [--runs 3] [--vocab 151936]

Prints one table: per row and filter, the milliseconds of every run, old then new. Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "models/src/generate/sampling.rs"

MAIN = r"""
fn main() {
    let v: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(151_936);
    let mut x: u64 = 1;
    let mut uniform = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let normals: Vec<f64> = (0..v)
        .map(|_| {
            let (a, b) = (uniform(), uniform());
            (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
        })
        .collect();
    let flat: Vec<f64> = (0..v).map(|_| (uniform() - 0.5) * 20.0).collect();
    let rows = [
        ("normal sd 6", normals.iter().map(|z| 6.0 * z).collect::<Vec<_>>()),
        ("normal sd 3", normals.iter().map(|z| 3.0 * z).collect()),
        ("uniform [-10, 10]", flat),
    ];
    for (row, logits) in rows {
        for (name, k, p) in [
            ("top_k 50", Some(50usize), None),
            ("top_p 0.9", None, Some(0.9f64)),
            ("top_k 50 + top_p 0.9", Some(50), Some(0.9f64)),
        ] {
            let n = 20;
            let start = std::time::Instant::now();
            for _ in 0..n {
                let mut s = logits.clone();
                if let Some(k) = k {
                    top_k(&mut s, k);
                }
                if let Some(p) = p {
                    top_p(&mut s, p);
                }
                std::hint::black_box(softmax(&s));
            }
            println!("{row}, {name}: {:.3}", start.elapsed().as_secs_f64() * 1e3 / n as f64);
        }
    }
}
"""


def filters(text: str, where: str) -> str:
    """The filters' part of sampling.rs: from the top-k filter's comment to the tests."""
    start = text.find("/// Keeps the `k` largest scores")
    end = text.find("#[cfg(test)]")
    if start < 0 or end < start:
        sys.exit(f"sampling_bench: {where}: cannot find the top-k filter and the tests in {SOURCE}")
    return "#![allow(dead_code)]\n" + text[start:end] + MAIN


def build(text: str, where: str, out: str) -> str:
    src = out + ".rs"
    with open(src, "w") as f:
        f.write(filters(text, where))
    r = subprocess.run(["rustc", "-O", "--edition", "2021", src, "-o", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sampling_bench: {where}: rustc failed:\n{r.stderr[-3000:]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the git revision to compare against")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    if args.runs < 1 or args.vocab < 1:
        sys.exit("sampling_bench: --runs and --vocab must be at least 1")
    old = subprocess.run(["git", "-C", ROOT, "show", f"{args.old}:{SOURCE}"],
                         capture_output=True, text=True)
    if old.returncode != 0:
        sys.exit(f"sampling_bench: --old {args.old}: {old.stderr.strip()}")
    with open(os.path.join(ROOT, SOURCE)) as f:
        new = f.read()
    with tempfile.TemporaryDirectory() as tmp:
        exes = {"old": build(old.stdout, args.old, os.path.join(tmp, "old")),
                "new": build(new, "working tree", os.path.join(tmp, "new"))}
        times: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.runs):
            for side, exe in exes.items():
                out = subprocess.run([exe, str(args.vocab)], capture_output=True, text=True,
                                     check=True).stdout
                for line in out.splitlines():
                    m = re.match(r"(.*): ([0-9.]+)$", line)
                    if m:
                        times.setdefault(m.group(1), {"old": [], "new": []})[side].append(
                            float(m.group(2)))
    print(f"ms per token, vocabulary {args.vocab}, {args.runs} alternating runs "
          f"(old = {args.old}, new = working tree)\n")
    print("| row, filter | old | new |")
    print("|---|---|---|")
    for name, t in times.items():
        fmt = lambda xs: " ".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"| {name} | {fmt(t['old'])} | {fmt(t['new'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
