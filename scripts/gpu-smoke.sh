#!/usr/bin/env bash
# GPU proof in one command, ON THE GPU MACHINE (driver, NVIDIA's CUDA 13 libraries from pip, no
# Rust needed). Build the bundle elsewhere first with scripts/gpu-bundle.sh, bring the repository
# with its gpu-bundle/ folder, then:
#
#   scripts/gpu-smoke.sh [SUMMARY_FILE]    # default: $OUT/gpu-smoke-summary.txt, else ./gpu-smoke-summary.txt
#
# Steps (each prints PASS or FAIL with its time; a failure does not stop the others):
#   1. digits on 1 GPU, test accuracy >= 0.95
#   2. real NCCL collectives at world size 1 (all_reduce, broadcast, all_gather in f32/bf16/f16,
#      results and call count checked), fused CUDA AdamW/SGD kernels launched and equal to the
#      unfused path within 1e-5: `accelerate-rs test -n 1`
#   2b. the same with the trial kernels on (ACCELERATE_RS_CUDA_TRIAL=1): the gradients'
#      finiteness check is one kernel per gradient into one flag, and a NaN, +inf or -inf in
#      f32, bf16 and f16 gradients still stops the step
#  15. (run right after step 2: the most valuable proof of issue 38) two ranks on ONE GPU over
#      REAL NCCL at world size 2 (scripts/gpu-two-hosts.sh: a distinct NCCL_HOSTID per rank makes
#      them two hosts to NCCL, joined by its socket transport on loopback; the placement follows
#      NCCL_HOSTID and picks NCCL), in order of value:
#      15a. `accelerate-rs test-worker` on both: every collective on GPU tensors through NCCL,
#           DDP steps equal to a 1-rank reference, find_executable_batch_size's Min vote (the
#           last rank runs out), fused optimizers; both communicators destroyed, none aborted
#      15b. kill -9 of rank 1 mid-training (transformer_lm): rank 0 ends with an error naming
#           rank 1 within the collective timeout (NCCL's asynchronous error, the peer named by
#           the host collective), no hang
#      15c. digits, DDP over NCCL (>= 0.95), both communicators destroyed
#      15d. transformer_lm on 2 ranks x batch 8 equals 1 rank x batch 16 (held-out loss within
#           2e-3 relative after 40 steps)
#      15e. ZeRO stages 1, 2 and 3 over NCCL (reduce_scatter/all_gather_into of the device
#           slices; at stage 3 the parameters sharded too), the DDP check equal to the reference
#      15f. fp16 loss scaling where only rank 1 overflows: every rank skips and halves the scale
#      15g. LoRA r=8 fine-tuning over NCCL (only the adapters are trainable, so only they are
#           all-reduced), then peft loads the adapters with the same logits
#      15h. find_executable_batch_size from a batch far too big with both ranks on the GPU: real
#           CUDA out-of-memory errors (in a forward pass or while allocating an NCCL output)
#           become retries on both ranks
#      15i. ZeRO stage 3 with the optimizer offloaded (ACCELERATE_RS_OFFLOAD_OPTIMIZER=1: the
#           shards' f32 masters and optimizer state in host memory, stepped by the CPU AdamW)
#      DP (one process, two threads, two communicators on one device) cannot run NCCL: NCCL_HOSTID
#      is read once per process, so both communicators would be one host with one GPU twice,
#      which NCCL refuses; DP on one GPU takes the host path (step 3).
#   3. DP, 2 replicas sharing GPU 0 (host fallback), equal to a 1-rank reference: `test --dp 2`
#   4. DDP, 2 processes sharing GPU 0 (host fallback), equal to a 1-rank reference: `test -n 2`
#      (plus `test -n <GPUs>` over NCCL when the machine has 2 or more)
#   4d-4h. ZeRO stages 1, 2 (and 3 at 4d/4e) on GPU tensors (ACCELERATE_RS_ZERO_STAGE): the DDP check (momentum
#      SGD equal to a 1-rank reference) at world size 1, with 2 processes sharing GPU 0 and with
#      2 DP replicas sharing it; step 2 already ran NCCL's reduce_scatter and all_gather_into
#   5. digits in bf16 on 1 GPU, accuracy >= 0.93
#   6. transformer_lm: 50 steps with a checkpoint at step 25 and 50, then a resume to step 60
#   7. step time, raw Candle vs accelerate-rs on GPU 0: the MLP and transformer_lm's model (the
#      raw side on accelerate-rs's device and on a `Device::new_cuda(0)` of its own), 16 blocks
#      of 20 steps each (the transformer's 2 blocks of `--quick` read -2% to +4% from call to call)
#   8. accelerate_rs::nn's CUDA kernels (in every cuda build) against the CPU path: every op, f32,
#      bf16 and f16, forward and backward, within the dtype's tolerance, kernels really launched;
#      then their time against the composed ops (examples/nn_kernels.rs)
#   9. transformer_lm 30 steps with the nn CUDA kernels on
#  10. PyTorch eager vs accelerate-rs (composed ops, and nn CUDA kernels) on transformer_lm's model
#      on GPU 0, one table: scripts/pytorch_lm_bench.py --gpu (the device's python3 has torch)
#  11. the Hugging Face parity tests on GPU 0: every architecture's logits, loss, every gradient
#      and 3 AdamW steps against the committed golden files of `transformers` (issue 24)
#  12. the fine-tuning example on GPU 0: tiny-llama 100 steps, then `transformers` loads the
#      folder with the same logits; LoRA r=8 with activation checkpointing, then `peft` loads the
#      adapters and `transformers` the merged folder (the device's python3 has both); bf16
#      mixed precision (f32 masters) checked the same way; on 2+ GPUs also DDP over NCCL
#  13. peak GPU memory and step time: full fine-tuning, activation checkpointing, LoRA, both
#      (models' memory_bench, the GPU pool's high-water mark) beside estimate-memory's prediction
#  14. find_executable_batch_size from a batch far too big: CUDA's out-of-memory errors become
#      retries at half the size until a step runs (issue 27). Batch 3000 x 256 tokens needs about
#      200 GiB, while its largest tensor (the attention scores) stays under 2^31 elements, so the
#      first failure is running out of memory, not an index overflow in a kernel.
#  16. ZeRO-3 on the GPU (issue 34): zero3_bench's 42M-parameter Llama-style folder trained on 2
#      ranks over NCCL (as step 15) at stage 0, stage 3 and stage 3 with the optimizer offloaded;
#      the device pool's peak per rank, passing when stage 3 peaks below stage 0 and offload
#      below stage 3.
#  17. speed at a size people fine-tune (issue 38): a 250M-parameter Llama in bf16 at sequence
#      1024 on GPU 0, `transformers` (SDPA, PyTorch eager) against accelerate-rs with the nn CUDA
#      kernels (the default), with Candle's composed ops, with the trial kernels
#      (ACCELERATE_RS_CUDA_TRIAL=1) and with flash attention's kernel; tokens/s, MFU and peak
#      memory in one table (scripts/pytorch_hf_bench.py --gpu, the bundle's hf_bench)
#  18. where step 17's GPU time goes, one warm-up and one step each side, kernels grouped by name
#      with their time and share, and the matrix products against the rest (scripts/gpu_profile.py):
#      18a with CUPTI's activity API (the bundle's lib/libcupti_trace.so; the programs run at
#      their own pace, also on gVisor; runs of 1 and 3 steps, so one step's kernels and the span
#      the GPU was busy come without set-up and warm-up), 18b under Nsight Compute
# Steps 1-7 and 11-14 run as a user's program does: with the nn CUDA kernels on (the default of a
# cuda build); `ACCELERATE_RS_NN_CUDA=0 scripts/gpu-smoke.sh` proves them on Candle's composed
# ops instead. Steps 8 and 9 always switch the kernels on; step 10 times both paths. Step 8 also
# switches on flash attention's kernels (ACCELERATE_RS_NN_CUDA_FLASH=1, off by default: slower
# than the composed attention at training sizes) to keep proving them, and the trial kernels
# (ACCELERATE_RS_CUDA_TRIAL=1, off by default until step 8 has passed with them on a GPU:
# the embedding's gradient); step 17 times them in a row of their own.
# ACCEL_SMOKE_ONLY="8 9 10" runs only the steps whose number is listed ("18a": that one step of 18) (e.g. to split the run over
# several device calls of at most 10 minutes each). With one short loan, run the proofs first and
# the timings after: ACCEL_SMOKE_ONLY="2 15" (NCCL at world sizes 1 and 2, about 6 minutes), then
# "1 3 4 6 8 11 12 14" (correctness, including the kernels, the models and the CUDA
# out-of-memory retry), then "5 7 9 10 13 16" (bf16 digits, step times, the PyTorch table, peak
# memory, ZeRO-3's peak memory).
# The summary file gets one line per step plus the figures that matter; bring it back.
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
summary="${1:-${OUT:-.}/gpu-smoke-summary.txt}"
bundle="${ACCEL_GPU_BUNDLE:-gpu-bundle/accelerate-rs-gpu.tar.xz}"
work="$(mktemp -d /tmp/accel-smoke.XXXXXX)"
: >"$summary"
say() { echo "$*" | tee -a "$summary"; }

