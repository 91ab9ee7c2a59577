#!/usr/bin/env bash
# Fails if a file installed under PREFIX names one of the given paths (the
# source tree, the build tree, the first install prefix): an installed ferry
# must not look into, nor print, a path of the machine it was built on, which
# another user can create on a shared machine. Debug info is left aside (it
# names the sources by design): ELF files are searched with it stripped.
#   tests/install/no_build_paths.sh PREFIX PATH...
set -euo pipefail
prefix=$1
shift
[ $# -gt 0 ] || { echo "usage: $0 PREFIX PATH..." >&2; exit 2; }
pats=()
for p in "$@"; do pats+=(-e "$p"); done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
found=0
while IFS= read -r -d '' f; do
  g=$f
  if [ "$(head -c 4 "$f" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ] ||
     [ "$(head -c 8 "$f")" = '!<arch>' ]; then
    objcopy --strip-debug "$f" "$tmp/stripped" 2>/dev/null || cp "$f" "$tmp/stripped"
    g=$tmp/stripped
  fi
  if grep -qaF "${pats[@]}" "$g"; then
    echo "build path in an installed file: ${f#"$prefix"/}:" >&2
    grep -aoF "${pats[@]}" "$g" | sort -u | sed 's/^/    /' >&2
    found=1
  fi
done < <(find "$prefix" -type f -print0)
[ $found = 0 ] || exit 1
echo "no build path in $prefix"
