"""SGLang's plugin hook for swa_ext (entry point group ``sglang.srt.plugins``).

SGLang calls ``plugin()`` in each of its processes. It imports nothing of SGLang's and
changes nothing unless ``SWA_EXT_SGLANG`` is set, the one switch (swa_ext.sglang says what
each value serves): ``1``, ``all``, ``lockstep`` or ``shared`` (one budget for full and
SWA pages, docs/sglang.md).

SGLang's plugin loader logs and goes on past any ``Exception`` a plugin raises, which
would leave SGLang serving on its own allocator with the cause somewhere in a long log.
So a value swa_ext cannot serve ends the process here: ``SystemExit`` with one line that
begins ``swa_ext:``, names the cause and what to do.
"""
import os

MODE_VARIABLE = "SWA_EXT_SGLANG"
MODES = ("1", "all", "lockstep", "shared")
# The shared mode's switch before it became a value of SWA_EXT_SGLANG: set, it is refused
# with the spelling that replaces it rather than ignored.
RETIRED_SHARED_VARIABLE = "SWA_EXT_SHARED"


def mode_from_environment(environ=os.environ):
    """The SWA_EXT_SGLANG value to serve (None: swa_ext serves nothing), or SystemExit
    with the one line that says why the environment asks for nothing swa_ext serves."""
    mode = environ.get(MODE_VARIABLE, "").strip()
    if RETIRED_SHARED_VARIABLE in environ:
        raise SystemExit(f"swa_ext: {RETIRED_SHARED_VARIABLE} is gone: the shared mode is {MODE_VARIABLE}=shared "
                         f"(unset {RETIRED_SHARED_VARIABLE}; {MODE_VARIABLE} is {mode or 'unset'} now)")
    if mode in ("", "0"):
        return None
    if mode not in MODES:
        raise SystemExit(f"swa_ext: {MODE_VARIABLE}={mode!r} is not a mode: set it to one of {', '.join(MODES)} "
                         f"(or unset it, or 0, for SGLang's own allocators)")
    return mode


def plugin():
    """Installs swa_ext's allocators in this SGLang process as SWA_EXT_SGLANG says."""
    mode = mode_from_environment()
    if mode is None:
        return
    from . import sglang

    sglang.install(single_pool=mode in ("all", "lockstep"), lockstep=mode == "lockstep", shared=mode == "shared")
