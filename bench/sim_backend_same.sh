#!/usr/bin/env bash
# sim_backend_same.sh OLD_CHECKOUT NEW_CHECKOUT [SEEDS] — a speed change to
# the sim backend must not change one bit of what it computes: builds
# bench/sim_backend_same.c against each checkout's build/lib/libferry.so
# (and its own headers), runs both on SEEDS (default 2000) random call
# sequences and compares their prints byte for byte. Exits 1 at the first
# sequence that differs (its prints left in the work directory).
set -u
old=$(realpath "$1") new=$(realpath "$2") seeds=${3:-2000}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/ferry-backend-same-XXXXXX")
for side in old new; do
  root=$old
  [[ $side == new ]] && root=$new
  def=()
  grep -q sim_backend_waits "$root/engine/include/ferry_tools.h" && def=(-DHAVE_SIM_BACKEND_WAITS)
  cc -O1 -std=gnu11 "${def[@]}" -I"$root/engine/include" "$here/sim_backend_same.c" \
    -o "$work/$side" -L"$root/build/lib" -lferry -Wl,-rpath,"$root/build/lib" -lm -lpthread ||
    exit 2
done
for seed in $(seq 1 "$seeds"); do
  calls=$((20 + seed % 400))
  "$work/old" "$seed" "$calls" >"$work/old.txt"
  "$work/new" "$seed" "$calls" >"$work/new.txt"
  if ! cmp -s "$work/old.txt" "$work/new.txt"; then
    echo "DIFFERENT: seed $seed, $calls calls: diff $work/old.txt $work/new.txt"
    exit 1
  fi
done
echo "same: $seeds sequences ($work)"
