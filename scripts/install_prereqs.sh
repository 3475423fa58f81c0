#!/usr/bin/env bash
# Installs the system packages scripts/test.sh expects but does not install itself, on Debian
# (CI's machines). Safe to re-run: each package is installed only when its command is missing.
# Python packages are not here: scripts/setup_e2e.sh puts them in .venv.
set -euo pipefail

need=()
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v python3 >/dev/null 2>&1 || need+=(python3 python3-venv)
# The real-agent e2e tests run Claude Code, Codex and pi from npm (setup_e2e.sh: npm ci).
command -v npm >/dev/null 2>&1 || need+=(nodejs npm)
# The Redis store tests start their own server (Debian has no valkey; the protocol is the same).
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# The inspector e2e test (tests/e2e/test_inspector.py) drives a system Chromium
# through Playwright (playwright install cannot download browsers here).
command -v chromium >/dev/null 2>&1 || need+=(chromium)

if [[ ${#need[@]} -eq 0 ]]; then
    echo "install_prereqs: nothing to install"
    exit 0
fi
sudo=""
[[ $(id -u) -eq 0 ]] || sudo="sudo"
echo "install_prereqs: installing ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
