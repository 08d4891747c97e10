#!/usr/bin/env bash
# Two ranks on ONE GPU over REAL NCCL, on the GPU machine (used by scripts/gpu-smoke.sh, step 15;
# runnable by hand):
#
#   scripts/gpu-two-hosts.sh [--expect REGEX]... [--each REGEX]... [--reject REGEX]... COMMAND [ARGS...]
#   scripts/gpu-two-hosts.sh --kill-rank R --kill-after REGEX COMMAND [ARGS...]
#
# NCCL refuses two ranks on one GPU of one host, but it tells hosts apart by NCCL_HOSTID: each
# rank here gets its own (accel-smoke-host-0 and -1), so to NCCL they are two hosts, joined over
# its socket transport on loopback (NCCL_SOCKET_IFNAME=lo; peer-to-peer, shared memory and
# InfiniBand off). accelerate-rs's placement keys a GPU by (NCCL_HOSTID or host, PCI bus id) the
# same way, so it picks NCCL instead of the host fallback. The real communicator, its
# asynchronous errors and its teardown run as on two machines.
#
# Both ranks run COMMAND on GPU 0 (CUDA_VISIBLE_DEVICES=0) with RANK/WORLD_SIZE/LOCAL_RANK/
# LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, as `accelerate-rs launch` would, but without the
# launcher, so that a failing rank's peer shows its own error instead of being stopped by the
# launcher. Each rank's output is printed after both ended, prefixed `[rank R] `; the exit status
# is the first non-zero one, else 1 when an --expect REGEX matches neither rank's output, an
# --each REGEX misses one rank's, or a --reject REGEX matches one (each failure printed as
# `gpu-two-hosts: ...`). With NCCL_DEBUG=INFO, NCCL prints `Destroy COMPLETE` for a communicator
# that was finalized and destroyed and `Abort COMPLETE` for an aborted one.
#
# With --kill-rank R --kill-after REGEX: once rank 0's output matches REGEX (at most 300 s),
# rank R gets SIGKILL; then the script waits for the other rank (at most its collective
# timeout, ACCELERATE_RS_TIMEOUT_SECS, plus 60 s) and passes (exit 0) only when it ended with an
# error (`Error: ...`) that names rank R, printing `kill -9 of rank R: rank S ended after N s with exit E,
# naming rank R`.
set -uo pipefail

kill_rank=""
kill_after=""
expect=()
each=()
reject=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kill-rank) kill_rank="$2"; shift 2 ;;
    --kill-after) kill_after="$2"; shift 2 ;;
    --expect) expect+=("$2"); shift 2 ;;
    --each) each+=("$2"); shift 2 ;;
    --reject) reject+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,33p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
if [ $# -eq 0 ]; then
  echo "gpu-two-hosts: no command (see --help)" >&2
  exit 2
fi
if [ -n "$kill_rank" ] && { [ -z "$kill_after" ] || ! [[ "$kill_rank" =~ ^[01]$ ]]; }; then
  echo "gpu-two-hosts: --kill-rank takes 0 or 1 and needs --kill-after REGEX" >&2
  exit 2
fi

logs="$(mktemp -d /tmp/accel-two-hosts.XXXXXX)"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT
trap 'cleanup; exit 143' TERM INT

for r in 0 1; do
  env CUDA_VISIBLE_DEVICES=0 RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" ACCELERATE_RS_SECRET=gpu-two-hosts \
    NCCL_HOSTID="accel-smoke-host-$r" NCCL_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1 \
    NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_NET=Socket \
    "$@" >"$logs/rank$r.log" 2>&1 &
  pids+=($!)
done

show() {
  for r in 0 1; do sed "s/^/[rank $r] /" "$logs/rank$r.log"; done
}

if [ -z "$kill_rank" ]; then
  rc=0
  for r in 0 1; do
    wait "${pids[$r]}"
    s=$?
    [ "$rc" -eq 0 ] && rc=$s
  done
  pids=()
  show
  for re in "${expect[@]}"; do
    if ! cat "$logs/rank0.log" "$logs/rank1.log" | grep -Eq "$re"; then
      echo "gpu-two-hosts: no rank printed /$re/"
      [ "$rc" -eq 0 ] && rc=1
    fi
  done
  for re in "${each[@]}"; do
    for r in 0 1; do
      if ! grep -Eq "$re" "$logs/rank$r.log"; then
        echo "gpu-two-hosts: rank $r did not print /$re/"
        [ "$rc" -eq 0 ] && rc=1
      fi
    done
  done
  for re in "${reject[@]}"; do
    for r in 0 1; do
      if grep -Eq "$re" "$logs/rank$r.log"; then
        echo "gpu-two-hosts: rank $r printed /$re/"
        [ "$rc" -eq 0 ] && rc=1
      fi
    done
  done
  [ "$rc" -eq 0 ] && echo "gpu-two-hosts: both ranks passed"
  exit "$rc"
fi

other=$((1 - kill_rank))
deadline=$((SECONDS + 300))
until grep -Eq "$kill_after" "$logs/rank0.log"; do
  if [ "$SECONDS" -ge "$deadline" ] || ! kill -0 "${pids[0]}" 2>/dev/null; then
    show
    echo "gpu-two-hosts: rank 0's output never matched /$kill_after/ (or it ended first)"
    exit 1
  fi
  sleep 0.2
done
kill -9 "${pids[$kill_rank]}"
wait "${pids[$kill_rank]}" 2>/dev/null
killed_at=$SECONDS
limit=$(( ${ACCELERATE_RS_TIMEOUT_SECS:-1800} + 60 ))
while kill -0 "${pids[$other]}" 2>/dev/null; do
  if [ $((SECONDS - killed_at)) -ge "$limit" ]; then
    show
    echo "gpu-two-hosts: rank $other still runs ${limit} s after rank $kill_rank was killed: it hangs"
    exit 1
  fi
  sleep 0.2
done
wait "${pids[$other]}"
s=$?
took=$((SECONDS - killed_at))
pids=()
show
# The program's error (`Error: ...`, as a Rust main returning an error prints it) names the rank.
if [ "$s" -ne 0 ] && grep -Eq "^Error: .*rank $kill_rank([^0-9]|$)" "$logs/rank$other.log"; then
  echo "kill -9 of rank $kill_rank: rank $other ended after $took s with exit $s, naming rank $kill_rank"
  exit 0
fi
echo "gpu-two-hosts: after kill -9 of rank $kill_rank, rank $other ended after $took s with exit $s without naming rank $kill_rank"
exit 1
