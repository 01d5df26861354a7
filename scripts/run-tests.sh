#!/usr/bin/env bash
# Every test: the C++ core's unit tests (ctest) and the Python suite (pytest).
# Extra arguments go to pytest (for example --slow for the long fuzzing budgets).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"

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
