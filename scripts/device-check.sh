#!/usr/bin/env bash
# The GPU check, on a machine with one Hopper GPU, its own Python, torch and CUDA
# toolkit, and no network. It builds swa_ext with its CUDA kernels in place against that
# torch and runs, each phase under its own time limit and the whole under
# DEVICE_CHECK_SECONDS (default 420, about 7 minutes):
#   env        versions (nvcc, torch, GPU, compute-sanitizer)         -> env.txt
#   build      setup.py build_ext --inplace (and the bench's floor, in bench/); cuobjdump must
#              list sm_90                                            -> build.log (+ env.txt)
#   smoke      one golden trace on cuda, CUDA_LAUNCH_BLOCKING=1, 60 s  -> smoke.log
#   tests      the cuda parameters of the golden, cuda, bad-input, misuse and SGLang batch
#              reader tests                                          -> tests.log
#   layer      tests/test_cuda_layer.py: a pool past one grid pass against the CPU core, a
#              serving lifecycle on a side stream, launch errors, faults, GIL, uploads -> layer.log
#   latency    bench/deferred_error_latency.py: calls from a planted double free to its
#              DeferredError, device idle and busy                  -> summary.txt
#   bench      swa-ext bench on cuda (batch 1/256/2048, page 1/64, 0.25 s a case); every
#              row's results_match asserted                          -> bench.json, summary.txt
#   sanitizer  compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1) on two golden
#              traces (page sizes 1 and 16) and the misuse walk, with a fixed share of the
#              budget (SANITIZER_SECONDS) that the phases before it leave; a sanitizer that
#              does not support the machine is reported "unavailable", not failed -> sanitizer.log
# summary.txt gets one line per phase as it ends (a timeout keeps what finished); at
# most 8 files under $OUT (default out/device), none in a folder. Exit status: 0 when
# every phase passed.
#
# DEVICE_CHECK_DRY=1 runs the plumbing on a machine without a GPU (tests/test_device_check.py,
# so CI keeps it working): every phase's command is composed and written to its log, the
# pytest selections are collected and counted, the bench's assertion runs on a tiny
# CPU bench and the latency on the emulated device. DEVICE_CHECK_SANITIZER names the
# sanitizer command (default compute-sanitizer); when set, it runs in a dry run too (a
# test plants a fake one).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUDGET="${DEVICE_CHECK_SECONDS:-420}"
if [[ -z "${DEVICE_CHECK_TIMED:-}" ]]; then  # the whole script under one limit
  DEVICE_CHECK_TIMED=1 exec timeout -k 10 "$BUDGET" bash "${BASH_SOURCE[0]}" "$@"
fi
DRY="${DEVICE_CHECK_DRY:-0}"
OUT="${OUT:-$ROOT/out/device}"
PY="${PYTHON:-python3}"
PER_TEST=90  # seconds any one test may take
SANITIZER_SECONDS="${SANITIZER_SECONDS:-100}"  # kept for the sanitizer, the last phase
RESERVED=$SANITIZER_SECONDS  # seconds the phases before the sanitizer leave it
SANITIZER="${DEVICE_CHECK_SANITIZER:-compute-sanitizer}"
mkdir -p "$OUT"
cd "$ROOT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failed=()

if [[ -z "${CUDA_HOME:-}" ]]; then
  if [[ -d /usr/local/cuda ]]; then
    CUDA_HOME=/usr/local/cuda
  elif command -v nvcc >/dev/null; then
    CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  fi
fi
export CUDA_HOME="${CUDA_HOME:-}" USE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1 PATH="${CUDA_HOME:+$CUDA_HOME/bin:}$PATH"
# The bench package is bench/, installed from a checkout as swa_ext_bench: give it that name
# here, and run it as python -m swa_ext_bench (swa-ext bench finds it by its entry point).
LINKS="$(mktemp -d)"
ln -sfn "$ROOT/bench" "$LINKS/swa_ext_bench"
export PYTHONPATH="$ROOT:$LINKS${PYTHONPATH:+:$PYTHONPATH}"

note() { echo "$*" >>"$SUMMARY"; echo "device-check: $*" >&2; }

