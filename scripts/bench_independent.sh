#!/usr/bin/env bash
# The independent harness of issue 49: compactor against nginx, CPU per
# request of the proxy process at c=64, with a Python upstream
# (scripts/py_upstream.py: asyncio, each SSE event its own write) instead of
# the Rust mock scripts/bench_load.sh uses.
#
#   scripts/bench_independent.sh                      # shared layout, 5 s a run, median of 3
#   LAYOUT=pinned scripts/bench_independent.sh        # wrk + upstream on CPU 0, the proxy on CPU 1
#   PACINGS="0 1 5" scripts/bench_independent.sh      # ms between stream events (default)
#   UPSTREAM=rust scripts/bench_independent.sh        # the same runs against examples/mock_upstream.rs
#   JSON_CHUNKED=1 scripts/bench_independent.sh       # the Python upstream's JSON chunked
#   SYSCALLS=1 scripts/bench_independent.sh           # + the proxies' syscalls a request (perf stat)
#   MODES="json sse" NO_BUILD=1 COMPACTOR_BIN=... REPS=5 DUR=8
#   COMPACTOR_B_BIN=/tmp/other COMPACTOR_B_ENV="VAR=1" scripts/bench_independent.sh
#       # an A/B: a second compactor (another binary, or the same with an
#       # environment variable) taken in turn with the first
#
# Kinds: json (a short chat, the upstream's JSON reply with usage) and sse at
# each pacing (16 content events, a usage event, [DONE]; the Rust mock sends
# 20). For each, REPS runs of nginx then compactor in turn (a drift of the
# shared VM falls on both), each figure the median: CPU per request of the
# proxy (utime+stime from /proc/PID/stat over the run / wrk's requests; for
# nginx its one worker), requests/s, and the upstream's CPU per request
# (what competes with the proxy on two cores). nginx is configured as
# bench_load.sh runs it (scripts/bench_nginx.sh: 1 worker, proxy_buffering
# off, upstream keep-alive, no access log); compactor is the perf build on an
# empty state directory, its request log on (its default).
set -euo pipefail
cd "$(dirname "$0")/.."

DUR="${DUR:-5}"
REPS="${REPS:-3}"
PACINGS="${PACINGS:-0 1 5}"
LAYOUT="${LAYOUT:-shared}"
UPSTREAM="${UPSTREAM:-py}"
OUT="${OUT:-target/bench_independent}"
mkdir -p "$OUT"

command -v wrk >/dev/null || apt-get install -y wrk >/dev/null
. scripts/bench_nginx.sh
. scripts/bench_bodies.sh
write_bodies "$OUT"

[ -n "${NO_BUILD:-}" ] || cargo build --profile perf --bin compactor --example mock_upstream
BIN="${BIN:-target/perf}"
COMPACTOR_BIN="${COMPACTOR_BIN:-$BIN/compactor}"

STATE=$(mktemp -d)
export XDG_STATE_HOME="$STATE"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap cleanup EXIT

LOADGEN="" UP_CPUS="" PROXY_CPUS=""
if [ "$LAYOUT" = pinned ]; then
  LOADGEN="taskset -c 0"; UP_CPUS=0; PROXY_CPUS=1
fi

# wait_listen LOG → the address of a `listening on <addr>` line.
wait_listen() {
  for _ in $(seq 1 100); do
    if grep -q "listening on" "$1"; then
      grep -o "listening on [0-9.:]*" "$1" | head -1 | awk '{print $3}'
      return
    fi
    sleep 0.1
  done
  echo "did not start: $1" >&2; cat "$1" >&2; exit 1
}

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
sys_ticks() { awk '{ print $15 }' "/proc/$1/stat"; }
HZ=$(getconf CLK_TCK)

# The upstream.
if [ "$UPSTREAM" = rust ]; then
  up_cmd=("$BIN/examples/mock_upstream" 127.0.0.1:0 0)
else
  up_cmd=(python3 scripts/py_upstream.py 127.0.0.1:0 ${JSON_CHUNKED:+--json-chunked})
fi
if [ -n "$UP_CPUS" ]; then taskset -c "$UP_CPUS" "${up_cmd[@]}" >"$OUT/upstream.log" 2>&1 &
else "${up_cmd[@]}" >"$OUT/upstream.log" 2>&1 & fi
UP_PID=$!
PIDS+=("$UP_PID")
UP=$(wait_listen "$OUT/upstream.log")