if [ ! -f "$bundle" ]; then
  say "FAIL setup: $bundle not found (build it with scripts/gpu-bundle.sh on a machine with Rust, carry gpu-bundle/)"
  exit 1
fi
tar -C "$work" -xJf "$bundle" || { say "FAIL setup: cannot unpack $bundle"; exit 1; }
B="$work/bin"
say "gpu-smoke: bundle of commit $(cat "$work/COMMIT" 2>/dev/null), unpacked in $work"
# shellcheck disable=SC1091
if ! source "$repo/scripts/gpu-env.sh"; then
  say "FAIL setup: scripts/gpu-env.sh could not set up the CUDA libraries (see above)"
  exit 1
fi
# Count the GPUs the way the programs will (after CUDA_VISIBLE_DEVICES, no MIG lines).
N="$("$B/accelerate-rs" env --gpus 2>"$work/gpus.err")" || N=0
say "gpu-smoke: GPUs seen by the binaries: $N; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
if [ "$N" -lt 1 ]; then
  say "FAIL setup: no GPU visible to the binaries: $(cat "$work/gpus.err")"
  exit 1
fi

passed=0
failed=0
# step NAME LIMIT_SECONDS PATTERN COMMAND...: runs COMMAND (in $work, output to a log), passes when
# it exits 0 and its output matches PATTERN (an extended regex; empty: no check).
step() {
  local name="$1" limit="$2" pattern="$3"
  shift 3
  if [ -n "${ACCEL_SMOKE_ONLY:-}" ]; then
    local label="${name%%.*}" number wanted=""
    number="${label%%[a-z]*}"
    for n in $ACCEL_SMOKE_ONLY; do [ "$n" = "$number" ] || [ "$n" = "$label" ] && wanted=1; done
    [ -n "$wanted" ] || return 0
  fi
  local log="$work/$(echo "$name" | tr -c 'A-Za-z0-9' '_').log" start end rc
  start=$(date +%s.%N)
  (cd "$work" && timeout --kill-after=10 "$limit" "$@") >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ] && { [ -z "$pattern" ] || grep -Eq "$pattern" "$log"; }; then
    say "PASS $name (${secs}s)"
    passed=$((passed + 1))
  else
    say "FAIL $name (${secs}s, exit $rc$([ "$rc" -eq 124 ] && echo ", timed out after ${limit}s"))"
    tail -n 15 "$log" | sed 's/^/    /' | tee -a "$summary"
    failed=$((failed + 1))
  fi
  # The figures worth keeping.
  grep -E "final test accuracy|ok: |skipped: |PASSED|FAILED|resumed from|overhead of|paired per round|\| (candle|accelerate-rs|PyTorch|implementation|composed|kernels|op |[a-z_]+ \[|configuration|plain|ckpt|lora|lora-ckpt) |^(PASS|FAIL) |nn_kernels:|RESULT-LM-GPU|warning: (ranks|DP replicas)|trained [0-9]+ steps|saved |test result|panicked|logits diff|find_executable_batch_size on|peak x|Llama-style|kill -9 of rank|gpu-two-hosts: |2 ranks x 8 over NCCL|zero3 on the GPU|\\| transformers|^llama on|round [0-9]+/[0-9]+ |gpu_profile: total|gpu_profile: span|gpu_profile: mem|kernel launches, |\| [0-9.]+ \| [0-9.e+]+ \| [0-9.]+% \|$" "$log" \
    | sed 's/^/    /' >>"$summary" || true
}

