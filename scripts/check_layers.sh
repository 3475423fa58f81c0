#!/usr/bin/env bash
# Fails when src/ or the engine crate (crates/compactor-engine/src) imports
# against its layers:
#  - a circle among the top-level modules, or among the files of one folder
#    (nested folders too), even where no order is written down;
#  - an import that points up the order written in scripts/layers.txt (the
#    top-level modules, and the files of the folders it lists), even when
#    it makes no circle;
#  - a module of a listed folder missing from that order, or a name in the
#    order that is no module (the order stays the code's).
# An edge A -> B is any `crate::B` written in src/A.rs or src/A/ outside a
# comment line and outside test code (for the files of a folder: `super::B`
# and `crate::dir::B`; for the engine's top-level files, which were the
# folder src/compaction/ before it became a crate: `super::B` and
# `crate::B`); tsort finds the loops. `-v` also prints the edges.
# What the engine may import from the proxy is the compiler's to check: it
# does not depend on it.
set -uo pipefail
cd "$(dirname "$0")/../src" || exit 2
# The engine's sources from src/, and its name in scripts/layers.txt.
engine_dir=../crates/compactor-engine/src
engine=compactor-engine
layers=../scripts/layers.txt
# The folder scan reads groups with perl: without it every folder would
# pass unread.
command -v perl >/dev/null || { echo "check_layers.sh needs perl" >&2; exit 2; }
[ -r "$layers" ] || { echo "check_layers.sh: no $layers" >&2; exit 2; }

