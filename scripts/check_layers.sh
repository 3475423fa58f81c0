#!/usr/bin/env bash
# Fails when the top-level modules of src/ import each other in a circle.
# An edge A -> B is any `crate::B` written in src/A.rs or src/A/ outside a
# comment line; tsort finds the loops. `-v` also prints the edges.
set -uo pipefail
cd "$(dirname "$0")/../src" || exit 2

edges() {
    for path in *.rs */; do
        m="${path%.rs}"
        m="${m%/}"
        if [ "$m" = lib ] || [ "$m" = main ]; then continue; fi
        echo "$m $m"
        { grep -rhE 'crate::[a-z_]+' "$path" | grep -vE '^[[:space:]]*//' \
            | grep -oE 'crate::[a-z_]+' || true; } \
            | sed 's/^crate:://' | sort -u \
            | while read -r dep; do
                if [ "$dep" != "$m" ]; then echo "$m $dep"; fi
            done
    done
}

# A grouped `crate::{a, b}` would hide its modules from the edge scan below.
if grep -rnE 'crate::\{' . ; then
    echo "write one \`use crate::module::...\` per module (the layer check reads them)" >&2
    exit 1
fi

if [ "${1:-}" = "-v" ]; then
    edges | awk '$1 != $2'
fi
loops=$(edges | tsort 2>&1 >/dev/null)
if [ -n "$loops" ]; then
    echo "import circle among src/ modules:" >&2
    echo "$loops" >&2
    exit 1
fi
echo "layers: no import circle"
