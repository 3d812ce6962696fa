#!/usr/bin/env bash
# Brings the patched llama.cpp tree up to date with the patch stack, touching as
# little as it can so the CMake build stays incremental:
#   patch_tree.sh apply PRISTINE TREE PATCH...  reverse the stack applied last, apply this one
#   patch_tree.sh check PRISTINE PATCH...       each patch applies and reverses cleanly
set -euo pipefail

mode=$1; pristine=$2; shift 2

apply_one() {  # DIR PATCH [patch options]: no fuzz, no offsets tolerated silently
    local dir=$1 file=$2; shift 2
    local out
    if ! out=$(patch -d "$dir" -p1 --fuzz=0 --no-backup-if-mismatch --forward "$@" < "$file" 2>&1); then
        echo "$out" >&2
        echo "error: $(basename "$file") does not apply cleanly to $dir $*" >&2
        return 1
    fi
    if grep -qiE 'offset|fuzz|reversed|previously applied|skipping' <<<"$out"; then
        echo "$out" >&2
        echo "error: $(basename "$file") applies only with offsets/fuzz; regenerate it" >&2
        return 1
    fi
}

case "$mode" in
apply)
    tree=$1; shift
    applied="$tree/.meshnet-applied"
    if [ -d "$applied" ]; then
        # undo the previous stack, newest first; a tree that will not reverse is rebuilt
        for p in $(ls -r "$applied"/*.patch 2>/dev/null); do
            if ! apply_one "$tree" "$p" -R; then
                echo "patched tree is not what the last stack left; starting again from pristine" >&2
                rm -rf "$tree"
                break
            fi
        done
    else
        rm -rf "$tree"
    fi
    [ -d "$tree" ] || cp -a "$pristine" "$tree"
    rm -rf "$applied"; mkdir -p "$applied"
    for p in "$@"; do
        apply_one "$tree" "$p"
        cp "$p" "$applied/"
    done
    ;;
check)
    work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
    cp -a "$pristine" "$work/tree"
    for p in "$@"; do apply_one "$work/tree" "$p"; echo "applies cleanly:  $(basename "$p")"; done
    for p in $(printf '%s\n' "$@" | sort -r); do apply_one "$work/tree" "$p" -R; echo "reverses cleanly: $(basename "$p")"; done
    diff -r -q "$pristine" "$work/tree" >/dev/null || { echo "error: the reversed tree differs from pristine" >&2; exit 1; }
    echo "patch stack OK: ${#@} patches apply and reverse to the pristine tree"
    ;;
*)
    echo "usage: $0 apply PRISTINE TREE PATCH... | check PRISTINE PATCH..." >&2; exit 2 ;;
esac
