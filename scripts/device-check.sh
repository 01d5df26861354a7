#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (one H200 here, its own Python and
# torch, no internet): builds swa_ext with its CUDA kernels in place against that
# torch, runs the CUDA golden replays, tests/test_cuda.py and the hostile-value runs
# on the device store (checks first, and checks in its ops), then the CUDA
# benchmarks, writing logs and results under $OUT (default out/device). One run
# fits in about 10 minutes:
#   device run: scripts/device-check.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/out/device}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" USE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
cd "$ROOT"
nvidia-smi -L >"$OUT/gpu.txt" 2>&1
"$PY" -c "import torch; print(torch.__version__, torch.version.cuda)" >>"$OUT/gpu.txt" 2>&1

# The bench package is bench/, installed as swa_ext_bench: give it that name here.
mkdir -p /tmp/swa_ext_path && ln -sfn "$ROOT/bench" /tmp/swa_ext_path/swa_ext_bench
export PYTHONPATH="$ROOT:/tmp/swa_ext_path"

"$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
"$PY" -c "import swa_ext; assert swa_ext.built_with_cuda()" || exit 1

"$PY" -m pytest tests/test_golden.py tests/test_cuda.py "tests/test_bad_input.py::test_hostile_values_are_refused_by_name_and_change_nothing" \
  "tests/test_bad_input.py::test_hostile_values_on_a_device_store_checking_in_its_ops" \
  -q -rs -s -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

timeout 300 "$PY" -m swa_ext bench --device cuda --json "$OUT/bench_cuda.json" --markdown "$OUT/bench_cuda.md" \
  --quiet 2>&1 | tail -40
timeout 120 "$PY" -m swa_ext_bench.bench_evict --device cuda 2>&1 | tee "$OUT/bench_evict_cuda.txt" | tail -20
exit "$tests_rc"