# phase NAME CAP LOG [--also-dry] CMD...: runs CMD (appending to $OUT/LOG) under
# min(CAP, the time left); in a dry run writes the command instead, unless --also-dry.
phase() {
  local name=$1 cap=$2 log=$3 t0=$SECONDS rc dry=$DRY
  shift 3
  if [[ "$1" == --also-dry ]]; then dry=0; shift; fi
  local left=$((BUDGET - SECONDS - 15 - RESERVED))
  if ((left < 20)); then
    note "$name: SKIPPED (out of time)"
    failed+=("$name")
    return
  fi
  local limit=$((cap < left ? cap : left))
  if [[ "$dry" == 1 ]]; then
    printf '%q ' timeout "$limit" "$@" >>"$OUT/$log"
    echo >>"$OUT/$log"
    rc=0
  else
    timeout -k 5 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
  fi
  note "$name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)$([[ $rc == 124 || $rc == 137 ]] && echo ' TIMED OUT')"
  ((rc == 0)) || failed+=("$name")
  return "$rc"
}

# ------------------------------------------------------------------ env
{
  date -u
  echo "CUDA_HOME=$CUDA_HOME"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  command -v nvcc >/dev/null && nvcc --version || echo "nvcc: not found"
  "$PY" - <<'EOF'
import platform, sys
import torch
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("pytest", "hypothesis", "numpy", "pytest_timeout"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "-", type(e).__name__)
EOF
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -1 || echo "compute-sanitizer: not found"
} >"$OUT/env.txt" 2>&1
note "env: written"

if "$PY" -c "import pytest_timeout" 2>/dev/null; then
  TIMEOUT_OPT=(--timeout "$PER_TEST")
else  # tracebacks of a hung test, which its phase's limit then ends
  TIMEOUT_OPT=(-o "faulthandler_timeout=$PER_TEST")
fi
PYTEST=("$PY" -m pytest -q -rs -p no:cacheprovider "${TIMEOUT_OPT[@]}")

# ------------------------------------------------------------------ build
# The bench's native-call floor (bench/floor.cpp) is its own module, built in bench/.
build_floor=(bash -c 'cd bench && "$0" setup.py -q build_ext --inplace' "$PY")
if [[ "$DRY" == 1 ]]; then
  phase build 240 build.log "$PY" setup.py build_ext --inplace
  phase floor 60 build.log "${build_floor[@]}"
else
  phase build 240 build.log "$PY" setup.py build_ext --inplace \
    && phase floor 60 build.log "${build_floor[@]}" \
    && phase import 30 build.log "$PY" -c "import torch, swa_ext
assert swa_ext.built_with_cuda(), 'no CUDA kernels'
assert torch.cuda.is_available(), 'torch sees no GPU: the CUDA tests would only skip'"
  so="$(ls swa_ext/_C*.so 2>/dev/null | head -n 1)"
  if [[ -n "$so" ]] && command -v cuobjdump >/dev/null; then
    cuobjdump --list-elf "$so" >>"$OUT/env.txt" 2>&1
    if cuobjdump --list-elf "$so" 2>/dev/null | grep -q sm_90; then note "cuobjdump: sm_90 code present"
    else note "cuobjdump: NO sm_90 code"; failed+=(sm_90); fi
  fi
  if [[ " ${failed[*]} " == *" build "* || " ${failed[*]} " == *" import "* ]]; then
    tail -40 "$OUT/build.log" >&2
    note "FAILED: ${failed[*]}"
    exit 1
  fi
fi

