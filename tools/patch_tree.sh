#!/usr/bin/env bash
# Brings the patched llama.cpp tree up to date with the patch stack, touching as
# little as it can so the CMake build stays incremental:
#   patch_tree.sh apply PRISTINE TREE PATCH...  the tree becomes pristine + this stack
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
    # the stack goes onto a fresh copy of pristine, and only the files whose bytes differ
    # from the tree's are written into it: the build then recompiles what this change of
    # the stack touched, not every file that any patch touches
    work=$(mktemp -d "$(dirname "$tree")/.patching.XXXXXX"); trap 'rm -rf "$work"' EXIT
    cp -a "$pristine" "$work/tree"
    for p in "$@"; do apply_one "$work/tree" "$p"; done
    if [ ! -d "$tree" ]; then
        mv "$work/tree" "$tree"
    else
        (cd "$work/tree" && find . -type f -print0) | while IFS= read -r -d '' f; do
            if ! cmp -s "$work/tree/$f" "$tree/$f"; then
                mkdir -p "$(dirname "$tree/$f")" && cp "$work/tree/$f" "$tree/$f"   # a new mtime: rebuilt
            fi
        done
        (cd "$tree" && find . -type f -print0) | while IFS= read -r -d '' f; do
            [ -e "$work/tree/$f" ] || rm -f "$tree/$f"   # made by a patch no longer in the stack
        done
    fi
    # the stack the tree holds, for a check that nothing else was changed (tests/engine/test_patches.py)
    mkdir -p "$tree/.meshnet-applied" && cp "$@" "$tree/.meshnet-applied/"
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
