#!/usr/bin/env python3
"""Side by side: PyTorch FSDP2 (`fully_shard` per decoder layer, gloo, CPU) and accelerate-rs
at ZeRO stage 3, training the same Llama-style model, in alternating rounds.

The model is the folder `zero3_bench --make` writes (hidden 512, 12 layers, 8 heads, 2 key/value
heads, SwiGLU 1408, vocab 8000: 42 M parameters, f32), loaded by both: `transformers`'
`LlamaForCausalLM.from_pretrained` for PyTorch, `LlamaForCausalLm::from_pretrained_sharded`
for accelerate-rs. Both train AdamW (lr 1e-4) on random tokens, batch 2 x 256 per rank.
PyTorch runs with and without activation checkpointing (`gradient_checkpointing_enable`;
accelerate-rs at stage 3 always recomputes its blocks: the same memory regime as FSDP2 with
checkpointing). Each run reports the median step time over `--steps` steps after one warm-up
step and each rank's peak resident set (`ru_maxrss`; `VmHWM` for accelerate-rs); the table
shows tokens/s over all ranks and the largest rank's peak, medians over the rounds.

Usage (after `cargo build --release -p accelerate-rs-models --example zero3_bench -p
accelerate-rs-cli`), with the virtualenv that has torch and transformers:
    /work/venv/bin/python scripts/pytorch_fsdp_bench.py --worlds 2,4 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_worker(rank: int, world: int, port: int, args, ckpt: bool, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    times = []
    for step in range(1 + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step > 0:
            times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    queue.put((rank, statistics.median(times), peak))
    dist.destroy_process_group()


def run_torch(world: int, ckpt: bool, args) -> tuple[float, int]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=torch_worker, args=(r, world, port, args, ckpt, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"a PyTorch worker failed ({p.exitcode})")
    step = max(r[1] for r in results)
    return world * args.batch * args.seq / step, max(r[2] for r in results)


LINE = re.compile(r"rank=\d+ world=\d+ stage=\d+ start=\d+ base=\d+ load_peak=\d+ "
                  r"train_peak=(\d+) step_ms=(\d+) tokens_per_s=\d+")


def run_ours(world: int, args) -> tuple[float, int]:
    cmd = [os.path.join(args.target, "accelerate-rs"), "launch", "--cpu", "-n", str(world),
           "--zero-stage", "3", os.path.join(args.target, "examples", "zero3_bench"),
           "--model", args.model, "--steps", str(args.steps), "--batch", str(args.batch),
           "--seq", str(args.seq)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    rows = [(int(p), int(s)) for p, s in LINE.findall(out.stdout)]
    if len(rows) != world:
        sys.exit(f"expected {world} result lines:\n{out.stdout}\n{out.stderr}")
    step = max(s for _, s in rows) / 1e3
    return world * args.batch * args.seq / step, max(p for p, _ in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="target/release")
    ap.add_argument("--model", help="a zero3_bench --make folder (else one is made)")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    if not args.model:
        args.model = os.path.join(tempfile.mkdtemp(prefix="fsdp-bench-"), "llama-42m")
        subprocess.run([os.path.join(args.target, "examples", "zero3_bench"), "--make",
                        args.model], check=True)
    runs = {"accelerate-rs stage 3": lambda w: run_ours(w, args),
            "FSDP2 + checkpointing": lambda w: run_torch(w, True, args),
            "FSDP2": lambda w: run_torch(w, False, args)}
    got: dict[tuple[int, str], list[tuple[float, int]]] = {}
    names = list(runs)
    for r in range(args.rounds):
        for world in [int(w) for w in args.worlds.split(",")]:
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                tps, peak = runs[name](world)
                got.setdefault((world, name), []).append((tps, peak))
                print(f"# round {r} n={world} {name}: {tps:.0f} tokens/s, peak {peak / 2**20:.0f} "
                      "MiB", file=sys.stderr)
    print("| processes | run | tokens/s (median, min-max) | peak RSS per rank (MiB, median) |")
    print("|---|---|---|---|")
    for (world, name), vals in sorted(got.items()):
        tps = [v[0] for v in vals]
        peaks = [v[1] for v in vals]
        print(f"| {world} | {name} | {statistics.median(tps):.0f} ({min(tps):.0f}-{max(tps):.0f}) "
              f"| {statistics.median(peaks) / 2**20:.0f} |")


if __name__ == "__main__":
    main()
