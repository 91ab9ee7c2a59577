#!/usr/bin/env bash
# Every GPU check of ferry, in one run on a bare GPU machine (CUDA toolkit,
# CMake, a python3 with a CUDA torch; no LuaJIT, jemalloc, registries):
#   tests/gpu/on-device.sh OUT
# 1. unpacks the Debian packages of tests/gpu/gather.sh's folder (FERRY_GPU_CARRY,
#    default gpu-carry) into a private prefix under FERRY_GPU_WORK (default
#    build-gpu): `dpkg -x` there, never into /; `ar x` + tar without dpkg
# 2. configures with CUDA for the GPU it finds (nvidia-smi's compute_cap ->
#    CMAKE_CUDA_ARCHITECTURES) and the extension for $PYTHON (python3), finding
#    the libraries in that prefix only; builds with all cores (ninja if there)
# 3. runs each check under its own time bound (the table STEPS below; a failed
#    or timed-out step does not stop the others) and writes to OUT at most 8
#    files: summary.json (tests/gpu/summary.py: every figure's key, null where
#    not measured; GPU, driver, CUDA and torch versions; each step's status)
#    and the logs. Exit status 1 if any step failed or timed out.
# FERRY_GPU_ONLY="optim dropins" reruns those checks alone (the build steps
# and env always run; a rerun on the same machine keeps the build).
# Without a GPU (FERRY_CUDA=OFF, no nvidia-smi, or it lists none) it builds
# without CUDA and every GPU step reports "no GPU": `make gpu-rehearse`
# (tests/gpu/rehearse.sh) runs it so on every `make test`.
# The time bounds add up to under 8 minutes, build included (checked below).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
[ $# -eq 1 ] || { echo "usage: tests/gpu/on-device.sh OUT" >&2; exit 2; }
OUT=$(realpath -m "$1")
CARRY=$(realpath -m "${FERRY_GPU_CARRY:-$ROOT/gpu-carry}")
WORK=$(realpath -m "${FERRY_GPU_WORK:-$ROOT/build-gpu}")
PYTHON=$(command -v "${PYTHON:-python3}") || { echo "on-device: no ${PYTHON:-python3}" >&2; exit 2; }
PREFIX=$WORK/prefix
BUILD=$WORK/build
STEPS=$WORK/steps
MULTIARCH=x86_64-linux-gnu
LIBDIR=$PREFIX/usr/lib/$MULTIARCH

# name            seconds  log file     needs a GPU (1: skipped without one)
STEP_TABLE="
unpack            10       build.log    0
configure         20       build.log    0
build             135      build.log    0
env               10       checks.log   0
link              25       checks.log   0
suite             35       suite.log    1
test_cuda         40       pytest.log   0
bench_gpu         30       checks.log   0
checkpoint        30       checks.log   0
optim             40       checks.log   0
dropins           35       checks.log   0
sanitizer         55       sanitizer.log 0
"
BUDGET_S=470  # of the 8 minutes a run may take: 10 s for the summary
total=$(awk 'NF { s += $2 } END { print s }' <<<"$STEP_TABLE")
if [ "$total" -gt "$BUDGET_S" ]; then
  echo "on-device: the steps' time bounds add up to ${total}s, over ${BUDGET_S}s" >&2
  exit 2
fi
# FERRY_GPU_TIME_SCALE stretches every bound (the rehearsal builds on 2 shared cores)
SCALE=${FERRY_GPU_TIME_SCALE:-1}
bound() { awk -v n="$1" -v k="$SCALE" '$1 == n { print int($2 * k) }' <<<"$STEP_TABLE"; }
logof() { awk -v n="$1" '$1 == n { print $3 }' <<<"$STEP_TABLE"; }
needs_gpu() { [ "$(awk -v n="$1" '$1 == n { print $4 }' <<<"$STEP_TABLE")" = 1 ]; }

rm -rf "$STEPS" && mkdir -p "$OUT" "$STEPS" "$WORK"
# OUT may hold the caller's own files: only ours are replaced
for f in $(awk 'NF { print $3 }' <<<"$STEP_TABLE" | sort -u) run.log summary.json; do
  rm -f "$OUT/$f"
done
exec > >(tee "$OUT/run.log") 2>&1
export FERRY_GPU_TIME_SCALE=$SCALE FERRY_GPU_CMAKE_ARGS=${FERRY_GPU_CMAKE_ARGS:-} ROOT OUT CARRY WORK PYTHON PREFIX BUILD STEPS MULTIARCH LIBDIR

# ---- is there a GPU? ----------------------------------------------------------
GPU=1 NO_GPU_WHY="" ARCH=""
if [ "${FERRY_CUDA:-AUTO}" = OFF ]; then
  GPU=0 NO_GPU_WHY="FERRY_CUDA=OFF"
elif ! command -v nvidia-smi >/dev/null; then
  GPU=0 NO_GPU_WHY="no nvidia-smi on this machine"
elif ! cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1) ||
     [ -z "$cap" ]; then
  GPU=0 NO_GPU_WHY="nvidia-smi lists no GPU"