export RUST_LOG="${RUST_LOG:-warn}"
# The nn CUDA kernels: on (a cuda build's default) unless the caller says otherwise.
say "gpu-smoke: nn CUDA kernels: ${ACCELERATE_RS_NN_CUDA:+ACCELERATE_RS_NN_CUDA=}${ACCELERATE_RS_NN_CUDA:-on (the default)}"
step "1. digits on 1 GPU (>= 0.95)" 240 "final test accuracy" \
  env CUDA_VISIBLE_DEVICES=0 "$B/digits" --min-accuracy 0.95
step "2. NCCL at world size 1 + fused CUDA optimizers" 240 "NCCL calls on a one-rank communicator" \
  env CUDA_VISIBLE_DEVICES=0 "$B/accelerate-rs" test -n 1
# 15 launches expected: per dtype, the finite step's check and SGD update, and one check for each
# of the three non-finite steps (3 without the trial kernel: the SGD updates alone); at least 10.
step "2b. the trial finiteness kernel: NaN/inf stop the step (ACCELERATE_RS_CUDA_TRIAL=1)" 240 \
  "stop the step; ([1-9][0-9]|[1-9][0-9][0-9]+) CUDA kernel launches" \
  env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_CUDA_TRIAL=1 "$B/accelerate-rs" test -n 1
