#!/bin/sh
# Build the trace-reader fuzzer with clang (libFuzzer + ASan + UBSan) and run
# it on tests/fuzz/corpus for SECONDS (default 60). Inputs that found new
# coverage go into $BUILD_FUZZ/new (merge the useful ones into corpus/ with
# -merge=1). Needs clang and libclang-rt-14-dev.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$here/../..
out=${BUILD_FUZZ:-$root/build-fuzz}
secs=${1:-60}
mkdir -p "$out"
CC=${CC:-clang}
# the engine's sources as CMake lists them, without CUDA
srcs=$(sed -n '/^set(FERRY_ENGINE_SOURCES/,/^)/p' "$root/engine/CMakeLists.txt" |
  grep -o 'src/[a-z_0-9/]*\.c' | sed "s|^|$root/engine/|")
srcs="$srcs $root/engine/src/backend/backend_cuda_absent.c"
extra_libs=$(pkg-config --libs zlib 2>/dev/null || true)
$CC -g -O1 -std=c11 -D_GNU_SOURCE -DFERRY_LIBFUZZER -DFERRY_BUILDING \
  -DFERRY_POLICY_LIBDIR="\"$root/policies/lib\"" \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/engine/include" -I"$root/engine/src" $(pkg-config --cflags luajit libcjson) \
  $srcs "$here/fuzz_trace_reader.c" -o "$out/fuzz_trace_reader" \
  $(pkg-config --libs luajit libcjson) $extra_libs -lm -lpthread -ldl
mkdir -p "$out/new"
"$out/fuzz_trace_reader" -max_total_time="$secs" -max_len=65536 -timeout=10 \
  -rss_limit_mb=4096 "$out/new" "$here/corpus"
