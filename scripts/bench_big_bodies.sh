#!/usr/bin/env bash
# Huge conversation bodies on the three conversation routes: what one costs
# compactor in CPU, and whether the I/O threads stay free meanwhile
# (issue 22, "big Messages/Responses bodies stall the I/O threads").
#
#   scripts/bench_big_bodies.sh
#   BLOCKS=100000 REPS=1 scripts/bench_big_bodies.sh
#   COMPACTOR_BIN=/tmp/old-compactor scripts/bench_big_bodies.sh   # A/B
#
# Builds with --profile perf, starts the mock upstream and compactor (an
# empty state directory, a context window so large that every request is a
# passthrough: what is measured is reading, decoding, hashing and
# estimating, not compaction), then:
#   1. the same conversation of BLOCKS short text blocks (default 200,000;
#      scripts/bench_bodies.sh `big_body`) as chat, Messages and Responses,
#      each posted REPS times under a new credential, its system text made
#      different each time (a cold conversation, and a cold decode):
#      compactor's CPU per request (the threads' run time from
#      /proc/PID/task/*/schedstat), the fastest of the REPS, and its ratio
#      to chat's;
#   2. three concurrent Responses bodies of 300,000 content items (~13 MB)
#      while GET /_compactor/health is polled every 20 ms: the slowest and the
#      median health check;
#   3. one Messages body of 880,000 blocks (~31 MB) that ends as a
#      passthrough: its CPU and wall time.
# Needs python3 and curl.
set -euo pipefail
cd "$(dirname "$0")/.."

BLOCKS="${BLOCKS:-200000}"
REPS="${REPS:-3}"
OUT="${OUT:-target/bench_big_bodies}"
mkdir -p "$OUT"

if [ -z "${COMPACTOR_BIN:-}" ]; then
  cargo build --profile perf --bin compactor --example mock_upstream
fi
BIN=target/perf
COMPACTOR_BIN="${COMPACTOR_BIN:-$BIN/compactor}"

. scripts/bench_bodies.sh
. scripts/bench_procs.sh
for api in chat messages responses; do
  [ -s "$OUT/$api.$BLOCKS.json" ] || big_body "$api" "$BLOCKS" "$OUT/$api.$BLOCKS.json"
done
[ -s "$OUT/responses.300000.json" ] || big_body responses 300000 "$OUT/responses.300000.json"
[ -s "$OUT/messages.880000.json" ] || big_body messages 880000 "$OUT/messages.880000.json"

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
COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
  COMPACTOR_DEFAULT_CONTEXT_LENGTH=1000000000 COMPACTOR_MAX_BODY_BYTES=67108864 \
  "$COMPACTOR_BIN" --config /dev/null >"$OUT/compactor.log" 2>&1 &
PID=$!
PIDS+=("$PID")
PROXY=$(wait_addr "$OUT/compactor.log")

