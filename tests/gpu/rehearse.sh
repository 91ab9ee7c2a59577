#!/usr/bin/env bash
# `make gpu-rehearse` (a stage of `make test`): tests/gpu/on-device.sh as a GPU
# machine would run it, here without a GPU (FERRY_CUDA=OFF), in a scratch
# folder, from a copy of the gathered folder (gpu-carry, or gathered now by
# tests/gpu/gather.sh; skipped with a message when it cannot be gathered). It
# must unpack, configure and build against the carried packages alone, and
# every GPU step must report "no GPU" without error: the prepared run cannot
# rot between the rare times a GPU machine is lent. Checks summary.json's
# schema (tests/gpu/summary.py --check --no-gpu).
#   BUILD=build tests/gpu/rehearse.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-build}
SCRATCH=$(realpath -m "${FERRY_REHEARSE_DIR:-$BUILD/gpu-rehearse}")
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"

# the run's own machinery (process groups killed whole, ...): no build needed
python3 tests/gpu/test_harness.py || { echo "gpu-rehearse: FAILED: tests/gpu/test_harness.py"; exit 1; }

if [ -f gpu-carry/debs/LIST ] && [ -d gpu-carry/wheels ]; then
  cp -r gpu-carry "$SCRATCH/carry"
  echo "gpu-rehearse: a copy of gpu-carry ($(du -sh gpu-carry | cut -f1))"
elif ! tests/gpu/gather.sh "$SCRATCH/carry" > "$SCRATCH/gather.log" 2>&1; then
  cat "$SCRATCH/gather.log"
  echo "gpu-rehearse: skipped: the packages could not be gathered here (no apt/pip network?)"
  exit 0
fi

# The GPU image's python3 has a torch 2.x and transformers: the venv that
# tests/python/run.sh uses is the nearest here.
PY=${FERRY_REHEARSE_PYTHON:-}
if [ -z "$PY" ]; then
  PY=$(.ci/python-env 2>/dev/null | tail -1) || PY=""
fi
if [ -z "$PY" ] || ! "$PY" -c 'import torch, transformers' 2>/dev/null; then
  echo "gpu-rehearse: skipped: no python with torch 2.x and transformers (.ci/python-env failed)"
  exit 0
fi

# Each check started through this python leaves a child running behind it
# (as compute-sanitizer's target may): on-device.sh must kill every step's
# process group, so that none outlives its step holding the GPU.
cat > "$SCRATCH/python" <<EOF
#!/bin/sh
case "\$1" in */tests/gpu/gpu_*.py) sleep 600 & echo \$! >> "$SCRATCH/left-behind" ;; esac
exec "$PY" "\$@"
EOF
chmod +x "$SCRATCH/python"

# 2 shared cores build far slower than a GPU machine's 16: the bounds stretch,
# and the tensor-facts module (minutes of one core against torch's headers;
# the hooks work without it) is left out
set +e
FERRY_GPU_CMAKE_ARGS=-DFERRY_TORCH_FACTS=OFF FERRY_CUDA=OFF FERRY_GPU_CARRY="$SCRATCH/carry" FERRY_GPU_WORK="$SCRATCH/work" \
  FERRY_GPU_TIME_SCALE=${FERRY_REHEARSE_TIME_SCALE:-8} PYTHON="$SCRATCH/python" \
  tests/gpu/on-device.sh "$SCRATCH/out"
rc=$?
set -e
left=0
for pid in $(cat "$SCRATCH/left-behind" 2>/dev/null); do
  # dead, or a zombie no one reaped yet
  if [ -e /proc/$pid ] && [ "$(awk '{ print $3 }' /proc/$pid/stat 2>/dev/null)" != Z ]; then
    left=$((left + 1))
    kill "$pid" 2>/dev/null || true
  fi
done
if [ ! -s "$SCRATCH/left-behind" ] || [ $left -ne 0 ]; then
  echo "gpu-rehearse: a step's children outlived it ($left of $(wc -l < "$SCRATCH/left-behind" 2>/dev/null || echo 0))"
  rc=1
fi
"$PY" tests/gpu/summary.py --check "$SCRATCH/out/summary.json" --no-gpu || rc=1
if [ $rc -ne 0 ]; then
  echo "gpu-rehearse: FAILED (logs in $SCRATCH/out)"
  for log in "$SCRATCH"/out/*.log; do echo "---- $log (last lines)"; tail -25 "$log"; done
  exit 1
fi
echo "gpu-rehearse: on-device.sh unpacked, configured, built and reported every GPU step as no GPU"
