#!/usr/bin/env bash
# THE one command that runs every test of the repository (CI runs it through .ci/run):
#   rustfmt check, the layer check (no import circle in src/ or the engine crate, no import up scripts/layers.txt), clippy (warnings are errors),
#   cargo tests of the workspace (the proxy and crates/compactor-engine) and the engine's doc example, docker-compose config check,
#   the Dockerfile's dependency layer run without docker (scripts/check_dockerfile.py),
#   then the end-to-end suite against a real llama.cpp server (tests/e2e, pytest).
# Stops at the first failing step and ends with a one-line summary.
# Arguments are passed to pytest (e.g. `-k sdk`); TEST_SH_SKIP="fmt clippy" skips named steps
# locally (CI never sets it).
#
# Prerequisites (this script checks them and installs nothing system-wide; on a fresh Debian
# machine `bash scripts/install_prereqs.sh` installs them, and .ci/run calls it first):
#   - a Rust toolchain with rustfmt and clippy;
#   - python3 (3.10+) with venv or pip: the e2e Python packages go into .venv (setup_e2e.sh);
#   - docker-compose, only to check docker-compose.yml and docker-compose.scale.yml (`config -q`);
#   - redis-server: the Redis store tests (tests/store_redis*.rs) start their own.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# Many integration tests open sockets in parallel; the default soft limit
# (1024 on some machines) can make one fail with "Too many open files".
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

started=$SECONDS
done_steps=()

summary_fail() {
    echo "test.sh: FAILED at step '$1' (exit $2) after $((SECONDS - started))s; passed: ${done_steps[*]:-none}"
    exit "$2"
}

# step NAME CMD...: runs CMD, records its time, stops everything on failure.
step() {
    local name=$1 t0=$SECONDS rc=0
    shift
    if [[ " ${TEST_SH_SKIP:-} " == *" $name "* ]]; then
        echo "==> [$name] skipped (TEST_SH_SKIP)"
        done_steps+=("$name:skipped")
        return 0
    fi
    echo "==> [$name] $*"
    "$@" || rc=$?
    [[ $rc -eq 0 ]] || summary_fail "$name" "$rc"
    done_steps+=("$name:$((SECONDS - t0))s")
}

require() {
    command -v "$1" >/dev/null 2>&1 && return 0
    echo "test.sh: '$1' not found: $2 (bash scripts/install_prereqs.sh installs it on Debian)" >&2
    return 127
}

compose_check() {
    require docker-compose "needed to check docker-compose.yml" &&
        docker-compose -f docker-compose.yml config -q &&
        docker-compose -f docker-compose.scale.yml config -q
}

e2e() {
    local rc=0
    COMPACTOR_BIN="${COMPACTOR_BIN:-$repo/target/debug/compactor}" \
        .venv/bin/python -m pytest tests/e2e -q -p no:cacheprovider --durations=8 "$@" || rc=$?
    # pytest exits 5 when it collected nothing: that is a broken suite, not a pass.
    [[ $rc -ne 5 ]] || echo "pytest collected no tests"
    return "$rc"
}

step fmt cargo fmt --all -- --check
step layers bash scripts/check_layers.sh
step clippy cargo clippy --workspace --all-targets -- -D warnings
step cargo-test cargo test --workspace --all-targets
step doc-test cargo test --workspace --doc
if [[ -f docker-compose.yml ]]; then
    step compose compose_check
fi
step dockerfile python3 scripts/check_dockerfile.py
step e2e-setup bash scripts/setup_e2e.sh
step build cargo build --bin compactor
step e2e e2e "$@"

echo "test.sh: all steps OK in $((SECONDS - started))s (${done_steps[*]})"
