#!/usr/bin/env bash
# Builds compactor with profile-guided optimisation: an instrumented build
# serves a training load (the benchmarks' bodies through the Rust mock
# upstream), and the profile it writes steers the final build's inlining,
# branch layout and hot/cold code placement.
#
#   bash scripts/build_pgo.sh        # -> target/pgo/perf/compactor
#
# The result is the `perf` profile (the release settings: fat LTO, one
# codegen unit) with the profile applied: the same code as `cargo build
# --release`, laid out for the request path. On the 2-core development
# machine it ran a small chat request in ~14% fewer user-space instructions
# (docs/benchmarks.md gives the figures and the commands).
#
# Needs rustup's llvm-tools component (added when missing: llvm-profdata
# must match rustc's LLVM) and wrk (installed from the distribution's
# packages when missing, as the benchmarks do). Two full builds on two
# cores: ~8 minutes.
#
# What the training covers: chat requests of every benchmark body, JSON and
# SSE; the passthrough routes; and one conversation in the three
# conversation APIs in a window small enough that every request is served
# from its compacted record (the codecs, the engine and the record path).
# Code no training request reaches is laid out as cold, so a workload far
# from these (another upstream's error shapes, say) gains less.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-target/pgo}"
DUR="${DUR:-3}"
PROFILES="$OUT/profiles"
mkdir -p "$OUT"

sysroot=$(rustc --print sysroot)
profdata() { ls "$sysroot"/lib/rustlib/*/bin/llvm-profdata 2>/dev/null | head -1; }
if [ -z "$(profdata)" ]; then
  rustup component add llvm-tools >/dev/null
fi
PROFDATA=$(profdata)
[ -n "$PROFDATA" ] || { echo "llvm-profdata not found under $sysroot" >&2; exit 1; }
command -v wrk >/dev/null || apt-get install -y wrk >/dev/null

# Each build has a target directory of its own: RUSTFLAGS rebuild every
# dependency, and the plain target/ stays as it was.
echo "1/3 instrumented build"
RUSTFLAGS="-Cprofile-generate=$PWD/$PROFILES" CARGO_TARGET_DIR="$OUT/gen" \
  cargo build -q --locked --profile perf --bin compactor
cargo build -q --locked --profile perf --example mock_upstream
# The build scripts the instrumented build ran wrote profiles of their own.
rm -rf "$PROFILES"

. scripts/bench_bodies.sh
. scripts/bench_procs.sh
BODIES="$OUT/bodies"
mkdir -p "$BODIES"
write_bodies "$BODIES"
write_conv_bodies "$BODIES" 2000

STATE=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT

echo "2/3 training load"
target/perf/examples/mock_upstream 127.0.0.1:0 0 >"$OUT/mock.log" 2>&1 &
PIDS+=($!)
MOCK=$(wait_addr "$OUT/mock.log")

# train WINDOW MODE URL_PATH CONNS: one compactor (its own empty state) under
# DUR seconds of MODE. It exits on SIGTERM through its graceful shutdown,
# which is when the instrumented binary writes its profile.
train() {
  local window="$1" mode="$2" path="$3" conns="$4" log="$OUT/train.log"
  rm -rf "${STATE:?}"/*
  XDG_STATE_HOME="$STATE" COMPACTOR_DEFAULT_CONTEXT_LENGTH="$window" \
    COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
    "$OUT/gen/perf/compactor" --config /dev/null >"$log" 2>&1 &
  local pid=$!
  local addr
  addr=$(wait_addr "$log")
  wrk -t1 -c"$conns" -d"${DUR}s" -s "$BODIES/$mode.lua" "http://$addr$path" >/dev/null
  kill "$pid"
  # A training run that crashed wrote no profile: stop rather than build
  # from a part of the load.
  wait "$pid" || { echo "compactor exited badly under $mode:" >&2; tail -5 "$log" >&2; exit 1; }
}

big=1000000000
for mode in json json_big json_agent sse sse_fp; do
  train "$big" "$mode" /v1/chat/completions 4
done
train "$big" json /v1/embeddings 4
train "$big" json /v1/chat/completions 1
train 8192 conv_chat /v1/chat/completions 1
train 8192 conv_messages /v1/messages 1
train 8192 conv_responses /v1/responses 1

ls "$PROFILES"/*.profraw >/dev/null
"$PROFDATA" merge -o "$OUT/compactor.profdata" "$PROFILES"/*.profraw

echo "3/3 optimised build"
# A function the training never reached has no profile: that is expected,
# not worth a warning per function.
RUSTFLAGS="-Cprofile-use=$PWD/$OUT/compactor.profdata -Cllvm-args=-pgo-warn-missing-function=false" \
  CARGO_TARGET_DIR="$OUT" cargo build -q --locked --profile perf --bin compactor
echo "built $OUT/perf/compactor"
