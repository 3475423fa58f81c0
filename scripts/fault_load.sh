#!/usr/bin/env bash
# Fault and load run (not a timed test): N concurrent streaming chat
# requests through compactor against a mock upstream that injects faults.
#
#   scripts/fault_load.sh               # 1,000 requests, debug build
#   N=200 TIMEOUT=30 scripts/fault_load.sh
#   PROFILE=release scripts/fault_load.sh
#   MODE=silent N=600 scripts/fault_load.sh        # silent connections
#   MODE=slow_upload N=64 scripts/fault_load.sh    # bodies dribbled slowly
#   MODE=silent N=1100 CAP=4096 PROXY_NOFILE=1024 scripts/fault_load.sh
#                                    # compactor alone under `ulimit -n 1024`
#
# Builds compactor and the two examples, starts examples/fault_upstream.rs
# (SSE streams with slow drip, stalls and aborted connections) and
# compactor in front of it, both on 127.0.0.1 with free ports, then runs
# examples/fault_client.rs (slow readers and early hang-ups among the
# clients; every stream checked byte for byte against what the upstream
# sent). Meanwhile it samples compactor's resident memory and open file
# descriptors from /proc. Prints a summary table; cleans up on exit.
# FAULT_VERBOSE=1 lists every request that was not ok in
# $OUT/client_errors.txt. Bounded: at most N (≤ 5,000) requests, each at most TIMEOUT (≤ 120) s.
#
# Connection-level modes (examples/fault_modes; a health check every 100 ms
# runs alongside, on fresh connections):
# - MODE=silent: N connections that never send a byte, with
#   timeouts.client_idle_secs = IDLE (2) and limits.max_connections = CAP
#   (3/4 of N). Expected: each closed by the idle timeout or, beyond the
#   cap, answered 503 with Retry-After; none still open; health answered
#   throughout (503 while the cap is full) and 200 afterwards.
# - MODE=slow_upload: N chat requests announcing a 1 MiB body, sending
#   256 KiB at once and then a byte every 200 ms, with
#   timeouts.body_read_secs = BODY_READ (2) and
#   limits.max_buffered_body_bytes = BUDGET (8 MiB). Expected: each answered
#   408 or, beyond the budget, 503 with Retry-After; none unanswered.
set -euo pipefail
cd "$(dirname "$0")/.."

N="${N:-1000}"; [ "$N" -gt 5000 ] && N=5000
TIMEOUT="${TIMEOUT:-60}"; [ "$TIMEOUT" -gt 120 ] && TIMEOUT=120
PROFILE="${PROFILE:-debug}"
MODE="${MODE:-stream}"
# Open-file limit (soft and hard) of compactor alone, e.g. 1024: the clients
# and the mock keep theirs.
PROXY_NOFILE="${PROXY_NOFILE:-}"
case "$MODE" in stream|silent|slow_upload) ;; *) echo "MODE must be stream, silent or slow_upload" >&2; exit 64;; esac
IDLE="${IDLE:-2}"
CAP="${CAP:-$(( N * 3 / 4 ))}"
BODY_READ="${BODY_READ:-2}"
BUDGET="${BUDGET:-8388608}"
OUT="${OUT:-target/fault_load}"
mkdir -p "$OUT"

# 1,000 client sockets + 2,000 in compactor + 1,000 in the mock, one process each.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

if [ "$PROFILE" = debug ]; then
  cargo build --bin compactor --example fault_upstream --example fault_client
  BIN=target/debug
else
  cargo build --profile "$PROFILE" --bin compactor --example fault_upstream --example fault_client
  BIN="target/$PROFILE"
fi

