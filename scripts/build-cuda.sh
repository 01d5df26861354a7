#!/usr/bin/env bash
# Builds swa_ext with its CUDA kernels against torch 2.14.1 (the CUDA 13.0 build) in
# .venv-cuda, out of tree in build/cuda-lib so the CPU build in swa_ext/ stays, then
# imports it. Runs on a machine without a GPU: compiling and linking is the check; the
# CUDA tests skip. Extra arguments go to the pytest run against this build;
# SWA_EXT_BUILD_ONLY=1 stops after the import. build/cuda-lib also gets swa_ext's
# dist-info, so that on PYTHONPATH SGLang finds its plugin entry point (tests/sglang).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SWA_EXT_CUDA_VENV:-$ROOT/.venv-cuda}"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import torch, pytest, hypothesis, ninja, numpy; assert torch.version.cuda" >/dev/null 2>&1; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.14.1" numpy pytest hypothesis tqdm matplotlib setuptools wheel ninja
fi

export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"  # nvcc on PATH may be a wrapper torch misreads
export USE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-2}"
cd "$ROOT"
# The Python files are copied afresh, so none that moved or left the wheel stays behind.
rm -rf build/cuda-lib/swa_ext_bench
if [[ -d build/cuda-lib ]]; then find build/cuda-lib -name '*.py' -delete; fi
"$PY" setup.py -q build_py --build-lib build/cuda-lib build_ext --build-lib build/cuda-lib --build-temp build/cuda-temp
rm -rf build/cuda-lib/swa_ext-*.dist-info
"$PY" setup.py -q dist_info --output-dir build/cuda-lib >/dev/null

export PYTHONPATH="$ROOT/build/cuda-lib"
cd /tmp
"$PY" -c "import swa_ext; assert swa_ext.built_with_cuda(), 'the CUDA kernels are missing'; print('swa_ext CUDA build imports; built_with_cuda() =', swa_ext.built_with_cuda())"
[[ "${SWA_EXT_BUILD_ONLY:-0}" == 1 ]] && exit 0
# The CUDA build's CPU paths, and the CUDA tests (which skip without a GPU, saying why).
"$PY" -m pytest "$ROOT/tests/test_golden.py" "$ROOT/tests/test_cuda.py" -q -rs -p no:cacheprovider "$@"