else
  ARCH=${cap//./}
fi
export GPU ARCH NO_GPU_WHY FERRY_GPU_NO_GPU="$NO_GPU_WHY"  # the Python checks read it: nulls with this reason
echo "on-device: $([ $GPU = 1 ] && echo "GPU of compute capability $cap (sm_$ARCH)" || echo "no GPU ($NO_GPU_WHY)"); work in $WORK, files to $OUT"

# Runs one step of the table: its own time bound, its log, its record in
# $STEPS/NAME.step (status, seconds, exit code, reason) for summary.py.
step() {
  local name=$1 t log rc t0 status reason=""
  shift
  t=$(bound "$name") log=$OUT/$(logof "$name")
  printf '\n==== %s (at most %ss) ====\n' "$name" "$t" | tee -a "$log"
  if [ -n "${FERRY_GPU_ONLY:-}" ] && [[ " unpack configure build env $FERRY_GPU_ONLY " != *" $name "* ]]; then
    echo "skipped: not in FERRY_GPU_ONLY" | tee -a "$log"
    printf 'skipped\t0\t0\tnot in FERRY_GPU_ONLY\n' > "$STEPS/$name.step"
    return 0
  fi
  if needs_gpu "$name" && [ $GPU = 0 ]; then
    echo "no GPU: $NO_GPU_WHY" | tee -a "$log"
    printf 'no GPU\t0\t0\t%s\n' "$NO_GPU_WHY" > "$STEPS/$name.step"
    return 0
  fi
  t0=$(date +%s.%N)
  # a function of this script runs in a child bash (exported: export -f)
  # timeout leads a process group of its own: killed whole after the step,
  # so nothing the step left running holds the GPU into the next one
  timeout -k 5 "$t" bash -c '"$@"' "$name" "$@" >> "$log" 2>&1 &
  local pid=$!
  wait "$pid"
  rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  case $rc in
    0) status=ok ;;
    124|137) status=timeout reason="over its ${t}s bound" ;;
    *) status=failed reason="exit status $rc" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$status" "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')" \
    "$rc" "$reason" > "$STEPS/$name.step"
  echo "$name: $status${reason:+ ($reason)}" | tee -a "$log"
}