# Step 15: two ranks on GPU 0, each its own host to NCCL (see the header and gpu-two-hosts.sh).
two="$repo/scripts/gpu-two-hosts.sh"
step "15a. 2 ranks on GPU 0 over real NCCL: accelerate-rs test-worker" 300 "both ranks passed" \
  env NCCL_DEBUG=INFO "$two" --expect "GPU tensors.*\(through nccl\)" \
  --expect "ok: DDP steps equal" --expect "ok: find_executable_batch_size" \
  --expect "Using network Socket|NET/Socket" --each "Destroy COMPLETE" \
  --reject "Abort COMPLETE" --reject "FAILED" "$B/accelerate-rs" test-worker
step "15b. kill -9 of rank 1 mid-training: rank 0 names it within the timeout" 300 \
  "kill -9 of rank 1: rank 0 ended after" \
  env ACCELERATE_RS_TIMEOUT_SECS=60 "$two" --kill-rank 1 --kill-after "step +5/" \
  "$B/transformer_lm" --max-steps 100000 --log-every 1 --checkpoint-every 0 \
  --log-dir "$work/lm-kill"
step "15c. digits, DDP over NCCL on GPU 0 (>= 0.95)" 300 "both ranks passed" \
  env NCCL_DEBUG=INFO "$two" --expect "final test accuracy" --each "Destroy COMPLETE" \
  --reject "Abort COMPLETE" "$B/digits" --min-accuracy 0.95
step "15d. transformer_lm: 2 ranks x 8 over NCCL equal 1 rank x 16" 400 "2 ranks x 8 over NCCL" \
  bash -c 'lm=(--max-steps 40 --log-every 20 --checkpoint-every 0 --eval-batches 0)
    CUDA_VISIBLE_DEVICES=0 "$1" "${lm[@]}" --batch-size 16 --log-dir "$3/lm-1x16" >"$3/lm-1x16.log" 2>&1 || exit 1
    "$2" "$1" "${lm[@]}" --batch-size 8 --log-dir "$3/lm-2x8" >"$3/lm-2x8.log" 2>&1 || { cat "$3/lm-2x8.log"; exit 1; }
    a=$(grep -o "held-out loss [0-9.]*" "$3/lm-1x16.log" | tail -1 | cut -d" " -f3)
    b=$(grep -o "held-out loss [0-9.]*" "$3/lm-2x8.log" | tail -1 | cut -d" " -f3)
    awk -v a="$a" -v b="$b" "BEGIN { if (a == \"\" || b == \"\") exit 1; d = (a > b ? a - b : b - a) / a;
      printf \"transformer_lm, 40 steps: held-out loss %s on 1 rank x 16, %s on 2 ranks x 8 over NCCL (relative difference %.1e)\\n\", a, b, d;
      exit d > 2e-3 }"' _ "$B/transformer_lm" "$two" "$work"
for stage in 1 2 3; do
  step "15e. ZeRO stage $stage over NCCL, 2 ranks on GPU 0" 300 "both ranks passed" \
    env ACCELERATE_RS_ZERO_STAGE=$stage "$two" --expect "zero_stage $stage: sharded true" \
    --expect "GPU tensors.*\(through nccl\)" "$B/accelerate-rs" test-worker