# nginx, as bench_load.sh runs it.
NGX_DIR="$OUT/nginx"
NGX_ADDR="127.0.0.1:$(free_port)"
write_nginx_conf "$NGX_DIR" "$UP" "$NGX_ADDR" "$PWD/$NGX_DIR/error.log"
if [ -n "$PROXY_CPUS" ]; then taskset -c "$PROXY_CPUS" "$NGINX" -c "$PWD/$NGX_DIR/nginx.conf" -p "$PWD/$NGX_DIR" >"$OUT/nginx.out" 2>&1 &
else "$NGINX" -c "$PWD/$NGX_DIR/nginx.conf" -p "$PWD/$NGX_DIR" >"$OUT/nginx.out" 2>&1 & fi
NGX_MASTER=$!
PIDS+=("$NGX_MASTER")
for _ in $(seq 1 100); do
  NGX_PID=$(pgrep -P "$NGX_MASTER" | head -1 || true)
  [ -n "$NGX_PID" ] && curl -s -o /dev/null -XPOST -d '{}' "http://$NGX_ADDR/v1/chat/completions" && break
  sleep 0.1
done

# compactor, on an empty state directory.
if [ -n "$PROXY_CPUS" ]; then pre=(taskset -c "$PROXY_CPUS"); else pre=(); fi
COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$UP" NO_COLOR=1 \
  "${pre[@]}" "$COMPACTOR_BIN" --config /dev/null >"$OUT/compactor.log" 2>&1 &
CMP_PID=$!
PIDS+=("$CMP_PID")
CMP_ADDR=$(wait_listen "$OUT/compactor.log")
if [ -n "${COMPACTOR_B_BIN:-}" ]; then
  env ${COMPACTOR_B_ENV:-} COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$UP" NO_COLOR=1 \
    "${pre[@]}" "$COMPACTOR_B_BIN" --config /dev/null >"$OUT/compactor_b.log" 2>&1 &
  CMPB_PID=$!
  PIDS+=("$CMPB_PID")
  CMPB_ADDR=$(wait_listen "$OUT/compactor_b.log")
fi

# run ADDR PID KIND GAP → "cpu_us_per_req rps upstream_cpu_us_per_req system_us_per_req"
run() {
  local addr="$1" pid="$2" kind="$3" gap="$4" f c0 c1 u0 u1 s0 s1 n rps
  local url="http://$addr/v1/chat/completions"
  [ "$kind" = sse ] && url="$url?gap_ms=$gap"
  f="$OUT/wrk_${kind}${gap}_${addr//[:.]/_}.txt"
  c0=$(cpu_ticks "$pid"); u0=$(cpu_ticks "$UP_PID"); s0=$(sys_ticks "$pid")
  $LOADGEN wrk -t2 -c64 -d"${DUR}s" -s "$OUT/$kind.lua" "$url" >"$f"
  c1=$(cpu_ticks "$pid"); u1=$(cpu_ticks "$UP_PID"); s1=$(sys_ticks "$pid")
  if grep -q "Non-2xx\|Socket errors" "$f"; then echo "errors in $f" >&2; cat "$f" >&2; fi
  n=$(awk '/requests in/{print $1}' "$f")
  rps=$(awk '/Requests\/sec/{print $2}' "$f")
  awk -v c=$((c1 - c0)) -v u=$((u1 - u0)) -v s=$((s1 - s0)) -v n="$n" -v hz="$HZ" -v r="$rps" \
    'BEGIN { printf "%.2f %.0f %.2f %.2f\n", c * 1e6 / hz / n, r, u * 1e6 / hz / n, s * 1e6 / hz / n }'
}

# syscalls ADDR PID KIND GAP → syscalls a request (perf stat, its own run).
syscalls() {
  local addr="$1" pid="$2" kind="$3" gap="$4" p="$OUT/perf_$3$4_$2.txt" pp n
  local url="http://$addr/v1/chat/completions"
  [ "$kind" = sse ] && url="$url?gap_ms=$gap"
  perf stat -x, -e raw_syscalls:sys_enter -p "$pid" -o "$p" 2>/dev/null &
  pp=$!
  sleep 0.3
  n=$($LOADGEN wrk -t2 -c64 -d3s -s "$OUT/$kind.lua" "$url" | awk '/requests in/{print $1}')
  kill -INT "$pp" 2>/dev/null || true; wait "$pp" 2>/dev/null || true
  awk -F, -v n="$n" '/raw_syscalls:sys_enter/ && $1 ~ /^[0-9]+$/ { printf "%.2f", $1 / n }' "$p"
}

median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

echo "== independent harness: upstream $UPSTREAM ($UP)${JSON_CHUNKED:+, JSON chunked}, layout $LAYOUT, wrk -t2 -c64 ${DUR}s, median of $REPS, $(nproc) cores"
echo "   load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
ROWS="$OUT/rows.txt"
: >"$ROWS"; : >"$OUT/rows_b.txt"
kinds=()
for m in ${MODES:-json sse}; do
  if [ "$m" = sse ]; then for g in $PACINGS; do kinds+=("sse:$g"); done; else kinds+=("$m:0"); fi
