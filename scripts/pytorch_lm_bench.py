#!/usr/bin/env python3
"""PyTorch DDP comparison on the Transformer LM (issue 15's workload).

A benchmark script, not a test: it is not run by `cargo test` or CI, it needs PyTorch
(`pip install torch`), and its timings only mean something on an otherwise quiet machine.

Workload: a Transformer language model, vocab 8000, d_model 256, 8 heads, 4 layers with a
1024-wide feed-forward, sequences of 128 random tokens, batch 8 per process, f32,
cross-entropy, AdamW (lr 1e-3, Candle's other defaults), gradient clipping at norm 1.0, one
compute thread per process.
  - PyTorch: the model as a PyTorch user writes it (`nn.TransformerEncoderLayer`, post-norm, ReLU,
    causal mask, PyTorch's fused attention path), 1 process and 2 processes under DDP (gloo).
  - accelerate-rs: `examples/transformer_lm`'s model of the same size (pre-norm, ReLU as in
    PyTorch's layer, causal attention, `accelerate_rs::nn` LayerNorm/fused packed self-attention/
    ReLU/cross-entropy/Linear), 1 and 2 processes
    (`cargo bench --bench overhead -- --ddp-only --model transformer --ddp-runs 1`).
Each round runs PyTorch with 1 then 2 processes, then the accelerate-rs command (which runs 1
then 2 processes), so drift hits both sides alike; one table and the ratios at the end.

Usage (from anywhere; the Rust command runs in the repository root):
    python scripts/pytorch_lm_bench.py                 # 3 rounds, 20 timed steps after 3 warm-up
    python scripts/pytorch_lm_bench.py --runs 5 --steps 30
    python scripts/pytorch_lm_bench.py --torch-only

The machinery (workers, DDP, the table) is scripts/pytorch_ddp_bench.py's, with `--model lm`.

--gpu: ONE GPU instead (scripts/gpu-smoke.sh runs it on the device):
    python3 scripts/pytorch_lm_bench.py --gpu [--runs 3] [--steps 50] [--rust-cmd CMD]
  The same LM on both sides: examples/transformer_lm's model (pre-norm GPT blocks, packed
  q/k/v projection, causal attention, ReLU MLP 4x wide, final LayerNorm, untied head with bias)
  at the bench's size (vocab 8000, d_model 256, 8 heads, 4 layers, 128 tokens, batch 8: 1024
  tokens and 7.3M parameters per step), f32, AdamW lr 1e-3 (weight decay 0.01), clip 1.0.
  - PyTorch eager: that model in PyTorch as its users write it (nn.Linear/LayerNorm/Embedding,
    F.scaled_dot_product_attention(is_causal=True), F.cross_entropy, torch.optim.AdamW with its
    default foreach implementation), no compile, TF32 off (PyTorch's default for matmuls).
  - accelerate-rs: `overhead --lm-gpu` (default command
    `cargo bench --features cuda --bench overhead -- --lm-gpu`; on a GPU node with the bundle,
    pass --rust-cmd "<bundle>/bin/overhead --lm-gpu"): Accelerator + prepare + backward_step,
    with nn's composed ops and, in a cuda build, its CUDA kernels.
  Each step ends with a device synchronization; --steps timed steps after 10 untimed ones; each
  round runs PyTorch (in its own process) then the accelerate-rs command, so drift hits both.
  One table: ms/step, tokens/s, and each row's time relative to PyTorch eager. Exit status 0,
  1 if a run failed, 2 without torch or without a CUDA GPU.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_ddp_bench  # noqa: E402

if __name__ == "__main__":
    if "--gpu" in sys.argv[1:]:
        import pytorch_lm_gpu  # noqa: E402

        sys.exit(pytorch_lm_gpu.main([a for a in sys.argv[1:] if a != "--gpu"], doc=__doc__))
    sys.exit(pytorch_ddp_bench.main(model="lm", doc=__doc__))
