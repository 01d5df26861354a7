#!/usr/bin/env bash
# The core's ctest suite and the Python tests against an extension built with
# AddressSanitizer and UndefinedBehaviorSanitizer, or with SWA_EXT_SANITIZER=thread
# with ThreadSanitizer (for the threaded emulation: pass --emulated-threads N to
# pytest). Python itself is not sanitized, so the runtimes are preloaded and leak
# checking (which would report the interpreter's own allocations) is off. Extra
# arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup-env.sh"

case "${SWA_EXT_SANITIZER:-address}" in
  address)
    CMAKE_FLAG=-DSWA_EXT_SANITIZE=ON BUILD_FLAG=1 MARK=__asan_report
    RUNTIMES="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    export SWA_EXT_SOAK_RSS_BOUND_MIB=320  # ASan's quarantine holds up to 256 MiB of freed memory
    ;;
  thread)
    CMAKE_FLAG=-DSWA_EXT_TSAN=ON BUILD_FLAG=thread MARK=__tsan_read
    RUNTIMES="$(gcc -print-file-name=libtsan.so)"
    # exitcode: a report fails the run even where pytest would otherwise pass.
    export TSAN_OPTIONS="halt_on_error=1:exitcode=66:report_signal_unsafe=0"
    ;;
  *)
    echo "run-sanitized: SWA_EXT_SANITIZER: expected 'address' or 'thread', got '$SWA_EXT_SANITIZER'" >&2
    exit 2
    ;;
esac
KIND="${SWA_EXT_SANITIZER:-address}"

cmake -S "$ROOT" -B "$ROOT/build/core-$KIND" "$CMAKE_FLAG" >/dev/null
cmake --build "$ROOT/build/core-$KIND" -j 2 >/dev/null
ctest --test-dir "$ROOT/build/core-$KIND" --output-on-failure

# The sanitized extension is built beside the regular one (build/$KIND-lib, with the
# package's Python files) and imported from there: nothing in the source tree changes, so
# other runs may use the tree meanwhile (.ci/run runs this beside scripts/run-tests.sh).
cd "$ROOT"
LIB="$ROOT/build/$KIND-lib"
if [[ -d "$LIB" ]]; then find "$LIB" -name '*.py' -delete; fi
SWA_EXT_SANITIZE="$BUILD_FLAG" MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py -q build_py --build-lib "$LIB" \
  build_ext --build-lib "$LIB" --build-temp "$ROOT/build/$KIND-temp" >/dev/null
SANITIZED_SO="$(ls "$LIB"/swa_ext/_C*.so)"

# Proof that the sanitized build is the one under test. (Not grep -q: it stops reading
# at the first match, nm dies of SIGPIPE, and pipefail turns the match into a failure.)
nm -D "$SANITIZED_SO" | grep "$MARK" >/dev/null || { echo "run-sanitized: $SANITIZED_SO is not instrumented" >&2; exit 1; }

# PYTHONSAFEPATH: no current directory on sys.path (in pytest and in the processes the
# tests start), so the swa_ext imported is the one on PYTHONPATH, as this checks.
export PYTHONPATH="$LIB" PYTHONSAFEPATH=1 LD_PRELOAD="$RUNTIMES"
[[ "$("$PY" -c 'from swa_ext import _C; print(_C.__file__)')" == "$SANITIZED_SO" ]] \
  || { echo "run-sanitized: python does not import $SANITIZED_SO" >&2; exit 1; }
# --capture=sys: a sanitizer report is written to file descriptor 2 just before the
# process aborts, so pytest must not be holding that descriptor.
"$PY" -m pytest -q -p no:cacheprovider --capture=sys "$@"
