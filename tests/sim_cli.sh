#!/bin/sh
# sim_cli.sh FERRY — `ferry sim`'s own options end to end on the tiny model:
# --fit writes a policy that replays and fits, an impossible target exits 4,
# --warmup/--host-ram/--pinned/--mfu parse and reach the report.
set -eu
FERRY=$1
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
# SGD: foreach AdamW's transients put tiny's peak at the optimizer step, which
# no policy reaches
"$FERRY" trace synth --preset tiny --optimizer sgd -o "$D/t.jsonl" >/dev/null
"$FERRY" sim --fit 25M --fit-host 8M --trace "$D/t.jsonl" --fit-out "$D/fit.lua" > "$D/fit.txt"
grep -q '^best: HOST_BYTES = ' "$D/fit.txt"
grep -q '^local HOST_BYTES = ' "$D/fit.lua"
"$FERRY" sim --policy "$D/fit.lua" --trace "$D/t.jsonl" --steps 4 --warmup 2 --no-layers \
  --json "$D/r.json" > "$D/check.txt"
# the replayed policy's steady peak is within the 25M target (the tiny model at
# 27.4 MiB without offload: a target that only some settings reach)
peak=$(tr ',' '\n' < "$D/r.json" | grep -m1 '"peak_device_bytes":' | sed 's/.*://')
[ "${peak%.*}" -le 26214400 ]
# --fit device: the memory the preset exposes less the allowance (h100: 79.11 GiB
# less 2.80 GiB = 76.31 GiB; h200: 139.80 - 2.80 = 137.00 GiB)
"$FERRY" sim --fit device --hw h100 --trace "$D/t.jsonl" --fit-out "$D/dev.lua" > "$D/dev.txt"
grep -q "target: device 76.31 GiB (h100's 80 GB: 79.11 GiB exposed less 2.80 GiB for the CUDA context and fragmentation)" "$D/dev.txt"
"$FERRY" sim --fit device --hw h200 --trace "$D/t.jsonl" --fit-out "$D/dev200.lua" > "$D/dev200.txt"
grep -q "target: device 137.00 GiB" "$D/dev200.txt"
grep -q '^local HOST_BYTES = ' "$D/dev.lua"
rc=0
"$FERRY" sim --fit 1K --trace "$D/t.jsonl" --fit-out "$D/none.lua" > "$D/none.txt" || rc=$?
[ "$rc" = 4 ]
grep -q 'nothing in the search space fits' "$D/none.txt"
[ ! -e "$D/none.lua" ]
"$FERRY" sim --policy default --trace "$D/t.jsonl" --no-layers --warmup 2 --steps 4 \
  --host-ram 64G --pinned pool=off,alloc=1ms --mfu 0.5 --json "$D/o.json" > "$D/o.txt"
grep -q 'host RAM 69 GB' "$D/o.txt"
grep -q 'steps 3..4 (--warmup 2)' "$D/o.txt"
grep -q '"pinned_alloc_us":' "$D/o.json"
# compute carrying its work is timed on the --hw preset: a matmul of 1e12
# FLOP (1e9 bytes) and a norm of 4.02e9 bytes. By hand: h100 989 TFLOP/s x
# 0.40 -> 2527.806 us, 3350 GB/s x 0.60 -> 2000 us; a100 312 x 0.40 ->
# 8012.821 us, 2039 x 0.60 -> 3285.924 us; --mfu 0.2 doubles the matmul,
# --tflops 100 makes it 10000 us, --hbm 4020 the norm 1000 us.
H='{"ev":"header","t_us":0,"format":"ferry-trace","version":1,"backend":"synth"}'
printf '%s\n' "$H" '{"ev":"step_begin","t_us":0,"step":1}' \
  '{"ev":"compute","t_us":0,"us":10,"flops":1e12,"hbm_bytes":1e9,"min_us":4}' \
  '{"ev":"compute","t_us":0,"us":20,"flops":0,"hbm_bytes":4.02e9,"min_us":4}' \
  '{"ev":"step_end","t_us":0,"step":1}' > "$D/work.jsonl"
