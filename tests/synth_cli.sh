#!/bin/sh
# synth_cli.sh FERRY — `ferry trace synth`'s checkpointing modes and presets
# end to end: Megatron's selective with FlashAttention refused with the
# reason and the alternative, full:K and selective-op named in the header,
# bad modes refused, the Qwen3 and MoE presets' parameter counts in the
# summary, --loss full and chunked (the chunked peak below the full one),
# the resident breakdown per training knob and tensor parallelism's flags,
# and a selective-op MoE trace that ferry sim replays.
set -eu
FERRY=$1
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
rc=0
"$FERRY" trace synth --preset tiny --checkpoint selective -o "$D/s.jsonl" 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ]
grep -q 'FlashAttention has no s^2 tensor to drop, so it would change nothing' "$D/err.txt"
grep -q "use selective-op (torchtitan's per-op policy), full or full:K, or --flash off$" "$D/err.txt"
[ ! -s "$D/s.jsonl" ]
"$FERRY" trace synth --preset tiny --checkpoint selective --flash off -q -o "$D/s.jsonl"
head -1 "$D/s.jsonl" | grep -q '"checkpoint":"selective:attn_core","checkpointed_layers":4,'
"$FERRY" trace synth --preset tiny --checkpoint full:2 -q -o "$D/f.jsonl"
head -1 "$D/f.jsonl" | grep -q '"checkpoint":"full:2","checkpointed_layers":2,'
"$FERRY" trace synth --preset tiny --checkpoint selective-op -q -o "$D/o.jsonl"
head -1 "$D/o.jsonl" | grep -q '"checkpoint":"selective-op","checkpointed_layers":4,'
"$FERRY" trace synth --preset tiny --checkpoint none -q -o "$D/n.jsonl"
head -1 "$D/n.jsonl" | grep -q '"checkpoint":"none",'
# which checkpoint runs it: what a saved-tensor hook (a policy) sees of it
"$FERRY" trace synth --preset tiny --checkpoint full --checkpoint-impl reentrant -o "$D/r.jsonl" 2> "$D/r.txt"
head -1 "$D/r.jsonl" | grep -q '"checkpointed_layers":4,"checkpoint_impl":"reentrant",'
grep -q '(full, reentrant: a policy sees what it keeps and what it recomputes)' "$D/r.txt"
grep -q '"what":"checkpoint: ' "$D/r.jsonl" && { echo "reentrant: no checkpoint allocs expected"; exit 1; }
"$FERRY" trace synth --preset tiny --checkpoint full -o "$D/nr.jsonl" 2> "$D/nr.txt"
grep -q '(full, non-reentrant: a policy sees its block inputs only)' "$D/nr.txt"
grep -q '"what":"checkpoint: recomputed"' "$D/nr.jsonl"
grep -q '"what":"checkpoint: block input"' "$D/nr.jsonl" && { echo "non-reentrant: the block input is a pack"; exit 1; }
rc=0
"$FERRY" trace synth --preset tiny --checkpoint selective-op --checkpoint-impl reentrant -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ] && grep -q 'use_reentrant=False' "$D/err.txt"
rc=0
"$FERRY" trace synth --preset tiny --checkpoint full --checkpoint-impl sometimes -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
[ "$rc" = 2 ] && grep -q 'reentrant, non-reentrant or compiled' "$D/err.txt"
for bad in full:0 full:x full:5 partial selective:nothing; do
  rc=0
  "$FERRY" trace synth --preset tiny --checkpoint "$bad" -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "--checkpoint $bad: exit $rc"; exit 1; }
done
grep -q 'unknown op group' "$D/err.txt"
"$FERRY" trace synth --preset qwen3-8b -o /dev/null 2> "$D/q.txt"
grep -q 'qwen3-8b, 8.19B parameters' "$D/q.txt"
"$FERRY" trace synth --preset mixtral-8x7b --checkpoint full:4 --seq 1024 -o /dev/null 2> "$D/m.txt"
grep -q 'mixtral-8x7b, 46.70B parameters (12.88B active)' "$D/m.txt"
grep -q 'kept by 8 checkpointed layer(s) (full:4, non-reentrant' "$D/m.txt"
"$FERRY" trace synth --help | grep -q 'selective-op'
"$FERRY" trace synth --help | grep -q 'qwen3-30b-a3b'
# --loss: Hugging Face's by default, Liger's fused chunked loss on request
head -1 "$D/n.jsonl" | grep -q '"loss":"full",'
grep -q '"what":"loss: logits.float()"' "$D/n.jsonl"
"$FERRY" trace synth --preset tiny --loss chunked -q -o "$D/c.jsonl"
head -1 "$D/c.jsonl" | grep -q '"loss":"chunked:64",'
grep -q '"class":"LigerFusedLinearCrossEntropyLoss"' "$D/c.jsonl"
if grep -q '"module":"lm_head"' "$D/c.jsonl"; then echo "chunked: lm_head packed"; exit 1; fi
"$FERRY" trace synth --preset tiny --loss chunked:32 -q -o "$D/c.jsonl"
head -1 "$D/c.jsonl" | grep -q '"loss":"chunked:32",'
for bad in chunked:0 chunked:257 partial; do
  rc=0
  "$FERRY" trace synth --preset tiny --loss "$bad" -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "--loss $bad: exit $rc"; exit 1; }
