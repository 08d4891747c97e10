#!/usr/bin/env python3
"""Peak resident memory per rank at ZeRO stages 0-3 on 1, 2 and 4 processes (BENCHMARKS.md).

Writes the model folder once (`zero3_bench --make`), then for every (processes, stage) runs
`accelerate-rs launch --cpu -n N --zero-stage S zero3_bench --model DIR` and reads each rank's
line. Prints a Markdown table: per cell the largest rank's peak after loading and at the end of
training (MiB), and the end peak relative to stage 0 on as many processes.

Usage (after `cargo build --release -p accelerate-rs-models --example zero3_bench -p
accelerate-rs-cli`):
    python3 scripts/zero3_memory_bench.py [--target target/release] [--steps 3] [--worlds 1,2,4]
Stdlib only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

LINE = re.compile(r"rank=(\d+) world=(\d+) stage=(\d+) start=(\d+) base=(\d+) "
                  r"load_peak=(\d+) train_peak=(\d+) step_ms=(\d+) tokens_per_s=(\d+)")


def run(target: str, model: str, world: int, stage: int, steps: int) -> list[dict]:
    cmd = [os.path.join(target, "accelerate-rs"), "launch", "--cpu", "-n", str(world),
           "--zero-stage", str(stage), os.path.join(target, "examples", "zero3_bench"),
           "--model", model, "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    rows = []
    for m in LINE.finditer(out.stdout):
        keys = ["rank", "world", "stage", "start", "base", "load_peak", "train_peak", "step_ms",
                "tps"]
        rows.append(dict(zip(keys, map(int, m.groups()))))
    if len(rows) != world:
        sys.exit(f"expected {world} result lines, got {len(rows)}:\n{out.stdout}\n{out.stderr}")
    return rows


def mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="target/release")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--model", help="an existing model folder (else one is made)")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    tmp = tempfile.mkdtemp(prefix="zero3-bench-")
    model = args.model or os.path.join(tmp, "llama-42m")
    if not args.model:
        subprocess.run([os.path.join(args.target, "examples", "zero3_bench"), "--make", model],
                       check=True)
    results: dict[tuple[int, int], list[dict]] = {}
    for world in worlds:
        for stage in stages:
            rows = run(args.target, model, world, stage, args.steps)
            results[(world, stage)] = rows
            worst = max(rows, key=lambda r: r["train_peak"])
            print(f"# n={world} stage={stage}: load peak {mib(max(r['load_peak'] for r in rows))} "
                  f"MiB, train peak {mib(worst['train_peak'])} MiB, step {worst['step_ms']} ms",
                  file=sys.stderr)
    print("| processes | ZeRO | peak after loading (MiB) | peak training (MiB) | vs stage 0 | "
          "step (ms) | tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for world in worlds:
        base = max(r["train_peak"] for r in results[(world, stages[0])])
        for stage in stages:
            rows = results[(world, stage)]
            load = max(r["load_peak"] for r in rows)
            peak = max(r["train_peak"] for r in rows)
            step = max(r["step_ms"] for r in rows)
            tps = min(r["tps"] for r in rows)
            print(f"| {world} | {stage} | {mib(load)} | {mib(peak)} | {peak / base:.2f}x | "
                  f"{step} | {tps} |")


if __name__ == "__main__":
    main()
