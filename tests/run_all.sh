#!/usr/bin/env bash
# Runs every test suite of ferry; `make test` calls it after building $BUILD.
#   1. ctest: the C suite over the host backend with each arena, and over
#      the cuda backend linked to the CUDA test double
#   2. the C suite under ASan+UBSan, and the threaded tests under TSan
#   3. valgrind memcheck on the C suite (shorter soak)
#   4. install + an out-of-tree find_package(ferry) consumer, and an install
#      that works moved and without its source tree
#   5. pytest (when that suite exists); the busted specs run inside ctest
#   6. the GPU run (tests/gpu/on-device.sh) rehearsed without a GPU
#      (tests/gpu/rehearse.sh, `make gpu-rehearse`)
# Stages can be skipped with FERRY_SKIP="asan tsan valgrind ..." for local runs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
JOBS=${JOBS:-2}
ROOT=$PWD
skip() { [[ " ${FERRY_SKIP:-} " == *" $1 "* ]]; }
stage() { printf '\n==== %s ====\n' "$*"; }
summary=()

# ctest docs/examples runs the docs' torch 2.x blocks (Lightning, DCP) with the
# venv tests/python/run.sh uses; without one they are skipped (failed under CI).
if [ -z "${FERRY_DOCS_TORCH2:-}" ] && [ "${FERRY_SKIP_VENV:-0}" != 1 ]; then
  if FERRY_DOCS_TORCH2=$(.ci/python-env | tail -1); then export FERRY_DOCS_TORCH2; fi
fi

stage "ctest ($BUILD)"
ctest --test-dir "$BUILD" --output-on-failure -j"$JOBS"
summary+=("ctest: ok")

THREADED='host_|threads|two_threads|recompute|concurrent'

if ! skip asan; then
  stage "C suite under ASan+UBSan"
  cmake -S . -B build-asan -DFERRY_ASAN=ON -DFERRY_WERROR=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-asan -j"$JOBS" --target ferry_tests
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$JOBS" -R '^c(-pool)?/'
  summary+=("asan+ubsan: ok")
fi

if ! skip tsan; then
  stage "threaded tests under TSan"
  cmake -S . -B build-tsan -DFERRY_TSAN=ON -DFERRY_WERROR=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-tsan -j"$JOBS" --target ferry_tests
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure -j"$JOBS" -R "^c(-pool)?/.*($THREADED)"
  summary+=("tsan: ok")
fi

if ! skip cuda-off; then
  stage "FERRY_CUDA=OFF build: the cuda backend answers FERRY_EUNSUPPORTED"
  cmake -S . -B build-nocuda -DFERRY_CUDA=OFF -DFERRY_WERROR=ON >/dev/null
  cmake --build build-nocuda -j"$JOBS" --target ferry_tests
  build-nocuda/bin/ferry_tests $(build-nocuda/bin/ferry_tests --list | grep '^cuda_')
  summary+=("cuda=off: ok")
fi

if ! skip valgrind && command -v valgrind >/dev/null; then
  stage "C suite under valgrind memcheck"
  # Valgrind runs code tens of times slower: the policy host's wall-clock
  # budgets (50 ms a decision, 5 s a load) guard against runaway policies at
  # native speed and would interrupt sound ones here. Tests of the budgets
  # set their own values.
  FERRY_POLICY_DECISION_MS=5000 FERRY_POLICY_LOAD_MS=120000 \
  FERRY_TEST_STEPS=300 valgrind -q --error-exitcode=99 --leak-check=full \
    --errors-for-leak-kinds=definite "$BUILD/bin/ferry_tests"
  summary+=("valgrind: ok")
fi

if ! skip install; then
  stage "install + find_package(ferry) consumer"
  rm -rf "$BUILD/install-test" "$BUILD/consumer"
  cmake --install "$BUILD" --prefix "$ROOT/$BUILD/install-test" >/dev/null
  cmake -S tests/install -B "$BUILD/consumer" -DCMAKE_PREFIX_PATH="$ROOT/$BUILD/install-test" >/dev/null
  cmake --build "$BUILD/consumer" -j"$JOBS" >/dev/null
  "$BUILD/consumer/consumer"
  "$BUILD/consumer/consumer_static"
  PKG_CONFIG_PATH="$ROOT/$BUILD/install-test/lib/pkgconfig" pkg-config --exists ferry
  JOBS=$JOBS tests/install/relocated.sh
  summary+=("install (relocated, without the source tree): ok")
fi

if ! skip pytest && [ -x tests/python/run.sh ]; then
  stage "pytest"
  BUILD=$BUILD tests/python/run.sh
  summary+=("pytest: ok")
fi

if ! skip gpu-rehearse; then
  stage "GPU run rehearsed without a GPU (tests/gpu/rehearse.sh)"
  BUILD=$BUILD tests/gpu/rehearse.sh 2>&1 | tee "$BUILD/gpu-rehearse.log"
  summary+=("$(tail -1 "$BUILD/gpu-rehearse.log")")
fi

stage "summary"
printf '%s\n' "${summary[@]}"
