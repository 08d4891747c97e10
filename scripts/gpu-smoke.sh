#!/usr/bin/env bash
# GPU smoke test: proves the `cuda` build on a machine with NVIDIA GPUs. Not run by CI (CI has no
# GPU; it only builds the cuda feature).
#
# Build (on any machine; the CUDA toolkit comes from PyPI wheels, libraries are stubs at link time):
#   source ../shared/tools/cuda-toolchain.sh
#   cargo build --release --features cuda --bin accelerate-rs --example digits
#   cargo bench --features cuda --bench overhead --no-run
# Run (on the GPU machine, from the repository root, with the built target/ directory):
#   scripts/gpu-smoke.sh [TARGET_DIR]        # default: target/release
#
# Steps: digits on 1 GPU; NCCL collectives at world size 1 (and DDP on 2 ranks when the machine
# has 2 GPUs), with the fused CUDA AdamW/SGD kernels checked against the unfused path; DP over the GPUs the machine has; a bf16 run; raw Candle vs accelerate-rs step time
# on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
T="${1:-target/release}"
# shellcheck disable=SC1091
source scripts/gpu-env.sh
N="$(nvidia-smi -L 2>/dev/null | wc -l)"
echo "GPUs: $N"
if [ "$N" -lt 1 ]; then
  echo "gpu-smoke: no GPU visible (nvidia-smi -L lists none)" >&2
  exit 1
fi

echo "== 1. digits on 1 GPU"
CUDA_VISIBLE_DEVICES=0 "$T/examples/digits" --min-accuracy 0.95

echo "== 2. NCCL collectives and fused CUDA optimizers, world size 1 (and 2 ranks over NCCL if there are 2 GPUs)"
CUDA_VISIBLE_DEVICES=0 "$T/accelerate-rs" test -n 1
if [ "$N" -ge 2 ]; then
  "$T/accelerate-rs" test -n 2
fi

echo "== 3. DP: one process, $N GPU replica(s)"
"$T/accelerate-rs" test --dp "$N"

echo "== 4. bf16 run of digits on 1 GPU"
CUDA_VISIBLE_DEVICES=0 "$T/examples/digits" --dtype bf16 --min-accuracy 0.93

echo "== 5. step time: raw Candle vs accelerate-rs on GPU 0 (MLP 784-1024-1024-10, batch 64)"
BENCH="$(ls -t "$T"/deps/overhead-* 2>/dev/null | grep -v '\.d$' | head -1 || true)"
if [ -z "$BENCH" ]; then
  echo "gpu-smoke: no overhead bench binary under $T/deps (cargo bench --features cuda --bench overhead --no-run)" >&2
  exit 1
fi
CUDA_VISIBLE_DEVICES=0 "$BENCH" --gpu

echo "gpu-smoke: all steps passed"
