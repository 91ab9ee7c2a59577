#!/bin/sh
# sim_demo.sh FERRY — `ferry sim --demo` (what `make demo` runs) shows the
# point: its scenario's step does not fit the preset device without
# offloading, and the policy it recommends does, within the headroom; the
# commands it prints run as printed.
set -eu
FERRY=$1
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
"$FERRY" sim --demo "$D/demo" > "$D/out.txt"
num() { # num KEY FILE: the first "KEY": number of a JSON report
  tr ',' '\n' < "$2" | grep -m1 "\"$1\":" | sed 's/.*://' | tr -d ' \t'
}
device=$(num device_capacity_bytes "$D/demo/sim.json")
usable=$(num device_usable_bytes "$D/demo/sim.json")
base=$(num peak_device_bytes_baseline "$D/demo/sim.json")
# the baseline is over what the device exposes, not only over the allowance
awk -v b="$base" -v d="$device" -v u="$usable" 'BEGIN { exit !(b > d && u < d && u > 0) }' ||
  { echo "demo baseline $base B vs device $device B, usable $usable B" >&2; exit 1; }
grep -q '^  no offload .*: does NOT fit without offloading$' "$D/out.txt"
grep -q ' fits  <- recommended: host_budget.lua' "$D/out.txt"
grep -q 'DOES NOT FIT' "$D/out.txt"
# every figure with its error band: the report's, --fit's choice and the summary's
for name in default layers budget fit.lua; do
  grep -q "^  $name  *memory saved [0-9.-]*%: .* points on .*published runs from [0-9]* publications (.*) -> a real run: " "$D/out.txt" ||
    { echo "no memory band for $name" >&2; exit 1; }
done
[ "$(grep -c '^  .*step overhead [+-][0-9.]*%: [+-][0-9.]* to [+-][0-9.]* points on ' "$D/out.txt")" = 8 ] ||
  { echo "not 8 overhead bands (3 report, best, 4 summary)" >&2; exit 1; }
grep -q '"band"' "$D/demo/sim.json"
grep -q 'class="band"' "$D/demo/report.html"
# the printed commands, as printed
check=$(sed -n 's/^check it:  //p' "$D/out.txt")
use=$(sed -n 's/^use it:    //p' "$D/out.txt")
[ "$use" = "ferry run --policy $D/demo/fit.lua -- python train.py" ]
case "$check" in "ferry sim --policy $D/demo/fit.lua --trace $D/demo/"*) ;; *) exit 1 ;; esac
# shellcheck disable=SC2086 # the command line as printed, split on spaces
"$FERRY" ${check#ferry } --no-layers --json "$D/check.json" > "$D/check.txt"
peak=$(num peak_device_bytes "$D/check.json")
errors=$(num policy_errors "$D/check.json")
[ "$errors" = 0 ]
awk -v p="$peak" -v u="$usable" -v b="$base" 'BEGIN { exit !(p <= u && p < b) }' ||
  { echo "recommended policy peaks at $peak B, usable $usable B" >&2; exit 1; }
grep -q "usable .*: no offload DOES NOT FIT; fit fits\$" "$D/check.txt"
echo ok