# The code of $1 (a file, or every .rs file under a folder) that the
# layers are about: without comment lines and without tests (files named
# tests.rs or test_support.rs, folders named tests, inline
# `#[cfg(test)] mod x { … }`). Test code may reach any module: a unit test
# of a leaf may build a whole compressor. Nothing else can reach test code
# (it is cfg(test)), so leaving it out hides no circle.
code_of() {
    find "$1" -name '*.rs' ! -name tests.rs ! -name test_support.rs ! -path '*/tests/*' -print0 \
        | xargs -0 -r perl -0777 -ne '
            s{^[ \t]*//[^\n]*\n}{}mg;
            s{#\[cfg\(test\)\]\s*mod\s+\w+\s*(\{(?:[^{}]++|(?1))*\})}{}g;
            print'
}

edges() {
    for path in *.rs */; do
        m="${path%.rs}"
        m="${m%/}"
        if [ "$m" = lib ] || [ "$m" = main ]; then continue; fi
        echo "$m $m"
        { code_of "$path" | grep -oE 'crate::[a-z_]+' || true; } \
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

# The names of section $1 of the order, highest first, one a line.
order_of() {
    awk -v want="[$1]" '
        { sub(/#.*/, "") }
        /^\[/ { on = ($1 == want); next }
        on { for (i = 1; i <= NF; i++) print $i }' "$layers"
}

# Edges (stdin, "a b") against the order of section $1, whose modules are
# the names in $2 (one a line): prints what breaks it, naming the folder
# $3 (src/$1 when not given).
order_breaks() {
    local label="${3:-src/$1}"
    [ "$1" = src ] && label=src
    awk -v sec="$label" -v here="$2" -v order="$(order_of "$1")" '
        BEGIN {
            n = split(order, names, "\n")
            for (i = 1; i <= n; i++) {
                if (names[i] in pos) print sec ": " names[i] " is named twice in scripts/layers.txt"
                pos[names[i]] = i
            }
            n = split(here, mods, "\n")
            for (i = 1; i <= n; i++) {
                have[mods[i]] = 1
                if (!(mods[i] in pos)) print sec ": " mods[i] " has no place in scripts/layers.txt"
            }
            for (m in pos) if (!(m in have)) print sec ": scripts/layers.txt names " m ", which is no module"
        }
        $1 != $2 && ($1 in pos) && ($2 in pos) && pos[$2] < pos[$1] {
            print sec ": " $1 " -> " $2 " points up the layer order (" $2 " is above " $1 " in scripts/layers.txt)"
        }'
}

# The modules of folder $1 (`src`: the top-level ones; a crate's src
# folder: its top-level ones, lib.rs being the crate), one a line.
modules_of() {
    if [ "$1" = src ]; then
        for path in *.rs */; do
            m="${path%.rs}"; m="${m%/}"
            if [ "$m" != lib ] && [ "$m" != main ]; then echo "$m"; fi
        done
    else
        for path in "$1"/*.rs "$1"/*/; do
            [ -e "$path" ] || continue
            m="${path#"$1"/}"; m="${m%.rs}"; m="${m%/}"
            case "$m" in mod | tests | test_support) ;; lib) [ "$1" = "$engine_dir" ] || echo "$m" ;; *) echo "$m" ;; esac
        done | sort -u
    fi
}

if [ "${1:-}" = "-v" ]; then
    edges | awk '$1 != $2'
fi
status=0
top=$(edges)
loops=$(echo "$top" | tsort 2>&1 >/dev/null)
if [ -n "$loops" ]; then
    echo "import circle among src/ modules:" >&2
    echo "$loops" >&2
    status=1
fi
breaks=$(echo "$top" | order_breaks src "$(modules_of src)")
if [ -n "$breaks" ]; then
    echo "$breaks" >&2
    status=1
fi

# The names a file of folder $2 reaches its siblings by, in $1 (a file or a
# subfolder) outside comment lines: `super::b` and `crate::$3::b` (`$3`
# the folder's module path, `a::b`; empty for a crate's top level:
# `crate::b`), and in a group (`use super::{b, c::X};`, over lines too)
# the first name of each item (b, c), inner groups skipped.
sibling_refs() {
    code_of "$1" | MOD="$3" perl -0777 -ne '
        my $m = $ENV{MOD} eq "" ? "" : "::\Q$ENV{MOD}\E";
        my $p = qr/(?:super|crate$m)::/;
        while (/$p([a-z_]+)/g) { print "$1\n" }
        while (/$p(\{((?:[^{}]++|(?1))*)\})/g) {
            my $g = $2;
            1 while $g =~ s/\{[^{}]*\}//g;
            for (split /,/, $g) { print "$1\n" if /^\s*([a-z_]+)/ }
        }'
}

# Files of one folder: an edge dir/a -> dir/b is a reference to b (see
# sibling_refs) written in dir/a.rs (or dir/a/). $2 is the folder's module
# path (`a::b`), by default the folder's own path in src/.
file_edges() {
    dir="$1"
    local modpath="${2-${1//\//::}}"
    for path in "$dir"/*.rs "$dir"/*/; do
        [ -e "$path" ] || continue
        m="${path#"$dir"/}"
        m="${m%.rs}"
        m="${m%/}"
        case "$m" in mod | tests | test_support) continue ;; esac
        if [ "$m" = lib ] && [ "$dir" = "$engine_dir" ]; then continue; fi
        echo "$m $m"
        sibling_refs "$path" "$dir" "$modpath" | sort -u \
            | while read -r dep; do
                if [ "$dep" != "$m" ] && [ -e "$dir/$dep.rs" -o -d "$dir/$dep" ]; then
                    echo "$m $dep"
                fi
            done
    done
}

# One folder's files: no circle among them, no allow-list; and the order,
# where layers.txt has one. $1 is the folder (from src/), $2 its section
# name in scripts/layers.txt, $3 its module path in its crate, $4 its
# name in messages.
check_folder() {
    local dir="$1" sec="$2" modpath="$3" label="$4" fe loops breaks
    fe=$(file_edges "$dir" "$modpath")
    if [ "${verbose:-}" = 1 ]; then echo "$fe" | awk -v d="$sec" '$1 != $2 {print d"/"$1" -> "d"/"$2}'; fi
    loops=$(echo "$fe" | tsort 2>&1 >/dev/null)
    if [ -n "$loops" ]; then
        echo "import circle among the files of $label/:" >&2
        echo "$loops" >&2
        status=1
    fi
    case "$ordered" in
        *" $sec "*)
            breaks=$(echo "$fe" | order_breaks "$sec" "$(modules_of "$dir")" "$label")
            if [ -n "$breaks" ]; then
                echo "$breaks" >&2
                status=1
            fi
            ;;
    esac
}

# Every folder, nested ones included (chat/, compressor/ of the engine):
# src/'s by their path (`chat`); the engine's top level as
# `compactor-engine` and its folders under it (`compactor-engine/compressor`).
[ "${1:-}" = "-v" ] && verbose=1
ordered=" $(sed -n 's/^\[\(.*\)\].*/\1/p' "$layers" | tr '\n' ' ') "
for dir in $(find . -mindepth 1 -type d | sed 's|^\./||' | sort); do
    check_folder "$dir" "$dir" "${dir//\//::}" "src/$dir"
done
[ -d "$engine_dir" ] || { echo "check_layers.sh: no $engine_dir" >&2; exit 2; }
check_folder "$engine_dir" "$engine" "" "crates/compactor-engine/src"
for dir in $(cd "$engine_dir" && find . -mindepth 1 -type d | sed 's|^\./||' | sort); do
    check_folder "$engine_dir/$dir" "$engine/$dir" "${dir//\//::}" "crates/compactor-engine/src/$dir"
done
for sec in $ordered; do
    case "$sec" in
        src) ;;
        "$engine") ;;
        "$engine"/*) [ -d "$engine_dir/${sec#"$engine"/}" ] || { echo "scripts/layers.txt: [$sec] is no folder of $engine_dir" >&2; status=1; } ;;
        *) [ -d "$sec" ] || { echo "scripts/layers.txt: [$sec] is no folder of src/" >&2; status=1; } ;;
    esac
done
[ "$status" = 0 ] || exit 1
echo "layers: no import circle, every import points down the order of scripts/layers.txt"
