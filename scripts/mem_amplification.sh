#!/usr/bin/env bash
# Memory and health-check latency of compactor on huge request bodies
# (the Hardening issue's "memory amplification").
#
#   scripts/mem_amplification.sh [MESSAGES] [BIN_DIR]
#
# Starts the mock upstream and compactor (release builds from BIN_DIR,
# default target/release), then:
#   1. one body of MESSAGES tiny messages (default 100000, about 4 MB):
#      compactor's VmHWM (peak RSS) and VmRSS afterwards;
#   2. two such bodies at once (two sessions) while /health is polled:
#      the slowest and the median health check, and VmHWM/VmRSS again.
# Needs python3 and curl. Build first:
#   cargo build --release --bin compactor --example mock_upstream
set -euo pipefail
N=${1:-100000}
BIN=${2:-target/release}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT

python3 - "$N" >"$tmp/body.json" <<'PY'
import json, sys
n = int(sys.argv[1])
msgs = [{"role": "system", "content": "s"}]
msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"hi {i}"} for i in range(n)]
print(json.dumps({"model": "m", "messages": msgs}, separators=(",", ":")))
PY
echo "body: $N messages, $(stat -c %s "$tmp/body.json") bytes"

"$BIN/examples/mock_upstream" 127.0.0.1:0 >"$tmp/mock.log" 2>&1 &
for _ in $(seq 50); do grep -q listening "$tmp/mock.log" && break; sleep 0.1; done
mock=$(sed -n 's/.*listening on \([0-9.:]*\).*/\1/p' "$tmp/mock.log" | head -1)
COMPACTOR_LISTEN=127.0.0.1:0 COMPACTOR_UPSTREAM="http://$mock" RUST_LOG=compactor=info \
    "$BIN/compactor" >"$tmp/proxy.log" 2>&1 &
pid=$!
for _ in $(seq 50); do grep -q "listening on" "$tmp/proxy.log" && break; sleep 0.1; done
proxy=$(sed -n 's/.*listening on \([0-9.:]*\).*/\1/p' "$tmp/proxy.log" | head -1)

mem() { awk '/VmHWM|VmRSS/ {printf "%s %d MB  ", $1, $2/1024}' "/proc/$pid/status"; echo; }
post() {
    curl -s -o /dev/null -w "%{http_code} %{time_total}s\n" "http://$proxy/v1/chat/completions" \
        -H 'content-type: application/json' -H "x-session-id: $1" -H "authorization: Bearer $1" --data-binary "@$tmp/body.json"
}

echo -n "idle:            "; mem
echo -n "one body:        "; post one
sleep 1
echo -n "after one:       "; mem

post two & a=$!
post three & b=$!
: >"$tmp/health"
while kill -0 "$a" 2>/dev/null || kill -0 "$b" 2>/dev/null; do
    curl -s -o /dev/null -w "%{time_total}\n" "http://$proxy/health" >>"$tmp/health"
    sleep 0.05
done
wait "$a" "$b" || true
sleep 1
echo -n "after two more:  "; mem
sort -n "$tmp/health" | awk '{a[NR]=$1} END {if (NR) printf "health checks during the two: %d, median %.1f ms, max %.1f ms\n", NR, a[int((NR+1)/2)]*1000, a[NR]*1000}'
echo "compactions logged: $(grep -c 'INFO.*compaction committed' "$tmp/proxy.log" || true)"
