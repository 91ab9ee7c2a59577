#!/usr/bin/env bash
# Every check that needs a GPU, on a machine with one (CI has none):
#   tests/gpu/run.sh [BUILD] [OUT]
# BUILD: a build configured with the CUDA toolkit (default build), whose
# Python extension was made for $PYTHON (default python3, with a CUDA torch).
# OUT (default BUILD/gpu): logs, bench.json and the recorded trace.
#   1. ferry_bench --only cuda_copy: the backend's copies against
#      cudaMemcpyAsync, the link's figures (docs/hardware.md)
#   2. tests/python/test_cuda.py: ferry.torch on the GPU, bit-identical
#   3. bench/bench_gpu.py: training steps against no offload and torch's
#      save_on_cpu, and a trace for `ferry sim --hw` (docs/simulator.md)
#   4. the cuda vtable tests of ferry_tests, and ferry_tests_gpu: the engine
#      suite over the real runtime
# Each step is bounded in time; the exit status is nonzero if any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=$(realpath "${1:-build}")
OUT=$(realpath -m "${2:-$BUILD/gpu}")
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FERRY_POLICY_DIR="${FERRY_POLICY_DIR:-$PWD/policies}"
failed=()
step() { printf '\n==== %s ====\n' "$1"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
  "$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
} 2>&1 | tee "$OUT/env.txt"

step "cuda_copy"
timeout 120 "$BUILD/bin/ferry_bench" --only cuda_copy --json "$OUT/bench.json" 2>&1 | tee "$OUT/copy.log" || failed+=(cuda_copy)
step "pytest tests/python/test_cuda.py"
timeout 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/python/test_cuda.py 2>&1 | tee "$OUT/pytest.log" || failed+=(test_cuda)
step "bench_gpu"
timeout 300 "$PYTHON" bench/bench_gpu.py --json "$OUT/bench.json" --trace "$OUT/gpt-gpu.jsonl" 2>&1 | tee "$OUT/bench_gpu.log" || failed+=(bench_gpu)
step "ferry_tests cuda_* and ferry_tests_gpu"
{ timeout 120 "$BUILD/bin/ferry_tests" $("$BUILD/bin/ferry_tests" --list | grep '^cuda_') &&
  FERRY_TEST_BACKEND=cuda timeout 600 "$BUILD/bin/ferry_tests_gpu"; } > "$OUT/suite.log" 2>&1 || failed+=(suite)
grep -E '^FAIL|passed' "$OUT/suite.log"

step "summary"
echo "logs in $OUT"
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
echo "all GPU checks passed"
