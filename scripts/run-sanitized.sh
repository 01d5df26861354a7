#!/usr/bin/env bash
# The core's ctest suite and the Python tests against an extension built with
# AddressSanitizer and UndefinedBehaviorSanitizer. Python itself is not sanitized, so
# the runtimes are preloaded and leak checking (which would report the interpreter's
# own allocations) is off. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"

cmake -S "$ROOT" -B "$ROOT/build/core-asan" -DSWA_EXT_SANITIZE=ON >/dev/null
cmake --build "$ROOT/build/core-asan" -j 2 >/dev/null
ctest --test-dir "$ROOT/build/core-asan" --output-on-failure

# A sanitized copy of the package, imported ahead of the editable install.
PKG="$ROOT/build/asan-pkg"
rm -rf "$PKG" && mkdir -p "$PKG"
cd "$ROOT"
SWA_EXT_SANITIZE=1 MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py -q build_ext \
  --build-temp "$ROOT/build/asan-temp" --build-lib "$PKG" >/dev/null
"$PY" - "$ROOT" "$PKG" <<'PYCOPY'
import shutil, sys
root, pkg = sys.argv[1], sys.argv[2]
skip = shutil.ignore_patterns("*.so", "__pycache__")
shutil.copytree(f"{root}/swa_ext", f"{pkg}/swa_ext", ignore=skip, dirs_exist_ok=True)
shutil.copytree(f"{root}/bench", f"{pkg}/swa_ext_bench", ignore=skip, dirs_exist_ok=True)
PYCOPY

ASAN_LIB="$(gcc -print-file-name=libasan.so)"
UBSAN_LIB="$(gcc -print-file-name=libubsan.so)"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
LD_PRELOAD="$ASAN_LIB:$UBSAN_LIB" "$PY" -c "import swa_ext, sys; sys.exit(0 if swa_ext.__file__.startswith('$PKG') else 'sanitized swa_ext not imported: ' + swa_ext.__file__)"
LD_PRELOAD="$ASAN_LIB:$UBSAN_LIB" exec "$PY" -m pytest tests -q -p no:cacheprovider "$@"
