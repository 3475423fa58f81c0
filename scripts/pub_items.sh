#!/usr/bin/env bash
# Exported (`pub`, not `pub(crate)`) items and fields per top-level module of
# src/, test files excluded: the size of each module's public face (issue 24).
#   bash scripts/pub_items.sh [checkout]
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
files=$(find src -name '*.rs' ! -name 'tests.rs' ! -path '*/tests/*' ! -name 'test_support.rs')
item='^\s*pub (async fn|unsafe fn|fn|struct|enum|trait|type|const|static|mod|use)\b'
field='^\s+pub [a-z_][a-z0-9_]*\s*:'
for m in $(echo "$files" | awk -F/ '{print $2}' | sed 's/\.rs$//' | sort -u); do
  fs=$(echo "$files" | grep -E "^src/$m(\.rs|/)")
  printf "%-12s %5d %5d\n" "$m" "$(cat $fs | grep -cE "$item")" "$(cat $fs | grep -cE "$field")"
done
printf "%-12s %5d %5d\n" TOTAL "$(cat $files | grep -cE "$item")" "$(cat $files | grep -cE "$field")"
