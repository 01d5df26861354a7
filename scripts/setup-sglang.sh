#!/usr/bin/env bash
# SGLang 0.5.23 for tests/sglang: installs it, and what its CPU engine imports, into the
# CUDA build's venv (.venv-cuda, torch 2.14.1), and builds swa_ext there (build/cuda-lib,
# with the dist-info that carries its sglang.srt.plugins entry point). Safe to run again.
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
"$PY" -c "import sglang.srt.mem_cache.allocator.swa" >/dev/null 2>&1 \
  && echo "setup-sglang: sglang 0.5.23 importable in $VENV" >&2
