#!/usr/bin/env bash
# What one compaction buys, against a real llama.cpp (issue 21's table): for each window a
# llama.cpp server at that n_ctx (Gemma 3 270M, 1 slot, 2 threads), then examples/economy.rs
# against it (agent-shaped conversations: a fixed part of ECONOMY_SHARES of the window, ~500-token
# tool turns, three facts the user states early). Not a test: figures to read.
#
#   bash scripts/bench_economy.sh                      # 2048 4096 8192, shares 0.3 and 0.75
#   WINDOWS="8192" ECONOMY_SHARES=0.75 ECONOMY_TURNS=10 bash scripts/bench_economy.sh
#
# ECONOMY_BIN runs a given build of the example (e.g. one of an earlier commit) instead of
# building this tree's. Needs scripts/setup_e2e.sh --serve-only (the venv and the model).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

bin="${ECONOMY_BIN:-}"
if [[ -z "$bin" ]]; then
    cargo build --release --example economy >&2
    bin="$repo/target/release/examples/economy"
fi
work="$(mktemp -d)"
trap 'kill "${llama_pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT

for w in ${WINDOWS:-2048 4096 8192}; do
    out="$work/llama-$w.out"
    .venv/bin/python scripts/llama_server.py --host 127.0.0.1 --port 0 --n-ctx "$w" --slots 1 \
        --threads 2 >"$out" 2>"$work/llama-$w.log" &
    llama_pid=$!
    url=""
    for _ in $(seq 1 600); do
        url="$(sed -n 's/^llama-server ready //p' "$out")"
        [[ -n "$url" ]] && break
        kill -0 "$llama_pid" 2>/dev/null || { cat "$work/llama-$w.log" >&2; exit 1; }
        sleep 0.5
    done
    [[ -n "$url" ]] || { echo "bench_economy: llama.cpp at n_ctx $w did not start" >&2; exit 1; }
    echo "== n_ctx $w ($url)" >&2
    ECONOMY_UPSTREAM="$url" ECONOMY_WINDOW="$w" "$bin"
    kill "$llama_pid"
    wait "$llama_pid" 2>/dev/null || true
done
