#!/usr/bin/env python3
"""PyTorch DDP comparison for the accelerate-rs CPU DDP benchmark.

A benchmark script, not a test: it is not run by `cargo test` or CI, it needs PyTorch
(`pip install torch`), and its timings only mean something on an otherwise quiet machine.

It runs one CPU training workload in PyTorch, with 1 process (a plain loop) and with 2 processes
(`torch.distributed` + `gloo` on 127.0.0.1, `DistributedDataParallel`), then runs the accelerate-rs
side of the same workload (`cargo bench --bench overhead -- --ddp-only`, run from the repository
root) and prints both in one markdown table with the ratio of their 2-process throughputs.

Workload (identical on both sides):
    MLP 784-1024-1024-10 (Linear, ReLU, Linear, ReLU, Linear), f32, cross-entropy loss,
    AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight_decay 0.01), batch 64 per process,
    synthetic data from a fixed seed (inputs uniform in [-1, 1), labels uniform in 0..10),
    one compute thread per process (OMP_NUM_THREADS=1, torch.set_num_threads(1)).
    Each rank trains on its own batches. After --warmup untimed steps (and a barrier), --steps
    steps are timed on rank 0; a step is zero_grad + forward + loss + backward (which includes
    DDP's gradient all-reduce) + optimizer step.
    samples/s = world * 64 / mean step time; scaling efficiency = samples/s(2) / (2 * samples/s(1)).

Usage:
    python scripts/pytorch_ddp_bench.py                  # torch 1 + 2 processes, then accelerate-rs
    python scripts/pytorch_ddp_bench.py --torch-only     # only the PyTorch side
    python scripts/pytorch_ddp_bench.py --steps 200 --runs 5
    python scripts/pytorch_ddp_bench.py --rust-cmd "cargo bench --bench overhead -- --ddp-only --quick"

The PyTorch runs alternate (1 process, 2 processes, 1, 2, ...; --runs per size) and the
accelerate-rs command runs right after them, so both sides see the same machine. The Rust command
must print, on stdout, lines of the form
    RESULT-DDP world=1 ms_mean=36.57 ms_median=36.01 samples_per_s=1750.0
    RESULT-DDP world=2 ms_mean=40.1 ms_median=39.5 samples_per_s=3192.0
(all its other output is ignored). Exit status: 0 on success, 1 if a run failed or the Rust
output lacked a result line, 2 if torch is not importable.

Standard library + torch only.
"""

import argparse
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

INPUT = 784
HIDDEN = 1024
CLASSES = 10
BATCH = 64
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
DATA_SEED = 0x5EED
WEIGHT_SEED = 0x3E16

DEFAULT_RUST_CMD = "cargo bench --bench overhead -- --ddp-only"

