"""SGLang's plugin hook for swa_ext (entry point group ``sglang.srt.plugins``).

SGLang calls ``plugin()`` in each of its processes. It imports nothing of SGLang's and
changes nothing unless ``SWA_EXT_SGLANG`` is set, the one switch (swa_ext.sglang says what
each value serves): ``1``, ``all``, ``lockstep`` or ``shared`` (one budget for full and
SWA pages, docs/sglang.md).

SGLang's plugin loader logs and goes on past any ``Exception`` a plugin raises, which
would leave SGLang serving on its own allocator with the cause somewhere in a long log.
So whatever keeps swa_ext from serving what the switch asks ends the process here, before
anything of SGLang's is patched: ``SystemExit`` with one line that begins ``swa_ext:``,
names the cause and what to do. The causes: a value that is not a mode, an ``SWA_EXT_``
variable swa_ext does not know (a misspelt setting, or a misspelt switch: this one is
refused with the switch unset too), an SGLang other than the supported
one, a seam of SGLang's that moved (swa_ext.sglang_seams), an install that failed.
"""
import os

from . import sglang_seams

MODE_VARIABLE = "SWA_EXT_SGLANG"
# Each value of the switch, and what swa_ext then serves (docs/sglang.md).
MODES_SERVE = {
    "1": "swa_ext's hybrid SWA allocator for SWA models (SGLang's own pools for other models)",
    "all": "swa_ext's hybrid SWA allocator and its page and token pools for other models",
    "lockstep": "as all, with SGLang's own allocator shadowing every call (a debugging mode)",
    "shared": "swa_ext's shared mode: one budget of pages for full and SWA KV",
}
MODES = tuple(MODES_SERVE)
# The shared mode's switch before it became a value of SWA_EXT_SGLANG: set, it is refused
# with the spelling that replaces it rather than ignored.
RETIRED_SHARED_VARIABLE = "SWA_EXT_SHARED"
PREFIX = "SWA_EXT_"

# Every SWA_EXT_ variable there is, with what reads it; any other is refused while
# SWA_EXT_SGLANG is set. Those swa_ext reads when serving:
VARIABLES = {
    MODE_VARIABLE: "the mode",
    "SWA_EXT_DEBUG": "the shared mode's per-step slot-kind check",
    "SWA_EXT_LOCKSTEP_REPORT": "lockstep mode's per-call counts file",
    sglang_seams.VERSION_OVERRIDE_VARIABLE: "try an SGLang other than the supported one",
    "SWA_EXT_EMULATED_THREADS": "the native host executor's threads",
    "SWA_EXT_EMULATED_ORDER_OFFSET": "the native host executor's order offset",
}
# Those only the project's tests, benchmarks and build scripts read (they pass them to
# the SGLang processes they start).
TEST_AND_BUILD_VARIABLES = {
    "SWA_EXT_BUILD_ONLY": "scripts: build, run no test",
    "SWA_EXT_CUDA_VENV": "scripts: the CUDA build's virtual environment",
    "SWA_EXT_VENV": "scripts/setup-env.sh: the virtual environment",
    "SWA_EXT_SANITIZE": "setup.py: a sanitizer build",
    "SWA_EXT_SANITIZER": "scripts/run-sanitized.sh: which sanitizer",
    "SWA_EXT_SOAK_RSS_BOUND_MIB": "tests/test_soak.py: the memory bound",
    "SWA_EXT_PD_PROBE_DIR": "tests/sglang: the PD probe's output folder",
    "SWA_EXT_SPEC_BRIDGES": "tests/sglang: speculative decoding bridges",
    "SWA_EXT_TEST_KV_FAULT": "tests/sglang: a planted KV fault",
    "SWA_EXT_TEST_DUMMY_WEIGHTS": "tests/sglang: the range of SGLang's dummy weights",
    "SWA_EXT_EVICT_TIMES": "tests/sglang: the eviction timer's output",
    "SWA_EXT_FAULTS_LOAD_WAVES": "tests/sglang/test_faults.py: the load waves",
}
KNOWN_VARIABLES = frozenset(VARIABLES) | frozenset(TEST_AND_BUILD_VARIABLES) | {RETIRED_SHARED_VARIABLE}


def mode_from_environment(environ=os.environ):
    """The SWA_EXT_SGLANG value to serve (None: swa_ext serves nothing), or SystemExit
    with the one line that says why the environment asks for nothing swa_ext serves."""
    mode = environ.get(MODE_VARIABLE, "").strip()
    if RETIRED_SHARED_VARIABLE in environ:
        raise SystemExit(f"swa_ext: {RETIRED_SHARED_VARIABLE} is gone: the shared mode is {MODE_VARIABLE}=shared "
                         f"(unset {RETIRED_SHARED_VARIABLE}; {MODE_VARIABLE} is {mode or 'unset'} now)")
    # Checked with the switch unset too: a typo in the switch's own name would otherwise
    # leave SGLang on its own allocators without a word. An environment scan, no import.
    unknown = sorted(name for name in environ if name.startswith(PREFIX) and name not in KNOWN_VARIABLES)
    if unknown:
        raise SystemExit(f"swa_ext: {', '.join(unknown)}: no such swa_ext setting (misspelt?): unset it; swa_ext "
                         f"reads {', '.join(sorted(VARIABLES))}")
    if mode in ("", "0"):
        return None
    if mode not in MODES:
        raise SystemExit(f"swa_ext: {MODE_VARIABLE}={mode!r} is not a mode: set it to one of {', '.join(MODES)} "
                         f"(or unset it, or 0, for SGLang's own allocators)")
    return mode


def refusal(environ=os.environ):
    """Why swa_ext cannot serve on the installed SGLang (its version, its seams), or None.
    Imports the SGLang modules the seams are in."""
    why = sglang_seams.version_refusal(environ)
    if why is not None:
        return why
    moved = sglang_seams.moved()
    if moved:
        return (f"SGLang {sglang_seams.installed_version()} moved {len(moved)} of the seams swa_ext patches or "
                f"calls: {'; '.join(f'{seam} {why}' for seam, why in moved)} (unset {MODE_VARIABLE} for SGLang's "
                f"own allocators, or install sglang=={sglang_seams.SUPPORTED_VERSION})")
    return None


def checked_mode(environ=os.environ):
    """The mode swa_ext serves in an SGLang process started in ``environ`` (None: nothing
    is asked), or SystemExit with the one line that says why it cannot."""
    mode = mode_from_environment(environ)
    if mode is None:
        return None
    why = refusal(environ)
    if why is not None:
        raise SystemExit(f"swa_ext: {MODE_VARIABLE}={mode} cannot serve: {why}")
    return mode


def _one_line(error):
    return " ".join(f"{type(error).__name__}: {error}".split())


def plugin():
    """Installs swa_ext's allocators in this SGLang process as SWA_EXT_SGLANG says."""
    mode = checked_mode()
    if mode is None:
        return
    try:
        from . import sglang

        sglang.install(single_pool=mode in ("all", "lockstep"), lockstep=mode == "lockstep", shared=mode == "shared")
    except Exception as e:  # install() has left SGLang unpatched
        raise SystemExit(f"swa_ext: {MODE_VARIABLE}={mode}: installing swa_ext in SGLang "
                         f"{sglang_seams.installed_version()} failed, nothing is patched: {_one_line(e)} (a seam "
                         f"swa_ext.sglang_seams does not list? report it; unset {MODE_VARIABLE} for SGLang's own "
                         f"allocators)") from e
