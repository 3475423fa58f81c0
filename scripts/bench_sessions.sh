#!/usr/bin/env bash
# Memory of idle conversation state: RSS per session after SESSIONS
# conversations (default 100,000) each sent one turn of the json_big body
# (61 messages, ~20 KB; scripts/bench_bodies.sh) and then left idle.
#
#   scripts/bench_sessions.sh
#   SESSIONS=20000 scripts/bench_sessions.sh
#   COMPACTOR_BIN=/tmp/old-compactor scripts/bench_sessions.sh   # A/B
#
# compactor runs with the memory store and `max_sessions` = SESSIONS (the
# default keeps 10,000); wrk sends each request under a new x-session-id
# until the `compactor_sessions` gauge reaches SESSIONS. Per session:
# (VmRSS after − VmRSS after a warm-up of 1,000 sessions) / sessions added.
# The target of issue 25 is 16 KB.
set -euo pipefail
cd "$(dirname "$0")/.."

SESSIONS="${SESSIONS:-100000}"
OUT="${OUT:-target/bench_sessions}"
mkdir -p "$OUT"
command -v wrk >/dev/null || apt-get install -y wrk >/dev/null
if [ -z "${COMPACTOR_BIN:-}" ]; then
  cargo build --profile perf --bin compactor --example mock_upstream
fi
BIN="${BIN:-target/perf}"
COMPACTOR_BIN="${COMPACTOR_BIN:-$BIN/compactor}"

. scripts/bench_bodies.sh
. scripts/bench_procs.sh
write_bodies "$OUT"
# json_big, each request under a session id of its own.
body=$(sed -n "s/^wrk.body = '\(.*\)'$/\1/p" "$OUT/json_big.lua")
cat >"$OUT/sessions.lua" <<LUA
-- LuaJIT seeds math.random the same way in every process, and each thread
-- runs this chunk in a state of its own: the ids are the run's (its start
-- time and a seeded random, made once in the main state by setup) and the
-- thread's number, or each wrk run would send the ids of the run before and
-- the session count would stop growing.
math.randomseed(os.time() + math.floor(os.clock() * 1e6))
local run = tostring(os.time()) .. "-" .. tostring(math.random(1, 1e9))
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", run .. "-" .. threads)
end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", nil, {["Content-Type"] = "application/json",
    ["x-session-id"] = tid .. "-" .. n}, '$body')
end
LUA
printf '[session]\nmax_sessions = %d\n[store]\nbackend = "memory"\n' "$SESSIONS" >"$OUT/proxy.toml"

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
"$BIN/examples/mock_upstream" 127.0.0.1:0 0 >"$OUT/mock.log" 2>&1 &
PIDS+=($!)
MOCK=$(wait_addr "$OUT/mock.log")
COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$MOCK" NO_COLOR=1 \
  COMPACTOR_DEFAULT_CONTEXT_LENGTH=1000000 \
  "$COMPACTOR_BIN" --config "$OUT/proxy.toml" >"$OUT/compactor.log" 2>&1 &
PID=$!
PIDS+=("$PID")
PROXY=$(wait_addr "$OUT/compactor.log")
URL="http://$PROXY/v1/chat/completions"

rss_kb() { awk '/VmRSS/{print $2}' "/proc/$PID/status"; }
sessions() { curl -s "http://$PROXY/_compactor/metrics" | awk '$1=="compactor_sessions"{print $2}'; }

# Warm-up: pools, allocator arenas, the first sessions.
until [ "$(sessions)" -ge 1000 ]; do wrk -t1 -c4 -d1s -s "$OUT/sessions.lua" "$URL" >/dev/null; done
s0=$(sessions); r0=$(rss_kb)
until [ "$(sessions)" -ge "$SESSIONS" ]; do
  wrk -t2 -c16 -d5s -s "$OUT/sessions.lua" "$URL" >/dev/null
done
sleep 2
s1=$(sessions); r1=$(rss_kb)
echo "sessions: $s0 -> $s1; VmRSS: $((r0 / 1024)) MB -> $((r1 / 1024)) MB"
awk -v r0="$r0" -v r1="$r1" -v s0="$s0" -v s1="$s1" \
  'BEGIN{printf "idle conversation state: %.1f KB per session (61-message conversations)\n", (r1 - r0) / (s1 - s0)}'
