#!/usr/bin/env bash
# User-space instructions per request, counted by valgrind (callgrind):
# compactor next to nginx (configured as scripts/bench_load.sh runs it), the
# naive proxy (examples/naive_proxy.rs, the price of a
# bare hyper hop) and the raw hop (examples/raw_hop.rs, a hop with no HTTP
# library: the floor of a tokio proxy), for each request body of
# scripts/bench_bodies.sh.
#
#   scripts/bench_instructions.sh                   # all bodies
#   MODES="json json_agent" scripts/bench_instructions.sh
#   COMPACTOR_BIN=/tmp/old-compactor scripts/bench_instructions.sh   # A/B
#   CONNS=1 MODES=sse scripts/bench_instructions.sh   # one connection (default 4)
#   MODES="pass json" scripts/bench_instructions.sh
#       # pass: the small JSON body on a passthrough route (/v1/embeddings):
#       # compactor's HTTP hop alone, without the chat work json adds (the
#       # difference of the two is that work)
#   MODES="conv_chat conv_messages conv_responses" scripts/bench_instructions.sh
#       # one conversation of CONV_BLOCKS text blocks (default 5,000) as chat,
#       # Messages and Responses: the three routes compared request for request
#       # (passthroughs; CONV_WINDOW=8192: compacted, the record substituted)
#
# Wall-clock numbers on a 2-core VM drift ±20% from run to run; instruction
# counts repeat to within a percent whatever else the machine does, so this
# is the benchmark to judge a change of compactor's own per-request work.
# Kernel time (the socket syscalls) is not counted: scripts/bench_load.sh
# measures the whole.
#
# Each target runs under callgrind, gets a warm-up of wrk traffic (pools,
# caches, session state), then its counters are zeroed, DUR seconds of
# traffic at 4 connections are counted and divided by the requests wrk
# completed.
set -euo pipefail
cd "$(dirname "$0")/.."

DUR="${DUR:-4}"
MODES="${MODES:-json json_big json_agent sse}"
OUT="${OUT:-target/bench_instructions}"
mkdir -p "$OUT"

command -v wrk >/dev/null || apt-get install -y wrk >/dev/null
command -v valgrind >/dev/null || apt-get install -y valgrind >/dev/null
. scripts/bench_nginx.sh

# NO_BUILD=1: use the binaries already in target/perf (an A/B while a build runs).
[ -n "${NO_BUILD:-}" ] || cargo build --profile perf --bin compactor --example mock_upstream --example naive_proxy --example raw_hop
BIN="${BIN:-target/perf}"
COMPACTOR_BIN="${COMPACTOR_BIN:-$BIN/compactor}"

. scripts/bench_bodies.sh
. scripts/bench_procs.sh
write_bodies "$OUT"
cp "$OUT/json.lua" "$OUT/pass.lua"
case " $MODES " in *" conv_"*) write_conv_bodies "$OUT" "${CONV_BLOCKS:-5000}" ;; esac

# The binary's default store is a file under the state directory: one
# shared with other runs holds their records, and looking them up (on the
# blocking pool) would be counted here. Each run starts from an empty one.
STATE=$(mktemp -d)
export XDG_STATE_HOME="$STATE"

PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT

"$BIN/examples/mock_upstream" 127.0.0.1:0 0 >"$OUT/mock.log" 2>&1 &
PIDS+=($!)
MOCK=$(wait_addr "$OUT/mock.log")

# count NAME MODE CMD...: Ir per request of CMD serving MODE.
count() {
  local name="$1" mode="$2"; shift 2
  local log="$OUT/$name.$mode.log" data="$OUT/callgrind.$name.$mode"
  rm -f "$data"*
  # The conversation bodies are passthroughs in a window this large; a
  # CONV_WINDOW under their size (8192) measures the steady state of a
  # compacted session instead: every request substitutes the record.
  local window=""
  case "$mode" in conv_*) window="COMPACTOR_DEFAULT_CONTEXT_LENGTH=${CONV_WINDOW:-1000000000}" ;; esac
  env $window COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
    valgrind --tool=callgrind --callgrind-out-file="$data" "$@" >"$log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  local addr url
  if [ "$name" = nginx ]; then
    addr="$NGINX_ADDR"
    for _ in $(seq 1 300); do
      curl -s -o /dev/null "http://$addr/json" && break
      sleep 0.1
    done
  else
    addr=$(wait_addr "$log")
  fi
  case "$mode" in
    conv_messages) url="http://$addr/v1/messages" ;;
    conv_responses) url="http://$addr/v1/responses" ;;
    pass) url="http://$addr/v1/embeddings" ;;
    *) url="http://$addr/v1/chat/completions" ;;
  esac
  # One conversation's requests come one after another (an agent waits
  # for each reply); the short bodies are sent on CONNS connections.
  local conns=${CONNS:-4}
  case "$mode" in conv_*) conns=1 ;; esac
  wrk -t1 -c"$conns" -d2s -s "$OUT/$mode.lua" "$url" >/dev/null
  callgrind_control -z "$pid" >/dev/null 2>&1
  wrk -t1 -c"$conns" -d"${DUR}s" -s "$OUT/$mode.lua" "$url" >"$OUT/wrk.$name.$mode.txt"
  callgrind_control -d "$pid" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
  local n total
  n=$(awk '/requests in/{print $1}' "$OUT/wrk.$name.$mode.txt")
  total=$(callgrind_annotate "$(ls -t "$data".* | head -1)" 2>/dev/null \
    | awk '/PROGRAM TOTALS/{gsub(",", "", $1); print $1}')
  echo $((total / n))
}

# nginx as scripts/bench_load.sh runs it, in one process (`master_process
# off`) so valgrind counts the worker.
NGINX_DIR="$OUT/nginx"
NGINX_ADDR="127.0.0.1:$(free_port)"
write_nginx_conf "$NGINX_DIR" "$MOCK" "$NGINX_ADDR" "$PWD/$NGINX_DIR/error.log" "master_process off;"

echo "user-space instructions per request (valgrind callgrind, wrk -c4 (conv_*: -c1), ${DUR}s)"
printf "%-11s %12s %12s %12s %12s %7s\n" mode raw naive nginx compactor "cmp/naive"
for mode in $MODES; do
  raw=$(count raw "$mode" "$BIN/examples/raw_hop" 127.0.0.1:0 "$MOCK" 1)
  naive=$(count naive "$mode" "$BIN/examples/naive_proxy" 127.0.0.1:0 "$MOCK")
  ngx=0
  case "$mode" in
    conv_*) ;; # nginx forwards the three routes alike: not a comparison there
    *) ngx=$(count nginx "$mode" "$NGINX" -c "$PWD/$NGINX_DIR/nginx.conf" -p "$PWD/$NGINX_DIR") ;;
  esac
  comp=$(count compactor "$mode" "$COMPACTOR_BIN" --config /dev/null)
  awk -v m="$mode" -v r="$raw" -v n="$naive" -v g="$ngx" -v c="$comp" \
    'BEGIN{printf "%-11s %12d %12d %12d %12d %6.2fx\n", m, r, n, g, c, c / n}'
done
