#!/usr/bin/env python3
"""Where a GPU step goes, kernel by kernel (issue 38's speed check): runs one program under Nsight
Compute (`ncu`, installed on the device machines), timing every kernel launch with one metric
(`gpu__time_duration.sum`, the clocks left alone), then prints the kernels grouped by name with
their total time, launch count and share, largest first, and the totals per kind (matrix products,
NCCL, the rest).

    python3 scripts/gpu_profile.py --label accelerate-rs -- BUNDLE/bin/hf_bench --dtype bf16 \\
        --steps 1 --warmup 1 ...          # any command
    python3 scripts/gpu_profile.py --label transformers --torch   # pytorch_hf_bench.py's GPU model

A tool, not a test. Every launch is timed, set-up and warm-up included, so run one warm-up and one
timed step and read the shares rather than the totals. `--torch` runs the `transformers` side of
`scripts/pytorch_hf_bench.py --gpu` (same model, one warm-up and one step). `--csv FILE` keeps
ncu's raw table (a new file: an existing one is refused). Exit 1 when ncu is missing or its table cannot be read (its first lines are
printed then).
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRIC = "gpu__time_duration.sum"
UNITS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}


def kind(name):
    n = name.lower()
    if "nccl" in n:
        return "NCCL"
    if any(k in n for k in ("gemm", "xmma", "cutlass", "cublas", "gemv", "sm90_", "sm80_")):
        return "matrix products (cuBLAS)"
    return "everything else"


def short(name):
    """A kernel's name without `void` and its parameter list, at most 100 characters (template
    arguments kept: they tell cuBLAS's and PyTorch's generic kernels apart)."""
    name = name.removeprefix("void ").strip()
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i] if i > 0 else name
                break
    return name[:100]


def read_table(path):
    """{short name: [ms, launches, kind]} and the total ms, from ncu's `--csv --page raw`
    output."""
    with open(path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no CSV header (a line starting with \"ID\")")
    rows = list(csv.reader(lines[start:]))
    header = rows[0]
    try:
        name_col, time_col = header.index("Kernel Name"), header.index(METRIC)
    except ValueError as e:
        raise ValueError(f"columns missing ({e}); header: {header}") from e
    scale, kernels, total = 1e-6, {}, 0.0
    for row in rows[1:]:
        if len(row) <= max(name_col, time_col):
            continue
        value = row[time_col].replace(",", "").strip()
        if not row[0].strip():  # the units row
            scale = UNITS.get(value, scale)
            continue
        try:
            ms = float(value) * scale
        except ValueError:
            continue
        entry = kernels.setdefault(short(row[name_col]), [0.0, 0, kind(row[name_col])])
        entry[0] += ms
        entry[1] += 1
        total += ms
    if not kernels:
        raise ValueError("no kernel rows")
    return kernels, total


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="program", help="the name printed with the table")
    p.add_argument("--top", type=int, default=30, help="kernels listed (default 30)")
    p.add_argument("--torch", action="store_true",
                   help="profile pytorch_hf_bench.py's transformers model instead of a command")
    p.add_argument("--csv", default=None, help="keep ncu's raw CSV here")
    p.add_argument("command", nargs="*", help="the program and its arguments (after --)")
    args = p.parse_args()
    if args.top < 1:
        p.error(f"--top {args.top}: at least 1")
    if args.csv and os.path.lexists(args.csv):
        p.error(f"--csv {args.csv} exists: name a new file (nothing is written over)")
    ncu = shutil.which("ncu")
    if ncu is None:
        print("gpu_profile: ncu (Nsight Compute) is not on the PATH", file=sys.stderr)
        return 1
    env = dict(os.environ)
    if args.torch:
        env["PYTORCH_HF_BENCH_ROLE"] = "gpu-worker"
        command = [sys.executable, os.path.join(REPO_ROOT, "scripts", "pytorch_hf_bench.py"),
                   "--gpu", "--steps", "1", "--warmup", "1"]
    elif args.command:
        command = args.command
    else:
        p.error("a command after --, or --torch")
    if args.csv:
        out = args.csv
    else:
        fd, out = tempfile.mkstemp(suffix=".csv", prefix="gpu_profile.")
        os.close(fd)
    cmd = [ncu, "--clock-control", "none", "--metrics", METRIC, "--csv", "--page", "raw",
           "--log-file", out] + command
    print(f"gpu_profile: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"gpu_profile: the profiled program exited with {proc.returncode}", file=sys.stderr)
        return 1
    try:
        kernels, total = read_table(out)
    except (OSError, ValueError) as e:
        print(f"gpu_profile: cannot read ncu's table in {out}: {e}", file=sys.stderr)
        try:
            with open(out, errors="replace") as f:
                print("".join(f.readlines()[:15]), file=sys.stderr)
        except OSError:
            pass
        return 1
    launches = sum(v[1] for v in kernels.values())
    print(f"\n{args.label}: {launches} kernel launches, {total:.1f} ms of kernel time in all")
    print("| kernel | ms | launches | share |")
    print("|---|---:|---:|---:|")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    for name, (ms, n, _) in ranked[:args.top]:
        print(f"| {name} | {ms:.2f} | {n} | {100 * ms / total:.1f}% |")
    kinds = {}
    for ms, n, what in kernels.values():
        k = kinds.setdefault(what, [0.0, 0])
        k[0] += ms
        k[1] += n
    print("\n| kind | ms | launches | share |")
    print("|---|---:|---:|---:|")
    for k, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {ms:.2f} | {n} | {100 * ms / total:.1f}% |")
    print(f"gpu_profile: total {total:.1f} ms ({args.label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