PIDS=()
SAMPLER=""
cleanup() {
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null || true
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# start VAR LOG CMD...: starts CMD in the background, waits for its
# `listening on <addr>` line, sets VAR to the address and VAR_PID to its pid.
start() {
  local var="$1" log="$2"; shift 2
  "$@" >"$log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 100); do
    if grep -q "listening on" "$log"; then
      printf -v "$var" '%s' "$(grep -o "listening on [0-9.:]*" "$log" | head -1 | awk '{print $3}')"
      printf -v "${var}_PID" '%s' "$pid"
      return
    fi
    sleep 0.1
  done
  echo "process did not start: $log" >&2; cat "$log" >&2; exit 1
}

start MOCK "$OUT/fault_upstream.log" "$BIN/examples/fault_upstream" 127.0.0.1:0
cat >"$OUT/compactor.toml" <<TOML
listen = "127.0.0.1:0"
upstream = "http://$MOCK"
[session]
max_sessions = 500
[log]
format = "text"
TOML
case "$MODE" in
  silent) printf '[timeouts]\nclient_idle_secs = %s\n[limits]\nmax_connections = %s\n' "$IDLE" "$CAP" >>"$OUT/compactor.toml" ;;
  slow_upload) printf '[timeouts]\nbody_read_secs = %s\n[limits]\nmax_buffered_body_bytes = %s\n' "$BODY_READ" "$BUDGET" >>"$OUT/compactor.toml" ;;
esac
LIMIT=()
[ -n "$PROXY_NOFILE" ] && LIMIT=(prlimit "--nofile=$PROXY_NOFILE:$PROXY_NOFILE")
NO_COLOR=1 start PROXY "$OUT/compactor.log" "${LIMIT[@]}" "$BIN/compactor" --config "$OUT/compactor.toml"

# Peak RSS (VmHWM) is kept by the kernel; fds and current RSS are sampled.
fds() { ls "/proc/$1/fd" 2>/dev/null | wc -l; }
kib() { awk -v k="$2" '$1==k":"{print $2}' "/proc/$1/status" 2>/dev/null; }
RSS_START=$(kib "$PROXY_PID" VmRSS)
FD_START=$(fds "$PROXY_PID")
: >"$OUT/samples.txt"
(
  while kill -0 "$PROXY_PID" 2>/dev/null; do
    echo "$(fds "$PROXY_PID") $(kib "$PROXY_PID" VmRSS)" >>"$OUT/samples.txt"
    sleep 0.2
  done
) &
SAMPLER=$!

timeout $((TIMEOUT + 60)) "$BIN/examples/fault_client" "http://$PROXY" "$N" "$TIMEOUT" "$MODE" >"$OUT/client.txt" 2>"$OUT/client_errors.txt"
sleep 1
FD_AFTER=$(fds "$PROXY_PID")
RSS_AFTER=$(kib "$PROXY_PID" VmRSS)
HWM=$(kib "$PROXY_PID" VmHWM)
kill "$SAMPLER" 2>/dev/null || true; SAMPLER=""
FD_PEAK=$(awk 'BEGIN{m=0} $1>m{m=$1} END{print m}' "$OUT/samples.txt")
UP=$(curl -s "http://$MOCK/_fault/stats" 2>/dev/null || echo '{}')
ALIVE=yes; kill -0 "$PROXY_PID" 2>/dev/null || ALIVE=no
PANICS=$(grep -c "panicked" "$OUT/compactor.log" || true)

