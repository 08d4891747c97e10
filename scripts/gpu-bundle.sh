#!/usr/bin/env bash
# Builds the GPU proof bundle ON A MACHINE WITHOUT A GPU (this one, or CI): the `cuda` release
# binaries that scripts/gpu-smoke.sh runs on a GPU node that has only the driver, NVIDIA's CUDA 13
# libraries from pip and no Rust toolchain.
#
#   scripts/gpu-bundle.sh      # build (a no-op when up to date), strip, compress into gpu-bundle/
#
# What goes in: the launcher (accelerate-rs), the digits and transformer_lm examples (their data
# is inside them), the nn_kernels device check and the overhead bench (which also times
# transformer_lm's step for scripts/pytorch_lm_bench.py --gpu), built with `cuda`; from
# the models crate, the finetune, memory_bench, zero3_bench and hf_bench examples and the parity test binary (the
# Hugging Face parity checks against the committed golden files, run on the GPU); stripped, in
# one xz-compressed tar:
# gpu-bundle/accelerate-rs-gpu.tar.xz, with lib/libcupti_trace.so (scripts/cupti_trace.c, the
# kernel tracer of scripts/gpu_profile.py --tracer cupti) when it builds. Its size is printed,
# and the script fails when it is over $ACCEL_BUNDLE_LIMIT_MB (default 60 MiB, what the device
# tool carries with room to spare).
#
# Then, with the device tool: carry `gpu-bundle` and run `scripts/gpu-smoke.sh` there.
#
# Environment: CARGO_TARGET_DIR (default ~/.cache/accelerate-rs-cuda-target, shared with CI's cuda
# build so the CUDA kernels are compiled once), ACCEL_BUNDLE_DIR (default gpu-bundle),
# ACCEL_BUNDLE_LIMIT_MB, ACCEL_BUNDLE_BINARIES (pack these files instead of building; tests use
# it), ACCEL_CUDA_TOOLCHAIN (default ../shared/tools/cuda-toolchain.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

for a in "$@"; do
  case "$a" in
    -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu-bundle: unknown argument: $a (see --help)" >&2; exit 2 ;;
  esac
done

out="${ACCEL_BUNDLE_DIR:-gpu-bundle}"
limit_mb="${ACCEL_BUNDLE_LIMIT_MB:-60}"
case "$limit_mb" in
  ''|*[!0-9]*) echo "gpu-bundle: ACCEL_BUNDLE_LIMIT_MB=$limit_mb is not a whole number of MiB" >&2; exit 2 ;;
esac
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/accelerate-rs-cuda-target}"

# The binaries to pack: given, or built now (cargo reports each executable's path).
bins=()
if [ -n "${ACCEL_BUNDLE_BINARIES:-}" ]; then
  read -r -a bins <<<"$ACCEL_BUNDLE_BINARIES"
else
  toolchain="${ACCEL_CUDA_TOOLCHAIN:-../shared/tools/cuda-toolchain.sh}"
  if [ ! -f "$toolchain" ]; then
    echo "gpu-bundle: $toolchain is missing: it provides nvcc and the link stubs for the cuda build" >&2
    exit 1
  fi
  cargo fetch --quiet
  # shellcheck disable=SC1090
  source "$toolchain"
  # A cuda build has the nn kernels (on unless ACCELERATE_RS_NN_CUDA=0; gpu-smoke.sh proves them
  # with the nn_kernels example).
  cargo_args=(build --release --features cuda --bin accelerate-rs --example digits
              --example transformer_lm --example nn_kernels --bench overhead)
  echo "gpu-bundle: cargo ${cargo_args[*]} (CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
  json="$(mktemp)"
  trap 'rm -f "$json"' EXIT
  cargo "${cargo_args[@]}" --message-format=json-render-diagnostics >"$json"
  # The models crate's GPU steps (same accelerate-rs features, so its build is reused).
  models_args=(-p accelerate-rs-models --release --features cuda)
  echo "gpu-bundle: cargo build ${models_args[*]} --example finetune --example memory_bench --example zero3_bench --example hf_bench; cargo test --no-run ... --test parity"
  cargo build "${models_args[@]}" --example finetune --example memory_bench --example zero3_bench --example hf_bench \
    --message-format=json-render-diagnostics >>"$json"
  cargo test "${models_args[@]}" --test parity --no-run --message-format=json-render-diagnostics >>"$json"
  while IFS= read -r exe; do bins+=("$exe"); done < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])
