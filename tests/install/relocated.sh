#!/usr/bin/env bash
# An installed ferry works without its source tree: build and install from a
# copy of the sources, check that no installed file names the source, build
# or install path (no_build_paths.sh), delete the copy and its build, move
# the prefix, then use what was installed: `ferry check default`, `ferry sim --policy budget`,
# the man page and bash completion, a pkg-config build and a find_package
# build of a consumer.
#   tests/install/relocated.sh      (JOBS=2)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d /tmp/ferry-relocate-XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
(cd "$root" && git ls-files -z | xargs -0 cp --parents -t "$work/src")
cmake -S "$work/src" -B "$work/build" -DFERRY_WERROR=ON -DBUILD_TESTING=OFF >/dev/null
cmake --build "$work/build" -j"${JOBS:-2}" >/dev/null
cmake --install "$work/build" --prefix "$work/first" >/dev/null
"$root/tests/install/no_build_paths.sh" "$work/first" "$work/src" "$work/build" "$work/first"
rm -rf "$work/src" "$work/build"
mv "$work/first" "$work/moved"
p=$work/moved

fail() { echo "relocated install: $*" >&2; exit 1; }
"$p/bin/ferry" check default >"$work/check.txt" 2>&1 || { cat "$work/check.txt"; fail "ferry check default"; }
grep -q "^name     default" "$work/check.txt" || fail "ferry check default printed no policy name"
grep -q "$p/share/ferry/policies/default.lua" "$work/check.txt" ||
  fail "ferry check default did not use the installed policy"
# run by its name, found on PATH: the program must find its own folder
(cd "$work" && PATH="$p/bin:$PATH" ferry check default >"$work/check_path.txt" 2>&1) ||
  { cat "$work/check_path.txt"; fail "ferry check default, ferry run from PATH"; }
"$p/bin/ferry" trace synth --preset tiny -o "$work/t.jsonl"
"$p/bin/ferry" sim --policy budget --trace "$work/t.jsonl" --steps 2 >"$work/sim.txt" 2>&1 ||
  { cat "$work/sim.txt"; fail "ferry sim --policy budget"; }
grep -q "^budget" "$work/sim.txt" || fail "ferry sim printed no row for budget"

# the man page and the bash completion where man and bash-completion look; the
# completion finds the installed policies beside the moved binary
[ -s "$p/share/man/man1/ferry.1" ] || fail "no share/man/man1/ferry.1"
comp=$p/share/bash-completion/completions/ferry
[ -s "$comp" ] || fail "no share/bash-completion/completions/ferry"
got=$(cd "$work" && PATH="$p/bin:$PATH" bash -c 'source "$1"; COMP_WORDS=(ferry sim --policy bud)
  COMP_CWORD=3; _ferry; echo "${COMPREPLY[*]}"' bash "$comp")
[ "$got" = budget ] || fail "the installed completion offers '$got' for --policy bud, not budget"

# pkg-config, the .pc found where the prefix now is
cc "$root/tests/install/consumer.c" -o "$work/consumer_pc" \
  $(PKG_CONFIG_PATH="$p/lib/pkgconfig" pkg-config --cflags --libs ferry)
LD_LIBRARY_PATH="$p/lib" "$work/consumer_pc" >/dev/null || fail "the pkg-config consumer"
# find_package
cmake -S "$root/tests/install" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$p" >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer" >/dev/null || fail "the find_package consumer"
echo "relocated install: ferry check, ferry sim, pkg-config and find_package work from $p"
