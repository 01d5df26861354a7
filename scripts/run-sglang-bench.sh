#!/usr/bin/env bash
# A benchmark of bench/ beside SGLang's own code (swa_ext_bench.sglang_step by default, or
# the module named first: scripts/run-sglang-bench.sh swa_ext_bench --json out.json, the
# micro-benchmarks with SGLang's allocator as a reference), in the venv that
# scripts/setup-sglang.sh builds: swa_ext's CUDA build (build/cuda-lib) and the benchmarks
# (build/cuda-bench, a link to bench/) on the path, the checkout itself not (python -P),
# so that its CPU build in swa_ext/ is not imported. Extra arguments go to the module.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}"
PY="$VENV/bin/python"
if ! "$PY" -c "import sglang.srt.mem_cache.allocator.swa" >/dev/null 2>&1; then
  echo "run-sglang-bench: sglang is not importable in $VENV: run scripts/setup-sglang.sh first" >&2
  exit 1
fi
SWA_EXT_BUILD_ONLY=1 "$ROOT/scripts/build-cuda.sh" >/dev/null  # incremental: current with csrc/ and swa_ext/
mkdir -p "$ROOT/build/cuda-bench"
ln -sfn "$ROOT/bench" "$ROOT/build/cuda-bench/swa_ext_bench"
module=swa_ext_bench.sglang_step
if [[ $# -gt 0 && "$1" != -* ]]; then module="$1"; shift; fi
PYTHONPATH="$ROOT/build/cuda-lib:$ROOT/build/cuda-bench" exec "$PY" -P -m "$module" "$@"
