#!/usr/bin/env bash
# Fails when the top-level modules of src/ import each other in a circle,
# or when the files of one folder of src/ (nested folders too) do.
# An edge A -> B is any `crate::B` written in src/A.rs or src/A/ outside a
# comment line; tsort finds the loops. `-v` also prints the edges.
set -uo pipefail
cd "$(dirname "$0")/../src" || exit 2
# The folder scan reads groups with perl: without it every folder would
# pass unread.
command -v perl >/dev/null || { echo "check_layers.sh needs perl" >&2; exit 2; }

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

# The names a file of folder $2 reaches its siblings by, in $1 (a file or a
# subfolder) outside comment lines: `super::b` and `crate::dir::b`, and in a
# group (`use super::{b, c::X};`, over lines too) the first name of each
# item (b, c), inner groups skipped.
sibling_refs() {
    { grep -rhvE '^[[:space:]]*//' "$1" || true; } | DIR="${2//\//::}" perl -0777 -ne '
        my $p = qr/(?:super|crate::\Q$ENV{DIR}\E)::/;
        while (/$p([a-z_]+)/g) { print "$1\n" }
        while (/$p(\{((?:[^{}]++|(?1))*)\})/g) {
            my $g = $2;
            1 while $g =~ s/\{[^{}]*\}//g;
            for (split /,/, $g) { print "$1\n" if /^\s*([a-z_]+)/ }
        }'
}

# Files of one folder: an edge dir/a -> dir/b is a reference to b (see
# sibling_refs) written in dir/a.rs (or dir/a/).
file_edges() {
    dir="$1"
    for path in "$dir"/*.rs "$dir"/*/; do
        [ -e "$path" ] || continue
        m="${path#"$dir"/}"
        m="${m%.rs}"
        m="${m%/}"
        if [ "$m" = mod ]; then continue; fi
        echo "$m $m"
        sibling_refs "$path" "$dir" | sort -u \
            | while read -r dep; do
                if [ "$dep" != "$m" ] && [ -e "$dir/$dep.rs" -o -d "$dir/$dep" ]; then
                    echo "$m $dep"
                fi
            done
    done
}


# Every folder, nested ones included (compaction/compressor/): no circle
# among its files, and no allow-list.
status=0
for dir in $(find . -mindepth 1 -type d | sed 's|^\./||' | sort); do
    loops=$(file_edges "$dir" | tsort 2>&1 >/dev/null)
    [ -n "$loops" ] || continue
    if [ "${1:-}" = "-v" ]; then file_edges "$dir" | awk -v d="$dir" '$1 != $2 {print d"/"$1" -> "d"/"$2}'; fi
    echo "import circle among the files of src/$dir/:" >&2
    echo "$loops" >&2
    status=1
done
[ "$status" = 0 ] || exit 1
echo "layers: no import circle"