done
step "15i. ZeRO stage 3 with the optimizer offloaded to host memory, over NCCL, 2 ranks on GPU 0" \
  300 "both ranks passed" \
  env ACCELERATE_RS_ZERO_STAGE=3 ACCELERATE_RS_OFFLOAD_OPTIMIZER=1 "$two" \
  --expect "zero_stage 3: sharded true" "$B/accelerate-rs" test-worker
step "15f. fp16 loss scaling over NCCL, overflow on rank 1 only" 300 "both ranks passed" \
  env ACCELERATE_RS_MIXED_PRECISION=fp16 "$two" \
  --expect "ok: fp16 loss scaling.*rank 1 overflowed: every rank skipped" \
  "$B/accelerate-rs" test-worker
step "15g. LoRA r=8 over NCCL (adapters all-reduced), peft loads the adapters" 400 \
  "logits diff.*: OK" \
  bash -c '"$1" "$2" --model "$4" --train "$5" --max-steps 60 --seq-len 64 --batch-size 4 \
      --lr 1e-2 --lora-r 8 --output "$3/ft-lora-nccl" --probe "$3/ft-lora-nccl.probe" &&
    python3 "$6" check-adapter "$3/ft-lora-nccl" --base "$4" --probe "$3/ft-lora-nccl.probe"' \
  _ "$two" "$B/finetune" "$work" "$repo/models/examples/tiny-llama" "$repo/data/corpus.txt" \
  "$repo/scripts/hf_reference.py"
step "15h. find_executable_batch_size, 2 ranks on GPU 0: CUDA out-of-memory errors become retries" \
  400 "out-of-memory retries: [1-9]" \
  "$two" "$B/memory_bench" --find-batch-size 3000 --seq 256 --vocab 1000

step "3. DP, 2 replicas sharing GPU 0" 240 "PASSED" \
  env CUDA_VISIBLE_DEVICES=0 "$B/accelerate-rs" test --dp 2
step "4. DDP, 2 processes sharing GPU 0" 240 "PASSED" \
  env CUDA_VISIBLE_DEVICES=0 "$B/accelerate-rs" test -n 2
if [ "$N" -ge 2 ]; then
  step "4b. DDP over NCCL, $N processes on $N GPUs" 240 "PASSED" "$B/accelerate-rs" test -n "$N"
  step "4c. DP over NCCL, $N replicas on $N GPUs" 240 "PASSED" "$B/accelerate-rs" test --dp "$N"
fi
for stage in 1 2 3; do
  step "4d. ZeRO stage $stage at world size 1 on GPU 0" 240 "zero_stage $stage: sharded true" \
    env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_ZERO_STAGE=$stage "$B/accelerate-rs" test -n 1
  step "4e. ZeRO stage $stage, 2 processes sharing GPU 0" 240 "zero_stage $stage: sharded true" \
    env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_ZERO_STAGE=$stage "$B/accelerate-rs" test -n 2
done
step "4f. ZeRO stage 1, 2 DP replicas sharing GPU 0" 240 "zero_stage 1: sharded true" \
  env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_ZERO_STAGE=1 "$B/accelerate-rs" test --dp 2
if [ "$N" -ge 2 ]; then
  step "4g. ZeRO stage 2 over NCCL, $N processes on $N GPUs" 240 "zero_stage 2: sharded true" \
    env ACCELERATE_RS_ZERO_STAGE=2 "$B/accelerate-rs" test -n "$N"
fi
step "5. digits in bf16 on 1 GPU (>= 0.93)" 240 "final test accuracy" \
  env CUDA_VISIBLE_DEVICES=0 "$B/digits" --dtype bf16 --min-accuracy 0.93
step "6a. transformer_lm 50 steps with checkpoints" 300 "trained 50 steps" \
  env CUDA_VISIBLE_DEVICES=0 "$B/transformer_lm" --max-steps 50 --checkpoint-every 25 \
  --log-every 25 --log-dir "$work/lm"
step "6b. transformer_lm resumed at step 50 to 60" 300 "resumed from .* at step 50" \
  env CUDA_VISIBLE_DEVICES=0 "$B/transformer_lm" --max-steps 60 --checkpoint-every 25 \
  --log-every 5 --log-dir "$work/lm" --resume
step "7a. step time, raw Candle vs accelerate-rs: MLP" 300 "overhead of accelerate-rs" \
  env CUDA_VISIBLE_DEVICES=0 "$B/overhead" --gpu
step "7b. step time, raw Candle vs accelerate-rs: transformer_lm model" 300 "overhead of accelerate-rs" \
  env CUDA_VISIBLE_DEVICES=0 "$B/overhead" --gpu --model transformer
