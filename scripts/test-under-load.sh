#!/usr/bin/env bash
# Runs the whole test suite while every core is kept busy, to find tests that depend on a quiet
# machine (timeouts too tight, races with a slow peer). Usage:
#
#     scripts/test-under-load.sh [RUNS] [BURNERS]
#
# RUNS: how many times to run `cargo test --workspace` (default 3); BURNERS: busy loops running
# beside it (default: the number of CPUs). Builds first without load, so that the runs measure the
# tests and not the compiler. Exits non-zero at the first failing run, keeping its log.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
burners="${2:-$(nproc)}"

cargo test --workspace --no-run --quiet

pids=()
stop() {
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
}
trap stop EXIT
for _ in $(seq 1 "$burners"); do
  (while :; do :; done) &
  pids+=("$!")
done

for r in $(seq 1 "$runs"); do
  log="$(mktemp -t test-under-load.XXXXXX)"
  start=$(date +%s)
  if cargo test --workspace >"$log" 2>&1; then
    echo "run $r/$runs: passed in $(( $(date +%s) - start )) s with $burners busy loops (load $(cut -d' ' -f1-3 /proc/loadavg))"
    rm -f "$log"
  else
    echo "run $r/$runs: FAILED after $(( $(date +%s) - start )) s; log: $log" >&2
    grep -E "^test .* FAILED|panicked at" "$log" | head -20 >&2 || true
    exit 1
  fi
done
