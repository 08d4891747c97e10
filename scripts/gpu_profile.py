#!/usr/bin/env python3
"""Where a GPU step goes, kernel by kernel (issue 38's speed check): runs one program under Nsight
Compute (`ncu`, installed on the device machines), timing every kernel launch with one metric
(`gpu__time_duration.sum`, the clocks left alone), then prints the kernels grouped by name with
their total time, launch count and share, largest first, and the totals per kind (matrix products,
NCCL, the rest).

    python3 scripts/gpu_profile.py --label accelerate-rs -- BUNDLE/bin/hf_bench --dtype bf16 \\
        --steps 1 --warmup 1 ...          # any command
    python3 scripts/gpu_profile.py --label transformers --torch   # pytorch_hf_bench.py's GPU model
    python3 scripts/gpu_profile.py --tracer cupti --cupti-lib BUNDLE/lib/libcupti_trace.so ...

`--tracer cupti` times the kernels with CUPTI's activity API instead (scripts/cupti_trace.c, built
into the GPU bundle, loaded as the CUDA injection library): the program runs at its own pace (ncu
serializes and replays every launch), it works where ncu cannot read the hardware counters
(gVisor), and it also reports the copies, the memsets and the span from the first GPU record to
the last, so kernel time against span tells how long the GPU sat idle.

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


def read_cupti(path):
    """{short name: [ms, launches, kind]}, the total kernel ms and the other rows
    ({"memcpy"|"memset"|"span"|"dropped": (ms, count)}) from cupti_trace.c's file."""
    kernels, total, other = {}, 0.0, {}
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t", 3)
            if len(parts) != 4:
                continue
            what, ns, count, name = parts
            try:
                ms, count = int(ns) / 1e6, int(count)
            except ValueError:
                continue
            if what == "kernel":
                entry = kernels.setdefault(short(name), [0.0, 0, kind(name)])
                entry[0] += ms
                entry[1] += count
                total += ms
            else:
                other[what] = (ms, count)
    if not kernels:
        raise ValueError("no kernel rows")
    return kernels, total, other


def cupti_lib_dirs():
    """Folders that may hold libcupti.so.13: CUDA's and the pip wheels' (PyTorch's)."""
    dirs = [os.environ.get("CUPTI_LIB_DIR", ""), "/usr/local/cuda/extras/CUPTI/lib64",
            "/usr/local/cuda/lib64"]
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_cupti/lib"):
            dirs.append(os.path.join(base, sub))
    return [d for d in dirs if d and os.path.exists(os.path.join(d, "libcupti.so.13"))]


def per_step(a, b, steps):
    """What one step adds: (b - a) / steps for every kernel name and for the copies, memsets
    and span, from two traces of runs that differ only in their number of steps."""
    (ka, _, oa), (kb, _, ob) = a, b
    kernels = {}
    for name, (ms, n, what) in kb.items():
        ms0, n0 = ka.get(name, [0.0, 0, what])[:2]
        d_ms, d_n = (ms - ms0) / steps, (n - n0) / steps
        if d_n > 0 or d_ms > 0:
            kernels[name] = [max(d_ms, 0.0), d_n, what]
    other = {}
    for w in ("memcpy", "memset", "span"):
        (ms0, n0), (ms1, n1) = oa.get(w, (0.0, 0)), ob.get(w, (0.0, 0))
        other[w] = ((ms1 - ms0) / steps, (n1 - n0) / steps)
    other["dropped"] = ob.get("dropped", (0.0, 0))
    return kernels, sum(v[0] for v in kernels.values()), other


def print_cupti(args, traced, what):
    """The tables of a CUPTI trace (`what`: whose numbers they are) and its summary lines."""
    kernels, total, other = traced
    print(f"\n{what}:")
    print_tables(args, kernels, total)
    for kind_ in ("memcpy", "memset"):
        ms, n = other.get(kind_, (0.0, 0))
        print(f"gpu_profile: {kind_}: {ms:.1f} ms over {n:g}")
    span, records = other.get("span", (0.0, 0))
    busy = total + sum(other.get(w, (0.0, 0))[0] for w in ("memcpy", "memset"))
    print(f"gpu_profile: span {span:.1f} ms from the first GPU record to the last "
          f"({records:g} records); kernels, copies and memsets {busy:.1f} ms "
          f"({100 * busy / span if span else 0:.0f}% of the span, overlaps counted twice); "
          f"names past the table's 8192: {other.get('dropped', (0, 0))[1]:g}")