step "8. nn CUDA kernels equal the CPU path (f32/bf16/f16, forward and backward)" 300 \
  "nn_kernels: [0-9]+ passed, 0 failed" \
  env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_NN_CUDA=1 ACCELERATE_RS_NN_CUDA_FLASH=1 \
  ACCELERATE_RS_CUDA_TRIAL=1 "$B/nn_kernels"
step "9. transformer_lm 30 steps with the nn CUDA kernels" 300 "trained 30 steps" \
  env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_NN_CUDA=1 "$B/transformer_lm" --max-steps 30 \
  --log-every 10 --log-dir "$work/lm-kernels"
step "10. PyTorch eager vs accelerate-rs on transformer_lm's model, 1 GPU" 600 "\| PyTorch eager" \
  env CUDA_VISIBLE_DEVICES=0 python3 "$repo/scripts/pytorch_lm_bench.py" --gpu --runs 2 --steps 40 \
  --rust-cmd "$B/overhead --lm-gpu"

# The models crate (issues 24 and 27).
export ACCELERATE_RS_MODELS_FIXTURES="$repo/models/tests/fixtures"
tiny="$repo/models/examples/tiny-llama"
corpus="$repo/data/corpus.txt"
ft=(--model "$tiny" --train "$corpus" --max-steps 100 --seq-len 64 --batch-size 8)
step "11. Hugging Face parity on GPU 0 (every architecture against transformers' golden files)" 300 \
  "test result: ok. [0-9]+ passed; 0 failed" \
  env CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_TEST_DEVICE=cuda "$B/parity" matches_transformers \
  --test-threads 1
step "12a. finetune tiny-llama on GPU 0" 300 "held-out loss" \
  env CUDA_VISIBLE_DEVICES=0 "$B/finetune" "${ft[@]}" --lr 1e-3 --output "$work/ft" \
  --probe "$work/ft.probe"
step "12b. transformers loads the fine-tuned folder with the same logits" 300 "logits diff.*: OK" \
  python3 "$repo/scripts/hf_reference.py" check "$work/ft" --probe "$work/ft.probe"
step "12c. finetune with LoRA r=8 and activation checkpointing on GPU 0, merged" 300 \
  "saved the merged model" \
  env CUDA_VISIBLE_DEVICES=0 "$B/finetune" "${ft[@]}" --lr 1e-2 --lora-r 8 \
  --checkpoint-activations --output "$work/ft-lora" --merge "$work/ft-merged" \
  --probe "$work/ft-lora.probe"
step "12d. peft loads the adapters, transformers the merged folder, same logits" 300 \
  "merged.*logits diff.*: OK" \
  bash -c 'python3 "$1" check-adapter "$2/ft-lora" --base "$3" --probe "$2/ft-lora.probe" &&
    python3 "$1" check "$2/ft-merged" --probe "$2/ft-lora.probe"' \
  _ "$repo/scripts/hf_reference.py" "$work" "$tiny"
step "12e. finetune in bf16 mixed precision on GPU 0 (f32 masters), transformers loads it" 300 \
  "logits diff.*: OK" \
  bash -c 'CUDA_VISIBLE_DEVICES=0 ACCELERATE_RS_MIXED_PRECISION=bf16 "$1" "${@:4}" --lr 1e-3 \
    --output "$2/ft-bf16" --probe "$2/ft-bf16.probe" && python3 "$3" check "$2/ft-bf16" --probe "$2/ft-bf16.probe"' \
  _ "$B/finetune" "$work" "$repo/scripts/hf_reference.py" "${ft[@]}"
if [ "$N" -ge 2 ]; then
  step "12f. finetune, DDP over NCCL on $N GPUs" 300 "held-out loss" \
    "$B/accelerate-rs" launch -n "$N" "$B/finetune" "${ft[@]}" --lr 1e-3 --output "$work/ft-ddp"
fi
step "13. peak GPU memory and step time: plain, checkpointing, LoRA (memory_bench)" 600 \
  "\| ckpt \|" \
  env CUDA_VISIBLE_DEVICES=0 "$B/memory_bench" --rounds 1 --steps 3 --warmup 1
step "14. find_executable_batch_size: CUDA out-of-memory errors become retries" 300 \
  "out-of-memory retries: [1-9]" \
  env CUDA_VISIBLE_DEVICES=0 "$B/memory_bench" --find-batch-size 3000 --seq 256 --vocab 1000
