#!/usr/bin/env bash
# Runs the ferry Python tests (pytest) with every interpreter that has a
# torch: Debian's /usr/bin/python3 (torch 1.13) and the venv that
# .ci/python-env creates (torch 2.x, transformers, torchvision).
#   BUILD=build tests/python/run.sh [pytest args]
# Under CI (CI=true) a missing interpreter, venv or test dependency fails the
# run; a local run skips it with a loud summary. FERRY_SKIP_VENV=1 skips the
# venv (locally). The venv must import every module in VENV_MODULES.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD=${BUILD:-build}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PYPATH="$BUILD/python"
if [ ! -d "$PYPATH/ferry" ]; then
  echo "tests/python/run.sh: $PYPATH/ferry does not exist: build first (cmake --build $BUILD)" >&2
  exit 1
fi

status=0
ran=()
skipped=()

run_with() { # python label
  local py=$1 label=$2
  shift 2
  if ! PYTHONPATH="$PYPATH" "$py" -c "import ferry._ferry" 2>/tmp/ferry-import.$$; then
    echo "FAILED: $label: the ferry extension does not import with $py:" >&2
    cat /tmp/ferry-import.$$ >&2
    echo "(re-run cmake -S . -B $BUILD so that it builds the module for this interpreter)" >&2
    rm -f /tmp/ferry-import.$$
    status=1
    return
  fi
  rm -f /tmp/ferry-import.$$
  local tv
  tv=$("$py" -c "import torch; print(torch.__version__)")
  printf '\n---- pytest: %s (%s, torch %s) ----\n' "$label" "$py" "$tv"
  if PYTHONPATH="$PYPATH" "$py" -m pytest -q -p no:cacheprovider tests/python "$@"; then
    ran+=("$label (torch $tv): passed")
  else
    ran+=("$label (torch $tv): FAILED")
    status=1
  fi
}

if /usr/bin/python3 -c "import torch, pytest" 2>/dev/null; then
  run_with /usr/bin/python3 "Debian python3" "$@"
else
  skipped+=("Debian /usr/bin/python3: no torch/pytest (apt-get install python3-torch python3-pytest python3-numpy)")
fi

if [ "${FERRY_SKIP_VENV:-0}" = 1 ]; then
  skipped+=("torch 2.x venv: FERRY_SKIP_VENV=1")
else
  venv_out=$(.ci/python-env)
  rc=$?
  if [ $rc -eq 0 ]; then
    FERRY_REQUIRE_MODULES="torch torchvision transformers accelerate lightning numpy" \
      run_with "$(printf '%s\n' "$venv_out" | tail -1)" "torch 2.x venv" "$@"
  else
    skipped+=("torch 2.x venv: .ci/python-env failed with exit $rc (PyPI unreachable or pip failed; see above): torch 2.x, transformers and torch.compile tests were NOT run")
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
