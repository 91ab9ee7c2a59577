#!/bin/sh
# Decision equality of two builds of the policy host and two policy
# libraries: every shipped policy replays the same stream of tensor facts
# (decide_replay.c) through each, decide and explain, and the outputs must
# be byte for byte the same.
#   tests/replay/compare.sh OLD_BUILD OLD_POLICY_TREE NEW_BUILD NEW_POLICY_TREE
# e.g. tests/replay/compare.sh /work/main/build /work/main/policies build policies
set -eu
old_build=$1 old_pol=$2 new_build=$3 new_pol=$4
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
${CC:-cc} -O1 -o "$out/replay" "$here/decide_replay.c" -I"$here/../../engine/include" \
  -L"$new_build/lib" -lferry
fail=0
for pol in default budget layers fraction ramcap host_budget checkpointed_inputs hidden_states \
           save_on_cpu wait_each; do
  for mode in decide explain; do
    # the same policy file both times (its "file:line" is in explain's
    # answers); each build loads its own tree's library
    LD_LIBRARY_PATH="$old_build/lib" FERRY_POLICY_LIBDIR="$old_pol/lib" \
      "$out/replay" "$new_pol/$pol.lua" $mode >"$out/old" 2>&1 || true
    LD_LIBRARY_PATH="$new_build/lib" FERRY_POLICY_LIBDIR="$new_pol/lib" \
      "$out/replay" "$new_pol/$pol.lua" $mode >"$out/new" 2>&1 || true
    n=$(wc -l <"$out/new")
    if cmp -s "$out/old" "$out/new"; then
      echo "same  $pol $mode ($n decisions)"
    else
      echo "DIFF  $pol $mode"; diff "$out/old" "$out/new" | head -5; fail=1
    fi
  done
done
# the fields t and ctx show at their extremes (2^53, 2^64, signs, no ctx)
${CC:-cc} -O1 -o "$out/fields" "$here/fields_replay.c" -I"$here/../../engine/include" \
  -L"$new_build/lib" -lferry
LD_LIBRARY_PATH="$old_build/lib" "$out/fields" >"$out/old" 2>&1 || true
LD_LIBRARY_PATH="$new_build/lib" "$out/fields" >"$out/new" 2>&1 || true
if cmp -s "$out/old" "$out/new"; then
  echo "same  fields ($(wc -l <"$out/new") decisions)"
else
  echo "DIFF  fields"; diff "$out/old" "$out/new" | head -5; fail=1
fi
exit $fail
