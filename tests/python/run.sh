#!/usr/bin/env bash
# Runs the ferry Python tests (pytest) against the INSTALLED package, as
# users get it: `python -m build` makes the sdist and, from it, the wheel
# (pyproject.toml, scikit-build-core driving the project's CMake); the wheel
# goes into fresh virtual environments, one per torch:
#   deb    Debian's /usr/bin/python3 with its system packages (torch 1.13)
#   torch2 the interpreter of the venv .ci/python-env keeps (torch 2.x,
#          Lightning, transformers, accelerate), its packages reached through
#          a .pth file so the heavy wheels are not downloaded again
# and pytest runs there with no PYTHONPATH; conftest checks that `ferry` is
# the installed one (FERRY_EXPECT_INSTALLED).
#   BUILD=build tests/python/run.sh [pytest args]
# Under CI (CI=true) a missing interpreter, venv or test dependency fails the
# run; a local run skips it with a loud summary. FERRY_SKIP_VENV=1 skips the
# torch 2.x environment (locally); without it no wheel can be built and the
# Debian run falls back to the build tree (PYTHONPATH=<build>/python), said
# in the summary.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-build}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac

status=0
ran=()
skipped=()

# run_with PYTHON LABEL [pytest args]: pytest in the environment of PYTHON,
# with the package it imports (installed, or the build tree's via PYTHONPATH
# set by the caller).
run_with() {
  local py=$1 label=$2
  shift 2
  if ! "$py" -c "import ferry._ferry" 2>/tmp/ferry-import.$$; then
    echo "FAILED: $label: ferry does not import with $py:" >&2
    cat /tmp/ferry-import.$$ >&2
    rm -f /tmp/ferry-import.$$
    ran+=("$label: FAILED (ferry does not import)")
    status=1
    return
  fi
  rm -f /tmp/ferry-import.$$
  local tv where
  tv=$("$py" -c "import torch; print(torch.__version__)")
  where=$("$py" -c "import ferry, os; print(os.path.dirname(ferry.__file__))")
  printf '\n---- pytest: %s (%s, torch %s, ferry from %s) ----\n' "$label" "$py" "$tv" "$where"
  if "$py" -m pytest -q -p no:cacheprovider tests/python "$@"; then
    ran+=("$label (torch $tv, ferry from $where): passed")
  else
    ran+=("$label (torch $tv, ferry from $where): FAILED")
    status=1
  fi
}

# fresh_venv DIR BASE_PYTHON [--system-site-packages] [DEPS_SITE]: a new venv
# with the wheel installed (nothing else from the index).
fresh_venv() {
  local dir=$1 base=$2 flag=${3:-} deps=${4:-}
  rm -rf "$dir"
  "$base" -m venv $flag "$dir" || return 1
  if [ -n "$deps" ]; then
    local site
    site=$("$dir/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$deps" >"$site/ferry-test-deps.pth"
  fi
  "$dir/bin/python" -m pip install --quiet --no-deps --no-index "$WHEEL" >&2
}

run_installed() { # LABEL DIR [pytest args]
  local label=$1 dir=$2
  shift 2
  FERRY_EXPECT_INSTALLED="$dir" FERRY_BIN="$dir/bin/ferry" run_with "$dir/bin/python" "$label" "$@"
}

venv_py=""
if [ "${FERRY_SKIP_VENV:-0}" = 1 ]; then
  skipped+=("torch 2.x venv: FERRY_SKIP_VENV=1")
else
  venv_out=$(.ci/python-env)
  rc=$?
  if [ $rc -eq 0 ]; then
    venv_py=$(printf '%s\n' "$venv_out" | tail -1)
  else
    skipped+=("torch 2.x venv: .ci/python-env failed with exit $rc (PyPI unreachable or pip failed; see above): torch 2.x, Lightning, transformers and torch.compile tests were NOT run")
  fi
fi

# The sdist and the wheel, built by the venv's interpreter (it has
# scikit-build-core and build; the wheel's cp3X tag fits Debian's python3 of
# the same minor version).
WHEEL=""
if [ -n "$venv_py" ]; then
  dist="$BUILD/dist"
  rm -rf "$dist"
  printf '\n---- python -m build: sdist, then the wheel from it ----\n'
  if "$venv_py" -m build --no-isolation --outdir "$dist" . >"$BUILD/dist.log" 2>&1; then
    WHEEL=$(ls "$dist"/ferry-*.whl)
    echo "built $(cd "$dist" && ls)"
  else
    tail -40 "$BUILD/dist.log" >&2
    echo "FAILED: python -m build (log: $BUILD/dist.log)" >&2
    ran+=("python -m build: FAILED")
    status=1
  fi
fi

if /usr/bin/python3 -c "import torch, pytest" 2>/dev/null; then
  if [ -n "$WHEEL" ]; then
    if fresh_venv "$BUILD/venv-test-deb" /usr/bin/python3 --system-site-packages; then
      run_installed "Debian python3, installed wheel" "$BUILD/venv-test-deb" "$@"
    else
      ran+=("Debian python3: FAILED (fresh venv with the wheel)")
      status=1
    fi
  elif [ -d "$BUILD/python/ferry" ]; then
    skipped+=("installed-package run with Debian python3: no wheel (needs the torch 2.x venv); ran the build tree instead")
    PYTHONPATH="$BUILD/python" run_with /usr/bin/python3 "Debian python3, build tree" "$@"
  fi
else
  skipped+=("Debian /usr/bin/python3: no torch/pytest (apt-get install python3-torch python3-pytest python3-numpy)")
fi

if [ -n "$venv_py" ] && [ -n "$WHEEL" ]; then
  deps=$("$venv_py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if fresh_venv "$BUILD/venv-test-torch2" "$venv_py" "" "$deps"; then
    # the wheel was built by this interpreter (--no-isolation): it carries
    # the tensor-facts module for its torch (bindings/python/ext/torch_facts.h)
    FERRY_REQUIRE_MODULES="torch torchvision transformers accelerate lightning numpy" \
      FERRY_EXPECT_TORCH_FACTS=1 run_installed "torch 2.x, installed wheel" "$BUILD/venv-test-torch2" "$@"
  else
    ran+=("torch 2.x: FAILED (fresh venv with the wheel)")
    status=1
  fi
fi

printf '\n---- python tests summary ----\n'
for r in "${ran[@]}"; do echo "ran: $r"; done
for s in "${skipped[@]}"; do echo "SKIPPED: $s"; done
if [ ${#skipped[@]} -gt 0 ]; then
  if [ "${CI:-}" = true ]; then
    echo "FAILED: under CI every Python test environment must run (${#skipped[@]} skipped, above)" >&2
    status=1
  else
    printf '\n*** %d Python test environment(s) SKIPPED: the tests above did not all run ***\n' \
      "${#skipped[@]}" >&2
  fi
fi
if [ ${#ran[@]} -eq 0 ]; then
  echo "no interpreter with torch could run the tests" >&2
  exit 1
fi
exit $status