step "16. ZeRO-3 on GPU 0: a 42M Llama, 2 ranks over NCCL, stages 0 / 3 / 3 + offload, peak device memory" \
  600 "zero3 on the GPU: stage 3 peak" \
  bash -c 'set -e
    "$1" --make "$2/llama-42m" >/dev/null
    for run in "0 0" "3 0" "3 1"; do
      read -r stage off <<<"$run"
      ACCELERATE_RS_ZERO_STAGE=$stage ACCELERATE_RS_OFFLOAD_OPTIMIZER=$off "$3" "$1" \
        --model "$2/llama-42m" --steps 3 --batch 4 --seq 512 >"$2/z3-$stage-$off.log" 2>&1 \
        || { cat "$2/z3-$stage-$off.log"; exit 1; }
      line=$(grep -o "rank=0 world=2 .*" "$2/z3-$stage-$off.log" | tail -1)
      [ -n "$line" ] || { cat "$2/z3-$stage-$off.log"; exit 1; }
      echo "zero3 on the GPU: stage $stage offload $off: $line"
    done
    p0=$(grep -o "rank=0 world=2 .*" "$2/z3-0-0.log" | grep -o "device_peak=[0-9]*" | cut -d= -f2)
    p3=$(grep -o "rank=0 world=2 .*" "$2/z3-3-0.log" | grep -o "device_peak=[0-9]*" | cut -d= -f2)
    p3o=$(grep -o "rank=0 world=2 .*" "$2/z3-3-1.log" | grep -o "device_peak=[0-9]*" | cut -d= -f2)
    awk -v a="$p0" -v b="$p3" -v c="$p3o" "BEGIN { if (a == \"\" || b == \"\" || c == \"\") exit 1;
      printf \"zero3 on the GPU: stage 3 peak %.0f MiB (%.2fx stage 0 %.0f MiB), with offload %.0f MiB (%.2fx)\\n\",
        b / 2^20, b / a, a / 2^20, c / 2^20, c / a; exit (b >= a || c >= b) }"' \
  _ "$B/zero3_bench" "$work" "$two"

step "17. a 250M Llama in bf16 at sequence 1024: transformers vs accelerate-rs on GPU 0" 400 \
  "RESULT-HF-GPU done" \
  env CUDA_VISIBLE_DEVICES=0 python3 "$repo/scripts/pytorch_hf_bench.py" --gpu --runs 2 --steps 10 \
  --warmup 3 --rust-bin "$B/hf_bench"

step "18a. where a 250M Llama's GPU step goes, kernel by kernel: transformers and accelerate-rs (CUPTI)" \
  400 "gpu_profile: total .*accelerate-rs" \
  bash -c 'set -e
    p=(python3 "$1/scripts/gpu_profile.py" --tracer cupti --cupti-lib "$3/../lib/libcupti_trace.so"
       --per-step 1,3)
    CUDA_VISIBLE_DEVICES=0 "${p[@]}" --label transformers --top 25 --torch
    CUDA_VISIBLE_DEVICES=0 "${p[@]}" --label accelerate-rs --top 40 -- "$2" --dtype bf16 \
      --steps "{steps}" --warmup 1 --vocab 32000 --hidden 1024 --intermediate 2816 --layers 16 \
      --heads 16 --kv-heads 8 --seq 1024 --batch 4' \
  _ "$repo" "$B/hf_bench" "$B"

step "18b. where a 250M Llama's GPU step goes, kernel by kernel: transformers and accelerate-rs (ncu)" \
  500 "gpu_profile: total .*accelerate-rs" \
  bash -c 'set -e
    CUDA_VISIBLE_DEVICES=0 python3 "$1/scripts/gpu_profile.py" --label transformers --top 20 --torch
    CUDA_VISIBLE_DEVICES=0 python3 "$1/scripts/gpu_profile.py" --label accelerate-rs --top 40 -- \
      "$2" --dtype bf16 --steps 1 --warmup 1 --vocab 32000 --hidden 1024 --intermediate 2816 \
      --layers 16 --heads 16 --kv-heads 8 --seq 1024 --batch 4' _ "$repo" "$B/hf_bench"

say "gpu-smoke: $passed passed, $failed failed (logs in $work)"
[ "$failed" -eq 0 ]