# ---- 1. the carried packages, into a private prefix -----------------------------
unpack_deb() {  # DEB DEST: dpkg -x, else ar x + tar (a bare image may lack dpkg)
  if [ "${FERRY_GPU_UNPACK:-dpkg}" = dpkg ] && command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$2"
  else
    local tmp
    tmp=$(mktemp -d) || return 1
    (cd "$tmp" && ar x "$1") && tar -xf "$tmp"/data.tar.* -C "$2"
    local rc=$?
    rm -rf "$tmp"
    return $rc
  fi
}
unpack() {
  [ -d "$CARRY/debs" ] || { echo "no $CARRY/debs: run tests/gpu/gather.sh and carry its folder"; return 1; }
  rm -rf "$PREFIX" "$WORK/site" && mkdir -p "$PREFIX" "$WORK/site"
  local deb n=0
  for deb in "$CARRY"/debs/*.deb; do
    unpack_deb "$(realpath "$deb")" "$PREFIX" || { echo "cannot unpack $deb"; return 1; }
    n=$((n + 1))
  done
  # pkgconf finds its library in the prefix (nothing else is given LD_LIBRARY_PATH:
  # programs built here find the prefix's libraries through their RPATH)
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$LIBDIR" "$PREFIX/usr/bin/pkgconf" \
    > "$WORK/pkg-config" && chmod +x "$WORK/pkg-config" || return 1
  # -dev links that point at / (zlib's libz.so) point into the prefix instead
  local l target
  while IFS= read -r l; do
    target=$(readlink "$l")
    if [[ $target == /* ]]; then ln -sfn "$PREFIX$target" "$l"; fi
  done < <(find "$PREFIX" -type l)
  # .pc files name /usr: the prefix's /usr instead
  sed -i -E "s#^([A-Za-z_]+)=/usr#\\1=$PREFIX/usr#" "$LIBDIR"/pkgconfig/*.pc || return 1
  # pure-Python wheels, unzipped (not installed: tests/gpu/gpu_dropins.py loads
  # the one torchtune module it compares with)
  for w in "$CARRY"/wheels/*.whl; do
    [ -e "$w" ] || continue
    "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$w" "$WORK/site" ||
      return 1
  done
  echo "unpacked $n packages into $PREFIX, $(ls "$CARRY"/wheels/*.whl 2>/dev/null | wc -l) wheels into $WORK/site"
}
export -f unpack_deb unpack
step unpack unpack

# The build and the checks find the libraries in the prefix only.
export PKG_CONFIG_LIBDIR=$LIBDIR/pkgconfig PKG_CONFIG_PATH=
export PYTHONPATH=$BUILD/python:$ROOT/tests/gpu${PYTHONPATH:+:$PYTHONPATH}
export FERRY_POLICY_DIR=$ROOT/policies PYTHONUNBUFFERED=1 FERRY_GPU_SITE=$WORK/site

# ---- 2. configure and build -----------------------------------------------------
configure() {
  local gen=() cuda=(-DFERRY_CUDA=OFF)
  command -v ninja >/dev/null && gen=(-G Ninja)
  [ $GPU = 1 ] && cuda=(-DFERRY_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCH")
  # a rerun on the same machine keeps the build of the run before
  cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" "${cuda[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "-DPKG_CONFIG_EXECUTABLE=$WORK/pkg-config" "-DFERRY_PYTHONS=$PYTHON" \
    ${FERRY_GPU_CMAKE_ARGS:-}  # the rehearsal's: -DFERRY_TORCH_FACTS=OFF
}
export -f configure
step configure configure

build() {
  # what the checks run, and no more (the suite and sanitizer need the tests)
  local targets=(ferry_cli ferry_python_package)
  [ $GPU = 1 ] && targets+=(ferry_bench ferry_tests ferry_tests_gpu)
  cmake --build "$BUILD" -j"$(nproc)" --target "${targets[@]}" || return 1
  # what was built loads LuaJIT from the prefix through its RPATH and finds
  # every library; without a GPU (the rehearsal, on a machine that may have
  # them all in /usr and so hide one the carry lacks) every library but the
  # base system's (C and C++ runtimes, zlib, CUDA's) comes from the prefix
  local f l name path bad=0 files=("$BUILD/bin/ferry" "$BUILD"/python/ferry/_ferry*.so)
  local base='^(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libz|ld-linux-x86-64|libcuda|libcudart)\.so'
  [ $GPU = 1 ] && files+=("$BUILD/bin/ferry_bench" "$BUILD/bin/ferry_tests" "$BUILD/bin/ferry_tests_gpu")
  for f in "${files[@]}"; do
    l=$(ldd "$f" 2>&1) || { echo "ldd $f: $l"; return 1; }
    grep -q "$LIBDIR/libluajit" <<<"$l" || { echo "$f does not load libluajit from $LIBDIR"; bad=1; }
    while read -r name _ path _; do
      if [ "$path" = not ] || { [ $GPU = 0 ] && [[ $path != "$PREFIX/"* ]] && ! [[ $name =~ $base ]]; }; then
        echo "$f loads $name from ${path/#not/nowhere}, not from the prefix"
        bad=1
      fi
    done < <(grep "=>" <<<"$l")
    [ $bad = 0 ] || { echo "$l"; return 1; }
  done
}
export -f build
step build build

# ---- 3. the checks ------------------------------------------------------------------
py() {  # SCRIPT STEP [ARGS]: a check of tests/gpu writing its figures to STEPS/STEP.json
  local script=$1 name=$2
  shift 2
  "$PYTHON" "$ROOT/tests/gpu/$script" --out "$STEPS/$name.json" --build "$BUILD" --work "$WORK" "$@"
}
export -f py
step env py gpu_env.py env
step link py gpu_link.py link
suite() {
  # the cuda vtable tests, then the engine suite over the real runtime: every
  # test but the simulator's (sim_*: CPU only, minutes here, run by ctest everywhere)
  "$BUILD/bin/ferry_tests" $("$BUILD/bin/ferry_tests" --list | grep '^cuda_') &&
    FERRY_TEST_BACKEND=cuda "$BUILD/bin/ferry_tests_gpu" \
      $("$BUILD/bin/ferry_tests_gpu" --list | grep -v '^sim_')
}
export -f suite
step suite suite
step test_cuda py gpu_pytest.py test_cuda
step bench_gpu py gpu_bench.py bench_gpu
step checkpoint py gpu_checkpoint.py checkpoint
step optim py gpu_optim.py optim
step dropins py gpu_dropins.py dropins
step sanitizer py gpu_sanitizer.py sanitizer

# ---- summary ---------------------------------------------------------------------------
"$PYTHON" "$ROOT/tests/gpu/summary.py" "$STEPS" "$OUT/summary.json"
rc=$?
n=$(find "$OUT" -type f | wc -l)
if [ "$n" -gt 8 ]; then echo "on-device: $n files in $OUT, over 8" >&2; rc=1; fi
echo "on-device: $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $rc