v() { awk -v k="$1" '$1==k{print $2}' "$OUT/client.txt"; }
# A counter of compactor's (read after the run, under the cap again).
metric() { curl -s "http://$PROXY/_compactor/metrics" | awk -v k="$1" '$1==k{print $2}'; }
# Outcome counts of the connection modes default to 0 when absent.
c() { local x; x="$(v "$1")"; echo "${x:-0}"; }
compactor_rows() {
  printf "%-42s %s\n" \
    "compactor peak RSS VmHWM (KiB)" "$HWM" \
    "compactor RSS start / after (KiB)" "$RSS_START / $RSS_AFTER" \
    "compactor fds start / peak / after" "$FD_START / $FD_PEAK / $FD_AFTER" \
    "compactor alive / panics logged" "$ALIVE / $PANICS"
}
health_rows() {
  printf "%-42s %s\n" \
    "health checks 200 / 503 / failed" "$(c health_200) / $(c health_503) / $(c health_failed)" \
    "health check latency max (ms)" "$(c health_max_ms)" \
    "health status after the run" "$(c health_after)"
}
echo
case "$MODE" in
silent)
  echo "== fault/load silent: $N connections that never send a byte, client_idle_secs $IDLE, max_connections $CAP, $PROFILE build, $(nproc) cores${PROXY_NOFILE:+, compactor under ulimit -n $PROXY_NOFILE}"
  printf "%-42s %s\n" \
    "max_connections in force (metric)" "$(metric compactor_max_connections)" \
    "connections" "$(v requests)" \
    "closed by the idle timeout (ok)" "$(c closed_idle)" \
    "503 + Retry-After, closed (ok)" "$(c refused_503_retry_after)" \
    "503 without Retry-After (bad)" "$(c refused_503_no_retry_after)" \
    "closed with other bytes (bad)" "$(c closed_other)" \
    "still open after ${TIMEOUT}s (bad)" "$(c still_open)" \
    "connect failed" "$(c connect_failed)" \
    "wall time (ms)" "$(v wall_ms)" \
    "metrics: idle closes / cap refusals" "$(metric compactor_idle_connection_closes_total) / $(metric compactor_connections_rejected_total)"
  health_rows; compactor_rows
  ;;
slow_upload)
  echo "== fault/load slow_upload: $N chat bodies of 1 MiB (256 KiB, then 5 B/s), body_read_secs $BODY_READ, max_buffered_body_bytes $BUDGET, $PROFILE build, $(nproc) cores"
  printf "%-42s %s\n" \
    "requests" "$(v requests)" \
    "408 body-read timeout (ok)" "$(c status_408)" \
    "503 + Retry-After (ok)" "$(c status_503_retry_after)" \
    "503 without Retry-After (bad)" "$(c status_503_no_retry_after)" \
    "other status (bad)" "$(c status_other)" \
    "closed without a status (bad)" "$(c closed_without_status)" \
    "no answer within ${TIMEOUT}s (bad)" "$(c no_answer)" \
    "connect failed" "$(c connect_failed)" \
    "wall time (ms)" "$(v wall_ms)" \
    "metrics: body-read timeouts / budget 503s" "$(metric compactor_body_read_timeouts_total) / $(metric compactor_body_budget_rejections_total)"
  health_rows; compactor_rows
  ;;
stream)
  echo "== fault/load: $N concurrent streaming requests, $PROFILE build, $(nproc) cores"
printf "%-34s %s\n" \
  "requests" "$(v requests)" \
  "ok (complete, byte-identical)" "$(v ok)" \
  "lost (no response / truncated)" "$(v lost)" \
  "corrupted (bytes differ)" "$(v corrupted)" \
  "upstream reset -> client error" "$(v reset_propagated)" \
  "upstream reset -> clean end (bad)" "$(v reset_masked)" \
  "upstream reset -> 5xx status" "$(v reset_status)" \
  "  bytes delivered/sent before reset" "$(v reset_bytes)" \
  "client hung up on purpose" "$(v hung_up)" \
  "wall time (ms)" "$(v wall_ms)" \
  "ok stream p50 / p99 (ms)" "$(v ok_p50_ms) / $(v ok_p99_ms)" \
  "compactor peak RSS VmHWM (KiB)" "$HWM" \
  "compactor RSS start / after (KiB)" "$RSS_START / $RSS_AFTER" \
  "compactor fds start / peak / after" "$FD_START / $FD_PEAK / $FD_AFTER" \
  "compactor alive / panics logged" "$ALIVE / $PANICS" \
  "upstream counters" "$UP" \
  "client connections open after (metric)" "$(metric compactor_connections_open)"
  ;;
esac