def run_cupti(args, command, env):
    """Runs `command` with the CUPTI injection library; (kernels, total, other) or None."""
    lib = os.path.abspath(args.cupti_lib or "")
    if not args.cupti_lib or not os.path.isfile(lib):
        print(f"gpu_profile: --cupti-lib {args.cupti_lib}: not a regular file (the bundle's "
              "lib/libcupti_trace.so)", file=sys.stderr)
        return None
    dirs = cupti_lib_dirs()
    env["LD_LIBRARY_PATH"] = ":".join(dirs + [env.get("LD_LIBRARY_PATH", "")]).strip(":")
    env["CUDA_INJECTION64_PATH"] = lib
    # The tracer creates the file (it refuses an existing one); the folder goes afterwards.
    with tempfile.TemporaryDirectory(prefix="gpu_profile.") as folder:
        out = os.path.join(folder, "trace.tsv")
        env["CUPTI_TRACE_OUT"] = out
        print(f"gpu_profile: CUPTI ({lib}; libcupti from {dirs[:1] or 'the loader path'}): "
              f"{' '.join(command)}", flush=True)
        proc = subprocess.run(command, env=env)
        if proc.returncode != 0:
            print(f"gpu_profile: the profiled program exited with {proc.returncode}",
                  file=sys.stderr)
            return None
        try:
            return read_cupti(out)
        except (OSError, ValueError) as e:
            print(f"gpu_profile: cannot read the CUPTI trace {out}: {e}", file=sys.stderr)
            return None


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="program", help="the name printed with the table")
    p.add_argument("--top", type=int, default=30, help="kernels listed (default 30)")
    p.add_argument("--torch", action="store_true",
                   help="profile pytorch_hf_bench.py's transformers model instead of a command")
    p.add_argument("--csv", default=None, help="keep ncu's raw CSV here")
    p.add_argument("--tracer", choices=["ncu", "cupti"], default="ncu",
                   help="Nsight Compute (default) or CUPTI's activity API (--cupti-lib)")
    p.add_argument("--cupti-lib", default=None,
                   help="scripts/cupti_trace.c built as a shared library (the GPU bundle's lib/)")
    p.add_argument("--per-step", default=None, metavar="A,B",
                   help="with --tracer cupti: run with A and with B steps ({steps} in the "
                        "command; --torch fills it) and print what one step adds, set-up and "
                        "warm-up excluded")
    p.add_argument("command", nargs="*", help="the program and its arguments (after --)")
    args = p.parse_args()
    if args.top < 1:
        p.error(f"--top {args.top}: at least 1")
    if args.per_step is not None:
        try:
            a, b = (int(x) for x in args.per_step.split(","))
        except ValueError:
            p.error(f"--per-step {args.per_step}: two whole numbers A,B expected")
        if not 0 < a < b:
            p.error(f"--per-step {args.per_step}: 0 < A < B expected")
        if args.tracer != "cupti":
            p.error("--per-step needs --tracer cupti")
        if not args.torch and not any("{steps}" in c for c in args.command):
            p.error("--per-step: the command needs {steps} where its step count goes")
        args.per_step = (a, b)
    if args.csv and os.path.lexists(args.csv):
        p.error(f"--csv {args.csv} exists: name a new file (nothing is written over)")
    env = dict(os.environ)
    if args.torch:
        env["PYTORCH_HF_BENCH_ROLE"] = "gpu-worker"
        steps = "{steps}" if args.per_step else "1"
        command = [sys.executable, os.path.join(REPO_ROOT, "scripts", "pytorch_hf_bench.py"),
                   "--gpu", "--steps", steps, "--warmup", "1"]
    elif args.command:
        command = args.command
    else:
        p.error("a command after --, or --torch")
    if args.tracer == "cupti":
        first = [c.replace("{steps}", str(args.per_step[0])) for c in command] \
            if args.per_step else command
        traced = run_cupti(args, first, dict(env))
        if traced is None:
            return 1
        if args.per_step:
            a, b = args.per_step
            more = run_cupti(args, [c.replace("{steps}", str(b)) for c in command], dict(env))
            if more is None:
                return 1
            print_cupti(args, traced, f"{args.label}, the whole run with {a} step(s)")
            traced = per_step(traced, more, b - a)
            print_cupti(args, traced, f"{args.label}, one step ({b} steps' run less {a}'s, "
                                      f"divided by {b - a})")
        else:
            print_cupti(args, traced, f"{args.label}, the whole run")
        print(f"gpu_profile: total {traced[1]:.1f} ms ({args.label})")
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("gpu_profile: ncu (Nsight Compute) is not on the PATH", file=sys.stderr)
        return 1
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
    print_tables(args, kernels, total)
    print(f"gpu_profile: total {total:.1f} ms ({args.label})")
    return 0


def print_tables(args, kernels, total):
    """The kernels by name (the `--top` largest) and the totals per kind."""
    launches = sum(v[1] for v in kernels.values())
    print(f"\n{args.label}: {launches:g} kernel launches, {total:.1f} ms of kernel time in all")
    print("| kernel | ms | launches | share |")
    print("|---|---:|---:|---:|")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    for name, (ms, n, _) in ranked[:args.top]:
        print(f"| {name} | {ms:.2f} | {n:g} | {100 * ms / total:.1f}% |")
    kinds = {}
    for ms, n, what in kernels.values():
        k = kinds.setdefault(what, [0.0, 0])
        k[0] += ms
        k[1] += n
    print("\n| kind | ms | launches | share |")
    print("|---|---:|---:|---:|")
    for k, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        print(f"| {k} | {ms:.2f} | {n:g} | {100 * ms / total:.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
