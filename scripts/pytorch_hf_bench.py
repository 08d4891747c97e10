#!/usr/bin/env python3
"""The same Llama-style model trained in `transformers` (PyTorch, DDP over gloo) and in
accelerate-rs (`accelerate_rs_models::LlamaForCausalLm`), 1 and 2 CPU processes, side by side.

A benchmark script, not a test: not run by `cargo test` or CI; it needs
`pip install torch transformers`, and its timings mean something only side by side on an
otherwise quiet machine.

Workload: `LlamaForCausalLM` with hidden 512, 4 layers, 8 heads, 2 key/value heads, SwiGLU
1408, vocab 8000, untied head; random token sequences of 256, batch 4 per process; the causal-LM
loss (`model(input_ids, labels=input_ids)`, shifted inside), AdamW lr 1e-3; f32, one compute
thread per process. PyTorch runs `transformers`' default (SDPA) attention.
  - PyTorch: `transformers.LlamaForCausalLM`, 1 process, and 2 under `DistributedDataParallel`.
  - accelerate-rs: `models/examples/hf_bench.rs` (the same configuration through
    `AutoModel::from_config`), 1 and 2 processes under `accelerate-rs launch --cpu`.
`--family qwen3`: `Qwen3ForCausalLM` of the same shape on both sides (q/k norms, head_dim
hidden / heads) instead of Llama.
Each round runs PyTorch 1, PyTorch 2, accelerate-rs 1, accelerate-rs 2, so drift hits every
side alike; one table at the end (means of the rounds' means, medians of their medians).

`--gpu`: one GPU, no DDP, a model of the size people fine-tune (issue 38): hidden 1024, 16 layers,
16 heads, 8 key/value heads, SwiGLU 2816, vocab 32000 (about 250M parameters), sequences of 1024,
batch 4, every parameter in bf16 on both sides (AdamW's state too), `transformers`' SDPA attention
against ours as a user runs it (the nn CUDA kernels on: norms, softmax, cross-entropy, RoPE,
SiLU/SwiGLU), on Candle's composed ops alone, with the trial kernels (`ACCELERATE_RS_CUDA_TRIAL=1`:
the embedding's gradient) and with flash attention's CUDA kernel too
(`ACCELERATE_RS_NN_CUDA_FLASH=1`); tokens/s, model FLOP utilisation (6N + 6·L·d·T
FLOPs a token: the causal attention's half, against the 989 TFLOP/s of an H100/H200's dense
bf16) and peak device memory. `--rust-bin` names the `hf_bench` built with `cuda` (the GPU
bundle's).

Usage (builds the release binaries first):
    cargo build --release -p accelerate-rs-models --example hf_bench && cargo build --release -p accelerate-rs-cli
    python scripts/pytorch_hf_bench.py --runs 3 --steps 10 --warmup 2
    python scripts/pytorch_hf_bench.py --gpu --rust-bin BUNDLE/bin/hf_bench   # on a GPU (the unpacked bundle)
"""

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, SEQ, BATCH = 8000, 512, 4, 8, 2, 1408, 256, 4
# --gpu's model: about 250M parameters, sequences of 1024.
GPU_SHAPE = dict(vocab=32000, hidden=1024, layers=16, heads=16, kv_heads=8, ffn=2816, seq=1024,
                 batch=4)
PEAK_BF16_TFLOPS = 989.0
ROLE_ENV = "PYTORCH_HF_BENCH_ROLE"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_RE = re.compile(
    r"RESULT-DDP world=(\d+) ms_mean=([0-9.eE+-]+) ms_median=([0-9.eE+-]+)"
    r" samples_per_s=([0-9.eE+-]+)(?: device_peak=(\d+))?"
)


def single_thread_env(env):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[var] = "1"
    return env


def worker(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ddp = world > 1
    if ddp:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
        )
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    if args.family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=HIDDEN // HEADS, **shape))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape))
    model.train()
    if ddp:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    gen = torch.Generator().manual_seed(0x5EED + rank)
    times = []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and ddp:
            dist.barrier()
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        m = statistics.fmean(times)
        print(f"RESULT-DDP world={world} ms_mean={m:.4f} "
              f"ms_median={statistics.median(times):.4f} "
              f"samples_per_s={world * BATCH * 1e3 / m:.4f}", flush=True)
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


