#!/usr/bin/env bash
# sim_same_output.sh OLD_FERRY NEW_FERRY [WORKDIR] — a speed change to the
# simulator must not change what it reports: runs `ferry sim` with both
# binaries over the same traces (synthesized once, by OLD_FERRY, and the
# repository's recorded and fuzz-corpus traces), policies and options, and
# compares every output byte for byte: the table on stdout, stderr, the
# JSON report (its "wall_s", the replay's wall-clock time, masked), the
# Chrome trace, the SVG and the HTML page. Prints one line per case and
# exits 1 if any differs (the diff is left in WORKDIR).
set -u
old=$(realpath "$1") new=$(realpath "$2")
work=${3:-$(mktemp -d "${TMPDIR:-/tmp}/ferry-same-XXXXXX")}
mkdir -p "$work" && work=$(cd "$work" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
# both binaries take the bundled policies from this checkout (a copied binary
# finds none beside it)
export FERRY_POLICY_DIR=$root/policies
# a policy decision cut by its wall-clock budget (50 ms) on a loaded machine
# makes two runs of one binary differ: no cut here
export FERRY_POLICY_DECISION_MS=3600000 FERRY_POLICY_LOAD_MS=3600000
mkdir -p "$work/traces"
cd "$work" || exit 2

synth() { # name, then synth options
  local name=$1
  shift
  "$old" trace synth -q "$@" -o "traces/$name.jsonl" || { echo "synth $name failed"; exit 2; }
}
synth llama3-8b --preset llama3-8b --steps 2
synth tiny --preset tiny --steps 3
synth qwen3-moe --preset qwen3-30b-a3b --steps 1
synth gpt-eager --preset gpt3-1.3b --flash off --checkpoint selective --steps 1
synth llama-full-ckpt --preset llama3-8b --checkpoint full:4 --loss chunked --steps 1
synth llama-tp --preset llama3-70b --tp 8 --sp on --shard 4 --layers 8 --steps 1
synth llama-cp --preset llama3-8b --cp 2 --cp-impl ulysses --steps 1
synth qwen-eager --preset qwen3-8b --norm eager --checkpoint selective-op --steps 1

# case name | trace | options (word-split)
cases=(
  "llama-all-policies|llama3-8b|--policy default,layers,budget,fraction,hidden_states,host_budget,ramcap,save_on_cpu,wait_each,checkpointed_inputs --steps 3"
  "llama-h200-steps5|llama3-8b|--policy default,budget --hw h200 --steps 5 --warmup 2"
  "llama-a100-duplex|llama3-8b|--policy default,layers --hw a100 --steps 3"
  "llama-link|llama3-8b|--policy budget --link h2d=20GB/s,d2h=25GB/s,latency=8us,duplex_h2d=0.5,duplex_d2h=0.9"
  "llama-nodes|llama3-8b|--policy default,budget --nodes 4 --gpus-per-node 8 --numa-far 0.8"
  "llama-pinned|llama3-8b|--policy default --pinned pool=off,alloc=3ms,touch=2.5GB/s --host-overhead torch1"
  "llama-no-contention|llama3-8b|--policy default,budget --contention off --host-overhead 0 --mfu 0.5"
  "llama-release|llama3-8b|--policy default,budget --release-copied --prefetch-at-backward --host-cap 8G"
  "llama-optimizer|llama3-8b|--policy default --optimizer-fraction 0.5,1 --optimizer-overlap off"
  "llama-optimizer-overlap|llama3-8b|--optimizer-fraction 0.3 --cpu-adam 1e8"
  "llama-weights|llama3-8b|--policy budget --weight-layers 4,2..6 --weight-double-buffer off"
  "llama-weights-db|llama3-8b|--policy default --weight-layers 8"
  "llama-sweep|llama3-8b|--policy budget --sweep FWD_STASH=1..4"
  "llama-host-ram|llama3-8b|--policy ramcap,host_budget --host-ram 64G --untracked off"
  "tiny-all|tiny|--policy default,layers,budget,wait_each --steps 4 --warmup 0"
  "qwen-moe|qwen3-moe|--policy default,budget --hw h100 --steps 2"
  "gpt-eager|gpt-eager|--policy default,layers --hw a100-40 --tflops 150 --hbm 1200"
  "llama-full-ckpt|llama-full-ckpt|--policy default,checkpointed_inputs,hidden_states"
  "llama-tp|llama-tp|--policy default,budget --hw gh200"
  "llama-cp|llama-cp|--policy default,budget --nodes 2"
  "qwen-eager|qwen-eager|--policy default,save_on_cpu --hw h200"
  "recorded-h200|$root/tests/cli/recorded_h200/trace.jsonl|--policy default --recorded --hw h200 --untracked auto"
  "check-reasons|$root/tests/cli/check_reasons/trace.jsonl|--policy default,budget --recorded"
  # the link's settled time under every rate change at once: comm lanes
  # sharing the link, host memory shared by the node's GPUs, NUMA, copies
  # beside memory-bound kernels, the host's own cost per call, unpooled pins
  "llama-nodes-all|llama3-8b|--policy default,budget,wait_each --nodes 2 --gpus-per-node 4 --numa-far 0.7 --host-overhead torch1 --pinned pool=off,alloc=1ms --steps 3"
  "qwen-moe-nodes|qwen3-moe|--policy default,layers --nodes 4 --gpus-per-node 8 --hw a100 --optimizer-fraction 0.5"
  "llama-cp-contention|llama-cp|--policy budget,hidden_states --nodes 2 --gpus-per-node 2 --release-copied --host-overhead torch1"
  "tiny-nodes-weights|tiny|--policy default,wait_each --nodes 2 --gpus-per-node 8 --weight-layers 2 --steps 4 --warmup 0"
)
for f in "$root"/tests/fuzz/corpus/synth_*.jsonl "$root"/tests/fuzz/corpus/alias_discard.jsonl \
         "$root"/tests/fuzz/corpus/transient_alloc.jsonl "$root"/tests/fuzz/corpus/six_tensors.jsonl \
         "$root"/tests/fuzz/corpus/recorded.jsonl; do
  cases+=("corpus-$(basename "$f" .jsonl)|$f|--policy default,budget,layers --steps 3")
done

fail=0
for c in "${cases[@]}"; do
  IFS='|' read -r name trace opts <<<"$c"
  [[ -n ${SAME_ONLY:-} && ! $name =~ $SAME_ONLY ]] && continue # SAME_ONLY=REGEX: those cases alone
  [[ $trace == /* ]] || trace="$work/traces/$trace.jsonl"
  for side in old new; do
    bin=$old
    [[ $side == new ]] && bin=$new
    d="out/$name/$side"
    mkdir -p "$d"
    # shellcheck disable=SC2086
    (cd "$d" && "$bin" sim --trace "$trace" $opts --json report.json --chrome-trace chrome.json \
      --svg mem.svg --html page.html >stdout.txt 2>stderr.txt; echo $? >rc.txt)
    if [[ -f $d/report.json ]]; then
      sed -E 's/"wall_s":[^,}]*/"wall_s":MASKED/g' "$d/report.json" >"$d/report.masked.json"
      rm "$d/report.json"
    fi
  done
  if diff -r "out/$name/old" "out/$name/new" >"out/$name/diff.txt"; then
    echo "same      $name ($(cat "out/$name/new/rc.txt"), $(cat out/"$name"/new/* | wc -c) bytes)"
  else
    echo "DIFFERENT $name: out/$name/diff.txt"
    fail=1
  fi
done
echo "outputs in $work"
exit $fail