done
for k in "${kinds[@]}"; do
  kind=${k%%:*} gap=${k#*:}
  # warm-up: pools and sessions
  $LOADGEN wrk -t2 -c64 -d1s -s "$OUT/$kind.lua" "http://$NGX_ADDR/v1/chat/completions" >/dev/null
  $LOADGEN wrk -t2 -c64 -d1s -s "$OUT/$kind.lua" "http://$CMP_ADDR/v1/chat/completions" >/dev/null
  [ -z "${CMPB_ADDR:-}" ] || $LOADGEN wrk -t2 -c64 -d1s -s "$OUT/$kind.lua" "http://$CMPB_ADDR/v1/chat/completions" >/dev/null
  : >"$OUT/r.ngx"; : >"$OUT/r.cmp"; : >"$OUT/r.cmpb"
  for _ in $(seq 1 "$REPS"); do
    run "$NGX_ADDR" "$NGX_PID" "$kind" "$gap" >>"$OUT/r.ngx"
    run "$CMP_ADDR" "$CMP_PID" "$kind" "$gap" >>"$OUT/r.cmp"
    [ -z "${CMPB_ADDR:-}" ] || run "$CMPB_ADDR" "$CMPB_PID" "$kind" "$gap" >>"$OUT/r.cmpb"
  done
  ng=$(awk '{print $1}' "$OUT/r.ngx" | median); cm=$(awk '{print $1}' "$OUT/r.cmp" | median)
  ngr=$(awk '{print $2}' "$OUT/r.ngx" | median); cmr=$(awk '{print $2}' "$OUT/r.cmp" | median)
  ngu=$(awk '{print $3}' "$OUT/r.ngx" | median); cmu=$(awk '{print $3}' "$OUT/r.cmp" | median)
  ngs=$(awk '{print $4}' "$OUT/r.ngx" | median); cms=$(awk '{print $4}' "$OUT/r.cmp" | median)
  sn="" sc=""
  if [ -n "${SYSCALLS:-}" ] && command -v perf >/dev/null; then
    sn=$(syscalls "$NGX_ADDR" "$NGX_PID" "$kind" "$gap"); sc=$(syscalls "$CMP_ADDR" "$CMP_PID" "$kind" "$gap")
  fi
  label="$kind"; [ "$kind" = sse ] && label="stream, ${gap} ms pacing"
  echo "$label|$ng|$cm|$ngr|$cmr|$ngu|$cmu|$sn|$sc|$ngs|$cms" >>"$ROWS"
  if [ -n "${CMPB_ADDR:-}" ]; then
    cb=$(awk '{print $1}' "$OUT/r.cmpb" | median); cbs=$(awk '{print $4}' "$OUT/r.cmpb" | median)
    echo "$label|$cm|$cb|$cms|$cbs" >>"$OUT/rows_b.txt"
  fi
  echo "   $label: nginx $(tr '\n' ' ' <"$OUT/r.ngx")| compactor $(tr '\n' ' ' <"$OUT/r.cmp")| B $(tr '\n' ' ' <"$OUT/r.cmpb")" >&2
done

echo
echo "| request | nginx µs/req | compactor µs/req | compactor/nginx | of which system, nginx / compactor | req/s nginx / compactor | upstream µs/req (via nginx / compactor) |${SYSCALLS:+ syscalls/req nginx / compactor |}"
echo "|---|---:|---:|---:|---:|---:|---:|${SYSCALLS:+---:|}"
awk -F'|' -v sc="${SYSCALLS:-}" '{
  printf "| %s | %.1f | %.1f | %.2f× | %.1f / %.1f | %d / %d | %.1f / %.1f |", $1, $2, $3, ($2 > 0 ? $3 / $2 : 0), $10, $11, $4, $5, $6, $7
  if (sc != "") printf " %s / %s |", $8, $9
  printf "\n" }' "$ROWS"
if [ -n "${CMPB_ADDR:-}" ]; then
  echo
  echo "A/B: compactor ($COMPACTOR_BIN) against B ($COMPACTOR_B_BIN ${COMPACTOR_B_ENV:-}), CPU µs per request (system):"
  echo "| request | compactor | B | B/compactor |"
  echo "|---|---:|---:|---:|"
  awk -F'|' '{ printf "| %s | %.1f (%.1f) | %.1f (%.1f) | %.2f× |\n", $1, $2, $4, $3, $5, ($2 > 0 ? $3 / $2 : 0) }' "$OUT/rows_b.txt"
fi
echo "   load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