def gpu_worker(args):
    """`transformers`' Llama of GPU_SHAPE on cuda:0 in bf16, one process; prints RESULT-DDP."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    g = GPU_SHAPE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=g["ffn"],
        num_hidden_layers=g["layers"], num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"], max_position_embeddings=g["seq"],
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    gen = torch.Generator().manual_seed(0x5EED)
    times, forwards = [], []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, g["vocab"], (g["batch"], g["seq"]), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        forward = (time.perf_counter() - start) * 1e3
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1e3)
            forwards.append(forward)
    m = statistics.fmean(times)
    f = statistics.fmean(forwards)
    print(f"BREAKDOWN forward_ms={f:.2f} backward_and_step_ms={m - f:.2f}", flush=True)
    print(f"RESULT-DDP world=1 ms_mean={m:.4f} ms_median={statistics.median(times):.4f} "
          f"samples_per_s={g['batch'] * 1e3 / m:.4f} "
          f"device_peak={torch.cuda.max_memory_allocated()}", flush=True)


def gpu_params():
    g = GPU_SHAPE
    h, kv_width = g["hidden"], g["hidden"] // g["heads"] * g["kv_heads"]
    layer = 2 * h * h + 2 * h * kv_width + 3 * h * g["ffn"] + 2 * h
    return g["layers"] * layer + 2 * g["vocab"] * h + h


def run_torch_gpu(args):
    env = dict(os.environ)
    env[ROLE_ENV] = "gpu-worker"
    cmd = [sys.executable, os.path.abspath(__file__), "--gpu", "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the torch GPU worker exited with {proc.returncode}:\n"
                           f"{proc.stderr[-2000:]}")
    return parse(proc.stdout, "torch GPU") + (breakdown(proc.stdout),)


def run_rust_gpu(args, extra_env):
    g = GPU_SHAPE
    bench = args.rust_bin or os.path.join(REPO_ROOT, args.target_dir, "release", "examples",
                                          "hf_bench")
    if not os.path.exists(bench):
        raise RuntimeError(f"{bench} is missing: build hf_bench with --features cuda (the GPU "
                           "bundle has it) and name it with --rust-bin")
    cmd = [bench, "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", "bf16",
           "--vocab", str(g["vocab"]), "--hidden", str(g["hidden"]), "--intermediate",
           str(g["ffn"]), "--layers", str(g["layers"]), "--heads", str(g["heads"]),
           "--kv-heads", str(g["kv_heads"]), "--seq", str(g["seq"]), "--batch", str(g["batch"])]
    env = dict(os.environ)
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.update(extra_env)
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                           f"{proc.stderr[-2000:]}")
    return parse(proc.stdout, "accelerate-rs GPU") + (breakdown(proc.stdout),)


def breakdown(out):
    """The BREAKDOWN line's text (forward against backward + optimizer step), or ''."""
    for line in out.splitlines():
        if line.startswith("BREAKDOWN "):
            return line[len("BREAKDOWN "):]
    return ""