step_is() { # step_is WANT_US FERRY-SIM-ARGS...: the no-offload step, to 0.01 us
  want=$1
  shift
  "$FERRY" sim -q --policy default --trace "$D/work.jsonl" --no-layers --json "$D/w.json" "$@" \
    > "$D/w.txt"
  got=$(tr ',' '\n' < "$D/w.json" | grep -m1 '"step_us_baseline":' | sed 's/.*://')
  awk -v g="$got" -v w="$want" 'BEGIN { d = g - w; exit !(d < 0.01 && d > -0.01) }' ||
    { echo "ferry sim $*: step $got us, want $want us" >&2; exit 1; }
}
step_is 4527.806 --hw h100
step_is 11298.745 --hw a100
step_is 19311.566 --hw a100 --mfu 0.2
step_is 12000 --hw h100 --tflops 100
step_is 3527.806 --hw h100 --hbm 4020
grep -q 'roofline' "$D/w.txt"
rc=0
"$FERRY" sim --policy default --trace "$D/t.jsonl" --pinned pool=maybe 2>/dev/null || rc=$?
[ "$rc" = 2 ]
# optimizer-state offload: one run per share without --policy, each policy
# per share with it; the report and the JSON carry it; bad lists refused
"$FERRY" sim --trace "$D/t.jsonl" --optimizer-fraction 0,0.5,1 --cpu-adam 1e9 --no-layers \
  --json "$D/opt.json" > "$D/opt.txt"
grep -q '^optimizer 0 ' "$D/opt.txt"
grep -q '^optimizer 1 ' "$D/opt.txt"
grep -q 'optimizer 0.5 .*share 0.50 .*overlapped): device -' "$D/opt.txt"
grep -q '"optimizer_fraction":	0.5' "$D/opt.json"
grep -q '"optimizer_stall_us":' "$D/opt.json"
"$FERRY" sim --trace "$D/t.jsonl" --policy default,budget --optimizer-fraction 0.25 \
  --optimizer-overlap off --no-layers > "$D/opt2.txt"
grep -q '^default opt=0.25 ' "$D/opt2.txt"
grep -q 'budget opt=0.25 .*serial' "$D/opt2.txt"
for bad in "0.5,2" "0.5," "0.5,,1"; do
  rc=0
  "$FERRY" sim --trace "$D/t.jsonl" --optimizer-fraction "$bad" 2> "$D/err.txt" || rc=$?
  [ "$rc" = 2 ]
  grep -q -e '--optimizer-fraction 2: ' -e '--optimizer-fraction: empty value' "$D/err.txt"
done
rc=0
"$FERRY" sim --trace "$D/t.jsonl" --optimizer-overlap maybe 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ]
grep -q 'optimizer-overlap maybe: expected on or off' "$D/err.txt"
rc=0
"$FERRY" sim --fit 50M --trace "$D/t.jsonl" --optimizer-fraction 0.5 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ]
# weight offload: one run per item without --policy, each policy per item
# with it; the report's weights line and the JSON's weights object; bad
# values refused
"$FERRY" sim --trace "$D/t.jsonl" --weight-layers 0,2,1..3 --no-layers --json "$D/w.json" \
  > "$D/wl.txt"
grep -q '^weights 0 ' "$D/wl.txt"
grep -q '^weights 1..3 ' "$D/wl.txt"
grep -q 'weights 2 .*blocks 0..1 (2 x .*double-buffered: .*on the host (pinned); D2H ' "$D/wl.txt"
grep -q '"layer_bytes_from":	"trace"' "$D/w.json"
grep -q '"double_buffer":	true' "$D/w.json"
"$FERRY" sim --trace "$D/t.jsonl" --policy default --weight-layers 2 --optimizer-fraction 0.5 \
  --weight-double-buffer off --no-layers > "$D/wl2.txt"
grep -q '^default opt=0.5 w=2 ' "$D/wl2.txt"
grep -q 'default opt=0.5 w=2 .*single-buffered' "$D/wl2.txt"
rc=0
"$FERRY" sim --trace "$D/t.jsonl" --weight-double-buffer maybe 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ]
grep -q 'weight-double-buffer maybe: expected on or off' "$D/err.txt"
rc=0
"$FERRY" sim --trace "$D/t.jsonl" --weight-layers 0..99 2> "$D/err.txt" || rc=$?
[ "$rc" = 1 ]
grep -q 'weight layers 0..99: the trace has' "$D/err.txt"
rc=0
"$FERRY" sim --fit 50M --trace "$D/t.jsonl" --weight-layers 2 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ]
echo ok
