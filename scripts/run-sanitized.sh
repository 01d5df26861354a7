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

# The sanitized extension replaces the built one in place for this run (the editable
# install imports from the source tree); the regular one is put back on exit.
cd "$ROOT"
REGULAR_SO="$(ls swa_ext/_C*.so)"
mkdir -p build
cp "$REGULAR_SO" build/regular_C.so
trap 'cp "$ROOT/build/regular_C.so" "$ROOT/$REGULAR_SO"' EXIT
SWA_EXT_SANITIZE="$BUILD_FLAG" MAX_JOBS="${MAX_JOBS:-2}" "$PY" setup.py -q build_ext --inplace \
  --build-temp "$ROOT/build/$KIND-temp" >/dev/null

# Proof that the sanitized build is the one under test. (Not grep -q: it stops reading
# at the first match, nm dies of SIGPIPE, and pipefail turns the match into a failure.)
nm -D "$REGULAR_SO" | grep "$MARK" >/dev/null || { echo "run-sanitized: $REGULAR_SO is not instrumented" >&2; exit 1; }

export LD_PRELOAD="$RUNTIMES"
# --capture=sys: a sanitizer report is written to file descriptor 2 just before the
# process aborts, so pytest must not be holding that descriptor.
"$PY" -m pytest -q -p no:cacheprovider --capture=sys "$@"