def gpu_main(args):
    import torch
    import transformers

    g = GPU_SHAPE
    n = gpu_params()
    tokens = g["batch"] * g["seq"]
    flops_per_token = 6 * n + 6 * g["layers"] * g["hidden"] * g["seq"]
    print(f"llama on {torch.cuda.get_device_name(0)}: {n / 1e6:.0f}M parameters (hidden "
          f"{g['hidden']}, {g['layers']} layers, {g['heads']} heads, {g['kv_heads']} KV heads, "
          f"FFN {g['ffn']}, vocab {g['vocab']}); seq {g['seq']}, batch {g['batch']}; bf16 "
          f"parameters and AdamW state; torch {torch.__version__}, transformers "
          f"{transformers.__version__}; {args.runs} rounds of {args.steps} timed steps after "
          f"{args.warmup} warm-up", flush=True)
    sides = [("transformers (SDPA), PyTorch eager", lambda: run_torch_gpu(args)),
             ("accelerate-rs (nn CUDA kernels, the default)", lambda: run_rust_gpu(args, {})),
             ("accelerate-rs, Candle's composed ops (ACCELERATE_RS_NN_CUDA=0)",
              lambda: run_rust_gpu(args, {"ACCELERATE_RS_NN_CUDA": "0"})),
             ("accelerate-rs + the trial kernels (ACCELERATE_RS_CUDA_TRIAL=1: the embedding)",
              lambda: run_rust_gpu(args, {"ACCELERATE_RS_CUDA_TRIAL": "1"})),
             ("accelerate-rs + flash attention's CUDA kernel",
              lambda: run_rust_gpu(args, {"ACCELERATE_RS_NN_CUDA_FLASH": "1"}))]
    results = {i: [] for i in range(len(sides))}
    for r in range(args.runs):
        for i, (name, run) in enumerate(sides):
            try:
                res = run()
            except RuntimeError as e:
                print(f"  round {r + 1}/{args.runs} {name}: FAILED: {e}", flush=True)
                continue
            results[i].append(res)
            print(f"  round {r + 1}/{args.runs} {name}: {res[0]:.1f} ms/step ({res[4]})",
                  flush=True)
    print()
    print("| implementation | ms/step mean | ms/step median | tokens/s | MFU | peak memory GiB | vs transformers |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    for i, (name, _) in enumerate(sides):
        if not results[i]:
            print(f"| {name} | failed | | | | | |")
            continue
        m = statistics.fmean(x[0] for x in results[i])
        md = statistics.median(x[1] for x in results[i])
        tps = tokens * 1e3 / m
        mfu = tps * flops_per_token / (PEAK_BF16_TFLOPS * 1e12) * 100
        peaks = [x[3] for x in results[i] if x[3] is not None]
        peak = f"{max(peaks) / 2**30:.1f}" if peaks else "-"
        base = tps if i == 0 else base
        ratio = f"{tps / base:.2f}x" if base else "-"
        print(f"| {name} | {m:.1f} | {md:.1f} | {tps:.0f} | {mfu:.1f}% | {peak} | {ratio} |")
    print("RESULT-HF-GPU done", flush=True)
    return 0


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(out, what):
    for line in out.splitlines():
        m = RESULT_RE.search(line)
        if m:
            peak = int(m.group(5)) if m.group(5) else None
            return tuple(float(m.group(i)) for i in (2, 3, 4)) + (peak,)
    raise RuntimeError(f"no RESULT-DDP line from {what}:\n{out[-2000:]}")


def run_torch(world, args):
    port = free_port()
    procs = []
    for rank in range(world):
        env = single_thread_env(dict(os.environ))
        env.update({ROLE_ENV: "worker", "RANK": str(rank), "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--family", args.family]
        procs.append(subprocess.Popen(cmd, env=env, text=True,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    out, _ = procs[0].communicate()
    codes = [procs[0].returncode] + [p.wait() for p in procs[1:]]
    if any(codes):
        raise RuntimeError(f"torch workers (world={world}) exited with {codes}")
    return parse(out, f"torch world={world}")


def run_rust(world, args):
    launcher = os.path.join(REPO_ROOT, args.target_dir, "release", "accelerate-rs")
    bench = os.path.join(REPO_ROOT, args.target_dir, "release", "examples", "hf_bench")
    for f in (launcher, bench):
        if not os.path.exists(f):
            raise RuntimeError(f"{f} is missing: build it first (see --help)")
    cmd = [launcher, "launch", "--cpu", "-n", str(world), bench, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--family", args.family]
    env = single_thread_env(dict(os.environ))
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return parse(proc.stdout, f"accelerate-rs world={world}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--family", choices=["llama", "qwen3"], default="llama",
                   help="the architecture on both sides (Qwen3: q/k norms, head_dim hidden/heads)")
    p.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR", "target"),
                   help="cargo's target folder (default $CARGO_TARGET_DIR or target)")
    p.add_argument("--gpu", action="store_true",
                   help="one GPU, a 250M-parameter Llama in bf16 at sequence 1024 (see above)")
    p.add_argument("--rust-bin", default=None,
                   help="with --gpu: the cuda build of hf_bench (default: the target folder's)")
    args = p.parse_args()
    for name, least in (("runs", 1), ("steps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name} {getattr(args, name)}: at least {least}")
    if os.environ.get(ROLE_ENV) == "worker":
        worker(args)
        return 0
    if os.environ.get(ROLE_ENV) == "gpu-worker":
        gpu_worker(args)
        return 0
    if args.gpu:
        return gpu_main(args)
    import torch
    import transformers

    print(f"{args.family}: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads, {KV_HEADS} KV "
          f"heads, FFN {FFN}, vocab {VOCAB}; seq {SEQ}, batch {BATCH}/process; f32, AdamW; "
          f"1 thread/process")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"nproc {os.cpu_count()}; {args.runs} rounds of {args.steps} timed steps after "
          f"{args.warmup} warm-up; load {os.getloadavg()}", flush=True)
    sides = [("pytorch (transformers)", 1, run_torch), ("pytorch DDP gloo", 2, run_torch),
             ("accelerate-rs", 1, run_rust), ("accelerate-rs", 2, run_rust)]
    results = {i: [] for i in range(len(sides))}
    for r in range(args.runs):
        for i, (name, world, run) in enumerate(sides):
            res = run(world, args)
            results[i].append(res)
            print(f"  round {r + 1}/{args.runs} {name} x{world}: {res[0]:.1f} ms/step", flush=True)
    rows = []
    for i, (name, world, _) in enumerate(sides):
        m = statistics.fmean(x[0] for x in results[i])
        md = statistics.median(x[1] for x in results[i])
        rows.append((name, world, m, md, world * BATCH * SEQ * 1e3 / m))
    print(f"load after: {os.getloadavg()}")
    print()
    print("| implementation | processes | ms/step mean | ms/step median | tokens/s | scaling efficiency |")
    print("|---|---:|---:|---:|---:|---:|")
    for j, (name, world, m, md, tps) in enumerate(rows):
        eff = "-" if world == 1 else f"{tps / (2 * rows[j - 1][4]) * 100:.1f}%"
        print(f"| {name} | {world} | {m:.1f} | {md:.1f} | {tps:.0f} | {eff} |")
    print()
    one = rows[2][2] / rows[0][2]
    two = rows[3][4] / rows[1][4]
    per_round_one = [results[2][r][0] / results[0][r][0] for r in range(args.runs)]
    per_round_two = [results[1][r][0] / 2 / (results[3][r][0] / 2) for r in range(args.runs)]
    print(f"1-process step: {one:.2f}x PyTorch's (target <= 1.0x: {'met' if one <= 1.0 else 'not met'}); "
          f"per round {', '.join(f'{x:.2f}x' for x in per_round_one)}")
    print(f"2-process tokens/s: {two:.2f}x PyTorch DDP's (target >= 1.2x: "
          f"{'met' if two >= 1.2 else 'not met'}); per round {', '.join(f'{x:.2f}x' for x in per_round_two)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
