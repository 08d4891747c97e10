#!/usr/bin/env python3
"""The one-GPU side of scripts/pytorch_lm_bench.py (its --gpu mode; see its docstring).

PyTorch eager against accelerate-rs on examples/transformer_lm's model, on one GPU, one table.
Standard library + torch only. Run through `python3 scripts/pytorch_lm_bench.py --gpu`.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

VOCAB = 8000
SEQ = 128
D = 256
HEADS = 8
LAYERS = 4
BATCH = 8
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
CLIP = 1.0
WARMUP = 10
SEED = 0x5EED
ROLE_ENV = "PYTORCH_LM_GPU_ROLE"
TORCH_RESULT = "RESULT-TORCH-GPU"
DEFAULT_RUST_CMD = "cargo bench --features cuda --bench overhead -- --lm-gpu"
RUST_RESULT_RE = re.compile(
    r"^RESULT-LM-GPU variant=(\w+) ms_mean=([0-9.eE+-]+) ms_median=([0-9.eE+-]+)"
    r" tokens_per_s=([0-9.eE+-]+) loss=([0-9.eE+-]+|nan|inf)\s*$"
)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lm(torch):
    """examples/transformer_lm/model.rs in PyTorch: token ids [B, T] to the mean next-token loss."""
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(D, eps=1e-5)
            self.qkv = nn.Linear(D, 3 * D)
            self.proj = nn.Linear(D, D)
            self.ln2 = nn.LayerNorm(D, eps=1e-5)
            self.fc = nn.Linear(D, 4 * D)
            self.fc_out = nn.Linear(4 * D, D)

        def forward(self, x):
            b, t, c = x.shape
            # [B, T, 3C]: q, k and v side by side, heads of C / H columns in each.
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.fc_out(F.relu(self.fc(self.ln2(x))))

    class Lm(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, D)
            self.pos = nn.Embedding(SEQ, D)
            nn.init.normal_(self.tok.weight, 0.0, 0.02)
            nn.init.normal_(self.pos.weight, 0.0, 0.02)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln_f = nn.LayerNorm(D, eps=1e-5)
            self.head = nn.Linear(D, VOCAB)
            nn.init.normal_(self.head.weight, 0.0, 0.02)
            nn.init.zeros_(self.head.bias)

        def forward(self, ids, targets):
            t = ids.shape[1]
            x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Lm()


def worker(steps, device):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(SEED)
    model = lm(torch).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)
    gen = torch.Generator(device=dev).manual_seed(SEED)
    total = WARMUP + steps
    ids = torch.randint(0, VOCAB, (total, BATCH, SEQ), device=dev, generator=gen)
    tgt = torch.randint(0, VOCAB, (total, BATCH, SEQ), device=dev, generator=gen)
    times = []
    sync()
    for step in range(total):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(ids[step], tgt[step])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sync()
        if step >= WARMUP:
            times.append((time.perf_counter() - start) * 1e3)
    value = loss.item()
    if value != value or value in (float("inf"), float("-inf")):
        raise RuntimeError(f"non-finite loss {value}")
    print(f"{TORCH_RESULT} variant=eager params={n_params} ms_mean={statistics.fmean(times):.4f} "
          f"ms_median={statistics.median(times):.4f} loss={value:.4f}", flush=True)


def run_torch(steps, device):
    env = dict(os.environ)
    env[ROLE_ENV] = "worker"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(steps),
                           "--device", device],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the PyTorch run exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith(TORCH_RESULT + " "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            return float(fields["ms_mean"]), float(fields["ms_median"]), int(fields["params"])
    raise RuntimeError(f"no {TORCH_RESULT} line from the PyTorch run:\n{proc.stdout}")


def run_rust(cmd, steps):
    full = f"{cmd} --lm-steps {steps}"
    print(f"$ {full}   (in {REPO_ROOT})", flush=True)
    proc = subprocess.Popen(full, shell=True, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    found = {}
    for line in proc.stdout:
        sys.stdout.write("  | " + line)
        m = RUST_RESULT_RE.match(line.strip())
        if m:
            found[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    sys.stdout.flush()
    return proc.wait(), found


def main(argv=None, doc=__doc__):
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per run (default 50)")
    p.add_argument("--rust-cmd", default=DEFAULT_RUST_CMD,
                   help=f"accelerate-rs command, run in the repo root (default {DEFAULT_RUST_CMD!r}); "
                        "--lm-steps is appended")
    p.add_argument("--torch-only", action="store_true", help="skip the accelerate-rs side")
    p.add_argument("--device", default="cuda",
                   help="torch device (default cuda; cpu checks the script itself without a GPU)")
    args = p.parse_args(argv)
    if os.environ.get(ROLE_ENV) == "worker":
        worker(args.steps, args.device)
        return 0
    try:
        import torch
    except ImportError as e:
        print(f"error: PyTorch is not importable ({e}); pip install torch", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: torch sees no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    print(f"PyTorch eager vs accelerate-rs on one GPU ({name}): examples/transformer_lm's model, "
          f"vocab {VOCAB}, d_model {D}, {HEADS} heads, {LAYERS} layers, ReLU MLP {4 * D}, "
          f"seq {SEQ}, batch {BATCH} ({BATCH * SEQ} tokens/step), f32, AdamW lr {LR:g}, clip {CLIP}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {sys.version.split()[0]}; "
          f"{args.runs} round(s) of {args.steps} timed steps after {WARMUP}", flush=True)
    torch_runs, rust_runs, params, status = [], {}, None, 0
    try:
        for r in range(args.runs):
            m, md, params = run_torch(args.steps, args.device)
            torch_runs.append((m, md))
            print(f"  torch round {r + 1}/{args.runs}: {m:.2f} ms/step mean, {md:.2f} median",
                  flush=True)
            if not args.torch_only:
                code, found = run_rust(args.rust_cmd, args.steps)
                if code != 0 or not found:
                    print(f"error: the accelerate-rs command exited with {code} "
                          f"and {len(found)} result line(s)", file=sys.stderr)
                    status = 1
                for k, v in found.items():
                    rust_runs.setdefault(k, []).append(v)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    rows = [(f"PyTorch eager (torch {torch.__version__}, {params / 1e6:.1f}M parameters)",
             statistics.fmean(r[0] for r in torch_runs), statistics.median(r[1] for r in torch_runs))]
    labels = {"composed": "accelerate-rs (nn: composed Candle ops)",
              "kernels": "accelerate-rs (nn: CUDA kernels)"}
    for k in ("composed", "kernels"):
        if k in rust_runs:
            rows.append((labels[k], statistics.fmean(r[0] for r in rust_runs[k]),
                         statistics.median(r[1] for r in rust_runs[k])))
    base = rows[0][1]
    print()
    print(f"| implementation ({name}) | ms/step mean | ms/step median | tokens/s | time vs PyTorch eager |")
    print("|---|---:|---:|---:|---:|")
    for label, m, md in rows:
        print(f"| {label} | {m:.2f} | {md:.2f} | {BATCH * SEQ * 1e3 / m:.0f} | {m / base:.2f}x |")
    return status


if __name__ == "__main__":
    sys.exit(main())
