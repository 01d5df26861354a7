#!/usr/bin/env bash
# SGLang 0.5.23 for tests/sglang: installs it, and what its CPU engine imports, into the
# CUDA build's venv (.venv-cuda, torch 2.14.1), and builds swa_ext there (build/cuda-lib,
# with the dist-info that carries its sglang.srt.plugins entry point). Beside it, what a
# prefill/decode pair needs (tests/sglang/test_pd_pair.py, scripts/run-pd-demo.sh): SGLang's
# router and the Mooncake transfer engine (tests/sglang/requirements-pd.txt). Safe to run again.
# scripts/run-tests.sh then runs tests/sglang in that venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}"
PY="$VENV/bin/python"

SWA_EXT_BUILD_ONLY=1 "$ROOT/scripts/build-cuda.sh"
if ! "$PY" -c "import sglang.srt.mem_cache.allocator.swa, uvloop, xgrammar, compressed_tensors, safetensors" >/dev/null 2>&1; then
  echo "installing sglang 0.5.23 and its CPU engine's imports into $VENV..." >&2
  "$PY" -m pip install -q -r "$ROOT/tests/sglang/requirements.txt"
  # Their declared dependencies would replace torch 2.14.1 (or pull CUDA-only packages).
  "$PY" -m pip install -q --no-deps "sglang==0.5.23" "xgrammar==0.2.7" "compressed-tensors==0.18.0"
fi
if ! "$PY" -c "import mooncake.engine, sglang_router, jsonschema, soundfile" >/dev/null 2>&1; then
  echo "installing the prefill/decode pair's transfer engine and router into $VENV..." >&2
  # The Mooncake engine built without CUDA still links libibverbs (it runs over TCP here).
  if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
    if [[ "$(id -u)" == 0 ]]; then
      apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
    else
      echo "setup-sglang: libibverbs.so.1 is missing: sudo apt-get install libibverbs1" >&2
    fi
  fi
  "$PY" -m pip install -q -r "$ROOT/tests/sglang/requirements-pd.txt"
  # The router's declared dependencies are in requirements.txt already, at the pinned versions.
  "$PY" -m pip install -q --no-deps "sglang-router==0.3.2"
fi
"$PY" -c "import sglang.srt.mem_cache.allocator.swa" >/dev/null 2>&1 \
  && echo "setup-sglang: sglang 0.5.23 importable in $VENV" >&2
