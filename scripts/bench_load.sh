#!/usr/bin/env bash
# Load benchmark: what compactor adds over talking to the upstream directly.
#
#   scripts/bench_load.sh            # 5 s per run
#   DUR=10 UPSTREAM_DELAY_MS=2 scripts/bench_load.sh
#
# Builds with --profile perf, starts the fast mock upstream
# (examples/mock_upstream.rs) and compactor on loopback, then runs wrk
# direct vs through compactor: p50/p99 at concurrency 1 and requests/s at
# concurrency 64, for non-streaming (JSON) and streaming (SSE) chat requests,
# plus time to first SSE byte (examples/ttfb.rs). Everything is bounded
# (DUR seconds per wrk run, at most 10) and loopback only.
set -euo pipefail
cd "$(dirname "$0")/.."

DUR="${DUR:-5}"
if [ "$DUR" -gt 10 ]; then DUR=10; fi
DELAY="${UPSTREAM_DELAY_MS:-0}"
TTFB_N="${TTFB_N:-200}"
OUT="${OUT:-target/bench_load}"
mkdir -p "$OUT"

command -v wrk >/dev/null || apt-get install -y wrk >/dev/null

cargo build --profile perf --bin compactor --example mock_upstream --example ttfb
BIN=target/perf

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# Starts a process logging to $2 and waits for its `listening on <addr>` line.
start() {
  local log="$2"; shift 2
  "$@" >"$log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do
    if grep -q "listening on" "$log"; then
      grep -o "listening on [0-9.:]*" "$log" | head -1 | awk '{print $3}'
      return
    fi
    sleep 0.1
  done
  echo "process did not start: $log" >&2; cat "$log" >&2; exit 1
}

MOCK=$(start mock "$OUT/mock.log" "$BIN/examples/mock_upstream" 127.0.0.1:0 "$DELAY")
PROXY=$(COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
  start proxy "$OUT/compactor.log" "$BIN/compactor" --config /dev/null)

cat >"$OUT/json.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","messages":[{"role":"user","content":"hi"}]}'
LUA
cat >"$OUT/sse.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}]}'
LUA

# wrk latency value (e.g. 45.00us, 1.20ms) → microseconds.
to_us() { awk -v v="$1" 'BEGIN{ n=v+0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n*1000; else if (v ~ /s$/) print n*1000000; else print n }'; }

# run TARGET MODE CONNS THREADS → prints "p50_us p99_us rps"
# Modes: json (non-streaming), sse (22 events written back to back: the worst
# case for a frame-by-frame proxy), sse_paced (1 ms between events, like a
# fast model: every event must be flushed on its own, direct or not).
run() {
  local target="$1" mode="$2" conns="$3" threads="$4"
  local url="http://$target/v1/chat/completions" script="$mode"
  if [ "$mode" = sse_paced ]; then url="$url?gap_ms=1"; script=sse; fi
  local f="$OUT/wrk_${target//[:.]/_}_${mode}_c${conns}.txt"
  wrk -t"$threads" -c"$conns" -d"${DUR}s" --latency -s "$OUT/$script.lua" "$url" >"$f"
  if grep -q "Non-2xx" "$f"; then echo "non-2xx responses in $f" >&2; exit 1; fi
  local p50 p99 rps
  p50=$(to_us "$(awk '$1=="50%"{print $2}' "$f")")
  p99=$(to_us "$(awk '$1=="99%"{print $2}' "$f")")
  rps=$(awk '/Requests\/sec/{print $2}' "$f")
  echo "$p50 $p99 $rps"
}

echo "mock upstream: $MOCK (delay ${DELAY} ms)   compactor: $PROXY   ${DUR}s per run   $(nproc) cores"
printf "%-9s %-4s | %10s %10s %10s | %10s %10s %10s | %9s %9s %7s\n" \
  mode conc "dir p50us" "dir p99us" "dir rps" "cmp p50us" "cmp p99us" "cmp rps" "+p50 us" "+p99 us" "rps %"
for mode in json sse sse_paced; do
  for conc in 1 64; do
    threads=1; [ "$conc" -gt 1 ] && threads=2
    read -r d50 d99 drps < <(run "$MOCK" "$mode" "$conc" "$threads")
    read -r p50 p99 prps < <(run "$PROXY" "$mode" "$conc" "$threads")
    awk -v m="$mode" -v c="$conc" -v d50="$d50" -v d99="$d99" -v dr="$drps" \
        -v p50="$p50" -v p99="$p99" -v pr="$prps" 'BEGIN{
      printf "%-9s %-4s | %10.1f %10.1f %10.0f | %10.1f %10.1f %10.0f | %9.1f %9.1f %6.1f%%\n",
        m, c, d50, d99, dr, p50, p99, pr, p50-d50, p99-d99, 100*pr/dr }'
  done
done

echo
echo "time to first SSE byte (sequential, ${TTFB_N} requests, 1 ms between upstream events):"
echo "  direct:    $("$BIN/examples/ttfb" "http://$MOCK/v1/chat/completions?gap_ms=1" "$TTFB_N")"
echo "  compactor: $("$BIN/examples/ttfb" "http://$PROXY/v1/chat/completions?gap_ms=1" "$TTFB_N")"
echo
echo "compactor metrics (overhead histogram):"
curl -s "http://$PROXY/_compactor/metrics" | grep -E "^compactor_proxy_overhead_seconds_(bucket\{le=\"0.000(1|25|5)\"|count)|^compactor_requests_total" || true
