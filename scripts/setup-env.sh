#!/usr/bin/env bash
# Creates .venv (torch 2.13.0 CPU and the test/plot dependencies) if needed and builds
# swa_ext into it in place, with the benchmarks (bench/, the swa_ext_bench package that
# swa_ext's wheel leaves out) beside it. Sourced by the other scripts; safe to run again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SWA_EXT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import torch, pytest, hypothesis, tqdm, matplotlib, ninja" >/dev/null 2>&1; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.13.0" numpy pytest hypothesis tqdm matplotlib setuptools wheel ninja
fi
# Build (against the venv's torch) unless the installed extension is newer than every
# native source.
SO="$(ls "$ROOT"/swa_ext/_C*.so 2>/dev/null | head -n 1 || true)"
if [[ -z "$SO" || -n "$(find "$ROOT/csrc" "$ROOT/setup.py" -newer "$SO" -print -quit)" ]] \
   || ! "$PY" -c "import swa_ext.simulator" >/dev/null 2>&1 || [[ ! -x "$VENV/bin/swa-ext" ]]; then
  echo "building swa_ext (a few minutes the first time)..." >&2
  MAX_JOBS="${MAX_JOBS:-2}" "$PY" -m pip install -q --no-build-isolation --no-deps -e "$ROOT"
fi
if ! "$PY" -c "import swa_ext_bench.micro" >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-build-isolation --no-deps -e "$ROOT/bench"
fi
