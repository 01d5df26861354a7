#!/usr/bin/env bash
# SGLang 0.5.23 for tests/sglang: installs it, and what its CPU engine imports, into the
# CUDA build's venv (.venv-cuda, torch 2.14.1), and builds swa_ext there (build/cuda-lib,
# with the dist-info that carries its sglang.srt.plugins entry point). Beside it, what a
# prefill/decode pair needs (tests/sglang/test_pd_pair.py, scripts/run-pd-demo.sh): SGLang's
# router and the Mooncake transfer engine (tests/sglang/requirements-pd.txt). Safe to run again.
# scripts/run-tests.sh then runs tests/sglang in that venv.
# pip's and the compiler's output go to build/setup-sglang.log; the terminal gets a summary.
# SGLang is installed without its declared dependencies (they would replace torch 2.14.1 or
# pull CUDA-only packages), so pip's resolver lists them as unmet: expected, and counted.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}"
PY="$VENV/bin/python"
mkdir -p "$ROOT/build"
LOG="$ROOT/build/setup-sglang.log"
: > "$LOG"

# Runs a step with its output in the log; on failure shows the log's end and stops.
logged() {
  local what="$1"; shift
  if ! "$@" >>"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "setup-sglang: $what failed (the whole output: $LOG)" >&2
    exit 1
  fi
}

echo "setup-sglang: building swa_ext with its CUDA kernels in build/cuda-lib (minutes the first time)..." >&2
logged "the CUDA build" env SWA_EXT_BUILD_ONLY=1 "$ROOT/scripts/build-cuda.sh"
if ! "$PY" -c "import sglang.srt.mem_cache.allocator.swa, uvloop, xgrammar, compressed_tensors, safetensors" >/dev/null 2>&1; then
  echo "setup-sglang: installing sglang 0.5.23 and its CPU engine's imports into $VENV..." >&2
  logged "installing tests/sglang/requirements.txt" "$PY" -m pip install -q -r "$ROOT/tests/sglang/requirements.txt"
  logged "installing sglang" "$PY" -m pip install -q --no-deps "sglang==0.5.23" "xgrammar==0.2.7" "compressed-tensors==0.18.0"
fi
if ! "$PY" -c "import mooncake.engine, sglang_router, jsonschema, soundfile" >/dev/null 2>&1; then
  echo "setup-sglang: installing the prefill/decode pair's transfer engine and router into $VENV..." >&2
  # The Mooncake engine built without CUDA still links libibverbs (it runs over TCP here).
  if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    if [[ "$(id -u)" == 0 ]]; then
      logged "installing libibverbs1" bash -c "apt-get update -qq && apt-get install -y -qq libibverbs1"
    else
      echo "setup-sglang: libibverbs.so.1 is missing: sudo apt-get install libibverbs1" >&2
    fi
  fi
  logged "installing tests/sglang/requirements-pd.txt" "$PY" -m pip install -q -r "$ROOT/tests/sglang/requirements-pd.txt"
  # The router's declared dependencies are in requirements.txt already, at the pinned versions.
  logged "installing sglang-router" "$PY" -m pip install -q --no-deps "sglang-router==0.3.2"
fi
unmet="$(grep -c ' requires .*, which is not installed\| requires .*, but you have ' "$LOG" || true)"
if ! "$PY" -c "import sglang.srt.mem_cache.allocator.swa" >/dev/null 2>&1; then
  echo "setup-sglang: sglang is still not importable in $VENV (the whole output: $LOG)" >&2
  exit 1
fi
"$PY" - "$VENV" "$unmet" "$LOG" >&2 <<'PY'
import sys
from importlib.metadata import version

venv, unmet, log = sys.argv[1:]
print(f"setup-sglang: done: sglang {version('sglang')}, torch {version('torch')} in {venv}; "
      "swa_ext's CUDA build in build/cuda-lib")
if int(unmet):
    print(f"setup-sglang: pip listed {unmet} declared requirements as unmet: installed without them on purpose "
          f"(they would replace torch or need CUDA); the list and pip's output: {log}")
PY