' "$json")
fi
# scripts/cupti_trace.c as a shared library (scripts/gpu_profile.py --tracer cupti), against
# CUPTI 13.0's headers (the wheel PyTorch's cu130 build uses; downloaded once next to the
# toolchain). Optional: a warning when it cannot be built, and the bundle goes without it.
cupti_trace() {
  local dir="${ACCEL_CUDA_HOME:-$HOME/.cache/accel-cuda-13.0}/cupti-13.0.85" wh
  if [ ! -f "$dir/nvidia/cu13/include/cupti.h" ]; then
    wh="$(mktemp -d)"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$wh" nvidia-cuda-cupti==13.0.85 \
      && rm -rf "$dir.tmp" && python3 -m zipfile -e "$wh"/*.whl "$dir.tmp" && mv "$dir.tmp" "$dir"
    rm -rf "$wh"
  fi
  gcc -O2 -Wall -shared -fPIC -I "${CUDA_HOME:-}/include" -I "$dir/nvidia/cu13/include" \
    scripts/cupti_trace.c -L "$dir/nvidia/cu13/lib" -l:libcupti.so.13 -lpthread -o "$1"
}
if [ "${#bins[@]}" -eq 0 ]; then
  echo "gpu-bundle: no binaries to pack" >&2
  exit 1
fi

stage="$(mktemp -d)"
trap 'rm -rf "$stage" "$stage.tar"; rm -f "${json:-}"' EXIT
mkdir -p "$stage/bin"
for b in "${bins[@]}"; do
  if [ ! -f "$b" ]; then
    echo "gpu-bundle: $b does not exist" >&2
    exit 1
  fi
  name="$(basename "$b")"
  # Cargo names bench and test binaries overhead-<hash>, parity-<hash>; the bundle drops the hash.
  case "$name" in overhead-*) name=overhead ;; parity-*) name=parity ;; esac
  cp "$b" "$stage/bin/$name"
  strip "$stage/bin/$name" 2>/dev/null || echo "gpu-bundle: warning: could not strip $name; packed as is" >&2
done
if [ -z "${ACCEL_BUNDLE_BINARIES:-}" ]; then
  mkdir -p "$stage/lib"
  if cupti_trace "$stage/lib/libcupti_trace.so"; then
    strip --strip-unneeded "$stage/lib/libcupti_trace.so" 2>/dev/null || true
  else
    echo "gpu-bundle: warning: the CUPTI tracer (scripts/cupti_trace.c) was not built;" \
      "packed without it" >&2
    rm -rf "$stage/lib"
  fi
fi
git rev-parse HEAD >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"
mkdir -p "$out"
tarball="$out/accelerate-rs-gpu.tar.xz"
# The binaries share most of their bytes (Candle's CUDA kernels, the library): a dictionary as
# large as the tar (up to 192 MiB) lets xz store them once, about a quarter of the size of the
# default 8 MiB window (12.6 instead of 53.2 MiB for the eight binaries; ~2 GiB of memory to
# compress, the dictionary's size to unpack).
tar -C "$stage" -cf "$stage.tar" bin COMMIT $( [ -d "$stage/lib" ] && echo lib )
tar_bytes="$(stat -c %s "$stage.tar")"
dict_mib=$(( (tar_bytes >> 20) + 1 ))
[ "$dict_mib" -gt 192 ] && dict_mib=192
xz -9 --lzma2=dict="${dict_mib}MiB" -c "$stage.tar" >"$tarball.tmp"
rm -f "$stage.tar"
mv "$tarball.tmp" "$tarball"
bytes="$(stat -c %s "$tarball")"
mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
echo "gpu-bundle: $tarball: $mib MiB ($bytes bytes) for:$(cd "$stage/bin" && printf ' %s' *)$( [ -d "$stage/lib" ] && cd "$stage/lib" && printf ' lib/%s' *)"
if [ "$bytes" -gt $((limit_mb * 1048576)) ]; then
  echo "gpu-bundle: error: the bundle is $mib MiB, over the limit of $limit_mb MiB (ACCEL_BUNDLE_LIMIT_MB)" >&2
  exit 1
fi
