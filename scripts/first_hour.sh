#!/usr/bin/env bash
# The first hour, measured: from a fresh crate (`cargo new` + the README's dependency lines + the
# converted regression loop of examples/regression.rs) to a 2-process run,
#   A. with the self-launch (ACCELERATE_RS_NUM_PROCESSES=2 ./target/release/demo): one build;
#   B. with the launcher (`accelerate-rs launch --cpu -n 2 ...`): the same build, plus building
#      the accelerate-rs command line in this repository, which compiles Candle a second time.
# Every build starts from an empty target directory (the crates.io registry cache is reused, as
# on a machine that has built any Rust project). Prints a table of wall-clock times.
#
#     scripts/first_hour.sh [WORK_DIR]     # WORK_DIR defaults to a fresh temporary directory
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
unset CARGO_TARGET_DIR RANK WORLD_SIZE ACCELERATE_RS_NUM_PROCESSES
export CARGO_TERM_COLOR=never

now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.0f}')"; }

echo "== fresh crate in $work/demo"
rm -rf "$work/demo" "$work/launcher-target"
t0=$(now)
(cd "$work" && cargo new --quiet --bin demo)
cat >> "$work/demo/Cargo.toml" <<EOF
accelerate-rs = { path = "$repo" }
candle-core = "0.11"
candle-nn = "0.11"
anyhow = "1"
EOF
cp "$repo/examples/regression.rs" "$work/demo/src/main.rs"
# The repository's lock file: the same dependency versions as its own build (no other effect).
cp "$repo/Cargo.lock" "$work/demo/Cargo.lock"

echo "== A: cargo build --release (the user's crate)"
(cd "$work/demo" && cargo build --release --quiet)
t1=$(now)
echo "== A: ACCELERATE_RS_NUM_PROCESSES=2 target/release/demo"
(cd "$work/demo" && ACCELERATE_RS_NUM_PROCESSES=2 target/release/demo | tail -n 2)
t2=$(now)

echo "== B: cargo build --release -p accelerate-rs-cli (the launcher, in this repository)"
(cd "$repo" && CARGO_TARGET_DIR="$work/launcher-target" cargo build --release --quiet -p accelerate-rs-cli)
t3=$(now)
echo "== B: accelerate-rs launch --cpu -n 2 target/release/demo"
(cd "$work/demo" && "$work/launcher-target/release/accelerate-rs" launch --cpu -n 2 target/release/demo | tail -n 2)
t4=$(now)

cat <<EOF

| path to a 2-process run of one's own crate | build | run | total |
|---|---|---|---|
| A. self-launch (\`ACCELERATE_RS_NUM_PROCESSES=2 ./demo\`) | $(secs "$t0" "$t1") s | $(secs "$t1" "$t2") s | $(secs "$t0" "$t2") s |
| B. build the launcher too (\`accelerate-rs launch -n 2 ./demo\`) | $(secs "$t0" "$t1") + $(secs "$t2" "$t3") s | $(secs "$t3" "$t4") s | $(python3 -c "print(f'{($t1 - $t0) + ($t4 - $t2):.0f}')") s |
EOF