done
# SGD: foreach AdamW's transients put tiny's peak at the optimizer step, past the loss
"$FERRY" trace synth --preset tiny --optimizer sgd -q -o "$D/n.jsonl"
"$FERRY" trace synth --preset tiny --optimizer sgd --loss chunked:32 -q -o "$D/c.jsonl"
"$FERRY" sim --policy default --trace "$D/n.jsonl" --no-layers --json "$D/full.json" > /dev/null
"$FERRY" sim --policy default --trace "$D/c.jsonl" --no-layers --json "$D/chunked.json" > /dev/null
baseline() { tr -d ' \t' < "$1" | grep -o '"peak_device_bytes_baseline":[0-9]*' | head -1 | cut -d: -f2; }
[ "$(baseline "$D/chunked.json")" -lt "$(baseline "$D/full.json")" ]
"$FERRY" trace synth --help | grep -q -- '--loss MODE'
# resident memory from the training knobs, by part in the summary
"$FERRY" trace synth --preset llama3-8b --seq 1024 -o /dev/null 2> "$D/r.txt"
grep -q 'resident per GPU: parameters 1.87 GiB + master weights 3.74 GiB + optimizer states 7.48 GiB (adamw) = 13.09 GiB all step; besides, within the step: gradients up to 1.87 GiB and gathered parameters up to 1.38 GiB' "$D/r.txt"
"$FERRY" trace synth --preset llama3-8b --seq 1024 --shard 1 --lora 0.01 --optimizer adamw8bit -o /dev/null 2> "$D/r.txt"
grep -q 'parameters 14.96 GiB + master weights 0.30 GiB + optimizer states 0.15 GiB (adamw8bit) = 15.41 GiB all step; besides, within the step: gradients up to 0.15 GiB' "$D/r.txt"
"$FERRY" trace synth --preset llama3-8b --seq 1024 --shard 1 --param-dtype fp32 --grad-dtype bf16 --optimizer sgd -o /dev/null 2> "$D/r.txt"
grep -q 'parameters 29.92 GiB + master weights 0.00 GiB + optimizer states 0.00 GiB (sgd) = 29.92 GiB all step; besides, within the step: gradients up to 14.96 GiB' "$D/r.txt"
"$FERRY" trace synth --preset tiny --tp 2 --sp on -q -o "$D/tp.jsonl"
head -1 "$D/tp.jsonl" | grep -q '"tp":2,"sp":true,'
grep -q '"what":"master weights","dtype":"f32"' "$D/tp.jsonl"
for bad in "--optimizer adam" "--sp on" "--tp 3" "--param-dtype fp32 --master-weights on" "--lora 0" "--tp 2 --loss chunked" "--grad-dtype i8"; do
  rc=0
  # shellcheck disable=SC2086
  "$FERRY" trace synth --preset tiny $bad -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "$bad: exit $rc"; exit 1; }
done
"$FERRY" trace synth --help | grep -q -- '--tp N'
# Ulysses: the header says so, its all-to-alls are on the lane; a bad --cp-impl, or a --cp that
# does not divide tiny's 2 KV heads, is refused naming the flag
"$FERRY" trace synth --preset tiny --seq 1024 --cp 2 --cp-impl ulysses -q -o "$D/uly.jsonl"
head -1 "$D/uly.jsonl" | grep -q '"cp":2,"cp_impl":"ulysses",'
grep -q '"op":"all_to_all",.*"ranks":2,"what":"cp"' "$D/uly.jsonl"
# --cp-impl without context parallelism (no --cp, or --cp 1) would be ignored: refused too
for bad in "--cp 2 --cp-impl ulysess" "--cp 4 --cp-impl ulysses" "--cp-impl ulysses" \
           "--cp 1 --cp-impl ulysses" "--cp-impl ring"; do
  rc=0
  # shellcheck disable=SC2086
  "$FERRY" trace synth --preset tiny --seq 1024 $bad -o "$D/b.jsonl" 2> "$D/err.txt" || rc=$?
  [ "$rc" = 2 ] || { echo "$bad: exit $rc"; exit 1; }
  grep -q -- '--cp-impl' "$D/err.txt" || { echo "$bad: $(cat "$D/err.txt")"; exit 1; }
done
# a small MoE with QK-norm under torchtitan's policy, compiled (what it keeps is packed), replays
"$FERRY" trace synth --preset tiny --experts 4 --top-k 2 --expert-ffn 128 --qk-norm on \
  --head-dim 32 --checkpoint selective-op --checkpoint-impl compiled -q -o "$D/moe.jsonl"
grep -q '"module":"model.layers.3.mlp.experts.2.down_proj"' "$D/moe.jsonl"
"$FERRY" sim --policy default --trace "$D/moe.jsonl" --no-layers --steps 2 > "$D/sim.txt"
grep -q '^default ' "$D/sim.txt"
echo ok
