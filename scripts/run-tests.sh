#!/usr/bin/env bash
# Every test: the C++ core's unit tests (ctest) and the Python suite (pytest).
# Arguments go to pytest. Options alone (--slow for the long fuzzing budgets, -x, -k EXPR,
# -m EXPR) apply to the whole run; test paths or node ids (tests/test_cli.py,
# tests/test_decode.py::test_x) run only those, with pytest, and skip ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"

# A test selection is an argument that names an existing file or directory, from the
# current directory (a node id is a path followed by ::). Option values such as -k's
# expression name none.
selected=()
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    selected+=("$arg")
  fi
done
if (( ${#selected[@]} )); then
  echo "run-tests: pytest on the tests named (${selected[*]}); ctest skipped" >&2
  exec "$VENV/bin/python" -m pytest -q "$@"
fi

if [[ ! -f /usr/include/gtest/gtest.h ]]; then
  if [[ "$(id -u)" == 0 ]]; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
  else
    echo "run-tests: googletest is missing: sudo apt-get install libgtest-dev" >&2
    exit 1
  fi
fi
cmake -S "$ROOT" -B "$ROOT/build/core" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$ROOT/build/core" -j 2 >/dev/null
ctest --test-dir "$ROOT/build/core" --output-on-failure

cd "$ROOT"
exec "$VENV/bin/python" -m pytest tests -q "$@"