# CPU time (user+system) of compactor in milliseconds.
cpu_ms() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.0f", ($14 + $15) * 1000 / hz }' "/proc/$PID/stat"; }
# The same in microseconds, from the scheduler's per-thread run time
# (/proc/PID/task/*/schedstat, nanoseconds): /proc/PID/stat counts in clock
# ticks (10 ms), a tenth of a cold request of the default size, too coarse
# to tell 1.1x from 1.2x. A thread that exits between two reads takes its
# time with it; the blocking pool's threads idle 10 s before they exit, far
# longer than one request.
cpu_us() { cat /proc/"$PID"/task/*/schedstat 2>/dev/null | awk '{ s += $1 } END { printf "%.0f", s / 1000 }'; }

route() {
  case "$1" in
    chat) echo /v1/chat/completions ;;
    messages) echo /v1/messages ;;
    responses) echo /v1/responses ;;
  esac
}

# post API FILE CREDENTIAL → "status action seconds"
post() {
  curl -s -o /dev/null -D "$OUT/headers.$3" -w "%{http_code} %{time_total}" \
    "http://$PROXY$(route "$1")" -H 'content-type: application/json' \
    -H "authorization: Bearer $3" -H "x-api-key: $3" --data-binary "@$2" >"$OUT/post.$3"
  local action
  action=$(awk -F': ' 'tolower($1)=="x-compactor-action"{gsub("\r",""); print $2}' "$OUT/headers.$3")
  read -r code secs <"$OUT/post.$3" || true
  echo "$code ${action:-none} $secs"
}

echo "compactor $COMPACTOR_BIN   $(nproc) cores   load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "1. one conversation of $BLOCKS blocks, fastest of $REPS cold requests"
printf "%-10s %10s %8s %12s %10s %8s\n" api bytes status "cpu ms" "wall ms" "x chat"
chat_cpu=""
for api in chat messages responses; do
  f="$OUT/$api.$BLOCKS.json"
  best="" best_wall="" status=""
  for rep in $(seq 1 "$REPS"); do
    # A body of its own each time: the codec memo keeps Messages and
    # Responses decodes by content, across credentials, so a repeated body
    # would be decoded warm. Its system text differs, nothing else.
    sed "s/You are a helpful assistant\./You are a helpful assistant ($rep $RANDOM)./" "$f" >"$OUT/rep.json"
    before=$(cpu_us)
    read -r code action secs < <(post "$api" "$OUT/rep.json" "$api-$rep-$RANDOM")
    after=$(cpu_us)
    d=$((after - before))
    status="$code/$action"
    if [ -z "$best" ] || [ "$d" -lt "$best" ]; then best=$d; best_wall=$secs; fi
  done
  [ "$api" = chat ] && chat_cpu=$best
  awk -v a="$api" -v b="$(stat -c %s "$f")" -v s="$status" -v c="$best" -v w="$best_wall" -v k="$chat_cpu" \
    'BEGIN{printf "%-10s %10d %8s %12.1f %10.0f %7.2fx\n", a, b, s, c / 1000, w * 1000, (k > 0 ? c / k : 0)}'
done

echo
echo "2. three concurrent Responses bodies of 300,000 items while /_compactor/health is polled"
: >"$OUT/health"
before=$(cpu_ms)
pids=()
for i in 1 2 3; do
  post responses "$OUT/responses.300000.json" "conc-$i-$RANDOM" >"$OUT/conc.$i" &
  pids+=($!)
done
running() { for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
while running; do
  curl -s -o /dev/null -w "%{time_total}\n" -m 30 "http://$PROXY/_compactor/health" >>"$OUT/health" || echo 30 >>"$OUT/health"
  sleep 0.02
done
wait "${pids[@]}" || true
after=$(cpu_ms)
for i in 1 2 3; do echo "   request $i: $(cat "$OUT/conc.$i")"; done
echo "   compactor CPU for the three: $((after - before)) ms"
sort -n "$OUT/health" | awk '{a[NR]=$1} END {if (NR) printf "   health checks: %d, median %.1f ms, max %.1f ms\n", NR, a[int((NR+1)/2)]*1000, a[NR]*1000}'

echo
echo "3. one Messages body of 880,000 blocks ($(stat -c %s "$OUT/messages.880000.json") bytes)"
before=$(cpu_ms)
read -r code action secs < <(post messages "$OUT/messages.880000.json" "big-$RANDOM")
after=$(cpu_ms)
echo "   status $code, action $action, wall $(awk -v s="$secs" 'BEGIN{printf "%.0f", s*1000}') ms, compactor CPU $((after - before)) ms"
echo "   compactor peak RSS: $(awk '/VmHWM/{printf "%d MB", $2/1024}' "/proc/$PID/status")"
# The sweep (every 30 s) hands what the big bodies freed back to the system.
sleep 32
echo "   compactor RSS 32 s later: $(awk '/VmRSS/{printf "%d MB", $2/1024}' "/proc/$PID/status")"