# The Transformer LM workload (--model lm; scripts/pytorch_lm_bench.py): the issue's model, as a
# PyTorch user writes it (nn.TransformerEncoderLayer, post-norm, ReLU, causal mask) beside
# accelerate-rs's examples/transformer_lm model of the same size (pre-norm, GELU).
LM_VOCAB = 8000
LM_SEQ = 128
LM_D = 256
LM_HEADS = 8
LM_LAYERS = 4
LM_FF = 1024
LM_BATCH = 8
LM_CLIP = 1.0
LM_RUST_CMD = "cargo bench --bench overhead -- --ddp-only --model transformer --ddp-runs 1"
ROLE_ENV = "PYTORCH_DDP_BENCH_ROLE"
TORCH_RESULT = "RESULT-TORCH"
RUST_RESULT_RE = re.compile(
    r"^RESULT-DDP world=(\d+) ms_mean=([0-9.eE+-]+) ms_median=([0-9.eE+-]+)"
    r" samples_per_s=([0-9.eE+-]+)\s*$"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def single_thread_env(env):
    """One compute thread per process, whatever the caller's environment says."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    return env


# ---------------------------------------------------------------------------------------------
# Worker (one training process; re-executed by the parent with ROLE_ENV set)


def lm_model(nn, torch):
    """The Transformer LM in PyTorch: token ids [B, T] to logits [B * T, vocab]."""

    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(LM_VOCAB, LM_D)
            self.pos = nn.Embedding(LM_SEQ, LM_D)
            layer = nn.TransformerEncoderLayer(
                LM_D, LM_HEADS, dim_feedforward=LM_FF, dropout=0.0, batch_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, LM_LAYERS, enable_nested_tensor=False)
            self.ln_f = nn.LayerNorm(LM_D)
            self.head = nn.Linear(LM_D, LM_VOCAB)
            self.register_buffer(
                "mask", nn.Transformer.generate_square_subsequent_mask(LM_SEQ), persistent=False
            )

        def forward(self, ids):
            t = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(t))
            x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
            return self.head(self.ln_f(x)).reshape(-1, LM_VOCAB)

    return Lm()


def worker(args):
    import torch
    import torch.nn as nn

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    ddp = world > 1
    if ddp:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=5)
        )

    total_steps = args.warmup + args.steps
    lm = args.model == "lm"
    batch = LM_BATCH if lm else BATCH
    # The whole data set is the same in every process; rank r takes batches r, r + world, ...
    gen = torch.Generator().manual_seed(DATA_SEED)
    samples = world * batch * total_steps
    if lm:
        x = torch.randint(0, LM_VOCAB, (samples, LM_SEQ), generator=gen)
        y = torch.randint(0, LM_VOCAB, (samples, LM_SEQ), generator=gen)
    else:
        x = torch.rand(samples, INPUT, generator=gen) * 2.0 - 1.0
        y = torch.randint(0, CLASSES, (samples,), generator=gen)
    batches = [
        (x[i * batch:(i + 1) * batch].contiguous(), y[i * batch:(i + 1) * batch].contiguous())
        for i in range(rank, world * total_steps, world)
    ]

    torch.manual_seed(WEIGHT_SEED)  # same initial weights everywhere (DDP broadcasts rank 0's)
    if lm:
        model = lm_model(nn, torch)
    else:
        model = nn.Sequential(
            nn.Linear(INPUT, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, CLASSES),
        )
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    loss_fn = nn.CrossEntropyLoss()

    times = []
    for step in range(total_steps):
        if step == args.warmup and ddp:
            dist.barrier()
        start = time.perf_counter()
        xb, yb = batches[step]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb.reshape(-1))
        loss.backward()
        if lm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), LM_CLIP)
        opt.step()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)

    if not torch.isfinite(loss.detach()):
        raise RuntimeError(f"rank {rank}: non-finite loss {loss.item()}")
    if rank == 0:
        print(
            f"{TORCH_RESULT} world={world} steps={len(times)} "
            f"ms_mean={statistics.fmean(times):.4f} ms_median={statistics.median(times):.4f} "
            f"loss={loss.item():.4f}",
            flush=True,
        )
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parent


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(world, args):
    """Start `world` worker processes; return (ms_mean, ms_median) from rank 0."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = single_thread_env(dict(os.environ))
        env.update(
            {
                ROLE_ENV: "worker",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                text=True,
            )
        )
    try:
        out, _ = procs[0].communicate()
        codes = [procs[0].returncode] + [p.wait() for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"torch workers (world={world}) exited with {codes}")
    for line in out.splitlines():
        if line.startswith(TORCH_RESULT + " "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            return float(fields["ms_mean"]), float(fields["ms_median"])
    raise RuntimeError(f"no {TORCH_RESULT} line from rank 0 (world={world}):\n{out}")


def run_rust(cmd):
    """Run the accelerate-rs bench; return {world: (ms_mean, ms_median, samples_per_s)}."""
    print(f"$ {cmd}   (in {REPO_ROOT})", flush=True)
    env = single_thread_env(dict(os.environ))
    proc = subprocess.Popen(
        cmd, shell=True, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    found = {}
    for line in proc.stdout:
        sys.stdout.write("  | " + line)
        m = RUST_RESULT_RE.match(line.strip())
        if m:
            w = int(m.group(1))
            found.setdefault(w, []).append(tuple(float(m.group(i)) for i in (2, 3, 4)))
    sys.stdout.flush()
    code = proc.wait()
    results = {}
    for w, rows in found.items():
        if len(rows) == 1:
            results[w] = rows[0]
        else:
            print(f"note: {len(rows)} RESULT-DDP lines for world={w}; "
                  "using mean of means, median of medians, mean of samples/s")
            results[w] = (
                statistics.fmean(r[0] for r in rows),
                statistics.median(r[1] for r in rows),
                statistics.fmean(r[2] for r in rows),
            )
    return code, results


def load():
    try:
        out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if out:
            return out
    except OSError:
        pass
    return "load average: {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def main(argv=None, model="mlp", doc=__doc__):
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lm_default = model == "lm"
    p.add_argument("--model", choices=("mlp", "lm"), default=model,
                   help=f"workload: the MLP or the Transformer LM (default {model})")
    p.add_argument("--steps", type=int, default=20 if lm_default else 100,
                   help="timed steps per run (default 100; 20 for lm)")
    p.add_argument("--warmup", type=int, default=3 if lm_default else 15,
                   help="untimed steps first (default 15; 3 for lm)")
    p.add_argument("--runs", type=int, default=3,
                   help="rounds; each runs PyTorch with 1 then 2 processes (and, with --alternate, "
                        "the accelerate-rs command) (default 3)")
    p.add_argument("--alternate", action="store_true", default=lm_default,
                   help="run the accelerate-rs command in every round instead of once after the "
                        "PyTorch runs (default for lm)")
    p.add_argument("--torch-only", action="store_true", help="skip the accelerate-rs side")
    p.add_argument("--rust-cmd", default=None,
                   help=f"accelerate-rs command, run in the repo root (default: {DEFAULT_RUST_CMD!r}; "
                        f"for lm {LM_RUST_CMD!r})")
    args = p.parse_args(argv)
    if args.rust_cmd is None:
        args.rust_cmd = LM_RUST_CMD if args.model == "lm" else DEFAULT_RUST_CMD

    if os.environ.get(ROLE_ENV) == "worker":
        worker(args)
        return 0

    single_thread_env(os.environ)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"error: PyTorch is not importable ({e}).\n"
              "Install it (CPU is enough), e.g.:\n"
              "    python3 -m venv /tmp/torch-venv && /tmp/torch-venv/bin/pip install torch\n"
              f"    /tmp/torch-venv/bin/python {os.path.relpath(__file__)} ...\n"
              "or simply: pip install torch", file=sys.stderr)
        return 2
    if not dist.is_available() or not dist.is_gloo_available():
        print("error: this torch build has no torch.distributed / gloo backend", file=sys.stderr)
        return 2

    batch = LM_BATCH if args.model == "lm" else BATCH
    if args.model == "lm":
        print(f"PyTorch DDP comparison benchmark: Transformer LM (vocab {LM_VOCAB}, d_model {LM_D}, "
              f"{LM_HEADS} heads, {LM_LAYERS} layers, FFN {LM_FF}, seq {LM_SEQ}), f32, AdamW lr "
              f"{LR:g}, clip {LM_CLIP}, batch {batch}/process, 1 thread/process, random tokens")
    else:
        print(f"PyTorch DDP comparison benchmark: MLP {INPUT}-{HIDDEN}-{HIDDEN}-{CLASSES} (ReLU), "
              f"f32, AdamW lr {LR:g}, batch {batch}/process, 1 thread/process, synthetic data")
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, nproc {os.cpu_count()}"
          f" (usable: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'})")
    print(f"{args.runs} run(s) per process count, {args.steps} timed steps after {args.warmup} warm-up")
    print(f"before:        {load()}", flush=True)

    worlds = (1, 2)
    torch_runs = {w: [] for w in worlds}
    rust_runs = {}
    status = 0
    rust_each_round = args.alternate and not args.torch_only
    try:
        for r in range(args.runs):
            for w in worlds:
                mean_ms, median_ms = run_torch(w, args)
                torch_runs[w].append((mean_ms, median_ms))
                print(f"  torch run {r + 1}/{args.runs} world={w}: "
                      f"{mean_ms:.2f} ms/step mean, {median_ms:.2f} median", flush=True)
            if rust_each_round or (r == args.runs - 1 and not args.torch_only):
                code, res = run_rust(args.rust_cmd)
                if code != 0:
                    print(f"error: the accelerate-rs command exited with {code}", file=sys.stderr)
                    status = 1
                for w, row in res.items():
                    rust_runs.setdefault(w, []).append(row)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    torch_res = {}
    for w in worlds:
        m = statistics.fmean(r[0] for r in torch_runs[w])
        md = statistics.median(r[1] for r in torch_runs[w])
        torch_res[w] = (m, md, w * batch * 1e3 / m)
    rust_res = {
        w: (statistics.fmean(r[0] for r in rows), statistics.median(r[1] for r in rows),
            statistics.fmean(r[2] for r in rows))
        for w, rows in rust_runs.items()
    }
    print(f"after all:     {load()}", flush=True)

    if not args.torch_only:
        missing = [w for w in worlds if w not in rust_res]
        if missing:
            print(f"error: no RESULT-DDP line for world={missing} from the accelerate-rs command",
                  file=sys.stderr)
            status = 1

    def eff(res):
        if 1 in res and 2 in res:
            return res[2][2] / (2 * res[1][2]) * 100.0
        return None

    rows = [("pytorch", 1, torch_res.get(1), None),
            ("pytorch DDP gloo", 2, torch_res.get(2), eff(torch_res))]
    if not args.torch_only:
        rows += [("accelerate-rs", 1, rust_res.get(1), None),
                 ("accelerate-rs", 2, rust_res.get(2), eff(rust_res))]
    print()
    print("| implementation | processes | ms/step mean | ms/step median | samples/s | scaling efficiency |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, w, res, e in rows:
        m, md, sps = res if res else (None, None, None)
        e_s = "-" if w == 1 else fmt(e, ".1f") + ("%" if e is not None else "")
        print(f"| {name} | {w} | {fmt(m, '.2f')} | {fmt(md, '.2f')} | {fmt(sps, '.0f')} | {e_s} |")
    print()
    if not args.torch_only and 2 in rust_res:
        print("ratio accelerate-rs / pytorch (2 processes, samples/s): "
              f"{rust_res[2][2] / torch_res[2][2]:.2f}x")
    if not args.torch_only and 1 in rust_res:
        print("ratio accelerate-rs / pytorch (1 process, ms/step mean): "
              f"{rust_res[1][0] / torch_res[1][0]:.2f}x")
    print(f"mean of run means, median of run medians; "
          f"samples/s = processes x {batch} / mean step time; "
          "efficiency = samples/s(2) / (2 x samples/s(1))")
    return status


if __name__ == "__main__":
    sys.exit(main())
