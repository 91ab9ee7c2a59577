#!/usr/bin/env bash
# Run on an ordinary machine (Debian 12 with apt and pip, network to their
# archives): gathers into one git-ignored folder what a bare GPU machine
# lacks to build and check ferry (tests/gpu/on-device.sh unpacks it there):
#   debs/   the Debian packages of the build's libraries, runtime and -dev
#           (LuaJIT, jemalloc, cJSON, simdjson, zlib) and pkgconf
#   wheels/ pure-Python wheels the checks import that a CUDA torch image
#           lacks (torchtune, for its OffloadActivations; pytest, where the
#           image has none)
#   tests/gpu/gather.sh [DIR]     (default: gpu-carry at the repo root)
# Prints the folder's size; fails above 48 MiB (what travels with the source
# tree to a GPU machine is 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=$(realpath -m "${1:-gpu-carry}")
LIMIT_MIB=${FERRY_GATHER_LIMIT_MIB:-48}
# Debian 12 names; each -dev package's runtime library is named beside it.
DEBS=(libluajit-5.1-2 libluajit-5.1-common libluajit-5.1-dev
      libjemalloc2 libjemalloc-dev
      libcjson1 libcjson-dev
      libsimdjson14 libsimdjson-dev
      zlib1g zlib1g-dev
      pkgconf-bin libpkgconf3)
# torchtune's activation offloading (tests/gpu/gpu_dropins.py loads its one
# module, not the package, whose __init__ needs torchao and HF datasets).
# pytest and what it imports, for an image without it (tests/gpu/gpu_pytest.py
# falls back to them, behind the image's own packages).
WHEELS=(torchtune==0.6.1 pytest==8.3.5 pluggy==1.5.0 iniconfig==2.0.0 packaging==24.2)
PIP=${PIP:-}
if [ -z "$PIP" ]; then
  for p in "$HOME/.cache/ferry/venv-torch2/bin/python" python3; do
    if "$p" -m pip --version >/dev/null 2>&1; then PIP="$p -m pip"; break; fi
  done
fi
[ -n "$PIP" ] || { echo "gather: no python with pip found (set PIP)" >&2; exit 2; }
command -v apt-get >/dev/null || { echo "gather: apt-get not found (a Debian 12 machine gathers)" >&2; exit 2; }

rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp/debs" "$DIR.tmp/wheels"
# apt's download runs as _apt where it can: a folder it may write to.
chmod 0777 "$DIR.tmp/debs" 2>/dev/null || true
download() { (cd "$DIR.tmp/debs" && apt-get download -qq "${DEBS[@]}"); }
# a machine whose package lists were never fetched (a fresh CI machine) fetches them once
download || { [ "$(id -u)" = 0 ] && apt-get update -qq && download; } ||
  { echo "gather: apt-get download failed (run 'apt-get update' first?)" >&2; rm -rf "$DIR.tmp"; exit 2; }
$PIP download -q --no-deps --only-binary=:all: -d "$DIR.tmp/wheels" "${WHEELS[@]}" ||
  { echo "gather: pip download failed" >&2; rm -rf "$DIR.tmp"; exit 2; }
for p in "${DEBS[@]}"; do
  ls "$DIR.tmp/debs/${p}_"*.deb >/dev/null 2>&1 || { echo "gather: $p missing" >&2; exit 1; }
done
printf '%s\n' "${DEBS[@]}" > "$DIR.tmp/debs/LIST"
rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
kib=$(du -sk "$DIR" | cut -f1)
echo "gather: $DIR holds $(ls "$DIR"/debs/*.deb | wc -l) debs and $(ls "$DIR"/wheels/*.whl | wc -l) wheels: $((kib / 1024)).$(( (kib % 1024) * 10 / 1024 )) MiB (limit $LIMIT_MIB MiB)"
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gather: $DIR is over $LIMIT_MIB MiB" >&2
  exit 1
fi
