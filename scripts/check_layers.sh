#!/usr/bin/env bash
# Fails when the top-level modules of src/ import each other in a circle,
# or when the files of one folder of src/ do (folders in KNOWN_CIRCLES excepted).
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

# Files of one folder: an edge dir/a -> dir/b is a `super::b` or
# `crate::dir::b` written in dir/a.rs (or dir/a/) outside a comment line.
file_edges() {
    dir="$1"
    for path in "$dir"/*.rs "$dir"/*/; do
        [ -e "$path" ] || continue
        m="${path#"$dir"/}"
        m="${m%.rs}"
        m="${m%/}"
        if [ "$m" = mod ]; then continue; fi
        echo "$m $m"
        { grep -rhE "(super|crate::$dir)::[a-z_]+" "$path" | grep -vE '^[[:space:]]*//' \
            | grep -oE "(super|crate::$dir)::[a-z_]+" || true; } \
            | sed -E "s/^(super|crate::$dir):://" | sort -u \
            | while read -r dep; do
                if [ "$dep" != "$m" ] && [ -e "$dir/$dep.rs" -o -d "$dir/$dep" ]; then
                    echo "$m $dep"
                fi
            done
    done
}

# Known circles, allowed only until they are taken apart (issue 24 item 1:
# chat/ is being reshaped on other branches; compaction/'s circles went with
# compressor.rs becoming a folder). A folder listed here is reported, not
# failed; remove it once its circle is gone. Any circle in a folder not
# listed fails the check.
KNOWN_CIRCLES="chat"

status=0
for dir in */; do
    dir="${dir%/}"
    loops=$(file_edges "$dir" | tsort 2>&1 >/dev/null)
    [ -n "$loops" ] || continue
    if [ "${1:-}" = "-v" ]; then file_edges "$dir" | awk -v d="$dir" '$1 != $2 {print d"/"$1" -> "d"/"$2}'; fi
    case " $KNOWN_CIRCLES " in
        *" $dir "*) echo "layers: known circle inside $dir/ (allow-listed, issue 24):" >&2
                   echo "$loops" | sed 's/^/  /' >&2 ;;
        *) echo "import circle among the files of src/$dir/:" >&2
           echo "$loops" >&2
           status=1 ;;
    esac
done
[ "$status" = 0 ] || exit 1
echo "layers: no import circle"
