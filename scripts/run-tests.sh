#!/usr/bin/env bash
# Every test: the C++ core's unit tests (ctest), the Python suite (pytest), and
# tests/sglang (SGLang's engine on swa_ext) in .venv-cuda when scripts/setup-sglang.sh
# has made it. What is not run is said at the end, one "not run:" line a group with the
# command that runs it (tests/conftest.py; tests/sglang's line here, without that venv).
# Arguments go to pytest. Options alone (--slow for the long fuzzing budgets, -x, -k EXPR,
# -m EXPR) apply to the whole run; test paths or node ids (tests/test_cli.py,
# tests/test_decode.py::test_x) run only those, with pytest, and skip ctest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"

# A test selection is an argument that names an existing file or directory, from the
# current directory (a node id is a path followed by ::). Option values such as -k's
# expression name none.
selected=() sglang_selected=() options=()
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    case "$(realpath "${arg%%::*}")" in
      "$ROOT/tests/sglang"*) sglang_selected+=("$(realpath "${arg%%::*}")${arg#"${arg%%::*}"}") ;;
      *) selected+=("$arg") ;;
    esac
  else
    options+=("$arg")
  fi
done

# tests/sglang run in the CUDA build's venv (torch 2.14.1, sglang 0.5.23) against
# build/cuda-lib, from outside the tree so that swa_ext/ (the CPU build) is not imported.
sglang_tests() {
  local py="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}/bin/python"
  if ! "$py" -c "import sglang.srt.mem_cache.allocator.swa" >/dev/null 2>&1; then
    echo "not run: tests/sglang (SGLang's engine, PD node and pair, the eviction hook; sglang is not importable" \
      "in ${py%/bin/python}): scripts/setup-sglang.sh, then scripts/run-tests.sh" >&2
    return 0
  fi
  SWA_EXT_BUILD_ONLY=1 "$ROOT/scripts/build-cuda.sh" >/dev/null  # incremental: current with csrc/ and swa_ext/
  echo "== tests/sglang (SGLang 0.5.23 on swa_ext, .venv-cuda)" >&2
  (cd /tmp && PYTHONPATH="$ROOT/build/cuda-lib" "$py" -m pytest -q -p no:cacheprovider "$@")
}

if (( ${#selected[@]} + ${#sglang_selected[@]} )); then
  echo "run-tests: pytest on the tests named (${selected[*]} ${sglang_selected[*]}); ctest skipped" >&2
  if (( ${#selected[@]} )); then "$VENV/bin/python" -m pytest -q "${options[@]}" "${selected[@]}"; fi
  if (( ${#sglang_selected[@]} )); then sglang_tests "${options[@]}" "${sglang_selected[@]}"; fi
  exit 0
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
"$VENV/bin/python" -m pytest tests -q --ignore=tests/sglang "$@"
sglang_tests "$@" "$ROOT/tests/sglang"