# ------------------------------------------------------------------ selections
# Node ids whose parameters name the cuda backend, one pytest collection for all files.
files=(tests/test_golden.py tests/test_cuda.py tests/test_bad_input.py tests/test_cuda_layer.py)
[[ -f tests/test_misuse.py ]] && files+=(tests/test_misuse.py)
[[ -f tests/test_sglang_reader.py ]] && files+=(tests/test_sglang_reader.py)
collected="$("$PY" -m pytest --collect-only -q -p no:cacheprovider "${files[@]}" 2>&1 | grep '::')"
cuda_nodes() { grep "^$1::" <<<"$collected" | grep -E '\[([^]]*-)?cuda(-[^]]*)?\]$' || true; }
mapfile -t golden < <(cuda_nodes tests/test_golden.py)
mapfile -t cuda_tests < <(cuda_nodes tests/test_cuda.py)
mapfile -t bad_input < <(cuda_nodes tests/test_bad_input.py)
mapfile -t misuse < <(cuda_nodes tests/test_misuse.py)
mapfile -t reader < <(cuda_nodes tests/test_sglang_reader.py)
mapfile -t layer < <(grep '^tests/test_cuda_layer.py::' <<<"$collected" | grep -v 'emulated' || true)
smoke_node="$(printf '%s\n' "${golden[@]}" | grep -m1 'ps1_' || true)"
# Under the memory checker: two golden traces (page sizes 1 and 16) and the misuse walk
# (its page sizes 1 and 16 where its ids say them; else its first two cuda nodes).
mapfile -t walk < <(printf '%s\n' "${misuse[@]}" | grep -E 'walk.*(ps1-|ps16)' | sort -u -t- -k2,2 | head -n 2)
((${#walk[@]})) || walk=("${misuse[@]:0:2}")
sanitized=("$smoke_node" "$(printf '%s\n' "${golden[@]}" | grep -m1 'ps16_' || true)" "${walk[@]}")
note "selected: golden ${#golden[@]}, cuda ${#cuda_tests[@]}, bad_input ${#bad_input[@]}, misuse ${#misuse[@]}, reader ${#reader[@]}, layer ${#layer[@]}, sanitized ${#sanitized[@]}"
if ((${#golden[@]} == 0 || ${#cuda_tests[@]} == 0 || ${#bad_input[@]} == 0 || ${#layer[@]} == 0)) || [[ -z "$smoke_node" ]]; then
  note "FAILED: a selection is empty"
  echo "$collected" | tail -20 >&2
  exit 1
fi

# ------------------------------------------------------------------ smoke, tests, layer
phase smoke 60 smoke.log env CUDA_LAUNCH_BLOCKING=1 "${PYTEST[@]}" "$smoke_node"
phase tests 150 tests.log "${PYTEST[@]}" "${golden[@]}" "${cuda_tests[@]}" "${bad_input[@]}" "${misuse[@]}" "${reader[@]}"
phase layer 60 layer.log "${PYTEST[@]}" -s "${layer[@]}"

# ------------------------------------------------------------------ latency
# Its lines go to summary.txt. A dry run measures the emulated device (the plumbing).
phase latency 45 summary.txt --also-dry "$PY" bench/deferred_error_latency.py \
  --kernels "$([[ "$DRY" == 1 ]] && echo emulated || echo cuda)"

# ------------------------------------------------------------------ bench
# Its table goes to summary.txt. A dry run runs it too, on the CPU and tiny: the plumbing.
if [[ "$DRY" == 1 ]]; then
  bench=(--device cpu --batch-sizes 1 --page-sizes 1 --ops alloc_decode --iters 3)
else
  bench=(--device cuda --batch-sizes 1 256 2048 --page-sizes 1 64 --seconds-per-case 0.25)
fi
phase bench 90 summary.txt --also-dry "$PY" -m swa_ext_bench "${bench[@]}" --no-sglang --quiet --json "$OUT/bench.json"
"$PY" - "$OUT/bench.json" >>"$SUMMARY" 2>&1 <<'EOF' || failed+=(bench_results_match)
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"bench: no rows ({e!r})")
bad = [(r["op"], r["batch_size"], r["page_size"], r["baseline_mismatch"]) for r in rows if r["results_match"] is not True]
print(f"bench: {len(rows)} rows; results_match on every row: {not bad and bool(rows)}", *bad)
sys.exit(1 if bad or not rows else 0)
EOF

# ------------------------------------------------------------------ sanitizer
RESERVED=0
sanitizer_dry=()
[[ -n "${DEVICE_CHECK_SANITIZER:-}" ]] && sanitizer_dry=(--also-dry)
if phase sanitizer "$SANITIZER_SECONDS" sanitizer.log "${sanitizer_dry[@]}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
  "$SANITIZER" --tool memcheck --error-exitcode 9 --print-limit 20 "${PYTEST[@]}" "${sanitized[@]}"; then :
elif grep -q "Device not supported" "$OUT/sanitizer.log" 2>/dev/null; then
  # Not a failure of ours: the memory checker cannot run on this machine's GPU runtime.
  unset 'failed[-1]'
  note "sanitizer: unavailable (compute-sanitizer: Device not supported on this machine's GPU runtime)"
fi

((${#failed[@]} == 0)) && note "ALL PASSED" || note "FAILED: ${failed[*]}"
((${#failed[@]} == 0))
